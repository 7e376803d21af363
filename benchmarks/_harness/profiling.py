"""Where the device time of an op goes, on one device: :class:`Timer` and
:func:`attribute_device_events`; used by benchmarks/bench_kernels.py.

- Device time (GPU): torch.profiler (CPU + CUDA activities), each call in a
  record_function range named ``ANNOTATION + "<op>#<call>"`` followed by a
  device synchronisation; a call's time is the sum of the durations of the
  device activities (kernels, memcpys, memsets) launched inside its range
  (the launching ops found through the profiler's correlation ids, else by
  time). On CPUs: the wall clock of each call (``time.perf_counter``).
- Graph replay (GPU): each op captured in a torch.cuda.CUDAGraph
  (rdna4_comm._timing's clock: eager warm-up on a side stream first),
  each replay between CUDA events.
- Host time: ``time.perf_counter`` around a block of back-to-back eager
  calls, no synchronisation inside it; the block's time / calls. On the GPU
  the device is kept busy: a ``torch.cuda._sleep`` kernel queued ahead of the
  block outlasts it (checked with an event after the sleep that must still be
  pending when the block ends; else the block is retried with a longer
  sleep), so no call waits for the GPU and the time is the Python call
  returning, not the kernels.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from rdna4_comm._ranks import RankContext
from rdna4_comm._timing import _GpuClock

from .ncu import function_base

# The prefix of the record_function ranges Timer opens around each call.
ANNOTATION = "rdna4_comm/bench_kernels:"
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")

# Host-time blocks on the GPU: the sleep kernel queued ahead of a block, its
# first length and the longest before giving up (ms).
BUSY_MS_START, BUSY_MS_MAX = 20.0, 2000.0


def _kind(event) -> str:
    """The activity of a device event: "kernel", "gpu_memcpy", "gpu_memset" or another."""
    kind = getattr(event, "activity_type", None)
    if kind:
        return str(kind)
    return "gpu_memcpy" if event.name.startswith("Memcpy") else "gpu_memset" if event.name.startswith("Memset") \
        else "kernel"


def attribute_device_events(events, annotation: str = ANNOTATION) -> dict[str, list[tuple[str, str, float]]]:
    """Group a profile's device activities by the record_function range that
    launched them: {range name without ``annotation``: [(name, kind, us), ...]
    in start order}. Ranges without device work map to []. A device event
    belongs to the range above the CPU op its linked correlation id names;
    one without such a link, to the range it starts in (ranges are sorted by
    start, each ending where the next begins). Raises where an event is left."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    ranges = sorted((e for e in cpu if e.name.startswith(annotation)), key=lambda e: e.time_range.start)
    by_id = {e.id: e for e in cpu if not getattr(e, "linked_correlation_id", 0)}
    out: dict[str, list] = {r.name[len(annotation):]: [] for r in ranges}
    starts = [r.time_range.start for r in ranges]
    device = [e for e in events if e.device_type != DeviceType.CPU and not e.name.startswith(annotation)
              and _kind(e) in DEVICE_ACTIVITIES]
    for e in sorted(device, key=lambda e: e.time_range.start):
        linked = getattr(e, "linked_correlation_id", 0)
        owner = by_id.get(linked) if linked > 0 else None
        while owner is not None and not owner.name.startswith(annotation):
            owner = owner.cpu_parent
        if owner is None:  # no correlation: by time
            i = max((k for k, s in enumerate(starts) if s <= e.time_range.start), default=None)
            owner = ranges[i] if i is not None else None
        if owner is None:
            raise RuntimeError(f"device activity {e.name!r} at {e.time_range.start} us is in no timed call")
        out[owner.name[len(annotation):]].append((e.name, _kind(e), e.time_range.end - e.time_range.start))
    return out


