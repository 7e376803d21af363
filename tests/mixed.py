"""A seeded stream of mixed back-to-back ops on one communicator: dispatch
in either layout (rank or expert), combine (of any earlier dispatch still
open, not only the last),
all_reduce and all_reduce_rmsnorm, with shapes and dtypes changing from op
to op. Every rank derives the same plan from the seed and its own inputs
from (op seed, rank), so the test side rebuilds every rank's inputs and the
expected results from rdna4_comm.reference. test_faults and test_soak use it.

Results are compared by digest (BLAKE2b of dtype, shape and every byte), a
bitwise comparison that keeps thousands of results from travelling back.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

import torch
from common import ep_inputs, expert_fn, rand

from rdna4_comm import reference
from rdna4_comm.reference import assert_rmsnorm_within_contract
from rdna4_comm._checks import HANDLE_FIELDS, received_rows

CAP, HIDDEN, TOPK, EXPERTS_PER_RANK = 12, 40, 4, 3
EP_DTYPE = torch.bfloat16
EPS = 1e-6
# A small all_reduce slot makes the larger all_reduce calls take several chunks.
SLOT_BYTES = 4096
# Dispatches open at once (their handles not yet combined).
MAX_OPEN = 3
ROUTING = ("random", "all_local", "all_remote", "invalid_ids", "one_expert")
LAYOUTS = ("rank", "expert")
# The expert layout's: alignment padding rows in most expert dispatches.
EXPERT_ALIGNMENT = 4
AR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RMSNORM_HIDDEN = (8, 40, 136, 1030)


def comm_kwargs(world: int) -> dict:
    """Communicator arguments of the stream's communicator."""
    return dict(max_tokens_per_rank=CAP, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS_PER_RANK * world,
                dtype=EP_DTYPE, allreduce_slot_bytes=SLOT_BYTES, expert_alignment=EXPERT_ALIGNMENT)


def _ep_cfg(world: int) -> dict:
    return dict(hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS_PER_RANK * world, dtype=EP_DTYPE)


class Op(NamedTuple):
    """One op of the plan; ``seed`` seeds its inputs. dispatch: ``tokens``
    per rank, ``routing`` and ``layout``; combine: ``of``, the index of its dispatch;
    all_reduce: ``numel`` and ``dtype``; all_reduce_rmsnorm: ``rows``,
    ``hidden``, ``dtype``, ``residual`` and ``weight_dtype``."""

    kind: str
    seed: int
    tokens: tuple = ()
    routing: str = ""
    of: int = -1
    numel: int = 0
    rows: int = 0
    hidden: int = 0
    dtype: Optional[torch.dtype] = None
    residual: bool = False
    weight_dtype: Optional[torch.dtype] = None
    layout: str = "rank"


def plan(n: int, world: int, seed: int) -> list[Op]:
    """``n`` ops; every dispatch is combined by the end."""
    g = torch.Generator().manual_seed(seed)

    def pick(seq):
        return seq[int(torch.randint(0, len(seq), (1,), generator=g))]

    ops: list[Op] = []
    open_dispatches: list[int] = []
    while len(ops) < n:
        s = seed * 1_000_003 + len(ops)
        left = n - len(ops)
        kind = "combine" if left <= len(open_dispatches) else pick(
            ("dispatch", "combine", "all_reduce", "all_reduce_rmsnorm"))
        if kind == "dispatch" and (len(open_dispatches) >= MAX_OPEN or left <= len(open_dispatches) + 1):
            kind = "all_reduce"
        if kind == "combine" and not open_dispatches:
            kind = "all_reduce_rmsnorm"
        if kind == "dispatch":
            open_dispatches.append(len(ops))
            tokens = tuple(torch.randint(0, CAP + 1, (world,), generator=g).tolist())
            ops.append(Op("dispatch", s, tokens=tokens, routing=pick(ROUTING), layout=pick(LAYOUTS)))
        elif kind == "combine":
            ops.append(Op("combine", s, of=open_dispatches.pop(int(torch.randint(0, len(open_dispatches), (1,),
                                                                                  generator=g)))))
        elif kind == "all_reduce":
            ops.append(Op("all_reduce", s, numel=int(torch.randint(1, 3000, (1,), generator=g)), dtype=pick(AR_DTYPES)))
        else:
            dtype = pick(AR_DTYPES)
            ops.append(Op("all_reduce_rmsnorm", s, rows=int(torch.randint(0, 7, (1,), generator=g)),
                          hidden=pick(RMSNORM_HIDDEN), dtype=dtype, residual=bool(pick((True, False))),
                          weight_dtype=pick((dtype, torch.float32))))
    return ops


def rmsnorm_inputs(op: Op, rank: int):
    """(x, residual, weight) of one rank; residual and weight are the same on every rank."""
    x = rand(op.seed, rank, (op.rows, op.hidden), op.dtype)
    residual = rand(op.seed, 1000, (op.rows, op.hidden), op.dtype) if op.residual else None
    return x, residual, rand(op.seed, 2000, (op.hidden,), op.weight_dtype) / 4


def _inputs(op: Op, rank: int, world: int) -> tuple:
    """Op ``op``'s inputs on ``rank``, on the CPU (combine takes its dispatch's results)."""
    if op.kind == "dispatch":
        return ep_inputs(op.seed, rank, world, op.tokens[rank], _ep_cfg(world), op.routing)
    if op.kind == "all_reduce":
        return (rand(op.seed, rank, (op.numel,), op.dtype),)
    if op.kind == "all_reduce_rmsnorm":
        return rmsnorm_inputs(op, rank)
    return ()


