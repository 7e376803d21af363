"""What the benchmarks and the demo time: each rdna4_comm op next to its
torch.distributed equivalent on the same inputs, as
:class:`~rdna4_comm._timing.Op` lists for
:func:`~rdna4_comm._timing.measure`, with the check every result passes
before it is timed. Inputs come from :func:`~rdna4_comm._checks.pattern`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import reference
from ..communicator import Communicator
from ..fp8 import DEFAULT_BLOCK as FP8_BLOCK, FP8_DTYPE, dequantize_fp8, num_scales, quantize_fp8
from .._checks import allreduce_case, assert_dispatched, assert_same, pattern
from .._timing import Op, Stats
from .._ranks import RankContext

# torch 2.13 renamed these two (the old names warn); older versions have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

EP_TOPK = 8
EP_EXPERTS = 256
# The CPU reference of one EP check handles world^2 * capacity * columns
# elements (it computes every rank's dispatch); above this many it checks the
# first columns only (all rows, all routing), and every column is still checked
# through an exact identity of the round trip. 2^26 takes about 2 s.
EP_CHECK_BUDGET = 1 << 26
EP_BITS = 4  # bf16/fp16: |value| <= 8, sums over 32 ranks stay within 8 bits


def record(op: str, tokens: int, hidden: int, dtype: torch.dtype, ops: list[Op], stats: dict[str, Stats],
           cap: Optional[int] = None) -> dict:
    """What a worker emits for one measured configuration (the demo's table
    and benchmarks/_harness/report.py print them); ``bytes`` is the payload
    per rank; ``cap``, where given, the communicator's max_tokens_per_rank."""
    rec = {
        "op": op,
        "tokens": tokens,
        "hidden": hidden,
        "dtype": str(dtype).replace("torch.", ""),
        "bytes": tokens * hidden * dtype.itemsize,
        "stats": stats,
        "details": {o.backend: o.detail for o in ops if o.backend in stats},
    }
    if cap is not None:
        rec["cap"] = cap
    return rec


def speedup(stats: dict[str, Stats], backend: str) -> float:
    """rdna4_comm's speedup over ``backend`` in one configuration: its p50 /
    rdna4_comm's p50 (> 1: rdna4_comm is faster; 1.0 for rdna4_comm itself)."""
    return stats[backend].p50_us / stats["rdna4_comm"].p50_us


# -------------------------------------------------------------- all_reduce


def rdna4_allreduce_op(comm: Communicator, x: torch.Tensor, check: Callable, backend: str = "rdna4_comm") -> Op:
    """rdna4_comm's all_reduce of ``x`` (out of place), checked by ``check``,
    timed as ``backend``."""
    return Op(backend, lambda: comm.all_reduce(x), check,
              detail=f"rdna4_comm.all_reduce, out of place, transport {comm.transport!r}")


def allreduce_ops(ctx: RankContext, comm: Communicator, tokens: int, hidden: int,
                  dist_comm: Optional[Communicator] = None) -> list[Op]:
    """fp32 sum of a [tokens, hidden] tensor over the ranks
    (:func:`~rdna4_comm._checks.allreduce_case`): rdna4_comm (out of place:
    copies the input in, returns a new tensor) against
    torch.distributed.all_reduce (in place: no copy, the baseline's cheapest
    form) and, if given, rdna4_comm over its "dist" transport
    (``dist_comm``, as "rdna4_comm_dist")."""
    x, check = allreduce_case(ctx.rank, ctx.world, tokens, hidden, ctx.device)
    ops = [rdna4_allreduce_op(comm, x, check)]
    if dist_comm is not None:
        # "dist" runs on the GPU wherever every rank sees one, CPU processes included.
        ops.append(rdna4_allreduce_op(dist_comm, x.to(dist_comm.device), check, "rdna4_comm_dist"))
    inplace = torch.empty_like(x)

    def torch_all_reduce():
        dist.all_reduce(inplace, group=ctx.group)
        return inplace

    ops.append(Op(ctx.baseline, torch_all_reduce, check, reset=lambda: inplace.copy_(x),
                  detail=f"torch.distributed.all_reduce ({ctx.baseline}), in place"))
    return ops


# ------------------------------------------------------- dispatch/combine


def ep_routing(rank: int, tokens: int, topk: int, num_experts: int, seed: int):
    """Rank ``rank``'s routing on the CPU: ([T, K] int32 expert ids, distinct per
    token and uniform over the experts; [T, K] fp32 weights)."""
    g = torch.Generator().manual_seed(seed * 100_003 + rank)
    idx = torch.rand(tokens, num_experts, generator=g).topk(topk, dim=1).indices.to(torch.int32)
    return idx, torch.rand(tokens, topk, generator=g)


