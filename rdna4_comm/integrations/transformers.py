"""Hugging Face transformers blocks on a :class:`rdna4_comm.Communicator`.

- :class:`ExpertParallelMoEBlock` turns an MoE block (Mixtral, Qwen2-MoE,
  Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, Llama-4) into its expert-parallel
  form::

      router -> comm.dispatch -> the block's own experts -> comm.combine (+ shared experts)

  It keeps the block's router, its experts module (with its
  ``experts_implementation``: eager, grouped_mm, batched_mm, ...) and its
  shared experts; each rank holds only its experts, global ids
  ``[rank*E/W, (rank+1)*E/W)``.
- :func:`expert_parallel` converts every MoE block of a whole model in
  place (dense layers stay as they are); :func:`ep_fields` reads the
  communicator's EP fields from the model's config; :func:`idle_forward`
  and :func:`idle_generate` let a rank without prompts take part in its
  peers' forward and ``generate(synced_gpus=True)``.
- :class:`TensorParallelMLP` (defined in :mod:`rdna4_comm.tp`) turns a
  LlamaMLP-style block (``gate_proj``, ``up_proj``, ``down_proj``,
  ``act_fn``) into its tensor-parallel form: gate/up column-parallel, down
  row-parallel, ``comm.all_reduce`` of the partial sums.

:class:`ExpertParallelMoEBlock` takes the block's modules over and cuts its
experts module down to this rank's experts in place: do not use the block
afterwards. :class:`TensorParallelMLP` copies its slices and leaves the MLP
as it was. Both run forward only (the ops have no autograd) and compile with
``torch.compile(fullgraph=True)`` where the block's own code does; see
docs/integrations.md.

This module does not import transformers: blocks are recognised by their class
names (:data:`ADAPTERS`), so ``import rdna4_comm`` stays free of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from ..communicator import Communicator
from ..fp8 import dequantize_fp8
from ..ops import mark_dynamic_tokens
from ..tp import TensorParallelMLP

__all__ = [
    "ADAPTERS", "ExpertParallelMoEBlock", "MoEAdapter", "Routing", "TensorParallelMLP", "adapter_for", "ep_fields",
    "expert_parallel", "idle_forward", "idle_generate",
]


class Routing(NamedTuple):
    """A router's decision for T tokens."""

    topk_idx: torch.Tensor  # [T, K] global expert ids, as the router returns them (int64)
    topk_weights: torch.Tensor  # [T, K], in the router's dtype
    logits: torch.Tensor  # [T, E], for blocks that return them


def _route_topk(router: nn.Module, x: torch.Tensor) -> Routing:
    """The HF top-k routers: ``router(x) -> (logits, topk_weights, topk_idx)``."""
    logits, weights, idx = router(x)
    return Routing(idx, weights, logits)


def _route_llama4(router: nn.Module, x: torch.Tensor) -> Routing:
    """Llama4Router returns dense scores ``[T, E]`` (sigmoid of the top-k logits,
    0 elsewhere) and the logits. The same ``topk`` call on the same logits gives
    the router's own ids."""
    scores, logits = router(x)
    idx = torch.topk(logits, router.top_k, dim=1).indices
    return Routing(idx, scores.gather(1, idx), logits)


