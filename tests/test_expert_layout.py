"""dispatch(..., layout="expert") and its combine: bitwise against
rdna4_comm.reference on every transport, property-based (alignments 1, 16
and 128; 1 to 64 local experts; top-k 1 to 64; skewed routing), mixed with
the rank layout back to back with interleaved handles, max_expert_rows
overflow, torch.compile and opcheck."""
from __future__ import annotations

import pytest
import torch
from common import ROUTINGS, assert_bitwise, ep_inputs, examples, expert_fn, opcheck_dispatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdna4_comm as rc
from rdna4_comm import reference
from rdna4_comm._checks import assert_expert_dispatched

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, max_examples=examples(60))


def ep_config(cap, hidden, topk, num_experts, dtype, alignment=1, max_rows=None):
    return dict(max_tokens_per_rank=cap, hidden=hidden, topk=topk, num_experts=num_experts, dtype=dtype,
                allreduce_slot_bytes=4096, expert_alignment=alignment, max_expert_rows=max_rows)


def ref_cfg(cfg):
    return dict(hidden=cfg["hidden"], topk=cfg["topk"], num_experts=cfg["num_experts"], dtype=cfg["dtype"])


def placed(x, dev, offset):
    """x on dev, `offset` elements into a buffer of its own (1: its rows start off 16-byte boundaries)."""
    buf = torch.empty(x.numel() + offset, dtype=x.dtype, device=dev)
    return buf[offset:].view(x.shape).copy_(x)


def t_round_trip(ctx, cfg, seed, Ts, kind, weights, offset=0):
    comm = ctx.comm(**cfg)
    dev = ctx.device
    x, idx, w = ep_inputs(seed, ctx.rank, ctx.world, Ts[ctx.rank], ref_cfg(cfg), kind, weights)
    d = comm.dispatch(placed(x, dev, offset), idx.to(dev), None if w is None else w.to(dev), layout="expert")
    out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
    return d, out, comm.expert_rows


def expected(W, cfg, seed, Ts, kind, weights, salt=0):
    xs, idxs, ws = zip(*[ep_inputs(seed, r, W, Ts[r], ref_cfg(cfg), kind, weights) for r in range(W)])
    ref = reference.dispatch(list(xs), list(idxs), list(ws) if weights else None, num_experts=cfg["num_experts"],
                             max_tokens_per_rank=cfg["max_tokens_per_rank"], layout="expert",
                             expert_alignment=cfg["expert_alignment"], max_expert_rows=cfg["max_expert_rows"])
    return ref, reference.combine([expert_fn(ref[r].x, r, salt) for r in range(W)], ref)


def check(world, cfg, seed, Ts, kind, weights, offset=0):
    ref, ref_out = expected(world.size, cfg, seed, Ts, kind, weights)
    for r, (d, out, rows) in enumerate(world.run(t_round_trip, cfg, seed, Ts, kind, weights, offset)):
        assert rows == ref[r].x.shape[0]
        assert_expert_dispatched(d, ref[r], f"rank {r}")
        assert_bitwise(out, ref_out[r], f"rank {r} combine")


@pytest.mark.parametrize("kind", ROUTINGS)
def test_every_routing_kind(world, kind):
    W = world.size
    check(world, ep_config(12, 24, 4, 4 * W, torch.bfloat16, 16), 5, [12 - 5 * (r % 3) for r in range(W)], kind, True)


def test_rows_off_vector_boundaries_give_the_same_bits(world):
    # x one element past a 16-byte boundary (its rows of 512 bytes all off one).
    W = world.size
    check(world, ep_config(7, 256, 3, 2 * W, torch.bfloat16, 16), 8, [7, 2, 0, 5][:W], "random", True, offset=1)


@pytest.mark.parametrize("hidden, offset", [(7168, 0), (7200, 0), (7200, 1)])
@pytest.mark.parametrize("cap", [8, 64])
def test_decode_rows_wide_enough_to_slice(world, hidden, offset, cap):
    # A decode step of rows of 1 KiB or more: on GPUs the placement cuts
    # them into slices over the grid (expert_row_slices) and combine's
    # receivers sum them a column slice a block (combine_recv_slices). 7168
    # bf16 channels are 896 16-byte vectors, 7200 are 900, so the last
    # slice is shorter; one element off a 16-byte boundary, the rows go as
    # 2-byte vectors. On a prefill-sized capacity too.
    W = world.size
    check(world, ep_config(cap, hidden, 8, 8 * W, torch.bfloat16, 1), hidden + cap, [8, 3, 8, 0][:W], "random",
          True, offset=offset)


