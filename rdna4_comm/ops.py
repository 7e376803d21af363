"""torch.ops.rdna4_comm.*: fake (meta) implementations, which ask the C++
communicator (rdna4_comm._C.dispatch_outputs, dispatch_scales_output, combine_output) for their shapes, and the ordering
token every op takes.

The schemas and the real CPU/CUDA implementations are registered by the C++
extension (csrc/ops.cpp). Output shapes never depend on data: dispatch returns
fixed-capacity buffers, so the ops trace under torch.compile(fullgraph=True).

Every op is a collective, so a compiler must neither drop one whose result is
unused (a rank with no tokens still has to take part) nor reorder two of them
(every rank must issue them in the same order). Each op's schema therefore
declares that it writes the ordering token of its device (``Tensor(a!)
order``): a write is never dead code, and writes to one tensor keep program
order. The ops never read or change the token's value.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _C  # also loads the schemas into torch.ops.rdna4_comm


_ORDER_TOKENS: dict[torch.device, torch.Tensor] = {}

# The Communicator methods call the ops' .default overloads directly (no
# overload resolution per call) where torch.compile traces them, and in
# eager calls the extension's entry points (_C.eager), which take plain
# tensors to the ops' kernels without boxing their arguments through the
# dispatcher, and hand anything else to the op itself (csrc/ops.cpp, at
# namespace eager).
_OPS = torch.ops.rdna4_comm
_EAGER = {name: getattr(_C.eager, name)
          for name in ("all_reduce", "all_reduce_rmsnorm", "dispatch", "combine", "dispatch_expert", "combine_expert",
                       "dispatch_fp8", "dispatch_expert_fp8")}


def op_callable(name: str, compiling: Optional[bool] = None):
    """What a Communicator method calls for op ``name``: the .default
    overload while torch.compile traces (``compiling``: the caller's
    torch.compiler.is_compiling(), or None to ask), else its eager callable."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    return getattr(_OPS, name).default if compiling else _EAGER[name]


def order_token(device: torch.device) -> torch.Tensor:
    """The process's ordering token for ``device``: one per device, shared by
    every communicator there, so their collectives keep program order among
    each other too. Its address is static (for CUDA graphs under
    torch.compile mode="reduce-overhead"), and it lives as long as the process."""
    device = torch.device(device)
    token = _ORDER_TOKENS.get(device)
    if token is None:
        token = _ORDER_TOKENS[device] = torch.zeros(1, dtype=torch.int64, device=device)
        torch._dynamo.mark_static_address(token)
    return token


def mark_dynamic_tokens(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark dimension ``dim`` of ``x``, an input of a ``torch.compile``d
    function, as a token count that may take any value, 0 and 1 included;
    returns ``x``. Call it on the input before every compiled call.

    Ranks pass different token counts to the same compiled layer, and a rank's
    count changes from call to call. Compiled for one count (torch.compile's
    default) or with a plain dynamic dimension (which still specialises 0
    and 1), a new count recompiles on that rank alone while its peers already
    wait in the layer's first collective. An unbacked size gives one graph for
    every count, so every rank runs the same compiled code.
    """
    torch._dynamo.decorators.mark_unbacked(x, dim)
    return x


def _check_devices(comm_id: str, op: str, **tensors) -> None:
    """Raise unless the communicator is open here and every tensor is on its device."""
    device = _C.comm_device(comm_id)
    if device is None:
        raise ValueError(
            f"rdna4_comm: no open communicator with id {comm_id!r} in this process "
            "(it was closed, or never created here)"
        )
    # The C++ ops check everything else; a call with a tensor on another
    # device (meta included) reaches this fake instead of them.
    for arg, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{op}: {arg} must be on {device} (the communicator's device), got {t.device}")


@torch.library.register_fake("rdna4_comm::all_reduce")
def _all_reduce_fake(x: torch.Tensor, order: torch.Tensor, comm: str) -> torch.Tensor:
    _check_devices(comm, "all_reduce", x=x, order=order)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _new_output(like: torch.Tensor, spec, tokens):
    """An empty tensor of an output spec of the C++ communicator (shape with
    _C.token_dim where the token count goes, dtype) on like's device."""
    shape, dtype = spec
    return like.new_empty(tuple(tokens if n == _C.token_dim else n for n in shape), dtype=dtype)


@torch.library.register_fake("rdna4_comm::dispatch")
def _dispatch_fake(x, topk_idx, topk_weights, order, comm):
    _check_devices(comm, "dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights, order=order)
    tokens = math.prod(x.shape[:-1])  # leading dimensions of x are tokens
    specs = _C.dispatch_outputs(comm, topk_idx.dtype, topk_weights.dtype if topk_weights is not None else None)
    return tuple(_new_output(x, spec, tokens) for spec in specs)


@torch.library.register_fake("rdna4_comm::dispatch_expert")
def _dispatch_expert_fake(x, topk_idx, topk_weights, order, comm):
    _check_devices(comm, "dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights, order=order)
    tokens = math.prod(x.shape[:-1])
    specs = _C.dispatch_expert_outputs(comm, topk_weights.dtype if topk_weights is not None else None)
    return tuple(_new_output(x, spec, tokens) for spec in specs)


def _with_scales(outputs: tuple, x, x_scales, comm: str, expert_layout: bool) -> tuple:
    """An FP8 dispatch's outputs: those of its layout's op, then x_scales."""
    _check_devices(comm, "dispatch", x_scales=x_scales)
    return (*outputs, _new_output(x, _C.dispatch_scales_output(comm, expert_layout), math.prod(x.shape[:-1])))


@torch.library.register_fake("rdna4_comm::dispatch_fp8")
def _dispatch_fp8_fake(x, x_scales, topk_idx, topk_weights, order, comm):
    return _with_scales(_dispatch_fake(x, topk_idx, topk_weights, order, comm), x, x_scales, comm, False)


@torch.library.register_fake("rdna4_comm::dispatch_expert_fp8")
def _dispatch_expert_fp8_fake(x, x_scales, topk_idx, topk_weights, order, comm):
    return _with_scales(_dispatch_expert_fake(x, topk_idx, topk_weights, order, comm), x, x_scales, comm, True)


@torch.library.register_fake("rdna4_comm::combine_expert")
def _combine_expert_fake(y, expert_rows_of, recv_src, counts, src_tokens, send_mask, dispatch_round, order, comm):
    _check_devices(comm, "combine", y=y, expert_rows_of=expert_rows_of, recv_src=recv_src, counts=counts,
                   src_tokens=src_tokens, send_mask=send_mask, dispatch_round=dispatch_round, order=order)
    return _new_output(y, _C.combine_output(comm), send_mask.shape[0])


@torch.library.register_fake("rdna4_comm::combine")
def _combine_fake(y, recv_src, counts, src_tokens, send_mask, dispatch_round, order, comm):
    _check_devices(comm, "combine", y=y, recv_src=recv_src, counts=counts, src_tokens=src_tokens,
                   send_mask=send_mask, dispatch_round=dispatch_round, order=order)
    return _new_output(y, _C.combine_output(comm), send_mask.shape[0])


@torch.library.register_fake("rdna4_comm::all_reduce_rmsnorm")
def _all_reduce_rmsnorm_fake(x, residual, weight, eps, order, comm):
    _check_devices(comm, "all_reduce_rmsnorm", x=x, residual=residual, weight=weight, order=order)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(out)
