"""Phase trace of bench_kernels rows 1-2 (dispatch and combine of T = 4096,
H = 7168 on one GPU) in a tree built with trace_t4096.patch: 5 warm calls
of each, then 3 traced; every block prints one `TR` line a call (cycles
from the block's start to each phase's end, a barrier before each
reading). Run from the traced tree's root: python3 <this file>."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import torch  # noqa: E402
from _harness.kernel_cases import GPU_SHAPES, Cases, one_rank  # noqa: E402

rank = one_rank("cuda")
cases = Cases(rank, GPU_SHAPES)
for key in ("dispatch", "combine"):
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