@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_skewed_routing_every_token_to_one_expert(world, alignment):
    W = world.size
    check(world, ep_config(9, 16, 3, 2 * W, torch.float32, alignment), 3, [9] * W, "one_expert", True)


def test_top_k_and_local_experts_up_to_sixty_four(world):
    W = world.size
    for topk, local in ((1, 1), (64, 2), (8, 64), (33, 5)):
        check(world, ep_config(6, 8, topk, local * W, torch.float16, 1), topk, [6] * W, "duplicates_across_32",
              topk % 2 == 1)


@st.composite
def cases(draw, W):
    cap = draw(st.integers(1, 12))
    topk = draw(st.one_of(st.sampled_from([1, 2, 8, 64]), st.integers(1, 16)))
    local = draw(st.one_of(st.sampled_from([1, 64]), st.integers(1, 12)))
    cfg = ep_config(cap, draw(st.integers(1, 40)), topk, local * W, draw(st.sampled_from(DTYPES)),
                    draw(st.sampled_from([1, 16, 128])))
    Ts = [draw(st.integers(0, cap)) for _ in range(W)]
    return cfg, draw(st.integers(0, 2**20)), Ts, draw(st.sampled_from(ROUTINGS)), draw(st.booleans())


@SETTINGS
@given(data=st.data())
def test_matches_reference(world, data):
    check(world, *data.draw(cases(world.size)))


def t_chunks_back_to_back(ctx, cfg, Ts):
    comm, dev = ctx.comm(**cfg), ctx.device
    outs = []
    for i, T in enumerate(Ts):
        x, idx, w = ep_inputs(30 + i, ctx.rank, ctx.world, T, ref_cfg(cfg), "random", True)
        d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev), layout="expert")
        outs.append((d, comm.combine(expert_fn(d.x, ctx.rank, i), d.handle)))
    return outs


def check_chunks_back_to_back(world):
    # Rows received that fill several chunks (of 32 rows), three dispatches
    # back to back with no host sync: on GPUs the tally's last block computes
    # the offsets, and each tally must find its count of finished blocks reset.
    W = world.size
    cfg = ep_config(48, 16, 4, 2 * W, torch.bfloat16, 16)
    Ts = (48, 33, 40)
    results = world.run(t_chunks_back_to_back, cfg, Ts)
    for i, T in enumerate(Ts):
        ref, ref_out = expected(W, cfg, 30 + i, [T] * W, "random", True, salt=i)
        for r, outs in enumerate(results):
            d, out = outs[i]
            assert_expert_dispatched(d, ref[r], f"call {i} rank {r}")
            assert_bitwise(out, ref_out[r], f"call {i} rank {r} combine")


def test_rows_of_several_chunks_back_to_back(world):
    check_chunks_back_to_back(world)


def test_rows_of_several_chunks_on_dist_alone(worlds):
    # One rank of "dist" has a GPU wherever there is one: its placement runs
    # without a heap (expert_layout_on_gpu), its count word the scratch's,
    # zeroed for each call.
    check_chunks_back_to_back(worlds("dist", 1))


def t_mixed(ctx, cfg):
    """Both layouts back to back on one communicator, no host sync, the
    handles combined in reverse order."""
    comm, dev = ctx.comm(**cfg), ctx.device
    sends = []
    for i, layout in enumerate(("expert", "rank", "expert")):
        x, idx, w = ep_inputs(20 + i, ctx.rank, ctx.world, cfg["max_tokens_per_rank"] - i, ref_cfg(cfg), "random")
        sends.append(comm.dispatch(x.to(dev), idx.to(dev), w.to(dev), layout=layout))
    outs = [comm.combine(expert_fn(d.x, ctx.rank, i), d.handle) for i, d in reversed(list(enumerate(sends)))]
    return sends, outs[::-1]


