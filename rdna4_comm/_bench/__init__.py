"""What the benchmarks (benchmarks/) and the demo (``python -m rdna4_comm.demo``)
share, package-internal:

- :mod:`.world`: the world they run in (:func:`~.world.resolve_world`,
  :func:`~.world.launch`; each rank's context is rdna4_comm._ranks'
  RankContext, the one-process world of benchmarks/bench_kernels.py
  rdna4_comm._ranks.one_rank);
- :mod:`.cases`: the ops timed, rdna4_comm next to torch.distributed;
- :mod:`.report`: tables, the speedup summary and heatmaps;
- for benchmarks/bench_kernels.py (one GPU, rdna4_comm's kernels against a
  copy of the same bytes): :mod:`.kernel_cases`, the ops of its rows and
  their checks; :mod:`.profiling`, device time per call from torch.profiler,
  graph replays and host time (:class:`~.profiling.Timer`); :mod:`.ncu`,
  running Nsight Compute and reading its report.

What the doctor and the tests use too lives outside this package: how an op
is checked and timed (rdna4_comm._timing), exactly checkable inputs and
bitwise checks (rdna4_comm._checks), the rank context (rdna4_comm._ranks).
"""
