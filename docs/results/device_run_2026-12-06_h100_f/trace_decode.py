"""Phase trace of the expert decode step's dispatch kernel (a tree built with
the rc_tr printf patch): warm calls, then the traced ones, at cap 8 and 4096."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch
from _harness.kernel_cases import one_rank, ep_inputs, Cases, GPU_SHAPES

rank = one_rank("cuda")
cases = Cases(rank, GPU_SHAPES)
for key in ("dc_expert_decode", "dc_expert_decode_bigcap"):
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
