"""What the benchmarks (benchmarks/) and the demo (``python -m rdna4_comm.demo``)
share, package-internal:

- :mod:`.world`: the world they run in (:func:`~.world.resolve_world`,
  :func:`~.world.launch`, the per-rank :class:`~.world.BenchRank`; the
  one-process :class:`~.world.OneRank` of benchmarks/bench_kernels.py);
- :mod:`.timing`: how an op is checked and timed (:func:`~.timing.measure`);
- :mod:`.cases`: the ops timed, rdna4_comm next to torch.distributed;
- :mod:`.checks`: exactly checkable inputs and bitwise checks (the tests use
  them too);
- :mod:`.report`: tables, the speedup summary and heatmaps;
- for benchmarks/bench_kernels.py (one GPU, rdna4_comm's kernels against a
  copy of the same bytes): :mod:`.kernel_cases`, the ops of its rows and
  their checks; :mod:`.profiling`, device time per call from torch.profiler,
  graph replays and host time (:class:`~.profiling.Timer`); :mod:`.ncu`,
  running Nsight Compute and reading its report.
"""
