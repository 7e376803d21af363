#!/usr/bin/env python3
"""all_reduce + residual add + RMSNorm (the tensor-parallel step after a
row-parallel layer), bf16: rdna4_comm.all_reduce_rmsnorm against the same
three steps unfused, over torch.distributed.all_reduce (NCCL/RCCL on GPUs,
gloo on CPU processes) and over rdna4_comm's own all_reduce.

Sweep: tokens {1, 8, 32, 128, 512, 2048} x hidden {2048, 2880, 4096, 7168,
8192}. Every result is checked before it is timed (residual_out bitwise
against rdna4_comm.reference, out within the op's contract); see
benchmarks/_common.py for the results file, the summary and the heatmap.

    python benchmarks/bench_fused.py                  # every GPU, or 2 CPU processes
    python benchmarks/bench_fused.py --quick --transport cpu
"""
import sys

import _common
import torch

from rdna4_comm import Communicator
from rdna4_comm._bench.cases import fused_ops, record
from rdna4_comm._timing import measure

TOKENS = (1, 8, 32, 128, 512, 2048)
HIDDEN = (2048, 2880, 4096, 7168, 8192)
FULL = [(t, h) for t in TOKENS for h in HIDDEN]
QUICK = [(t, h) for t in (1, 32, 512) for h in (2048, 7168)]


def worker(ctx, configs, rounds, samples) -> None:
    """One rank's sweep: one communicator serves every size."""
    with Communicator(ctx.cpu_group, transport=ctx.transport) as comm:
        for tokens, hidden in configs:
            ops = fused_ops(ctx, comm, tokens, hidden)
            stats = measure(ctx, ops, rounds=rounds, samples=samples)
            ctx.emit(record("all_reduce_rmsnorm", tokens, hidden, torch.bfloat16, ops, stats))
            del ops
            ctx.release()


if __name__ == "__main__":
    sys.exit(_common.main("bench_fused", __doc__, FULL, QUICK, worker))
