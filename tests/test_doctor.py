"""rdna4_comm.doctor: its readers of sysfs, procfs, lspci and the topology
tools against fixture trees and texts written here, and the doctor end to
end as a user runs it: on the CPU path here, on the GPU path where GPUs are."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from rdna4_comm import _host_findings as findings
from rdna4_comm import doctor

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

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


def test_report_carries_the_p2p_kernel_parameters_and_nothing_else(tmp_path):
    """Of /proc/cmdline the report keeps the peer-to-peer parameters alone, in
    the JSON and in the text; the IOMMU finding still reads its arguments,
    and the words after "--" (init's) are no kernel parameters."""
    p2p = "amd_iommu=on iommu=pt pci=noacs pcie_acs_override=downstream,multifunction amdgpu.pcie_p2p=1"
    cmdline = ("BOOT_IMAGE=/vmlinuz-6.8.0 root=UUID=6f1c-secret-disk ro quiet amd_iommu=on iommu=pt pci=noacs "
               "nfsroot=10.0.0.7:/export/private pcie_acs_override=downstream,multifunction amdgpu.pcie_p2p=1 "
               "-- --auth-token=hunter2 iommu=off")
    assert findings.p2p_kernel_params(cmdline) == p2p
    sys_root = write_sys(tmp_path, iommu_units=("ivhd0",))
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    (proc_root / "cmdline").write_text(cmdline + "\n")
    plat = findings.platform_report(sys_root, proc_root, [], None)
    assert plat["p2p_kernel_params"] == p2p
    assert plat["iommu"]["mode"] == "passthrough" and plat["iommu"]["kernel_args"] == {"amd_iommu": "on", "iommu": "pt"}
    report = dict(gpu_report(), platform=plat)
    report["exit_code"] = doctor.exit_code(report)
    text, json_text = doctor.render(report), json.dumps(report)
    assert f"  [info] kernel_params: peer-to-peer parameters of the kernel command line: {p2p}\n" in text
    for unrelated in ("BOOT_IMAGE", "root=UUID", "nfsroot", "quiet", "hunter2", "iommu=off"):
        assert unrelated not in text and unrelated not in json_text, unrelated
    [none] = findings.kernel_params_findings(findings.p2p_kernel_params("BOOT_IMAGE=/vmlinuz ro quiet"))
    assert none["what"] == "the kernel command line sets no peer-to-peer parameter (IOMMU, ACS, PCI, amdgpu.pcie_p2p)"


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


# ------------------------------------------------------------------ report


def gpu_report(pair_ok=True, transport="gpu", verdict_error=None) -> dict:
    """A report of the GPU path as diagnose() builds it, on 2 GPUs."""
    gpu = {"name": "AMD Radeon AI PRO R9700", "architecture": "gfx1201", "memory_bytes": 32 << 30,
           "numa_node": 0, "root_complex": "pci0000:00", "bars": [{"bar": 0, "bytes": 32 << 30}]}
    good = {"ok": True, "stage": None, "error": None, "all_reduce_bytes": 64 << 20, "bandwidth_gbps": 24.5,
            "all_reduce_p50_us": 2739.0, "latency_us": 9.5, "samples": 40}
    bad = {"ok": False, "stage": "probe", "error": "RuntimeError: Communicator: peer-to-peer probe failed:\n"
           "rank 0: rank 1 -> rank 0: the probe flag never arrived within 10000 ms"}
    return {
        "software": {"rdna4_comm": "0.1.0", "torch": "2.13.0", "cuda": None, "hip": "6.4", "python": "3.11",
                     "extension_gpu_support": True, "gpus_visible_to_torch": 2, "shared_gpus_allowed": False},
        "gpus": [dict(gpu, index=i, pci_bus_id=b) for i, b in enumerate((GPU0, GPU1))],
        "peer_access": [[None, True], [True, None]],
        "links": {"tool": "rocm-smi --showtopo", "matrix": [[None, "PCIE"], ["PCIE", None]]},
        "pairs": [{"ranks": [0, 1], "gpus": [0, 1], **(good if pair_ok else bad)}], "pairs_skipped": None,
        "platform": {"findings": [findings.finding("iommu", "warning", "the IOMMU translates DMA", findings.FIX_IOMMU)]},
        "verdict": {"transport": transport, "reason": "every rank has its own GPU", "all_reduce": "bitwise equal",
                    "error": verdict_error, "world": 2, "ranks_on": "GPUs 0,1"},
    }


@pytest.mark.parametrize("pair_ok, transport, verdict_error, why_not", [
    (True, "gpu", None, None),
    (False, "dist", None, None),  # auto falls back around the broken pair: the library runs on dist
    (True, "cpu", None, None),
    (False, "gpu", None, "transport 'gpu' would run over GPU pairs that failed their checks: rank 0 <-> rank 1"),
    (True, "dist", "RuntimeError: all_reduce mismatch",
     "the all_reduce through transport 'dist' failed (the error above)"),
    (False, None, "RuntimeError: probe failed",  # e.g. RDNA4_COMM_TRANSPORT=gpu where gpu cannot work
     "no Communicator could be built over the doctor's processes (the error above)"),
])
def test_exit_code_says_whether_the_library_runs_on_the_auto_transport(pair_ok, transport, verdict_error, why_not):
    report = gpu_report(pair_ok, transport, verdict_error)
    assert doctor.why_library_cannot_run(report) == why_not
    expected = doctor.EXIT_LIBRARY_RUNS if why_not is None else doctor.EXIT_LIBRARY_CANNOT_RUN
    assert doctor.exit_code(report) == expected


def test_gpu_box_with_an_extension_built_without_gpu_support_cannot_run():
    # The cpu transport works there, but the box's GPU tensors would be refused.
    report = gpu_report(transport="cpu")
    report["software"]["extension_gpu_support"] = False
    assert "built without GPU support" in doctor.why_library_cannot_run(report)
    assert doctor.exit_code(report) == doctor.EXIT_LIBRARY_CANNOT_RUN


def test_help_states_the_exit_status_rule(capsys):
    with pytest.raises(SystemExit) as exited:
        doctor.main(["--help"])
    assert exited.value.code == 0
    assert doctor.EXIT_STATUS_HELP in capsys.readouterr().out


def test_render_gpu_report():
    report = gpu_report(pair_ok=False, transport=None, verdict_error="RuntimeError: probe failed")
    report["exit_code"] = doctor.exit_code(report)
    text = doctor.render(report)
    assert "GPU0  AMD Radeon AI PRO R9700  gfx1201  32 GiB  0000:03:00.0  0     BAR0 32 GiB" in text
    assert "== peer access (torch.cuda.can_device_access_peer) / link type (rocm-smi --showtopo)" in text
    assert "GPU0  -         yes/PCIE" in text
    assert "rank 0 (GPU0) <-> rank 1 (GPU1): FAILED (probe)" in text
    assert "      rank 0: rank 1 -> rank 0: the probe flag never arrived within 10000 ms" in text
    assert "  [warning] iommu: the IOMMU translates DMA\n      fix: add iommu=pt" in text
    assert "transport='auto' over 2 processes on GPUs 0,1: FAILED" in text
    assert text.endswith("=> rdna4_comm cannot run here: no Communicator could be built over the doctor's processes "
                         "(the error above) (exit 1)")
    report = gpu_report()
    report["exit_code"] = doctor.exit_code(report)
    text = doctor.render(report)
    assert ("rank 0 (GPU0) <-> rank 1 (GPU1): ok; 64 MiB all_reduce bitwise correct, 24.5 GB/s per direction "
            "(both loaded), tiny all_reduce 9.5 us (p50 of 40)") in text
    assert "  reason: every rank has its own GPU" in text
    assert text.endswith("=> rdna4_comm runs here on transport 'gpu' (GPU peer-to-peer, every GPU pair passed its "
                         "checks) (exit 0)")


def test_gpu_world_sizes(monkeypatch):
    monkeypatch.setattr(doctor, "usable_gpus", lambda: 4)
    monkeypatch.setattr(doctor, "shared_gpus_allowed", lambda: False)
    assert doctor.gpu_world(None) == [0, 1, 2, 3] and doctor.gpu_world(2) == [0, 1]
    with pytest.raises(ValueError, match="RDNA4_COMM_ALLOW_SHARED_GPU"):
        doctor.gpu_world(5)
    monkeypatch.setattr(doctor, "usable_gpus", lambda: 1)
    assert doctor.gpu_world(None) is None
    monkeypatch.setattr(doctor, "shared_gpus_allowed", lambda: True)
    assert doctor.gpu_world(None) == [0, 0] and doctor.gpu_world(3) == [0, 0, 0]
    monkeypatch.setattr(doctor, "usable_gpus", lambda: 0)
    assert doctor.gpu_world(2) is None


def test_a_pair_that_cannot_build_the_gpu_transport_is_reported(tmp_path):
    """check_pair turns a failed Communicator construction into the pair's
    result, with the exception text, instead of raising (here: the extension
    has no GPU support, or the process no GPU)."""
    import torch.distributed as dist
    from types import SimpleNamespace

    if doctor.gpu_world(None) is not None:
        pytest.skip("the GPU transport can be built here")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        result = doctor.check_pair(SimpleNamespace(cpu_group=None), 1, 1, 1000)
    finally:
        dist.destroy_process_group()
    assert result["ok"] is False and result["stage"] == "probe"
    assert result["error"].startswith("RuntimeError: Communicator: transport='gpu' is not possible")


# ------------------------------------------------------------------ end to end


def run_doctor(*args: str, extra_env: Optional[dict[str, str]] = None, package_root: Path = ROOT) -> subprocess.Popen:
    """The doctor as a user runs it from ``package_root`` (python -m puts the
    working directory first on the path, so rdna4_comm comes from there),
    with ``extra_env`` added to this environment."""
    env = dict(os.environ, **(extra_env or {}),
               PYTHONPATH=str(package_root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "rdna4_comm.doctor", *args], cwd=package_root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def cpu_path_only():
    if doctor.gpu_world(None) is not None:
        pytest.skip("GPUs here: the doctor takes its GPU path (test_gpu_path)")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run of the doctor on the CPU path as a user runs it, with the JSON
    report also written to a file: (exit code, stdout, stderr, JSON report)."""
    cpu_path_only()
    path = tmp_path_factory.mktemp("doctor") / "report.json"
    p = run_doctor("--json-file", str(path))
    out, err = p.communicate(timeout=TIMEOUT_S)
    return p.returncode, out, err, json.loads(path.read_text())


def test_a_cpu_only_box_runs_the_library_so_the_doctor_exits_0(cpu_run):
    """Without GPUs "auto" picks the CPU transport, which works: healthy."""
    code, out, err, report = cpu_run
    assert code == report["exit_code"] == doctor.EXIT_LIBRARY_RUNS, out + err
    assert report["verdict"]["transport"] == "cpu"
    assert out.rstrip().endswith("=> rdna4_comm runs here on transport 'cpu' (shared memory between the processes "
                                 "of this host) (exit 0)")


def test_a_forced_transport_that_cannot_work_exits_1():
    """RDNA4_COMM_TRANSPORT=gpu without GPUs: the library cannot run as asked."""
    cpu_path_only()
    p = run_doctor("--json", extra_env={"RDNA4_COMM_TRANSPORT": "gpu"})
    out, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == doctor.EXIT_LIBRARY_CANNOT_RUN, out + err
    verdict = json.loads(out)["verdict"]
    assert verdict["transport"] is None and "transport='gpu' is not possible" in verdict["error"]


def test_an_extension_that_cannot_load_exits_1(tmp_path):
    """A copy of the package whose _C is not a loadable library: Python stops
    at the import with status 1, before any report."""
    package = ROOT / "rdna4_comm"
    shutil.copytree(package, tmp_path / "rdna4_comm", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    for built in package.glob("_C*"):
        (tmp_path / "rdna4_comm" / built.name).write_text("not a shared library\n")
    p = run_doctor("--json", package_root=tmp_path)
    out, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == doctor.EXIT_LIBRARY_CANNOT_RUN and out == "", out + err
    assert "ImportError" in err and str(tmp_path) in err, err


def test_cpu_path_text_report(cpu_run):
    _, out, err, _ = cpu_run
    sections = ["== software", "== GPUs (0)", "== GPU pairs (2-rank gpu Communicator: init probe both ways, then a "
                "verified all_reduce)", "== platform", "== verdict"]
    assert [line for line in out.splitlines() if line.startswith("== ")] == sections
    assert "extension GPU support (rdna4_comm._C.with_gpu): no" in out
    assert "  not checked: torch sees no GPU" in out
    assert "transport='auto' over 2 processes on CPU: cpu" in out
    assert "all_reduce through it: [64, 1024] fp32 over 2 ranks bitwise equal to rdna4_comm.reference.all_reduce" in out
    assert "] iommu: " in out and "] acs: " in out and "] p2pdma: " in out
    assert "transport='auto' over 2 CPU processes" in err  # progress goes to stderr


def test_cpu_path_json_report(cpu_run):
    code, out, _, report = cpu_run
    assert set(report) == {"software", "gpus", "peer_access", "links", "pairs", "pairs_skipped", "platform", "verdict",
                           "exit_code"}
    assert report["exit_code"] == code
    assert report["software"]["torch"] and report["software"]["extension_gpu_support"] is False
    assert report["gpus"] == report["pairs"] == report["peer_access"] == []
    v = report["verdict"]
    assert v["transport"] == "cpu" and v["world"] == 2 and v["error"] is None and "bitwise" in v["all_reduce"]
    assert "reason" in v
    assert set(report["platform"]) == {"p2p_kernel_params", "iommu", "acs", "amdgpu_params", "p2pmem_devices",
                                       "findings"}
    assert report["platform"]["p2p_kernel_params"] == findings.p2p_kernel_params(Path("/proc/cmdline").read_text())
    assert all({"area", "severity", "what", "fix"} == set(f) for f in report["platform"]["findings"])
    assert doctor.render(report) == out.rstrip("\n")


def test_json_flag_prints_the_report_alone(cpu_run, monkeypatch, capsys):
    """--json: stdout is one JSON object, the exit status the report's."""
    report = cpu_run[3]
    monkeypatch.setattr(doctor, "diagnose", lambda *args: report)
    assert doctor.main(["--json"]) == doctor.EXIT_LIBRARY_RUNS
    assert json.loads(capsys.readouterr().out) == report


def test_gpu_path():
    """One pair at least: both ranks pass the probe and the verified all_reduce,
    and auto picks the GPU transport. On one GPU it needs
    RDNA4_COMM_ALLOW_SHARED_GPU=1 (2 ranks share it)."""
    devices = doctor.gpu_world(None)
    if devices is None:
        pytest.skip("needs 2 GPUs, or 1 with RDNA4_COMM_ALLOW_SHARED_GPU=1, and a GPU build")
    p = run_doctor("--json", "--size-mib", "16", "--samples", "5")
    out, err = p.communicate(timeout=TIMEOUT_S)
    report = json.loads(out)
    assert p.returncode == doctor.EXIT_LIBRARY_RUNS, out + err
    assert len(report["pairs"]) == len(devices) * (len(devices) - 1) // 2
    for pair in report["pairs"]:
        assert pair["ok"] and pair["bandwidth_gbps"] > 0 and pair["latency_us"] > 0, pair
    assert report["verdict"]["transport"] == "gpu"
    assert all(g["architecture"] and g["name"] for g in report["gpus"])
