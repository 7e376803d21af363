"""What the benchmarks (benchmarks/) and the demo (``python -m rdna4_comm.demo``)
share, package-internal:

- :mod:`.world`: the world they run in (:func:`~.world.resolve_world`,
  :func:`~.world.launch`, the per-rank :class:`~.world.BenchRank`);
- :mod:`.timing`: how an op is checked and timed (:func:`~.timing.measure`);
- :mod:`.cases`: the ops timed, rdna4_comm next to torch.distributed;
- :mod:`.checks`: exactly checkable inputs and bitwise checks (the tests use
  them too);
- :mod:`.report`: tables, the speedup summary and heatmaps.
"""
