"""The device kernels compile with nvcc for Hopper (sm_90, the H200s they are
measured on), one .cu file (op family) at a time, without warnings, within
the 128 registers a 512-thread block allows, and none spills: a spill in a
row loop is a local-memory round trip per unrolled step.

Also checks the GPU transport's host glue (csrc/gpu/*.cpp, every host file
with code for GPU builds only, and the testing extension's
csrc/testing/module.cpp) compiles against the installed torch and the CUDA
runtime headers, so a CPU-only CI machine still type-checks them.

Needs nvcc (skipped without it).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("csrc/*/*.cu"))  # the library's (gpu/) and the testing extension's (testing/)
NVCC = shutil.which("nvcc")

if NVCC is None:
    pytest.skip("nvcc not installed", allow_module_level=True)


def ptxas_report(source: Path, arch: str, out_dir: Path) -> str:
    out = out_dir / f"{source.stem}_{arch}.cubin"
    cmd = [NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-Xptxas", "-v", str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
    return res.stderr


@pytest.fixture(scope="module")
def sm90_reports(tmp_path_factory):
    """ptxas's report of every source for sm_90, by file name, as a future:
    the compiles run side by side, one a core, and a failed one raises
    where a test reads its result."""
    out = tmp_path_factory.mktemp("sm90")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        yield {p.name: pool.submit(ptxas_report, p, "sm_90", out) for p in SOURCES}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernels_compile_and_fit_their_registers(source, sm90_reports):
    report = sm90_reports[source.name].result()
    used = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert used and max(used) <= 128, report  # __launch_bounds__(512): 64K registers / 512 threads
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and max(spills) == 0, f"{source.name}: spills {spills}\n{report}"


def test_gpu_host_glue_compiles_against_torch_and_cuda_headers(tmp_path):
    import torch
    from torch.utils.cpp_extension import include_paths

    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), Path(NVCC).resolve().parents[1], "/usr/local/cuda"]
    found = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()]
    if not found:
        pytest.skip(f"no CUDA runtime headers found for {NVCC} (set CUDA_HOME)")
    cuda_include = found[0]
    # A CPU build of torch ships c10/cuda's headers but not the one its CMake
    # generates; the glue needs only its export macro.
    generated = tmp_path / "c10" / "cuda" / "impl"
    generated.mkdir(parents=True)
    (generated / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    includes = [str(tmp_path), *include_paths(), str(cuda_include), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)

    def check(source: str):
        cmd = [cxx, "-fsyntax-only", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DRDNA4_COMM_WITH_GPU=1",
               "-DTORCH_EXTENSION_NAME=_C", *(f"-I{p}" for p in includes), str(ROOT / source)]
        return cmd, subprocess.run(cmd, capture_output=True, text=True)

    # The host files with code under RDNA4_COMM_WITH_GPU or built only with
    # it, two at a time (torch's headers take a while).
    host = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.cpp")
                  if p.parent.name in ("gpu", "testing") or "RDNA4_COMM_WITH_GPU" in p.read_text())
    assert {"csrc/gpu/gpu_comm.cpp", "csrc/gpu/runtime.cpp", "csrc/testing/module.cpp"} <= set(host)
    with ThreadPoolExecutor(2) as pool:
        for cmd, res in pool.map(check, host):
            assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"
