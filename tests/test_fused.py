"""all_reduce_rmsnorm: residual_out bitwise against the unfused composition,
out within the contract's bound and bitwise equal on every rank, on every
world; the gate and the path each call takes at and around every boundary;
chunking, back-to-back mixes with the other ops, torch.compile, opcheck, bad
inputs, a rank that skips the call; on GPUs graph replay."""
from __future__ import annotations

import time

import pytest
import torch
from common import assert_bitwise, ep_inputs, errors_of, examples, expert_fn, rand, short_timeout_ms
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdna4_comm as rc
from rdna4_comm import reference
from rdna4_comm.reference import assert_rmsnorm_within_contract

# A small slot makes modest shapes take several chunks, and rows wider than
# it (more than 2048 fp32 elements) take the all_reduce path.
SLOT = 8 << 10
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-6
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    max_examples=examples(12))


def inputs(seed, rank, T, H, dtype, with_residual, weight_dtype):
    """(x, residual, weight) of one rank; residual and weight are the same on every rank."""
    x = rand(seed, rank, (T, H), dtype)
    residual = rand(seed, 1000, (T, H), dtype) if with_residual else None
    weight = rand(seed, 2000, (H,), weight_dtype) / 4
    return x, residual, weight


def expected(seed, world_size, T, H, dtype, with_residual, weight_dtype, eps=EPS):
    xs = [inputs(seed, r, T, H, dtype, with_residual, weight_dtype)[0] for r in range(world_size)]
    _, residual, weight = inputs(seed, 0, T, H, dtype, with_residual, weight_dtype)
    return reference.all_reduce_rmsnorm(xs, residual, weight, eps), weight


def t_fused(ctx, calls, slot):
    comm = ctx.comm(allreduce_slot_bytes=slot)
    before = comm.fused_path_counts()
    outs = []
    for seed, T, H, dtype, with_residual, weight_dtype in calls:
        x, residual, weight = (t.to(ctx.device) if t is not None else None
                               for t in inputs(seed, ctx.rank, T, H, dtype, with_residual, weight_dtype))
        outs.append(comm.all_reduce_rmsnorm(x, residual, weight, EPS))
    after = comm.fused_path_counts()
    return outs, {k: after[k] - before[k] for k in after}  # fetched after the last call: no host sync between


def check_calls(world, calls, slot=SLOT):
    """Runs the calls back to back on every rank and checks each; returns the
    path counts of the calls (the same on every rank)."""
    results = world.run(t_fused, calls, slot)
    for i, (seed, T, H, dtype, with_residual, weight_dtype) in enumerate(calls):
        (_, ref_residual), weight = expected(seed, world.size, T, H, dtype, with_residual, weight_dtype)
        what = f"call {i}: T={T} H={H} {dtype} residual={with_residual} weight {weight_dtype}"
        out0 = results[0][0][i][0]
        for r, (outs, _) in enumerate(results):
            out, residual_out = outs[i]
            assert_bitwise(residual_out, ref_residual, f"{what} rank {r} residual_out")
            assert_bitwise(out, out0, f"{what} rank {r} out against rank 0")
        assert_rmsnorm_within_contract(out0, ref_residual, weight, EPS, what)
    counts = [c for _, c in results]
    assert all(c == counts[0] for c in counts), counts
    return counts[0]


call_st = st.tuples(
    st.integers(0, 2**20),
    st.sampled_from([0, 1, 2, 3, 5, 8, 17, 40]),
    st.one_of(st.sampled_from([1, 7, 8, 64, 129, 1000, 2048, 2880]), st.integers(1, 300)),
    st.sampled_from(DTYPES),
    st.booleans(),
    st.booleans(),
).map(lambda c: (*c[:5], torch.float32 if c[5] else c[3]))


@SETTINGS
@given(calls=st.lists(call_st, min_size=1, max_size=3))
def test_matches_the_unfused_composition(world, calls):
    check_calls(world, calls)


def test_no_rows_between_others(world):
    """x of no rows (a null data pointer) gives empty results, and the calls
    around it their own."""
    check_calls(world, [(3, 0, 64, torch.float32, False, torch.float32), (4, 5, 64, torch.bfloat16, True, torch.float32),
                        (5, 0, 8, torch.bfloat16, True, torch.bfloat16), (6, 2, 8, torch.float16, False, torch.float16)])


