"""rdna4_comm: direct peer-to-peer MoE dispatch/combine and all_reduce for PyTorch.

    import rdna4_comm as rc
    comm = rc.Communicator(max_tokens_per_rank=256, hidden=4096, topk=8, num_experts=64)
    d = comm.dispatch(x, topk_idx, topk_weights)       # -> rc.Dispatched
    out = comm.combine(expert_out, d.handle)           # -> [T, H]
    y = comm.all_reduce(t)
    out, residual = comm.all_reduce_rmsnorm(partial, residual, norm_weight)
"""
from . import ops as _ops  # noqa: F401  (schemas and fakes)
from . import reference
from .algorithms import all_reduce_rmsnorm_algorithm, all_reduce_rmsnorm_row_in_registers, allreduce_algorithm
from .communicator import Communicator
from .fp8 import dequantize_fp8, quantize_fp8
from .results import DispatchHandle, Dispatched, ExpertDispatched
from .ops import mark_dynamic_tokens

__all__ = [
    "Communicator", "Dispatched", "DispatchHandle", "ExpertDispatched", "all_reduce_rmsnorm_algorithm",
    "all_reduce_rmsnorm_row_in_registers", "allreduce_algorithm", "dequantize_fp8", "mark_dynamic_tokens",
    "quantize_fp8", "reference",
]
__version__ = "0.1.0"
