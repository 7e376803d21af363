"""What this box can do for rdna4_comm: ``python -m rdna4_comm.doctor``
(or ``rdna4-comm-doctor``).

Reports the GPUs and software, the peer-access matrix and link types, a
functional check of every GPU pair through the library's own GPU transport
(its init probe, then a 64 MiB all_reduce checked bitwise, timed for
bandwidth, and a tiny one timed for latency), what Linux says about the
things that break peer-to-peer (IOMMU, ACS, BAR sizes, amdgpu parameters,
P2PDMA), each with its usual fix, and the transport ``transport="auto"``
chooses across all GPUs. Without GPUs it checks the CPU transport between 2
processes instead. docs/doctor.md explains every part of the report.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from . import _C
from ._checks import allreduce_case
from ._host_findings import (inventory_gpus, link_types, mib, peer_access_matrix, peer_findings, platform_report,
                             run_tool, software)
from ._launch import Member, ProcessWorld, WorldFailed
from ._ranks import CheckFailed, RankContext, usable_gpus
from ._timing import Op, format_table, measure
from .communicator import Communicator
from .transport_policy import TRANSPORT_RECORDS, shared_gpus_allowed

EXIT_LIBRARY_RUNS, EXIT_LIBRARY_CANNOT_RUN, EXIT_DOCTOR_FAILED = 0, 1, 2
# The rule of the exit status (why_library_cannot_run computes it), for --help.
EXIT_STATUS_HELP = """\
exit status: whether rdna4_comm can run on this box, on the transport that
transport="auto" picks here (or that RDNA4_COMM_TRANSPORT forces, where set):
  0  it can: that Communicator was built over the doctor's processes, an
     all_reduce through it was bitwise equal to the reference, and, if it is
     "gpu", every GPU pair passed its checks. Falling back to "cpu" (no GPUs)
     or "dist" (GPU peer-to-peer unusable, the report says why) is 0 too: the
     library runs there, on "dist" slower.
  1  it cannot: that Communicator could not be built (e.g. a forced transport
     that cannot work), its all_reduce failed, it is "gpu" although a GPU pair
     failed, or torch sees GPUs but the extension was built without GPU
     support; also when the extension cannot load (Python's ImportError,
     before any report).
  2  the doctor itself could not run (bad arguments, or an error of its own).