def test_model_hidden_sizes(world_small):
    # Decode (T = 1) and a small prefill of real models' hidden sizes, bf16.
    calls = [(7, T, H, torch.bfloat16, True, torch.bfloat16) for H in (2880, 5120, 7168, 8192, 16384) for T in (1, 9)]
    check_calls(world_small, calls, slot=1 << 20)


# --------------------------------------------------------------------- gate


def boundary_cases(world_size, transport, slot):
    """Shapes at and around every boundary of the gate, each named by the path
    the gate gives it; every path occurs (two_stage only beyond 2 ranks)."""
    one_shot_max = rc._C.testing.one_shot_max_bytes[transport]
    aligned = rc._C.allreduce_slot_bytes(transport, slot)
    cases = []
    H = 256  # fp32 rows of 1 KiB
    rows = one_shot_max // (H * 4)
    for T in (rows - 1, rows, rows + 1, world_size - 1, world_size):
        cases.append((T, H, torch.float32))
    # Fewer tokens than ranks with large rows: one-stage though over the size cap.
    wide = one_shot_max // 4 + 16
    for T in (world_size - 1, world_size):
        cases.append((T, wide // 4 if T else 1, torch.float32))
    # Rows at the slot's capacity: one-stage takes rows up to the slot,
    # two-stage up to half of it; wider rows go through all_reduce first.
    for row_bytes in (aligned // 2, aligned // 2 + 16, aligned, aligned + 16):
        for T in (1, 2 * world_size + 1):
            cases.append((T, row_bytes // 2, torch.bfloat16))
    # The register capacity of a row (GPU fast path) and around it.
    for dtype in (torch.bfloat16, torch.float32):
        elt = torch.empty((), dtype=dtype).element_size()
        cap = rc._C.testing.rmsnorm_register_row_elems(elt)
        for H in (cap - 16 // elt, cap - 1, cap, cap + 16 // elt):
            cases.append((3, H, dtype))
    return [(T, H, d) for T, H, d in cases if T >= 0]


def t_paths_one_by_one(ctx, cases, slot):
    comm = ctx.comm(allreduce_slot_bytes=slot)
    taken = []
    for i, (T, H, dtype) in enumerate(cases):
        before = comm.fused_path_counts()
        x, residual, weight = (t.to(ctx.device) for t in inputs(i, ctx.rank, T, H, dtype, True, dtype))
        out, residual_out = comm.all_reduce_rmsnorm(x, residual, weight, EPS)
        after = comm.fused_path_counts()
        taken.append(({k: after[k] - before[k] for k in after}, out, residual_out))
    return taken


def test_every_call_takes_the_path_the_gate_names(world_small):
    world = world_small
    slot = 256 << 10
    cases = boundary_cases(world.size, world.transport, slot)
    results = world.run(t_paths_one_by_one, cases, slot)
    paths = set()
    for i, (T, H, dtype) in enumerate(cases):
        gate = rc.all_reduce_rmsnorm_algorithm(T, H, dtype, world.size, world.transport, allreduce_slot_bytes=slot)
        in_registers = rc.all_reduce_rmsnorm_row_in_registers(H, dtype)
        (_, ref_residual), weight = expected(i, world.size, T, H, dtype, True, dtype)
        for r, taken in enumerate(results):
            counts, out, residual_out = taken[i]
            want = {"one_stage": 0, "two_stage": 0, "all_reduce_then_norm": 0, "row_in_registers": 0}
            if T:
                want[gate] = 1
                want["row_in_registers"] = int(in_registers and world.transport == "gpu")
            assert counts == want, f"T={T} H={H} {dtype} rank {r}: gate says {gate}, took {counts}"
            assert_bitwise(residual_out, ref_residual, f"T={T} H={H} {dtype} rank {r}")
            assert_bitwise(out, taken_out0(results, i), f"T={T} H={H} {dtype} rank {r} against rank 0")
        assert_rmsnorm_within_contract(taken_out0(results, i), ref_residual, weight, EPS, f"T={T} H={H} {dtype}")
        paths.add(gate if T else None)
    want_paths = {"one_stage", "all_reduce_then_norm"} | ({"two_stage"} if world.size > 2 else set())
    assert want_paths <= paths, paths


def taken_out0(results, i):
    return results[0][i][1]


def test_gate_predicates():
    for transport in ("cpu", "gpu"):
        limit = rc._C.testing.one_shot_max_bytes[transport]
        gpu = transport == "gpu"
        # The size cap at W > 2, none at W <= 2, none below W tokens.
        assert rc.all_reduce_rmsnorm_algorithm(limit // 1024, 256, torch.float32, 4, transport) == "one_stage"
        assert rc.all_reduce_rmsnorm_algorithm(limit // 1024 + 1, 256, torch.float32, 4, transport) == "two_stage"
        assert rc.all_reduce_rmsnorm_algorithm(1 << 20, 256, torch.float32, 2, transport) == "one_stage"
        assert rc._C.testing.rmsnorm_use_one_stage(3, 1 << 30, 4, gpu)
        assert not rc._C.testing.rmsnorm_use_one_stage(4, 1 << 30, 4, gpu)
    # Chunk rows: one-stage fills a slot, two-stage sends out and residual_out back in one.
    assert rc._C.testing.rmsnorm_chunk_rows(4096, 1024, 4, True) == 4
    assert rc._C.testing.rmsnorm_chunk_rows(4096, 1024, 4, False) == 8
    assert rc._C.testing.rmsnorm_chunk_rows(4096, 4097, 4, True) == 0
    assert rc._C.testing.rmsnorm_chunk_rows(4096, 2049, 4, False) == 0
    # Rows in registers: whole 16-byte vectors, at most the block's capacity.
    for dtype, elt in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        cap = rc._C.testing.rmsnorm_register_row_elems(elt)
        assert cap == 512 * 4 * 16 // elt
        assert rc.all_reduce_rmsnorm_row_in_registers(cap, dtype)
        assert not rc.all_reduce_rmsnorm_row_in_registers(cap + 16 // elt, dtype)
        assert not rc.all_reduce_rmsnorm_row_in_registers(16 // elt + 1, dtype)
        assert rc.all_reduce_rmsnorm_row_in_registers(16 // elt, dtype)


# ----------------------------------------------------------- mixes, compile


def t_mixed(ctx, n):
    comm = ctx.comm(max_tokens_per_rank=8, hidden=64, topk=2, num_experts=2 * ctx.world,
                    dtype=torch.bfloat16, allreduce_slot_bytes=SLOT)
    cfg = dict(hidden=64, topk=2, num_experts=2 * ctx.world, dtype=torch.bfloat16)
    outs = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            x, res, w = (t.to(ctx.device) for t in inputs(i, ctx.rank, 1 + i % 7, 64, torch.bfloat16, True, torch.float32))
            outs.append(comm.all_reduce_rmsnorm(x, res, w, EPS))
        elif kind == 1:
            outs.append(comm.all_reduce(rand(i, ctx.rank, (3 + i,)).to(ctx.device)))
        else:
            x, idx, wts = (t.to(ctx.device) for t in ep_inputs(i, ctx.rank, ctx.world, 1 + i % 8, cfg, "random"))
            d = comm.dispatch(x, idx, wts)
            outs.append(comm.combine(expert_fn(d.x, ctx.rank), d.handle))
    return outs


def test_back_to_back_with_all_reduce_dispatch_and_combine(world_small):
    n = 30
    results = world_small.run(t_mixed, n)
    W = world_small.size
    cfg = dict(hidden=64, topk=2, num_experts=2 * W, dtype=torch.bfloat16)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            (_, ref_res), _ = expected(i, W, 1 + i % 7, 64, torch.bfloat16, True, torch.float32)
            for r in range(W):
                assert_bitwise(results[r][i][1], ref_res, f"op {i} rank {r}")
                assert_bitwise(results[r][i][0], results[0][i][0], f"op {i} rank {r}")
        elif kind == 1:
            ref = reference.all_reduce([rand(i, r, (3 + i,)) for r in range(W)])
            for r in range(W):
                assert_bitwise(results[r][i], ref, f"op {i} rank {r}")
        else:
            ins = [ep_inputs(i, r, W, 1 + i % 8, cfg, "random") for r in range(W)]
            xs, idxs, ws = (list(v) for v in zip(*ins))
            d = reference.dispatch(xs, idxs, ws, num_experts=2 * W, max_tokens_per_rank=8)
            ref = reference.combine([expert_fn(d[r].x, r) for r in range(W)], d)
            for r in range(W):
                assert_bitwise(results[r][i], ref[r], f"op {i} rank {r}")


def t_compiled_tp_block(ctx, mode):
    comm = ctx.comm(allreduce_slot_bytes=SLOT, timeout_ms=120_000)
    H, F = 32, 48
    g = torch.Generator().manual_seed(3)
    w_down = (torch.randn(F, H, generator=g) / 8).to(ctx.device)
    norm_w = (torch.rand(H, generator=g) + 0.5).to(ctx.device)

    def block(h, residual):
        partial = torch.relu(h) @ w_down  # a row-parallel layer's partial sums
        return comm.all_reduce_rmsnorm(partial, residual, norm_w, EPS)

    compiled = torch.compile(block, fullgraph=True, **({} if mode == "default" else {"mode": mode}))
    outs = []
    for i, T in enumerate((3, 1, 5, 5)):
        h = rand(i, ctx.rank, (T, F)).to(ctx.device)
        residual = rand(i, 99, (T, H)).to(ctx.device)
        # reduce-overhead: a graph's outputs are overwritten by its next replay
        outs.append((block(h, residual), tuple(t.clone() for t in compiled(h, residual))))
    ctx.sync()
    return outs


def test_torch_compile_fullgraph_equals_eager(worlds):
    for pairs in worlds("cpu", 2).run(t_compiled_tp_block, "default"):
        for eager, compiled in pairs:
            for e, c in zip(eager, compiled):
                assert_bitwise(c, e, "compiled vs eager")


def t_opcheck(ctx):
    comm = ctx.comm(allreduce_slot_bytes=SLOT)
    for dtype in DTYPES:
        for with_residual in (True, False):
            x, res, w = (t.to(ctx.device) if t is not None else None
                         for t in inputs(1, ctx.rank, 5, 24, dtype, with_residual, dtype))
            torch.library.opcheck(torch.ops.rdna4_comm.all_reduce_rmsnorm.default,
                                  (x, res, w, EPS, rc.ops.order_token(x.device), comm.id))
    return True


def test_opcheck(world_small):
    assert all(world_small.run(t_opcheck))


# ------------------------------------------------------------------- errors


def t_bad_inputs(ctx):
    comm = ctx.comm(allreduce_slot_bytes=SLOT)
    dev = ctx.device
    other = torch.device("meta") if ctx.device.type == "cpu" else torch.device("cpu")
    x, res, w = (t.to(dev) for t in inputs(4, ctx.rank, 6, 16, torch.bfloat16, True, torch.bfloat16))
    f = comm.all_reduce_rmsnorm
    cases = {
        "weight_shape": lambda: f(x, res, w[:8], EPS),
        "weight_dtype": lambda: f(x, res, w.half(), EPS),
        "weight_dtype_fp32_x": lambda: f(x.float(), res.float(), w, EPS),
        "residual_shape": lambda: f(x, res[:3], w, EPS),
        "residual_dtype": lambda: f(x, res.float(), w, EPS),
        "eps_zero": lambda: f(x, res, w, 0.0),
        "eps_negative": lambda: f(x, res, w, -1e-6),
        "eps_nan": lambda: f(x, res, w, float("nan")),
        "eps_inf": lambda: f(x, res, w, float("inf")),
        "non_contiguous": lambda: f(x.t(), None, rand(1, 0, (6,), torch.bfloat16).to(dev), EPS),
        "wrong_device": lambda: f(x.to(other), res.to(other), w.to(other), EPS),
        "x_dtype": lambda: f(x.to(torch.float64), None, w.to(torch.float64), EPS),
        "hidden_zero": lambda: f(x[:, :0], None, w[:0], EPS),
    }
    errors = errors_of(cases)
    still = comm.all_reduce_rmsnorm(x, res, w, EPS)
    return errors, still


def test_bad_inputs_raise_clear_errors_and_leave_the_communicator_usable(world_small):
    results = world_small.run(t_bad_inputs)
    (_, ref_res), _ = expected(4, world_small.size, 6, 16, torch.bfloat16, True, torch.bfloat16)
    want = {
        "weight_shape": ("ValueError", "weight must have shape [16]"),
        "weight_dtype": ("TypeError", "weight must be torch.bfloat16 (x's dtype) or torch.float32, got torch.float16"),
        "weight_dtype_fp32_x": ("TypeError", "weight must be torch.float32 (x's dtype), got torch.bfloat16"),
        "residual_shape": ("ValueError", "residual must have shape [6, 16]"),
        "residual_dtype": ("TypeError", "residual must be torch.bfloat16"),
        "eps_zero": ("ValueError", "eps must be a finite float > 0"),
        "eps_negative": ("ValueError", "eps must be a finite float > 0"),
        "eps_nan": ("ValueError", "eps must be a finite float > 0"),
        "eps_inf": ("ValueError", "eps must be a finite float > 0"),
        "non_contiguous": ("ValueError", "x must be contiguous"),
        "wrong_device": ("ValueError", "communicator's device"),
        "x_dtype": ("TypeError", "x must be torch.float32, torch.bfloat16 or torch.float16"),
        "hidden_zero": ("ValueError", "H >= 1"),
    }
    for errors, (out, residual_out) in results:
        for case, (kind, text) in want.items():
            assert errors[case] is not None, f"{case} was accepted"
            assert errors[case][0] == kind and text in errors[case][1], (case, errors[case])
        assert_bitwise(residual_out, ref_res, "after rejected calls")


def t_skip_one_call(ctx, skipper):
    c = ctx.comm(timeout_ms=short_timeout_ms(ctx.transport), allreduce_slot_bytes=4096)
    x, res, w = (t.to(ctx.device) for t in inputs(5, ctx.rank, 4, 32, torch.float32, True, torch.float32))
    c.all_reduce_rmsnorm(x, res, w, EPS)
    c.check()
    if ctx.rank == skipper:
        return None
    start = time.monotonic()
    try:
        c.all_reduce_rmsnorm(x, res, w, EPS)
        c.check()
        message = None
    except RuntimeError as e:
        message = str(e)
    return message, time.monotonic() - start


def test_a_rank_that_skips_the_call_makes_the_others_raise(world_small):
    if world_small.size == 1:
        pytest.skip("needs a peer")
    skipper = world_small.size - 1
    try:
        results = world_small.run(t_skip_one_call, skipper)
    finally:
        world_small.run(t_drop_communicators)  # the failed communicator must not be reused
    for r, res in enumerate(results):
        if r == skipper:
            continue
        message, elapsed = res
        assert message is not None, "the call without its peer returned"
        if world_small.transport == "dist":  # its exchange is the all_reduce's; a collective names no peer
            assert "all_reduce" in message and "in torch.distributed" in message, message
        else:
            assert "all_reduce_rmsnorm" in message and f"waiting for rank {skipper}" in message, message
            assert f"Rank {skipper} had not made this call" in message, message
        assert "timed out" in message and elapsed < short_timeout_ms(world_small.transport) / 1000 + 5


def t_drop_communicators(ctx):
    ctx.drop_comms()


# --------------------------------------------------------------------- GPU


def t_graph_replay(ctx):
    comm = ctx.comm(allreduce_slot_bytes=SLOT)
    T, H = 6, 1000
    x, res, w = (t.to(ctx.device) for t in inputs(0, ctx.rank, T, H, torch.bfloat16, True, torch.float32))
    comm.all_reduce_rmsnorm(x, res, w, EPS)  # warm up outside the capture
    ctx.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, residual_out = comm.all_reduce_rmsnorm(x, res, w, EPS)
    results = []
    for i in range(3):
        nx, nres, _ = inputs(10 + i, ctx.rank, T, H, torch.bfloat16, True, torch.float32)
        x.copy_(nx)
        res.copy_(nres)
        graph.replay()
        results.append((out.clone(), residual_out.clone()))
    ctx.sync()
    return results


def test_graph_replay_with_inputs_changed_in_place(world_small):
    if world_small.transport != "gpu":
        pytest.skip("CUDA/HIP graphs need the GPU transport")
    results = world_small.run(t_graph_replay)
    for i in range(3):
        xs = [inputs(10 + i, r, 6, 1000, torch.bfloat16, True, torch.float32)[0] for r in range(world_small.size)]
        res = inputs(10 + i, 0, 6, 1000, torch.bfloat16, True, torch.float32)[1]
        w = inputs(0, 0, 6, 1000, torch.bfloat16, True, torch.float32)[2]  # captured once, unchanged
        _, ref_res = reference.all_reduce_rmsnorm(xs, res, w, EPS)
        for r in range(world_small.size):
            assert_bitwise(results[r][i][1], ref_res, f"replay {i} rank {r}")
            assert_bitwise(results[r][i][0], results[0][i][0], f"replay {i} rank {r}")
        assert_rmsnorm_within_contract(results[0][i][0], ref_res, w, EPS, f"replay {i}")


def test_torch_compile_reduce_overhead(world_small):
    if world_small.transport != "gpu":
        pytest.skip("mode='reduce-overhead' records CUDA graphs")
    for pairs in world_small.run(t_compiled_tp_block, "reduce-overhead"):
        for eager, compiled in pairs:
            for e, c in zip(eager, compiled):
                assert_bitwise(c, e, "compiled vs eager")


# --------------------------------------------------- tensor-parallel block

TP_HIDDEN, TP_FFN = 64, 96  # ffn a multiple of every world size tested (1..4)


def tp_inputs(i, T):
    return rand(i, 500, (T, TP_HIDDEN), torch.bfloat16), rand(i, 600, (T, TP_HIDDEN), torch.bfloat16)


def t_tp_block(ctx, mode):
    from rdna4_comm import tp

    comm = ctx.comm(allreduce_slot_bytes=SLOT, timeout_ms=120_000)
    weights = tp.init_weights(1, TP_HIDDEN, TP_FFN)
    mlp = tp.TensorParallelMLP(tp.LlamaStyleMLP(weights, ctx.device), comm)
    norm = weights["next_norm"].to(ctx.device)

    def block(normed, residual):
        return mlp.forward_norm(normed, residual, norm)

    compiled = torch.compile(block, fullgraph=True, **({} if mode in (None, "default") else {"mode": mode}))
    outs = []
    for i, T in enumerate((1, 7, 7)):
        normed, residual = (t.to(ctx.device) for t in tp_inputs(i, T))
        fused, unfused = block(normed, residual), mlp.forward_norm_unfused(normed, residual, norm)
        outs.append((fused, unfused, compiled(normed, residual) if mode else None))
    if ctx.transport == "gpu":
        normed, residual = (t.to(ctx.device) for t in tp_inputs(0, 7))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(normed, residual)
        graph.replay()
        outs.append((captured, block(normed, residual), None))
    ctx.sync()
    return outs


def check_tp(results, W, compiled):
    from rdna4_comm import tp

    weights = tp.init_weights(1, TP_HIDDEN, TP_FFN)
    for i, T in enumerate((1, 7, 7)):
        normed, residual = tp_inputs(i, T)
        dense_out, dense_residual = tp.dense_mlp_block(normed, residual, weights)
        for r in range(W):
            fused, unfused, comp = results[r][i]
            assert_bitwise(fused[1], unfused[1], f"call {i} rank {r}: residual_out fused vs unfused")
            assert_rmsnorm_within_contract(fused[0], fused[1], weights["next_norm"], 1e-6, f"call {i} rank {r}")
            assert_bitwise(fused[0], results[0][i][0][0], f"call {i} rank {r} against rank 0")
            # Sharded matmuls round differently from the dense one: a few bf16
            # ulps of values up to 16.
            torch.testing.assert_close(fused[1].float(), dense_residual.float(), rtol=2e-2, atol=0.125)
            torch.testing.assert_close(fused[0].float(), dense_out.float(), rtol=2e-2, atol=0.1)
            if compiled:
                # Inductor keeps silu(gate) * up in fp32 where eager rounds it
                # to bf16, so the partial sums, not the op, differ slightly.
                for c, e in zip(comp, fused):
                    torch.testing.assert_close(c.float(), e.float(), rtol=2e-2, atol=0.125)
                assert_bitwise(comp[0], results[0][i][2][0], f"call {i} rank {r}: compiled, against rank 0")
    for r in range(W):
        for captured, eager, _ in results[r][3:]:
            for c, e in zip(captured, eager):
                assert_bitwise(c, e, f"rank {r}: graph replay vs eager")


def test_tensor_parallel_block_matches_the_dense_block(world_small):
    check_tp(world_small.run(t_tp_block, None), world_small.size, compiled=False)


def test_tensor_parallel_block_compiles_fullgraph(worlds):
    check_tp(worlds("cpu", 2).run(t_tp_block, "default"), 2, compiled=True)
