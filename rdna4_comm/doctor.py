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

Exit status: 0 when the GPU peer-to-peer path is usable, 1 when "auto" falls
back to another transport, 2 when a check failed in a way no transport covers
(or the doctor itself could not run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from . import _C, __version__
from ._bench.cases import allreduce_case, rdna4_allreduce_op
from ._bench.report import format_table
from ._bench.timing import measure
from ._bench.world import BenchRank, CheckFailed, usable_gpus
from ._launch import Member, ProcessWorld, WorldFailed
from .communicator import Communicator
from .transport_policy import shared_gpus_allowed

EXIT_P2P_USABLE, EXIT_FALLBACK, EXIT_ERROR = 0, 1, 2
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
TOOL_TIMEOUT_S = 30.0
# The BAR size that firmware without Resizable BAR / Above 4G decoding gives a GPU.
SMALL_BAR_BYTES = 256 << 20
# Resource flags (include/linux/ioport.h) in /sys/bus/pci/devices/<id>/resource.
IORESOURCE_MEM, IORESOURCE_PREFETCH, IORESOURCE_MEM_64 = 0x200, 0x2000, 0x100000
# ACS controls that send peer requests up to the root complex (and its IOMMU)
# instead of straight across the switch: with them on, peer writes take the
# long way or are dropped.
ACS_REDIRECTING = ("SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl")

FIX_IOMMU = ("add iommu=pt to the kernel command line (GRUB_CMDLINE_LINUX in /etc/default/grub, then "
             "update-grub or grub2-mkconfig, reboot); or turn the IOMMU off in the BIOS (AMD: IOMMU, Intel: VT-d)")
FIX_ACS = ("disable ACS in the BIOS (often 'ACS Enable' or 'PCIe ACS' under the chipset/PCIe settings); or at "
           "every boot clear it on each listed device: setpci -s <device> ECAP_ACS+0x6.w=0000 (as root); "
           "kernels carrying the ACS override patch also take pci=noacs / pcie_acs_override=downstream,multifunction")
FIX_BAR = ("enable 'Above 4G Decoding' and 'Resizable BAR' (Re-Size BAR Support) in the BIOS, and disable CSM, "
           "so the GPU's memory BAR covers all of its memory")
FIX_NUMA = ("keep communicating GPUs under one CPU socket / root complex (move the cards, or choose the GPUs with "
            "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES); P2P across sockets is often unsupported or slow")
FIX_AMDGPU_P2P = "add amdgpu.pcie_p2p=1 to the kernel command line (or 'options amdgpu pcie_p2p=1' in /etc/modprobe.d)"
FIX_PEER = ("the driver refuses peer access between these GPUs: check ACS, IOMMU and BAR findings above, and that "
            "both GPUs sit under one root complex")


# ------------------------------------------------------------- findings


def finding(area: str, severity: str, what: str, fix: Optional[str] = None) -> dict:
    """One platform observation: ``severity`` is "ok", "info" or "warning"; a
    warning comes with the ``fix`` users apply."""
    return {"area": area, "severity": severity, "what": what, "fix": fix}


def read_text(path: Path) -> Optional[str]:
    """A sysfs/procfs file's text, stripped; None where it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def pci_device_dir(sys_root: Path, bus_id: str) -> Path:
    return Path(sys_root) / "bus" / "pci" / "devices" / bus_id.lower()


# ------------------------------------------------------------- IOMMU


def kernel_iommu_args(cmdline_text: str) -> dict[str, str]:
    """The IOMMU arguments of a kernel command line (iommu=, amd_iommu=,
    intel_iommu=, iommu.passthrough=, iommu.strict=), by name."""
    names = ("iommu", "amd_iommu", "intel_iommu", "iommu.passthrough", "iommu.strict")
    args = {}
    for word in cmdline_text.split():
        name, _, value = word.partition("=")
        if name in names:
            args[name] = value
    return args


def iommu_mode(cmdline_text: str, sys_root: Path, bus_ids: Sequence[str] = ()) -> dict:
    """The IOMMU as the kernel runs it: the command line's IOMMU arguments, the
    IOMMU units in ``sys_root``/class/iommu, the IOMMU group type of each GPU
    (``identity``: passthrough; ``DMA``/``DMA-FQ``: translated), and ``mode``:
    "off" (no IOMMU unit), "passthrough", "translated" or "unknown"."""
    args = kernel_iommu_args(cmdline_text)
    units_dir = Path(sys_root) / "class" / "iommu"
    units = sorted(p.name for p in units_dir.iterdir()) if units_dir.is_dir() else []
    groups = {b: read_text(pci_device_dir(sys_root, b) / "iommu_group" / "type") for b in bus_ids}
    group_types = {t for t in groups.values() if t}
    off = any(args.get(n) == "off" for n in ("iommu", "amd_iommu", "intel_iommu"))
    if off or (units_dir.is_dir() and not units):
        mode = "off"
    elif group_types:
        mode = "passthrough" if group_types == {"identity"} else "translated"
    elif args.get("iommu") == "pt" or args.get("iommu.passthrough") in ("1", "on", "y"):
        mode = "passthrough"
    elif units:
        mode = "translated"
    else:
        mode = "unknown"
    return {"mode": mode, "kernel_args": args, "units": units, "gpu_group_types": groups}


def iommu_findings(iommu: dict) -> list[dict]:
    args = " ".join(f"{k}={v}" for k, v in iommu["kernel_args"].items()) or "no IOMMU arguments"
    mode = iommu["mode"]
    if mode == "translated":
        return [finding("iommu", "warning",
                        f"the IOMMU translates DMA ({len(iommu['units'])} IOMMU unit(s); kernel command line: {args}): "
                        "peer-to-peer writes between GPUs go through it, and on many AMD and Intel platforms "
                        "they are dropped or slowed down", FIX_IOMMU)]
    if mode == "unknown":
        return [finding("iommu", "info", f"IOMMU mode unknown (no /sys/class/iommu; kernel command line: {args})")]
    return [finding("iommu", "ok", f"IOMMU {mode} (kernel command line: {args})")]


# ------------------------------------------------------------- ACS (lspci)

_LSPCI_HEADER = re.compile(r"^([0-9a-fA-F]{4}:)?([0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+(.*)$")


def parse_lspci(text: str) -> list[dict]:
    """Devices of ``lspci -vvv`` output: ``bdf``, ``description`` (class and
    name), ``acs_ctl`` ({control: enabled} from the ACSCtl line, None
    without an ACS capability) and ``access_denied`` (lspci ran without root,
    so capabilities were not read)."""
    devices: list[dict] = []
    for line in text.splitlines():
        m = _LSPCI_HEADER.match(line)
        if m:
            devices.append({"bdf": (m.group(1) or "0000:") + m.group(2), "description": m.group(3),
                            "acs_ctl": None, "access_denied": False})
        elif devices:
            stripped = line.strip()
            if stripped.startswith("ACSCtl:"):
                devices[-1]["acs_ctl"] = {w[:-1]: w.endswith("+") for w in stripped.split()[1:] if w[-1] in "+-"}
            elif "<access denied>" in stripped:
                devices[-1]["access_denied"] = True
    return devices


def acs_findings(devices: Optional[list[dict]]) -> list[dict]:
    """ACS as parsed by :func:`parse_lspci` (None: no lspci output)."""
    if devices is None:
        return [finding("acs", "info", "ACS unknown: lspci is not installed (pciutils) or failed")]
    redirecting = [(d, [c for c in ACS_REDIRECTING if d["acs_ctl"].get(c)]) for d in devices if d["acs_ctl"]]
    redirecting = [(d, on) for d, on in redirecting if on]
    if redirecting:
        listed = "; ".join(f"{d['bdf']} ({d['description'][:60]}): {'+ '.join(on)}+" for d, on in redirecting)
        return [finding("acs", "warning",
                        f"ACS redirects peer requests upstream on {len(redirecting)} device(s): {listed}", FIX_ACS)]
    if any(d["access_denied"] for d in devices) and not any(d["acs_ctl"] for d in devices):
        return [finding("acs", "info", "ACS unknown: lspci read no capabilities (run the doctor as root)")]
    with_acs = sum(1 for d in devices if d["acs_ctl"])
    return [finding("acs", "ok", f"no ACS redirection ({with_acs} device(s) with an ACS capability, all off)")]


# ------------------------------------------------------------- BARs, NUMA, root complex


def read_bar_sizes(sys_root: Path, bus_id: str) -> list[dict]:
    """The memory BARs (0-5) of a PCI device from ``sys_root``/bus/pci/devices/
    <bus_id>/resource: ``bar``, ``bytes``, ``prefetchable``, ``mem64``;
    empty where the file cannot be read."""
    text = read_text(pci_device_dir(sys_root, bus_id) / "resource")
    bars = []
    for index, line in enumerate((text or "").splitlines()[:6]):
        start, end, flags = (int(v, 16) for v in line.split()[:3])
        if end > start and flags & IORESOURCE_MEM:
            bars.append({"bar": index, "bytes": end - start + 1, "prefetchable": bool(flags & IORESOURCE_PREFETCH),
                         "mem64": bool(flags & IORESOURCE_MEM_64)})
    return bars


def read_numa_node(sys_root: Path, bus_id: str) -> Optional[int]:
    """The NUMA node of a PCI device; None where unknown (the kernel says -1)."""
    text = read_text(pci_device_dir(sys_root, bus_id) / "numa_node")
    return int(text) if text and text.lstrip("-").isdigit() and int(text) >= 0 else None


def read_root_complex(sys_root: Path, bus_id: str) -> Optional[str]:
    """The PCI host bridge above a device ("pci0000:00"), from where its sysfs
    link points; None where unknown."""
    try:
        target = os.readlink(pci_device_dir(sys_root, bus_id))
    except OSError:
        return None
    return next((part for part in Path(target).parts if part.startswith("pci")), None)


def bar_findings(gpus: list[dict]) -> list[dict]:
    out = []
    for g in gpus:
        if not g["bars"]:
            out.append(finding("bar", "info", f"GPU{g['index']}: BAR sizes unknown (no sysfs resource file)"))
            continue
        largest = max(g["bars"], key=lambda b: b["bytes"])
        what = f"GPU{g['index']}: largest BAR is BAR{largest['bar']}, {mib(largest['bytes'])}"
        if largest["bytes"] <= SMALL_BAR_BYTES:
            out.append(finding("bar", "warning", what + " (small BAR: peers and the CPU see only that much of "
                               "the GPU's memory; the driver may refuse or slow peer mappings)", FIX_BAR))
        else:
            out.append(finding("bar", "ok", what + " (large BAR)"))
    return out


def topology_findings(gpus: list[dict]) -> list[dict]:
    numa = {g["numa_node"] for g in gpus if g["numa_node"] is not None}
    roots = {g["root_complex"] for g in gpus if g["root_complex"]}
    out = []
    if len(numa) > 1:
        out.append(finding("numa", "warning", f"the GPUs sit on {len(numa)} NUMA nodes ({sorted(numa)})", FIX_NUMA))
    if len(roots) > 1:
        out.append(finding("root_complex", "info",
                           f"the GPUs sit under {len(roots)} PCI host bridges ({', '.join(sorted(roots))}): peer "
                           "traffic crosses the CPU's fabric; whether that works depends on the CPU", FIX_NUMA))
    return out


# ------------------------------------------------------------- amdgpu, P2PDMA


def read_module_params(sys_root: Path, module: str) -> dict[str, str]:
    """``sys_root``/module/<module>/parameters/*, by name ({} without the module)."""
    d = Path(sys_root) / "module" / module / "parameters"
    if not d.is_dir():
        return {}
    return {p.name: v for p in sorted(d.iterdir()) if (v := read_text(p)) is not None}


def amdgpu_findings(params: dict[str, str]) -> list[dict]:
    if not params:
        return []
    p2p = params.get("pcie_p2p")
    if p2p in ("N", "0"):
        return [finding("amdgpu", "warning", f"amdgpu.pcie_p2p={p2p}: the driver does not map peer memory",
                        FIX_AMDGPU_P2P)]
    return [finding("amdgpu", "ok", f"amdgpu loaded (pcie_p2p={p2p if p2p is not None else 'not a parameter here'})")]


def read_p2pmem_devices(sys_root: Path) -> list[str]:
    """PCI devices that publish peer-to-peer DMA memory (a ``p2pmem`` folder)."""
    d = Path(sys_root) / "bus" / "pci" / "devices"
    return sorted(p.name for p in d.iterdir() if (p / "p2pmem").is_dir()) if d.is_dir() else []


def p2pdma_findings(devices: list[str]) -> list[dict]:
    what = (f"kernel P2PDMA memory published by {', '.join(devices)}" if devices else
            "no device publishes kernel P2PDMA memory (normal for GPUs: their driver maps peers itself)")
    return [finding("p2pdma", "info", what)]


# ------------------------------------------------------------- link types


def parse_link_matrix(text: str, title: Optional[str] = None) -> Optional[list[list[Optional[str]]]]:
    """The GPU x GPU matrix of ``nvidia-smi topo -m`` or of the table of
    ``rocm-smi --showtopo`` whose title contains ``title`` (e.g. "Link Type"):
    ``m[i][j]`` is the tool's word for the link (NV18, PIX, PHB, SYS, PCIE,
    XGMI, ...), None on the diagonal. None where no matrix is found."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi underlines its header
    lines = text.splitlines()
    if title is not None:
        starts = [i for i, line in enumerate(lines) if title in line]
        if not starts:
            return None
        lines = lines[starts[0] + 1:]
    for i, line in enumerate(lines):
        header = line.split()
        n = 0
        while n < len(header) and header[n] == f"GPU{n}":
            n += 1
        if n == 0:
            continue
        matrix = []
        for r, row in enumerate(lines[i + 1:i + 1 + n]):
            cells = row.split()
            if len(cells) < n + 1 or cells[0] != f"GPU{r}":
                return None
            matrix.append([None if c == r else cells[1 + c] for c in range(n)])
        return matrix if len(matrix) == n else None
    return None


def run_tool(argv: Sequence[str]) -> Optional[str]:
    """A tool's stdout, or None where it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def link_types() -> dict:
    """The link matrix from ``nvidia-smi topo -m`` or ``rocm-smi --showtopo``,
    whichever exists and answers; ``tool`` None and ``matrix`` None otherwise.
    The tools number GPUs as torch does by default on a box of one GPU model."""
    for argv, title in ((["nvidia-smi", "topo", "-m"], None), (["rocm-smi", "--showtopo"], "Link Type")):
        text = run_tool(argv)
        matrix = parse_link_matrix(text, title) if text else None
        if matrix is not None:
            return {"tool": " ".join(argv), "matrix": matrix}
    return {"tool": None, "matrix": None}


# ------------------------------------------------------------- GPUs


def gpu_architecture(props) -> str:
    """gcnArchName on ROCm (e.g. gfx1201), sm_XY on CUDA."""
    if torch.version.hip:
        return str(getattr(props, "gcnArchName", "unknown")).split(":")[0]
    return f"sm_{props.major}{props.minor}"


def gpu_bus_id(props) -> Optional[str]:
    """The PCI bus id (domain:bus:device.0, lower case) torch reports, if it does."""
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(p is None for p in parts):
        return None
    domain, bus, device = parts
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def inventory_gpus(sys_root: Path) -> list[dict]:
    """Every GPU torch sees: name, architecture, memory, PCI bus id, and from
    sysfs its NUMA node, host bridge and memory BARs."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        bus = gpu_bus_id(props)
        gpus.append({
            "index": i, "name": props.name, "architecture": gpu_architecture(props),
            "memory_bytes": props.total_memory, "pci_bus_id": bus,
            "numa_node": read_numa_node(sys_root, bus) if bus else None,
            "root_complex": read_root_complex(sys_root, bus) if bus else None,
            "bars": read_bar_sizes(sys_root, bus) if bus else [],
        })
    return gpus


def peer_access_matrix(n: int) -> list[list[Optional[bool]]]:
    """torch.cuda.can_device_access_peer(i, j); None on the diagonal."""
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]


def software() -> dict:
    return {"rdna4_comm": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": torch.version.hip, "python": platform.python_version(), "extension_gpu_support": bool(_C.with_gpu),
            "gpus_visible_to_torch": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "shared_gpus_allowed": shared_gpus_allowed()}


def platform_report(sys_root: Path, proc_root: Path, gpus: list[dict], lspci_text: Optional[str]) -> dict:
    """Everything Linux tells about peer-to-peer, and the findings from it."""
    cmdline = read_text(Path(proc_root) / "cmdline") or ""
    iommu = iommu_mode(cmdline, sys_root, [g["pci_bus_id"] for g in gpus if g["pci_bus_id"]])
    lspci = parse_lspci(lspci_text) if lspci_text is not None else None
    amdgpu = read_module_params(sys_root, "amdgpu")
    p2pmem = read_p2pmem_devices(sys_root)
    findings = (iommu_findings(iommu) + acs_findings(lspci) + bar_findings(gpus) + topology_findings(gpus)
                + amdgpu_findings(amdgpu) + p2pdma_findings(p2pmem))
    acs = None if lspci is None else [{"bdf": d["bdf"], "description": d["description"], "acs_ctl": d["acs_ctl"]}
                                      for d in lspci if d["acs_ctl"]]
    return {"kernel_cmdline": cmdline, "iommu": iommu, "acs": acs, "amdgpu_params": amdgpu,
            "p2pmem_devices": p2pmem, "findings": findings}


def peer_findings(peer: list[list[Optional[bool]]]) -> list[dict]:
    refused = [(i, j) for i, row in enumerate(peer) for j, ok in enumerate(row) if ok is False]
    if not refused:
        return []
    pairs = ", ".join(f"GPU{i}->GPU{j}" for i, j in refused)
    return [finding("peer_access", "warning", f"torch.cuda.can_device_access_peer is False for {pairs}", FIX_PEER)]


# ------------------------------------------------------------- rank processes


class DoctorRank(BenchRank):
    """A rank of the doctor's worlds: gloo process groups only (the doctor
    compares nothing against NCCL, and NCCL refuses ranks that share a GPU),
    on GPU ``devices[rank]``, or on the CPU when ``devices`` is None."""

    def __init__(self, member: Member, devices: Optional[Sequence[int]]):
        super().__init__(member, "cpu")
        if devices is not None:
            self.transport = "gpu"
            self.device = torch.device("cuda", devices[member.rank])
            torch.cuda.set_device(self.device)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def check_pair(ctx: DoctorRank, rows: int, samples: int, timeout_ms: int) -> dict:
    """On both ranks of a pair world: a gpu-transport Communicator (its
    construction probes the peer mapping both ways), then a [rows, 1024] fp32
    all_reduce checked bitwise and timed, and a one-element one timed."""
    try:
        comm = Communicator(ctx.cpu_group, transport="gpu", timeout_ms=timeout_ms)
    except Exception as e:  # noqa: BLE001  (a failed probe raises on every rank alike)
        return {"ok": False, "stage": "probe", "error": error_text(e)}
    with comm:
        def timed(tokens: int, hidden: int):
            op = rdna4_allreduce_op(comm, *allreduce_case(ctx.rank, 2, tokens, hidden, ctx.device))
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


def auto_transport(ctx: DoctorRank, timeout_ms: int) -> dict:
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
    """Rank 0's result of ``task`` on a new world of ``size`` DoctorRanks;
    a world that fails (a rank raised outside the task's own checks, died
    or hung) gives ``{"error": ...}``. Stdout stays the report's alone."""
    try:
        with ProcessWorld(size, DoctorRank, (devices,)) as world:
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


def exit_code(report: dict) -> int:
    verdict, pairs = report["verdict"], report["pairs"]
    if verdict.get("error") or verdict.get("transport") is None:
        return EXIT_ERROR
    if verdict["transport"] != "gpu":
        return EXIT_FALLBACK
    return EXIT_P2P_USABLE if all(p["ok"] for p in pairs) else EXIT_ERROR


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


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


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
    lines.append({
        EXIT_P2P_USABLE: "  => the GPU peer-to-peer path is usable (exit 0)",
        EXIT_FALLBACK: "  => transport='auto' falls back from GPU peer-to-peer (exit 1)",
        EXIT_ERROR: "  => errors: see above (exit 2)",
    }[report["exit_code"]])
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
    p = argparse.ArgumentParser(prog="python -m rdna4_comm.doctor", description=__doc__,
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
            print(json.dumps({"error": error_text(e), "exit_code": EXIT_ERROR}))
        print(f"doctor: {error_text(e)}", file=sys.stderr)
        return EXIT_ERROR
    if args.json_file is not None:
        args.json_file.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1) if args.json else render(report), flush=True)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
