"""The ops of benchmarks/bench_kernels.py's rows (its docstring says what each
row times), in a world of one rank (:func:`one_rank`):
:class:`Cases` builds the communicators, inputs and ops, each op a
:class:`KOp` with the check its result passes before it is timed.

Inputs: x [T, H] bf16 (:func:`~rdna4_comm._checks.pattern`), topk_idx
[T, 8] int64 and topk_weights [T, 8] bf16 (top-8 of 256 experts, distinct and
uniform per token: :func:`~rdna4_comm._bench.cases.ep_routing`). Checks are
bitwise, against rdna4_comm.reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from rdna4_comm import reference
from rdna4_comm._bench.cases import EP_BITS, EP_EXPERTS, EP_TOPK, ep_routing
from rdna4_comm._checks import assert_dispatched, assert_expert_dispatched, assert_same, pattern
from rdna4_comm._launch import free_port
from rdna4_comm._ranks import RankContext
from rdna4_comm.communicator import Communicator
from rdna4_comm.fp8 import FP8_DTYPE, quantize_fp8
from rdna4_comm.results import ExpertDispatched

DTYPE = torch.bfloat16
SEED = 0


def one_rank(device: str) -> RankContext:
    """A world of one process, this one: gloo on 127.0.0.1; ``device``
    "cuda": transport "gpu" on cuda:0, "cpu": transport "cpu", the CPU
    transport and torch's baselines on the calling thread (torch's thread
    pool also costs milliseconds per op on small, loaded machines)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    if device == "cuda":
        return RankContext(0, 1, "gpu", torch.device("cuda", 0), init, baseline="torch")
    torch.set_num_threads(1)
    return RankContext(0, 1, "cpu", torch.device("cpu"), init, baseline="torch")


@dataclass(frozen=True)
class Shapes:
    """(T, H) of the rows; capacity = T unless a row says otherwise."""

    large: tuple  # rows 1-2, 8-9 and 12-13; its communicator (cap = T) is rows 5 and 11's large capacity
    small: tuple  # row 3
    medium: tuple  # row 4
    decode: tuple  # rows 5 and 11 (cap = large T against cap = T), 6-7 and 10 (cap = T); H = large H


GPU_SHAPES = Shapes(large=(4096, 7168), small=(8, 4096), medium=(128, 7168), decode=(8, 7168))
CPU_SHAPES = Shapes(large=(256, 512), small=(8, 256), medium=(64, 512), decode=(8, 512))
ADD_NUMEL = 8  # the host-time baseline: torch.add of two [8] fp32 tensors


@dataclass(frozen=True)
class KOp:
    """One op: ``run()`` launches it on fixed inputs (capturable in a CUDA
    graph: no host sync); ``check(run())`` raises AssertionError when the
    result is wrong; ``detail`` says what exactly runs."""

    key: str
    run: Callable[[], Any]
    check: Callable[[Any], None]
    detail: str


def ep_inputs(tokens: int, hidden: int, device) -> tuple:
    """x [T, H] bf16, topk_idx [T, 8] int64 (distinct uniform ids of 256) and
    topk_weights [T, 8] bf16 on ``device``."""
    idx, w = ep_routing(0, tokens, EP_TOPK, EP_EXPERTS, SEED)
    x = pattern(0, tokens, hidden, DTYPE, device, bits=EP_BITS)
    return x, idx.to(torch.int64).to(device), w.to(DTYPE).to(device)


