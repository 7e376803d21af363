"""GPU-only properties: CUDA/HIP graph capture and replay with inputs changed
in place between replays and eager calls interleaved (FP8 dispatch too), and
torch.compile(mode="reduce-overhead"). Every other property runs on the GPU
worlds through the shared tests (test_allreduce, test_ep, test_moe,
test_lifecycle)."""
from __future__ import annotations

import gpu_testing
import pytest
import torch
from common import assert_bitwise, assert_dispatched, ep_inputs, expert_fn, rand, received_rows
from conftest import GPU_WORLDS

import rdna4_comm as rc
from rdna4_comm import reference

pytestmark = pytest.mark.skipif(not GPU_WORLDS, reason="needs 2+ GPUs and a GPU build")

CAP, HIDDEN, TOPK = 24, 72, 8
AR_SHAPE = (3, 520)


def graph_cfg(W):
    return dict(max_tokens_per_rank=CAP, hidden=HIDDEN, topk=TOPK, num_experts=8 * W, dtype=torch.bfloat16,
                allreduce_slot_bytes=4096)


def replay_inputs(rank, world, i):
    cfg = dict(hidden=HIDDEN, topk=TOPK, num_experts=8 * world, dtype=torch.bfloat16)
    kind = ("random", "all_local", "invalid_ids", "one_expert")[i % 4]
    x, idx, w = ep_inputs(1000 + i, rank, world, CAP, cfg, kind)
    return x, idx, w, rand(2000 + i, rank, AR_SHAPE)


def t_graph_replay(ctx, replays):
    comm = ctx.comm(**graph_cfg(ctx.world))
    dev = ctx.device
    x, idx, w, a = (t.to(dev) for t in replay_inputs(ctx.rank, ctx.world, 0))

    def step():
        d = comm.dispatch(x, idx, w)
        out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
        return d, out, comm.all_reduce(a)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch requires
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    results = []
    for i in range(replays):
        for static, new in zip((x, idx, w, a), replay_inputs(ctx.rank, ctx.world, i)):
            static.copy_(new)
        graph.replay()
        d, out, s = captured
        results.append(("replay", i, d.counts.clone(), d.x.clone(), out.clone(), s.clone()))
        if i % 3 == 1:  # eager calls between replays share the generation counters
            ex, eidx, ew, ea = (t.to(dev) for t in replay_inputs(ctx.rank, ctx.world, 500 + i))
            ed = comm.dispatch(ex, eidx, ew)
            eout = comm.combine(expert_fn(ed.x, ctx.rank), ed.handle)
            results.append(("eager", 500 + i, ed.counts, ed.x, eout, comm.all_reduce(ea)))
    ctx.sync()
    return results


def test_graph_replays_with_inputs_changed_in_place_and_eager_calls_between(worlds):
    W = GPU_WORLDS[0][1]
    world = worlds("gpu", W)
    replays = 24
    per_rank = world.run(t_graph_replay, replays)
    cfg = graph_cfg(W)
    for j, (kind, i, *_) in enumerate(per_rank[0]):
        xs, idxs, ws, ars = zip(*(replay_inputs(r, W, i) for r in range(W)))
        ref = reference.dispatch(list(xs), list(idxs), list(ws), num_experts=cfg["num_experts"], max_tokens_per_rank=CAP)
        ref_out = reference.combine([expert_fn(ref[r].x, r) for r in range(W)], ref)
        ref_sum = reference.all_reduce(list(ars))
        for r in range(W):
            _, _, counts, rx, out, s = per_rank[r][j]
            what = f"{kind} {i} rank {r}"
            assert_bitwise(counts, ref[r].counts, what + " counts")
            assert_bitwise(rx[: int(counts.sum())], received_rows(ref[r]), what + " x")
            assert_bitwise(out, ref_out[r], what + " combine")
            assert_bitwise(s, ref_sum, what + " all_reduce")
    assert sum(1 for k, *_ in per_rank[0] if k == "replay") == replays


