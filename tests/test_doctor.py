"""rdna4_comm.doctor: its verdict and report from findings, and the doctor end
to end as a user runs it: on the CPU path here, on the GPU path where GPUs
are (its readers of the host: tests/test_host_findings.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from test_host_findings import GPU0, GPU1, write_sys

from rdna4_comm import _host_findings as findings
from rdna4_comm import doctor

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

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
