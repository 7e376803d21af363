"""dispatch/combine: bitwise against the reference for every routing edge case,
interleaved handles, back-to-back calls, torch.compile, opcheck, bad inputs."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from common import (ROUTINGS, assert_bitwise, assert_dispatched, ep_inputs, examples, expert_fn, opcheck_dispatch, rand,
                    sender_chunk_bytes)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdna4_comm as rc
from rdna4_comm import reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, max_examples=examples(120))
SMALL_SLOT = 4096  # EP tests don't need all_reduce buffers


def ep_config(cap, hidden, topk, num_experts, dtype):
    return dict(max_tokens_per_rank=cap, hidden=hidden, topk=topk, num_experts=num_experts, dtype=dtype,
                allreduce_slot_bytes=SMALL_SLOT)


def ref_cfg(cfg):
    return dict(hidden=cfg["hidden"], topk=cfg["topk"], num_experts=cfg["num_experts"], dtype=cfg["dtype"])


def t_round_trip(ctx, cfg, seed, Ts, kind, weights):
    comm = ctx.comm(**cfg)
    x, idx, w = ep_inputs(seed, ctx.rank, ctx.world, Ts[ctx.rank], ref_cfg(cfg), kind, weights)
    dev = ctx.device
    d = comm.dispatch(x.to(dev), idx.to(dev), None if w is None else w.to(dev))
    out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
    return d, out


def expected_round_trip(W, cfg, seed, Ts, kind, weights, salt=0):
    inputs = [ep_inputs(seed, r, W, Ts[r], ref_cfg(cfg), kind, weights) for r in range(W)]
    xs, idxs, ws = zip(*inputs)
    ref = reference.dispatch(list(xs), list(idxs), list(ws) if weights else None,
                             num_experts=cfg["num_experts"], max_tokens_per_rank=cfg["max_tokens_per_rank"])
    ys = [expert_fn(ref[r].x, r, salt) for r in range(W)]
    return ref, reference.combine(ys, ref)


def check_round_trip(world, cfg, seed, Ts, kind, weights):
    results = world.run(t_round_trip, cfg, seed, Ts, kind, weights)
    ref, ref_out = expected_round_trip(world.size, cfg, seed, Ts, kind, weights)
    for r, (d, out) in enumerate(results):
        assert_dispatched(d, ref[r], f"rank {r}")
        assert_bitwise(out, ref_out[r], f"rank {r} combine")


@st.composite
def ep_cases(draw, world_size):
    cap = draw(st.integers(1, 40))
    hidden = draw(st.one_of(st.sampled_from([1, 7, 8, 13, 64, 100]), st.integers(1, 160)))
    topk = draw(st.one_of(st.sampled_from([1, 8, 32, 33, 64]), st.integers(1, 64)))
    num_experts = world_size * draw(st.integers(1, 24))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(ROUTINGS))
    Ts = [draw(st.one_of(st.sampled_from([0, cap]), st.integers(0, cap))) for _ in range(world_size)]
    if kind == "rank_without_tokens":
        Ts[draw(st.integers(0, world_size - 1))] = 0
    cfg = ep_config(cap, hidden, topk, num_experts, dtype)
    return cfg, draw(st.integers(0, 2**20)), Ts, kind, draw(st.booleans())


@pytest.mark.parametrize("kind", ROUTINGS)
def test_every_routing_kind(world, kind):
    W = world.size
    cfg = ep_config(24, 40, 8, 4 * W, torch.bfloat16)
    check_round_trip(world, cfg, 7, [24 - 5 * (r % 3) for r in range(W)], kind, True)


def test_top_k_one_to_sixty_four(world):
    W = world.size
    for topk in (1, 2, 8, 31, 32, 33, 63, 64):
        cfg = ep_config(12, 24, topk, 8 * W, torch.float32)
        check_round_trip(world, cfg, topk, [12] * W, "duplicates_across_32", topk % 2 == 0)


@pytest.mark.parametrize("tokens", [129, 1000, 8320, 66000], ids=lambda t: f"T{t}")
def test_large_batches_span_multi_token_chunks(world, tokens):
    """Token counts past 128 give chunks of several tokens (ep_chunk_tokens),
    past 8192 chunks of more than 64 tokens (one chunk per receive group) and
    past 65536 chunks of more than one block of tokens; on the GPU, 66000
    tokens also give dispatch sender blocks (a chunk each) ranges of more
    than a block of tokens (ep_own_block_tokens: about 674 at W = 1 on 132
    multiprocessors), which they route in several batches."""
    W = world.size
    cfg = ep_config(tokens, 8, 8, 8 * W, torch.bfloat16)
    Ts = [tokens - (r % 3 * tokens) // 3 for r in range(W)]  # T, 2T/3, T/3, T, ... at any world size
    check_round_trip(world, cfg, tokens, Ts, "random", True)


def test_chunks_of_more_rows_than_a_block_prefetches_into_l1(world):
    """Sender chunks of more bytes than a line per thread of the block
    (block_prefetch_covers; 8 tokens of 8200 bytes at W = 2 on 132
    multiprocessors) are not prefetched on the GPU, and each warp's piece of
    them spans rows; rows of 8200 bytes move in 2-byte pieces, not 16-byte
    vectors."""
    from rdna4_comm import _C

    assert not _C.testing.block_prefetch_covers(sender_chunk_bytes(600, 2, 4100 * 2))
    W = world.size
    cfg = ep_config(600, 4100, 8, 8 * W, torch.bfloat16)
    check_round_trip(world, cfg, 3, [600 - 200 * (r % 2) for r in range(W)], "random", True)


@SETTINGS
@given(data=st.data())
def test_matches_reference(world, data):
    cfg, seed, Ts, kind, weights = data.draw(ep_cases(world.size))
    check_round_trip(world, cfg, seed, Ts, kind, weights)


def t_interleaved(ctx, cfg_a, cfg_b, seed, Ts_a, Ts_b):
    ca, cb = ctx.comm(**cfg_a), ctx.comm(**cfg_b)
    dev = ctx.device

    def send(comm, cfg, s, Ts):
        x, idx, w = ep_inputs(s, ctx.rank, ctx.world, Ts[ctx.rank], ref_cfg(cfg), "random")
        return comm.dispatch(x.to(dev), idx.to(dev), w.to(dev))

    # Two dispatches on one communicator, combined in reverse order, with a
    # third on another communicator in between; no host sync anywhere.
    a = send(ca, cfg_a, seed, Ts_a)
    b = send(ca, cfg_a, seed + 1, Ts_a)
    c = send(cb, cfg_b, seed + 2, Ts_b)
    out_b = ca.combine(expert_fn(b.x, ctx.rank, 1), b.handle)
    out_c = cb.combine(expert_fn(c.x, ctx.rank, 2), c.handle)
    out_a = ca.combine(expert_fn(a.x, ctx.rank, 0), a.handle)
    return [(a, out_a), (b, out_b), (c, out_c)]


def test_interleaved_handles(world):
    W = world.size
    cfg_a = ep_config(16, 24, 4, 2 * W, torch.bfloat16)
    cfg_b = ep_config(9, 8, 3, 3 * W, torch.float16)
    Ts_a = [16 - 3 * (r % 6) for r in range(W)]  # 16, 13, ..., 1: in [0, cap] at any world size
    Ts_b = [9 - 2 * (r % 5) for r in range(W)]
    results = world.run(t_interleaved, cfg_a, cfg_b, 50, Ts_a, Ts_b)
    for i, (cfg, Ts) in enumerate(((cfg_a, Ts_a), (cfg_a, Ts_a), (cfg_b, Ts_b))):
        ref, ref_out = expected_round_trip(W, cfg, 50 + i, Ts, "random", True, salt=i)
        for r in range(W):
            d, out = results[r][i]
            assert_dispatched(d, ref[r], f"op {i} rank {r}")
            assert_bitwise(out, ref_out[r], f"op {i} rank {r} combine")


# Rank 0 issues its combine this long after the others issue theirs.
LATE_S = 0.5


def t_late_peer(ctx, cfg, seed, Ts):
    comm = ctx.comm(**cfg, timeout_ms=20 * int(LATE_S * 1000))
    x, idx, w = ep_inputs(seed, ctx.rank, ctx.world, Ts[ctx.rank], ref_cfg(cfg), "random")
    dev = ctx.device
    d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    y = expert_fn(d.x, ctx.rank)
    ctx.sync()
    dist.barrier(group=ctx.cpu_group)
    if ctx.rank == 0:
        time.sleep(LATE_S)
    # CLOCK_MONOTONIC: one clock for every process of the machine.
    issued = time.monotonic()
    out = comm.combine(y, d.handle)
    ctx.sync()
    return d, out, issued, time.monotonic()


def test_rank_without_tokens_waits_for_a_late_peer(world):
    """A combine on a rank with no tokens sums nothing, yet it must not end
    before every peer has issued its own: the combine inboxes alternate
    between two halves by generation, and a rank that ran two combines ahead
    would overwrite rows a late peer has yet to read."""
    W = world.size
    if W < 2:
        pytest.skip("needs a peer")
    cfg = ep_config(16, 40, 4, 4 * W, torch.bfloat16)
    Ts = [16] * (W - 1) + [0]
    results = world.run(t_late_peer, cfg, 5, Ts)
    ref, ref_out = expected_round_trip(W, cfg, 5, Ts, "random", True)
    for r, (d, out, _, _) in enumerate(results):
        assert_dispatched(d, ref[r], f"rank {r}")
        assert_bitwise(out, ref_out[r], f"rank {r} combine")
    late_issued, done = results[0][2], results[-1][3]
    assert done >= late_issued, (
        f"the combine of rank {W - 1} (no tokens) ended {late_issued - done:.3f} s before rank 0, "
        f"{LATE_S} s late, issued its combine")


def back_to_back_plan(n, W, cap):
    g = torch.Generator().manual_seed(n)
    Ts = torch.randint(0, cap + 1, (n, W), generator=g).tolist()
    kinds = [ROUTINGS[i] for i in torch.randint(0, len(ROUTINGS), (n,), generator=g).tolist()]
    return Ts, kinds


def t_back_to_back(ctx, cfg, ar_cfg, n, seed):
    comm, ar = ctx.comm(**cfg), ctx.comm(**ar_cfg)
    Ts, kinds = back_to_back_plan(n, ctx.world, cfg["max_tokens_per_rank"])
    dev = ctx.device
    outs = []
    for i in range(n):
        x, idx, w = ep_inputs(seed + i, ctx.rank, ctx.world, Ts[i][ctx.rank], ref_cfg(cfg), kinds[i])
        d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev))
        out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
        s = ar.all_reduce(rand(seed + i, ctx.rank, (1 + 37 * i % 700,)).to(dev))
        outs.append((d.counts, out, s))
    return outs


def test_back_to_back_mixed_ops_changing_shapes(world_small):
    W = world_small.size
    n = 700 if world_small.transport == "gpu" else 40  # x3 ops each
    cfg = ep_config(20, 48, 6, 3 * W, torch.bfloat16)
    ar_cfg = dict(allreduce_slot_bytes=1024)
    results = world_small.run(t_back_to_back, cfg, ar_cfg, n, 900)
    Ts, kinds = back_to_back_plan(n, W, 20)
    for i in range(n):
        ref, ref_out = expected_round_trip(W, cfg, 900 + i, Ts[i], kinds[i], True)
        ref_sum = reference.all_reduce([rand(900 + i, r, (1 + 37 * i % 700,)) for r in range(W)])
        for r in range(W):
            counts, out, s = results[r][i]
            assert_bitwise(counts, ref[r].counts, f"op {i} rank {r} counts")
            assert_bitwise(out, ref_out[r], f"op {i} rank {r} combine")
            assert_bitwise(s, ref_sum, f"op {i} rank {r} all_reduce")


def t_compiled_round_trip(ctx, cfg, seed):
    comm = ctx.comm(**cfg)

    def layer(x, idx, w):
        d = comm.dispatch(x, idx, w)
        return comm.combine(expert_fn(d.x, ctx.rank), d.handle), d.topk_weights

    compiled = torch.compile(layer, fullgraph=True)
    res = []
    for i, T in enumerate((5, cfg["max_tokens_per_rank"], 0)):
        x, idx, w = (t.to(ctx.device) for t in ep_inputs(seed + i, ctx.rank, ctx.world, T, ref_cfg(cfg), "random"))
        res.append((layer(x, idx, w), compiled(x, idx, w)))
    return res


def test_torch_compile_fullgraph_equals_eager(worlds):
    cfg = ep_config(8, 16, 4, 4, torch.bfloat16)
    for pairs in worlds("cpu", 2).run(t_compiled_round_trip, cfg, 4):
        for (eager_out, eager_w), (comp_out, comp_w) in pairs:
            assert_bitwise(comp_out, eager_out, "compiled combine")
            assert_bitwise(comp_w, eager_w, "compiled weights")


def t_opcheck(ctx, cfg):
    """opcheck compares every output element of eager and traced calls, so
    its dispatch receives W * cap rows (every token to every rank, T = cap):
    x has no padding rows, whose values the op leaves unspecified."""
    comm = ctx.comm(**cfg)
    dev = ctx.device
    assert cfg["topk"] >= ctx.world
    for weights in (True, False):
        x, idx, w = ep_inputs(3, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], ref_cfg(cfg), "every_rank", weights)
        token = rc.ops.order_token(dev)
        args = (x.to(dev), idx.to(dev), None if w is None else w.to(dev), token, comm.id)
        opcheck_dispatch(torch.ops.rdna4_comm.dispatch.default, args)
        d = comm.dispatch(*args[:3])
        h = d.handle
        y = expert_fn(d.x, ctx.rank)
        torch.library.opcheck(torch.ops.rdna4_comm.combine.default,
                              (y, h.recv_src, h.counts, h.src_tokens, h.send_mask, h.dispatch_round, token, comm.id))
    return True


def test_opcheck(world_small):
    W = world_small.size
    assert all(world_small.run(t_opcheck, ep_config(6, 8, max(3, W), 2 * W, torch.bfloat16)))


def t_model_shaped_inputs(ctx, cfg, seed, lead, w_dtype, idx_dtype):
    """x of shape [*lead, H] with routing [*lead, K] in the router's dtypes, as
    model code passes them."""
    comm = ctx.comm(**cfg)
    T = int(torch.tensor(lead).prod())
    x, idx, w = ep_inputs(seed, ctx.rank, ctx.world, T, ref_cfg(cfg), "random")
    H, K = cfg["hidden"], cfg["topk"]
    dev = ctx.device
    d = comm.dispatch(x.view(*lead, H).to(dev), idx.to(idx_dtype).view(*lead, K).to(dev),
                      w.to(w_dtype).view(*lead, K).to(dev))
    out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
    # The flat [T, K] routing of the same tokens is accepted as well.
    flat = comm.dispatch(x.view(*lead, H).to(dev), idx.to(idx_dtype).to(dev), w.to(w_dtype).to(dev))
    comm.combine(expert_fn(flat.x, ctx.rank), flat.handle)
    return d, out, flat


@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
def test_model_shaped_inputs_and_router_dtypes(world, w_dtype):
    """[B, S, H] tokens and bf16/fp16/fp32 weights with int32/int64 ids go in
    unchanged; routing comes back in the dtypes given, combine in x's shape."""
    W = world.size
    cfg = ep_config(12, 24, 4, 4 * W, torch.bfloat16)
    lead = (2, 5)
    for idx_dtype in (torch.int64, torch.int32):
        results = world.run(t_model_shaped_inputs, cfg, 31, lead, w_dtype, idx_dtype)
        inputs = [ep_inputs(31, r, W, 10, ref_cfg(cfg), "random") for r in range(W)]
        xs, idxs, ws = (list(v) for v in zip(*inputs))
        ref = reference.dispatch(xs, [i.to(idx_dtype) for i in idxs], [w.to(w_dtype) for w in ws],
                                 num_experts=cfg["num_experts"], max_tokens_per_rank=12)
        ref_out = reference.combine([expert_fn(ref[r].x, r) for r in range(W)], ref)
        for r, (d, out, flat) in enumerate(results):
            assert d.topk_idx.dtype == idx_dtype and d.topk_weights.dtype == w_dtype
            assert_dispatched(d, ref[r], f"rank {r}")
            assert_dispatched(flat, ref[r], f"rank {r}, flat routing")
            assert d.handle.token_shape == lead
            assert_bitwise(out, ref_out[r].view(*lead, cfg["hidden"]), f"rank {r} combine")


def t_all_reduce_only(ctx):
    comm = ctx.comm(allreduce_slot_bytes=SMALL_SLOT)
    try:
        comm.dispatch(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))
    except RuntimeError as e:
        return str(e)


def test_dispatch_needs_ep_fields(worlds):
    for message in worlds("cpu", 2).run(t_all_reduce_only):
        assert "without EP fields" in message