To require GPU peer-to-peer, run the doctor with RDNA4_COMM_TRANSPORT=gpu.
"""
# The verdict's words for each transport the library can run on.
TRANSPORT_MEANINGS = {
    "gpu": "GPU peer-to-peer, every GPU pair passed its checks",
    "cpu": "shared memory between the processes of this host",
    "dist": "torch.distributed collectives, slower than GPU peer-to-peer: see the reason above",
}
# The pair check's large all_reduce: realistic for a prefill-sized tensor and
# larger than the GPU buffer (16 MiB per slot), so it runs in chunks.
DEFAULT_SIZE_MIB = 64
ALLREDUCE_COLS = 1024  # the checked tensors are [rows, 1024] fp32
# Short, so that a pair whose peer writes never arrive fails in seconds.
DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_SAMPLES = 20
TIMING_ROUNDS = 2
# A whole pair world: spawn, CUDA init, probe, checks and timing. Past it the
# world is killed and the pair reported as hung.
PAIR_TIMEOUT_S = 180.0
VERDICT_TIMEOUT_S = 180.0
# ------------------------------------------------------------- rank processes


def doctor_rank(member: Member, devices: Optional[Sequence[int]]) -> RankContext:
    """A rank of the doctor's worlds: gloo process groups only (the doctor
    compares nothing against NCCL, and NCCL refuses ranks that share a GPU),
    on GPU ``devices[rank]``, or on the CPU when ``devices`` is None."""
    if devices is None:
        return RankContext(member.rank, member.world, "cpu", torch.device("cpu"), member.init_method, member=member)
    return RankContext(member.rank, member.world, "gpu", torch.device("cuda", devices[member.rank]),
                       member.init_method, member=member)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def check_pair(ctx: RankContext, rows: int, samples: int, timeout_ms: int) -> dict:
    """On both ranks of a pair world: a gpu-transport Communicator (its
    construction probes the peer mapping both ways), then a [rows, 1024] fp32
    all_reduce checked bitwise and timed, and a one-element one timed."""
    try:
        comm = Communicator(ctx.cpu_group, transport="gpu", timeout_ms=timeout_ms)
    except Exception as e:  # noqa: BLE001  (a failed probe raises on every rank alike)
        return {"ok": False, "stage": "probe", "error": error_text(e)}
    with comm:
        def timed(tokens: int, hidden: int):
            x, check = allreduce_case(ctx.rank, 2, tokens, hidden, ctx.device)
            op = Op("rdna4_comm", lambda: comm.all_reduce(x), check)
            return measure(ctx, [op], rounds=TIMING_ROUNDS, samples=samples)["rdna4_comm"]

        try:
            large, tiny = timed(rows, ALLREDUCE_COLS), timed(1, 1)
            comm.check()
        except CheckFailed as e:  # raised on every rank alike
            return {"ok": False, "stage": "all_reduce", "error": str(e)}
    nbytes = rows * ALLREDUCE_COLS * 4
    # A 2-rank all_reduce moves the whole tensor once each way (half in its
    # reduce-scatter, half in its all-gather), both directions at once.
    return {"ok": True, "stage": None, "error": None, "all_reduce_bytes": nbytes,
            "bandwidth_gbps": nbytes / (large.p50_us * 1e-6) / 1e9, "all_reduce_p50_us": large.p50_us,
            "latency_us": tiny.p50_us, "samples": large.samples}


def auto_transport(ctx: RankContext, timeout_ms: int) -> dict:
    """On every rank: Communicator(transport="auto"), what it chose and why,
    and a small all_reduce through it checked bitwise."""
    try:
        comm = Communicator(ctx.cpu_group, transport="auto", timeout_ms=timeout_ms)
    except Exception as e:  # noqa: BLE001  (a failed probe raises on every rank alike)
        return {"transport": None, "reason": None, "all_reduce": None, "error": error_text(e)}
    with comm:
        x, check = allreduce_case(ctx.rank, ctx.world, 64, ALLREDUCE_COLS, comm.device)
        error = None
        try:
            check(comm.all_reduce(x))
            comm.check()
        except Exception as e:  # noqa: BLE001  (agreed on by all ranks below)
            error = error_text(e)
        bad = ctx.errors(error)
        return {"transport": comm.transport, "reason": getattr(comm, "transport_reason", None),
                "all_reduce": "FAILED" if bad else f"[64, {ALLREDUCE_COLS}] fp32 over {ctx.world} ranks bitwise "
                "equal to rdna4_comm.reference.all_reduce", "error": "; ".join(bad) or None}


def run_world(devices: Optional[Sequence[int]], size: int, task: Callable, args: tuple, timeout: float) -> dict:
    """Rank 0's result of ``task`` on a new world of ``size`` RankContexts;
    a world that fails (a rank raised outside the task's own checks, died
    or hung) gives ``{"error": ...}``. Stdout stays the report's alone."""
    try:
        with ProcessWorld(size, doctor_rank, (devices,)) as world:
            return world.call(task, {r: args for r in range(size)}, timeout=timeout,
                              on_message=lambda m: print(m, file=sys.stderr))[0]
    except WorldFailed as e:
        return {"error": str(e)}


def progress(items: list, desc: str) -> Iterable:
    """``items`` with a progress bar on stderr (tqdm, or a line per item)."""
    try:
        from tqdm import tqdm
    except ImportError:
        def lines():
            for n, item in enumerate(items):
                print(f"{desc} {n + 1}/{len(items)}: {item}", file=sys.stderr, flush=True)
                yield item
        return lines()
    return tqdm(items, desc=desc, file=sys.stderr)


def check_pairs(devices: list[int], rows: int, samples: int, timeout_ms: int) -> list[dict]:
    """Every pair of the world's ranks, each in a 2-process world of its own,
    so that a pair that crashes or hangs takes nothing else down."""
    pairs = [(a, b) for a in range(len(devices)) for b in range(a + 1, len(devices))]
    out = []
    for a, b in progress(pairs, "GPU pairs"):
        result = run_world([devices[a], devices[b]], 2, check_pair, (rows, samples, timeout_ms), PAIR_TIMEOUT_S)
        result.setdefault("ok", False)
        result.setdefault("stage", "world")  # the world itself failed: a rank died, hung or raised elsewhere
        out.append({"ranks": [a, b], "gpus": [devices[a], devices[b]], **result})
    return out


# ------------------------------------------------------------- the report


def gpu_world(requested: Optional[int]) -> Optional[list[int]]:
    """The GPU of each rank of the doctor's GPU world, or None for the CPU path:
    one rank per usable GPU when there are 2 or more; ``requested`` ranks,
    shared round-robin, where RDNA4_COMM_ALLOW_SHARED_GPU=1 allows it."""
    gpus = usable_gpus()
    shared = shared_gpus_allowed()
    size = requested if requested is not None else (gpus if gpus >= 2 else 2 if shared else 0)
    if gpus == 0 or size < 2 or (gpus < 2 and not shared):
        return None
    if size > gpus and not shared:
        raise ValueError(f"--world {size}: {gpus} usable GPU(s); set RDNA4_COMM_ALLOW_SHARED_GPU=1 to let ranks share")
    return [r % gpus for r in range(size)]


