"""rdna4_comm._host_findings, the doctor's readers of sysfs, procfs, lspci
and the topology tools, against fixture trees and texts written here."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rdna4_comm import _host_findings as findings
from rdna4_comm import doctor


# lspci -vvv (as root) of a PCIe switch's downstream port with ACS redirection
# on, and of an R9700 behind it (no ACS capability on the GPU itself).
LSPCI_ACS_ON = """\
00:01.1 PCI bridge: Advanced Micro Devices, Inc. [AMD] Starship/Matisse GPP Bridge (prog-if 00 [Normal decode])
\tControl: I/O+ Mem+ BusMaster+ SpecCycle- MemWINV- VGASnoop- ParErr- Stepping- SERR- FastB2B- DisINTx+
\tCapabilities: [2a0 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+
\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
\tKernel driver in use: pcieport

03:00.0 VGA compatible controller: Advanced Micro Devices, Inc. [AMD/ATI] Navi 48 [Radeon AI PRO R9700] (rev c0) (prog-if 00 [VGA controller])
\tRegion 0: Memory at 7c00000000 (64-bit, prefetchable) [size=256M]
\tKernel driver in use: amdgpu
"""
LSPCI_ACS_OFF = LSPCI_ACS_ON.replace("ACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+",
                                     "ACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd-")
LSPCI_NO_ROOT = """\
0000:00:01.1 PCI bridge: Advanced Micro Devices, Inc. [AMD] Starship/Matisse GPP Bridge (prog-if 00 [Normal decode])
\tCapabilities: <access denied>
"""

# /sys/bus/pci/devices/<id>/resource lines: start end flags. BAR0 64-bit
# prefetchable (VRAM), BAR2 64-bit prefetchable (doorbells), BAR4 I/O, BAR5
# 32-bit registers, then the expansion ROM and unused windows.
MEM64_PREF, MEM32, IO = 0x14220C, 0x40200, 0x40101


def resource_file(vram_bar_bytes: int) -> str:
    rows = [(0x7C00000000, vram_bar_bytes, MEM64_PREF), (0, 0, 0), (0x7E00000000, 2 << 20, MEM64_PREF), (0, 0, 0),
            (0xE000, 0x100, IO), (0xFCA00000, 512 << 10, MEM32), (0xFCA80000, 128 << 10, 0x46200)]
    lines = [f"0x{s:016x} 0x{(s + n - 1) if n else 0:016x} 0x{f:016x}" for s, n, f in rows]
    return "\n".join(lines + ["0x0000000000000000 0x0000000000000000 0x0000000000000000"] * 6) + "\n"


GPU0, GPU1 = "0000:03:00.0", "0000:83:00.0"


def write_sys(root: Path, *, bars=(256 << 20, 32 << 30), numa=(0, 1), group_type="DMA-FQ", iommu_units=("ivhd0",),
              pcie_p2p="N", p2pmem=()) -> Path:
    """A /sys tree: two GPUs under two host bridges with the given VRAM BARs,
    NUMA nodes and IOMMU group type; the IOMMU units; amdgpu's parameters;
    devices with a p2pmem folder."""
    sys_root = root / "sys"
    devices = sys_root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    for bus, bar, node, host in zip((GPU0, GPU1), bars, numa, ("pci0000:00", "pci0000:80")):
        real = sys_root / "devices" / host / bus
        (real / "iommu_group").mkdir(parents=True)
        (real / "resource").write_text(resource_file(bar))
        (real / "numa_node").write_text(f"{node}\n")
        (real / "iommu_group" / "type").write_text(group_type + "\n")
        os.symlink(os.path.relpath(real, devices), devices / bus)
    (sys_root / "class" / "iommu").mkdir(parents=True)
    for unit in iommu_units:
        (sys_root / "class" / "iommu" / unit).mkdir()
    params = sys_root / "module" / "amdgpu" / "parameters"
    params.mkdir(parents=True)
    (params / "pcie_p2p").write_text(pcie_p2p + "\n")
    (params / "vramlimit").write_text("0\n")
    for dev in p2pmem:
        (devices / dev).mkdir(exist_ok=True)
        (devices / dev / "p2pmem").mkdir()
    return sys_root


def by_area(findings, area):
    return [f for f in findings if f["area"] == area]


# ------------------------------------------------------------------ parsers


def test_parse_lspci_reads_acs_control_per_device():
    on = findings.parse_lspci(LSPCI_ACS_ON)
    assert [d["bdf"] for d in on] == ["0000:00:01.1", "0000:03:00.0"]
    assert on[0]["description"].startswith("PCI bridge: Advanced Micro Devices")
    assert on[0]["acs_ctl"] == {"SrcValid": True, "TransBlk": False, "ReqRedir": True, "CmpltRedir": True,
                                "UpstreamFwd": True, "EgressCtrl": False, "DirectTrans": False}
    assert on[1]["acs_ctl"] is None

    [warning] = findings.acs_findings(on)
    assert warning["severity"] == "warning" and "0000:00:01.1" in warning["what"]
    assert "SrcValid+ ReqRedir+ CmpltRedir+ UpstreamFwd+" in warning["what"]
    assert "BIOS" in warning["fix"] and "setpci" in warning["fix"] and "pci=noacs" in warning["fix"]

    [ok] = findings.acs_findings(findings.parse_lspci(LSPCI_ACS_OFF))
    assert ok["severity"] == "ok" and ok["fix"] is None


def test_acs_unknown_without_root_or_without_lspci():
    [no_root] = findings.acs_findings(findings.parse_lspci(LSPCI_NO_ROOT))
    assert no_root["severity"] == "info" and "root" in no_root["what"]
    [missing] = findings.acs_findings(None)
    assert missing["severity"] == "info" and "not installed" in missing["what"]


def test_read_bar_sizes_small_and_large_bar(tmp_path):
    sys_root = write_sys(tmp_path)
    small, large = findings.read_bar_sizes(sys_root, GPU0), findings.read_bar_sizes(sys_root, GPU1)
    assert [(b["bar"], b["bytes"], b["prefetchable"], b["mem64"]) for b in small] == [
        (0, 256 << 20, True, True), (2, 2 << 20, True, True), (5, 512 << 10, False, False)]
    assert large[0]["bytes"] == 32 << 30
    assert findings.read_bar_sizes(sys_root, "0000:99:00.0") == []

    gpus = [{"index": i, "bars": b} for i, b in enumerate((small, large, []))]
    warn, ok, unknown = findings.bar_findings(gpus)
    assert warn["severity"] == "warning" and "BAR0, 256 MiB" in warn["what"] and "Resizable BAR" in warn["fix"]
    assert ok["severity"] == "ok" and "32 GiB" in ok["what"]
    assert unknown["severity"] == "info"


def test_numa_node_and_host_bridge_from_sysfs(tmp_path):
    sys_root = write_sys(tmp_path)
    assert [findings.read_numa_node(sys_root, b) for b in (GPU0, GPU1)] == [0, 1]
    assert [findings.read_root_complex(sys_root, b) for b in (GPU0, GPU1)] == ["pci0000:00", "pci0000:80"]
    (sys_root / "devices" / "pci0000:00" / GPU0 / "numa_node").write_text("-1\n")
    assert findings.read_numa_node(sys_root, GPU0) is None
    gpus = [{"numa_node": 0, "root_complex": "pci0000:00"}, {"numa_node": 1, "root_complex": "pci0000:80"}]
    assert {f["area"] for f in findings.topology_findings(gpus)} == {"numa", "root_complex"}
    assert findings.topology_findings([gpus[0], gpus[0]]) == []


@pytest.mark.parametrize("cmdline, units, group_type, mode", [
    ("BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 ro quiet amd_iommu=on", ("ivhd0",), "DMA-FQ", "translated"),
    ("BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 ro quiet amd_iommu=on iommu=pt", ("ivhd0",), "identity", "passthrough"),
    ("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt", ("dmar0", "dmar1"), None, "passthrough"),
    ("BOOT_IMAGE=/vmlinuz ro intel_iommu=on", ("dmar0",), None, "translated"),
    ("BOOT_IMAGE=/vmlinuz ro quiet", (), None, "off"),
    ("BOOT_IMAGE=/vmlinuz ro amd_iommu=off", ("ivhd0",), None, "off"),
])
def test_iommu_mode(tmp_path, cmdline, units, group_type, mode):
    sys_root = write_sys(tmp_path, iommu_units=units, group_type=group_type or "unused")
    bus_ids = [GPU0, GPU1] if group_type else []
    iommu = findings.iommu_mode(cmdline, sys_root, bus_ids)
    assert iommu["mode"] == mode and iommu["units"] == sorted(units)
    [f] = findings.iommu_findings(iommu)
    if mode == "translated":
        assert f["severity"] == "warning" and "iommu=pt" in f["fix"]
    else:
        assert f["severity"] == "ok" and f["fix"] is None
    assert findings.kernel_iommu_args(cmdline) == {k: v for k, v in (w.split("=", 1) for w in cmdline.split()[1:]
                                                                   if "=" in w) if "iommu" in k}


def test_iommu_mode_unknown_without_sysfs(tmp_path):
    assert findings.iommu_mode("ro quiet", tmp_path / "nothing")["mode"] == "unknown"


def test_amdgpu_parameters_and_p2pdma(tmp_path):
    sys_root = write_sys(tmp_path, p2pmem=("0000:41:00.0",))
    params = findings.read_module_params(sys_root, "amdgpu")
    assert params == {"pcie_p2p": "N", "vramlimit": "0"}
    [f] = findings.amdgpu_findings(params)
    assert f["severity"] == "warning" and "amdgpu.pcie_p2p=1" in f["fix"]
    assert findings.amdgpu_findings({"pcie_p2p": "Y"})[0]["severity"] == "ok"
    assert findings.amdgpu_findings({}) == []
    assert findings.read_module_params(sys_root, "nvidia") == {}
    assert findings.read_p2pmem_devices(sys_root) == ["0000:41:00.0"]
    assert "0000:41:00.0" in findings.p2pdma_findings(["0000:41:00.0"])[0]["what"]


def test_platform_report_collects_every_finding(tmp_path):
    sys_root = write_sys(tmp_path)
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    (proc_root / "cmdline").write_text("BOOT_IMAGE=/vmlinuz ro amd_iommu=on\n")
    gpus = [{"index": i, "pci_bus_id": b, "bars": findings.read_bar_sizes(sys_root, b),
             "numa_node": findings.read_numa_node(sys_root, b), "root_complex": findings.read_root_complex(sys_root, b)}
            for i, b in enumerate((GPU0, GPU1))]
    plat = findings.platform_report(sys_root, proc_root, gpus, LSPCI_ACS_ON)
    warnings = {f["area"] for f in plat["findings"] if f["severity"] == "warning"}
    assert warnings == {"iommu", "acs", "bar", "numa", "amdgpu"}
    assert all(f["fix"] for f in plat["findings"] if f["severity"] == "warning")
    assert plat["iommu"]["gpu_group_types"] == {GPU0: "DMA-FQ", GPU1: "DMA-FQ"}
    assert [d["bdf"] for d in plat["acs"]] == ["0000:00:01.1"]
    json.dumps(plat)  # the --json report holds it as it is


NVIDIA_TOPO = """\
\t\x1b[4mGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tSYS\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tSYS\t0-47\t0\t\tN/A
NIC0\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
ROCM_TOPO = """\
============================ ROCm System Management Interface ============================
================================ Weight between two GPUs =================================
       GPU0         GPU1
GPU0   0            40
GPU1   40           0

=============================== Link Type between two GPUs ===============================
       GPU0         GPU1
GPU0   0            PCIE
GPU1   PCIE         0

======================================= Numa Nodes =======================================
GPU[0]          : (Topology) Numa Node: 0
"""


def test_parse_link_matrix_of_nvidia_smi_and_rocm_smi():
    assert findings.parse_link_matrix(NVIDIA_TOPO) == [[None, "NV18"], ["NV18", None]]
    assert findings.parse_link_matrix(ROCM_TOPO, "Link Type") == [[None, "PCIE"], ["PCIE", None]]
    assert findings.parse_link_matrix(ROCM_TOPO, "no such table") is None
    assert findings.parse_link_matrix("No devices were found\n") is None
    one_gpu = "\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \t0-15\t0\t\tN/A\n"
    assert findings.parse_link_matrix(one_gpu) == [[None]]  # nvidia-smi topo -m on one H200


def test_gpu_bus_id_and_architecture_from_device_properties(monkeypatch):
    class Props:  # what torch.cuda.get_device_properties gives for an H200 at 0000:00:06.0
        name, major, minor, gcnArchName = "NVIDIA H200", 9, 0, "NVIDIA H200"
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0, 6

    assert findings.gpu_bus_id(Props) == "0000:00:06.0"
    monkeypatch.setattr(doctor.torch.version, "hip", None)
    assert findings.gpu_architecture(Props) == "sm_90"
    monkeypatch.setattr(doctor.torch.version, "hip", "6.4.43482")
    Props.gcnArchName = "gfx1201:sramecc-:xnack-"
    assert findings.gpu_architecture(Props) == "gfx1201"
    del Props.pci_domain_id
    assert findings.gpu_bus_id(Props) is None


def test_peer_findings():
    assert findings.peer_findings([[None, True], [True, None]]) == []
    [f] = findings.peer_findings([[None, False], [True, None]])
    assert "GPU0->GPU1" in f["what"] and f["severity"] == "warning"
