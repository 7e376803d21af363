"""The world the benchmarks and the demo run in: one process per GPU
(transport "gpu", or "dist" where the GPUs lack peer access) or plain CPU
processes (transport "cpu"), each with its process groups set up
(rdna4_comm._ranks.bench_rank); rank 0 streams
messages back to the launching process."""
from __future__ import annotations

import os
import platform
from typing import Any, Callable, Optional

import torch

from .. import _C
from .._launch import ProcessWorld
from .._ranks import RankContext, bench_rank, runs_on_gpus, usable_gpus
from ..transport_policy import TRANSPORT_RECORDS, TRANSPORTS, choose_transport, device_report


def resolve_world(transport: str = "auto", world: Optional[int] = None) -> tuple[str, int]:
    """(transport, world size) for a launch. "auto" means what it means to a
    Communicator: the library's choice (choose_transport) for the ranks of the
    world, one process per usable GPU where there are at least 2 (so "gpu",
    or "dist" without peer access), else 2 CPU processes ("cpu"). "dist" runs
    on the GPUs where there are any, else on CPU processes. ``world``
    overrides the size."""
    gpus = usable_gpus()
    if transport == "auto":
        reports = [device_report(d) for d in range(gpus)] if gpus >= 2 else [device_report(None)] * 2
        transport = choose_transport("auto", reports, with_gpu=bool(_C.with_gpu), allow_shared_gpu=False).transport
    if transport not in TRANSPORT_RECORDS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if runs_on_gpus(transport):
        if gpus == 0:
            raise ValueError(
                f"transport {transport!r} needs GPUs and a GPU build of rdna4_comm "
                f"(torch.cuda.is_available()={torch.cuda.is_available()}, rdna4_comm GPU support={_C.with_gpu})"
            )
        world = gpus if world is None else world
        if not 1 <= world <= gpus:
            raise ValueError(f"--world {world}: {gpus} usable GPU(s) here, one process per GPU")
    else:
        world = 2 if world is None else world
        if not 1 <= world <= _C.max_world:
            raise ValueError(f"--world {world}: {transport!r} on CPUs takes 1..{_C.max_world} processes")
    return transport, world


def launch(
    target: Callable[..., None],
    args: tuple = (),
    *,
    transport: str,
    world: int,
    on_message: Callable[[Any], None] = print,
) -> None:
    """Run ``target(ctx, *args)`` on every rank of a new world of ``world``
    processes (``target`` importable; ``ctx`` its RankContext, from
    bench_rank) and wait for them.

    What rank 0 emits (``RankContext.emit``) reaches ``on_message`` here, in
    order, while the world runs. Raises :class:`~rdna4_comm._launch.WorldFailed`
    with the traceback of every rank that raised or died; the world is then
    killed.
    """
    with ProcessWorld(world, bench_rank, (transport,)) as ranks:
        ranks.call(target, {r: args for r in range(world)}, on_message=on_message)


def describe(ctx: RankContext) -> dict:
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
    if TRANSPORT_RECORDS[ctx.transport].device_kernels:
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
