"""A small expert-parallel MoE layer to read and copy.

    router -> dispatch -> local experts -> combine

Every rank holds the (replicated) router and its ``E/W`` experts, and routes
its own tokens. The local-expert step applies the routing weights and reduces
each received row's local experts into one row, one expert at a time; combine
then sums each token's rows from all ranks. :func:`dense_moe` computes the same
layer in one process from the same weights.

The expert step runs every local expert densely over all ``W*cap`` received
rows, masked by the routing weights: shapes stay static, so the layer compiles
with ``torch.compile(fullgraph=True)`` and replays in CUDA graphs. A
production layer would run a grouped GEMM over rows ``[0, counts.sum())``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .communicator import Communicator
from .fp8 import dequantize_fp8


def init_weights(seed: int, num_experts: int, hidden: int, ffn: int):
    """Deterministic float32 weights on the CPU, identical on every rank:
    router [E, H], w_in [E, F, H], w_out [E, H, F]."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=g) / hidden**0.5
    w_in = torch.randn(num_experts, ffn, hidden, generator=g) / hidden**0.5
    w_out = torch.randn(num_experts, hidden, ffn, generator=g) / ffn**0.5
    return router, w_in, w_out


def route(x: torch.Tensor, router: torch.Tensor, topk: int):
    """Top-k softmax routing: (topk_idx [T, K] int64, topk_weights [T, K] float32)."""
    probs = torch.softmax(x.float() @ router.t(), dim=-1)
    weights, idx = torch.topk(probs, topk, dim=-1)
    return idx, weights / weights.sum(-1, keepdim=True)


def expert(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One SiLU MLP expert in float32: [R, H] -> [R, H]."""
    return F.silu(x.float() @ w_in.t()) @ w_out.t()


def weighted_experts(x, idx, weights, w_in, w_out) -> torch.Tensor:
    """[R, H] rows -> [R, H] in x's dtype: each row's routing-weighted sum of
    the outputs of experts ``0..len(w_in)-1`` (ids in ``idx`` [R, K]; other ids,
    -1 included, contribute nothing), one expert at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_in.shape[0]):
        w_e = (weights * (idx == e)).sum(-1, keepdim=True)
        out = out + w_e * expert(x, w_in[e], w_out[e])
    return out.to(x.dtype)


def dense_moe(x, router, w_in, w_out, topk: int) -> torch.Tensor:
    """Single-process MoE over all experts: [T, H] -> [T, H] in x's dtype."""
    idx, weights = route(x, router, topk)
    return weighted_experts(x, idx, weights, w_in, w_out)


class ExpertParallelMoE(torch.nn.Module):
    """Expert-parallel MoE layer over a :class:`Communicator` with EP fields.

    Args:
        comm: gives H (hidden), K (topk), E (num_experts), W and the dtype.
        ffn: expert inner width.
        seed: weight seed; every rank must pass the same one.
    """

    def __init__(self, comm: Communicator, *, ffn: int, seed: int = 0):
        super().__init__()
        self.comm = comm
        self.topk = comm.topk
        mine = slice(comm.local_experts.start, comm.local_experts.stop)
        router, w_in, w_out = init_weights(seed, comm.num_experts, comm.hidden, ffn)
        self.register_buffer("router", router.to(comm.device))
        self.register_buffer("w_in", w_in[mine].contiguous().to(comm.device))
        self.register_buffer("w_out", w_out[mine].contiguous().to(comm.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] of the communicator dtype, T <= max_tokens_per_rank -> [T, H].

        Compile it with ``torch.compile(layer, fullgraph=True)`` and pass
        ``rdna4_comm.mark_dynamic_tokens(x)``: one graph serves every T."""
        idx, weights = route(x, self.router, self.topk)
        d = self.comm.dispatch(x, idx, weights)
        # FP8 dispatch: the experts take the communicator dtype.
        rows = d.x if d.x_scales is None else dequantize_fp8(d.x, d.x_scales, self.comm.dtype)
        # Received rows carry local expert ids; padding rows (all -1) give zeros.
        y = weighted_experts(rows, d.topk_idx, d.topk_weights, self.w_in, self.w_out)
        return self.comm.combine(y, d.handle)
