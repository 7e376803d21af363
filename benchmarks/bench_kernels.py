#!/usr/bin/env python3
"""Kernel efficiency on one GPU: rdna4_comm's dispatch and combine in a world
of one rank (transport "gpu"; every row takes the kernels' own-rank path,
since with W = 1 every token's experts live on rank 0), each row measured
side by side with its baseline in one run and checked before it is timed.

Common to every row: top-8 of 256 experts, distinct and uniform per token
(rdna4_comm._bench.cases.ep_routing); routing as a real router gives it:
topk_idx [T, 8] int64, topk_weights [T, 8] bf16; payload x [T, H] bf16
(rdna4_comm._checks.pattern); capacity cap = T unless a row says
otherwise. Dispatch returns x [cap, H] bf16, topk_idx [cap, 8] int64,
topk_weights [cap, 8] bf16, counts [1] int32 and a handle (recv_src [cap],
counts [1], src_tokens [1], send_mask [T], all int32); combine takes y
[cap, H] bf16 (the dispatched x, unchanged: no expert step) and the handle,
and returns [T, H] bf16.

GPU rows (defaults; "ratio" is rdna4_comm / baseline, a target bounds it
from above):

1. dispatch, T = 4096, H = 7168, cap = 4096: device time against a torch
   copy of the bytes dispatch moves at W = 1 (every token goes to rank 0
   once): ``dst.copy_(src)`` of a [4096, 7168] bf16 tensor (T * H * 2 bytes).
   Target ratio <= 1.2.
2. combine, same shape (y [4096, 7168] from a checked dispatch), against the
   same copy. Target ratio <= 1.1.
3. dispatch + combine, T = 8, H = 4096, cap = 8: absolute device time.
   Target <= 6.5 us.
4. dispatch + combine, T = 128, H = 7168, cap = 128. Target <= 16 us.
5. a decode step on a prefill-sized capacity: dispatch + combine with T = 8,
   H = 7168 and cap = 4096 (the communicator of row 1), against the same with
   cap = 8. Target ratio <= 1.25.
6. host time per eager dispatch (T = 8, H = 7168, cap = 8, int64 ids, bf16
   weights) against host time per eager ``torch.add`` of two [8] fp32
   tensors on the same device. Target ratio <= 2.5.
7. host time per eager combine (same communicator) against the same add.
   Target ratio <= 1.3.
8. FP8 dispatch (``dispatch_dtype=torch.float8_e4m3fn``), T = 4096,
   H = 7168, cap = 4096, x in bf16 quantised inside the op: device time
   against the copy of row 1, x in bf16 (the op reads those bytes and
   writes half as many). Target ratio <= 1.1.
9. the same with a ``(q, scales)`` pair from ``rdna4_comm.quantize_fp8``,
   against a copy of the bytes it moves at W = 1, the FP8 rows and their
   scales (``copy_`` of q [T, H] uint8 and scales [T, 56] fp32). Target
   ratio <= 1.2.
10. the expert layout's decode step, ``dispatch(..., layout="expert")`` +
    combine (every kernel of it), T = 8, H = 7168, cap = 8, against the rank
    layout's step on the same communicator (row 5's baseline). Target <= 1.5.
11. the same on cap = 4096, against row 5's op. Target ratio <= 1.5.
12. expert-layout dispatch, T = cap = 4096: x [32768, 7168] bf16, a row per
    (token, expert) pair, against a copy of those rows. Target <= 1.3.
13. its combine against ``torch.sum`` of the pair rows per token (each read
    once, [4096, 7168] written). Target ratio <= 1.3.

all_reduce and all_reduce_rmsnorm have no rows: at W = 1 the sum over ranks
is a copy of the input (plus the norm), which says nothing about either
collective; bench_allreduce.py and bench_fused.py time them on 2+ ranks.

Method.
- Checks: before timing, every op's result is compared bitwise with
  rdna4_comm.reference (dispatch: counts, rows [0, counts.sum()) of x (later
  rows are padding, unspecified), topk_idx with its -1 padding, topk_weights
  with its 0 padding, every handle field; combine: reference.combine, and at
  W = 1 combine(dispatch(x).x) == x); baselines against what they must give.
- Device time (every row but 6-7, GPU): torch.profiler (CPU + CUDA activities), each
  call in a record_function range followed by a device synchronisation; a
  call's time is the sum of the durations of the device activities
  (kernels, memcpys, memsets) launched inside its range (the launching ops
  found through the profiler's correlation ids, else by time). Reported:
  p50 over rounds x calls; op and baseline take turns call by call, in an
  order that flips every round.
- Graph replay (rows 3-5, 10-11, GPU): dispatch + combine captured in one
  torch.cuda.CUDAGraph (rdna4_comm._timing's clock: eager warm-up on a
  side stream first), each replay between CUDA events; p50; its result is
  checked too.
- Host time (rows 6-7): ``time.perf_counter`` around blocks of back-to-back
  eager calls, no synchronisation inside a block; the block's time / calls.
  On the GPU the device is kept busy: a ``torch.cuda._sleep`` kernel queued
  ahead of each block outlasts it (checked with an event after the sleep
  that must still be pending when the block ends; else the block is retried
  with a longer sleep), so no call waits for the GPU and the time is the
  Python call returning, not the kernels. The host rows run first, in a
  process that has not yet run torch.profiler or captured a graph, as an
  eager user's; on the GPU they run again after the device rows ("after
  capture" columns, not judged): the profiler's callbacks then slow every
  launch, torch.add's too, and the captured communicator orders each launch
  with an event wait and record.
- ncu (``--ncu``, GPU): the benchmark runs itself again under Nsight
  Compute (``ncu --profile-from-start off --kernel-name-base demangled``,
  the kernels and metrics of _harness/ncu.py's NCU_KERNEL_REGEX and
  NCU_METRICS); that child process checks the ops, warms them up, and
  profiles one call of each inside cudaProfilerStart/Stop. The report is read back with ``ncu --import
  --csv --page raw --print-units base``, matched in order with the kernels
  torch.profiler saw each op launch, and every op gets its kernels' DRAM
  throughput (% of peak, GB/s = dram__bytes / duration), instructions and
  instructions per DRAM byte, and every kernel its instructions per warp
  (what each warp of a small batch's kernel runs around its few bytes). ``copy_`` of one contiguous
  bf16 tensor to another is a device-to-device memcpy, which ncu does not
  profile, so the copy's ncu columns come from an elementwise kernel moving
  the same bytes (``torch.mul(src, 1, out=dst)``). Without ncu the table
  has no ncu columns and says why.

CPU (``--device cpu``, also where no GPU is usable): a one-process world on
the "cpu" transport, the same rows with smaller shapes (rows 1-2: T = cap =
256, H = 512; row 3: T = cap = 8, H = 256; row 4: T = cap = 64, H = 512;
row 5: T = 8, H = 512, cap 256 against cap 8; rows 6-7 and 10: T = cap = 8,
H = 512; row 11 as row 5; rows 8-9 and 12-13 as rows 1-2), device times
from the wall clock of each call (the CPU transport runs its op on the
calling thread, and torch on one thread too), no graph replay, no ncu.
The targets are GPU targets: on CPUs the table prints, but does not judge, them.

Output: the table, the per-op kernel breakdown, and a JSONL results file
(refuses to overwrite; a header line with versions, device and command, one
"result" line per row, "ncu" lines per profiled op, "note" lines).
``--rows`` measures the rows it names alone (host rows among them are
measured again after the device rows named with them).

    python3 benchmarks/bench_kernels.py --out bench_kernels.jsonl
    python3 benchmarks/bench_kernels.py --rows 10 11 12 13 --out expert_rows.jsonl
    python3 benchmarks/bench_kernels.py --ncu --out bench_kernels_ncu.jsonl
    python3 benchmarks/bench_kernels.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import _common
import torch

from _harness.kernel_cases import CPU_SHAPES, DTYPE, GPU_SHAPES, Cases, Shapes, one_rank
from _harness.ncu import aggregate, find_ncu, ncu_table, ncu_version, run_ncu
from _harness.profiling import Timer
from _harness.report import finite
from rdna4_comm._bench.world import describe
from rdna4_comm._ranks import usable_gpus
from rdna4_comm._timing import Stats, format_table

NAME = "bench_kernels"

# (rounds, calls per backend per round, calls per host-time block, host-time blocks per backend per round)
DEFAULTS = {"gpu": (5, 40, 50, 4), "cpu": (3, 20, 20, 4), "quick": (2, 5, 10, 2)}

# Host-time blocks on the GPU: each call queues a handful of launches, and a
# full launch queue would block the host on the GPU; 50 calls stay far below.
MAX_GPU_HOST_CALLS = 100

# What the host rows' second measurement (GPU) adds to the first. Both stay
# with a process: a finished torch.profiler session leaves CUDA callbacks
# that slow every later launch (torch.add too), and a communicator that was
# captured orders each later launch with an event wait and record
# (gpu_comm.cpp, in_stream_order). The first, before any of that, is what
# an eager user's process sees, and the targets judge it.
AFTER_CAPTURE = "after the device rows: torch.profiler sessions and graph captures of the same communicators"

# The ops the ncu child profiles, one call each, in this order.
NCU_OPS = ("dispatch", "copy", "copy_kernel", "combine", "dc_small", "dc_medium", "dc_decode_bigcap",
           "dc_decode", "add", "dispatch_fp8", "dispatch_fp8_pair", "dc_expert_decode", "dc_expert_decode_bigcap",
           "dispatch_expert", "combine_expert", "read_pairs")
# ncu columns of a baseline whose own kernels ncu cannot see (a memcpy).
NCU_STAND_IN = {"copy": "copy_kernel"}


# --------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    n: int
    case: str
    measure: str  # "device" (every row but 6-7) or "host" (rows 6-7)
    op: str  # key of Cases.ops
    baseline: Optional[str]
    target: float
    target_kind: str  # "ratio" (op / baseline) or "us" (op alone)
    graph: bool  # also timed as CUDA-graph replays (GPU)
    tokens: int
    hidden: int
    cap: int
    baseline_name: str = ""


def make_rows(shapes: Shapes) -> list[Row]:
    (tl, hl), (ts, hs), (tm, hm), (td, hd) = shapes.large, shapes.small, shapes.medium, shapes.decode
    return [
        Row(1, f"dispatch T={tl} H={hl} cap={tl}", "device", "dispatch", "copy", 1.2, "ratio", False, tl, hl, tl,
            "copy_ of the bytes"),
        Row(2, f"combine T={tl} H={hl} cap={tl}", "device", "combine", "copy", 1.1, "ratio", False, tl, hl, tl,
            "copy_ of the bytes"),
        Row(3, f"dispatch+combine T={ts} H={hs}", "device", "dc_small", None, 6.5, "us", True, ts, hs, ts),
        Row(4, f"dispatch+combine T={tm} H={hm}", "device", "dc_medium", None, 16.0, "us", True, tm, hm, tm),
        Row(5, f"decode d+c T={td} H={hd} cap={tl} vs cap={td}", "device", "dc_decode_bigcap", "dc_decode", 1.25,
            "ratio", True, td, hd, tl, f"same at cap={td}"),
        Row(6, f"host: eager dispatch T={td} H={hd}", "host", "dispatch_host", "add", 2.5, "ratio", False, td, hd, td,
            "eager torch.add"),
        Row(7, f"host: eager combine T={td} H={hd}", "host", "combine_host", "add", 1.3, "ratio", False, td, hd, td,
            "eager torch.add"),
        Row(8, f"FP8 dispatch T={tl} H={hl} cap={tl}", "device", "dispatch_fp8", "copy", 1.1, "ratio", False, tl,
            hl, tl, "copy_ of x in bf16"),
        Row(9, f"FP8 dispatch of a pair T={tl} H={hl}", "device", "dispatch_fp8_pair", "copy_fp8", 1.2, "ratio", False,
            tl, hl, tl, "copy_ of the FP8 bytes"),
        Row(10, f"expert decode d+c T={td} H={hd} cap={td}", "device", "dc_expert_decode", "dc_decode", 1.5, "ratio",
            True, td, hd, td, "rank layout's step"),
        Row(11, f"expert decode d+c T={td} H={hd} cap={tl}", "device", "dc_expert_decode_bigcap", "dc_decode_bigcap",
            1.5, "ratio", True, td, hd, tl, "rank layout's step"),
        Row(12, f"expert dispatch T={tl} H={hl} cap={tl}", "device", "dispatch_expert", "copy_pairs", 1.3, "ratio",
            False, tl, hl, tl, "copy_ of the pair rows"),
        Row(13, f"expert combine T={tl} H={hl} cap={tl}", "device", "combine_expert", "read_pairs", 1.3, "ratio",
            False, tl, hl, tl, "torch.sum of the pair rows"),
    ]


ROW_COUNT = len(make_rows(GPU_SHAPES))


# ------------------------------------------------------ the ncu child


def ncu_child_command(child_args: list[str]) -> list[str]:
    """This script's command line as ncu's child: ``--ncu-child`` and ``child_args``."""
    return [sys.executable, str(Path(__file__).resolve()), "--ncu-child", *child_args]


def ncu_child(device: str, shapes: Shapes) -> int:
    """Under ncu: check, warm up, then profile one call of each op of NCU_OPS,
    each inside cudaProfilerStart/Stop."""
    rank = one_rank(device)
    cases = Cases(rank, shapes)
    try:
        cases.check_all(NCU_OPS)
        for key in NCU_OPS:
            for _ in range(2):
                cases.ops[key].run()
        rank.sync()
        for key in NCU_OPS:
            torch.cuda.profiler.start()
            cases.ops[key].run()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        print(f"{NAME} (ncu child): profiled one call of each of {', '.join(NCU_OPS)}", flush=True)
    finally:
        cases.close()
        rank.close()
    return 0


# --------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: one GPU, transport 'gpu'; cpu: transport 'cpu', smaller shapes; "
                        "auto (default): cuda where rdna4_comm's GPU transport can run, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer rounds and calls (seconds on CPUs)")
    p.add_argument("--rounds", type=int, help="rounds (default 5 on the GPU, 3 on CPUs, 2 with --quick)")
    p.add_argument("--calls", type=int, help="timed calls per op per round: profiled (GPU), wall-clocked (CPU), "
                   "graph replays (default 40 on the GPU, 20 on CPUs, 5 with --quick)")
    p.add_argument("--host-calls", type=int, help="back-to-back eager calls per host-time block "
                   f"(default 50 on the GPU, at most {MAX_GPU_HOST_CALLS}; 20 on CPUs; 10 with --quick)")
    p.add_argument("--rows", type=int, nargs="+", metavar="N",
                   help="measure these rows alone (default: every row), e.g. --rows 10 11 to compare two trees' "
                        "expert decode steps in more processes per device command")
    p.add_argument("--ncu", action="store_true", help="also run the ops under Nsight Compute (GPU) and add "
                   "DRAM throughput and instruction counts per kernel")
    p.add_argument("--out", type=Path, help="results file (.jsonl); refuses to overwrite "
                   "(default: results/bench_kernels-<transport>-w1-<time>.jsonl)")
    p.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rounds", "calls", "host_calls"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    bad = sorted(set(args.rows or ()) - set(range(1, ROW_COUNT + 1)))
    if bad:
        p.error(f"--rows must name rows 1 to {ROW_COUNT}, got {', '.join(map(str, bad))}")
    return args


def resolve_device(choice: str) -> str:
    gpus = usable_gpus()
    if choice == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    if choice == "cuda" and gpus == 0:
        raise ValueError("--device cuda needs a GPU and a GPU build of rdna4_comm "
                         f"(torch.cuda.is_available()={torch.cuda.is_available()})")
    return choice


def _stats(values: list[float]) -> Stats:
    return Stats.of(values)


def _target_text(row: Row) -> str:
    return f"<= {row.target:g}x" if row.target_kind == "ratio" else f"<= {row.target:g} us"


def measure_row(row: Row, cases: Cases, timer: Timer, rounds: int, calls: int, host_calls: int,
                host_blocks: int) -> dict:
    """Check, then time, one row's op and baseline side by side; its record."""
    keys = [row.op] + ([row.baseline] if row.baseline else [])
    cases.check_all(keys)
    fns = {k: cases.ops[k].run for k in keys}
    values: dict[str, list[float]] = {k: [] for k in keys}
    if row.measure == "device":
        timer.device_times(fns, keys, 2)  # warm-up (the profiler's first session included)
        for k in keys:
            timer.kernels.pop(k, None)  # the breakdown counts the timed calls only
        for r in range(rounds):
            got = timer.device_times(fns, keys if r % 2 == 0 else keys[::-1], calls)
            for k in keys:
                values[k] += got[k]
    else:
        for k in keys:  # warm-up block: the allocator's first allocations
            timer.host_block_us(fns[k], host_calls)
        for r in range(rounds):
            for _ in range(host_blocks):
                for k in keys if r % 2 == 0 else keys[::-1]:
                    values[k].append(timer.host_block_us(fns[k], host_calls))
    stats = {k: _stats(v) for k, v in values.items()}
    graph = None
    if row.graph and timer.gpu:
        g = timer.graph_times(cases.ops, keys, rounds, calls)
        graph = {k: _stats(v) for k, v in g.items()}
    op = stats[row.op]
    ratio = op.p50_us / stats[row.baseline].p50_us if row.baseline else math.nan
    value = ratio if row.target_kind == "ratio" else op.p50_us
    return {"row": row, "stats": stats, "graph": graph, "ratio": ratio,
            "met": (value <= row.target) if timer.gpu else None}


