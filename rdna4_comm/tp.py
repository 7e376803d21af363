"""A tensor-parallel Llama-style MLP block, to read and copy.

The MLP of a decoder layer sharded over the ranks of a communicator:
gate and up projections column-parallel (rank r holds rows
[r*F/W, (r+1)*F/W) of each, so it computes its slice of the activation with no
communication), the down projection row-parallel (rank r holds the matching
columns, so each rank produces partial sums of the whole output), and then one
collective, ``Communicator.all_reduce_rmsnorm``, which sums the partials, adds
the residual stream and applies the next layer's RMSNorm::

    normed, residual = block(normed, residual)   # the next layer's input, the new residual

Without the fused op the same step is ``all_reduce``, an add and an RMSNorm
(:meth:`TensorParallelMLP.unfused`, the same values bit for bit in
residual_out). :func:`dense_mlp_block` is the single-process block with the
same weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference
from .communicator import Communicator


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


def dense_mlp_block(normed: torch.Tensor, residual: torch.Tensor, weights: dict[str, torch.Tensor],
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded block: (next layer's normed input, new residual)."""
    act = F.silu(normed @ weights["gate"].T) * (normed @ weights["up"].T)
    r = act @ weights["down"].T + residual
    return reference.rms_norm(r, weights["next_norm"], eps), r


class TensorParallelMLP(torch.nn.Module):
    """This rank's shard of the MLP block; ``ffn`` must be a multiple of the world size."""

    def __init__(self, comm: Communicator, weights: dict[str, torch.Tensor], eps: float = 1e-6):
        super().__init__()
        ffn = weights["gate"].shape[0]
        W, r = comm.world_size, comm.rank
        if ffn % W:
            raise ValueError(f"TensorParallelMLP: ffn ({ffn}) must be a multiple of the world size ({W})")
        rows = slice(r * ffn // W, (r + 1) * ffn // W)
        dev = comm.device
        self.comm, self.eps = comm, eps
        self.gate = torch.nn.Parameter(weights["gate"][rows].to(dev), requires_grad=False)
        self.up = torch.nn.Parameter(weights["up"][rows].to(dev), requires_grad=False)
        self.down = torch.nn.Parameter(weights["down"][:, rows].contiguous().to(dev), requires_grad=False)
        self.next_norm = torch.nn.Parameter(weights["next_norm"].to(dev), requires_grad=False)

    def partial(self, normed: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the block's output (row-parallel down projection)."""
        return (F.silu(normed @ self.gate.T) * (normed @ self.up.T)) @ self.down.T

    def forward(self, normed: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.comm.all_reduce_rmsnorm(self.partial(normed), residual, self.next_norm, self.eps)

    def unfused(self, normed: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same step as three: all_reduce, add, RMSNorm."""
        r = self.comm.all_reduce(self.partial(normed)) + residual
        return reference.rms_norm(r, self.next_norm, self.eps), r
