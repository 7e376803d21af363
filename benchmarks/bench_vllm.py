#!/usr/bin/env python3
"""vLLM generation with and without the rdna4_comm plugin, on the same
engine settings, side by side: offline throughput (a batch of prompts) and a
decode step's latency (one prompt alone, time per generated token), greedy,
on the tiny random checkpoints the tests use (tests/with_vllm/). Each engine
runs in a process of its own (tests/with_vllm/generate.py); tokens are
checked equal before anything is timed.

Configurations: a dense Llama-like model at TP = 2 (vLLM's own all_reduce
against the library's), a Qwen3-MoE at TP = 2 + EP and at DP = 2 + EP, which
vLLM's CPU build cannot run without the plugin (only the plugin's numbers
are reported there, with vLLM's TP = 1 as the reference point).

    python benchmarks/bench_vllm.py                     # CPU processes, eager and compiled
    python benchmarks/bench_vllm.py --quick --out r.jsonl

It needs vLLM (scripts/install_vllm_cpu.sh on CPUs). Results: JSONL (header
first, never overwritten) and a table; see docs/integrations.md, "vLLM".
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "with_vllm"))
import checkpoints  # noqa: E402
import engine  # noqa: E402

# (model, engine settings, whether vLLM runs it without the plugin)
CONFIGS = [
    ("llama", dict(tp=2), True),
    ("qwen3_moe", dict(tp=2, ep=True), False),
    ("qwen3_moe", dict(dp=2, ep=True), False),
]


CACHE_ROOT = tempfile.mkdtemp(prefix="bench_vllm_cache_")


def run(spec: dict, plugin: bool) -> dict:
    return engine.generate(spec, plugin, CACHE_ROOT, 1800)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="eager engines only, 2 rounds")
    p.add_argument("--rounds", type=int, help="timed rounds per engine (default 5, 2 with --quick)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--out", type=Path, help="results file (.jsonl); refuses to overwrite")
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    out = _common.results_path("bench_vllm", args.out, "cpu", 2)
    if out is None:
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    root = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    models = {kind: checkpoints.write(kind, str(root / kind)) for kind in checkpoints.MODELS}
    prompts = [[(7 * i + 13 * j) % checkpoints.VOCAB for j in range(16)] for i in range(8)]
    rows = []
    with open(out, "x") as f:
        f.write(json.dumps({
            "type": "header", "benchmark": "bench_vllm", "vllm": vllm.__version__, "torch": torch.__version__,
            "cores": os.cpu_count(), "rounds": rounds, "max_tokens": args.max_tokens, "batch": len(prompts),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
            "ratio": "time without the plugin / time with it (> 1: the plugin is faster)"}) + "\n")
        for kind, settings, vllm_runs_it in CONFIGS:
            for compiled in ((False,) if args.quick else (False, True)):
                spec = dict(model=models[kind], prompts=prompts, max_tokens=args.max_tokens, rounds=rounds,
                            compile=compiled, **settings)
                reference = dict(spec, tp=1, dp=1, ep=False) if not vllm_runs_it else spec
                t0 = time.perf_counter()
                base = run(reference, plugin=False)
                mine = run(dict(spec, plugin=dict(strict=True)), plugin=True)
                if mine["tokens"] != base["tokens"]:
                    raise RuntimeError(f"{kind} {settings}: the plugin's tokens differ from vLLM's")
                row = dict(type="result", model=kind, compiled=compiled, **settings,
                           baseline="vLLM, same settings" if vllm_runs_it else "vLLM TP=1 (it cannot run these)",
                           start_s=[base["start_s"], mine["start_s"]],
                           batch_s=[statistics.median(base["batch_s"]), statistics.median(mine["batch_s"])],
                           step_ms=[1e3 * statistics.median(base["step_s"]), 1e3 * statistics.median(mine["step_s"])])
                row["ratio_batch"] = row["batch_s"][0] / row["batch_s"][1]
                row["ratio_step"] = row["step_ms"][0] / row["step_ms"][1]
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)
                print(f"{kind} {settings} compiled={compiled}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    tokens = len(prompts) * args.max_tokens
    print(f"\n{'model':10} {'parallel':12} {'mode':8} {'baseline':32} {'tok/s base':>10} {'tok/s plugin':>12} "
          f"{'step ms base':>12} {'step ms plugin':>14}")
    for r in rows:
        parallel = " ".join(f"{k}{r[k]}" for k in ("tp", "dp") if k in r) + (" +EP" if r.get("ep") else "")
        print(f"{r['model']:10} {parallel:12} {'compiled' if r['compiled'] else 'eager':8} {r['baseline']:32} "
              f"{tokens / r['batch_s'][0]:10.1f} {tokens / r['batch_s'][1]:12.1f} "
              f"{r['step_ms'][0]:12.1f} {r['step_ms'][1]:14.1f}")
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
