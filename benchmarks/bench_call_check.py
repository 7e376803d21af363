#!/usr/bin/env python3
"""What checking that the ranks' calls agree costs on transport "dist"
(docs/semantics.md, "Calls that disagree"): the same ops on two
communicators of the same group, one made with ``dist_check_calls=True``
(an all-gather of the ranks' call words before each op), side by side in
one run. The P2P transports check always, inside the flags they publish
(on GPUs: benchmarks/bench_kernels.py, before and after, docs/development.md).

Rows: all_reduce of [tokens, hidden] fp32, and a decode step's dispatch +
combine (top-8 of 256 experts, bf16, weights), at tokens 8 and 128.

    python benchmarks/bench_call_check.py                 # 2 CPU processes, gloo
    python benchmarks/bench_call_check.py --out r.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys

import _common
import torch

import rdna4_comm as rc
from rdna4_comm._bench.world import describe, launch
from rdna4_comm._timing import Op, format_table, measure

HIDDEN, TOPK, EXPERTS = 4096, 8, 256
TOKENS = (8, 128)


def worker(ctx, rounds: int, samples: int) -> None:
    ctx.emit({"info": describe(ctx)})
    dev = ctx.device
    for tokens in TOKENS:
        plain = rc.Communicator(transport="dist", max_tokens_per_rank=tokens, hidden=HIDDEN, topk=TOPK,
                                num_experts=EXPERTS)
        checked = rc.Communicator(transport="dist", max_tokens_per_rank=tokens, hidden=HIDDEN, topk=TOPK,
                                  num_experts=EXPERTS, dist_check_calls=True)
        g = torch.Generator().manual_seed(ctx.rank)
        t = torch.randn(tokens, HIDDEN, generator=g).to(dev)
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
        idx = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOPK].contiguous().to(dev)
        w = torch.rand(tokens, TOPK, generator=g).to(dev)

        def step(comm):
            d = comm.dispatch(x, idx, w)
            return comm.combine(d.x, d.handle)

        want_ar, want_step = plain.all_reduce(t), step(plain)

        def same_as(want):
            def check(got):
                assert torch.equal(got, want), "the checked communicator's result differs"
            return check

        for op, run, want in (("all_reduce", lambda c: c.all_reduce(t), want_ar),
                              ("dispatch+combine", step, want_step)):
            stats = measure(ctx, [Op("dist", lambda run=run: run(plain), same_as(want)),
                                  Op("dist, calls checked", lambda run=run: run(checked), same_as(want))],
                            rounds=rounds, samples=samples)
            ctx.emit({"op": op, "tokens": tokens, "hidden": HIDDEN,
                      "p50_us": {b: s.p50_us for b, s in stats.items()}})
        plain.close()
        checked.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--out", type=argparse.FileType("x"), help="results file (.jsonl); refuses to overwrite")
    args = p.parse_args(argv)
    rows = []

    def on_message(msg: dict) -> None:
        if "info" in msg:
            record = _common.header("bench_call_check", msg["info"], rounds=args.rounds, samples=args.samples,
                                     ratio="p50 with the check / p50 without")
        else:
            record = dict(type="result", **msg)
            record["ratio"] = msg["p50_us"]["dist, calls checked"] / msg["p50_us"]["dist"]
            rows.append(record)
        if args.out:
            args.out.write(json.dumps(record) + "\n")

    launch(worker, (args.rounds, args.samples), transport="cpu", world=2, on_message=on_message)
    print(format_table(["op", "tokens", "dist us", "checked us", "ratio"],
                       [(r["op"], r["tokens"], r["p50_us"]["dist"], r["p50_us"]["dist, calls checked"], r["ratio"])
                        for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