def stage(ops: list[Op], rank: int, world: int, device) -> list[tuple]:
    """Every op's inputs on ``device``, copied before the stream starts: a
    copy from pageable host memory waits for the device, a host sync the
    stream must not have."""
    staged = [tuple(None if t is None else t.to(device) for t in _inputs(op, rank, world)) for op in ops]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return staged


def issue(comm, ops: list[Op], staged: list[tuple], i: int, rank: int, dispatched: dict):
    """Issue op ``i`` on this rank with its ``staged`` inputs and return its
    results (nothing synchronised). ``dispatched`` holds the results of the
    dispatches not combined yet, by op index."""
    op = ops[i]
    if op.kind == "dispatch":
        d = dispatched[i] = comm.dispatch(*staged[i], layout=op.layout)
        return d
    if op.kind == "combine":
        d = dispatched.pop(op.of)
        return comm.combine(expert_fn(d.x, rank, salt=op.of % 5), d.handle)
    if op.kind == "all_reduce":
        return comm.all_reduce(*staged[i])
    return comm.all_reduce_rmsnorm(*staged[i], EPS)


def _tensors(op: Op, result) -> tuple:
    """The tensors of a result that the reference fixes bitwise."""
    if op.kind == "dispatch" and op.layout == "expert":
        # Rows past expert_offsets[-1] are unspecified.
        n = min(int(result.expert_offsets[-1]), result.x.shape[0])
        return (result.x[:n], result.topk_weights[:n], result.expert_counts, result.expert_offsets,
                result.handle.expert_rows_of, *(getattr(result.handle, f) for f in HANDLE_FIELDS))
    if op.kind == "dispatch":
        return (received_rows(result), result.topk_idx, result.topk_weights, result.counts,
                *(getattr(result.handle, f) for f in HANDLE_FIELDS))
    if op.kind == "all_reduce_rmsnorm":
        return (result[1],)  # residual_out; out is checked against it by the contract and across ranks
    return (result,)


def digest(*tensors: Optional[torch.Tensor]) -> bytes:
    """BLAKE2b of the dtype, shape and bytes of each tensor (None included)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t is None:
            h.update(b"None;")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def rank_digests(ops: list[Op], results: list) -> list[tuple[bytes, bytes]]:
    """Per op, on the rank that ran it: (digest of what the reference fixes,
    digest of all_reduce_rmsnorm's out or b""). Checks each
    all_reduce_rmsnorm's out against the contract for its residual_out."""
    out = []
    for op, result in zip(ops, results):
        extra = b""
        if op.kind == "all_reduce_rmsnorm":
            norm, residual_out = result
            _, _, weight = rmsnorm_inputs(op, 0)
            assert_rmsnorm_within_contract(norm, residual_out, weight, EPS, f"{op}")
            extra = digest(norm)
        out.append((digest(*_tensors(op, result)), extra))
    return out


def expected_digests(ops: list[Op], world: int) -> list[list[bytes]]:
    """Per op, per rank: the digest of what rdna4_comm.reference gives."""
    cfg = _ep_cfg(world)
    dispatched: dict = {}
    out = []
    for i, op in enumerate(ops):
        if op.kind == "dispatch":
            xs, idxs, ws = zip(*(ep_inputs(op.seed, r, world, op.tokens[r], cfg, op.routing) for r in range(world)))
            per_rank = dispatched[i] = reference.dispatch(
                list(xs), list(idxs), list(ws), num_experts=cfg["num_experts"], max_tokens_per_rank=CAP,
                layout=op.layout, expert_alignment=EXPERT_ALIGNMENT)
        elif op.kind == "combine":
            d = dispatched.pop(op.of)
            per_rank = reference.combine([expert_fn(d[r].x, r, salt=op.of % 5) for r in range(world)], d)
        elif op.kind == "all_reduce":
            per_rank = [reference.all_reduce([rand(op.seed, r, (op.numel,), op.dtype) for r in range(world)])] * world
        else:
            _, residual, weight = rmsnorm_inputs(op, 0)
            xs = [rmsnorm_inputs(op, r)[0] for r in range(world)]
            per_rank = [reference.all_reduce_rmsnorm(xs, residual, weight, EPS)] * world
        out.append([digest(*_tensors(op, res)) for res in per_rank])
    return out


def assert_stream_matches(ops: list[Op], digests_of_rank: list[list[tuple[bytes, bytes]]]) -> None:
    """Every rank's every result bitwise equal to the reference's, and every
    all_reduce_rmsnorm out equal on every rank."""
    world = len(digests_of_rank)
    expected = expected_digests(ops, world)
    bad = []
    for i, op in enumerate(ops):
        for r in range(world):
            got, norm = digests_of_rank[r][i]
            if got != expected[i][r]:
                bad.append(f"op {i} rank {r}: {op}")
            if norm != digests_of_rank[0][i][1]:
                bad.append(f"op {i} rank {r}: all_reduce_rmsnorm out differs from rank 0's: {op}")
    assert not bad, f"{len(bad)} results differ from rdna4_comm.reference, first: " + "; ".join(bad[:5])
