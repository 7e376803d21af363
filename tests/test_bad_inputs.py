"""The catalogue of bad inputs (docs/semantics.md, "Catalogue of bad
inputs"): every row raises its exception with its message, naming the
argument and what was expected, and leaves the communicator usable; the
inputs that are not errors pass. Each case id here is a row of that table,
and a test keeps the two in step."""
from __future__ import annotations

import functools
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from common import assert_bitwise, ep_inputs, errors_of, expert_fn, rand, received_rows
from conftest import GPU_WORLDS

import rdna4_comm as rc
from rdna4_comm import reference
from rdna4_comm._ranks import runs_on_gpus

DOC = Path(__file__).resolve().parents[1] / "docs" / "semantics.md"
CAP, H, K = 6, 8, 3


def ep_cfg(W):
    return dict(max_tokens_per_rank=CAP, hidden=H, topk=K, num_experts=2 * W, dtype=torch.bfloat16,
                allreduce_slot_bytes=4096)


def ref_cfg(W):
    return dict(hidden=H, topk=K, num_experts=2 * W, dtype=torch.bfloat16)


def constructor(**kwargs):
    return functools.partial(rc.Communicator, **kwargs)


def with_timeout_env(value: str):
    def call():
        os.environ["RDNA4_COMM_TIMEOUT_MS"] = value
        try:
            rc.Communicator()
        finally:
            del os.environ["RDNA4_COMM_TIMEOUT_MS"]
    return call


