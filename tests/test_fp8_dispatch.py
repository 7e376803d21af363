"""FP8 dispatch (Communicator(dispatch_dtype=torch.float8_e4m3fn)): every
transport sends the bytes of rdna4_comm.quantize_fp8, bitwise, whether the
op quantises x or takes a (q, scales) pair; in the rank and the expert
layout; property-based (dtypes, H not a multiple of 128, odd H, top-k,
token counts 0..cap), back to back, compiled, opcheck, and bad inputs that
leave the communicator usable (with the catalogue's rows for FP8 in
tests/test_bad_inputs.py)."""
from __future__ import annotations

import pytest
import torch
from common import ROUTINGS, assert_bitwise, ep_inputs, examples, opcheck_dispatch, sender_chunk_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdna4_comm as rc
from rdna4_comm import reference

FP8 = torch.float8_e4m3fn
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, max_examples=examples(40))


def fp8_config(cap, hidden, topk, num_experts, dtype=torch.bfloat16, alignment=1):
    return dict(max_tokens_per_rank=cap, hidden=hidden, topk=topk, num_experts=num_experts, dtype=dtype,
                allreduce_slot_bytes=4096, expert_alignment=alignment, dispatch_dtype=FP8)


def inputs(cfg, seed, rank, world, T, kind="random", scale=1.0):
    rcfg = dict(hidden=cfg["hidden"], topk=cfg["topk"], num_experts=cfg["num_experts"], dtype=cfg["dtype"])
    x, idx, w = ep_inputs(seed, rank, world, T, rcfg, kind)
    return (x.float() * scale).to(cfg["dtype"]), idx, w


def t_dispatch(ctx, cfg, seed, Ts, kind, pair, layout, scale):
    comm, dev = ctx.comm(**cfg), ctx.device
    x, idx, w = inputs(cfg, seed, ctx.rank, ctx.world, Ts[ctx.rank], kind, scale)
    arg = tuple(t.to(dev) for t in rc.quantize_fp8(x)) if pair else x.to(dev)
    d = comm.dispatch(arg, idx.to(dev), w.to(dev), layout=layout)
    assert d.x.dtype == FP8, d.x.dtype
    return d._replace(x=d.x.view(torch.uint8))  # FP8 storages do not pickle; their bytes do


def assert_fp8_rows(actual, expected, rows, what):
    """The FP8 bytes (actual.x: their uint8 view) and the scales of the first
    `rows` rows (later rows are unspecified). A NaN byte matches a NaN byte
    of either sign: a NaN's sign is not part of the rule (docs/semantics.md,
    section 9; an infinite x gives inf / inf, whose sign the hardware picks)."""
    assert actual.x.shape == expected.x.shape, (what, actual.x.shape)
    assert actual.x_scales.shape == expected.x_scales.shape, (what, actual.x_scales.shape)
    mine, want = actual.x[:rows].clone(), expected.x[:rows].view(torch.uint8).clone()
    for q in (mine, want):
        q[(q & 0x7F) == 0x7F] = 0x7F
    assert_bitwise(mine, want, f"{what} x")
    assert_bitwise(actual.x_scales[:rows], expected.x_scales[:rows], f"{what} x_scales")


def check(world, cfg, seed, Ts, kind="random", pair=False, layout="rank", scale=1.0):
    W = world.size
    xs, idxs, ws = zip(*[inputs(cfg, seed, r, W, Ts[r], kind, scale) for r in range(W)])
    ref = reference.dispatch(list(xs), list(idxs), list(ws), num_experts=cfg["num_experts"],
                             max_tokens_per_rank=cfg["max_tokens_per_rank"], layout=layout,
                             expert_alignment=cfg["expert_alignment"], dispatch_dtype=FP8)
    for r, d in enumerate(world.run(t_dispatch, cfg, seed, Ts, kind, pair, layout, scale)):
        if layout == "rank":
            assert_fp8_rows(d, ref[r], int(ref[r].counts.sum()), f"rank {r}")
            assert_bitwise(d.topk_idx, ref[r].topk_idx, f"rank {r} topk_idx")
            assert_bitwise(d.topk_weights, ref[r].topk_weights, f"rank {r} topk_weights")
        else:
            rows = min(int(ref[r].expert_offsets[-1]), ref[r].x.shape[0])
            assert_fp8_rows(d, ref[r], rows, f"rank {r} expert layout")
            assert_bitwise(d.expert_offsets, ref[r].expert_offsets, f"rank {r} expert_offsets")
        for field in ("recv_src", "counts", "src_tokens", "send_mask"):
            assert_bitwise(getattr(d.handle, field), getattr(ref[r].handle, field), f"rank {r} handle.{field}")


