"""Whole Hugging Face MoE causal LMs made expert-parallel in one call
(rdna4_comm.integrations.transformers.expert_parallel), against the same
model unconverted.

Every rank builds the same tiny random model (same seed: two decoder
layers, 8 experts, top-2; Qwen3-MoE and DeepSeek-V3 with a dense first
layer, DeepSeek-V3 and Qwen2-MoE with shared experts), runs it on prompts of
its own (data-parallel attention, expert-parallel MoE, as EP serving runs
them), then converts it and runs the same prompts again: ``model(input_ids)``
and ``model.generate(max_new_tokens=..., do_sample=False, synced_gpus=True)``.
A rank without prompts takes part through idle_forward / idle_generate;
rank 0 asks for fewer new tokens, so it finishes before its peers. fp32 at
W = 2 for every model and W = 4 for four; bf16 logits at W = 4 for two.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

transformers = pytest.importorskip("transformers", minversion="5.18")  # setup.py extra "transformers"
from rdna4_comm.integrations import transformers as hf  # noqa: E402

H, I, E, K, V = 32, 48, 8, 2, 64
CAP = 16  # the largest prompt batch below: 2 x 5 tokens
NEW_TOKENS = 6
# (sequences, tokens each) per rank; a world of 4 has a rank without prompts.
PROMPTS = {2: [(2, 5), (1, 3)], 4: [(2, 5), (1, 3), (0, 0), (3, 2)]}


def _model(kind: str, seed: int, experts: str = "eager") -> torch.nn.Module:
    common = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, num_experts_per_tok=K,
                  pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if kind == "mixtral":
        cfg, cls = transformers.MixtralConfig(num_local_experts=E, **common), transformers.MixtralForCausalLM
    elif kind == "qwen3_moe":  # layer 0 dense
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=I, num_experts=E, mlp_only_layers=[0], head_dim=8,
                                          **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":  # shared expert
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=I, num_experts=E, shared_expert_intermediate_size=40,
                                          **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif kind == "deepseek_v3":  # layer 0 dense, a shared expert, grouped routing; MLA: as many kv heads as heads
        common["num_key_value_heads"] = common["num_attention_heads"]
        cfg = transformers.DeepseekV3Config(moe_intermediate_size=I, n_routed_experts=E, n_group=2, topk_group=1,
                                            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                            **common)
        cls = transformers.DeepseekV3ForCausalLM
    elif kind == "gpt_oss":  # its eager experts cannot skip other ranks' experts
        cfg, cls = transformers.GptOssConfig(num_local_experts=E, head_dim=8, **common), transformers.GptOssForCausalLM
    else:
        raise ValueError(kind)
    cfg._experts_implementation = "grouped_mm" if kind == "gpt_oss" else experts
    torch.manual_seed(seed)
    model = cls(cfg)
    # Matrices at unit scale (HF's init leaves routers near zero, where top-k ties everywhere).
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def t_whole_model(ctx, kind, seed, compiled=False):
    """This rank's (logits, new tokens) before and after expert_parallel; None
    without prompts. ``compiled``: the converted blocks compiled for any token
    count (grouped_mm experts: the eager ones do not compile fullgraph); also
    returns how many graphs they took."""
    model = _model(kind, seed, "grouped_mm" if compiled else "eager")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    comm = ctx.comm(max_tokens_per_rank=CAP, dtype=torch.float32, **hf.ep_fields(model.config))
    batch, length = PROMPTS[ctx.world][ctx.rank]
    ids = torch.randint(2, V, (batch, length), generator=torch.Generator().manual_seed(seed * 100 + ctx.rank))
    new = NEW_TOKENS - 3 if ctx.rank == 0 else NEW_TOKENS  # rank 0 finishes first
    gen = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        before = (model(ids).logits, model.generate(ids, max_new_tokens=new, **gen)) if batch else None
        converted = hf.expert_parallel(model, comm, compile_blocks=dict(backend=counter) if compiled else False)
        assert converted is model
        if batch:
            after = (model(ids).logits, model.generate(ids, max_new_tokens=new, synced_gpus=True, **gen))
        else:
            hf.idle_forward(model)
            hf.idle_generate(model, **gen)
            after = None
    blocks = sum(isinstance(m, hf.ExpertParallelMoEBlock) for m in model.modules())
    return before, after, blocks, counter.frame_count


def t_bf16_forward(ctx, kind, seed, dispatch_dtype=None, layout="expert"):
    """This rank's bf16 logits before and after expert_parallel (None without prompts)."""
    model = _model(kind, seed).to(torch.bfloat16)
    comm = ctx.comm(max_tokens_per_rank=CAP, dtype=torch.bfloat16, dispatch_dtype=dispatch_dtype,
                    **hf.ep_fields(model.config))
    batch, length = PROMPTS[ctx.world][ctx.rank]
    ids = torch.randint(2, V, (batch, length), generator=torch.Generator().manual_seed(seed * 100 + ctx.rank))
    with torch.no_grad():
        before = model(ids).logits if batch else None
        hf.expert_parallel(model, comm, layout=layout)
        if batch:
            return before, model(ids).logits
        hf.idle_forward(model)
    return None


MODELS = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"]
# One MoE layer of two where the first is dense.
MOE_LAYERS = dict(mixtral=2, qwen3_moe=1, qwen2_moe=2, deepseek_v3=1, gpt_oss=2)