class Timer:
    """Device and host times of ops on ``rank``'s device (see the module
    docstring); ``rank`` has ``device`` (a torch.device) and ``sync()`` (e.g.
    a world of one: :func:`.kernel_cases.one_rank`). An op is a callable that
    takes no argument; its result is not read, except by :meth:`graph_times`."""

    def __init__(self, rank: RankContext):
        self.rank = rank
        self.gpu = rank.device.type == "cuda"
        self.kernels: dict[str, list] = {}  # per op: its calls' [(name, kind, us)] on the GPU
        self._busy_cycles = None

    # device time -------------------------------------------------------
    def device_times(self, fns: dict[str, Callable], order: list[str], calls: int) -> dict[str, list[float]]:
        """``calls`` calls of every op of ``order`` (interleaved: one of each,
        in that order, per step); per op, every call's device time in us."""
        if not self.gpu:
            values: dict[str, list[float]] = {k: [] for k in order}
            for _ in range(calls):
                for key in order:
                    t0 = time.perf_counter()
                    fns[key]()
                    values[key].append((time.perf_counter() - t0) * 1e6)
            return values
        from torch.profiler import ProfilerActivity, profile, record_function

        self.rank.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                for key in order:
                    with record_function(f"{ANNOTATION}{key}#{i}"):
                        fns[key]()
                    torch.cuda.synchronize()
        per_call = attribute_device_events(prof.events())
        values = {k: [] for k in order}
        for i in range(calls):
            for key in order:
                acts = per_call.get(f"{key}#{i}")
                if not acts:
                    raise RuntimeError(f"torch.profiler saw no device activity for call {i} of {key}")
                values[key].append(sum(us for _, _, us in acts))
                self.kernels.setdefault(key, []).append(acts)
        return values

    def kernel_names(self, fns: dict[str, Callable], order: list[str]) -> dict[str, list[str]]:
        """Per op, the names of the kernels (not memcpys or memsets) one call launches, in order (GPU)."""
        for key in order:  # first calls (lazy module loading, the allocator) outside the profile
            fns[key]()
        self.rank.sync()
        self.device_times(fns, order, 1)
        return {k: [name for name, kind, _ in self.kernels[k][-1] if kind == "kernel"] for k in order}

    def breakdown(self, key: str) -> list[tuple[str, str, float]]:
        """Op ``key``'s device activities, each with its p50 over the calls
        where the calls launched the same sequence (GPU)."""
        calls = self.kernels.get(key, [])
        if not calls:
            return []
        shape = [(n, k) for n, k, _ in calls[-1]]
        same = [c for c in calls if [(n, k) for n, k, _ in c] == shape]
        return [(n, k, statistics.median(c[i][2] for c in same)) for i, (n, k) in enumerate(shape)]

    def breakdown_table(self, keys) -> str:
        """A line per op of ``keys``: its device activities with their p50 (GPU)."""
        lines = []
        for key in keys:
            parts = [f"{function_base(n) or n} ({k}) {us:.1f} us" for n, k, us in self.breakdown(key)]
            lines.append(f"  {key}: " + (", ".join(parts) if parts else "-"))
        return "\n".join(lines)

    # graph replay --------------------------------------------------------
    def graph_times(self, ops: dict[str, Any], order: list[str], rounds: int, calls: int) -> dict[str, list[float]]:
        """Each op of ``order`` (an object with ``run()``, capturable, and
        ``check(result)``, which raises when the result is wrong) captured in a
        CUDA graph, its replayed result checked, then ``rounds`` x ``calls``
        replays each between CUDA events: per op, every replay's time in us."""
        clock = _GpuClock()
        try:
            replays = {}
            for key in order:
                replays[key] = clock.prepare(ops[key].run)
                out = replays[key]()
                clock.sync()
                ops[key].check(out)
            values: dict[str, list[float]] = {k: [] for k in order}
            for r in range(rounds):
                for key in order if r % 2 == 0 else order[::-1]:
                    clock.sync()
                    clock.begin(calls)
                    marks = []
                    for _ in range(calls):
                        start = clock.mark()
                        replays[key]()
                        marks.append((start, clock.mark()))
                    clock.sync()
                    values[key] += [clock.elapsed_us(a, b) for a, b in marks]
            return values
        finally:
            clock.close()
            self.rank.sync()

    # host time ------------------------------------------------------------
    def host_block_us(self, fn: Callable, calls: int) -> float:
        """Host time per call (us) of ``calls`` back-to-back eager calls of ``fn``."""
        if not self.gpu:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) / calls * 1e6
        if self._busy_cycles is None:
            self._busy_cycles = self._cycles_for_ms(BUSY_MS_START)
        while True:
            torch.cuda.synchronize()
            torch.cuda._sleep(self._busy_cycles)
            guard = torch.cuda.Event()
            guard.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            held = not guard.query()  # the sleep still runs: no call waited for the GPU
            torch.cuda.synchronize()
            if held:
                return (t1 - t0) / calls * 1e6
            if self._busy_cycles >= self._cycles_for_ms(BUSY_MS_MAX):
                raise RuntimeError(f"a {BUSY_MS_MAX:.0f} ms sleep kernel did not outlast {calls} eager calls: "
                                   "the host waited for the GPU (launch queue full?); use fewer --host-calls")
            self._busy_cycles *= 2

    def _cycles_for_ms(self, ms: float) -> int:
        if not hasattr(self, "_cycles_per_ms"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            torch.cuda.synchronize()
            self._cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
        return int(self._cycles_per_ms * ms)
