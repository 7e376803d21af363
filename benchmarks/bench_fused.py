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
import torch.distributed as dist

from rdna4_comm import Communicator, reference
from rdna4_comm._bench.cases import EP_BITS, record
from rdna4_comm._checks import assert_same, pattern
from rdna4_comm._ranks import RankContext
from rdna4_comm._timing import Op, measure

TOKENS = (1, 8, 32, 128, 512, 2048)
HIDDEN = (2048, 2880, 4096, 7168, 8192)
FULL = [(t, h) for t in TOKENS for h in HIDDEN]
QUICK = [(t, h) for t in (1, 32, 512) for h in (2048, 7168)]

FUSED_EPS = 1e-6


def fused_ops(ctx: RankContext, comm: Communicator, tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> list[Op]:
    """all_reduce + residual add + RMSNorm of [tokens, hidden] partial sums:
    rdna4_comm.all_reduce_rmsnorm against the same three steps unfused, once
    over torch.distributed.all_reduce (in place) and once over rdna4_comm's
    all_reduce. residual_out is checked bitwise (the inputs' sums are exact),
    out against the contract."""
    dev = ctx.device
    xs = [pattern(r, tokens, hidden, dtype, dev, bits=EP_BITS) for r in range(ctx.world)]
    x = xs[ctx.rank]
    residual = pattern(ctx.world, tokens, hidden, dtype, dev, bits=EP_BITS)
    weight = pattern(ctx.world + 1, 1, hidden, dtype, dev, bits=EP_BITS).reshape(hidden)
    _, expected_residual = reference.all_reduce_rmsnorm([t.cpu() for t in xs], residual.cpu(), weight.cpu(), FUSED_EPS)
    del xs
    what = f"all_reduce_rmsnorm [{tokens}, {hidden}] {str(dtype).replace('torch.', '')}"

    def check(result):
        out, residual_out = result
        assert_same(residual_out, expected_residual, f"{what} residual_out vs rdna4_comm.reference")
        reference.assert_rmsnorm_within_contract(out, residual_out, weight, FUSED_EPS, what)

    def unfused(summed):
        r = summed + residual
        return reference.rms_norm(r, weight, FUSED_EPS), r

    inplace = torch.empty_like(x)

    def torch_composition():
        dist.all_reduce(inplace, group=ctx.group)
        return unfused(inplace)

    return [
        Op("rdna4_comm", lambda: comm.all_reduce_rmsnorm(x, residual, weight, FUSED_EPS), check,
           detail="rdna4_comm.all_reduce_rmsnorm (fused)"),
        Op("rdna4_comm_unfused", lambda: unfused(comm.all_reduce(x)), check,
           detail="rdna4_comm.all_reduce + add + RMSNorm in torch ops"),
        Op(ctx.baseline, torch_composition, check, reset=lambda: inplace.copy_(x),
           detail=f"torch.distributed.all_reduce ({ctx.baseline}, in place) + add + RMSNorm in torch ops"),
    ]


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