def pairs_skipped_reason(gpus: int) -> str:
    """Why the doctor checks no GPU pair here."""
    if gpus == 0:
        return "torch sees no GPU"
    if not _C.with_gpu:
        return "rdna4_comm was built without GPU support (see README, 'Building for GPUs')"
    return ("one GPU: set RDNA4_COMM_ALLOW_SHARED_GPU=1 and pass --world 2 to check the transport with 2 ranks "
            "sharing it (correctness only; its speed says nothing about peer links)")


def why_library_cannot_run(report: dict) -> Optional[str]:
    """Why rdna4_comm cannot run on this box, from the report's verdict and
    pairs; None when it can (EXIT_STATUS_HELP states the rule). Failed pairs
    count against "gpu" alone: the library would run over those links, while
    "cpu" and "dist" use none, and failed pairs are why "auto" falls back."""
    verdict, software = report["verdict"], report["software"]
    if software["gpus_visible_to_torch"] and not software["extension_gpu_support"]:
        return ("torch sees GPUs but rdna4_comm was built without GPU support, so it cannot take GPU tensors "
                "(see README, 'Building for GPUs')")
    if verdict.get("transport") is None:
        return "no Communicator could be built over the doctor's processes (the error above)"
    if verdict.get("error"):
        return f"the all_reduce through transport '{verdict['transport']}' failed (the error above)"
    failed = [p for p in report["pairs"] if not p["ok"]]
    if TRANSPORT_RECORDS[verdict["transport"]].writes_cross_links and failed:
        return ("transport 'gpu' would run over GPU pairs that failed their checks: "
                + ", ".join(f"rank {p['ranks'][0]} <-> rank {p['ranks'][1]}" for p in failed))
    return None


def exit_code(report: dict) -> int:
    return EXIT_LIBRARY_RUNS if why_library_cannot_run(report) is None else EXIT_LIBRARY_CANNOT_RUN


