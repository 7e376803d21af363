"""Communicators over vLLM's process groups, and the tensor-parallel
all_reduce through them.

A communicator is created collectively over a group's gloo group
(``GroupCoordinator.cpu_group``) once vLLM has made its groups, named after
the group (``vllm.tp:0``, say) rather than the process, so that compiled
graphs, which hold the name as a constant, stay valid in another process.
It is closed when vLLM destroys the group (``GroupCoordinator.destroy``).

The tensor-parallel group's ``all_reduce`` becomes ``comm.all_reduce``: its
class is swapped for a subclass that overrides ``all_reduce`` and
``_all_reduce_out_place``, so both vLLM's direct calls (traced by
torch.compile into the graph) and its opaque ``torch.ops.vllm.all_reduce``
reach the library.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ...communicator import Communicator
from . import config

# Where a GroupCoordinator keeps its communicators, by name.
_COMMS = "_rdna4_comm_communicators"
ALL_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def communicator(group, suffix: str = "", **fields) -> Communicator:
    """The communicator over ``group`` (a vLLM GroupCoordinator) named
    ``vllm.<group>`` + ``suffix``, created on first use. Collective the first
    time: every rank of the group asks for it at the same point."""
    comms = group.__dict__.setdefault(_COMMS, {})
    name = f"vllm.{group.unique_name}{suffix}"
    comm = comms.get(name)
    if comm is None:
        options = config.current()
        comm = comms[name] = Communicator(group.cpu_group, transport=options.transport,
                                          timeout_ms=options.timeout_ms, name=name, **fields)
    return comm


def close_communicators(group) -> None:
    """Close every communicator over ``group`` (local; before vLLM destroys it)."""
    for comm in group.__dict__.pop(_COMMS, {}).values():
        comm.close()


class LibraryAllReduce:
    """Placed before a GroupCoordinator's class: its all_reduce through
    ``comm.all_reduce`` (fp32 sum in rank order, bitwise the same on every
    rank); other dtypes keep vLLM's."""

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        return self._all_reduce_out_place(input_)

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.dtype not in ALL_REDUCE_DTYPES:
            return super()._all_reduce_out_place(input_)
        return communicator(self).all_reduce(input_.contiguous())


@functools.lru_cache(maxsize=None)
def _with_library_all_reduce(cls: type) -> type:
    return type(f"RDNA4Comm{cls.__name__}", (LibraryAllReduce, cls), {})


def route_all_reduce(group) -> None:
    """``group``'s all_reduce through the library from now on (its
    communicator is created here, collectively)."""
    communicator(group)
    if not isinstance(group, LibraryAllReduce):
        group.__class__ = _with_library_all_reduce(type(group))


def _refuse(what: str, group) -> Callable:
    def refuse(*args, **kwargs):
        raise RuntimeError(f"rdna4_comm (strict): vLLM's own {what} was called on group {group.unique_name!r}, "
                           "which the rdna4_comm plugin routes through the library")
    return refuse


def forbid_vllm_collectives(group, names: tuple) -> None:
    """Strict mode: ``group``'s device communicator raises on ``names``."""
    device_comm = group.device_communicator
    if device_comm is None:
        return
    for name in names:
        if hasattr(device_comm, name):
            setattr(device_comm, name, _refuse(name, group))


def _after_groups_exist() -> None:
    from vllm.distributed import parallel_state

    options = config.current()
    tp = parallel_state.get_tp_group()
    if tp.world_size > 1 and options.all_reduce:
        route_all_reduce(tp)
        if options.strict:
            forbid_vllm_collectives(tp, ("all_reduce",))
    ep = parallel_state._EP
    if options.strict and options.expert_parallel and ep is not None and ep.world_size > 1:
        forbid_vllm_collectives(ep, ("dispatch", "dispatch_router_logits", "combine", "combine_into_output"))


def install() -> None:
    """Patch vLLM (0.32): communicators follow its groups' lifetimes."""
    from vllm.distributed import parallel_state

    make_groups = parallel_state.initialize_model_parallel

    @functools.wraps(make_groups)
    def initialize_model_parallel(*args, **kwargs):
        make_groups(*args, **kwargs)
        _after_groups_exist()

    parallel_state.initialize_model_parallel = initialize_model_parallel

    destroy = parallel_state.GroupCoordinator.destroy

    @functools.wraps(destroy)
    def destroy_group(self):
        close_communicators(self)
        destroy(self)

    parallel_state.GroupCoordinator.destroy = destroy_group
