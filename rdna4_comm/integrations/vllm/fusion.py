"""A compile pass: vLLM's tensor-parallel all_reduce followed by its RMSNorm
becomes the library's fused ``all_reduce_rmsnorm``.

Once the plugin routes the tensor-parallel all_reduce (:mod:`.collectives`),
vLLM's compiled graphs hold ``rdna4_comm.all_reduce`` and, where a decoder
layer ends, ``vllm_ir.fused_add_rms_norm`` (or ``vllm_ir.rms_norm``) of its
result. :func:`fuse_all_reduce_rmsnorm` rewrites each such pair into one
``rdna4_comm.all_reduce_rmsnorm`` (one kernel, one trip through memory,
docs/semantics.md section 8). The pass runs among vLLM's post-grad passes,
which vLLM runs on CUDA/ROCm (its CPU build compiles without them); the
rewrite itself is a plain function of an FX graph, tested on CPU.

What changes in the numbers: ``residual_out`` is bitwise vLLM's. vLLM
normalises the fp32 sum before rounding it to the residual's dtype; the
fused op normalises the rounded residual (the HF formula), so ``out`` can
differ by the rounding of the residual's dtype.
"""
from __future__ import annotations

import functools
import operator
from typing import Optional

import torch
from torch import fx

from . import config


def _auto_functionalized_ops() -> tuple:
    higher_order = torch.ops.higher_order
    return (higher_order.auto_functionalized, higher_order.auto_functionalized_v2)


def _item(node: fx.Node, index: int) -> Optional[fx.Node]:
    """The ``getitem(node, index)`` user of ``node``, if any."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def _val(node) -> Optional[torch.Tensor]:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _norm_operands(norm: fx.Node) -> Optional[tuple]:
    """(residual or None, weight, eps) of a vLLM IR RMSNorm node, or None
    where the fused op does not compute the same thing (no weight, a
    variance over part of the row)."""
    ir = torch.ops.vllm_ir
    args = list(norm.args) + [None] * 5
    if norm.target is ir.fused_add_rms_norm.default:
        residual, weight, eps, variance_size = args[1], args[2], args[3], norm.kwargs.get("variance_size", args[4])
    elif norm.target is ir.rms_norm.default:
        residual, weight, eps, variance_size = None, args[1], args[2], norm.kwargs.get("variance_size", args[3])
    else:
        return None
    if weight is None or variance_size is not None or not isinstance(eps, float) or not eps > 0:
        return None
    return residual, weight, eps


def _fusable(x, residual, weight) -> bool:
    """The fused op's argument rules (docs/semantics.md section 8), on the traced values."""
    x, residual, weight = _val(x), _val(residual), _val(weight)
    if x is None or weight is None:
        return False
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return False
    return weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.dtype in (x.dtype, torch.float32)


def fuse_all_reduce_rmsnorm(graph: fx.Graph) -> int:
    """Rewrite every ``rdna4_comm.all_reduce`` whose result feeds only a vLLM
    IR RMSNorm (with or without residual) into ``rdna4_comm.all_reduce_rmsnorm``,
    in a functionalised (post-grad) graph; returns how many were fused."""
    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)

    all_reduce = torch.ops.rdna4_comm.all_reduce.default
    fused_op = torch.ops.rdna4_comm.all_reduce_rmsnorm.default
    fused = 0
    for node in list(graph.nodes):
        if node.target not in _auto_functionalized_ops() or node.args[0] is not all_reduce:
            continue
        result = _item(node, 0)
        if result is None or len(result.users) != 1:
            continue
        norm = next(iter(result.users))
        operands = _norm_operands(norm)
        if operands is None or norm.args[0] is not result:
            continue
        residual, weight, eps = operands
        if not _fusable(node.kwargs["x"], residual, weight):
            continue
        with_residual = norm.target is torch.ops.vllm_ir.fused_add_rms_norm.default
        x_val = _val(node.kwargs["x"])
        with graph.inserting_before(norm):
            kwargs = dict(node.kwargs, residual=residual, weight=weight, eps=eps)
            call = graph.call_function(node.target, (fused_op,), kwargs)
            out = graph.call_function(operator.getitem, (call, 0))
            residual_out = graph.call_function(operator.getitem, (call, 1))
            order = graph.call_function(operator.getitem, (call, 2))
        order_before = _item(node, 1)
        out.meta["val"] = x_val.new_empty(x_val.shape) if x_val is not None else None
        residual_out.meta["val"] = out.meta["val"]
        if order_before is not None:
            order.meta.update(order_before.meta)
        call.meta["val"] = (out.meta["val"], residual_out.meta["val"], order.meta.get("val"))
        if with_residual:
            for index, new in ((0, out), (1, residual_out)):
                old = _item(norm, index)
                if old is not None:
                    old.replace_all_uses_with(new)
                    graph.erase_node(old)
        else:
            norm.replace_all_uses_with(out)
        graph.erase_node(norm)
        if order_before is not None:
            order_before.replace_all_uses_with(order)
            graph.erase_node(order_before)
        graph.erase_node(result)
        graph.erase_node(node)
        fused += 1
    if fused:
        graph.eliminate_dead_code()
    return fused


@functools.lru_cache(maxsize=None)
def _pass_class():
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

    class AllReduceRMSNormFusionPass(VllmInductorPass):
        """vLLM's post-grad pass around :func:`fuse_all_reduce_rmsnorm`."""

        @VllmInductorPass.time_and_log
        def __call__(self, graph: fx.Graph) -> None:
            self.fused = fuse_all_reduce_rmsnorm(graph)

    return AllReduceRMSNormFusionPass


def install() -> None:
    """Patch vLLM (0.32): where it runs its post-grad passes (its VLLM_COMPILE
    mode, on CUDA/ROCm; its CPU build traces once, without them) and the
    plugin routes the tensor-parallel all_reduce, the fusion pass runs after
    vLLM's own fusions."""
    from vllm.compilation.passes import pass_manager

    configure = pass_manager.PostGradPassManager.configure

    @functools.wraps(configure)
    def configure_with_fusion(self, vllm_config):
        configure(self, vllm_config)
        options = config.PluginConfig.from_additional_config(vllm_config.additional_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if options.fuse_all_reduce_rmsnorm and options.all_reduce and tp > 1:
            self.passes.append(_pass_class()(vllm_config))

    pass_manager.PostGradPassManager.configure = configure_with_fusion