@pytest.mark.parametrize("kind", ROUTINGS)
def test_every_routing_kind(world, kind):
    W = world.size
    check(world, fp8_config(9, 256, 4, 4 * W), 3, [9 - 4 * (r % 3) for r in range(W)], kind)


@pytest.mark.parametrize("pair", [False, True], ids=["quantised_in_op", "pair"])
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_layouts_and_inputs(world, pair, layout):
    W = world.size
    check(world, fp8_config(7, 300, 3, 2 * W, alignment=16), 11, [7, 0, 5, 2][:W], pair=pair, layout=layout)


@pytest.mark.parametrize("pair", [False, True], ids=["quantised_in_op", "pair"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chunks_of_more_rows_than_a_block_prefetches_into_l1(world, pair, dtype):
    """Sender chunks past a line per thread (test_ep's test of that name; 16
    tokens at W = 2, whose 4100-byte pair rows are past it too): each
    quantising warp's piece spans rows and many passes of its loop, and a
    last block of 4 channels (hidden 4100) gives lane units past the row's
    channels."""
    from rdna4_comm import _C

    assert not _C.testing.block_prefetch_covers(sender_chunk_bytes(1200, 2, 4100))
    W = world.size
    check(world, fp8_config(1200, 4100, 4, 4 * W, dtype), 5, [1200 - 400 * (r % 2) for r in range(W)], pair=pair)


@SETTINGS
@given(data=st.data())
def test_property(world, data):
    W = world.size
    cap = data.draw(st.integers(1, 12), "cap")
    hidden = data.draw(st.sampled_from([1, 17, 128, 130, 255, 384]), "hidden")
    topk = data.draw(st.integers(1, 6), "topk")
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), "dtype")
    Ts = data.draw(st.lists(st.integers(0, cap), min_size=W, max_size=W), "Ts")
    scale = data.draw(st.sampled_from([1.0, 1e-3, 3e4 if dtype != torch.float16 else 6e4]), "scale")
    cfg = fp8_config(cap, hidden, topk, data.draw(st.sampled_from([W, 4 * W]), "experts"), dtype)
    check(world, cfg, data.draw(st.integers(0, 99), "seed"), Ts, data.draw(st.sampled_from(ROUTINGS), "kind"),
          pair=data.draw(st.booleans(), "pair"), scale=scale)


def t_back_to_back(ctx, cfg, rounds):
    """Dispatches without a host synchronisation between them, x and pairs
    alternating, then every result read at the end."""
    comm, dev = ctx.comm(**cfg), ctx.device
    out = []
    for i in range(rounds):
        x, idx, w = inputs(cfg, 20 + i, ctx.rank, ctx.world, cfg["max_tokens_per_rank"] - i % 3)
        arg = tuple(t.to(dev) for t in rc.quantize_fp8(x)) if i % 2 else x.to(dev)
        out.append(comm.dispatch(arg, idx.to(dev), w.to(dev)))
    return [(d.x.view(torch.uint8).cpu(), d.x_scales.cpu(), d.counts.cpu()) for d in out]


def test_back_to_back(world):
    W, rounds = world.size, 6
    cfg = fp8_config(6, 200, 2, 2 * W)
    got = world.run(t_back_to_back, cfg, rounds)
    for i in range(rounds):
        xs, idxs, ws = zip(*[inputs(cfg, 20 + i, r, W, 6 - i % 3) for r in range(W)])
        ref = reference.dispatch(list(xs), list(idxs), list(ws), num_experts=2 * W, max_tokens_per_rank=6,
                                 dispatch_dtype=FP8)
        for r, results in enumerate(got):
            q, s, counts = results[i]
            n = int(counts.sum())
            assert_bitwise(q[:n], ref[r].x[:n].view(torch.uint8), f"round {i} rank {r} x")
            assert_bitwise(s[:n], ref[r].x_scales[:n], f"round {i} rank {r} x_scales")


def t_combine_after_fp8(ctx, cfg):
    """The experts dequantise and combine runs in dtype, as without FP8."""
    comm, dev = ctx.comm(**cfg), ctx.device
    x, idx, w = inputs(cfg, 5, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], "every_rank")
    d = comm.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    y = rc.dequantize_fp8(d.x, d.x_scales, cfg["dtype"])
    return comm.combine(y, d.handle).cpu(), x