def check_dispatched(d, x, idx, w, cap: int, what: str, fp8: bool = False, layout: str = "rank"):
    """Raise unless ``d`` (a Dispatched) is what rdna4_comm.reference.dispatch
    gives for this one rank (rdna4_comm._checks.assert_dispatched:
    counts; rows [0, counts.sum()) of x [cap, H] bf16, the rows after them
    being padding, unspecified; topk_idx [cap, 8] int64 with -1 padding and
    topk_weights [cap, 8] bf16 with 0 padding, whole; every handle field).
    With ``fp8``, x is the FP8 rows of rdna4_comm.quantize_fp8 and their
    scales. ``layout="expert"``: ``d`` is an ExpertDispatched, x [8 * cap, H]
    bf16 (a row per (token, expert) pair, grouped by expert), checked by
    assert_expert_dispatched. Returns the reference's result."""
    ref = reference.dispatch([x.cpu()], [idx.cpu()], [w.cpu()], num_experts=EP_EXPERTS, max_tokens_per_rank=cap,
                             dispatch_dtype=FP8_DTYPE if fp8 else None, layout=layout)[0]
    (assert_expert_dispatched if layout == "expert" else assert_dispatched)(d, ref, f"{what}:")
    return ref


def check_combined(out, y, ref, x, what: str) -> None:
    """Raise unless ``out`` = reference.combine of ``y`` under the reference
    handle ``ref``, and (W = 1: each token comes back once from each of its
    rows) equals x times the rows a token has: 1 in the rank layout, its 8
    distinct experts' in the expert layout (exact: a power of two)."""
    assert_same(out, reference.combine([y.cpu()], [ref])[0], f"{what}: combine vs rdna4_comm.reference")
    rows = EP_TOPK if isinstance(ref, ExpertDispatched) else 1
    assert_same(out, x * rows, f"{what}: combine(dispatch(x).x) == {rows} x")


