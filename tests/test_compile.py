"""torch.compile never drops, duplicates or reorders a collective, and one
compiled graph serves every token count.

Each op declares that it writes its device's ordering token (rdna4_comm.ops),
so inductor keeps a collective whose result is dead (a rank with no tokens
still takes part) and keeps collectives in program order. These tests failed
when the ops were registered as pure: the rank whose result was dead returned
at once and its peers timed out in the collective it skipped.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from common import assert_bitwise, ep_inputs, expert_fn, rand
from conftest import GPU_WORLDS

import rdna4_comm as rc
from rdna4_comm import moe, reference

# The ranks compile different graphs (different token counts) on two cores, so
# they reach the first collective seconds apart: a bound that covers that.
COMPILE_TIMEOUT_MS = 120_000
WORLDS = [("cpu", 2), ("dist", 2)] + [("gpu", w) for _, w in GPU_WORLDS[:1]]


def compiled(fn, ctx):
    """Compiled, with CUDA graphs where the rank's ops can be captured."""
    return torch.compile(fn, fullgraph=True, **({"mode": "reduce-overhead"} if ctx.captures_graphs else {}))


def ep_cfg(W, hidden=32):
    return dict(max_tokens_per_rank=8, hidden=hidden, topk=3, num_experts=4 * W, dtype=torch.float32,
                allreduce_slot_bytes=4096, timeout_ms=COMPILE_TIMEOUT_MS)


def cudagraph_skips() -> int:
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def t_moe_layer_with_no_tokens_on_rank_0(ctx):
    """The issue's reproducer: layer(x) + x, rank 0 with no tokens."""
    comm = ctx.comm(**ep_cfg(ctx.world))
    layer = moe.ExpertParallelMoE(comm, ffn=16)
    f = compiled(lambda x: layer(x) + x, ctx)
    skips = cudagraph_skips()
    outs = []
    for i in range(3):  # reduce-overhead records on the first calls, then replays
        x = rand(i, ctx.rank, (0 if ctx.rank == 0 else 5, 32)).to(ctx.device)
        # reduce-overhead: a graph's outputs are overwritten by its next replay
        outs.append((f(x).clone(), layer(x) + x))
    ctx.sync()
    return outs, cudagraph_skips() - skips


def t_dead_all_reduce_on_rank_0(ctx):
    """Rank 0 discards its all_reduce; rank 1 uses it."""
    comm = ctx.comm(allreduce_slot_bytes=4096, timeout_ms=COMPILE_TIMEOUT_MS)
    if ctx.rank == 0:
        def f(x):
            comm.all_reduce(x)
            return x * 2
    else:
        def f(x):
            return comm.all_reduce(x) * 2
    g = compiled(f, ctx)
    outs = [g(rand(10 + i, ctx.rank, (3, 40)).to(ctx.device)).clone() for i in range(3)]
    ctx.sync()
    return outs


def t_dead_dispatch_combine(ctx):
    """dispatch -> combine -> further ops, rank 0 with no tokens, and on rank 0
    the whole result unused."""
    cfg = ep_cfg(ctx.world, hidden=16)
    comm = ctx.comm(**cfg)
    rcfg = dict(hidden=16, topk=3, num_experts=cfg["num_experts"], dtype=cfg["dtype"])

    def f(x, idx, w):
        d = comm.dispatch(x, idx, w)
        out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
        return (out * 2 + 1) if ctx.rank else x.sum()

    g = compiled(f, ctx)
    outs = []
    for i in range(3):
        T = 0 if ctx.rank == 0 else 6
        x, idx, w = (t.to(ctx.device) for t in ep_inputs(40 + i, ctx.rank, ctx.world, T, rcfg, "random"))
        outs.append(g(x, idx, w).clone())
    ctx.sync()
    return outs


@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}{w}" for t, w in WORLDS])
def test_moe_layer_with_a_rank_without_tokens(worlds, transport, size):
    for outs, skips in worlds(transport, size).run(t_moe_layer_with_no_tokens_on_rank_0):
        for compiled_out, eager_out in outs:
            torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-6)
        if transport == "gpu":
            assert skips == 0, "torch.compile(mode='reduce-overhead') skipped CUDA graphs"


@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}{w}" for t, w in WORLDS])
def test_all_reduce_whose_result_is_dead_on_one_rank(worlds, transport, size):
    outs = worlds(transport, size).run(t_dead_all_reduce_on_rank_0)
    for i in range(3):
        xs = [rand(10 + i, r, (3, 40)) for r in range(size)]
        assert_bitwise(outs[0][i], xs[0] * 2, "rank 0 (result dead)")
        for r in range(1, size):
            assert_bitwise(outs[r][i], reference.all_reduce(xs) * 2, f"rank {r}")


