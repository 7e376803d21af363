"""Tensor parallelism on a communicator: :class:`TensorParallelMLP`, the
tensor-parallel form of a LlamaMLP-style block (the Hugging Face
integration's, and the demo's and tests' TP block).

Rank r holds rows [r*I/W, (r+1)*I/W) of the gate and up projections
(column-parallel: it computes its slice of the activation with no
communication) and the matching columns of the down projection
(row-parallel: each rank produces partial sums of the whole output). Then
one collective: ``Communicator.all_reduce`` (:meth:`TensorParallelMLP.forward`),
or ``Communicator.all_reduce_rmsnorm``, which also adds the residual stream
and applies the next layer's RMSNorm (:meth:`TensorParallelMLP.forward_norm`)::

    normed, residual = mlp.forward_norm(normed, residual, next_norm_weight)

Without the fused op that step is ``all_reduce``, an add and an RMSNorm
(:meth:`TensorParallelMLP.forward_norm_unfused`, the same values bit for bit
in residual_out). :func:`init_weights`, :class:`LlamaStyleMLP` and
:func:`dense_mlp_block` build a block and its single-process reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .communicator import Communicator


def _column_shard(linear: nn.Linear, rows: slice) -> nn.Linear:
    """Output features ``rows`` of ``linear`` (weight rows and bias)."""
    part = nn.Linear(linear.in_features, rows.stop - rows.start, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            part.bias.copy_(linear.bias[rows])
    return part


def _row_shard(linear: nn.Linear, cols: slice) -> nn.Linear:
    """Input features ``cols`` of ``linear`` (weight columns); the bias is kept
    whole, to be added once after the reduction."""
    part = nn.Linear(cols.stop - cols.start, linear.out_features, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(linear.weight[:, cols])
        if linear.bias is not None:
            part.bias.copy_(linear.bias)
    return part


class TensorParallelMLP(nn.Module):
    """The tensor-parallel form of a LlamaMLP-style block,
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.

    Rank ``r`` holds rows ``[r*I/W, (r+1)*I/W)`` of ``gate_proj`` and ``up_proj``
    (column-parallel) and the same columns of ``down_proj`` (row-parallel), so
    its down projection is a partial sum of the output, in the MLP's dtype;
    ``comm.all_reduce`` adds the partial sums in fp32 in rank order, rounded
    once, bitwise identical on every rank. Every rank passes the same ``x``.

    The reduction is kept apart from the rest (:meth:`partial_sum`), so a
    decoder layer can hand the partial sum to the fused all_reduce + residual
    + RMSNorm (:meth:`forward_norm`) instead of calling :meth:`forward`.

    Args:
        mlp: a module with ``gate_proj``, ``up_proj``, ``down_proj``
            (``nn.Linear``) and ``act_fn`` (``activation_fn`` in Llama-4), e.g.
            ``LlamaMLP``, ``Qwen3MoeMLP``, ``DeepseekV3MLP``. Not changed.
        comm: any communicator of the group (EP fields not needed); the
            intermediate size must be a multiple of its world size.
    """

    def __init__(self, mlp: nn.Module, comm: Communicator):
        super().__init__()
        intermediate = mlp.gate_proj.out_features
        if intermediate % comm.world_size:
            raise ValueError(
                f"intermediate size {intermediate} is not a multiple of the world size {comm.world_size}"
            )
        n = intermediate // comm.world_size
        mine = slice(comm.rank * n, (comm.rank + 1) * n)
        self.comm = comm
        self.gate_proj = _column_shard(mlp.gate_proj, mine)
        self.up_proj = _column_shard(mlp.up_proj, mine)
        self.down_proj = _row_shard(mlp.down_proj, mine)
        self.act_fn = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the reduction and without
        ``down_proj``'s bias (added once, after it)."""
        return F.linear(self.act_fn(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(self.partial_sum(x))
        return out if self.down_proj.bias is None else out + self.down_proj.bias

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(r, norm_weight, eps), r)`` for ``r = forward(x) +
        residual``, in one ``all_reduce_rmsnorm`` (down_proj's bias, if
        any, joins the residual first)."""
        return self.comm.all_reduce_rmsnorm(self.partial_sum(x), self._with_bias(residual), norm_weight, eps)

    def forward_norm_unfused(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_norm` as three steps: all_reduce, add, RMSNorm."""
        r = self.comm.all_reduce(self.partial_sum(x)) + self._with_bias(residual)
        return reference.rms_norm(r, norm_weight, eps), r

    def _with_bias(self, residual: torch.Tensor) -> torch.Tensor:
        return residual if self.down_proj.bias is None else residual + self.down_proj.bias


def init_weights(seed: int, hidden: int, ffn: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights: gate and up [ffn, hidden], down [hidden, ffn],
    next_norm [hidden] (the next layer's RMSNorm weight)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": (torch.randn(ffn, hidden, generator=g) / hidden**0.5).to(dtype),
        "up": (torch.randn(ffn, hidden, generator=g) / hidden**0.5).to(dtype),
        "down": (torch.randn(hidden, ffn, generator=g) / ffn**0.5).to(dtype),
        "next_norm": (1 + torch.randn(hidden, generator=g) / 8).to(dtype),
    }


class LlamaStyleMLP(nn.Module):
    """A LlamaMLP-style module (``gate_proj``, ``up_proj``, ``down_proj``
    without bias, SiLU ``act_fn``) holding :func:`init_weights`' weights, on
    ``device`` (default the CPU)."""

    def __init__(self, weights: dict[str, torch.Tensor], device: Optional[torch.device] = None):
        super().__init__()
        ffn, hidden = weights["gate"].shape
        for name, (fan_in, fan_out) in (("gate", (hidden, ffn)), ("up", (hidden, ffn)), ("down", (ffn, hidden))):
            linear = nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=weights[name].dtype)
            with torch.no_grad():
                linear.weight.copy_(weights[name])
            setattr(self, f"{name}_proj", linear)
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def dense_mlp_block(normed: torch.Tensor, residual: torch.Tensor, weights: dict[str, torch.Tensor],
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded block, the reference of :meth:`TensorParallelMLP.forward_norm`:
    (next layer's normed input, new residual)."""
    r = LlamaStyleMLP(weights, normed.device)(normed) + residual
    return reference.rms_norm(r, weights["next_norm"], eps), r
