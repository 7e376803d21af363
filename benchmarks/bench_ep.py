#!/usr/bin/env python3
"""MoE expert-parallel communication: rdna4_comm dispatch + combine against
the vLLM allgather_reducescatter path in torch.distributed (all_gather of the
hidden states and the routing, reduce_scatter of the [W*T, H] result; NCCL/RCCL
on GPUs, gloo on CPU processes).

Sweep: hidden {2048, 3072, 4096, 5120, 7168, 8192} x tokens per rank {8, 32,
64, 128, 256, 512, 1024, 4096, 8192, 16384}; top-8 of 256 experts, distinct
and uniform per token; bf16 x [T, H]; int32 ids and fp32 routing weights
[T, 8]; capacity = tokens (one communicator per configuration). Plus, at every
hidden size, a decode step on a prefill-sized communicator: 8 tokens with
capacity 4096 (op "dispatch+combine (cap 4096)"), whose dispatch returns
[W*4096, H] buffers of which 8 rows per source are valid. No expert step is
timed: combine gets the dispatched rows unchanged, and the baseline
reduce-scatters the gathered hidden states. Both are checked before timing
(rdna4_comm against rdna4_comm.reference; see rdna4_comm._bench.cases.ep_ops).
See benchmarks/_common.py for the results file.

--layout rank expert times the expert layout too (dispatch(...,
layout="expert"): one row per token and local expert, which combine takes
back; named "dispatch+combine (expert layout)"), each layout against the
same baseline in the same run.

--dispatch-dtype bf16 fp8 times FP8 dispatch too (a communicator made with
dispatch_dtype=torch.float8_e4m3fn; x quantised in the op, the received
rows dequantised before combine; named "dispatch+combine (fp8)"), against
the same baseline and against its FP8 form ("<baseline>_fp8": quantize_fp8,
all_gather of the FP8 bytes and scales with the routing, dequantize_fp8,
reduce_scatter).

--cap N fixes every communicator's capacity at N (>= every token count
selected, so give --tokens with it) instead of = tokens; configurations whose
capacity differs from their token count are named "dispatch+combine (cap N)".

    python benchmarks/bench_ep.py                  # every GPU, or 2 CPU processes
    python benchmarks/bench_ep.py --quick --transport cpu
    python benchmarks/bench_ep.py --hidden 7168 --tokens 8 128 --out r.jsonl
    python benchmarks/bench_ep.py --hidden 7168 --tokens 8 --cap 4096
    python benchmarks/bench_ep.py --quick --transport cpu --dispatch-dtype bf16 fp8
"""
import functools
import sys

import _common
import torch

from rdna4_comm import Communicator
from rdna4_comm._bench.cases import EP_EXPERTS, EP_TOPK, ep_ops, record
from rdna4_comm._timing import measure

HIDDEN = (2048, 3072, 4096, 5120, 7168, 8192)
TOKENS = (8, 32, 64, 128, 256, 512, 1024, 4096, 8192, 16384)
DECODE_TOKENS, DECODE_CAP = 8, 4096
# (tokens, hidden, capacity); capacity None: = tokens.
FULL = [(t, h, None) for h in HIDDEN for t in TOKENS] + [(DECODE_TOKENS, h, DECODE_CAP) for h in HIDDEN]
QUICK = [(t, h, None) for h in (256, 512) for t in (8, 32, 128)]
DTYPE = torch.bfloat16


def op_name(tokens: int, cap: int, layout: str, fp8: bool = False) -> str:
    """The record's op: "dispatch+combine", with the capacity where it is not
    the token count, the layout where it is not the rank layout, and FP8."""
    notes = (([f"cap {cap}"] if cap != tokens else []) + (["expert layout"] if layout == "expert" else []) +
             (["fp8"] if fp8 else []))
    return "dispatch+combine" + (f" ({', '.join(notes)})" if notes else "")


def worker(ctx, configs, rounds, samples, layouts=("rank",), dispatch_dtypes=("bf16",)) -> None:
    """One rank's sweep: per configuration and dispatch dtype, a communicator
    with its capacity (= tokens unless given), the check and timing of every
    backend, the record; everything freed before the next configuration (the
    large ones take GiBs)."""
    for tokens, hidden, cap in configs:
        cap = tokens if cap is None else cap
        for fp8 in (d == "fp8" for d in dispatch_dtypes):
            with Communicator(ctx.cpu_group, max_tokens_per_rank=cap, hidden=hidden, topk=EP_TOPK,
                              num_experts=EP_EXPERTS, dtype=DTYPE, transport=ctx.transport,
                              dispatch_dtype=torch.float8_e4m3fn if fp8 else None) as comm:
                for layout in layouts:
                    ops = ep_ops(ctx, comm, tokens, layout=layout)
                    stats = measure(ctx, ops, rounds=rounds, samples=samples)
                    ctx.emit(record(op_name(tokens, cap, layout, fp8), tokens, hidden, DTYPE, ops, stats, cap=cap))
                    del ops
            ctx.release()


def add_options(parser) -> None:
    parser.add_argument("--cap", type=int, help="capacity (max_tokens_per_rank) of every communicator, "
                        ">= every token count (default: = tokens; the full sweep adds 8 tokens at cap 4096)")
    parser.add_argument("--layout", nargs="+", choices=("rank", "expert"), default=["rank"],
                        help="dispatch layouts to time, each against the same baseline (default: rank)")
    parser.add_argument("--dispatch-dtype", nargs="+", choices=("bf16", "fp8"), default=["bf16"],
                        help="dispatch payloads to time (default: bf16); fp8 adds the FP8 all_gather baseline")


def main(argv=None) -> int:
    args = _common.parse_args(__doc__, argv, extra=add_options)
    configs = _common.select(QUICK if args.quick else FULL, args)
    if args.cap is not None:
        too_many = sorted({t for t, _, _ in configs if t > args.cap})
        if args.cap < 1 or too_many:
            print(f"bench_ep: --cap {args.cap} must be >= 1 and >= every token count "
                  f"(selected token counts above it: {too_many}; choose them with --tokens)", file=sys.stderr)
            return 2
        configs = list(dict.fromkeys((t, h, args.cap) for t, h, _ in configs))
    return _common.run("bench_ep", args, configs, functools.partial(worker, layouts=tuple(args.layout),
                                                                    dispatch_dtypes=tuple(args.dispatch_dtype)))


if __name__ == "__main__":
    sys.exit(main())