# id -> (call built from the environment e, exception, message fragment).
# "{...}" in a message is filled from e.
CASES = {
    # constructor (validated before any exchange: local to the rank)
    "ctor.ep_partial": (lambda e: constructor(max_tokens_per_rank=4, hidden=8), "ValueError",
                        "max_tokens_per_rank, hidden, topk and num_experts are needed together"),
    "ctor.experts": (lambda e: constructor(max_tokens_per_rank=4, hidden=8, topk=2, num_experts=2 * e.W + 1),
                     "ValueError", "must be a multiple of the world size"),
    "ctor.topk": (lambda e: constructor(max_tokens_per_rank=4, hidden=8, topk=65, num_experts=2 * e.W),
                  "ValueError", "topk must be in [1, 64], got 65"),
    "ctor.dtype": (lambda e: constructor(max_tokens_per_rank=4, hidden=8, topk=2, num_experts=2 * e.W,
                                         dtype=torch.int32), "TypeError", "dtype must be one of"),
    "ctor.cap": (lambda e: constructor(max_tokens_per_rank=0, hidden=8, topk=2, num_experts=2 * e.W),
                 "ValueError", "max_tokens_per_rank must be a positive int, got 0"),
    "ctor.hidden_type": (lambda e: constructor(max_tokens_per_rank=4, hidden=8.0, topk=2, num_experts=2 * e.W),
                         "ValueError", "hidden must be a positive int, got 8.0"),
    "ctor.transport": (lambda e: constructor(transport="nvlink"), "ValueError",
                       "transport must be one of ('auto', 'cpu', 'dist', 'gpu'), got 'nvlink'"),
    "ctor.timeout": (lambda e: constructor(timeout_ms=-5), "ValueError", "timeout_ms must be a positive int, got -5"),
    "ctor.slot_bytes": (lambda e: constructor(allreduce_slot_bytes=0), "ValueError",
                        "allreduce_slot_bytes must be a positive int, got 0"),
    "ctor.expert_alignment": (lambda e: constructor(max_tokens_per_rank=4, hidden=8, topk=2, num_experts=2 * e.W,
                                                    expert_alignment=0), "ValueError",
                              "expert_alignment must be a positive int, got 0"),
    "ctor.max_expert_rows": (lambda e: constructor(max_tokens_per_rank=4, hidden=8, topk=2, num_experts=2 * e.W,
                                                   max_expert_rows=-1), "ValueError",
                             "max_expert_rows must be a positive int, got -1"),
    "ctor.dispatch_dtype": (lambda e: constructor(max_tokens_per_rank=4, hidden=8, topk=2, num_experts=2 * e.W,
                                                  dispatch_dtype=torch.float8_e5m2), "TypeError",
                            "dispatch_dtype must be None or torch.float8_e4m3fn, got torch.float8_e5m2"),
    "ctor.timeout_env": (lambda e: with_timeout_env("ten seconds"), "ValueError",
                         "RDNA4_COMM_TIMEOUT_MS must be a positive integer (milliseconds), got 'ten seconds'"),
    # dispatch
    "dispatch.x_0dim": (lambda e: lambda: e.comm.dispatch(e.x[0, 0], e.idx), "ValueError",
                        "x must have shape [..., 8] (tokens, hidden)"),
    "dispatch.x_1dim": (lambda e: lambda: e.comm.dispatch(e.x.reshape(-1), e.idx), "ValueError",
                        "x must have shape [..., 8] (tokens, hidden)"),
    "dispatch.x_hidden": (lambda e: lambda: e.comm.dispatch(e.x[:, :-1].contiguous(), e.idx), "ValueError",
                          "x must have shape [..., 8] (tokens, hidden)"),
    "dispatch.x_tokens": (lambda e: lambda: e.comm.dispatch(e.ones(CAP + 1, H), e.zeros_ids(CAP + 1)), "ValueError",
                          "at most 6 tokens (max_tokens_per_rank), got [7, 8] = 7 tokens"),
    "dispatch.x_dtype": (lambda e: lambda: e.comm.dispatch(e.x.float(), e.idx), "TypeError",
                         "x must be torch.bfloat16, got torch.float32"),
    "dispatch.x_device": (lambda e: lambda: e.comm.dispatch(e.x.to(e.wrong_device), e.idx), "ValueError",
                          "x must be on {dev} (the communicator's device)"),
    "dispatch.x_contiguous": (lambda e: lambda: e.comm.dispatch(e.ones(H, 4).t(), e.idx), "ValueError",
                              "x must be contiguous"),
    "dispatch.idx_dtype": (lambda e: lambda: e.comm.dispatch(e.x, e.idx.float()), "TypeError",
                           "topk_idx must be torch.int32 or torch.int64, got torch.float32"),
    "dispatch.idx_shape": (lambda e: lambda: e.comm.dispatch(e.x, e.idx[:, :-1]), "ValueError",
                           "topk_idx must have shape [4, 3] (x's tokens, topk), got [4, 2]"),
    "dispatch.idx_tokens": (lambda e: lambda: e.comm.dispatch(e.x, e.idx[:-1]), "ValueError",
                            "topk_idx must have shape [4, 3] (x's tokens, topk), got [3, 3]"),
    "dispatch.idx_device": (lambda e: lambda: e.comm.dispatch(e.x, e.idx.to(e.wrong_device)), "ValueError",
                            "topk_idx must be on {dev}"),
    "dispatch.w_dtype": (lambda e: lambda: e.comm.dispatch(e.x, e.idx, e.w.double()), "TypeError",
                         "topk_weights must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    "dispatch.w_shape": (lambda e: lambda: e.comm.dispatch(e.x, e.idx, e.w[:, :-1]), "ValueError",
                         "topk_weights must have shape [4, 3]"),
    "dispatch.w_device": (lambda e: lambda: e.comm.dispatch(e.x, e.idx, e.w.to(e.wrong_device)), "ValueError",
                          "topk_weights must be on {dev}"),
    "dispatch.no_ep": (lambda e: lambda: e.ar_only.dispatch(e.x, e.idx), "RuntimeError",
                       "created without EP fields"),
    "dispatch.layout": (lambda e: lambda: e.comm.dispatch(e.x, e.idx, layout="expert_major"), "ValueError",
                        "dispatch: layout must be one of ('rank', 'expert'), got 'expert_major'"),
    # FP8 dispatch (e.fp8: a communicator made with dispatch_dtype=torch.float8_e4m3fn)
    "dispatch.pair_without_fp8": (lambda e: lambda: e.comm.dispatch(rc.quantize_fp8(e.x), e.idx), "ValueError",
                                  "a (q, scales) pair needs a communicator made with "
                                  "dispatch_dtype=torch.float8_e4m3fn; this one dispatches torch.bfloat16"),
    "dispatch.fp8_not_a_pair": (lambda e: lambda: e.fp8.dispatch((e.x,), e.idx), "TypeError",
                                "x must be a tensor or a (q, scales) pair from rdna4_comm.quantize_fp8, "
                                "got a sequence of 1"),
    "dispatch.fp8_pair_scales_missing": (lambda e: lambda: e.fp8.dispatch((rc.quantize_fp8(e.x)[0], None), e.idx),
                                         "TypeError", "x_scales (the pair's scales) must be a tensor, got NoneType"),
    "dispatch.fp8_q_dtype": (lambda e: lambda: e.fp8.dispatch((e.x, rc.quantize_fp8(e.x)[1]), e.idx), "TypeError",
                             "x (the pair's q) must be torch.float8_e4m3fn, got torch.bfloat16"),
    "dispatch.fp8_scales_shape": (lambda e: lambda: e.fp8.dispatch((rc.quantize_fp8(e.x)[0], e.ones(4, 2).float()),
                                                                   e.idx), "ValueError",
                                  "x_scales (the pair's scales) must have shape [4, 1] (x's tokens, ceil(hidden / "
                                  "128)), got [4, 2]"),
    "dispatch.fp8_scales_dtype": (lambda e: lambda: e.fp8.dispatch(
        (rc.quantize_fp8(e.x)[0], rc.quantize_fp8(e.x)[1].double()), e.idx), "TypeError",
        "x_scales (the pair's scales) must be torch.float32, got torch.float64"),
    "dispatch.fp8_x_dtype": (lambda e: lambda: e.fp8.dispatch(e.x.float(), e.idx), "TypeError",
                             "x must be torch.bfloat16 (quantised to FP8 by the op) or a (q, scales) pair from "
                             "rdna4_comm.quantize_fp8, got torch.float32"),
    # combine
    "combine.y_rows": (lambda e: lambda: e.comm.combine(e.y[:-1], e.d.handle), "ValueError",
                       "y must have shape [{rows}, 8] ([world_size * max_tokens_per_rank, hidden])"),
    "combine.y_hidden": (lambda e: lambda: e.comm.combine(e.ones(e.W * CAP, H + 1), e.d.handle), "ValueError",
                         "y must have shape [{rows}, 8]"),
    "combine.y_dtype": (lambda e: lambda: e.comm.combine(e.y.half(), e.d.handle), "TypeError",
                        "y must be torch.bfloat16, got torch.float16"),
    "combine.y_device": (lambda e: lambda: e.comm.combine(e.y.to(e.wrong_device), e.d.handle), "ValueError",
                         "y must be on {dev}"),
    "combine.y_contiguous": (lambda e: lambda: e.comm.combine(e.ones(H, e.W * CAP).t(), e.d.handle), "ValueError",
                             "y must be contiguous"),
    "combine.handle_type": (lambda e: lambda: e.comm.combine(e.y, tuple(e.d.handle)[:4]), "TypeError",
                            "handle must be a DispatchHandle (Dispatched.handle), got tuple"),
    "combine.handle_foreign": (lambda e: lambda: e.comm.combine(e.y, e.foreign.handle), "ValueError",
                               "handle comes from communicator"),
    "combine.handle_token_shape": (lambda e: lambda: e.comm.combine(e.y, e.d.handle._replace(
        token_shape=(2, 3))), "ValueError", "handle.token_shape (2, 3) holds 6 tokens but handle.send_mask has 4"),
    "combine.handle_field_dtype": (lambda e: lambda: e.comm.combine(e.y, e.d.handle._replace(
        counts=e.d.handle.counts.long())), "TypeError", "handle.counts must be torch.int32, got torch.int64"),
    "combine.expert_y_rows": (lambda e: lambda: e.comm.combine(e.y, e.de.handle), "ValueError",
                              "y must have shape [{expert_rows}, 8] ([comm.expert_rows, hidden] for an "
                              "expert-layout handle)"),
    "combine.expert_rows_of_dtype": (lambda e: lambda: e.comm.combine(e.de.x, e.de.handle._replace(
        expert_rows_of=e.de.handle.expert_rows_of.long())), "TypeError",
        "handle.expert_rows_of must be torch.int32, got torch.int64"),
    "combine.expert_rows_of_shape": (lambda e: lambda: e.comm.combine(e.de.x, e.de.handle._replace(
        expert_rows_of=e.de.handle.expert_rows_of[:, :-1])), "ValueError",
        "handle.expert_rows_of must have shape [{rows}, 3] ([world_size * max_tokens_per_rank, topk])"),
    # all_reduce
    "all_reduce.dtype": (lambda e: lambda: e.comm.all_reduce(torch.ones(8, dtype=torch.int64, device=e.dev)),
                         "TypeError", "x must be torch.float32, torch.bfloat16 or torch.float16, got torch.int64"),
    "all_reduce.float64": (lambda e: lambda: e.comm.all_reduce(torch.ones(8, dtype=torch.float64, device=e.dev)),
                           "TypeError", "x must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    "all_reduce.device": (lambda e: lambda: e.comm.all_reduce(torch.ones(8, device=e.wrong_device)), "ValueError",
                          "x must be on {dev} (the communicator's device)"),
    "all_reduce.contiguous": (lambda e: lambda: e.comm.all_reduce(torch.ones(6, 4, device=e.dev).t()), "ValueError",
                              "x must be contiguous"),
    "op.order_token": (lambda e: lambda: torch.ops.rdna4_comm.all_reduce(
        torch.ones(8, device=e.dev), torch.zeros(2, dtype=torch.int64, device=e.dev), e.comm.id), "ValueError",
        "order must be the ordering token of the communicator's device"),
    "op.unknown_communicator": (lambda e: lambda: torch.ops.rdna4_comm.all_reduce(
        torch.ones(8, device=e.dev), rc.ops.order_token(e.dev), "no-such-communicator"), "ValueError",
        "no open communicator with id 'no-such-communicator'"),
    # a closed communicator
    "closed.all_reduce": (lambda e: lambda: e.closed.all_reduce(torch.ones(8, device=e.dev)), "RuntimeError",
                          "is closed"),
    "closed.check": (lambda e: e.closed.check, "RuntimeError", "is closed"),
}


