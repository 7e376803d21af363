"""Inputs whose results can be checked exactly, and the exact checks; used by
the benchmarks, the demo, the doctor and the tests.

:func:`pattern` makes small signed integers times a power of two, each a hash
of (rank, row, column). Sums of them over up to 32 ranks are exact in their
dtype whatever the order, so the baselines, which sum in an order of their
own, are checked bitwise too; and every rank can build any rank's inputs (or
some columns of them) without communication.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import reference
from .results import ExpertDispatched

# fp32 all_reduce inputs: 16-bit values, sums over 32 ranks stay within 24 bits.
ALLREDUCE_BITS = 16

# The fields of a DispatchHandle that say where each row goes and comes from.
HANDLE_FIELDS = ("recv_src", "counts", "src_tokens", "send_mask")


def pattern(rank: int, rows: int, cols: int, dtype: torch.dtype, device, *, bits: int,
            width: Optional[int] = None) -> torch.Tensor:
    """Rank ``rank``'s deterministic input: the first ``cols`` columns of a
    [rows, width] tensor (width defaults to cols). Values are nonzero integers
    in [-(2^(bits-1)-1), 2^(bits-1)] times 2^-(bits//2)."""
    width = cols if width is None else width
    # k < 2^31 keeps k * 2654435761 within int64.
    assert (rank + 1) * rows * width < 2**31, "pattern: tensor too large for the hash"
    t = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    h = torch.arange(cols, device=device, dtype=torch.int64).unsqueeze(0)
    k = (rank * rows + t) * width + h
    half = 2 ** (bits - 1)
    v = ((k * 2654435761) >> 8) % (2 * half - 1) - (half - 1)  # Knuth's multiplicative hash
    v = torch.where(v == 0, torch.full_like(v, half), v)
    return (v.to(torch.float32) * 2.0 ** -(bits // 2)).to(dtype)


def rand(seed: int, rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Deterministic non-zero random data on the CPU for (seed, rank): never
    zeros, which hide unwritten outputs."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 17)
    x = torch.randn(shape, generator=g) * 4
    return torch.where(x == 0, torch.ones_like(x), x).to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensors") -> None:
    """Raise AssertionError unless dtype, shape and every byte agree."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().contiguous()
    e = expected.detach().cpu().contiguous()
    if not torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)):
        bad = (a != e).nonzero()
        if len(bad):
            at = tuple(bad[0].tolist())
            where = f"first at {at}: {a[at].item()} != {e[at].item()}"
        else:
            where = "all equal by value (NaN payloads or signed zeros differ)"
        raise AssertionError(f"{what}: {len(bad)} of {a.numel()} elements differ bitwise; {where}")


def received_rows(d) -> torch.Tensor:
    """The rows of a Dispatched's ``x`` that carry tokens: ``x[:counts.sum()]``
    (the rows after them are unspecified). Reads the counts on the host."""
    return d.x[: int(d.counts.sum())]


def assert_dispatched(actual, expected, what: str = "", cols: Optional[int] = None) -> None:
    """Every field of a Dispatched and of its handle bitwise equal to the
    expected one (e.g. from rdna4_comm.reference.dispatch), the payload (and
    an FP8 dispatch's scales) on its received rows (padding rows of ``x`` are unspecified; their routing is
    compared: -1 ids, 0 weights). With ``cols``, the expected rows hold only
    the first ``cols`` columns of the payload, and only those columns of
    ``actual.x`` are compared."""
    assert_same(actual.counts, expected.counts, f"{what} counts")
    assert actual.x.shape == expected.x.shape, f"{what} x: shape {tuple(actual.x.shape)} != {tuple(expected.x.shape)}"
    x, want = received_rows(actual), received_rows(expected)
    x, part = (x, "") if cols is None else (x[:, :cols], f"[:, :{cols}]")
    assert_same(x, want, f"{what} x[:num_recv]{part}")
    assert (actual.x_scales is None) == (expected.x_scales is None), f"{what}: x_scales of FP8 dispatch only"
    if expected.x_scales is not None:  # with cols, the scales of its blocks
        scales = actual.x_scales[: want.shape[0], : expected.x_scales.shape[1]]
        assert_same(scales, expected.x_scales[: want.shape[0]], f"{what} x_scales[:num_recv]")
    assert_same(actual.topk_idx, expected.topk_idx, f"{what} topk_idx")
    if expected.topk_weights is None:
        assert actual.topk_weights is None, f"{what}: weights returned without weights given"
    else:
        assert_same(actual.topk_weights, expected.topk_weights, f"{what} topk_weights")
    for field in HANDLE_FIELDS:
        assert_same(getattr(actual.handle, field), getattr(expected.handle, field), f"{what} handle.{field}")


def assert_expert_dispatched(actual, expected, what: str = "") -> None:
    """Every field of an ExpertDispatched and of its handle bitwise equal to
    the expected one (rdna4_comm.reference.dispatch with layout="expert"):
    x, the weights and an FP8 dispatch's scales on the rows below
    expert_offsets[-1] (the rows past it are unspecified), the expert counts
    and offsets whole."""
    assert isinstance(actual, ExpertDispatched), f"{what}: {type(actual).__name__}, not an ExpertDispatched"
    assert_same(actual.expert_counts, expected.expert_counts, f"{what} expert_counts")
    assert_same(actual.expert_offsets, expected.expert_offsets, f"{what} expert_offsets")
    assert actual.x.shape == expected.x.shape, f"{what} x: shape {tuple(actual.x.shape)} != {tuple(expected.x.shape)}"
    n = min(int(expected.expert_offsets[-1]), expected.x.shape[0])
    assert_same(actual.x[:n], expected.x[:n], f"{what} x")
    assert (actual.x_scales is None) == (expected.x_scales is None), f"{what}: x_scales of FP8 dispatch only"
    if expected.x_scales is not None:
        assert_same(actual.x_scales[:n], expected.x_scales[:n], f"{what} x_scales")
    if expected.topk_weights is None:
        assert actual.topk_weights is None, f"{what}: weights returned without weights given"
    else:
        assert_same(actual.topk_weights[:n], expected.topk_weights[:n], f"{what} topk_weights")
    for field in HANDLE_FIELDS + ("expert_rows_of",):
        assert_same(getattr(actual.handle, field), getattr(expected.handle, field), f"{what} handle.{field}")


def allreduce_case(rank: int, world: int, tokens: int, hidden: int, device) -> tuple[torch.Tensor, Callable]:
    """Rank ``rank``'s [tokens, hidden] fp32 all_reduce input on ``device`` and
    the check of a result: bitwise equal to rdna4_comm.reference.all_reduce of
    every rank's input."""
    xs = [pattern(r, tokens, hidden, torch.float32, device, bits=ALLREDUCE_BITS) for r in range(world)]
    x, expected = xs[rank], reference.all_reduce(xs)
    del xs
    what = f"all_reduce [{tokens}, {hidden}] fp32"

    def check(out):
        assert_same(out, expected, f"{what} vs rdna4_comm.reference.all_reduce")

    return x, check