def test_combine_of_dequantised_rows_is_within_fp8_error(world):
    W = world.size
    for r, (out, x) in enumerate(world.run(t_combine_after_fp8, fp8_config(5, 256, W, W))):
        # K = W and one expert per rank: every token reaches every rank once.
        expected = rc.dequantize_fp8(*rc.quantize_fp8(x), torch.float32) * W
        assert torch.allclose(out.float(), expected, rtol=2 ** -7 * W, atol=1e-6), (r, (out.float() - expected).abs().max())


def t_empty_and_bad_inputs(ctx, cfg):
    """T = 0, then each bad input raises naming the argument; the
    communicator still dispatches afterwards."""
    comm, dev = ctx.comm(**cfg), ctx.device
    H, K = cfg["hidden"], cfg["topk"]
    idx0 = torch.zeros(0, K, dtype=torch.int64, device=dev)
    d = comm.dispatch(torch.zeros(0, H, dtype=cfg["dtype"], device=dev), idx0)
    assert d.x.dtype == FP8 and d.x_scales.shape == (ctx.world * cfg["max_tokens_per_rank"], 2)
    x, idx, w = (t.to(dev) for t in inputs(cfg, 1, ctx.rank, ctx.world, 3))
    q, s = rc.quantize_fp8(x)
    errors = {}
    bad = {
        "scales_shape": ((q, s[:, :1]), "x_scales"),
        "scales_dtype": ((q, s.double()), "x_scales"),
        "q_dtype": ((x, s), "x (the pair's q)"),
        "x_dtype": (x.float() if cfg["dtype"] != torch.float32 else x.half(), "x must be"),
        "triple": ((q, s, s), "pair"),
    }
    for name, (arg, needle) in bad.items():
        try:
            comm.dispatch(arg, idx, w)
        except (TypeError, ValueError) as e:
            errors[name] = needle in str(e), str(e)
        else:
            errors[name] = False, "no error"
    d = comm.dispatch((q, s), idx, w)
    return errors, int(d.counts.sum())


def test_empty_and_bad_inputs(world_small):
    for errors, _ in world_small.run(t_empty_and_bad_inputs, fp8_config(4, 200, 2, 2 * world_small.size)):
        for name, (ok, message) in errors.items():
            assert ok, (name, message)


def t_opcheck(ctx, cfg):
    comm, dev = ctx.comm(**cfg), ctx.device
    x, idx, w = (t.to(dev) for t in inputs(cfg, 3, ctx.rank, ctx.world, cfg["max_tokens_per_rank"], "every_rank"))
    token = rc.ops.order_token(dev)
    opcheck_dispatch(torch.ops.rdna4_comm.dispatch_fp8.default, (x, None, idx, w, token, comm.id))
    q, s = rc.quantize_fp8(x)
    # test_schema compares FP8 inputs with allclose, which torch lacks for FP8
    # on the CPU: the pair form runs the other checks.
    opcheck_dispatch(torch.ops.rdna4_comm.dispatch_fp8.default, (q, s, idx, w, token, comm.id),
                     test_utils=("test_faketensor",))
    return True


def test_opcheck(world_small):
    W = world_small.size
    # K = W and one expert per rank: every token reaches every rank, so no row is padding.
    assert all(world_small.run(t_opcheck, fp8_config(4, 136, W, W, torch.float32)))


def t_compiled(ctx, cfg):
    comm, dev = ctx.comm(**cfg), ctx.device

    @torch.compile(fullgraph=True, backend="eager")
    def step(x, idx, w):
        d = comm.dispatch(x, idx, w)
        e = comm.dispatch(rc.quantize_fp8(x), idx, w, layout="expert")
        return d.x.view(torch.uint8), d.x_scales, e.x.view(torch.uint8), e.x_scales

    x, idx, w = (t.to(dev) for t in inputs(cfg, 6, ctx.rank, ctx.world, 5))
    d = comm.dispatch(x, idx, w)
    e = comm.dispatch(x, idx, w, layout="expert")
    n, m = int(d.counts.sum()), int(e.expert_offsets[-1])
    cq, cs, ceq, ces = step(x, idx, w)
    return (d.x.view(torch.uint8)[:n], d.x_scales[:n], e.x.view(torch.uint8)[:m], e.x_scales[:m],
            cq[:n], cs[:n], ceq[:m], ces[:m])


def test_compiled_matches_eager(world_small):
    W = world_small.size
    for r, got in enumerate(world_small.run(t_compiled, fp8_config(5, 130, 2, 2 * W))):
        for i, what in enumerate(("x", "x_scales", "expert x", "expert x_scales")):
            assert_bitwise(got[4 + i], got[i], f"rank {r} compiled {what}")
