"""Nsight Compute (ncu) for benchmarks/bench_kernels.py: finding it
(:func:`find_ncu`), profiling a child process under it (:func:`run_ncu`,
:func:`ncu_command`), and reading its CSV report back (:func:`parse_ncu_csv`)
into per-kernel and per-op figures matched with the kernels torch.profiler saw
(:func:`match_ncu`, :func:`kernel_metrics`, :func:`aggregate`).

The figures: DRAM throughput (% of peak, GB/s = dram__bytes / duration),
instructions executed, instructions per DRAM byte (smsp__inst_executed.sum
/ dram__bytes.sum) and per warp (/ smsp__warps_launched.sum: what each warp
of a small batch's kernel runs before and around its few bytes), of the
kernels whose names match NCU_KERNEL_REGEX.
"""
from __future__ import annotations

import csv
import math
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from rdna4_comm._timing import format_table

NCU_METRICS = ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes.sum",
               "smsp__inst_executed.sum", "gpu__time_duration.sum", "smsp__warps_launched.sum")
# The kernels profiled (demangled names): rdna4_comm's dispatch, combine and
# expert-layout kernels and the baselines' copy, elementwise and reduction
# kernels.
NCU_KERNEL_REGEX = "dispatch|combine|expert|copy|elementwise|reduce"
NCU_TIMEOUT_S = 1200


def find_ncu() -> Optional[str]:
    """The ncu executable: on PATH, in $CUDA_HOME/bin, or /usr/local/cuda*/bin."""
    found = shutil.which("ncu")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             *sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)]
    for root in roots:
        if root and os.access(Path(root) / "bin" / "ncu", os.X_OK):
            return str(Path(root) / "bin" / "ncu")
    return None


def function_base(name: str) -> str:
    """A kernel's function name without return type, namespaces, template
    arguments and parameters: "void at::native::vectorized_elementwise_kernel<4,
    ...>(int, ...)" -> "vectorized_elementwise_kernel"."""
    s = name.replace("(anonymous namespace)", "anon").strip()
    if s.startswith("void "):
        s = s[5:]
    depth, end = 0, len(s)
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
    plain, depth = [], 0
    for ch in s[:end]:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            plain.append(ch)
    return "".join(plain).split("::")[-1].strip()


# Scale of ncu's units to bytes, nanoseconds and plain counts.
_NCU_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6, "GB": 1e9,
              "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "ns": 1, "us": 1e3, "ms": 1e6,
              "inst": 1, "Kinst": 1e3, "Minst": 1e6, "Ginst": 1e9, "%": 1, "": 1}


def _ncu_number(value: str, unit: str = "") -> float:
    v = value.strip().replace(",", "")
    if not v or v.lower() in ("n/a", "nan"):
        return math.nan
    return float(v) * _NCU_UNITS.get(unit.strip(), 1)


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's CSV (``--csv --page raw``: a header, a units line, a line per
    kernel; or the long form with "Metric Name"/"Metric Unit"/"Metric Value"
    columns) as one dict per kernel in ID order: "id", "name" and every
    metric of NCU_METRICS in bytes, nanoseconds, instructions or %."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if start is None:
        raise ValueError("no CSV header with \"Kernel Name\" in ncu's output")
    table = [r for r in csv.reader(lines[start:]) if r]
    header, rows = table[0], [r for r in table[1:] if len(r) == len(table[0])]
    col = {name: i for i, name in enumerate(header)}
    kernels: dict[int, dict] = {}
    if "Metric Name" in col:
        for r in rows:
            if not r[col["ID"]].strip().isdigit():
                continue
            k = kernels.setdefault(int(r[col["ID"]]), {"id": int(r[col["ID"]]), "name": r[col["Kernel Name"]]})
            metric = r[col["Metric Name"]]
            if metric in NCU_METRICS:
                unit = r[col["Metric Unit"]] if "Metric Unit" in col else ""
                k[metric] = _ncu_number(r[col["Metric Value"]], unit)
    else:
        units = next((r for r in rows if not r[col["ID"]].strip()), None)
        for r in rows:
            if not r[col["ID"]].strip().isdigit():
                continue
            k = {"id": int(r[col["ID"]]), "name": r[col["Kernel Name"]]}
            for metric in NCU_METRICS:
                if metric in col:
                    k[metric] = _ncu_number(r[col[metric]], units[col[metric]] if units else "")
            kernels[k["id"]] = k
    missing = [m for m in NCU_METRICS if kernels and not any(m in k for k in kernels.values())]
    if missing:
        raise ValueError(f"ncu's CSV lacks the metrics {missing}")
    return [kernels[i] for i in sorted(kernels)]


def kernel_metrics(k: dict) -> dict:
    """One ncu kernel's figures: time_us, dram_pct, dram_bytes, dram_gbs, inst,
    inst_per_byte, warps, inst_per_warp.

    ``k`` is a kernel of :func:`parse_ncu_csv`; the result also has "kernel"
    (:func:`function_base` of its name) and "name". Units: us, % of peak,
    bytes, GB/s, instructions, instructions per DRAM byte (NaN without
    bytes), warps launched, instructions per warp (NaN without warps)."""
    ns, nbytes, inst, warps = k[NCU_METRICS[3]], k[NCU_METRICS[1]], k[NCU_METRICS[2]], k[NCU_METRICS[4]]
    return {"kernel": function_base(k["name"]), "name": k["name"], "time_us": ns / 1e3,
            "dram_pct": k[NCU_METRICS[0]], "dram_bytes": nbytes,
            "dram_gbs": nbytes / ns if ns > 0 else math.nan, "inst": inst,
            "inst_per_byte": inst / nbytes if nbytes > 0 else math.nan, "warps": warps,
            "inst_per_warp": inst / warps if warps > 0 else math.nan}