def t_catalogue(ctx):
    W, dev = ctx.world, ctx.device
    comm = ctx.comm(**ep_cfg(W))
    other = ctx.comm(**dict(ep_cfg(W), max_tokens_per_rank=CAP + 3))  # another communicator, larger capacity
    ar_only = ctx.comm(allreduce_slot_bytes=4096)
    fp8 = ctx.comm(**ep_cfg(W), dispatch_dtype=torch.float8_e4m3fn)
    x, idx, w = (t.to(dev) for t in ep_inputs(1, ctx.rank, W, 4, ref_cfg(W), "random"))
    d = comm.dispatch(x, idx, w)
    de = comm.dispatch(x, idx, w, layout="expert")
    foreign = other.dispatch(x, idx, w)
    closed = rc.Communicator(transport=ctx.transport)
    closed.close()
    e = SimpleNamespace(
        W=W, dev=dev, comm=comm, ar_only=ar_only, fp8=fp8, closed=closed, x=x, idx=idx, w=w, d=d, de=de, foreign=foreign,
        y=expert_fn(d.x, ctx.rank), wrong_device=torch.device("meta") if ctx.device.type == "cpu" else torch.device("cpu"),
        ones=lambda *shape: torch.ones(*shape, dtype=torch.bfloat16, device=dev),
        zeros_ids=lambda T: torch.zeros(T, K, dtype=torch.long, device=dev),
    )
    errors = errors_of({name: build(e) for name, (build, _, _) in CASES.items()})
    # Still usable: the dispatch made before the rejected calls combines, and
    # every op runs afterwards.
    out = comm.combine(e.y, d.handle)
    other.combine(expert_fn(foreign.x, ctx.rank), foreign.handle)
    s = comm.all_reduce(rand(9, ctx.rank, (100,)).to(dev))
    fp8.dispatch(x, idx, w)
    return errors, out, s