def _run_experts(experts: nn.Module, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The HF experts modules: ``experts(x, idx, weights)`` applies the weights
    and sums each row over its slots, skipping the id ``num_experts``."""
    return experts(x, idx, weights)


def _run_llama4_experts(experts: nn.Module, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Llama4TextExperts runs every expert on every row, with the routing weight
    applied to its input (as Llama4TextMoe does with its dense scores): build
    those scores for the local experts, the extra column taking the non-local
    marker ``num_experts``, then sum the experts' outputs per row."""
    n = experts.num_experts
    scores = weights.new_zeros(x.shape[0], n + 1).scatter_add_(1, idx, weights)[:, :n]
    routed_in = x.repeat(n, 1) * scores.t().reshape(-1, 1)
    return experts(routed_in).view(n, x.shape[0], x.shape[1]).sum(dim=0)


def _row_experts(d, n: int) -> torch.Tensor:
    """The local expert whose block holds each row of an expert-layout
    dispatch ``d``: ``[expert_rows]`` int64; rows past the last block (the
    tail) get the last expert, ``n - 1``."""
    row = torch.arange(d.x.shape[0], device=d.x.device, dtype=d.expert_offsets.dtype)
    return torch.searchsorted(d.expert_offsets[1:], row, right=True).clamp_max(n - 1)


def _hidden(out: torch.Tensor, routing: Routing) -> torch.Tensor:
    return out


@dataclass(frozen=True)
class MoEAdapter:
    """Where one family of HF MoE blocks differs from the others.

    Args:
        router: attribute name of the block's router.
        route: ``route(router, x [T, H]) -> Routing``.
        run_experts: ``run_experts(experts, rows [N, H], local ids [N, K], weights [N, K]) -> [N, H]``:
            each row's weighted sum over its slots; ids equal to
            ``experts.num_experts`` mark slots of other ranks and must add nothing.
        shared: ``shared(ep_block, x [T, H]) -> [T, H]``, the shared experts on
            the rank's own tokens (``ep_block`` holds the block's submodules
            under their names), or None.
        output: ``output(out, routing)`` -> what the block's forward returns,
            given ``out`` in the input's shape.
        eager_skips_marker: whether the experts module's "eager" forward skips
            the id ``num_experts`` (a one-hot over ``num_experts + 1`` classes).
    """

    router: str = "gate"
    route: Callable[[nn.Module, torch.Tensor], Routing] = _route_topk
    run_experts: Callable[..., torch.Tensor] = _run_experts
    shared: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None
    output: Callable[[torch.Tensor, Routing], Any] = _hidden
    eager_skips_marker: bool = True


def _qwen2_moe_shared(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


# Keyed by class name so that this module needs no transformers import; a
# subclass of a listed block finds its base's adapter (see adapter_for).
ADAPTERS: dict[str, MoEAdapter] = {
    "MixtralSparseMoeBlock": MoEAdapter(),
    "Qwen3MoeSparseMoeBlock": MoEAdapter(),
    "OlmoeSparseMoeBlock": MoEAdapter(),
    "Qwen2MoeSparseMoeBlock": MoEAdapter(shared=_qwen2_moe_shared),
    "DeepseekV3MoE": MoEAdapter(shared=lambda block, x: block.shared_experts(x)),
    # GptOssExperts' eager forward one-hots over num_experts classes only, so
    # the non-local id is out of range there; grouped_mm and batched_mm skip it.
    "GptOssMLP": MoEAdapter(
        router="router", output=lambda out, r: (out, r.topk_weights), eager_skips_marker=False
    ),
    # Llama4TextMoe returns the output flattened to [T, H], with the logits.
    "Llama4TextMoe": MoEAdapter(
        router="router",
        route=_route_llama4,
        run_experts=_run_llama4_experts,
        shared=lambda block, x: block.shared_expert(x),
        output=lambda out, r: (out.view(-1, out.shape[-1]), r.logits),
    ),
}


def adapter_for(block: nn.Module) -> MoEAdapter:
    """The adapter of ``block``'s class or of its nearest listed base class."""
    for cls in type(block).__mro__:
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__]
    raise TypeError(
        f"no MoE adapter for {type(block).__name__} (known blocks: {', '.join(ADAPTERS)}): for an MoE block of "
        "another family pass adapter=MoEAdapter(...); a dense MLP needs none (expert_parallel(model, comm) "
        "converts a model's MoE blocks and leaves its dense layers)"
    )


def _keep_local_experts(experts: nn.Module, comm: Communicator) -> None:
    """Cut every per-expert parameter ([E, ...]) down to this rank's experts and
    tell the module it holds ``E/W`` of them, as HF's own expert sharding does."""
    mine = slice(comm.local_experts.start, comm.local_experts.stop)
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] != comm.num_experts:
            raise ValueError(
                f"experts.{name} has shape {tuple(p.shape)}; every experts parameter must have "
                f"num_experts ({comm.num_experts}) rows in dim 0"
            )
        setattr(experts, name, nn.Parameter(p.data[mine].clone(), requires_grad=p.requires_grad))
    experts.num_experts = comm.num_local_experts
    # Set by transformers' use_experts_implementation: its grouped_mm and
    # batched_mm forwards mask the non-local id only when this is set.
    if hasattr(experts, "_is_expert_parallel"):
        experts._is_expert_parallel = True


