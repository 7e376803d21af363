#!/usr/bin/env python3
"""MoE expert-parallel communication: rdna4_comm dispatch + combine against
the vLLM allgather_reducescatter path in torch.distributed (all_gather of the
hidden states and the routing, reduce_scatter of the [W*T, H] result; NCCL/RCCL
on GPUs, gloo on CPU processes).

Sweep: hidden {2048, 3072, 4096, 5120, 7168, 8192} x tokens per rank {8, 32,
64, 128, 256, 512, 1024, 4096, 8192, 16384}; top-8 of 256 experts, distinct
and uniform per token; bf16; fp32 routing weights; capacity = tokens (one
communicator per configuration). No expert step is timed: combine gets the
dispatched rows unchanged, and the baseline reduce-scatters the gathered hidden
states. Both are checked before timing (rdna4_comm against
rdna4_comm.reference; see rdna4_comm._bench.cases.ep_ops).
See benchmarks/_common.py for the results file.

    python benchmarks/bench_ep.py                  # every GPU, or 2 CPU processes
    python benchmarks/bench_ep.py --quick --transport cpu
    python benchmarks/bench_ep.py --hidden 7168 --tokens 8 128 --out r.jsonl
"""
import sys

import _common
import torch

from rdna4_comm import Communicator
from rdna4_comm._bench.cases import EP_EXPERTS, EP_TOPK, ep_ops, record
from rdna4_comm._bench.timing import measure

HIDDEN = (2048, 3072, 4096, 5120, 7168, 8192)
TOKENS = (8, 32, 64, 128, 256, 512, 1024, 4096, 8192, 16384)
FULL = [(t, h) for h in HIDDEN for t in TOKENS]
QUICK = [(t, h) for h in (256, 512) for t in (8, 32, 128)]
DTYPE = torch.bfloat16


def worker(ctx, configs, rounds, samples) -> None:
    """One rank's sweep: per configuration, a communicator with capacity =
    tokens, the check and timing of both backends, the record; everything
    freed before the next configuration (the large ones take GiBs)."""
    for tokens, hidden in configs:
        with Communicator(ctx.cpu_group, max_tokens_per_rank=tokens, hidden=hidden, topk=EP_TOPK,
                          num_experts=EP_EXPERTS, dtype=DTYPE, transport=ctx.transport) as comm:
            ops = ep_ops(ctx, comm, tokens)
            stats = measure(ctx, ops, rounds=rounds, samples=samples)
            ctx.emit(record("dispatch+combine", tokens, hidden, DTYPE, ops, stats))
            del ops
        ctx.release()


if __name__ == "__main__":
    sys.exit(_common.main("bench_ep", __doc__, FULL, QUICK, worker))
