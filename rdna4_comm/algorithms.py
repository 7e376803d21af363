"""Which algorithm an op of :class:`rdna4_comm.Communicator` takes: the same
predicates the C++ ops use (csrc/policies.h), for callers who plan around them."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C

def allreduce_algorithm(nbytes: int, world_size: int, transport: str) -> str:
    """The all_reduce path for a tensor of ``nbytes``: "one_shot" or "two_shot"
    (the predicate the C++ ops use, see csrc/policies.h)."""
    return "one_shot" if _C.allreduce_use_one_shot(nbytes, world_size, transport) else "two_shot"


def all_reduce_rmsnorm_algorithm(
    tokens: int, hidden: int, dtype: torch.dtype, world_size: int, transport: str,
    allreduce_slot_bytes: Optional[int] = None,
) -> str:
    """The path :meth:`Communicator.all_reduce_rmsnorm` takes for ``tokens``
    rows of ``hidden`` elements: "one_stage", "two_stage", or
    "all_reduce_then_norm" when a row does not fit the communicator's
    all_reduce slot (``allreduce_slot_bytes``, default the transport's). The
    predicate the C++ op itself uses (csrc/policies.h, rmsnorm_path)."""
    slot = _C.allreduce_slot_bytes(transport, allreduce_slot_bytes or 0)
    elt = torch.empty((), dtype=dtype).element_size()
    return _C.rmsnorm_path(tokens, hidden, elt, world_size, transport, slot)


def all_reduce_rmsnorm_row_in_registers(hidden: int, dtype: torch.dtype) -> bool:
    """Whether the GPU kernel keeps a row of ``hidden`` elements in registers
    (its fast path: whole 16-byte vectors, at most
    ``_C.rmsnorm_register_row_elems(element size)`` elements); other rows are
    re-read from residual_out. Same result either way."""
    return _C.rmsnorm_row_in_registers(hidden, torch.empty((), dtype=dtype).element_size())