WORLDS = [("cpu", 2)] + [("gpu", w) for _, w in GPU_WORLDS[:1]]


@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}{w}" for t, w in WORLDS])
def test_every_bad_input_raises_its_error_and_the_communicator_stays_usable(worlds, transport, size):
    results = worlds(transport, size).run(t_catalogue)
    _, ref = ep_reference(size)
    ref_sum = reference.all_reduce([rand(9, r, (100,)) for r in range(size)])
    dev = "cpu" if transport == "cpu" else f"cuda:{0}"
    documented = documented_cases()
    for r, (errors, out, s) in enumerate(results):
        for name, (_, kind, text) in CASES.items():
            # expert_rows: every received row in min(K, E/W = 2) experts, alignment 1.
            text = text.format(dev=dev, rows=size * CAP, expert_rows=size * CAP * min(K, 2))
            assert errors[name] is not None, f"rank {r}: {name} was accepted"
            assert errors[name][0] == kind and text in errors[name][1], (name, errors[name], text)
            if transport == "cpu" and size == 2:  # the documented examples are for this world
                parts = documented[name][1].split("...")
                assert all(p in errors[name][1] for p in parts), (name, errors[name][1], documented[name][1])
        assert_bitwise(out, ref[r], f"rank {r}: combine after the rejected calls")
        assert_bitwise(s, ref_sum, f"rank {r}: all_reduce after the rejected calls")


