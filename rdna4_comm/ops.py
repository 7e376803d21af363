"""torch.ops.rdna4_comm.*: the ops' fake (meta) implementations, the access
to their outputs by name, and the ordering token every op takes.

Every op is declared once, in the C++ extension (csrc/ops.cpp, the op
table): its arguments, its outputs by name, their shape rule and its
kernel. The schemas, the kernels and the eager entry points are made from
it there; the fakes and :func:`output_getter` here, from ``_C.op_table()``
and ``_C.output_specs``. Output shapes never depend on data: dispatch
returns fixed-capacity buffers, so the ops trace under
torch.compile(fullgraph=True).

Every op is a collective, so a compiler must neither drop one whose result is
unused (a rank with no tokens still has to take part) nor reorder two of them
(every rank must issue them in the same order). Each op's schema therefore
declares that it writes the ordering token of its device (``Tensor(a!)
order``): a write is never dead code, and writes to one tensor keep program
order. The ops never read or change the token's value.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from . import _C  # also loads the schemas into torch.ops.rdna4_comm

# Each op's declaration: name, method, args [(name, kind)], outputs, token source.
OP_TABLE = {op["name"]: op for op in _C.op_table()}

_ORDER_TOKENS: dict[torch.device, torch.Tensor] = {}

# The Communicator methods call the ops' .default overloads directly (no
# overload resolution per call) where torch.compile traces them, and in
# eager calls the extension's entry points (_C.eager), which take plain
# tensors to the ops' kernels without boxing their arguments through the
# dispatcher, and hand anything else to the op itself (csrc/ops.cpp, at
# namespace eager).
_OPS = torch.ops.rdna4_comm
_EAGER = {name: getattr(_C.eager, name) for name in OP_TABLE}


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


def output_getter(op: str, *names: str) -> Callable[[tuple], Sequence]:
    """A function that takes op ``op``'s outputs (a tuple) to those named
    ``names``, in that order: the methods unpack the ops' results by name.
    A plain function, which torch.compile traces (an operator.itemgetter it
    does not). Names in the op's own order take the tuple as it is: an
    eager call pays no copy."""
    outputs = OP_TABLE[op]["outputs"]
    missing = [n for n in names if n not in outputs]
    if missing:
        raise ValueError(f"{op} has no output {missing}; it has {outputs}")
    positions = tuple(outputs.index(n) for n in names)
    if positions == tuple(range(len(outputs))):
        return _same_tuple

    def get(out: tuple) -> list:
        return [out[i] for i in positions]

    return get


def _same_tuple(out: tuple) -> tuple:
    return out


def _check_devices(comm_id: str, op: str, tensors: dict) -> None:
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


def _fake(decl: dict):
    """The fake of the op ``decl`` declares: its outputs as _C.output_specs
    gives them, each an empty tensor of its spec (shape, with _C.token_dim
    where the call's token count goes, and dtype) or like an argument."""
    names = [name for name, _ in decl["args"]]
    every = [*names, "order", "comm"]

    def fake(*args, **kwargs):
        *own, order, comm = (*args, *(kwargs[name] for name in every[len(args):]))
        tensors = {name: a for name, a in zip(names, own) if isinstance(a, torch.Tensor)}
        _check_devices(comm, decl["method"], {**tensors, "order": order})
        specs = _C.output_specs(decl["name"], comm, [a.dtype if isinstance(a, torch.Tensor) else None for a in own])
        source = own[decl["tokens_arg"]]
        tokens = math.prod(source.shape[:-1]) if decl["tokens_leading"] else source.shape[0]
        outputs = tuple(
            torch.empty_like(own[spec], memory_format=torch.contiguous_format) if isinstance(spec, int)
            else source.new_empty(tuple(tokens if n == _C.token_dim else n for n in spec[0]), dtype=spec[1])
            for spec in specs
        )
        return outputs[0] if len(outputs) == 1 else outputs

    return fake


for _decl in OP_TABLE.values():
    torch.library.register_fake(f"rdna4_comm::{_decl['name']}")(_fake(_decl))
