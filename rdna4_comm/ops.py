"""torch.ops.rdna4_comm.*: fake (meta) implementations and the per-process
table of communicator shapes they read.

The schemas and the real CPU/CUDA implementations are registered by the C++
extension (csrc/ops.cpp). Output shapes never depend on data: dispatch returns
fixed-capacity buffers, so the ops trace under torch.compile(fullgraph=True).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _C  # noqa: F401  (loads the schemas into torch.ops.rdna4_comm)


@dataclass(frozen=True)
class OpShapes:
    """What a fake needs to know about a communicator: its output shapes."""

    world: int
    cap: int
    hidden: int
    topk: int
    dtype: torch.dtype
    device: torch.device


_SHAPES: dict[str, OpShapes] = {}


def register_shapes(comm_id: str, shapes: OpShapes) -> None:
    _SHAPES[comm_id] = shapes


def unregister_shapes(comm_id: str) -> None:
    _SHAPES.pop(comm_id, None)


def _shapes(comm_id: str, op: str, **tensors) -> OpShapes:
    try:
        s = _SHAPES[comm_id]
    except KeyError:
        raise ValueError(
            f"rdna4_comm: no open communicator with id {comm_id!r} in this process "
            "(it was closed, or never created here)"
        ) from None
    # The C++ ops check everything else; a call with a tensor on another
    # device (meta included) reaches this fake instead of them.
    for arg, t in tensors.items():
        if t is not None and t.device != s.device:
            raise ValueError(f"{op}: {arg} must be on {s.device} (the communicator's device), got {t.device}")
    return s


@torch.library.register_fake("rdna4_comm::all_reduce")
def _all_reduce_fake(x: torch.Tensor, comm: str) -> torch.Tensor:
    _shapes(comm, "all_reduce", x=x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("rdna4_comm::dispatch")
def _dispatch_fake(x, topk_idx, topk_weights, comm):
    s = _shapes(comm, "dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights)
    rows = s.world * s.cap
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty((rows, s.hidden), dtype=s.dtype),
        x.new_empty((rows, s.topk), **i32),
        x.new_empty((rows if topk_weights is not None else 0, s.topk), dtype=torch.float32),
        x.new_empty((s.world,), **i32),
        x.new_empty((rows,), **i32),
        x.new_empty((s.world,), **i32),
        x.new_empty((x.shape[0],), **i32),
    )


@torch.library.register_fake("rdna4_comm::combine")
def _combine_fake(y, recv_src, counts, src_tokens, send_mask, comm):
    s = _shapes(comm, "combine", y=y, recv_src=recv_src, counts=counts, src_tokens=src_tokens,
                send_mask=send_mask)
    return y.new_empty((send_mask.shape[0], s.hidden))
