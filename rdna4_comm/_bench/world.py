"""The world the benchmarks and the demo run in: one process per GPU
(transport "gpu") or plain CPU processes (transport "cpu"), each with its
process groups set up (:class:`BenchRank`); rank 0 streams messages back to
the launching process. Or a world of one process, the calling one
(:class:`OneRank`, for benchmarks/bench_kernels.py)."""
from __future__ import annotations

import gc
import os
import platform
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import _C
from .._launch import Member, ProcessWorld, free_port


class CheckFailed(AssertionError):
    """A result check failed on at least one rank (raised on every rank)."""


def usable_gpus() -> int:
    """GPUs the GPU transport can use here: 0 unless rdna4_comm was built with
    GPU support and torch sees GPUs."""
    if not (_C.with_gpu and torch.cuda.is_available()):
        return 0
    return min(torch.cuda.device_count(), _C.max_gpu_world)


def resolve_world(transport: str = "auto", world: Optional[int] = None) -> tuple[str, int]:
    """(transport, world size) for a launch. "auto": one process per GPU when at
    least 2 GPUs are usable, else 2 CPU processes. ``world`` overrides the size."""
    gpus = usable_gpus()
    if transport == "auto":
        transport = "gpu" if gpus >= 2 else "cpu"
    if transport == "gpu":
        if gpus == 0:
            raise ValueError(
                "transport 'gpu' needs GPUs and a GPU build of rdna4_comm "
                f"(torch.cuda.is_available()={torch.cuda.is_available()}, rdna4_comm GPU support={_C.with_gpu})"
            )
        world = gpus if world is None else world
        if not 1 <= world <= gpus:
            raise ValueError(f"--world {world}: {gpus} usable GPU(s) here, one process per GPU")
    elif transport == "cpu":
        world = 2 if world is None else world
        if not 1 <= world <= _C.max_world:
            raise ValueError(f"--world {world}: the CPU transport takes 1..{_C.max_world} processes")
    else:
        raise ValueError(f"transport must be 'auto', 'gpu' or 'cpu', got {transport!r}")
    return transport, world


class BenchRank:
    """One rank of a benchmark or demo world.

    - ``group``: where the torch.distributed baselines run: NCCL (RCCL on ROCm)
      over the GPUs, gloo over CPU processes.
    - ``cpu_group``: gloo; bootstraps Communicators and carries barriers, check
      verdicts and timings, so none of that touches the GPU being measured.
    """

    def __init__(self, member: Member, transport: str):
        self.rank, self.world, self.transport = member.rank, member.world, transport
        self._member = member
        # The CPU reference checks are the only heavy host work; share the cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
        init = dict(init_method=member.init_method, rank=self.rank, world_size=self.world)
        if transport == "gpu":
            self.device = torch.device("cuda", self.rank)
            torch.cuda.set_device(self.device)
            # device_id makes NCCL set up its communicator now, not inside a capture.
            dist.init_process_group("nccl", device_id=self.device, **init)
            self.cpu_group = dist.new_group(backend="gloo")
            self.group = dist.group.WORLD
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", **init)
            self.group = self.cpu_group = dist.group.WORLD

    @property
    def baseline(self) -> str:
        """Name of the torch.distributed backend of ``group``: nccl, rccl or gloo."""
        name = str(dist.get_backend(self.group))
        return "rccl" if name == "nccl" and torch.version.hip else name

    def emit(self, obj: Any) -> None:
        """Send ``obj`` (picklable) to the launching process. Only rank 0 sends;
        on other ranks this does nothing, so callers need not branch on rank."""
        if self.rank == 0:
            self._member.tell(obj)

    def note(self, text: str) -> None:
        """Emit a note for the launching process to print."""
        self.emit({"note": text})

    def errors(self, error: Optional[str]) -> list[str]:
        """Collective: every rank passes its error (or None) and gets all of
        them, as "rank r: error" lines; so all ranks take the same branch."""
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self.cpu_group)
        return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]

    def agree(self, error: Optional[str], what: str) -> None:
        """Collective: raise :class:`CheckFailed` on every rank if any rank
        passes an error, so that no rank is left waiting in a later collective."""
        bad = self.errors(error)
        if bad:
            raise CheckFailed(f"{what}:\n" + "\n".join(bad))

    def release(self) -> None:
        """Return freed memory (GPU: to the driver) between configurations."""
        gc.collect()
        if self.transport == "gpu":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Wait for the GPU's queued work, then leave the process groups."""
        if self.transport == "gpu":
            torch.cuda.synchronize(self.device)
        dist.destroy_process_group()


class OneRank:
    """A world of one process, this one: a gloo group on 127.0.0.1 (rank 0
    of 1) that bootstraps the communicators; ``device`` "cuda": transport
    "gpu" on cuda:0, "cpu": transport "cpu". Has what :func:`describe` reads."""

    rank, world, baseline = 0, 1, "torch"

    def __init__(self, device: str):
        self.transport = "gpu" if device == "cuda" else "cpu"
        if device == "cuda":
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            # The CPU transport does its copies on the calling thread; torch's
            # baselines run on one thread too (torch's thread pool also costs
            # milliseconds per op on small, loaded machines).
            torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    def sync(self) -> None:
        """Wait for the GPU's queued work (CPU: nothing to wait for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Wait for the GPU's queued work, then leave the process group."""
        self.sync()
        dist.destroy_process_group()


def launch(
    target: Callable[..., None],
    args: tuple = (),
    *,
    transport: str,
    world: int,
    on_message: Callable[[Any], None] = print,
) -> None:
    """Run ``target(ctx, *args)`` on every rank of a new world of ``world``
    processes (``target`` importable; ``ctx`` its :class:`BenchRank`) and wait
    for them.

    What rank 0 emits (:meth:`BenchRank.emit`) reaches ``on_message`` here, in
    order, while the world runs. Raises :class:`~rdna4_comm._launch.WorldFailed`
    with the traceback of every rank that raised or died; the world is then
    killed.
    """
    with ProcessWorld(world, BenchRank, (transport,)) as ranks:
        ranks.call(target, {r: args for r in range(world)}, on_message=on_message)


def describe(ctx: BenchRank) -> dict:
    """Versions and hardware of this run, for result headers."""
    import rdna4_comm

    info = {
        "versions": {
            "torch": torch.__version__,
            "rdna4_comm": rdna4_comm.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
        },
        "world_size": ctx.world,
        "transport": ctx.transport,
        "baseline_backend": ctx.baseline,
        "rdna4_comm_gpu_support": bool(_C.with_gpu),
    }
    if ctx.transport == "gpu":
        info["device"] = torch.cuda.get_device_name(ctx.device)
        nccl = torch.cuda.nccl.version()  # a tuple; an int in old torch versions
        info["versions"]["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        info["device"] = cpu_model()
        info["cpu_cores"] = os.cpu_count()
    return info


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