def ep_reference(W):
    inputs = [ep_inputs(1, r, W, 4, ref_cfg(W), "random") for r in range(W)]
    xs, idxs, ws = (list(v) for v in zip(*inputs))
    d = reference.dispatch(xs, idxs, ws, num_experts=2 * W, max_tokens_per_rank=CAP)
    return d, reference.combine([expert_fn(d[r].x, r) for r in range(W)], d)


# --------------------------------------------------- what is not an error


def t_not_errors(ctx):
    W, dev = ctx.world, ctx.device
    comm = ctx.comm(**dict(ep_cfg(W), dtype=torch.float32))
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.5])
    x = special.repeat(CAP, 2)[:, :H].contiguous().to(dev)  # [CAP, H] of NaN, +-Inf, -0
    E = 2 * W
    # Slot 0 and 1 name the same expert (one row to its rank), slot 2 ids at or
    # above 2^31 (dropped, like any id >= num_experts).
    idx = torch.stack([torch.arange(CAP) % E, torch.arange(CAP) % E, torch.full((CAP,), 2**31 + 5)], 1).to(dev)
    d = comm.dispatch(x, idx)
    out = comm.combine(d.x, d.handle)
    # recv_src past the received rows is never read: any value there passes.
    n = int(d.counts.sum())
    junk = d.handle.recv_src.clone()
    junk[n:] = torch.arange(junk.shape[0] - n, dtype=junk.dtype, device=dev)
    out_junk_padding = comm.combine(d.x, d.handle._replace(recv_src=junk))
    scalar = comm.all_reduce(torch.tensor(float("nan") if ctx.rank == 0 else 1.0, device=dev))  # 0-dim: any shape
    empty = comm.all_reduce(torch.ones(0, 3, device=dev))
    ctx.sync()
    return x, d, (out, out_junk_padding), scalar, empty


@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}{w}" for t, w in WORLDS])
def test_what_is_not_an_error(worlds, transport, size):
    results = worlds(transport, size).run(t_not_errors)
    xs = [res[0] for res in results]
    E = 2 * size
    idx = torch.stack([torch.arange(CAP) % E, torch.arange(CAP) % E, torch.full((CAP,), 2**31 + 5)], 1)
    ref = reference.dispatch(xs, [idx] * size, None, num_experts=E, max_tokens_per_rank=CAP)
    ref_out = reference.combine([r.x for r in ref], ref)
    for r, (x, d, (out, out_junk_padding), scalar, empty) in enumerate(results):
        assert_bitwise(out_junk_padding, out, "recv_src past the received rows is not read")
        assert_bitwise(received_rows(d), received_rows(ref[r]), "NaN/Inf/-0 payload passes through dispatch bitwise")
        assert_bitwise(d.topk_idx, ref[r].topk_idx, "a duplicate id routes once; ids >= 2^31 are dropped")
        assert_bitwise(d.counts, ref[r].counts, "one row per (token, destination)")
        assert_bitwise(out, ref_out[r], "combine of NaN/Inf rows")
        assert scalar.shape == () and torch.isnan(scalar)
        assert empty.shape == (0, 3)


def documented_cases() -> dict[str, tuple[str, str]]:
    """The catalogue's rows: case id -> (exception, message contains)."""
    section = DOC.read_text().split("### Catalogue of bad inputs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+\.[a-z0-9_]+)` \| .*? \| (\w+) \| `(.*)` \|$", section, re.M)
    return {case: (kind, message) for case, kind, message in rows}


def test_every_catalogue_case_is_documented_and_every_documented_case_is_tested():
    documented = documented_cases()
    assert sorted(documented) == sorted(CASES), set(documented) ^ set(CASES)
    for name, (_, kind, _) in CASES.items():
        assert documented[name][0] == kind, (name, documented[name])
    assert len(CASES) >= 30


