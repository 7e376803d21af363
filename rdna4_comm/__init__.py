"""rdna4_comm: direct peer-to-peer MoE dispatch/combine and all_reduce for PyTorch.

    import rdna4_comm as rc
    comm = rc.Communicator(max_tokens_per_rank=256, hidden=4096, topk=8, num_experts=64)
    d = comm.dispatch(x, topk_idx, topk_weights)       # -> rc.Dispatched
    out = comm.combine(expert_out, d.handle)           # -> [T, H]
    y = comm.all_reduce(t)
"""
from . import ops as _ops  # noqa: F401  (schemas and fakes)
from . import reference
from .communicator import Communicator, DispatchHandle, Dispatched, allreduce_algorithm
from .ops import mark_dynamic_tokens

__all__ = ["Communicator", "Dispatched", "DispatchHandle", "allreduce_algorithm", "mark_dynamic_tokens", "reference"]
__version__ = "0.1.0"
