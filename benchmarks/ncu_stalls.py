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

Where few warps work and the rest wait at a barrier, the barrier's samples
say only that they waited; the working warps' own samples say on what.
``--lines SASS`` adds, per kernel, the samples outside barrier waits by
source line: SASS is ``nvdisasm -g -c`` of a cubin holding the kernel,
built with the extension's flags (``-lineinfo``) by the nvcc the device
used, on any machine, e.g.

    nvcc -std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -DRDNA4_COMM_WITH_GPU=1 \
        -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
        -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
        -gencode=arch=compute_90,code=sm_90 -cubin -I csrc csrc/gpu/dispatch.cu -o d.cubin
    nvdisasm -g -c d.cubin > d.sass
    python3 benchmarks/ncu_stalls.py stalls.csv.gz --lines d.sass

A kernel is matched to its SASS by its instructions' opcodes; one the SASS
does not hold (another compiler, other flags) is said to be missing. Each
line's text is read from the file the SASS names, as it is when this runs.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import re
from collections import Counter
from pathlib import Path
from typing import Optional


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


def reasons_text(reasons: Counter, most: Optional[int] = None) -> str:
    """The `most` largest stall reasons (all by default), "reason count, ..."."""
    return ", ".join(f"{k} {v}" for k, v in reasons.most_common(most))


def report(name: str, instructions: list[dict], top: int) -> None:
    total = sum(count(i, "# Samples") for i in instructions)
    ran = sum(1 for i in instructions if count(i, "Instructions Executed"))
    print(f"{name[:150]}\n  samples {total}, warp instructions executed "
          f"{sum(count(i, 'Instructions Executed') for i in instructions)}, "
          f"instructions run at least once {ran} of {len(instructions)}")
    if not total:
        return
    print("  " + reasons_text(sum((stalls(i) for i in instructions), Counter())))
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
                print(f"  {start:>6}-{n:<6} {piece:>8} {piece / total:>6.1%} {executed:>9}  {src[:34]:34s} "
                      f"{reasons_text(reasons, 3)}")
            start, piece, executed, reasons = n + 1, 0, 0, Counter()
    print(f"  the {top} instructions with the most samples:")
    for n in sorted(sorted(range(len(instructions)), key=lambda n: -count(instructions[n], "# Samples"))[:top]):
        ins = instructions[n]
        print(f"  {n:>6} {count(ins, '# Samples'):>8} {ins.get('Source', '').strip()[:60]:60s} "
              f"{reasons_text(stalls(ins), 3)}")


def opcode(text: str) -> str:
    """An instruction's opcode, without its predicate."""
    words = text.replace(";", " ").split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words[0] if words else ""


def read_sass_lines(path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Per function of ``nvdisasm -g -c`` output, by its mangled name: its
    instructions' opcodes and each one's source ("file:line", "?" before
    the first)."""
    functions: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    where = "?"
    for text in path.read_text().splitlines():
        if m := re.match(r"^\.text\.(\S+):$", text):
            current = functions.setdefault(m.group(1), ([], []))
            where = "?"
        elif m := re.search(r'//## File "([^"]+)", line (\d+)', text):
            where = f"{m.group(1)}:{m.group(2)}"
        elif current is not None and (m := re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*)$", text)):
            current[0].append(opcode(m.group(1)))
            current[1].append(where)
    return functions


def source_text(where: str) -> str:
    path, _, line = where.rpartition(":")
    try:
        return Path(path).read_text().splitlines()[int(line) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""


def report_lines(instructions: list[dict], functions: dict[str, tuple[list[str], list[str]]], top: int) -> None:
    """The kernel's samples outside barrier waits, by source line."""
    ops = [opcode(i.get("Source", "")) for i in instructions]
    lines: Optional[list[str]] = next((w for o, w in functions.values() if o == ops), None)
    if lines is None:
        print("  by source line: the SASS given does not hold this kernel")
        return
    by_line: dict[str, Counter] = {}
    for ins, where in zip(instructions, lines):
        reasons = stalls(ins)
        del reasons["barrier"]
        by_line.setdefault(where, Counter()).update(reasons)
    total = sum(by_line.values(), Counter())
    n = sum(total.values())
    print(f"  outside barrier waits: samples {n}" + "".join(f", {k} {v}" for k, v in total.most_common()))
    if not n:
        return
    print(f"  the {top} source lines with the most of them:")
    busy = [(where, c) for where, c in by_line.items() if sum(c.values())]
    for where, c in sorted(busy, key=lambda kv: -sum(kv[1].values()))[:top]:
        k = sum(c.values())
        short = "/".join(where.split("/")[-2:])
        print(f"  {k:>8} {k / n:>6.1%}  {short:34s} {source_text(where)[:60]:60s} {reasons_text(c, 3)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source_page", type=Path, help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=12, help="instructions (and lines) listed per kernel (default 12)")
    p.add_argument("--lines", type=Path, help="nvdisasm -g -c output of the kernels' cubin: adds the samples "
                                              "outside barrier waits by source line")
    args = p.parse_args(argv)
    functions = read_sass_lines(args.lines) if args.lines else None
    for name, instructions in read_kernels(args.source_page):
        report(name, instructions, args.top)
        if functions is not None:
            report_lines(instructions, functions, args.top)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
