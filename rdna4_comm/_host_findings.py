"""What Linux, the PCI tree and the driver say about peer-to-peer on this
host, for the doctor (:mod:`rdna4_comm.doctor`): the GPUs and software, the
peer-access matrix and link types, the kernel command line's peer-to-peer
parameters, IOMMU, ACS, BAR sizes, NUMA placement, amdgpu parameters and
P2PDMA, each finding with its usual fix (:func:`platform_report`). Reads
/proc, /sys and tools' output; changes nothing. docs/doctor.md explains
every finding.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import _C, __version__
from .transport_policy import shared_gpus_allowed

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
# The kernel parameters that set the IOMMU's mode (iommu_mode reads them).
IOMMU_KERNEL_PARAMS = ("iommu", "amd_iommu", "intel_iommu", "iommu.passthrough", "iommu.strict")
# The kernel parameters that bear on peer-to-peer: the IOMMU's, pci= (noacs;
# realloc and resource_alignment, which place and size BARs), the ACS
# override patch's, and amdgpu's switch for peer mappings. They are all the
# report carries of /proc/cmdline: users paste reports into public issues,
# and the rest of the line names disks, init arguments, hypervisor settings.
P2P_KERNEL_PARAMS = IOMMU_KERNEL_PARAMS + ("pci", "pcie_acs_override", "amdgpu.pcie_p2p")



# ------------------------------------------------------------- findings


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


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


def kernel_params(cmdline_text: str, names: Sequence[str]) -> list[str]:
    """The words ("name" or "name=value") of a kernel command line whose
    parameter is one of ``names``, in order. The words after "--" are init's
    arguments, not the kernel's."""
    words = cmdline_text.split()
    if "--" in words:
        words = words[:words.index("--")]
    return [word for word in words if word.partition("=")[0] in names]


def kernel_iommu_args(cmdline_text: str) -> dict[str, str]:
    """The IOMMU arguments of a kernel command line (IOMMU_KERNEL_PARAMS), by
    name; a repeated one has its last value, as the kernel takes it."""
    return {name: value for name, _, value in
            (word.partition("=") for word in kernel_params(cmdline_text, IOMMU_KERNEL_PARAMS))}


def p2p_kernel_params(cmdline_text: str) -> str:
    """The peer-to-peer parameters (P2P_KERNEL_PARAMS) of a kernel command
    line, in their order, as a command line of their own: all of it that the
    report carries."""
    return " ".join(kernel_params(cmdline_text, P2P_KERNEL_PARAMS))


def kernel_params_findings(p2p_params: str) -> list[dict]:
    what = (f"peer-to-peer parameters of the kernel command line: {p2p_params}" if p2p_params else
            "the kernel command line sets no peer-to-peer parameter (IOMMU, ACS, PCI, amdgpu.pcie_p2p)")
    return [finding("kernel_params", "info", what)]


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
    """Everything Linux tells about peer-to-peer, and the findings from it.
    Of the kernel command line it keeps the peer-to-peer parameters alone."""
    p2p_params = p2p_kernel_params(read_text(Path(proc_root) / "cmdline") or "")
    iommu = iommu_mode(p2p_params, sys_root, [g["pci_bus_id"] for g in gpus if g["pci_bus_id"]])
    lspci = parse_lspci(lspci_text) if lspci_text is not None else None
    amdgpu = read_module_params(sys_root, "amdgpu")
    p2pmem = read_p2pmem_devices(sys_root)
    findings = (kernel_params_findings(p2p_params) + iommu_findings(iommu) + acs_findings(lspci) + bar_findings(gpus)
                + topology_findings(gpus) + amdgpu_findings(amdgpu) + p2pdma_findings(p2pmem))
    acs = None if lspci is None else [{"bdf": d["bdf"], "description": d["description"], "acs_ctl": d["acs_ctl"]}
                                      for d in lspci if d["acs_ctl"]]
    return {"p2p_kernel_params": p2p_params, "iommu": iommu, "acs": acs, "amdgpu_params": amdgpu,
            "p2pmem_devices": p2pmem, "findings": findings}


def peer_findings(peer: list[list[Optional[bool]]]) -> list[dict]:
    refused = [(i, j) for i, row in enumerate(peer) for j, ok in enumerate(row) if ok is False]
    if not refused:
        return []
    pairs = ", ".join(f"GPU{i}->GPU{j}" for i, j in refused)
    return [finding("peer_access", "warning", f"torch.cuda.can_device_access_peer is False for {pairs}", FIX_PEER)]
