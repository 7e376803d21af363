"""vLLM's expert-parallel MoE layers over ``comm.dispatch`` and ``comm.combine``.

vLLM runs a MoE layer as ``FusedMoEKernel(prepare_finalize, fused_experts)``:
``prepare`` moves tokens to the ranks of their experts, the experts compute,
``finalize`` brings the results back. Where vLLM runs expert parallelism, the
plugin replaces the ``prepare_finalize`` the kernel was built with by one of
these (``FusedMoEKernel.__init__`` is wrapped), keeping vLLM's experts:

- :class:`RankLayoutPrepareFinalize` for experts of the Standard activation
  format (``[rows, H]`` with per-row top-k ids): ``dispatch`` in the rank
  layout, ``combine`` of the experts' weighted row sums;
- :class:`ExpertLayoutPrepareFinalize` for BatchedExperts
  (``[E_loc, slots, H]`` with per-expert counts): ``dispatch(layout="expert")``,
  whose rows grouped by local expert are laid out per expert.

Tokens: with data parallelism every rank dispatches its own tokens. The
ranks of a tensor-parallel group hold the same tokens, so each dispatches
the share :func:`token_share` gives it; ``finalize`` leaves this rank's
share of the result in its rows and zeros in the others, and vLLM's own
final tensor-parallel all_reduce of the MoE output (through the library
when the plugin routes it) completes every row: ``output_is_reduced()`` is
False.

A layer the plugin cannot route (:func:`unroutable`) keeps vLLM's
prepare/finalize with a warning, or fails in strict mode.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ... import _C
from . import collectives, config

logger = logging.getLogger("rdna4_comm.integrations.vllm")
EP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def token_share(tokens, rank: int, ranks: int) -> tuple:
    """Rows ``[start, end)`` of ``tokens`` that ``rank`` of ``ranks`` holding
    the same tokens dispatches: contiguous, sizes differing by at most one,
    together every row once. ``tokens`` may be a SymInt under torch.compile."""
    return (rank * tokens) // ranks, ((rank + 1) * tokens) // ranks


def share_capacity(max_tokens: int, ranks: int) -> int:
    """``cap`` for layers of up to ``max_tokens`` tokens shared by ``ranks``
    ranks: one more than ``max_tokens // ranks``, so at least the largest
    share :func:`token_share` gives, and the receive buffer's ``W * cap``
    rows exceed every token count. vLLM compares the experts' output rows
    with the layer's tokens; under torch.compile a buffer exactly as long as
    the traced token count would specialise the dynamic token dimension."""
    return max_tokens // ranks + 1


def experts_take_local_ids(experts) -> bool:
    """Whether vLLM's ``experts`` index their weights with the ids as given
    (local ids ``[0, E_loc)``): vLLM's CPU experts, and those that declare
    ``supports_expert_map() == False``. The others take global ids and map
    them through the layer's ``expert_map`` (-1: not on this rank)."""
    from vllm.platforms import current_platform

    declared = getattr(experts, "supports_expert_map", None)
    return current_platform.is_cpu() or (declared is not None and not declared())


def unroutable(experts, vllm_config) -> Optional[str]:
    """Why the plugin cannot route this MoE layer's dispatch and combine, or None."""
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    moe = experts.moe_config
    pc = moe.moe_parallel_config
    parallel = vllm_config.parallel_config if vllm_config is not None else None
    if not isinstance(experts, mk.FusedMoEExpertsModular):
        return f"its experts ({type(experts).__name__}) route inside their own kernel (monolithic)"
    if pc.pcp_size > 1:
        return "prefill context parallelism splits its tokens"
    if pc.is_sequence_parallel:
        return "it runs sequence-parallel"
    if pc.enable_eplb or (parallel is not None and parallel.enable_eplb):
        return "EPLB moves experts between ranks"
    if parallel is not None and parallel.expert_placement_strategy != "linear":
        return f"expert placement {parallel.expert_placement_strategy!r} (the library places experts linearly)"
    if moe.num_experts % pc.ep_size or moe.num_local_experts != moe.num_experts // pc.ep_size:
        return f"{moe.num_experts} experts do not split evenly over {pc.ep_size} ranks"
    if moe.in_dtype not in EP_DTYPES:
        return f"its activations are {moe.in_dtype}, not one of {EP_DTYPES}"
    if moe.experts_per_token > _C.max_topk:
        return f"top-{moe.experts_per_token} routing exceeds the library's {_C.max_topk}"
    ep = parallel_state.get_ep_group()
    if ep.rank_in_group != pc.ep_rank:
        return f"its expert-parallel rank {pc.ep_rank} is not its rank {ep.rank_in_group} in the EP group"
    batched = experts.activation_format() == mk.FusedMoEActivationFormat.BatchedExperts
    if batched and experts.quant_config.quant_dtype is not None:
        return "its batched experts take quantised activations"
    return None


