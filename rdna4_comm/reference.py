"""Dense single-process reference: given every rank's inputs (lists indexed by
rank), what every rank must get from dispatch, combine, all_reduce and
all_reduce_rmsnorm; and the FP8 rule (:func:`quantize_fp8`,
:func:`dequantize_fp8`, from rdna4_comm/fp8.py).

Pure torch. Sums run in float32 in ascending rank order and round once, the
order the transports use, so results are comparable bitwise. The fused op's
norm is specified to within one ulp (:func:`assert_rmsnorm_within_contract`,
with the kernels' exact arithmetic in :func:`ieee_normalised`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8  # noqa: F401  (the FP8 rule is part of the spec)
from .results import DispatchHandle, Dispatched, ExpertDispatched


def _sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def all_reduce(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of ``xs[r]`` over ranks r ascending, in float32, in the dtype of the inputs."""
    return _sum_in_rank_order(xs).to(xs[0].dtype)


def rms_norm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as model code writes it: normalise in float32, round to r's
    dtype, multiply by the weight in float32 and round once to r's dtype."""
    r32 = r.float()
    normalised = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)
    return (weight.float() * normalised.float()).to(r.dtype)


def all_reduce_rmsnorm(
    xs: Sequence[torch.Tensor], residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)`` of ``Communicator.all_reduce_rmsnorm`` given
    every rank's x (``xs[r]``): the unfused composition in torch ops,
    ``r = all_reduce(xs) + residual`` and ``out = rms_norm(r, weight, eps)``."""
    r = all_reduce(xs)
    if residual is not None:
        r = r + residual
    return rms_norm(r, weight, eps), r


def ieee_normalised(r32: torch.Tensor, eps: float) -> torch.Tensor:
    """``r32 * (1 / sqrt(mean(r32**2, -1) + eps))`` as the kernels compute it
    (``rmsnorm_inv_rms`` in csrc/rmsnorm_arith.h): the squares summed in float64
    and the mean rounded once to float32, then every step one correctly
    rounded float32 operation. Each step runs in float64 and is rounded to
    float32 (exact for a product, correctly rounded for a sum, quotient or
    square root of float32 values), because torch's float32 sqrt and rsqrt
    on the CPU are not always correctly rounded."""
    f32 = torch.float32
    mean = (r32.double().pow(2).sum(-1, keepdim=True) / r32.shape[-1]).to(f32)
    shifted = (mean.double() + torch.tensor(eps, dtype=f32).double()).to(f32)
    inv = (1.0 / shifted.double().sqrt().to(f32).double()).to(f32)
    return (r32.double() * inv.double()).to(f32)


def assert_rmsnorm_within_contract(out: torch.Tensor, residual_out: torch.Tensor, weight: torch.Tensor,
                                   eps: float, what: str = "all_reduce_rmsnorm") -> None:
    """Raise AssertionError unless ``out`` is what the contract allows for
    this ``residual_out`` (docs/semantics.md, section 8): the torch
    composition except for the reduction order of the mean, i.e. the
    normalised value before the weight multiply within 1 ulp of the dtype of
    the one IEEE fp32 arithmetic gives from an accurately summed mean
    (:func:`ieee_normalised`). The tests and benchmarks check with it."""
    out, residual_out, weight = (t.detach().cpu() for t in (out, residual_out, weight))
    dtype = out.dtype
    expected = rms_norm(residual_out, weight, eps)
    normalised = ieee_normalised(residual_out.float(), eps).to(dtype)
    ok = torch.isnan(out) & torch.isnan(expected)
    for towards in (None, float("inf"), float("-inf")):
        n = normalised if towards is None else torch.nextafter(normalised, torch.full_like(normalised, towards))
        ok |= (weight.float() * n.float()).to(dtype) == out
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} elements beyond 1 ulp of the normalised value"


def expert_owners(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """[T, K] int64: the rank owning each slot's expert, -1 for dropped ids."""
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)
    return torch.where(valid, idx // (num_experts // world_size), torch.full_like(idx, -1))


def dispatch(
    xs: Sequence[torch.Tensor],
    topk_idxs: Sequence[torch.Tensor],
    topk_weights: Optional[Sequence[torch.Tensor]] = None,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    layout: str = "rank",
    expert_alignment: int = 1,
    max_expert_rows: Optional[int] = None,
    dispatch_dtype: Optional[torch.dtype] = None,
) -> list:
    """What each rank receives from ``Communicator.dispatch``.

    Args:
        xs: per rank, [T_r, H] (the op's x with its leading dimensions
            flattened); with ``dispatch_dtype=torch.float8_e4m3fn``, that or
            a ``(q, scales)`` pair of :func:`quantize_fp8`.
        topk_idxs: per rank, [T_r, K] int32 or int64 global expert ids.
        topk_weights: per rank, [T_r, K] float32, bfloat16 or float16, or None.
        layout, expert_alignment, max_expert_rows, dispatch_dtype: as the Communicator's.

    Returns:
        Per rank, a :class:`Dispatched` with the op's shapes and values,
        padding included (``layout="expert"``: an :class:`ExpertDispatched`
        built from it by :func:`expert_layout`). Its routing has the dtypes of
        that rank's own inputs; weights travel in float32 (exact for
        bfloat16/float16 inputs) and are rounded once to the receiving rank's
        weight dtype. FP8: x holds the bytes of :func:`quantize_fp8` of each
        row (or of the pair given), x_scales their scales.
    """
    if layout not in ("rank", "expert"):
        raise ValueError(f"dispatch: layout must be one of ('rank', 'expert'), got {layout!r}")
    if dispatch_dtype not in (None, FP8_DTYPE):
        raise TypeError(f"dispatch: dispatch_dtype must be None or {FP8_DTYPE}, got {dispatch_dtype!r}")
    if dispatch_dtype is not None:  # FP8 rows travel as their bytes, with their scales
        xs = [x if isinstance(x, (tuple, list)) else quantize_fp8(x) for x in xs]
        xs = [(q.view(torch.uint8), scales) for q, scales in xs]
    rank_major = _dispatch_rank_major(xs, topk_idxs, topk_weights, num_experts, max_tokens_per_rank)
    if layout == "rank":
        return rank_major
    W, K, epr = len(xs), topk_idxs[0].shape[1], num_experts // len(xs)
    rows = max_expert_rows or W * max_tokens_per_rank * min(K, epr) + epr * (expert_alignment - 1)
    return [expert_layout(d, epr, expert_alignment, rows) for d in rank_major]


def expert_layout(d: Dispatched, num_local_experts: int, alignment: int, rows: int) -> ExpertDispatched:
    """The expert layout of one rank's rank-layout result ``d``: for each
    local expert e ascending, a row per received row that names e in a slot
    (ascending), the block's start rounded up to ``alignment``; the pair's
    weight is the fp32 sum of its slots' weights in slot order, rounded once.
    Pairs past ``rows`` are dropped (the op raises for them at a later call).
    Rows that hold no pair are zeros (their FP8 scales too)."""
    idx = d.topk_idx.long()
    R, K = idx.shape
    received = int(d.counts.sum())
    fp8 = d.x_scales is not None
    rows_in = d.x.view(torch.uint8) if fp8 else d.x
    x = torch.zeros(rows, d.x.shape[1], dtype=rows_in.dtype)
    scales = torch.zeros(rows, d.x_scales.shape[1]) if fp8 else None
    w = None if d.topk_weights is None else torch.zeros(rows, dtype=d.topk_weights.dtype)
    rows_of = [[] for _ in range(R)]
    counts, offsets = [], [0]
    for e in range(num_local_experts):
        at = offsets[-1]
        for j in range(received):
            slots = [k for k in range(K) if int(idx[j, k]) == e]
            if not slots:
                continue
            if at < rows:
                x[at] = rows_in[j]
                if fp8:
                    scales[at] = d.x_scales[j]
                if w is not None:
                    acc = d.topk_weights[j, slots[0]].float()
                    for k in slots[1:]:
                        acc = acc + d.topk_weights[j, k].float()
                    w[at] = acc.to(w.dtype)
                rows_of[j].append(at)
            at += 1
        counts.append(at - offsets[-1])
        offsets.append(offsets[-1] + -(-counts[-1] // alignment) * alignment)
    of = torch.full((R, K), -1, dtype=torch.int32)
    for j, pairs in enumerate(rows_of):
        of[j, :len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
    return ExpertDispatched(x.view(d.x.dtype), torch.tensor(counts, dtype=torch.int32),
                            torch.tensor(offsets, dtype=torch.int32), w, d.handle._replace(expert_rows_of=of), scales)


def _dispatch_rank_major(xs, topk_idxs, topk_weights, num_experts: int, max_tokens_per_rank: int) -> list[Dispatched]:
    """xs: per rank, [T_r, H], or FP8's (q bytes [T_r, H] uint8, scales [T_r, S])."""
    W, cap = len(xs), max_tokens_per_rank
    fields = [x if isinstance(x, tuple) else (x,) for x in xs]  # each source's row fields
    epr = num_experts // W
    owners = [expert_owners(i, num_experts, W) for i in topk_idxs]
    ranks = torch.arange(W)
    hits = [(o.unsqueeze(-1) == ranks).any(1) for o in owners]  # [T, W] bool
    bits = (1 << ranks).to(torch.int32)
    send_masks = [(h.to(torch.int32) * bits).sum(1, dtype=torch.int32) for h in hits]
    src_tokens = torch.tensor([f[0].shape[0] for f in fields], dtype=torch.int32)

    out = []
    for d in range(W):
        xr, ir, wr, sr, counts = [], [], [], [], []
        for s in range(W):
            toks = hits[s][:, d].nonzero().flatten()
            here = owners[s][toks] == d
            xr.append([f[toks] for f in fields[s]])
            ir.append(torch.where(here, topk_idxs[s][toks].long() - d * epr, -1))
            if topk_weights is not None:
                wr.append(torch.where(here, topk_weights[s][toks].float(), 0.0))
            sr.append((s * cap + toks).to(torch.int32))
            counts.append(toks.numel())
        n, rows = sum(counts), W * cap
        K = topk_idxs[d].shape[1]
        x = []
        for i, f in enumerate(fields[d]):
            x.append(torch.zeros(rows, f.shape[1], dtype=f.dtype))
            x[i][:n] = torch.cat([part[i] for part in xr])
        idx = torch.full((rows, K), -1, dtype=topk_idxs[d].dtype)
        idx[:n] = torch.cat(ir)
        w = None
        if topk_weights is not None:
            w = torch.zeros(rows, K, dtype=torch.float32)
            w[:n] = torch.cat(wr)
            w = w.to(topk_weights[d].dtype)
        src = torch.full((rows,), -1, dtype=torch.int32)
        src[:n] = torch.cat(sr)
        cnt = torch.tensor(counts, dtype=torch.int32)
        handle = DispatchHandle(src, cnt, src_tokens.clone(), send_masks[d], "reference", (fields[d][0].shape[0],))
        if len(x) == 2:  # FP8
            out.append(Dispatched(x[0].view(FP8_DTYPE), idx, w, cnt, handle, x[1]))
        else:
            out.append(Dispatched(x[0], idx, w, cnt, handle))
    return out


def combine(ys: Sequence[torch.Tensor], dispatched: Sequence) -> list[torch.Tensor]:
    """What each rank gets from ``Communicator.combine``.

    Args:
        ys: per rank, [W*cap, H] expert results, one row per received row
            (an expert-layout handle: [expert_rows, H], one row per pair).
        dispatched: per rank, the dispatch result (``reference.dispatch``'s or
            the op's; only the handles are read).

    Returns:
        Per rank, [T_r, H] in the dtype of ``ys``: for each token the float32
        sum over its destination ranks ascending, rounded once; zeros for tokens
        routed nowhere. With an expert-layout handle, a rank's contribution
        to a token is first its pairs' rows summed in float32 in ascending
        expert order, rounded once.
    """
    ys = [_rank_rows(y, d.handle) for y, d in zip(ys, dispatched)]
    W = len(ys)
    cap = dispatched[0].handle.recv_src.shape[0] // W
    out = []
    for s in range(W):
        T, H = dispatched[s].handle.send_mask.shape[0], ys[s].shape[1]
        acc = torch.zeros(T, H, dtype=torch.float32)
        seen = torch.zeros(T, dtype=torch.bool)
        for r in range(W):
            src = dispatched[r].handle.recv_src.long()
            rows = ((src >= s * cap) & (src < (s + 1) * cap)).nonzero().flatten()
            toks = src[rows] - s * cap
            part = ys[r][rows].float()
            first = ~seen[toks]
            acc[toks] = torch.where(first.unsqueeze(1), part, acc[toks] + part)
            seen[toks] = True
        out.append(acc.to(ys[s].dtype))
    return out


def _rank_rows(y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """y as rank-layout rows: unchanged for a rank-layout handle; else each
    received row's pair rows (``expert_rows_of``) summed in fp32 from the
    first, in ascending expert order, rounded once."""
    if handle.expert_rows_of is None:
        return y
    of = handle.expert_rows_of
    out = torch.zeros(of.shape[0], y.shape[1], dtype=y.dtype)
    for j in range(of.shape[0]):
        rows = [int(r) for r in of[j] if 0 <= int(r) < y.shape[0]]
        if rows:
            acc = y[rows[0]].float()
            for r in rows[1:]:
                acc = acc + y[r].float()
            out[j] = acc.to(y.dtype)
    return out