class ExpertParallelMoEBlock(nn.Module):
    """The expert-parallel form of a Hugging Face MoE block.

    Every rank builds it from an identical block (same weights) and the same
    communicator. Per forward, on each rank's own tokens:

    1. the block's router picks the top-k experts and their weights;
    2. ``comm.dispatch`` sends each token to the ranks that own its experts;
    3. the block's experts, this rank's ``E/W`` of them, run on the expert
       layout's rows: one row per (token, local expert) pair, grouped by
       expert, each times its pair's weight. An experts module of HF's
       grouped_mm implementation gets them straight into its grouped GEMMs
       (``offs = expert_offsets[1:]``, no sort by expert); any other runs
       its forward with a one-slot routing, rows that hold no pair taking
       the id the module skips. Either way no expert runs over the rows
       past ``expert_offsets[-1]`` and shapes stay static;
    4. ``comm.combine`` sums each token's pair rows per rank (ascending
       expert), then over its destination ranks;
    5. the shared experts, where the block has them, are added as the block
       adds them.

    Args:
        block: the HF block (e.g. ``MixtralSparseMoeBlock``). Its submodules
            move into this module under the same names (so state-dict keys
            match the block's); its experts module is cut down to this rank's
            experts in place.
        comm: a communicator with EP fields: ``hidden``, ``topk`` and
            ``num_experts`` of the block, ``dtype`` of the block's weights and
            ``max_tokens_per_rank`` at least the tokens (batch x sequence) of
            one forward.
        adapter: how this block family differs (default: ``adapter_for(block)``).
        layout: ``"expert"`` (default; steps 3-4 above) or ``"rank"``: the
            experts module runs on dispatch's ``W*cap`` rank-layout rows with
            their received routing (slots of other ranks' experts, and every
            slot of a padding row, take the id the module skips), and combine
            takes them back. On one H200 a Mixtral layer whose experts module
            is of HF's grouped_mm implementation took 0.65-0.94x the rank
            layout's time in the expert layout (docs/performance.md, "The
            expert layout").

    ``forward(hidden_states)`` takes what the block takes (``[B, S, H]``, or any
    ``[..., H]``) and returns what it returns, e.g. ``(hidden, router_scores)``
    for GPT-OSS. Every rank must call it the same number of times, with zero
    tokens too: dispatch and combine are collectives.
    """

    def __init__(self, block: nn.Module, comm: Communicator, adapter: Optional[MoEAdapter] = None,
                 layout: str = "expert"):
        super().__init__()
        if layout not in ("expert", "rank"):
            raise ValueError(f"layout must be 'expert' or 'rank', got {layout!r}")
        self.adapter = adapter if adapter is not None else adapter_for(block)
        self.comm = comm
        self.layout = layout
        self._compiled = None  # compile_tokens_dynamic
        for name, child in block.named_children():
            self.add_module(name, child)
        router, experts = getattr(self, self.adapter.router), self.experts
        found = dict(hidden=router.weight.shape[1], topk=router.top_k, num_experts=experts.num_experts)
        expected = dict(hidden=comm.hidden, topk=comm.topk, num_experts=comm.num_experts)
        if found != expected:
            raise ValueError(f"{type(block).__name__} has {found}, the communicator {expected}")
        weight_dtype = next(experts.parameters()).dtype
        if weight_dtype != comm.dtype:
            raise TypeError(f"{type(block).__name__} weights are {weight_dtype}, the communicator's dtype {comm.dtype}")
        implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
        if not self.adapter.eager_skips_marker and implementation in (None, "eager"):
            raise ValueError(
                f"{type(experts).__name__}'s eager forward cannot skip the experts of other ranks; "
                "build the model with experts_implementation='grouped_mm' or 'batched_mm'"
            )
        _keep_local_experts(experts, comm)
        # HF's grouped GEMM (transformers.integrations.moe), for the expert
        # layout's rows of an experts module of its grouped_mm implementation
        # (_grouped_experts); None: the module's forward.
        self._grouped_linear = None
        if (layout == "expert" and self.adapter.run_experts is _run_experts and implementation == "grouped_mm"
                and hasattr(experts, "has_gate")):
            from transformers.integrations.moe import _grouped_linear

            self._grouped_linear = _grouped_linear

    def compile_tokens_dynamic(self, **compile_kwargs) -> "ExpertParallelMoEBlock":
        """Run forward through ``torch.compile(fullgraph=True, **compile_kwargs)``
        with every dimension of the input but the last marked as a token
        count of any size (:func:`rdna4_comm.mark_dynamic_tokens`) at each
        call: one graph serves every rank's batch and sequence sizes, prefill
        and decode alike, so no rank recompiles while its peers wait in the
        block's collectives. Returns the block."""
        self._compiled = torch.compile(self._forward, fullgraph=True, **compile_kwargs)
        return self

    def forward(self, hidden_states: torch.Tensor):
        if self._compiled is None or torch.compiler.is_compiling():
            return self._forward(hidden_states)
        for dim in range(hidden_states.dim() - 1):
            mark_dynamic_tokens(hidden_states, dim)
        return self._compiled(hidden_states)

    def _forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.adapter.route(getattr(self, self.adapter.router), x)
        # Routing goes through in the router's dtypes (int64 ids; fp32 or
        # bf16 weights), which the HF experts expect.
        d = self.comm.dispatch(x, routing.topk_idx, routing.topk_weights, layout=self.layout)
        # FP8 dispatch (a communicator made with dispatch_dtype): HF experts
        # take the model's dtype, so the rows are dequantised first.
        rows = d.x if d.x_scales is None else dequantize_fp8(d.x, d.x_scales, self.comm.dtype)
        # HF experts skip the id num_local_experts: every slot that names no
        # local expert takes it.
        n = self.comm.num_local_experts
        if self.layout == "rank":  # the library marks such slots (and padding rows' slots) -1
            y = self.adapter.run_experts(self.experts, rows, torch.where(d.topk_idx < 0, n, d.topk_idx),
                                         d.topk_weights)
        elif (y := self._grouped_experts(rows, d)) is None:
            # Each row is one (token, local expert) pair, grouped by expert: a
            # one-slot routing, its expert and weight. Rows that hold no pair
            # (alignment padding, the tail) take the skipped id.
            expert = _row_experts(d, n)
            pair = torch.arange(d.x.shape[0], device=d.x.device) < d.expert_offsets[expert] + d.expert_counts[expert]
            y = self.adapter.run_experts(self.experts, rows, torch.where(pair, expert, n).unsqueeze(1),
                                         d.topk_weights.unsqueeze(1))
        out = self.comm.combine(y, d.handle)
        if self.adapter.shared is not None:
            out = out + self.adapter.shared(self, x)
        return self.adapter.output(out.view(hidden_states.shape), routing)

    def _grouped_experts(self, rows: torch.Tensor, d) -> Optional[torch.Tensor]:
        """The experts on the expert layout's rows through HF's grouped GEMMs:
        what its grouped_mm forward runs once it has sorted its rows by
        expert, which these rows are already (expert e's are
        ``[offsets[e], offsets[e+1])``, so ``offs = expert_offsets[1:]``), then
        each row's output times its pair's weight, rounded once to the rows'
        dtype, as that forward rounds a one-slot routing. The GEMMs skip the
        rows past ``expert_offsets[-1]``, whose output is left unspecified
        (combine never reads them). None where the experts module is not of
        HF's grouped_mm implementation."""
        if self._grouped_linear is None or d.topk_weights is None:
            return None
        ex, offs = self.experts, d.expert_offsets[1:]
        bias_rows = _row_experts(d, ex.num_experts) if ex.has_bias else None  # for the per-expert biases

        def project(x: torch.Tensor, weight: torch.Tensor, bias_name: str) -> torch.Tensor:
            bias = None if bias_rows is None else getattr(ex, bias_name)[bias_rows]
            return self._grouped_linear(x, weight, offs, bias=bias, is_transposed=ex.is_transposed)

        if ex.has_gate:
            h = ex._apply_gate(project(rows, ex.gate_up_proj, "gate_up_proj_bias"))
        else:
            h = ex.act_fn(project(rows, ex.up_proj, "up_proj_bias"))
        out = project(h, ex.down_proj, "down_proj_bias")
        # Releases of transformers before the post-expert norm have no flag for it.
        if getattr(ex, "has_post_expert_norm", False):
            out = ex.post_expert_norm(out)
        return (out * d.topk_weights.unsqueeze(-1)).to(rows.dtype)