def aggregate(kernels: list[dict]) -> dict:
    """An op's kernels together: summed time, bytes and instructions; DRAM % of
    peak weighted by time; GB/s and instructions per byte of the sums."""
    if not kernels:
        return {"kernels": 0}
    t = sum(k["time_us"] for k in kernels)
    nbytes = sum(k["dram_bytes"] for k in kernels)
    inst = sum(k["inst"] for k in kernels)
    pct = sum(k["dram_pct"] * k["time_us"] for k in kernels) / t if t > 0 else math.nan
    return {"kernels": len(kernels), "time_us": t, "dram_pct": pct, "dram_bytes": nbytes,
            "dram_gbs": nbytes / (t * 1e3) if t > 0 else math.nan, "inst": inst,
            "inst_per_byte": inst / nbytes if nbytes > 0 else math.nan}


def match_ncu(kernels: list[dict], expected: dict[str, list[str]], order) -> dict[str, list[dict]]:
    """ncu's kernels (ID order) split into the ops of ``order`` by the kernel
    names torch.profiler saw each op launch (``expected``, the ones that match
    NCU_KERNEL_REGEX). Raises ValueError where count or names disagree."""
    pattern_ = re.compile(NCU_KERNEL_REGEX)
    wanted = {k: [n for n in expected[k] if pattern_.search(n)] for k in order}
    total = sum(len(v) for v in wanted.values())
    if len(kernels) != total:
        raise ValueError(f"ncu profiled {len(kernels)} kernels, torch.profiler saw {total} matching "
                         f"{NCU_KERNEL_REGEX!r} in the ops {list(order)}")
    out, i = {}, 0
    for key in order:
        out[key] = []
        for name in wanted[key]:
            got = kernels[i]
            if function_base(got["name"]) != function_base(name):
                raise ValueError(f"kernel {i}: ncu has {got['name']!r}, torch.profiler saw {name!r} ({key})")
            out[key].append(kernel_metrics(got))
            i += 1
    return out


def ncu_command(ncu: str, report: Path, child: list[str], launch_cap: int) -> list[str]:
    """The command line that profiles ``child`` (a command line) under ncu:
    kernels matching NCU_KERNEL_REGEX, from cudaProfilerStart on, at most
    ``launch_cap`` of them, NCU_METRICS, exported to ``report`` (.ncu-rep)."""
    return [ncu, "--target-processes", "all", "--profile-from-start", "off",
            "--kernel-name-base", "demangled", "--kernel-name", f"regex:{NCU_KERNEL_REGEX}",
            "--launch-count", str(launch_cap), "--metrics", ",".join(NCU_METRICS),
            "--export", str(report), "--force-overwrite", *child]


def run_ncu(ncu: str, child: list[str], expected: dict[str, list[str]], order,
            tmp_prefix: str = "ncu_") -> tuple[Optional[dict], str]:
    """Run ``child`` (a command line that launches the ops of ``order``, each
    inside cudaProfilerStart/Stop, in that order) under ncu and read its report
    back against ``expected`` (see :func:`match_ncu`): ({op: [kernel figures
    of :func:`kernel_metrics`]}, "") or (None, why not). The report lives in
    a temporary directory named with ``tmp_prefix``."""
    launch_cap = sum(len(v) for v in expected.values()) + 16
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        base = Path(tmp) / "kernels"  # ncu adds .ncu-rep
        cmd = ncu_command(ncu, base, child, launch_cap)
        print("ncu: " + shlex.join(cmd), flush=True)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=NCU_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"ncu did not finish: {type(e).__name__}: {e}"
        report = next((f for f in (base.with_suffix(".ncu-rep"), base) if f.exists()), None)
        if r.returncode != 0 or report is None:
            tail = (r.stdout + r.stderr)[-3000:]
            return None, f"ncu exited with {r.returncode}{'' if report else ' and wrote no report'}:\n{tail}"
        try:
            imp = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"],
                                 capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"ncu --import did not finish: {type(e).__name__}: {e}"
        if imp.returncode != 0:
            return None, f"ncu --import exited with {imp.returncode}:\n{(imp.stdout + imp.stderr)[-3000:]}"
    try:
        kernels = parse_ncu_csv(imp.stdout)
        return match_ncu(kernels, expected, order), ""
    except ValueError as e:
        return None, f"ncu's report could not be read against the ops: {e}"


def ncu_version(ncu: str) -> str:
    """ncu's version line (the last line of ``ncu --version``), or "unknown"."""
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
        return out.splitlines()[-1] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def ncu_table(ncu: dict, ops) -> str:
    """A line per kernel of each op of ``ops`` (op -> its kernels' ncu columns, as run_ncu gives them)."""
    header = ["op", "kernel", "ncu us", "DRAM %", "DRAM GB/s", "DRAM MB", "inst", "inst/B", "inst/warp"]
    rows = []
    for key in ops:
        for k in ncu.get(key, []):
            rows.append([key, k["kernel"], k["time_us"], k["dram_pct"], k["dram_gbs"], k["dram_bytes"] / 1e6,
                         k["inst"], k["inst_per_byte"], k["inst_per_warp"]])
        if not ncu.get(key):
            rows.append([key, "(no kernel: memcpy, not profiled by ncu)" if key == "copy" else "(none)",
                         *[math.nan] * 7])
    return format_table(header, rows)