def diagnose(world: Optional[int], size_mib: int, samples: int, timeout_ms: int,
             sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> dict:
    """The whole report as one dict (the ``--json`` output)."""
    gpus = inventory_gpus(sys_root)
    devices = gpu_world(world)
    peer = peer_access_matrix(len(gpus)) if gpus else []
    plat = platform_report(sys_root, proc_root, gpus, run_tool(["lspci", "-vvv"]))
    plat["findings"] += peer_findings(peer)
    rows = max(1, (size_mib << 20) // (4 * ALLREDUCE_COLS))
    pairs = check_pairs(devices, rows, samples, timeout_ms) if devices else []
    pairs_skipped = None if devices else pairs_skipped_reason(len(gpus))
    size = len(devices) if devices else (world or 2)
    print(f"transport='auto' over {size} {'GPU' if devices else 'CPU'} processes ...", file=sys.stderr, flush=True)
    verdict = {"transport": None, "reason": None, "all_reduce": None,
               **run_world(devices, size, auto_transport, (timeout_ms,), VERDICT_TIMEOUT_S)}
    verdict.update(world=size, ranks_on=("GPUs " + ",".join(map(str, devices))) if devices else "CPU")
    report = {"software": software(), "gpus": gpus, "peer_access": peer, "links": link_types() if gpus else
              {"tool": None, "matrix": None}, "pairs": pairs, "pairs_skipped": pairs_skipped, "platform": plat, "verdict": verdict}
    report["exit_code"] = exit_code(report)
    return report


def verdict_text(report: dict) -> list[str]:
    v = report["verdict"]
    lines = [f"  transport='auto' over {v['world']} processes on {v['ranks_on']}: "
             + (v["transport"] if v.get("transport") else "FAILED")]
    if v.get("reason"):
        lines.append(f"  reason: {v['reason']}")
    if v.get("all_reduce"):
        lines.append(f"  all_reduce through it: {v['all_reduce']}")
    if v.get("error"):
        lines.append(f"  error: {v['error']}")
    why_not = why_library_cannot_run(report)
    if why_not:
        lines.append(f"  => rdna4_comm cannot run here: {why_not} (exit {report['exit_code']})")
    else:
        lines.append(f"  => rdna4_comm runs here on transport '{v['transport']}' "
                     f"({TRANSPORT_MEANINGS[v['transport']]}) (exit {report['exit_code']})")
    return lines


def indented(table: str) -> list[str]:
    return ["  " + line.rstrip() for line in table.splitlines()]


def render(report: dict) -> str:
    """The report as text, section by section."""
    s = report["software"]
    out = ["rdna4_comm doctor", "", "== software",
           f"  rdna4_comm {s['rdna4_comm']}, torch {s['torch']}, CUDA {s['cuda'] or '-'}, ROCm/HIP {s['hip'] or '-'}, "
           f"Python {s['python']}",
           f"  extension GPU support (rdna4_comm._C.with_gpu): {'yes' if s['extension_gpu_support'] else 'no'}; "
           f"GPUs visible to torch: {s['gpus_visible_to_torch']}", "", f"== GPUs ({len(report['gpus'])})"]
    if report["gpus"]:
        rows = [[f"GPU{g['index']}", g["name"], g["architecture"], mib(g["memory_bytes"]), g["pci_bus_id"] or "?",
                 "?" if g["numa_node"] is None else str(g["numa_node"]),
                 ", ".join(f"BAR{b['bar']} {mib(b['bytes'])}" for b in g["bars"]) or "?"] for g in report["gpus"]]
        out += indented(format_table(["GPU", "name", "arch", "memory", "PCI bus id", "NUMA", "BARs"], rows))
    else:
        out.append("  none (the CPU transport is checked instead)")
    peer, links = report["peer_access"], report["links"]
    if peer:
        out += ["", "== peer access (torch.cuda.can_device_access_peer) / link type "
                f"({links['tool'] or 'unknown: neither nvidia-smi nor rocm-smi answered'})"]
        link = links["matrix"]
        cells = [[f"GPU{i}"] + ["-" if ok is None else ("yes" if ok else "NO") + "/" + (
            link[i][j] if link and i < len(link) and j < len(link) and link[i][j] else "unknown")
            for j, ok in enumerate(row)] for i, row in enumerate(peer)]
        out += indented(format_table([""] + [f"GPU{j}" for j in range(len(peer))], cells))
    out += ["", "== GPU pairs (2-rank gpu Communicator: init probe both ways, then a verified all_reduce)"]
    if report["pairs_skipped"]:
        out.append(f"  not checked: {report['pairs_skipped']}")
    for p in report["pairs"]:
        name = f"  rank {p['ranks'][0]} (GPU{p['gpus'][0]}) <-> rank {p['ranks'][1]} (GPU{p['gpus'][1]})"
        if p["ok"]:
            out.append(f"{name}: ok; {mib(p['all_reduce_bytes'])} all_reduce bitwise correct, "
                       f"{p['bandwidth_gbps']:.1f} GB/s per direction (both loaded), "
                       f"tiny all_reduce {p['latency_us']:.1f} us (p50 of {p['samples']})")
        else:
            out.append(f"{name}: FAILED ({p['stage']})")
            out += ["      " + line for line in p["error"].strip().splitlines()]
    out += ["", "== platform"]
    for f in report["platform"]["findings"]:
        out.append(f"  [{f['severity']}] {f['area']}: {f['what']}")
        if f["fix"]:
            out.append(f"      fix: {f['fix']}")
    out += ["", "== verdict"] + verdict_text(report)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rdna4_comm.doctor", description=__doc__, epilog=EXIT_STATUS_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--json-file", type=Path, metavar="PATH",
                   help="also write the JSON report to PATH (one run gives the text and the JSON)")
    p.add_argument("--world", type=int, help="processes (default: one per GPU, or 2 CPU processes; more ranks than "
                   "GPUs with RDNA4_COMM_ALLOW_SHARED_GPU=1)")
    p.add_argument("--size-mib", type=int, default=DEFAULT_SIZE_MIB,
                   help=f"the pair check's large all_reduce (default {DEFAULT_SIZE_MIB} MiB)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"timed calls per round, {TIMING_ROUNDS} rounds (default {DEFAULT_SAMPLES})")
    p.add_argument("--timeout-ms", type=int, default=DEFAULT_TIMEOUT_MS,
                   help=f"bound on every wait for a peer (default {DEFAULT_TIMEOUT_MS})")
    args = p.parse_args(argv)
    for name, least in (("world", 2), ("size_mib", 1), ("samples", 1), ("timeout_ms", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}")
    try:
        report = diagnose(args.world, args.size_mib, args.samples, args.timeout_ms)
    except Exception as e:  # noqa: BLE001  (the doctor could not run: say why, exit 2)
        if args.json:
            print(json.dumps({"error": error_text(e), "exit_code": EXIT_DOCTOR_FAILED}))
        print(f"doctor: {error_text(e)}", file=sys.stderr)
        return EXIT_DOCTOR_FAILED
    if args.json_file is not None:
        args.json_file.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1) if args.json else render(report), flush=True)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
