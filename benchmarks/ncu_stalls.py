#!/usr/bin/env python3
"""Where the warps of a kernel stall, phase by phase: a reader of Nsight
Compute's SASS-level source page (warp stall sampling), a diagnostic beside
bench_kernels.py.

A kernel's instructions are cut at every block barrier (BAR.*, B2R) and
exit, in code order; each piece prints its warp-stall samples, the
instructions its warps executed, and its top stall reasons. With every warp
of a block sampled alike, a piece's share of the samples is its share of
the block's time, and the samples of a barrier are the time its warps wait
for the slowest one. Then the instructions with the most samples.

Profile (one call of each of bench_kernels' ops, caches left warm as in its
timed loop), export the source page, read it:

    ncu --profile-from-start off --cache-control none --import-source no \\
        --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 \\
        -k regex:"dispatch_kernel|combine_kernel" -o stalls \\
        python3 benchmarks/bench_kernels.py --ncu-child
    ncu -i stalls.ncu-rep --page source --csv --print-source sass | gzip > stalls.csv.gz
    python3 benchmarks/ncu_stalls.py stalls.csv.gz
"""
from __future__ import annotations

import argparse
import csv
import gzip
from collections import Counter
from pathlib import Path


def read_kernels(path: Path) -> list[tuple[str, list[dict]]]:
    """(kernel name, its instructions as dicts of the page's columns), in the file's order."""
    opener = gzip.open if path.suffix == ".gz" else open
    kernels: list[tuple[str, list[dict]]] = []
    header: list[str] = []
    with opener(path, "rt") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                kernels.append((row[1], []))
            elif row and row[0] == "Address":
                header = row
            elif row and kernels:
                kernels[-1][1].append(dict(zip(header, row)))
    return kernels


def count(ins: dict, key: str) -> int:
    value = ins.get(key, "") or "0"
    return int(value) if value.isdigit() else 0


def stalls(ins: dict) -> Counter:
    """The instruction's samples by stall reason (all samples, issued or not)."""
    return Counter({k[len("stall_"):]: count(ins, k) for k in ins
                    if k.startswith("stall_") and "Not Issued" not in k and count(ins, k)})


def report(name: str, instructions: list[dict], top: int) -> None:
    total = sum(count(i, "# Samples") for i in instructions)
    print(f"{name[:150]}\n  samples {total}, warp instructions executed "
          f"{sum(count(i, 'Instructions Executed') for i in instructions)}")
    if not total:
        return
    print("  " + ", ".join(f"{k} {v}" for k, v in (sum((stalls(i) for i in instructions), Counter())).most_common()))
    print(f"  {'instructions':>13} {'samples':>8} {'share':>6} {'executed':>9}  ends at / top stalls")
    start, piece, executed, reasons = 0, 0, 0, Counter()
    for n, ins in enumerate(instructions):
        piece += count(ins, "# Samples")
        executed += count(ins, "Instructions Executed")
        reasons += stalls(ins)
        src = ins.get("Source", "").strip()
        ends = count(ins, "Instructions Executed") and any(s in src for s in ("BAR.", "B2R", "EXIT"))
        if ends or n == len(instructions) - 1:
            if piece:
                top3 = ", ".join(f"{k} {v}" for k, v in reasons.most_common(3))
                print(f"  {start:>6}-{n:<6} {piece:>8} {piece / total:>6.1%} {executed:>9}  {src[:34]:34s} {top3}")
            start, piece, executed, reasons = n + 1, 0, 0, Counter()
    print(f"  the {top} instructions with the most samples:")
    for n in sorted(sorted(range(len(instructions)), key=lambda n: -count(instructions[n], "# Samples"))[:top]):
        ins = instructions[n]
        top3 = ", ".join(f"{k} {v}" for k, v in stalls(ins).most_common(3))
        print(f"  {n:>6} {count(ins, '# Samples'):>8} {ins.get('Source', '').strip()[:60]:60s} {top3}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source_page", type=Path, help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=12, help="instructions listed per kernel (default 12)")
    args = p.parse_args(argv)
    for name, instructions in read_kernels(args.source_page):
        report(name, instructions, args.top)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