@pytest.mark.parametrize("kind,size,compiled", [(m, 2, False) for m in MODELS] + [
    (m, 4, False) for m in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")] + [("mixtral", 2, True)])
def test_whole_model_matches_the_unconverted_model(worlds, kind, size, compiled):
    for rank, (before, after, blocks, graphs) in enumerate(worlds("cpu", size).run(t_whole_model, kind, 7, compiled)):
        assert blocks == MOE_LAYERS[kind], (rank, blocks)
        # Compiled: one graph serves every block (they share their code, the
        # parameters are its inputs), prefill and every decode step, on every rank.
        assert graphs == (1 if compiled else 0), (rank, graphs)
        if before is None:
            assert after is None
            continue
        torch.testing.assert_close(after[0], before[0], rtol=1e-4, atol=1e-4, msg=f"rank {rank}: logits")
        assert torch.equal(after[1], before[1]), f"rank {rank}: generated tokens {after[1]} != {before[1]}"


def test_ep_fields_read_every_models_expert_count():
    for kind in MODELS:
        cfg = _model(kind, 0).config
        assert hf.ep_fields(cfg) == dict(hidden=H, topk=K, num_experts=E), kind
    with pytest.raises(ValueError, match="not an MoE model config"):
        hf.ep_fields(transformers.LlamaConfig(hidden_size=H))


def t_dense_model(ctx):
    comm = ctx.comm(max_tokens_per_rank=CAP, hidden=H, topk=K, num_experts=E, dtype=torch.float32)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=4, vocab_size=V))
    try:
        hf.expert_parallel(model, comm)
    except ValueError as e:
        return str(e)
    return None


def test_a_model_without_moe_blocks_is_refused(worlds):
    for error in worlds("cpu", 2).run(t_dense_model):
        assert error is not None and "LlamaForCausalLM has no MoE block with an adapter" in error, error


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_bf16_whole_model_logits_within_bf16_rounding(worlds, kind):
    """bf16: the expert-parallel model sums each token's experts in another
    order than HF's block (fp32 per rank, then over ranks), so its logits
    differ from the unconverted model's by bf16 roundings, not more."""
    for rank, pair in enumerate(worlds("cpu", 4).run(t_bf16_forward, kind, 11)):
        if pair is None:
            continue
        before, after = (t.float() for t in pair)
        err = (after - before).abs().max().item()
        scale = before.abs().max().item()
        assert err <= 2**-6 * scale, f"rank {rank}: logits differ by {err} at scale {scale}"



@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_fp8_dispatch_whole_model_logits_within_fp8_error(worlds, layout):
    """FP8 dispatch: the experts get the dequantised rows (3 mantissa bits to
    bf16's 7), so the logits move by up to 2^4 times the bf16 bound of
    test_bf16_whole_model_logits_within_bf16_rounding (2^-6 of their scale),
    and by something: the rows did go through FP8."""
    for rank, pair in enumerate(worlds("cpu", 2).run(t_bf16_forward, "mixtral", 11, torch.float8_e4m3fn, layout)):
        if pair is None:
            continue
        before, after = (t.float() for t in pair)
        err = (after - before).abs().max().item()
        scale = before.abs().max().item()
        assert 0 < err <= 2**-2 * scale, f"rank {rank}: logits differ by {err} at scale {scale}"


def t_bf16_generate(ctx, kind, seed):
    """This rank's bf16 greedy generations before and after expert_parallel,
    with the unconverted model's logits at every step (None without prompts)."""
    model = _model(kind, seed).to(torch.bfloat16)
    comm = ctx.comm(max_tokens_per_rank=CAP, dtype=torch.bfloat16, **hf.ep_fields(model.config))
    batch, length = PROMPTS[ctx.world][ctx.rank]
    ids = torch.randint(2, V, (batch, length), generator=torch.Generator().manual_seed(seed * 100 + ctx.rank))
    gen = dict(do_sample=False, pad_token_id=0, max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        before = model.generate(ids, output_logits=True, return_dict_in_generate=True, **gen) if batch else None
        hf.expert_parallel(model, comm)
        if not batch:
            hf.idle_generate(model, **gen)
            return None
        after = model.generate(ids, synced_gpus=True, **gen)
    return before.sequences, torch.stack(before.logits, 1).float(), after


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_bf16_generate_matches_up_to_near_ties(worlds, kind):
    """bf16 greedy generation: the converted model's tokens are the
    unconverted model's, except that a row may part from them at a step
    where the unconverted model's best two logits lie within bf16 rounding
    (2^-6 of the logits' scale, as in the logits test); after that the row's
    tokens follow their own prefix and are not compared."""
    for rank, result in enumerate(worlds("cpu", 4).run(t_bf16_generate, kind, 13)):
        if result is None:
            continue
        before, logits, after = result
        prompt = before.shape[1] - logits.shape[1]
        assert after.shape == before.shape, (rank, after.shape, before.shape)
        for b in range(before.shape[0]):
            differ = (after[b, prompt:] != before[b, prompt:]).nonzero()
            if len(differ) == 0:
                continue
            step = int(differ[0])
            row = logits[b, step]
            gap = (row.max() - row[after[b, prompt + step]]).item()
            assert gap <= 2**-6 * row.abs().max().item(), (
                f"rank {rank} row {b}: token {step} differs with a logit gap of {gap} (not a near-tie)")
