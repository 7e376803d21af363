#!/usr/bin/env python3
"""fp32 all_reduce: rdna4_comm against torch.distributed.all_reduce (NCCL/RCCL
on GPUs, gloo on CPU processes), on CPU processes rdna4_comm's "dist"
transport too ("rdna4_comm_dist": its collectives over gloo) and, on GPUs
where torch has it, torch's symmetric-memory one-shot all_reduce
(torch.ops.symm_mem.one_shot_all_reduce).

Sweep: tokens {1, 8, 32, 128, 512, 2048} x hidden {2048, 4096, 8192}, plus
4096 and 8192 tokens where the tensor stays within 64 MiB (the grid's largest
cell, 2048 x 8192 fp32, is already 64 MiB). Every result is checked bitwise
against rdna4_comm.reference before it is timed; see
benchmarks/_common.py for the results file.

    python benchmarks/bench_allreduce.py                  # every GPU, or 2 CPU processes
    python benchmarks/bench_allreduce.py --quick --transport cpu
    python benchmarks/bench_allreduce.py --tokens 1 8 --hidden 8192 --out r.jsonl
"""
import sys
from contextlib import nullcontext

import _common
import torch

from rdna4_comm import Communicator
from rdna4_comm._bench.cases import SymmMemOneShot, allreduce_ops, record
from rdna4_comm._timing import measure

TOKENS = (1, 8, 32, 128, 512, 2048)
HIDDEN = (2048, 4096, 8192)
MAX_BYTES = 64 << 20
FULL = [(t, h) for t in TOKENS for h in HIDDEN] + [
    (t, h) for t in (4096, 8192) for h in HIDDEN if t * h * 4 <= MAX_BYTES
]
QUICK = [(t, h) for t in (1, 32, 512) for h in (2048, 4096)]


def worker(ctx, configs, rounds, samples) -> None:
    """One rank's sweep: a single communicator serves every size; per
    configuration, check and time every backend and emit the record."""
    symm = SymmMemOneShot.create(ctx, max(t * h for t, h in configs)) if ctx.transport == "gpu" else None
    # On CPU processes the "dist" transport (over gloo) is timed too: what a
    # world without shared memory gets, next to the cpu transport and gloo.
    with Communicator(ctx.cpu_group, transport=ctx.transport) as comm, \
            (Communicator(ctx.cpu_group, transport="dist") if ctx.transport == "cpu" else nullcontext()) as dist_comm:
        for tokens, hidden in configs:
            ops = allreduce_ops(ctx, comm, tokens, hidden, symm, dist_comm)
            stats = measure(ctx, ops, rounds=rounds, samples=samples)
            ctx.emit(record("all_reduce", tokens, hidden, torch.float32, ops, stats))
            if symm is not None and symm.backend not in stats:
                symm = None  # it failed (noted by measure): don't retry it for every size
            del ops
            ctx.release()


if __name__ == "__main__":
    sys.exit(_common.main("bench_allreduce", __doc__, FULL, QUICK, worker))