def test_both_layouts_back_to_back_with_interleaved_handles(world):
    W = world.size
    cfg = ep_config(8, 16, 4, 3 * W, torch.bfloat16, 16)
    results = world.run(t_mixed, cfg)
    for i, layout in enumerate(("expert", "rank", "expert")):
        Ts = [cfg["max_tokens_per_rank"] - i] * W
        xs, idxs, ws = zip(*[ep_inputs(20 + i, r, W, Ts[r], ref_cfg(cfg), "random") for r in range(W)])
        ref = reference.dispatch(list(xs), list(idxs), list(ws), num_experts=cfg["num_experts"],
                                 max_tokens_per_rank=cfg["max_tokens_per_rank"], layout=layout,
                                 expert_alignment=16)
        ref_out = reference.combine([expert_fn(ref[r].x, r, i) for r in range(W)], ref)
        for r, (sends, outs) in enumerate(results):
            if layout == "expert":
                assert_expert_dispatched(sends[i], ref[r], f"call {i} rank {r}")
            assert_bitwise(outs[i], ref_out[r], f"call {i} rank {r} combine")


def test_layouts_combine_to_the_same_bits(world):
    """The expert layout's combine of per-pair rows equals the rank layout's
    combine of the same rows summed per received row first (what an experts
    loop over slots gives): the two layouts are bitwise comparable."""
    W = world.size
    cfg = ep_config(10, 12, 6, 2 * W, torch.bfloat16, 1)
    ref, ref_out = expected(W, cfg, 9, [10] * W, "random", True)
    rank_rows = [reference._rank_rows(expert_fn(ref[r].x, r), ref[r].handle) for r in range(W)]
    rank_ref = reference.dispatch(*[list(t) for t in zip(*[ep_inputs(9, r, W, 10, ref_cfg(cfg), "random")
                                                           for r in range(W)])], num_experts=2 * W,
                                  max_tokens_per_rank=10)
    via_rank = reference.combine(rank_rows, rank_ref)
    for r in range(W):
        assert_bitwise(via_rank[r], ref_out[r], f"rank {r}")


def t_overflow(ctx, cfg):
    comm, dev = ctx.comm(**cfg), ctx.device
    x, idx, w = ep_inputs(4, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], ref_cfg(cfg), "one_expert")
    d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev), layout="expert")
    error = None
    try:
        comm.check()
    except ValueError as e:
        error = str(e)
    again = comm.dispatch(x[:1].to(dev), idx[:1].to(dev), w[:1].to(dev), layout="expert")  # still usable
    comm.check()
    return d, error, again


def test_max_expert_rows_overflow_raises_and_writes_nothing_out_of_bounds(world):
    W = world.size
    cfg = ep_config(6, 8, 2, 2 * W, torch.float32, 1, max_rows=5)
    ref, _ = expected(W, cfg, 4, [6] * W, "one_expert", True)
    for r, (d, error, again) in enumerate(world.run(t_overflow, cfg)):
        assert d.x.shape[0] == 5
        # Up to the end of the last nonempty block: its alignment padding need not fit.
        needed = int((ref[r].expert_offsets[:-1] + ref[r].expert_counts).max())
        if needed > 5:
            assert error is not None and f"needed {needed} rows, more than this communicator's expert_rows = 5" \
                in error, (r, error)
        else:
            assert error is None, (r, error)
        assert_expert_dispatched(d, ref[r], f"rank {r}")  # the rows that fit


def t_overflow_next_call(ctx, cfg):
    """The overflow raises at the end of a later op of the rank, after that op
    ran on every rank (the next one on the CPU; on a GPU the first after the
    device computed it), or at check(): the ranks stay in step and the next
    collective works."""
    comm, dev = ctx.comm(**cfg), ctx.device
    x, idx, w = ep_inputs(4, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], ref_cfg(cfg), "one_expert")
    d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev), layout="expert")
    error = None
    try:
        comm.combine(expert_fn(d.x, ctx.rank), d.handle)
    except ValueError as e:
        error = str(e)
    if error is None:
        try:
            comm.check()
        except ValueError as e:
            error = str(e)
    ctx.sync()
    total = comm.all_reduce(torch.full((4,), float(ctx.rank + 1), device=dev))
    return error, total