@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}{w}" for t, w in WORLDS])
def test_dispatch_combine_with_no_tokens_and_a_dead_result(worlds, transport, size):
    outs = worlds(transport, size).run(t_dead_dispatch_combine)
    cfg = ep_cfg(size, hidden=16)
    rcfg = dict(hidden=16, topk=3, num_experts=cfg["num_experts"], dtype=cfg["dtype"])
    for i in range(3):
        inputs = [ep_inputs(40 + i, r, size, 0 if r == 0 else 6, rcfg, "random") for r in range(size)]
        xs, idxs, ws = (list(v) for v in zip(*inputs))
        ref = reference.dispatch(xs, idxs, ws, num_experts=cfg["num_experts"], max_tokens_per_rank=8)
        ref_out = reference.combine([expert_fn(ref[r].x, r) for r in range(size)], ref)
        for r in range(1, size):
            assert_bitwise(outs[r][i], ref_out[r] * 2 + 1, f"call {i} rank {r}")


# ------------------------------------------------------------------ ordering


def collective_chain(gm: torch.fx.GraphModule) -> list[str]:
    """The rdna4_comm ops of a post-functionalization graph, in graph order,
    each checked to depend on the one before it (so no pass may reorder them)."""
    def target_of(n):
        if n.op != "call_function":
            return None
        t = n.target
        if t in (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2):
            t = n.args[0]
        return t._opname if isinstance(t, torch._ops.OpOverload) and t.namespace == "rdna4_comm" else None

    chain, prev = [], None
    for n in gm.graph.nodes:
        name = target_of(n)
        if name is None:
            continue
        if prev is not None:
            seen, todo = set(), list(n.all_input_nodes)
            while todo and prev not in seen:
                m = todo.pop()
                if m not in seen:
                    seen.add(m)
                    todo.extend(m.all_input_nodes)
            assert prev in seen, f"{name} does not depend on the collective before it ({prev.name})"
        chain.append(name)
        prev = n
    return chain


def t_independent_collectives_keep_program_order(ctx):
    a = ctx.comm(allreduce_slot_bytes=4096, timeout_ms=COMPILE_TIMEOUT_MS)
    cfg = ep_cfg(ctx.world, hidden=16)
    b = ctx.comm(**cfg)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = torch._dynamo.backends.common.aot_autograd(fw_compiler=capture)

    def f(u, v, x, idx, w):
        s = a.all_reduce(u)                    # none of these four depend on each other's data
        d = b.dispatch(x, idx, w)
        t = a.all_reduce(v)
        out = b.combine(d.x, d.handle)
        return s, t, out

    rcfg = dict(hidden=16, topk=3, num_experts=cfg["num_experts"], dtype=cfg["dtype"])
    x, idx, w = (t.to(ctx.device) for t in ep_inputs(3, ctx.rank, ctx.world, 5, rcfg, "random"))
    u, v = rand(1, ctx.rank, (7,)).to(ctx.device), rand(2, ctx.rank, (9,)).to(ctx.device)
    traced = torch.compile(f, fullgraph=True, backend=backend)(u, v, x, idx, w)
    inductor = compiled(f, ctx)(u, v, x, idx, w)
    eager = f(u, v, x, idx, w)
    ctx.sync()
    return [collective_chain(g) for g in graphs], traced, inductor, eager


@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}{w}" for t, w in WORLDS])
def test_independent_collectives_stay_in_program_order(worlds, transport, size):
    for chains, traced, inductor, eager in worlds(transport, size).run(t_independent_collectives_keep_program_order):
        assert chains == [["all_reduce", "dispatch", "all_reduce", "combine"]], chains
        for got in (traced, inductor):
            for g, e in zip(got, eager):
                assert_bitwise(g, e, "compiled vs eager")


def test_order_token_is_one_per_device():
    cpu = rc.ops.order_token(torch.device("cpu"))
    assert rc.ops.order_token("cpu") is cpu and cpu.shape == (1,)


# ------------------------------------------------------- one graph for every T

T_SEQUENCE = [5, 0, 1, 2, 7, 8, 3, 4, 6, 0]  # 9 distinct token counts, 0 and 1 among them


def t_token_counts_share_one_graph(ctx):
    comm = ctx.comm(**ep_cfg(ctx.world))
    layer = moe.ExpertParallelMoE(comm, ffn=16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    f = torch.compile(lambda x: layer(x) + x, fullgraph=True, backend=counter)
    outs = []
    for i, T in enumerate(T_SEQUENCE):
        T = (T + 3 * ctx.rank) % 9  # ranks differ in T on every call
        x = rand(50 + i, ctx.rank, (T, 32)).to(ctx.device)
        outs.append((f(rc.mark_dynamic_tokens(x)), layer(x) + x))
    ctx.sync()
    return counter.frame_count, outs


def test_changing_token_counts_compile_once(worlds):
    for frames, outs in worlds("cpu", 2).run(t_token_counts_share_one_graph):
        assert frames <= 2, f"{frames} compilations for {len(set(T_SEQUENCE))} token counts"
        for got, want in outs:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
