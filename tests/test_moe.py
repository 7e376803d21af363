"""The example MoE layer: expert-parallel equals dense, eager equals compiled."""
from __future__ import annotations

import pytest
import torch
from common import rand
from conftest import GPU_WORLDS

from rdna4_comm import moe

FFN = 24


def moe_config(W, dtype):
    return dict(max_tokens_per_rank=12, hidden=32, topk=3, num_experts=4 * W, dtype=dtype, allreduce_slot_bytes=4096)


def t_moe(ctx, cfg, seed, T, compile_mode):
    comm = ctx.comm(**cfg)
    layer = moe.ExpertParallelMoE(comm, ffn=FFN, seed=seed)
    router, w_in, w_out = (t.to(ctx.device) for t in moe.init_weights(seed, cfg["num_experts"], cfg["hidden"], FFN))
    x = rand(seed, ctx.rank, (T, cfg["hidden"]), cfg["dtype"]).to(ctx.device)
    dense = moe.dense_moe(x, router, w_in, w_out, cfg["topk"])
    eager = layer(x)
    compiled = None
    if compile_mode is not None:
        kwargs = {} if compile_mode == "default" else {"mode": compile_mode}
        fn = torch.compile(layer, fullgraph=True, **kwargs)
        compiled = [fn(x) for _ in range(3)][-1]  # reduce-overhead records, then replays a graph
    return dense, eager, compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_expert_parallel_layer_matches_dense(world, dtype):
    cfg = moe_config(world.size, dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for r, (dense, eager, _) in enumerate(world.run(t_moe, cfg, 5, 12 - world.size, None)):
        torch.testing.assert_close(eager.float(), dense.float(), **tol, msg=f"rank {r}")


COMPILED_WORLDS = [("cpu", 2, "default")] + [("gpu", w, "reduce-overhead") for _, w in GPU_WORLDS[:1]]


@pytest.mark.parametrize("transport,size,mode", COMPILED_WORLDS, ids=[f"{t}{w}-{m}" for t, w, m in COMPILED_WORLDS])
def test_compiled_layer_matches_eager(worlds, transport, size, mode):
    world = worlds(transport, size)
    cfg = moe_config(size, torch.float32)
    for dense, eager, compiled in world.run(t_moe, cfg, 9, 10, mode):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled, dense, rtol=1e-4, atol=1e-5)