class Cases:
    """The communicators, inputs and ops of every row (see the module
    docstring), on ``rank``'s device; :meth:`check_all` checks them."""

    def __init__(self, rank: RankContext, shapes: Shapes):
        self.rank, self.shapes = rank, shapes
        dev = rank.device
        (tl, hl), (ts, hs), (tm, hm), (td, hd) = shapes.large, shapes.small, shapes.medium, shapes.decode
        assert hd == hl, "the decode rows run on the large communicator too: same hidden size"
        self.comms: dict[tuple, Communicator] = {}
        self.ops: dict[str, KOp] = {}
        large = self.comm(tl, hl)

        # Rows 1-2: dispatch and combine of T = cap tokens, and the copy of the same bytes.
        x, _ = self._add_dispatch_and_combine("", "", large, tl, hl)
        dst = torch.empty_like(x)
        self._add("copy", lambda: dst.copy_(x), lambda out: assert_same(out, x, "copy_"),
                  f"dst.copy_(src), [{tl}, {hl}] bf16 ({tl * hl * 2} bytes: the payload dispatch moves at W = 1)")
        dst_kernel = torch.empty_like(x)
        self._add("copy_kernel", lambda: torch.mul(x, 1, out=dst_kernel),
                  lambda out: assert_same(out, x, "torch.mul(src, 1, out=dst)"),
                  f"torch.mul(src, 1, out=dst), [{tl}, {hl}] bf16: an elementwise kernel moving the copy's bytes "
                  "(ncu's stand-in for the copy_, a memcpy it does not profile)")

        # Rows 8-9: FP8 dispatch of the same tokens, quantised in the op and of
        # a (q, scales) pair, and the copy of the bytes it moves.
        self._add_fp8_dispatch(self.comm(tl, hl, fp8=True), tl, hl)

        # Rows 3-5: dispatch + combine.
        self._add_round_trip("dc_small", self.comm(ts, hs), ts, hs)
        self._add_round_trip("dc_medium", self.comm(tm, hm), tm, hm)
        self._add_round_trip("dc_decode_bigcap", large, td, hd)
        decode = self.comm(td, hd)
        self._add_round_trip("dc_decode", decode, td, hd)

        # Rows 10-13: the expert layout. Decode steps on both capacities
        # (against the rank layout's steps above), and dispatch and combine of
        # the large T against the bytes they write and read.
        self._add_round_trip("dc_expert_decode", decode, td, hd, layout="expert")
        self._add_round_trip("dc_expert_decode_bigcap", large, td, hd, layout="expert")
        _, pairs = self._add_dispatch_and_combine("_expert", " (expert layout)", large, tl, hl, layout="expert")
        self._add_pair_baselines(pairs[: tl * EP_TOPK], tl, hl)

        # Rows 6-7: eager host time on the decode communicator, and an add.
        self._add_dispatch_and_combine("_host", " (host time)", decode, td, hd)
        a = torch.arange(ADD_NUMEL, dtype=torch.float32, device=dev)
        b = torch.full((ADD_NUMEL,), 0.5, dtype=torch.float32, device=dev)
        expected = torch.arange(ADD_NUMEL, dtype=torch.float32) + 0.5
        self._add("add", lambda: torch.add(a, b), lambda out: assert_same(out, expected, "torch.add"),
                  f"torch.add(a, b), two [{ADD_NUMEL}] fp32 tensors on {dev}")

    def comm(self, cap: int, hidden: int, fp8: bool = False) -> Communicator:
        key = (cap, hidden, fp8)
        if key not in self.comms:
            self.comms[key] = Communicator(dist.group.WORLD, max_tokens_per_rank=cap, hidden=hidden, topk=EP_TOPK,
                                           num_experts=EP_EXPERTS, dtype=DTYPE, transport=self.rank.transport,
                                           dispatch_dtype=FP8_DTYPE if fp8 else None)
        return self.comms[key]

    def _add_fp8_dispatch(self, comm: Communicator, tokens: int, hidden: int) -> None:
        """Ops "dispatch_fp8" (x [T, H] bf16 quantised in the op),
        "dispatch_fp8_pair" (its (q, scales) from rdna4_comm.quantize_fp8) and
        "copy_fp8" (copy_ of those q and scales: the bytes FP8 dispatch moves
        at W = 1)."""
        x, idx, w = ep_inputs(tokens, hidden, self.rank.device)
        q, scales = quantize_fp8(x)
        shapes = (f"topk_idx [{tokens}, 8] int64, topk_weights [{tokens}, 8] bf16), cap {tokens}, "
                  "dispatch_dtype=torch.float8_e4m3fn")
        self._add("dispatch_fp8", lambda: comm.dispatch(x, idx, w),
                  lambda d: check_dispatched(d, x, idx, w, tokens, "FP8 dispatch", fp8=True),
                  f"comm.dispatch(x [{tokens}, {hidden}] bf16, {shapes}")
        self._add("dispatch_fp8_pair", lambda: comm.dispatch((q, scales), idx, w),
                  lambda d: check_dispatched(d, x, idx, w, tokens, "FP8 dispatch of a pair", fp8=True),
                  f"comm.dispatch((q [{tokens}, {hidden}] float8_e4m3fn, scales [{tokens}, {scales.shape[1]}] "
                  f"fp32), {shapes}")
        q_bytes, dst_q, dst_s = q.view(torch.uint8), torch.empty_like(q.view(torch.uint8)), torch.empty_like(scales)

        def check_copy(out):
            assert_same(out[0], q_bytes, "copy_ of q")
            assert_same(out[1], scales, "copy_ of the scales")

        self._add("copy_fp8", lambda: (dst_q.copy_(q_bytes), dst_s.copy_(scales)), check_copy,
                  f"dst_q.copy_(q), dst_s.copy_(scales): [{tokens}, {hidden}] uint8 and [{tokens}, {scales.shape[1]}] "
                  f"fp32 ({tokens * hidden + scales.numel() * 4} bytes: what FP8 dispatch moves at W = 1)")

    def _add(self, key, run, check, detail) -> None:
        self.ops[key] = KOp(key, run, check, detail)

    def _add_dispatch_and_combine(self, suffix: str, note: str, comm: Communicator, tokens: int, hidden: int,
                                  layout: str = "rank") -> tuple:
        """Ops "dispatch<suffix>" (x [T, H] bf16 with its routing, T = the
        communicator's capacity, in ``layout``) and "combine<suffix>" (y = a
        checked dispatch's x, its handle: [T, H] bf16 in the rank layout,
        [comm.expert_rows, H] in the expert layout); ``note`` ends their
        check messages. Returns (x, y)."""
        x, idx, w = ep_inputs(tokens, hidden, self.rank.device)
        arg = "" if layout == "rank" else f", layout={layout!r}"
        self._add(f"dispatch{suffix}", lambda: comm.dispatch(x, idx, w, layout=layout),
                  lambda d: check_dispatched(d, x, idx, w, tokens, f"dispatch{note}", layout=layout),
                  f"comm.dispatch(x [{tokens}, {hidden}] bf16, topk_idx [{tokens}, 8] int64, "
                  f"topk_weights [{tokens}, 8] bf16{arg}), cap {tokens}")
        d = comm.dispatch(x, idx, w, layout=layout)
        ref = check_dispatched(d, x, idx, w, tokens, f"dispatch for combine's input{note}", layout=layout)
        y, handle = d.x, d.handle
        self._add(f"combine{suffix}", lambda: comm.combine(y, handle),
                  lambda out: check_combined(out, y, ref, x, f"combine{note}"),
                  f"comm.combine(y [{y.shape[0]}, {hidden}] bf16, handle{arg}) -> [{tokens}, {hidden}] bf16, "
                  f"cap {tokens}")
        return x, y

    def _add_round_trip(self, key: str, comm: Communicator, tokens: int, hidden: int, layout: str = "rank") -> None:
        x, idx, w = ep_inputs(tokens, hidden, self.rank.device)
        cap = comm.max_tokens_per_rank

        def run():
            d = comm.dispatch(x, idx, w, layout=layout)
            return d, comm.combine(d.x, d.handle)

        def check(result):
            d, out = result
            ref = check_dispatched(d, x, idx, w, cap, f"{key} dispatch", layout=layout)
            check_combined(out, d.x, ref, x, f"{key} combine")

        arg = "" if layout == "rank" else f", layout={layout!r}"
        self._add(key, run, check, f"d = comm.dispatch(x [{tokens}, {hidden}] bf16, topk_idx int64, topk_weights bf16"
                                   f"{arg}); comm.combine(d.x, d.handle); cap {cap}")

    def _add_pair_baselines(self, pairs: torch.Tensor, tokens: int, hidden: int) -> None:
        """Ops "copy_pairs" (copy_ of the [8 T, H] bf16 pair rows an expert
        dispatch writes) and "read_pairs" (those rows summed per token by
        torch: each read once, T rows written)."""
        dst = torch.empty_like(pairs)
        self._add("copy_pairs", lambda: dst.copy_(pairs), lambda out: assert_same(out, pairs, "copy_ of the pair rows"),
                  f"dst.copy_(src), [{tokens * EP_TOPK}, {hidden}] bf16 ({tokens * EP_TOPK * hidden * 2} bytes: the "
                  "pair rows the expert dispatch writes at W = 1)")
        by_token = pairs.view(tokens, EP_TOPK, hidden)
        expected = (by_token.float().sum(1)).to(DTYPE).cpu()
        self._add("read_pairs", lambda: torch.sum(by_token, 1),
                  lambda out: assert_same(out, expected, "torch.sum of the pair rows"),
                  f"torch.sum(y.view({tokens}, 8, {hidden}), 1) of [{tokens * EP_TOPK}, {hidden}] bf16 pair rows: each "
                  f"read once, [{tokens}, {hidden}] written (what the expert combine reads and writes at W = 1)")

    def check_all(self, keys) -> None:
        """Run and check every op of ``keys`` once (eager)."""
        for key in keys:
            op = self.ops[key]
            out = op.run()
            self.rank.sync()
            op.check(out)

    def close(self) -> None:
        self.rank.sync()
        for comm in self.comms.values():
            comm.close()
        self.comms.clear()