# The expert count's name in the configs of HF MoE models (Mixtral, GPT-OSS,
# Llama 4: num_local_experts; Qwen2/3-MoE, OLMoE: num_experts; DeepSeek-V3:
# n_routed_experts), tried in this order.
_EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts")


def ep_fields(config) -> dict:
    """``hidden``, ``topk`` and ``num_experts`` of an HF MoE model's config
    (its ``text_config`` where it has one), whatever the model names them:
    the EP fields of its :class:`~rdna4_comm.Communicator`::

        comm = rc.Communicator(max_tokens_per_rank=batch * seq_len, dtype=model.dtype,
                               **ep_fields(model.config))
    """
    cfg = getattr(config, "text_config", None) or config
    experts = next((n for n in (getattr(cfg, name, None) for name in _EXPERT_COUNT_NAMES)
                    if isinstance(n, int) and n > 0), None)
    topk = getattr(cfg, "num_experts_per_tok", None)
    if experts is None or not isinstance(topk, int):
        raise ValueError(f"{type(cfg).__name__} names no expert count ({', '.join(_EXPERT_COUNT_NAMES)}) "
                         "and top-k (num_experts_per_tok): not an MoE model config")
    return dict(hidden=cfg.hidden_size, topk=topk, num_experts=experts)


def expert_parallel(model: nn.Module, comm: Communicator, compile_blocks: Union[bool, dict] = False,
                    layout: str = "expert") -> nn.Module:
    """Make ``model`` expert-parallel in place and return it: every MoE block
    with an adapter (:data:`ADAPTERS`, by class or base class) becomes an
    :class:`ExpertParallelMoEBlock` on ``comm`` under the same name, so the
    state-dict keys stay the same; every other module (attention, dense MLP
    layers, norms) stays as it is and runs on this rank's own tokens.

    Every rank converts an identical model (same weights) with the same
    communicator, and from then on runs every forward its peers run:
    a rank without prompts calls :func:`idle_forward` (or
    :func:`idle_generate`) instead. Raises ValueError if the model has no
    MoE block with an adapter.

    ``compile_blocks``: True, or a dict of ``torch.compile`` arguments, compiles
    every converted block for any token count
    (:meth:`ExpertParallelMoEBlock.compile_tokens_dynamic`); the rest of the
    model stays as it is (docs/integrations.md, "torch.compile"). ``layout``:
    the blocks' dispatch layout (:class:`ExpertParallelMoEBlock`).
    """
    found = [(name, module) for name, module in model.named_modules()
             if any(cls.__name__ in ADAPTERS for cls in type(module).__mro__)]
    # An adapted block's own submodules are never blocks themselves; skip them anyway.
    blocks = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block with an adapter (known blocks: {', '.join(ADAPTERS)})")
    for name, block in blocks:
        parent_name, _, attr = name.rpartition(".")
        ep = ExpertParallelMoEBlock(block, comm, layout=layout)
        if compile_blocks:
            ep.compile_tokens_dynamic(**(compile_blocks if isinstance(compile_blocks, dict) else {}))
        model.get_submodule(parent_name).add_module(attr, ep)
    return model