def _reduce_scatter_fn(ctx: RankContext, tokens: int):
    """(fn(out, inp), description) for the baseline's reduce-scatter of [W*T, H]
    into [T, H]: reduce_scatter_tensor, or, where the group lacks it (gloo in
    some torch versions), an all_reduce of the whole tensor and this rank's slice."""
    try:
        _reduce_scatter(torch.empty(1, device=ctx.device), torch.ones(ctx.world, device=ctx.device), group=ctx.group)
    except (RuntimeError, NotImplementedError):
        def fallback(out, inp):
            total = inp.clone()
            dist.all_reduce(total, group=ctx.group)
            out.copy_(total[ctx.rank * tokens:(ctx.rank + 1) * tokens])

        return fallback, f"all_reduce + slice ({ctx.baseline} lacks reduce_scatter_tensor)"
    return (lambda out, inp: _reduce_scatter(out, inp, group=ctx.group)), "reduce_scatter_tensor"


def ep_ops(ctx: RankContext, comm: Communicator, tokens: int, seed: int = 0, layout: str = "rank") -> list[Op]:
    """One MoE layer's communication for ``tokens`` tokens per rank, with the
    communicator's hidden size, top-k, experts and dtype, and fp32 weights;
    the expert step is left out (identity: the received rows go straight back).
    ``layout="expert"``: dispatch returns the expert layout (one row per
    token and local expert), which combine takes back; each token then comes
    back times its number of experts.

    - rdna4_comm: ``d = dispatch(x, topk_idx, topk_weights)``, then
      ``combine(d.x, d.handle)``. Checked bitwise against
      rdna4_comm.reference.dispatch/combine (every output field; the payload
      on the first columns where the reference would be slow, see
      EP_CHECK_BUDGET), and on every column by the round trip's exact
      identity: each token comes back times its number of destination ranks.
    - baseline (vLLM's allgather_reducescatter EP path): all_gather of x
      [T, H], topk_idx and topk_weights, then reduce_scatter of the gathered
      x [W*T, H]. Checked: the gathers equal the concatenation of every rank's
      inputs, the reduce-scatter equals the sum over ranks of this rank's rows.

    An FP8 communicator (``dispatch_dtype``): rdna4_comm dispatches x
    quantised in the op, and the received rows are dequantised
    (``rdna4_comm.dequantize_fp8``) before combine, as experts would take
    them; a second baseline, ``<baseline>_fp8``, quantises x
    (``rdna4_comm.quantize_fp8``), all_gathers the FP8 bytes, their scales
    and the routing, dequantises and reduce-scatters. Checks: the FP8 bytes
    and scales against rdna4_comm.reference (on whole 128-channel blocks of
    the first columns), and the round trip against the dequantised x.
    """
    W, rank, dev, T = ctx.world, ctx.rank, ctx.device, tokens
    H, K, E, dtype, cap = comm.hidden, comm.topk, comm.num_experts, comm.dtype, comm.max_tokens_per_rank
    routing = [ep_routing(r, T, K, E, seed) for r in range(W)]
    idxs, ws = [i for i, _ in routing], [w for _, w in routing]
    x = pattern(rank, T, H, dtype, dev, bits=EP_BITS)
    idx, w = idxs[rank].to(dev), ws[rank].to(dev)
    owners = idx.long() // (E // W)
    n_dest = (owners.unsqueeze(-1) == torch.arange(W, device=dev)).any(1).sum(1)
    # ep_routing's ids are distinct within a token: K (token, expert) pairs each in the expert layout.
    per_token = n_dest if layout == "rank" else torch.full_like(n_dest, K)
    fp8 = comm.dispatch_dtype is not None
    # What the experts get: x, or the FP8 round trip of x.
    rows_of_x = dequantize_fp8(*quantize_fp8(x), dtype) if fp8 else x
    round_trip = (rows_of_x.float() * per_token.unsqueeze(1)).to(dtype)

    def run_rdna4():
        d = comm.dispatch(x, idx, w, layout=layout)
        return d, comm.combine(dequantize_fp8(d.x, d.x_scales, dtype) if fp8 else d.x, d.handle)

    def check_rdna4(result):
        d, out = result
        cols = min(H, max(1, EP_CHECK_BUDGET // (W * W * cap)))
        if fp8 and cols < H:  # whole blocks: a block's scale depends on all its channels
            cols = min(H, max(FP8_BLOCK, cols // FP8_BLOCK * FP8_BLOCK))
        xs = [pattern(r, T, cols, dtype, "cpu", bits=EP_BITS, width=H) for r in range(W)]
        ref = reference.dispatch(xs, idxs, ws, num_experts=E, max_tokens_per_rank=cap,
                                 dispatch_dtype=comm.dispatch_dtype)
        part = f"[:, :{cols}]" if cols < H else ""
        if layout == "rank":
            assert_dispatched(d, ref[rank], "dispatch vs reference:", cols)
        elif W * cap * (E // W) <= EP_CHECK_BUDGET >> 6:  # the reference grouping loops in Python
            mine = reference.expert_layout(ref[rank], E // W, comm.expert_alignment, comm.expert_rows)
            for field in ("expert_counts", "expert_offsets"):
                assert_same(getattr(d, field), getattr(mine, field), f"dispatch {field} vs reference")
            assert_same(d.handle.expert_rows_of, mine.handle.expert_rows_of, "handle.expert_rows_of vs reference")
        expert_rows = [dequantize_fp8(r.x, r.x_scales, dtype) if fp8 else r.x for r in ref]
        expected = reference.combine(expert_rows, ref)[rank]
        if layout == "rank":
            assert_same(out[:, :cols], expected, f"combine{part} vs reference")
        assert_same(out, round_trip, "combine(dispatch(x).x) == x * " + ("destination ranks" if layout == "rank"
                                                                          else "experts"))

    xg = torch.empty(W * T, H, dtype=dtype, device=dev)
    ig = torch.empty(W * T, K, dtype=torch.int32, device=dev)
    wg = torch.empty(W * T, K, dtype=torch.float32, device=dev)
    rs_out = torch.empty(T, H, dtype=dtype, device=dev)
    reduce_scatter, rs_how = _reduce_scatter_fn(ctx, T)

    def run_baseline():
        _all_gather(xg, x, group=ctx.group)
        _all_gather(ig, idx, group=ctx.group)
        _all_gather(wg, w, group=ctx.group)
        reduce_scatter(rs_out, xg)
        return xg, ig, wg, rs_out

    def check_baseline(result):
        xg, ig, wg, out = result
        for r in range(W):
            assert_same(xg[r * T:(r + 1) * T], pattern(r, T, H, dtype, dev, bits=EP_BITS), f"all_gather x, rank {r}'s rows")
        assert_same(ig, torch.cat(idxs).to(dev), "all_gather topk_idx")
        assert_same(wg, torch.cat(ws).to(dev), "all_gather topk_weights")
        assert_same(out, reference.all_reduce([x] * W), f"{rs_how}: sum over ranks of this rank's rows")

    ops = [
        Op("rdna4_comm", run_rdna4, check_rdna4,
           detail=f"dispatch(x, topk_idx, topk_weights, layout={layout!r}) + combine(" +
                  ("dequantize_fp8(d.x, d.x_scales), handle); FP8 dispatch" if fp8 else "dispatched x, handle)")),
        Op(ctx.baseline, run_baseline, check_baseline,
           detail=f"all_gather x, topk_idx, topk_weights + {rs_how} of the gathered x"),
    ]
    if fp8:
        qg = torch.empty(W * T, H, dtype=torch.uint8, device=dev)
        sg = torch.empty(W * T, num_scales(H), dtype=torch.float32, device=dev)

        def run_fp8_baseline():
            q, scales = quantize_fp8(x)
            _all_gather(qg, q.view(torch.uint8), group=ctx.group)
            _all_gather(sg, scales, group=ctx.group)
            _all_gather(ig, idx, group=ctx.group)
            _all_gather(wg, w, group=ctx.group)
            reduce_scatter(rs_out, dequantize_fp8(qg.view(FP8_DTYPE), sg, dtype))
            return qg, sg, rs_out

        def check_fp8_baseline(result):
            qg, sg, out = result
            for r in range(W):
                q, scales = quantize_fp8(pattern(r, T, H, dtype, dev, bits=EP_BITS))
                assert_same(qg[r * T:(r + 1) * T], q.view(torch.uint8), f"all_gather of rank {r}'s FP8 rows")
                assert_same(sg[r * T:(r + 1) * T], scales, f"all_gather of rank {r}'s scales")
            assert_same(out, reference.all_reduce([rows_of_x] * W), f"{rs_how}: sum over ranks of this rank's rows")

        ops.append(Op(f"{ctx.baseline}_fp8", run_fp8_baseline, check_fp8_baseline,
                      detail=f"quantize_fp8(x); all_gather of the FP8 bytes, scales, topk_idx, topk_weights; "
                             f"dequantize_fp8 + {rs_how}"))
    return ops
