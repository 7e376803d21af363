"""Inputs and comparisons shared by the tests. The ones the benchmarks and
the demo use too live in rdna4_comm._checks and are re-exported here."""
from __future__ import annotations

import glob
import os

import torch

from rdna4_comm._checks import assert_dispatched, rand, received_rows  # noqa: F401  (re-exported to the tests)
# Bitwise equality of dtype, shape and every byte: the benchmarks' check.
from rdna4_comm._checks import assert_same as assert_bitwise  # noqa: F401  (re-exported to the tests)


def shm_segments(*pids: int) -> list[str]:
    """This library's /dev/shm names created by the given processes (segment
    names start with the creator's pid), so strays of other runs don't count."""
    return [p for pid in pids for p in glob.glob(f"/dev/shm/rdna4_comm.{pid}.*")]


def errors_of(cases: dict) -> dict:
    """Run each call of ``cases`` (name -> callable); per name, None if it
    returned, else (exception type name, message)."""
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001  (the tests assert on the kind)
            errors[name] = (type(e).__name__, str(e))
    return errors


def examples(n: int) -> int:
    """Hypothesis examples for a test, scaled by RDNA4_COMM_TEST_EXAMPLES (a factor)."""
    return max(5, int(n * float(os.environ.get("RDNA4_COMM_TEST_EXAMPLES", "1"))))


# Multiprocessors of the H200 (and H100) the GPU kernels are measured on.
H200_SMS = 132


def sender_chunk_bytes(ntok: int, world: int, row_bytes: int, sms: int = H200_SMS) -> int:
    """Bytes of input rows a GPU dispatch sender block takes (its chunk of
    ep_own_block_tokens rows), for deciding whether a test's shape is past
    the block's prefetch (block_prefetch_covers)."""
    from rdna4_comm import _C

    return _C.testing.ep_own_block_tokens(ntok, world, sms) * row_bytes


# ------------------------------------------------------------------ EP inputs

ROUTINGS = (
    "random", "all_local", "all_remote", "all_dropped", "invalid_ids", "one_expert",
    "dest_only_in_last_slot", "duplicates_across_32", "rank_without_tokens",
)


def routing(kind: str, g: torch.Generator, T: int, K: int, E: int, W: int, rank: int) -> torch.Tensor:
    """[T, K] int64 global expert ids for one rank, following ``kind``."""
    epr = E // W

    def experts_of(r, shape):
        return r * epr + torch.randint(0, epr, shape, generator=g)

    if kind in ("random", "rank_without_tokens"):
        return torch.randint(0, E, (T, K), generator=g)
    if kind == "all_local":
        return experts_of(rank, (T, K))
    if kind == "all_remote":
        if W == 1:
            return torch.full((T, K), -1, dtype=torch.long)
        others = torch.tensor([r for r in range(W) if r != rank])
        owner = others[torch.randint(0, W - 1, (T, K), generator=g)]
        return owner * epr + torch.randint(0, epr, (T, K), generator=g)
    if kind == "all_dropped":
        bad = torch.tensor([-1, -5, E, E + 3])
        return bad[torch.randint(0, 4, (T, K), generator=g)]
    if kind == "invalid_ids":
        idx = torch.randint(0, E, (T, K), generator=g)
        bad = torch.tensor([-1, E, E + 11, -3])
        pick = torch.randint(0, 2, (T, K), generator=g).bool()
        return torch.where(pick, bad[torch.randint(0, 4, (T, K), generator=g)], idx)
    if kind == "one_expert":
        return torch.full((T, K), (E * 5) // 7, dtype=torch.long)
    if kind == "dest_only_in_last_slot":
        # Slots 0..K-2 go to this rank's experts, the last slot to the next rank's.
        idx = experts_of(rank, (T, K))
        idx[:, K - 1] = experts_of((rank + 1) % W, (T,))
        return idx
    if kind == "every_rank":
        # Slot k goes to rank k % W: with K >= W every token reaches every
        # rank, and at T = cap dispatch's x has no padding rows.
        owner = torch.arange(K) % W
        return owner * epr + torch.randint(0, epr, (T, K), generator=g)
    if kind == "duplicates_across_32":
        idx = torch.randint(0, E, (T, K), generator=g)
        if K > 32:
            idx[:, 32] = idx[:, 0]
            idx[:, K - 1] = idx[:, 31]
        elif K > 1:
            idx[:, K - 1] = idx[:, 0]
        return idx
    raise ValueError(kind)


def ep_inputs(seed: int, rank: int, world: int, T: int, cfg: dict, kind: str, weights: bool = True):
    """Deterministic (x, topk_idx, topk_weights) for one rank of one EP case."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 3)
    H, K, E = cfg["hidden"], cfg["topk"], cfg["num_experts"]
    x = rand(seed, rank, (T, H), cfg["dtype"])
    idx = routing(kind, g, T, K, E, world, rank)
    idx = idx.to(torch.int32) if seed % 2 else idx
    w = torch.rand(T, K, generator=g) + 0.125 if weights else None
    return x, idx, w


def expert_fn(x: torch.Tensor, rank: int, salt: int = 0) -> torch.Tensor:
    """A stand-in expert that rounds exactly once (so eager, compiled and GPU agree bitwise)."""
    return (x.float() * 2 + (rank + 1 + salt)).to(x.dtype)


SHORT_TIMEOUT_MS = 700


def short_timeout_ms(transport: str) -> int:
    """A bound that a skipped call reaches quickly. It bounds construction
    too, and a dist communicator's construction connects a process group of
    its own, which takes seconds on a loaded 2-core machine."""
    return 5000 if transport == "dist" else SHORT_TIMEOUT_MS


# opcheck of the dispatch ops. Their output dispatch_round is the round the
# call ran as (docs/semantics.md, "Calls that disagree"), so two calls with
# the same arguments differ there, and opcheck's AOT test, which compares
# an eager call with a traced one, would fail on it: that test is replaced
# by the same comparison of every other output, and the rounds consecutive.
DISPATCH_OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")


def opcheck_dispatch(op, args, test_utils=DISPATCH_OPCHECK_TESTS) -> None:
    torch.library.opcheck(op, args, test_utils=test_utils)
    names = [r.name for r in op._schema.returns]
    at = names.index("dispatch_round")
    eager = op(*args)
    traced = torch.compile(lambda *a: op(*a), backend="aot_eager", fullgraph=True, dynamic=True)(*args)
    for name, a, b in zip(names, eager, traced):
        if name != "dispatch_round":
            assert_bitwise(b, a, f"{op} output {name}, traced")
    assert int(traced[at]) == int(eager[at]) + 1, (int(eager[at]), int(traced[at]))
