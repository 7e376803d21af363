"""How the benchmarks, the demo and the doctor time an op (:func:`measure`)
and print results (:func:`format_table`).

Every op is checked before it is timed. A sample is one call on every rank
(GPU: one CUDA-graph replay timed with CUDA events; CPU: one eager call timed
with ``perf_counter``), and its value is the max over ranks, so a sample is
as slow as the slowest rank. The result is p50/p10/p90 over rounds x samples,
with the order of the backends reversed every other round so that no backend
always runs first.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ._ranks import CheckFailed, RankContext
from .transport_policy import TRANSPORT_RECORDS

# Eager calls before a CUDA graph is captured (NCCL and lazy inits happen here).
GPU_WARMUP_CALLS = 3


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


def _block(ctx: RankContext, clock, runner, samples: int) -> list[float]:
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


def measure(ctx: RankContext, ops: Sequence[Op], *, rounds: int, samples: int) -> dict[str, Stats]:
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
    clock = _GpuClock() if TRANSPORT_RECORDS[ctx.transport].device_kernels else _CpuClock()
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