def _dummy_prompt(model: nn.Module) -> torch.Tensor:
    """One token (id 0) of one sequence on the model's device."""
    return torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)


def idle_forward(model: nn.Module) -> None:
    """For a rank without prompts while its peers run ``model(input_ids)``:
    one forward on a one-token dummy prompt, its output dropped. HF models
    cannot run a batch of zero sequences; a dummy token issues every
    converted block's dispatch and combine in the model's order, as the
    peers' forward does."""
    with torch.no_grad():
        model(input_ids=_dummy_prompt(model))


def idle_generate(model: nn.Module, **generate_kwargs) -> None:
    """For a rank without prompts while its peers run
    ``model.generate(..., synced_gpus=True)``: generate one token from a
    one-token dummy prompt with ``synced_gpus=True``. The rank has then
    finished, and HF's synced loop keeps it running a forward per step (and
    so every converted block's collectives) until every rank has finished.
    ``generate_kwargs`` are the peers' other arguments (``do_sample`` and so
    on); ``max_new_tokens`` and ``synced_gpus`` are set here."""
    for name in ("max_length", "min_new_tokens", "min_length"):
        generate_kwargs.pop(name, None)
    generate_kwargs.update(max_new_tokens=1, synced_gpus=True)
    with torch.no_grad():
        model.generate(_dummy_prompt(model), **generate_kwargs)