# ------------------------------------------------------- bad handle values
#
# Handles are user input: combine checks the values of every field (on the
# GPU, the kernel does). Rank BAD_RANK passes a bad handle, its peers the
# right one. On the CPU transport the bad rank gets a ValueError before any
# protocol step and repeats the call with the right handle; on the GPU its
# kernel stores nothing out of bounds, still publishes its flags (the peers
# complete), and check() raises RuntimeError; that communicator is unusable
# and a new one works (docs/semantics.md, "Bad handles").

BAD_RANK = 0


def with_value(t, i, v):
    t = t.clone()
    t[i] = v
    return t


def last_row(h):
    """(row, its source rank) of the last received row."""
    j = int(h.counts.sum()) - 1
    return j, int(torch.searchsorted(h.counts.cumsum(0), j, right=True))


def second_row_of_a_source(h):
    """The second row of the first source that sent this rank two rows or more."""
    counts = h.counts.tolist()
    s = next(s for s, n in enumerate(counts) if n >= 2)
    return sum(counts[:s]) + 1


# id -> (forged handle built from e, message fragment), "{...}" filled from e.
HANDLE_CASES = {
    "handle.recv_src": (lambda e: e.h._replace(recv_src=with_value(e.h.recv_src, e.j, e.past_source)),
                        "combine: handle.recv_src[{j}] = {past_source} is out of range: expected"),
    "handle.recv_src_order": (lambda e: e.h._replace(recv_src=with_value(e.h.recv_src, e.j2, e.before_j2)),
                              "combine: handle.recv_src[{j2}] = {before_j2} is out of range: expected"),
    "handle.counts": (lambda e: e.h._replace(counts=with_value(e.h.counts, 0, CAP + 1)),
                      "combine: handle.counts[0] = 7 is out of range: expected a row count in [0, 6]"),
    "handle.counts_negative": (lambda e: e.h._replace(counts=with_value(e.h.counts, e.peer, -1)),
                               "combine: handle.counts[{peer}] = -1 is out of range"),
    "handle.src_tokens": (lambda e: e.h._replace(src_tokens=with_value(e.h.src_tokens, e.peer, CAP + 1)),
                          "combine: handle.src_tokens[{peer}] = 7 is out of range: expected a token count in [0, 6]"),
    "handle.send_mask": (lambda e: e.h._replace(send_mask=with_value(e.h.send_mask, 0, e.beyond_world)),
                         "combine: handle.send_mask[0] = {beyond_world} is out of range: expected a set of ranks "
                         "below the world size {W}"),
    "handle.wrong_dispatch": (lambda e: e.h._replace(send_mask=e.d2.handle.send_mask,
                                                     token_shape=e.d2.handle.token_shape),
                              "combine: handle.src_tokens[{rank}] = 4 is out of range: expected"),
    "handle.larger_capacity": (lambda e: e.foreign.handle._replace(
        comm_id=e.comm.id, recv_src=e.foreign.handle.recv_src[:e.W * CAP].contiguous(),
        send_mask=e.foreign.handle.send_mask[:CAP].contiguous(), token_shape=(CAP,)),
        "is out of range: expected"),
}


