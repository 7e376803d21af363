"""What only the benchmarks use, beside them rather than in the installed
package (what they share with the demo is rdna4_comm._bench):

- :mod:`.report`: the side-by-side table, the speedup summary and heatmaps
  (benchmarks/_common.py);
- for bench_kernels.py (one GPU, rdna4_comm's kernels against a copy of
  the same bytes): :mod:`.kernel_cases`, its world of one process and
  the ops of its rows with their checks; :mod:`.profiling`, device time per call from torch.profiler,
  graph replays and host time (:class:`~.profiling.Timer`); :mod:`.ncu`,
  running Nsight Compute and reading its report.

The scripts import it as ``_harness`` (their own folder is first on
sys.path when run as ``python benchmarks/<script>.py``).
"""