def result_line(rec: dict, cases: Cases, timer: Timer) -> dict:
    row: Row = rec["row"]

    def side(key):
        if key is None:
            return None
        out = {"op": key, "detail": cases.ops[key].detail, **asdict(rec["stats"][key])}
        if timer.gpu and row.measure == "device":
            out["activities"] = [{"name": n, "kind": k, "p50_us": us} for n, k, us in timer.breakdown(key)]
        if rec["graph"] is not None:
            out["graph_replay"] = asdict(rec["graph"][key])
        return out

    after = rec.get("after")
    return {"type": "result", "row": row.n, "case": row.case, "measure": row.measure,
            "time": ("device time per call" if row.measure == "device" else "host time per eager call") +
                    (", torch.profiler" if timer.gpu and row.measure == "device" else ", perf_counter"),
            "tokens": row.tokens, "hidden": row.hidden, "cap": row.cap, "dtype": "bfloat16",
            "bytes": row.tokens * row.hidden * DTYPE.itemsize,
            "rdna4_comm": side(row.op), "baseline": side(row.baseline), "baseline_name": row.baseline_name or None,
            "ratio": None if math.isnan(rec["ratio"]) else rec["ratio"],
            "target": row.target, "target_kind": row.target_kind, "met": rec["met"],
            "after_capture": None if after is None else {
                "rdna4_comm": asdict(after["stats"][row.op]), "baseline": asdict(after["stats"][row.baseline]),
                "ratio": after["ratio"], "what": AFTER_CAPTURE}}


