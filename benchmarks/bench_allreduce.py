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
import warnings
from contextlib import nullcontext
from typing import Optional

import _common
import torch

from rdna4_comm import Communicator
from rdna4_comm._bench.cases import allreduce_ops, record
from rdna4_comm._checks import allreduce_case
from rdna4_comm._ranks import RankContext
from rdna4_comm._timing import Op, measure

TOKENS = (1, 8, 32, 128, 512, 2048)
HIDDEN = (2048, 4096, 8192)
MAX_BYTES = 64 << 20
FULL = [(t, h) for t in TOKENS for h in HIDDEN] + [
    (t, h) for t in (4096, 8192) for h in HIDDEN if t * h * 4 <= MAX_BYTES
]
QUICK = [(t, h) for t in (1, 32, 512) for h in (2048, 4096)]


class SymmMemOneShot:
    """torch.ops.symm_mem.one_shot_all_reduce over one symmetric-memory buffer
    (GPU only), big enough for the largest tensor of a sweep."""

    backend = "symm_mem_one_shot"

    def __init__(self, buf: torch.Tensor, group_name: str):
        self.buf, self.group_name = buf, group_name

    @classmethod
    def create(cls, ctx: RankContext, max_numel: int) -> Optional["SymmMemOneShot"]:
        """Collective. None, with a note, where torch lacks it or it fails to set up."""
        error = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            torch.ops.symm_mem.one_shot_all_reduce  # noqa: B018  (AttributeError where missing)
            name = ctx.group.group_name
            if not symm_mem.is_symm_mem_enabled_for_group(name):
                # Needed before torch 2.13; deprecated (and a no-op) since.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(name)
            buf = symm_mem.empty(max_numel, dtype=torch.float32, device=ctx.device)
            symm_mem.rendezvous(buf, name)
        except Exception as e:  # noqa: BLE001  (any failure means: no such baseline here)
            error = f"{type(e).__name__}: {e}"
        bad = ctx.errors(error)
        if bad:
            ctx.note(f"{cls.backend} skipped, torch symmetric memory is not usable here: " + "; ".join(bad))
            return None
        return cls(buf, name)

    def op(self, x: torch.Tensor, check) -> Op:
        view = self.buf[: x.numel()].view(x.shape)
        return Op(self.backend, lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group_name),
                  check, reset=lambda: view.copy_(x), optional=True,
                  detail="torch.ops.symm_mem.one_shot_all_reduce from a symmetric buffer holding the input")


def worker(ctx, configs, rounds, samples) -> None:
    """One rank's sweep: a single communicator serves every size; per
    configuration, check and time every backend and emit the record."""
    symm = SymmMemOneShot.create(ctx, max(t * h for t, h in configs)) if ctx.transport == "gpu" else None
    # On CPU processes the "dist" transport (over gloo) is timed too: what a
    # world without shared memory gets, next to the cpu transport and gloo.
    with Communicator(ctx.cpu_group, transport=ctx.transport) as comm, \
            (Communicator(ctx.cpu_group, transport="dist") if ctx.transport == "cpu" else nullcontext()) as dist_comm:
        for tokens, hidden in configs:
            ops = allreduce_ops(ctx, comm, tokens, hidden, dist_comm)
            if symm is not None:  # its own copy of the same input (allreduce_case is deterministic)
                ops.append(symm.op(*allreduce_case(ctx.rank, ctx.world, tokens, hidden, ctx.device)))
            stats = measure(ctx, ops, rounds=rounds, samples=samples)
            ctx.emit(record("all_reduce", tokens, hidden, torch.float32, ops, stats))
            if symm is not None and symm.backend not in stats:
                symm = None  # it failed (noted by measure): don't retry it for every size
            del ops
            ctx.release()


if __name__ == "__main__":
    sys.exit(_common.main("bench_allreduce", __doc__, FULL, QUICK, worker))
