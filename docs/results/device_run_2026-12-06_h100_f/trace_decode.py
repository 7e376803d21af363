"""Phase trace of bench_kernels ops (a tree built with a trace patch:
rc_tr printfs): 5 warm calls of each, then 3 traced. The ops are
kernel_cases keys, by default the expert decode steps at cap 8 and 4096
(rows 10-11, with trace.patch); `dispatch combine` traces rows 1-2 (with
../device_run_2026-12-07_h100_d/trace_t4096.patch). Run from the traced
tree's root."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import torch
from _harness.kernel_cases import one_rank, Cases, GPU_SHAPES

rank = one_rank("cuda")
cases = Cases(rank, GPU_SHAPES)
for key in sys.argv[1:] or ("dc_expert_decode", "dc_expert_decode_bigcap"):
    op = cases.ops[key]
    for _ in range(5):
        op.run()
    torch.cuda.synchronize()
    print(f"=== {key}: 3 traced calls", flush=True)
    for _ in range(3):
        op.run()
        torch.cuda.synchronize()
    print(f"=== end {key}", flush=True)
cases.close()
rank.close()