def test_overflow_raises_at_the_next_call_and_the_ranks_stay_in_step(world):
    W = world.size
    cfg = ep_config(6, 8, 2, 2 * W, torch.float32, 1, max_rows=5)
    ref, _ = expected(W, cfg, 4, [6] * W, "one_expert", True)
    for r, (error, total) in enumerate(world.run(t_overflow_next_call, cfg)):
        needed = int((ref[r].expert_offsets[:-1] + ref[r].expert_counts).max())
        assert (error is not None) == (needed > 5), (r, needed, error)
        assert torch.equal(total, torch.full((4,), float(W * (W + 1) // 2))), (r, total)


def t_forged_and_strided(ctx, cfg):
    comm, dev, H = ctx.comm(**cfg), ctx.device, cfg["hidden"]
    x, idx, w = ep_inputs(5, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], ref_cfg(cfg), "random")
    d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev), layout="expert")
    y, h, n = expert_fn(d.x, ctx.rank), d.handle, comm.expert_rows
    # Values outside [0, expert_rows) name no row: forged into every -1 entry.
    unused = h.expert_rows_of < 0
    bad = torch.tensor([-5, n, 2**31 - 1], dtype=torch.int32, device=dev).repeat(int(unused.sum()) // 3 + 1)
    forged = h.expert_rows_of.clone()
    forged[unused] = bad[: int(unused.sum())]
    # Strided y and expert_rows_of: the left halves of wider tensors.
    wide_y = torch.zeros(n, 2 * H, dtype=y.dtype, device=dev)
    wide_y[:, :H] = y
    wide_of = torch.full((h.expert_rows_of.shape[0], 2 * cfg["topk"]), -1, dtype=torch.int32, device=dev)
    wide_of[:, : cfg["topk"]] = h.expert_rows_of
    out = comm.combine(y, h)
    out_forged = comm.combine(y, h._replace(expert_rows_of=forged))
    out_strided = comm.combine(wide_y[:, :H], h._replace(expert_rows_of=wide_of[:, : cfg["topk"]]))
    return out, out_forged, out_strided, bool(unused.any())


def test_forged_expert_rows_name_no_row_and_strided_inputs_give_the_same_sums(world):
    cfg = ep_config(6, 8, 3, 4 * world.size, torch.bfloat16, 4)
    for out, out_forged, out_strided, forged_any in world.run(t_forged_and_strided, cfg):
        assert forged_any
        assert_bitwise(out_forged, out, "forged expert_rows_of values")
        assert_bitwise(out_strided, out, "strided y and expert_rows_of")


def t_opcheck(ctx, cfg):
    comm, dev = ctx.comm(**cfg), ctx.device
    x, idx, w = ep_inputs(3, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], ref_cfg(cfg), "every_rank")
    token = rc.ops.order_token(dev)
    args = (x.to(dev), idx.to(dev), w.to(dev), token, comm.id)
    d = comm.dispatch(*args[:3], layout="expert")
    # Every pair row is compared; rows past expert_offsets[-1] are unspecified, so the case fills x exactly.
    assert int(d.expert_offsets[-1]) == comm.expert_rows
    opcheck_dispatch(torch.ops.rdna4_comm.dispatch_expert.default, args)
    h = d.handle
    torch.library.opcheck(torch.ops.rdna4_comm.combine_expert.default,
                          (d.x, h.expert_rows_of, h.recv_src, h.counts, h.src_tokens, h.send_mask, h.dispatch_round,
                           token, comm.id))
    return True


def test_opcheck(world_small):
    W = world_small.size
    # K = W and one local expert: every token reaches every rank once, so the layout has no padding.
    assert all(world_small.run(t_opcheck, ep_config(4, 8, W, W, torch.float32, 1)))


def t_compiled(ctx, cfg):
    comm, dev = ctx.comm(**cfg), ctx.device

    @torch.compile(fullgraph=True, backend="eager")
    def step(x, idx, w):
        d = comm.dispatch(x, idx, w, layout="expert")
        return d.expert_offsets, comm.combine(expert_fn(d.x, ctx.rank), d.handle)

    x, idx, w = ep_inputs(6, ctx.rank, ctx.world, 5, ref_cfg(cfg), "random")
    eager_d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev), layout="expert")
    eager = comm.combine(expert_fn(eager_d.x, ctx.rank), eager_d.handle)
    offsets, out = step(x.to(dev), idx.to(dev), w.to(dev))
    return eager_d.expert_offsets, eager, offsets, out


def test_compiled_matches_eager(world_small):
    W = world_small.size
    for eo, eager, co, out in world_small.run(t_compiled, ep_config(5, 8, 2, 2 * W, torch.bfloat16, 16)):
        assert_bitwise(co, eo, "expert_offsets")
        assert_bitwise(out, eager, "combine")
