"""Calls that disagree between ranks, case by case (docs/semantics.md,
"Calls that disagree"): what each rank calls in each case, for
tests/test_calls_agree.py and benchmarks/bench_call_mismatch.py (how long
each rank takes to raise, and what it says).

A case's ``odd`` rank makes the call that differs: in "skipped" it skips an
all_reduce the others make before they all dispatch, in "op_kind" it calls
all_reduce while the others dispatch.
"""
from __future__ import annotations

from typing import Callable

import torch

from .._checks import rand
from ..communicator import Communicator
from ..fp8 import FP8_DTYPE, quantize_fp8

H, K, CAP = 64, 2, 8
CASES = ("numel", "dtype", "rmsnorm_hidden", "rmsnorm_residual", "layout", "fp8_pair", "handles", "skipped",
         "op_kind")


def communicator(ctx, timeout_ms: int, **kwargs) -> Communicator:
    """A communicator of ctx's transport ("dist": with its call checks on)."""
    if ctx.transport == "dist":
        kwargs.setdefault("dist_check_calls", True)
    return Communicator(transport=ctx.transport, timeout_ms=timeout_ms, **kwargs)


def _ep(ctx, timeout_ms: int, **kwargs) -> Communicator:
    return communicator(ctx, timeout_ms, max_tokens_per_rank=CAP, hidden=H, topk=K, num_experts=2 * ctx.world,
                        **kwargs)


def _inputs(ctx, seed: int, T: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10 + ctx.rank)
    x = rand(seed, ctx.rank, (T, H), torch.bfloat16).to(ctx.device)
    idx = torch.randint(0, 2 * ctx.world, (T, K), generator=g).to(ctx.device)
    return x, idx


def calls(case: str, ctx, odd: bool, seed: int, timeout_ms: int) -> tuple[Communicator, Callable[[], object]]:
    """This rank's communicator for ``case`` and a callable that makes its
    calls; ``odd``: whether this rank is the one whose call differs."""
    dev = ctx.device
    if case == "numel":
        c = communicator(ctx, timeout_ms)
        x = torch.ones(1023 if odd else 1024, device=dev)
        return c, lambda: c.all_reduce(x)
    if case == "dtype":
        c = communicator(ctx, timeout_ms)
        x = torch.ones(512, device=dev, dtype=torch.bfloat16 if odd else torch.float32)
        return c, lambda: c.all_reduce(x)
    if case == "rmsnorm_hidden":
        c = communicator(ctx, timeout_ms)
        h = 32 if odd else 64
        x = torch.ones(256 // h, h, device=dev)
        return c, lambda: c.all_reduce_rmsnorm(x, None, torch.ones(h, device=dev))
    if case == "rmsnorm_residual":
        c = communicator(ctx, timeout_ms)
        x = torch.ones(4, 64, device=dev)
        return c, lambda: c.all_reduce_rmsnorm(x, x if odd else None, torch.ones(64, device=dev))
    if case == "layout":
        c = _ep(ctx, timeout_ms)
        x, idx = _inputs(ctx, seed)
        return c, lambda: c.dispatch(x, idx, layout="expert" if odd else "rank")
    if case == "fp8_pair":
        c = _ep(ctx, timeout_ms, dispatch_dtype=FP8_DTYPE)
        x, idx = _inputs(ctx, seed)
        # Quantised before the call: the callable is what the benchmark
        # times, and a first quantize_fp8 on a GPU loads its kernels.
        sent = quantize_fp8(x) if odd else x
        return c, lambda: c.dispatch(sent, idx)
    if case == "handles":
        c = _ep(ctx, timeout_ms)
        x, idx = _inputs(ctx, seed)

        def run():
            first, second = c.dispatch(x, idx), c.dispatch(x, idx)
            d = second if odd else first
            return c.combine(d.x, d.handle)
        return c, run
    if case == "skipped":
        c = _ep(ctx, timeout_ms)
        x, idx = _inputs(ctx, seed)
        t = torch.ones(64, device=dev)

        def run():
            if not odd:
                c.all_reduce(t)
            return c.dispatch(x, idx)
        return c, run
    if case == "op_kind":
        c = _ep(ctx, timeout_ms)
        x, idx = _inputs(ctx, seed)
        t = torch.ones(64, device=dev)
        return c, (lambda: c.all_reduce(t)) if odd else (lambda: c.dispatch(x, idx))
    raise ValueError(f"case must be one of {CASES}, got {case!r}")
