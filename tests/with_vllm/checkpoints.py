"""Tiny random checkpoints for the vLLM tests, written by the tests
themselves (nothing is downloaded): a Qwen3-MoE, a Mixtral-like MoE and a
dense Llama-like model, with hidden and intermediate sizes that vLLM's CPU
MoE kernels accept (multiples of 32).

They are fp32. A random model's greedy choices are often near ties, and in
bf16 the last bit of a sum decides them: expert parallelism adds each rank's
experts in fp32, rounds to bf16 and adds the ranks, one rounding more than
one rank's kernel, which flips a tie now and then (measured: the bf16 logits
of these models differ from their fp32 ones by about 1 where the top two are
0.25 apart or tied). In fp32 the same steps differ by about 1e-6, far below
the gaps, so equal tokens test the routing, not the rounding. The bf16 paths
are checked against vLLM's kernels in tests/test_vllm_plugin.py.
"""
from __future__ import annotations

import os

import torch

VOCAB = 512
MODELS = ("qwen3_moe", "mixtral", "llama")


def _config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
    if kind == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **common, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    if kind == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common, intermediate_size=256)
    raise ValueError(f"unknown model kind {kind!r}; one of {MODELS}")


def write(kind: str, path: str, seed: int = 0) -> str:
    """Write the tiny random ``kind`` model to ``path`` (once) and return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cls, config = _config(kind)
    torch.manual_seed(seed)
    model = cls(config)
    model.save_pretrained(path)
    return path
