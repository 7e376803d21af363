"""What the benchmarks share: the command line, the JSONL results file
(header first, never overwritten) and the progress bar. The world and the
ops they time are rdna4_comm._bench's (the demo's too), the reports
_harness.report's. bench_kernels.py, which runs in one process of its own,
uses :func:`results_path` and :func:`header` only.

Results file: one JSON object per line. The first is the header (``"type":
"header"``: versions, device, world size, transport, timestamp, command
line); then one ``"type": "result"`` line per (configuration, backend) with
its p50/p10/p90 in microseconds and ``ratio`` = p50 of that backend / p50 of
rdna4_comm (the speedup of rdna4_comm over it; 1.0 for rdna4_comm itself);
notes the run printed are kept as ``"type": "note"`` lines.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from _harness.report import save_heatmap, summary
from rdna4_comm._bench.cases import speedup
from rdna4_comm._bench.world import describe, launch, resolve_world
from rdna4_comm._launch import WorldFailed

ROUNDS_SAMPLES = {  # (rounds, samples) unless given
    "gpu": (10, 50),
    "cpu": (4, 10),
    "quick": (2, 5),
}


def parse_args(description: str, argv=None, extra=None) -> argparse.Namespace:
    """The shared command line; ``extra(parser)``, if given, adds a benchmark's own options."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small subset of configurations (a few seconds on CPUs)")
    p.add_argument("--transport", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto (default): the library's own choice for one process per GPU with >= 2 usable GPUs "
                        "(gpu, or dist without peer access), else for CPU processes (cpu)")
    p.add_argument("--world", type=int, help="number of processes (default: every GPU, or 2 CPU processes)")
    p.add_argument("--rounds", type=int, help="rounds; backends alternate order between rounds "
                   f"(default {ROUNDS_SAMPLES['gpu'][0]} on GPUs, {ROUNDS_SAMPLES['cpu'][0]} on CPUs, "
                   f"{ROUNDS_SAMPLES['quick'][0]} with --quick)")
    p.add_argument("--samples", type=int, help="timed calls per backend per round "
                   f"(default {ROUNDS_SAMPLES['gpu'][1]} on GPUs, {ROUNDS_SAMPLES['cpu'][1]} on CPUs, "
                   f"{ROUNDS_SAMPLES['quick'][1]} with --quick)")
    p.add_argument("--tokens", type=int, nargs="+", help="only these token counts")
    p.add_argument("--hidden", type=int, nargs="+", help="only these hidden sizes")
    p.add_argument("--out", type=Path,
                   help="results file (.jsonl); refuses to overwrite (default: results/<bench>-<transport>-w<W>-<time>.jsonl)")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    for name in ("world", "rounds", "samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def select(configs, args) -> list[tuple]:
    """The configurations that pass --tokens/--hidden: tuples that start with
    (tokens, hidden), kept whole (bench_ep's carry a capacity too)."""
    return [c for c in configs
            if (args.tokens is None or c[0] in args.tokens) and (args.hidden is None or c[1] in args.hidden)]


class _PlainProgress:
    """Stand-in for tqdm where it is not installed: one line per step."""

    def __init__(self, total: int, desc: str):
        self.n, self.total, self.desc, self.postfix = 0, total, desc, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{self.desc}: {self.n}/{self.total} {self.postfix}", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        print(text, flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        pass


def progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="config", dynamic_ncols=True)


def _git_commit() -> str | None:
    """The commit of the rdna4_comm checkout, where it is one, with "+changes"
    where its tracked files differ from that commit (read-only git calls): a
    copied working tree can carry an older commit's history."""
    import rdna4_comm

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(rdna4_comm.__file__).parent, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def results_path(name: str, out: Path | None, transport: str, world: int) -> Path | None:
    """The results file: ``out``, or results/<name>-<transport>-w<world>-<time>.jsonl;
    None, with the reason on stderr, when it exists already (never overwritten)."""
    out = out or Path("results") / f"{name}-{transport}-w{world}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    if out.exists():
        print(f"{name}: {out} exists; refusing to overwrite it (choose another --out)", file=sys.stderr)
        return None
    return out


def header(name: str, info: dict, **fields) -> dict:
    """The results file's first line: ``info`` (rdna4_comm._bench.world.describe),
    ``fields``, the time, the git commit and the command line."""
    return {"type": "header", "benchmark": name, **info, **fields,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": _git_commit(),
            "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))}


def _worker(ctx, bench_worker, configs, rounds, samples) -> None:
    ctx.emit({"info": describe(ctx)})
    bench_worker(ctx, configs, rounds, samples)


def main(name: str, description: str, full, quick, bench_worker, argv=None) -> int:
    """A benchmark's command line: the configurations ``full`` (or ``quick``)
    that pass --tokens/--hidden, run by ``bench_worker``; see :func:`run`."""
    args = parse_args(description, argv)
    return run(name, args, select(quick if args.quick else full, args), bench_worker)


def run(name: str, args: argparse.Namespace, configs: list[tuple], bench_worker) -> int:
    """Run ``bench_worker(ctx, configs, rounds, samples)`` in a world chosen by
    ``args`` and record what it emits: rank 0 emits one record per
    configuration (see rdna4_comm._bench.cases.record) and notes. Returns the exit
    status: 0, or 1 if the world failed (a check included)."""
    if not configs:
        print(f"{name}: no configuration left after --tokens/--hidden", file=sys.stderr)
        return 2
    try:
        transport, world = resolve_world(args.transport, args.world)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    default_rounds, default_samples = ROUNDS_SAMPLES["quick" if args.quick else transport]
    rounds, samples = args.rounds or default_rounds, args.samples or default_samples
    out = results_path(name, args.out, transport, world)
    if out is None:
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{name}: {len(configs)} configurations, {world} {transport.upper()} processes, "
          f"{rounds} rounds x {samples} samples -> {out}", flush=True)

    records: list[dict] = []
    with open(out, "x") as f:  # "x": never overwrite, even if the file appeared meanwhile
        bar = progress(len(configs), name)

        def write(obj: dict) -> None:
            f.write(json.dumps(obj) + "\n")
            f.flush()  # a long sweep that dies keeps what it measured

        def on_message(msg: dict) -> None:
            if "info" in msg:
                write(header(name, msg["info"], rounds=rounds, samples=samples,
                             ratio="p50 of the backend / p50 of rdna4_comm (> 1: rdna4_comm is faster)"))
            elif "note" in msg:
                bar.write(f"note: {msg['note']}")
                write({"type": "note", "text": msg["note"]})
            else:
                records.append(msg)
                for row in _rows(msg):
                    write(row)
                bar.set_postfix_str(f"tokens {msg['tokens']}, hidden {msg['hidden']}")
                bar.update(1)

        try:
            launch(_worker, (bench_worker, configs, rounds, samples),
                           transport=transport, world=world, on_message=on_message)
            failure = None
        except WorldFailed as e:
            failure = e
        finally:
            bar.close()
    if failure is not None:
        print(f"{name}: FAILED (results so far are in {out}): {failure}", file=sys.stderr)
        return 1
    print(summary(records))
    save_heatmap(records, out.with_suffix(".png"), f"{name}: rdna4_comm speedup, {world} {transport.upper()} processes")
    return 0


def _rows(rec: dict) -> list[dict]:
    """The result lines of one configuration record."""
    shape = {k: rec[k] for k in ("op", "tokens", "hidden", "cap", "dtype", "bytes") if k in rec}
    return [{"type": "result", **shape, "backend": b, "detail": rec["details"][b], **asdict(s),
             "ratio": speedup(rec["stats"], b)}
            for b, s in rec["stats"].items()]