def table(records: list[dict], gpu: bool, ncu: Optional[dict]) -> str:
    header = ["#", "case", "time", "rdna4_comm us", "baseline", "baseline us", "ratio", "target", "met"]
    if gpu:
        header += ["graph us", "graph base us", "after capture us", "after capture ratio"]
    if ncu is not None:
        header += ["DRAM %", "DRAM GB/s", "inst", "inst/B", "base DRAM %", "base GB/s", "base inst/B"]
    rows = []
    for rec in records:
        row: Row = rec["row"]
        s = rec["stats"]
        met = "n/a" if rec["met"] is None else ("yes" if rec["met"] else "NO")
        line = [row.n, row.case, row.measure, s[row.op].p50_us, row.baseline_name or "-",
                s[row.baseline].p50_us if row.baseline else math.nan, rec["ratio"], _target_text(row), met]
        if gpu:
            g = rec["graph"]
            a = rec.get("after")
            line += [g[row.op].p50_us if g else math.nan,
                     g[row.baseline].p50_us if g and row.baseline else math.nan,
                     a["stats"][row.op].p50_us if a else math.nan, a["ratio"] if a else math.nan]
        if ncu is not None:
            op = ncu.get(row.op) if row.measure == "device" else None
            base = ncu.get(row.baseline) if row.measure == "device" and row.baseline else None
            if (not base or not base.get("kernels")) and row.baseline in NCU_STAND_IN and row.measure == "device":
                base = ncu.get(NCU_STAND_IN[row.baseline])  # a memcpy: its kernel stand-in
            pick = lambda agg, f: agg.get(f, math.nan) if agg and agg.get("kernels") else math.nan  # noqa: E731
            line += [pick(op, "dram_pct"), pick(op, "dram_gbs"), pick(op, "inst"), pick(op, "inst_per_byte"),
                     pick(base, "dram_pct"), pick(base, "dram_gbs"), pick(base, "inst_per_byte")]
        rows.append(line)
    return format_table(header, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(f"{NAME}: {e}", file=sys.stderr)
        return 2
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    if args.ncu_child:
        return ncu_child(device, shapes)
    transport = "gpu" if device == "cuda" else "cpu"
    rounds, calls, host_calls, host_blocks = DEFAULTS["quick" if args.quick else transport]
    rounds, calls = args.rounds or rounds, args.calls or calls
    host_calls = args.host_calls or host_calls
    if device == "cuda" and host_calls > MAX_GPU_HOST_CALLS:
        print(f"{NAME}: --host-calls at most {MAX_GPU_HOST_CALLS} on the GPU (the launch queue)", file=sys.stderr)
        return 2
    out = _common.results_path(NAME, args.out, transport, 1)
    if out is None:
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in make_rows(shapes) if not args.rows or r.n in args.rows]
    print(f"{NAME}: {len(rows)} rows, one {device.upper()} rank (transport {transport!r}), {rounds} rounds x "
          f"{calls} calls, host time in blocks of {host_calls} calls -> {out}", flush=True)

    status = 0
    with open(out, "x") as f:

        def write(obj: dict) -> None:
            f.write(json.dumps(obj) + "\n")
            f.flush()

        def note(text: str) -> None:
            print(f"note: {text}", flush=True)
            write({"type": "note", "text": text})

        rank = one_rank(device)
        cases = None
        try:
            cases = Cases(rank, shapes)
            details = {k: op.detail for k, op in cases.ops.items()}
            timer = Timer(rank)
            write(_common.header(
                NAME, describe(rank), rounds=rounds, calls=calls, host_calls=host_calls, host_blocks=host_blocks,
                shapes=asdict(shapes), rows=[r.n for r in rows],
                device_time="torch.profiler: sum of a call's device activities" if timer.gpu else
                            "perf_counter around each call (the CPU transport runs on the calling thread)",
                host_time="perf_counter around blocks of eager calls" +
                          (", the GPU kept busy by a sleep kernel queued ahead of each block" if timer.gpu else ""),
                ratio="p50 of rdna4_comm / p50 of the baseline (the targets bound it from above)",
                targets_judged=timer.gpu))
            # The host rows first, as an eager user's process sees them, and
            # on the GPU once more after the device rows (AFTER_CAPTURE).
            host_rows = [r for r in rows if r.measure == "host"]
            measured = {}
            for row in host_rows + [r for r in rows if r.measure != "host"]:
                print(f"{NAME}: row {row.n}: {row.case}", flush=True)
                measured[row.n] = measure_row(row, cases, timer, rounds, calls, host_calls, host_blocks)
            if timer.gpu:
                for row in host_rows:
                    print(f"{NAME}: row {row.n} again, after the device rows", flush=True)
                    measured[row.n]["after"] = measure_row(row, cases, timer, rounds, calls, host_calls, host_blocks)
            records = [measured[row.n] for row in rows]
            for rec in records:
                write(finite(result_line(rec, cases, timer)))
            ncu = None
            if args.ncu and not timer.gpu:
                note("--ncu: Nsight Compute needs the GPU path (--device cuda); no ncu columns")
            elif args.ncu:
                exe = find_ncu()
                if exe is None:
                    note("--ncu: ncu not found (PATH, $CUDA_HOME/bin, /usr/local/cuda*/bin); no ncu columns")
                else:
                    expected = timer.kernel_names({k: cases.ops[k].run for k in NCU_OPS}, list(NCU_OPS))
                    cases.close()  # the child builds its own; give it the memory
                    cases = None
                    torch.cuda.empty_cache()
                    child = ncu_child_command(["--device", "cuda"] + (["--quick"] if args.quick else []))
                    ncu, why = run_ncu(exe, child, expected, NCU_OPS, tmp_prefix=f"{NAME}_ncu_")
                    if ncu is None:
                        note(f"--ncu: no ncu columns: {why}")
                        status = 1
                    else:
                        ver = ncu_version(exe)
                        for key in NCU_OPS:
                            write(finite({"type": "ncu", "op": key, "ncu": exe, "ncu_version": ver,
                                          "kernels": ncu[key], "total": aggregate(ncu[key])}))
                        ncu = {"_kernels": ncu, **{k: aggregate(v) for k, v in ncu.items()}}
            print()
            print(table(records, timer.gpu, ncu))
            print()
            print("what each op runs:")
            for key in dict.fromkeys(k for rec in records for k in (rec["row"].op, rec["row"].baseline) if k):
                print(f"  {key}: {details[key]}")
            if timer.gpu:
                print("device activities per op (p50 per call):")
                print(timer.breakdown_table(dict.fromkeys(
                    k for rec in records if rec["row"].measure == "device" for k in (rec["row"].op, rec["row"].baseline)
                    if k)))
            if ncu is not None:
                print("\nncu, one call of each op (clocks as ncu sets them; ratios and shares, not absolute "
                      "times, compare with the table):")
                print(ncu_table(ncu["_kernels"], NCU_OPS))
            print("\nDevice time (every row but 6-7): " + ("torch.profiler, the sum of a call's kernels, memcpys and memsets"
                                                  if timer.gpu else "the wall clock of each call") +
                  "; host time (rows 6-7): perf_counter around blocks of back-to-back eager calls" +
                  (", the GPU kept busy by a sleep kernel queued ahead of each block (no call waits for it)."
                   if timer.gpu else "."))
            if not timer.gpu:
                print("The targets are GPU targets: not judged on CPUs.")
        finally:
            if cases is not None:
                cases.close()
            rank.close()
    print(f"results: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
