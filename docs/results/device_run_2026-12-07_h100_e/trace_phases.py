"""Phase medians of a trace_decode.py run with trace_t4096.patch (its
output gzipped as 2_trace.txt.gz): per traced op and kernel, each phase's
cycles from the block's start, median, spread and deciles over the blocks
of the 3 traced calls (-1, a phase the block does not reach, left out).
The printf lines of a kernel's blocks interleave, so a value cannot be
tied to its block; each kernel's lines are contiguous."""
import gzip
import re
import statistics
import sys

CLOCK_GHZ = 1.98  # the H100's clock64 rate under load, an assumption: cycles are exact, us approximate


def main(path):
    sec, kern, data = None, None, {}
    for line in gzip.open(path, "rt"):
        m = re.match(r"=== (\S+): 3 traced", line)
        if m or line.startswith("=== end"):
            sec = m.group(1) if m else None  # warm-up calls print too: only the traced ones count
            continue
        if sec is None:
            continue
        k = re.match(r"TR (\w+) blk", line)
        if k:
            kern = k.group(1)
        for mm in re.finditer(r"(p\d+|end) (-?\d+)", line):
            data.setdefault((sec, kern), {}).setdefault(mm.group(1), []).append(int(mm.group(2)))
    order = lambda kv: (kv[0] == "end", int(kv[0][1:]) if kv[0] != "end" else 0)  # noqa: E731
    for (sec, kern), phases in data.items():
        print(f"{sec} {kern}")
        for p, vals in sorted(phases.items(), key=order):
            v = sorted(x for x in vals if x >= 0)
            if not v:
                continue
            dec = [v[int(q * (len(v) - 1))] / CLOCK_GHZ / 1000 for q in (0.1, 0.5, 0.9)]
            print(f"  {p:4s} blocks {len(v):3d}  median {statistics.median(v):6.0f} cycles ({dec[1]:5.1f} us)"
                  f"  min {v[0]:6d} max {v[-1]:6d}  p10-p90 {dec[0]:5.1f}-{dec[2]:5.1f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "2_trace.txt.gz")
