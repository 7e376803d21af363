"""Soak: long streams of mixed back-to-back ops with changing shapes and no
host sync between them (tests/mixed.py), every result of every rank checked
bitwise against rdna4_comm.reference."""
from __future__ import annotations

import time

import mixed
import pytest
from conftest import CPU_WORLDS, GPU_WORLDS

SEED = 8


def t_soak(ctx, n, seed):
    """Run ``n`` ops back to back (inputs staged before); then, with the
    results all issued, synchronise once and return their digests and the
    seconds the ops took."""
    comm = ctx.comm(**mixed.comm_kwargs(ctx.world))
    ops = mixed.plan(n, ctx.world, seed)
    staged = mixed.stage(ops, ctx.rank, ctx.world, ctx.device)
    dispatched: dict = {}
    start = time.monotonic()
    results = [mixed.issue(comm, ops, staged, i, ctx.rank, dispatched) for i in range(n)]
    comm.check()
    elapsed = time.monotonic() - start
    return mixed.rank_digests(ops, results), elapsed


def soak(world, n):
    start = time.monotonic()
    results = world.run(t_soak, n, SEED)
    ran = time.monotonic() - start
    mixed.assert_stream_matches(mixed.plan(n, world.size, SEED), [digests for digests, _ in results])
    print(f"\n{world.transport}{world.size}: {n} ops in {max(t for _, t in results):.1f} s on the ranks, "
          f"{ran:.1f} s with the digests, {time.monotonic() - start:.1f} s with the reference check")


@pytest.mark.slow
@pytest.mark.skipif(("cpu", 4) not in CPU_WORLDS, reason="cpu transport not selected")
def test_soak_cpu_20000_ops_4_ranks(worlds):
    soak(worlds("cpu", 4), 20_000)


@pytest.mark.skipif(("gpu", 2) not in GPU_WORLDS, reason="no GPU world of 2 ranks")
def test_soak_gpu_5000_ops_2_ranks(worlds):
    soak(worlds("gpu", 2), 5_000)