def replayed(ctx, step, inputs, collect):
    """step() captured in a CUDA graph (after one eager call), then replayed
    on replay inputs 7, 8 and 9, each copied into `inputs` (x, topk_idx,
    topk_weights, the tensors step reads): collect(step's result) after each."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    outs = []
    for i in (7, 8, 9):
        for static, new in zip(inputs, replay_inputs(ctx.rank, ctx.world, i)[:3]):
            static.copy_(new)
        graph.replay()
        outs.append(collect(result))
    ctx.sync()
    return outs


def t_dispatched_in_graph(ctx):
    """Every Dispatched field, captured: the whole contract holds under replay."""
    comm = ctx.comm(**graph_cfg(ctx.world))
    x, idx, w, _ = (t.to(ctx.device) for t in replay_inputs(ctx.rank, ctx.world, 7))

    def fields(d):
        return type(d)(*(t.clone() if isinstance(t, torch.Tensor) else t for t in d[:4]),
                       type(d.handle)(*(t.clone() if isinstance(t, torch.Tensor) else t for t in d.handle)))

    return replayed(ctx, lambda: comm.dispatch(x, idx, w), (x, idx, w), fields)


def test_every_dispatch_field_under_replay(worlds):
    W = GPU_WORLDS[0][1]
    per_rank = worlds("gpu", W).run(t_dispatched_in_graph)
    cfg = graph_cfg(W)
    for k, i in enumerate((7, 8, 9)):
        xs, idxs, ws = zip(*(replay_inputs(r, W, i)[:3] for r in range(W)))
        # Replays copy new ids into the captured id tensor, which keeps its dtype.
        captured = [replay_inputs(r, W, 7)[1].dtype for r in range(W)]
        idxs = [idx.to(dt) for idx, dt in zip(idxs, captured)]
        ref = reference.dispatch(list(xs), idxs, list(ws), num_experts=cfg["num_experts"], max_tokens_per_rank=CAP)
        for r in range(W):
            assert_dispatched(per_rank[r][k], ref[r], f"replay {i} rank {r}")


def t_fp8_dispatch_in_graph(ctx):
    """FP8 dispatch captured, x quantised in the op (rank layout) and a pair
    quantised inside the graph (expert layout): each replay sends the bytes
    of the new rows. FP8 tensors do not pickle: their bytes come back."""
    comm = ctx.comm(**graph_cfg(ctx.world), dispatch_dtype=torch.float8_e4m3fn)
    x, idx, w, _ = (t.to(ctx.device) for t in replay_inputs(ctx.rank, ctx.world, 7))

    def step():
        return comm.dispatch(x, idx, w), comm.dispatch(rc.quantize_fp8(x), idx, w, layout="expert")

    def received_bytes(result):
        d, e = result
        n, m = int(d.counts.sum()), int(e.expert_offsets[-1])
        return (d.x.view(torch.uint8)[:n].clone(), d.x_scales[:n].clone(),
                e.x.view(torch.uint8)[:m].clone(), e.x_scales[:m].clone())

    return replayed(ctx, step, (x, idx, w), received_bytes)


def test_fp8_dispatch_under_replay(worlds):
    W = GPU_WORLDS[0][1]
    per_rank = worlds("gpu", W).run(t_fp8_dispatch_in_graph)
    cfg = graph_cfg(W)
    kw = dict(num_experts=cfg["num_experts"], max_tokens_per_rank=CAP, dispatch_dtype=torch.float8_e4m3fn)
    for k, i in enumerate((7, 8, 9)):
        xs, idxs, ws = (list(t) for t in zip(*(replay_inputs(r, W, i)[:3] for r in range(W))))
        ref, ref_e = reference.dispatch(xs, idxs, ws, **kw), reference.dispatch(xs, idxs, ws, layout="expert", **kw)
        for r in range(W):
            q, s, eq, es = per_rank[r][k]
            n, m = int(ref[r].counts.sum()), int(ref_e[r].expert_offsets[-1])
            what = f"replay {i} rank {r}"
            assert_bitwise(q, ref[r].x.view(torch.uint8)[:n], what + " x")
            assert_bitwise(s, ref[r].x_scales[:n], what + " x_scales")
            assert_bitwise(eq, ref_e[r].x.view(torch.uint8)[:m], what + " expert layout x")
            assert_bitwise(es, ref_e[r].x_scales[:m], what + " expert layout x_scales")


# ------------------------------------------------------------ stream order
#
# A kernel's blocks read their generation at start and store it back at the end,
# so two ops of one communicator on two streams could take the same
# generation; the library orders every launch after the one before it.

STREAM_ITERS = 200


def stream_inputs(rank, world, i):
    """Inputs of iteration i (four distinct sets, so the references are few)."""
    return replay_inputs(rank, world, i % 4)


def stream_reference(W, i):
    cfg = graph_cfg(W)
    xs, idxs, ws, ars = zip(*(stream_inputs(r, W, i) for r in range(W)))
    ref = reference.dispatch(list(xs), list(idxs), list(ws), num_experts=cfg["num_experts"], max_tokens_per_rank=CAP)
    return ref, reference.combine([expert_fn(ref[r].x, r) for r in range(W)], ref), reference.all_reduce(list(ars))


def t_two_streams(ctx):
    """all_reduce on a side stream interleaved with dispatch/combine and
    another all_reduce (the same generation counter) on the main stream, no
    host sync, every tensor kept alive until the end."""
    comm = ctx.comm(**graph_cfg(ctx.world))
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    inputs = [tuple(t.to(ctx.device) for t in stream_inputs(ctx.rank, ctx.world, i)) for i in range(4)]
    side.wait_stream(main)
    results = []
    for i in range(STREAM_ITERS):
        x, idx, w, a = inputs[i % 4]
        with torch.cuda.stream(side):
            s = comm.all_reduce(a)
        d = comm.dispatch(x, idx, w)
        out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
        results.append((d.counts, d.x, out, s, comm.all_reduce(a)))
    main.wait_stream(side)
    ctx.sync()
    return results


def t_replays_beside_eager_ops_on_another_stream(ctx):
    """A captured all_reduce replayed on the main stream while eager
    dispatch/combine and all_reduce run on a side stream, no host sync."""
    comm = ctx.comm(**graph_cfg(ctx.world))
    inputs = [tuple(t.to(ctx.device) for t in stream_inputs(ctx.rank, ctx.world, i)) for i in range(4)]
    a = inputs[0][3].clone()
    comm.all_reduce(a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = comm.all_reduce(a)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    results = []
    for i in range(STREAM_ITERS // 4):
        x, idx, w, new_a = inputs[i % 4]
        a.copy_(new_a)
        graph.replay()
        s = captured.clone()
        side.wait_stream(main)  # the inputs were written on the main stream
        with torch.cuda.stream(side):
            d = comm.dispatch(x, idx, w)
            out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
            eager_sum = comm.all_reduce(new_a)
        results.append((d.counts, d.x, out, s, eager_sum))
    main.wait_stream(side)
    ctx.sync()
    return results


@pytest.mark.parametrize("task", [t_two_streams, t_replays_beside_eager_ops_on_another_stream],
                         ids=["eager", "replay"])
def test_ops_on_two_streams_keep_their_order(worlds, task):
    W = GPU_WORLDS[0][1]
    per_rank = worlds("gpu", W).run(task)
    refs = [stream_reference(W, i) for i in range(4)]
    for i in range(len(per_rank[0])):
        ref, ref_out, ref_sum = refs[i % 4]
        for r in range(W):
            counts, rx, out, *sums = per_rank[r][i]
            what = f"{task.__name__} {i} rank {r}"
            assert_bitwise(counts, ref[r].counts, what + " counts")
            assert_bitwise(rx[: int(counts.sum())], received_rows(ref[r]), what + " x")
            assert_bitwise(out, ref_out[r], what + " combine")
            for k, s in enumerate(sums):
                assert_bitwise(s, ref_sum, f"{what} all_reduce {k}")


# ------------------------------------------------------------ co-residency


def t_ops_beside_a_kernel_filling_the_gpu(ctx, fraction, ms):
    """Mixed ops while another stream's kernel holds most of the GPU's thread
    slots for `ms` ms: every block of every op still gets to run."""
    comm = ctx.comm(**graph_cfg(ctx.world), timeout_ms=20 * ms)
    inputs = [tuple(t.to(ctx.device) for t in stream_inputs(ctx.rank, ctx.world, i)) for i in range(4)]
    ctx.sync()
    with torch.cuda.stream(torch.cuda.Stream()):
        gpu_testing.load().occupy_gpu(ctx.device.index, fraction, ms)
    results = []
    for i in range(8):
        x, idx, w, a = inputs[i % 4]
        d = comm.dispatch(x, idx, w)
        results.append((d.counts, d.x, comm.combine(expert_fn(d.x, ctx.rank), d.handle), comm.all_reduce(a)))
    ctx.sync()
    return results


def test_ops_complete_beside_a_kernel_filling_the_gpu(worlds, testing_extension):
    W = GPU_WORLDS[0][1]
    per_rank = worlds("gpu", W).run(t_ops_beside_a_kernel_filling_the_gpu, 0.9, 1000)
    refs = [stream_reference(W, i) for i in range(4)]
    for i in range(8):
        ref, ref_out, ref_sum = refs[i % 4]
        for r in range(W):
            counts, rx, out, s = per_rank[r][i]
            assert_bitwise(rx[: int(counts.sum())], received_rows(ref[r]), f"op {i} rank {r} x")
            assert_bitwise(out, ref_out[r], f"op {i} rank {r} combine")
            assert_bitwise(s, ref_sum, f"op {i} rank {r} all_reduce")
