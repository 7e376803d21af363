"""Measurement machinery shared by the benchmarks and the demo (package-internal).

- :func:`resolve_world` and :func:`launch`: a world of W processes, one per GPU
  (transport "gpu") or plain CPU processes (transport "cpu"), each with its
  process groups set up (:class:`Ctx`); rank 0 streams messages back to the
  launching process.
- :func:`measure`: the timing primitive of DESIGN.md section 9. Every op is
  checked before it is timed; a sample is one call (GPU: one CUDA-graph replay
  timed with CUDA events; CPU: one eager call timed with ``perf_counter``), its
  value the max over ranks; the result is p50/p10/p90 over rounds x samples,
  with the order of the backends reversed every other round.
- :func:`comparison_table`: the side-by-side table the demo and the benchmarks print.
"""
from __future__ import annotations

import gc
import math
import os
import platform
import queue as queue_mod
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _C

# Set in every process this module starts (children inherit the environment):
# NVLink SHARP / multicast stay off for NCCL and torch's symmetric memory.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Eager calls before a CUDA graph is captured (NCCL and lazy inits happen here).
GPU_WARMUP_CALLS = 3
# How long the launcher waits for a dead rank's last messages before calling it a crash.
CRASH_GRACE_S = 5.0


class WorldFailed(RuntimeError):
    """A rank of a launched world raised, or died."""


class CheckFailed(AssertionError):
    """A result check failed on at least one rank (raised on every rank)."""


# ----------------------------------------------------------------- the world


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


@dataclass
class Ctx:
    """One rank of a launched world.

    - ``group``: where the torch.distributed baselines run: NCCL (RCCL on ROCm)
      over the GPUs, gloo over CPU processes.
    - ``cpu_group``: gloo; bootstraps Communicators and carries barriers, check
      verdicts and timings, so none of that touches the GPU being measured.
    """

    rank: int
    world: int
    transport: str
    device: torch.device
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    _queue: Any

    @property
    def baseline(self) -> str:
        """Name of the torch.distributed backend of ``group``: nccl, rccl or gloo."""
        name = str(dist.get_backend(self.group))
        return "rccl" if name == "nccl" and torch.version.hip else name

    def emit(self, obj: Any) -> None:
        """Send ``obj`` (picklable) to the launching process. Only rank 0 sends;
        on other ranks this does nothing, so callers need not branch on rank."""
        if self.rank == 0:
            self._queue.put(("message", 0, obj))

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


def describe(ctx: Ctx) -> dict:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank: int, world: int, transport: str, port: int, queue) -> Ctx:
    # The CPU reference checks are the only heavy host work; share the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if transport == "gpu":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        # device_id makes NCCL set up its communicator now, not inside a capture.
        dist.init_process_group("nccl", device_id=device, **init)
        cpu_group = dist.new_group(backend="gloo")
        group = dist.group.WORLD
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **init)
        group = cpu_group = dist.group.WORLD
    return Ctx(rank, world, transport, device, group, cpu_group, queue)


def _entry(rank, world, transport, port, queue, target, args) -> None:
    try:
        ctx = _setup(rank, world, transport, port, queue)
        target(ctx, *args)
        if transport == "gpu":
            torch.cuda.synchronize()
        dist.destroy_process_group()
        status, payload = 0, ("done", rank, None)
    except BaseException:  # noqa: BLE001  (reported to the launcher)
        status, payload = 1, ("error", rank, traceback.format_exc())
    # Out of the except block the failed frames are gone; collecting now runs
    # the finalizers of communicators they held (unlinking shared memory).
    gc.collect()
    queue.put(payload)
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch loaded it takes seconds, and after
    # an error peers may still wait for this rank in a collective. Targets
    # close their communicators themselves.
    os._exit(status)


