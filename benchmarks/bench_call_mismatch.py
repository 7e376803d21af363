#!/usr/bin/env python3
"""How long each rank takes to raise when the ranks' calls disagree, and
what it says (docs/semantics.md, "Calls that disagree"): every case of
rdna4_comm._bench.disagreeing_calls on a fresh communicator, timed on every
rank from a common barrier to the exception of its call (or of the
``check()`` after it: on GPUs a kernel's finding surfaces there). Then a
peer that is alive but makes no call, which only the timeout bounds.

The odd rank of each case: 0 where it skips a call ("skipped") or calls
all_reduce while the others dispatch ("op_kind"), else the last rank.
``--timeout-ms`` is the communicators' timeout (default 30 s: a case found
by the timeout shows it); the no-call row uses ``--no-call-timeout-ms``.

    python benchmarks/bench_call_mismatch.py                       # 2 CPU processes
    python benchmarks/bench_call_mismatch.py --transport cpu --world 3
    RDNA4_COMM_ALLOW_SHARED_GPU=1 python benchmarks/bench_call_mismatch.py --transport gpu --world 2
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import _common
import torch
import torch.distributed as dist

from rdna4_comm._bench.disagreeing_calls import CASES, calls, communicator
from rdna4_comm._bench.world import describe
from rdna4_comm._launch import ProcessWorld
from rdna4_comm._ranks import RankContext, runs_on_gpus, usable_gpus
from rdna4_comm._timing import format_table
from rdna4_comm.transport_policy import shared_gpus_allowed

ODD_AT_ZERO = ("skipped", "op_kind")
NO_CALL = "no_call"


def odd_rank(case: str, world: int) -> int:
    return 0 if case in ODD_AT_ZERO else world - 1


def rank_context(member, transport: str) -> RankContext:
    """A rank on CPUs, or on GPU rank % (usable GPUs): ranks may share a GPU
    (RDNA4_COMM_ALLOW_SHARED_GPU=1), so no NCCL group is made."""
    device = torch.device("cuda", member.rank % usable_gpus()) if runs_on_gpus(transport) else torch.device("cpu")
    return RankContext(member.rank, member.world, transport, device, member.init_method, member=member)


def timed(ctx, run, check) -> dict:
    """Run this rank's calls from a barrier of every rank; what it raised and when."""
    dist.barrier(group=ctx.cpu_group)
    start = time.monotonic()
    raised = message = None
    try:
        run()
        check()
    except (ValueError, RuntimeError) as e:
        raised, message = type(e).__name__, str(e)
    return {"rank": ctx.rank, "raised": raised, "after_ms": (time.monotonic() - start) * 1e3, "message": message}


def gathered(ctx, mine: dict) -> list:
    every = [None] * ctx.world
    dist.all_gather_object(every, mine, group=ctx.cpu_group)
    return every


def worker(ctx, cases: list, timeout_ms: int, no_call_timeout_ms: int) -> None:
    ctx.emit({"info": describe(ctx)})
    for seed, case in enumerate(cases):
        odd = odd_rank(case, ctx.world)
        c, run = calls(case, ctx, ctx.rank == odd, seed, timeout_ms)
        mine = timed(ctx, run, c.check)
        c.close()
        ctx.emit({"case": case, "odd_rank": odd, "timeout_ms": timeout_ms, "ranks": gathered(ctx, mine)})
    # Rank 1 is alive (it waits in the gather below) but makes no call.
    c = communicator(ctx, no_call_timeout_ms)
    x = torch.ones(64, device=ctx.device)
    mine = timed(ctx, (lambda: c.all_reduce(x)) if ctx.rank != 1 else (lambda: None), c.check)
    ranks = gathered(ctx, mine)  # rank 1 keeps its communicator open until every rank has its verdict
    c.close()
    ctx.emit({"case": NO_CALL, "odd_rank": 1, "timeout_ms": no_call_timeout_ms, "ranks": ranks})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=("cpu", "gpu", "dist"), default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--timeout-ms", type=int, default=30_000)
    p.add_argument("--no-call-timeout-ms", type=int, default=2_000)
    p.add_argument("--out", type=argparse.FileType("x"), help="results file (.jsonl); refuses to overwrite")
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be >= 2: one rank has no peer to disagree with")
    if runs_on_gpus(args.transport):
        gpus = usable_gpus()
        if gpus == 0:
            p.error(f"--transport {args.transport} needs a GPU")
        if gpus < args.world and not shared_gpus_allowed():
            p.error(f"--world {args.world} on {gpus} GPU(s): set RDNA4_COMM_ALLOW_SHARED_GPU=1 to let ranks share")
    rows = []

    def on_message(msg: dict) -> None:
        if "info" in msg:
            record = _common.header("bench_call_mismatch", msg["info"], timeout_ms=args.timeout_ms,
                                     no_call_timeout_ms=args.no_call_timeout_ms)
        else:
            record = dict(type="result", **msg)
            for r in msg["ranks"]:
                rows.append((msg["case"], msg["odd_rank"], r["rank"], r["raised"] or "-", r["after_ms"],
                             (r["message"] or ("made no call" if msg["case"] == NO_CALL and r["rank"] == msg["odd_rank"]
                                               else "returned"))[:160]))
        if args.out:
            args.out.write(json.dumps(record) + "\n")

    with ProcessWorld(args.world, rank_context, (args.transport,)) as ranks:
        ranks.call(worker, {r: (args.cases, args.timeout_ms, args.no_call_timeout_ms) for r in range(args.world)},
                   on_message=on_message)
    print(format_table(["case", "odd rank", "rank", "raised", "after ms", "message"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