class _LibraryPrepareFinalize:
    """What both layouts share: the communicator, this rank's share of the
    layer's tokens, and the handle a prepare leaves for its finalize.

    ``comm``: an EP communicator over the expert-parallel group (its EP
    fields the layer's); ``share``: (this rank's index, ranks) among the ranks
    that hold the same tokens, (0, 1) where every rank has its own."""

    def __init__(self, comm, share: tuple):
        self.comm = comm
        self.share = share
        self.cap = comm.max_tokens_per_rank
        self._pending = None  # (handle, start, end) from prepare to finalize

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def num_dispatchers(self) -> int:
        return self.comm.world_size

    def output_is_reduced(self) -> bool:
        return False

    def _my_tokens(self, a1, topk_ids, topk_weights, apply_router_weight_on_input: bool):
        """This rank's share of the layer's tokens, with the weights applied
        to the input where the layer asks for it (top-1 only, as vLLM's
        own prepare/finalizes)."""
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("rdna4_comm: apply_router_weight_on_input needs top-1 routing")
            a1 = a1 * topk_weights.to(a1.dtype)
        start, end = token_share(a1.shape[0], *self.share)
        return a1[start:end], topk_ids[start:end], topk_weights[start:end], start, end

    def _finish(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        """combine ``rows`` into this rank's share of ``output``, zeros in the
        others (the tensor-parallel all_reduce that follows fills them)."""
        handle, start, end = self._pending
        self._pending = None
        mine = self.comm.combine(rows, handle)
        if self.share[1] == 1:
            output.copy_(mine)
        else:
            output.zero_()
            output[start:end].copy_(mine)


@functools.lru_cache(maxsize=None)
def prepare_finalize_classes():
    """The two prepare/finalizes, subclasses of vLLM's
    ``FusedMoEPrepareAndFinalizeModular``, built when vLLM is imported."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceContiguous, TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOP)
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    class RankLayoutPrepareFinalize(_LibraryPrepareFinalize, mk.FusedMoEPrepareAndFinalizeModular):
        """Standard format: ``dispatch`` (rank layout) -> the experts on
        ``[W*cap, H]`` rows with per-row top-k ids and weights -> ``combine``
        of each row's weighted sum over its local slots.

        Slots of other ranks carry weight 0 (the library's rule), with an id
        the experts skip or that adds nothing: ``experts_take_local_ids``
        experts get local ids with 0 in those slots (an expert's output times
        0); the others get global ids, with an expert of another rank there,
        which the layer's ``expert_map`` maps to -1 (vLLM's own convention for
        dispatched ids)."""

        def __init__(self, comm, share: tuple, local_ids: bool):
            _LibraryPrepareFinalize.__init__(self, comm, share)
            mk.FusedMoEPrepareAndFinalizeModular.__init__(self)
            self.local_ids = local_ids
            self.first_expert = comm.local_experts.start
            self.elsewhere = comm.local_experts.stop % comm.num_experts

        @property
        def activation_format(self):
            return mk.FusedMoEActivationFormat.Standard

        def max_num_tokens_per_rank(self) -> Optional[int]:
            return None

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                    quant_config, defer_input_quant=False):
            a1, ids, weights, start, end = self._my_tokens(a1, topk_ids, topk_weights, apply_router_weight_on_input)
            d = self.comm.dispatch(a1, ids, weights)
            self._pending = (d.handle, start, end)
            if self.local_ids:
                ids = d.topk_idx.clamp_min(0)
            else:
                ids = torch.where(d.topk_idx >= 0, d.topk_idx + self.first_expert, self.elsewhere)
            x, scale = d.x, None
            if quant_config.quant_dtype is not None and not defer_input_quant:
                x, scale = moe_kernel_quantize_input(
                    x, quant_config.a1_scale, quant_dtype=quant_config.quant_dtype,
                    per_act_token_quant=quant_config.per_act_token_quant, block_shape=quant_config.block_shape)
            return x, scale, None, ids, d.topk_weights

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                     weight_and_reduce_impl):
            if isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
                weight_and_reduce_impl = TopKWeightAndReduceContiguous()
            rows = weight_and_reduce_impl.apply(
                output=None, fused_expert_output=fused_expert_output, topk_weights=topk_weights,
                topk_ids=topk_ids, apply_router_weight_on_input=apply_router_weight_on_input)
            self._finish(output, rows)

    class ExpertLayoutPrepareFinalize(_LibraryPrepareFinalize, mk.FusedMoEPrepareAndFinalizeModular):
        """BatchedExperts format: ``dispatch(layout="expert")``, its rows
        laid out ``[E_loc, slots, H]`` (expert e's first ``expert_counts[e]``
        slots hold its rows, the rest are not read), the experts, their
        outputs weighted per (token, expert) pair and ``combine``d.

        ``slots`` is what the experts were built for (vLLM's max tokens per
        rank times its dispatchers); it must hold every row one expert can
        receive, ``W * cap``."""

        def __init__(self, comm, share: tuple, slots: int):
            _LibraryPrepareFinalize.__init__(self, comm, share)
            mk.FusedMoEPrepareAndFinalizeModular.__init__(self)
            if slots < self.comm.world_size * self.cap:
                raise ValueError(f"rdna4_comm: the batched experts hold {slots} rows per expert, fewer than the "
                                 f"{self.comm.world_size} x {self.cap} one expert can receive")
            self.slots = slots

        @property
        def activation_format(self):
            return mk.FusedMoEActivationFormat.BatchedExperts

        def max_num_tokens_per_rank(self) -> Optional[int]:
            return self.cap

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                    quant_config, defer_input_quant=False):
            a1, ids, weights, start, end = self._my_tokens(a1, topk_ids, topk_weights, apply_router_weight_on_input)
            d = self.comm.dispatch(a1, ids, weights, layout="expert")
            self._pending = (d.handle, start, end)
            self._expert_rows = d
            slot = torch.arange(self.slots, device=d.x.device, dtype=d.expert_offsets.dtype)
            rows = (d.expert_offsets[:-1, None] + slot).clamp_max(d.x.shape[0] - 1)
            meta = mk.ExpertTokensMetadata(expert_num_tokens=d.expert_counts, expert_num_tokens_cpu=None)
            return d.x[rows], None, meta, None, None

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                     weight_and_reduce_impl):
            d, self._expert_rows = self._expert_rows, None
            e_loc = d.expert_counts.shape[0]
            row = torch.arange(d.x.shape[0], device=d.x.device, dtype=d.expert_offsets.dtype)
            expert = torch.searchsorted(d.expert_offsets[1:], row, right=True).clamp_max(e_loc - 1)
            slot = (row - d.expert_offsets[expert]).clamp(0, self.slots - 1)
            rows = fused_expert_output[expert, slot]
            weighted = isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP) or apply_router_weight_on_input
            if not weighted:
                rows = (rows.float() * d.topk_weights.float()[:, None]).to(rows.dtype)
            self._finish(output, rows)

    return RankLayoutPrepareFinalize, ExpertLayoutPrepareFinalize


def library_prepare_finalize(prepare_finalize, experts):
    """What a MoE kernel being built gets as its prepare/finalize: the
    library's where vLLM runs this layer expert-parallel and the plugin can
    route it, else ``prepare_finalize`` unchanged."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    options = config.current()
    moe = experts.moe_config
    pc = moe.moe_parallel_config
    if not options.expert_parallel or not pc.use_ep or pc.ep_size == 1:
        return prepare_finalize
    vllm_config = get_current_vllm_config_or_none()
    problem = unroutable(experts, vllm_config)
    if problem is not None:
        message = f"rdna4_comm: MoE layer left to vLLM's {type(prepare_finalize).__name__}: {problem}"
        if options.strict:
            raise RuntimeError(message + " (strict)")
        _warn_once(message)
        return prepare_finalize
    tp = parallel_state.get_tp_group()
    cap = share_capacity(moe.max_num_tokens, tp.world_size)
    if options.max_tokens_per_rank is not None:
        if options.max_tokens_per_rank < cap:
            raise ValueError(f'rdna4_comm: additional_config["rdna4_comm"]["max_tokens_per_rank"] must be at least '
                             f"{cap} (max_num_batched_tokens {moe.max_num_tokens} // {tp.world_size} "
                             f"tensor-parallel ranks + 1), got {options.max_tokens_per_rank}")
        cap = options.max_tokens_per_rank
    dtype = str(moe.in_dtype).removeprefix("torch.")
    shape = f"{moe.hidden_dim}x{moe.experts_per_token}of{moe.num_experts}.{dtype}.cap{cap}"
    comm = collectives.communicator(parallel_state.get_ep_group(), f".moe.{shape}", max_tokens_per_rank=cap,
                                    hidden=moe.hidden_dim, topk=moe.experts_per_token, num_experts=moe.num_experts,
                                    dtype=moe.in_dtype)
    # The attention's tensor-parallel group holds the same tokens on every
    # rank (the MoE's own tp_size is 1 under expert parallelism).
    share = (tp.rank_in_group, tp.world_size)
    rank_layout, expert_layout = prepare_finalize_classes()
    if experts.activation_format() == mk.FusedMoEActivationFormat.BatchedExperts:
        return expert_layout(comm, share, experts.max_num_tokens * experts.num_dispatchers)
    return rank_layout(comm, share, experts_take_local_ids(experts))


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def install() -> None:
    """Patch vLLM (0.32): every MoE kernel built from now on takes its
    prepare/finalize from :func:`library_prepare_finalize`."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    build = mk.FusedMoEKernel.__init__

    @functools.wraps(build)
    def __init__(self, prepare_finalize, fused_experts):
        build(self, library_prepare_finalize(prepare_finalize, fused_experts), fused_experts)

    mk.FusedMoEKernel.__init__ = __init__