def launch(
    target: Callable[..., None],
    args: tuple = (),
    *,
    transport: str,
    world: int,
    on_message: Callable[[Any], None] = print,
) -> None:
    """Run ``target(ctx, *args)`` on every rank of a new world of ``world``
    processes (spawned; ``target`` must be importable) and wait for them.

    What rank 0 emits (:meth:`Ctx.emit`) reaches ``on_message`` here, in order,
    while the world runs. Raises :class:`WorldFailed` with the traceback of the
    first rank that raised or died; the other ranks are then terminated.
    """
    os.environ.update(ENV)
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    port = _free_port()
    procs = [
        spawn.Process(target=_entry, args=(r, world, transport, port, queue, target, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        _supervise(procs, queue, on_message)
    finally:
        for p in procs:
            p.join(timeout=10 if p.is_alive() else None)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _supervise(procs, queue, on_message) -> None:
    done: set[int] = set()
    crash_deadline = None
    while len(done) < len(procs):
        try:
            kind, rank, payload = queue.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
            if dead:
                crash_deadline = crash_deadline or time.monotonic() + CRASH_GRACE_S
                if time.monotonic() > crash_deadline:
                    r = dead[0]
                    raise WorldFailed(f"rank {r} exited with code {procs[r].exitcode} without reporting an error")
            continue
        if kind == "message":
            on_message(payload)
        elif kind == "done":
            done.add(rank)
        else:
            # A rank that died first is the likelier cause of this one's error.
            dead = [f"rank {r} had exited with code {p.exitcode}" for r, p in enumerate(procs)
                    if r not in done and r != rank and p.exitcode not in (None, 0)]
            for r, p in enumerate(procs):
                if r != rank and p.is_alive():
                    p.terminate()  # it would wait for the failed rank until a timeout
            raise WorldFailed(f"rank {rank} failed" + (f" ({'; '.join(dead)})" if dead else "") + f":\n{payload}")


# ------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Op:
    """One backend's op sequence for one configuration.

    - ``run``: the ops on fixed inputs; returns what ``check`` reads. On GPUs it
      is captured in a CUDA graph, so it must only launch work on the current
      stream (no host sync, no data-dependent Python).
    - ``check``: raises (AssertionError) when ``run``'s result is wrong.
    - ``reset``: restores inputs that ``run`` changes in place, before the
      checked call.
    - ``detail``: what exactly is timed, for result records.
    - ``optional``: a failure to set up or check drops this backend with a note
      instead of failing the measurement.
    """

    backend: str
    run: Callable[[], Any]
    check: Callable[[Any], None]
    reset: Optional[Callable[[], None]] = None
    detail: str = ""
    optional: bool = False


@dataclass(frozen=True)
class Stats:
    """Per-sample times in microseconds (each the max over ranks): quantiles and count."""

    p50_us: float
    p10_us: float
    p90_us: float
    samples: int

    @classmethod
    def of(cls, values_us: Sequence[float]) -> "Stats":
        v = torch.tensor(values_us, dtype=torch.float64)
        p50, p10, p90 = torch.quantile(v, torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64)).tolist()
        return cls(p50, p10, p90, len(values_us))


class _CpuClock:
    """Eager calls timed with perf_counter on the host."""

    def prepare(self, run):
        return run

    def begin(self, samples: int) -> None:
        pass

    def sync(self) -> None:
        pass

    def mark(self):
        return time.perf_counter()

    def elapsed_us(self, start, end) -> float:
        return (end - start) * 1e6

    def close(self) -> None:
        pass


class _GpuClock:
    """CUDA-graph replays timed with CUDA events on the current stream."""

    def __init__(self):
        self.graphs: list = []

    def prepare(self, run):
        # torch requires warm-up on a side stream before capture; NCCL's lazy
        # setup and the caching allocator's first allocations happen here.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GPU_WARMUP_CALLS):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread keeps querying its events while
        # this thread captures; "global" mode would make those queries fail.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = run()
        self.graphs.append(graph)

        def replay():
            graph.replay()
            return out

        return replay

    def begin(self, samples: int) -> None:
        # Created up front: creating an event between a replay and its end mark
        # would be timed whenever the GPU outruns the host.
        self.events = iter([torch.cuda.Event(enable_timing=True) for _ in range(2 * samples)])

    def sync(self) -> None:
        torch.cuda.synchronize()

    def mark(self):
        event = next(self.events)
        event.record()
        return event

    def elapsed_us(self, start, end) -> float:
        return start.elapsed_time(end) * 1e3

    def close(self) -> None:
        self.graphs.clear()


def _block(ctx: Ctx, clock, runner, samples: int) -> list[float]:
    """``samples`` back-to-back calls of ``runner``, each timed on this rank (us)."""
    clock.sync()
    dist.barrier(group=ctx.cpu_group)
    runner()  # untimed: its collective lines the ranks up for the first sample
    clock.begin(samples)
    marks = []
    for _ in range(samples):
        start = clock.mark()
        runner()
        marks.append((start, clock.mark()))
    clock.sync()
    return [clock.elapsed_us(a, b) for a, b in marks]


def measure(ctx: Ctx, ops: Sequence[Op], *, rounds: int, samples: int) -> dict[str, Stats]:
    """Check, then time, each op of ``ops`` side by side. Collective.

    Each op is first prepared (GPU: warmed up eagerly on a side stream, then
    captured in a CUDA graph; CPU: nothing), reset, called once, and its result
    checked; a failed check raises :class:`CheckFailed` on every rank (an
    optional op is dropped with a note instead). Then ``rounds`` rounds each
    time ``samples`` calls of every op; ops run in the given order in even
    rounds and in reverse order in odd rounds, so that no backend always runs
    first. A sample is one call on every rank (GPU: one graph replay between
    CUDA events; CPU: one eager call under perf_counter); its value is the max
    over ranks.

    Returns, per backend that was timed, :class:`Stats` over the rounds x
    samples values (the same on every rank).
    """
    clock = _GpuClock() if ctx.transport == "gpu" else _CpuClock()
    try:
        runners = {}
        for op in ops:
            error = None
            try:
                runner = clock.prepare(op.run)
                if op.reset is not None:
                    op.reset()
                out = runner()
                clock.sync()
                op.check(out)
            except Exception as e:  # noqa: BLE001  (agreed on by all ranks below)
                error = f"{op.backend}: {type(e).__name__}: {e}"
            try:
                ctx.agree(error, f"check before timing ({op.backend})")
            except CheckFailed as e:
                if not op.optional:
                    raise
                ctx.note(f"{op.backend} skipped: {e}")
                continue
            runners[op.backend] = runner
        timed = [op for op in ops if op.backend in runners]
        values: dict[str, list[float]] = {op.backend: [] for op in timed}
        for r in range(rounds):
            for op in timed if r % 2 == 0 else timed[::-1]:
                local = torch.tensor(_block(ctx, clock, runners[op.backend], samples), dtype=torch.float64)
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
                values[op.backend] += local.tolist()
        return {b: Stats.of(v) for b, v in values.items()}
    finally:
        clock.close()


# -------------------------------------------------------------- reporting


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: numeric columns right-aligned, floats with 2 decimals
    below 100 and none above, NaN as "-"."""

    def cell(v) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [list(header)] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(header))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def comparison_table(records: Sequence[dict]) -> str:
    """One line per measured configuration: its shape, the p50 of rdna4_comm
    and, for every other backend, its p50 and the speedup of rdna4_comm over
    it (its p50 / rdna4_comm's p50; > 1 means rdna4_comm is faster).

    ``records``: dicts with "op", "tokens", "hidden", "bytes" and "stats"
    ({backend: Stats}).
    """
    others: list[str] = []
    for rec in records:
        others += [b for b in rec["stats"] if b != "rdna4_comm" and b not in others]
    header = ["op", "tokens", "hidden", "MiB/rank", "rdna4_comm p50 us"]
    for b in others:
        header += [f"{b} p50 us", f"x vs {b}"]
    rows = []
    for rec in records:
        stats = rec["stats"]
        ours = stats["rdna4_comm"].p50_us
        row = [rec["op"], rec["tokens"], rec["hidden"], rec["bytes"] / 2**20, ours]
        for b in others:
            theirs = stats[b].p50_us if b in stats else math.nan
            row += [theirs, theirs / ours]
        rows.append(row)
    return format_table(header, rows)