def t_bad_handle(ctx, case):
    W, dev = ctx.world, ctx.device
    # A handle on the GPU is checked after its combine ran (both transports
    # that take one), which leaves the communicator unusable: each case gets a new one there.
    gpu = dev.type == "cuda" and ctx.transport in ("gpu", "dist")
    new_comm = functools.partial(rc.Communicator, **ep_cfg(W), transport=ctx.transport)
    comm = new_comm() if gpu else ctx.comm(**ep_cfg(W))
    x, idx, w = (t.to(dev) for t in ep_inputs(1, ctx.rank, W, 4, ref_cfg(W), "random"))
    d = comm.dispatch(x, idx, w)
    d2 = comm.dispatch(x[:2], idx[:2], w[:2])
    other = foreign = None
    if case == "handle.larger_capacity":
        # Another communicator with a larger capacity, given more tokens than this one holds.
        other = rc.Communicator(**dict(ep_cfg(W), max_tokens_per_rank=CAP + 3), transport=ctx.transport)
        xf, idxf, wf = (t.to(dev) for t in ep_inputs(2, ctx.rank, W, CAP + 3, ref_cfg(W), "random"))
        foreign = other.dispatch(xf, idxf, wf)
    y = expert_fn(d.x, ctx.rank)
    j, s = last_row(d.handle)
    j2 = second_row_of_a_source(d.handle)
    e = SimpleNamespace(W=W, rank=ctx.rank, peer=(ctx.rank + 1) % W, h=d.handle, d2=d2, comm=comm, foreign=foreign,
                        j=j, past_source=s * CAP + int(d.handle.src_tokens[s]),
                        j2=j2, before_j2=int(d.handle.recv_src[j2 - 1]),
                        beyond_world=int(d.handle.send_mask[0]) | (1 << W))
    handle = HANDLE_CASES[case][0](e) if ctx.rank == BAD_RANK else d.handle
    inputs = [t.clone() for t in (y, *handle[:4])]
    guard = torch.full((W * CAP + 1, H), 3.0, dtype=torch.bfloat16, device=dev)  # allocated just before the output
    error, out = None, None
    start = time.monotonic()
    try:
        out = comm.combine(y, handle)
        comm.check()
    except (ValueError, RuntimeError) as exc:
        error = (type(exc).__name__, str(exc))
        if not gpu:  # rejected before any protocol step: the peers wait for the repeated call
            out = comm.combine(y, d.handle)
    elapsed = time.monotonic() - start
    # Bytes, not values: y's rows past the received ones come from x's unspecified padding and may be NaN.
    untouched = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(inputs, (y, *handle[:4])))
    untouched = untouched and bool((guard == 3.0).all())
    fields = {k: getattr(e, k) for k in ("W", "rank", "peer", "j", "past_source", "j2", "before_j2", "beyond_world")}
    if other is not None:
        other.close()
    if gpu:  # the peers complete; a new communicator works
        ctx.sync()
        comm.close()
        comm = new_comm()
    d3 = comm.dispatch(x, idx, w)
    after = comm.combine(y, d3.handle)
    ctx.sync()
    if gpu:
        comm.close()
    return error, None if gpu else out, after, untouched, elapsed, fields


@pytest.mark.parametrize("case", sorted(HANDLE_CASES))
@pytest.mark.parametrize("transport,size", WORLDS + [("dist", 2)], ids=[f"{t}{w}" for t, w in WORLDS + [("dist", 2)]])
def test_bad_handle_values_raise_and_write_nothing_out_of_bounds(worlds, transport, size, case):
    results = worlds(transport, size).run(t_bad_handle, case)
    _, ref = ep_reference(size)
    kind = "RuntimeError" if runs_on_gpus(transport) else "ValueError"
    documented = documented_handle_cases()
    for r, (error, out, after, untouched, elapsed, fields) in enumerate(results):
        if r == BAD_RANK:
            text = HANDLE_CASES[case][1].format(**fields)
            assert error is not None and error[0] == kind and text in error[1], (case, error, text)
            if transport == "cpu" and size == 2:  # the documented examples are for this world
                assert all(p in error[1] for p in documented[case].split("...")), (error[1], documented[case])
        else:
            assert error is None, (r, error)
        assert untouched, f"rank {r}: combine modified its inputs or a neighbouring tensor"
        assert elapsed < 60, f"rank {r}: took {elapsed:.1f} s"
        if out is not None:  # CPU: every rank's (repeated) combine is exact
            assert_bitwise(out, ref[r], f"rank {r}: combine after the rejected handle")
        assert_bitwise(after, ref[r], f"rank {r}: the next combine")


def documented_handle_cases() -> dict[str, str]:
    """The rows of docs/semantics.md's table of bad handles: case id -> message contains."""
    section = DOC.read_text().split("### Bad handles", 1)[1].split("\n### ", 1)[0]
    return dict(re.findall(r"^\| `(handle\.[a-z_]+)` \| .*? \| `(.*)` \|$", section, re.M))


def test_every_bad_handle_case_is_documented():
    assert sorted(documented_handle_cases()) == sorted(HANDLE_CASES)


def t_gpu_token_cap(ctx):
    cap = rc._C.transports()['gpu'].max_tokens_per_rank + 1
    return errors_of({"cap": constructor(max_tokens_per_rank=cap, hidden=8, topk=2, num_experts=2 * ctx.world)})


@pytest.mark.skipif(not GPU_WORLDS, reason="needs the GPU transport")
def test_gpu_token_cap(worlds):
    for errors in worlds("gpu", GPU_WORLDS[0][1]).run(t_gpu_token_cap):
        assert errors["cap"][0] == "ValueError"
        assert f"max_tokens_per_rank must be at most {rc._C.transports()['gpu'].max_tokens_per_rank}" in errors["cap"][1]
