"""What the benchmarks (benchmarks/) and the demo (``python -m rdna4_comm.demo``)
share, package-internal:

- :mod:`.world`: the world they run in (:func:`~.world.resolve_world`,
  :func:`~.world.launch`; each rank's context is rdna4_comm._ranks'
  RankContext);
- :mod:`.cases`: the ops timed, rdna4_comm next to torch.distributed, the
  record of a measured configuration and rdna4_comm's speedup in it;
- :mod:`.disagreeing_calls`: the ranks' calls that disagree, case by case
  (benchmarks/bench_call_mismatch.py; tests/test_calls_agree.py too).

What only the benchmarks use lives beside them, in benchmarks/_harness/
(reports and heatmaps; bench_kernels.py's world of one process, cases,
profiling and Nsight Compute). What the doctor and the tests use too lives outside this package:
how an op is checked and timed (rdna4_comm._timing), exactly checkable
inputs and bitwise checks (rdna4_comm._checks), the rank context
(rdna4_comm._ranks).
"""
