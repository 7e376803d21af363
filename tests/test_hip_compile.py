"""The GPU code compiles as HIP.

Device: the kernels compile for RDNA4 (gfx1201), RDNA3 (gfx1100) and CDNA3
(gfx942), and the gfx1201 code keeps the protocol's promises: flags are
published with system-scope stores, every spin sleeps, no atomic reaches
beyond the device (no peer atomics), waves are 32 lanes wide, nothing
spills to scratch, and no kernel makes a call (the device library's
work-item ids inlined as a ROCm build inlines them: hip_work_item_ids.h).
Every .cu file (one per op family, and the testing extension's test
kernels) is checked on its own.
Needs clang++-19 and HIP headers (Debian: clang-19 libamdhip64-dev).

Host: every file that calls the CUDA/HIP runtime (the kernels' launchers in
the .cu files, and csrc/gpu/runtime.cpp, the host's only other caller)
compiles as HIP host code against ROCm 6 headers, as a ROCm build of torch
compiles it, and every runtime symbol it uses is one the HIP library
exports. Needs the headers and library that scripts/fetch_rocm_headers.sh
unpacks (RDNA4_COMM_ROCM_ROOT, default /opt/rdna4_comm/rocm).

Skipped without the tools unless RDNA4_COMM_REQUIRE_HIP=1 (set by .ci/run).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("csrc/*/*.cu"))  # the library's (gpu/) and the testing extension's (testing/)
# The kernels each file must define (a name may appear as several instantiations).
KERNELS_OF = {
    "all_reduce.cu": ["all_reduce_kernel"],
    "all_reduce_rmsnorm.cu": ["all_reduce_rmsnorm_kernel"],
    "dispatch.cu": ["dispatch_kernel"],
    "combine.cu": ["combine_kernel"],
    "expert_layout.cu": ["expert_tally_kernel", "expert_place_kernel"],
    "expert_sum.cu": ["expert_sum_kernel"],
    "probe.cu": ["probe_kernel"],
    "testing.cu": ["occupy_kernel", "store_out_of_bounds_kernel", "fp8_conversion_check_kernel"],
}
CLANG = shutil.which("clang++-19")
HAVE_HIP = CLANG is not None and Path("/usr/include/hip/hip_runtime.h").exists()
REQUIRED = os.environ.get("RDNA4_COMM_REQUIRE_HIP") == "1"
ROCM = Path(os.environ.get("RDNA4_COMM_ROCM_ROOT", "/opt/rdna4_comm/rocm")) / "usr"
HIP_LIBRARY = ROCM / "lib" / "x86_64-linux-gnu" / "libamdhip64.so"
# The host files that call the runtime: every .cu (its launchers) and runtime.cpp.
HOST_SOURCES = [*SOURCES, ROOT / "csrc" / "gpu" / "runtime.cpp"]
# A call of the runtime in a source, through platform.h's names or directly
# (RC_RT(Name) alone names a type or a constant); not the lines that define
# those names.
RUNTIME_CALL = re.compile(r"\bRC_RT\(\w+\)\s*\(|\bRC_LAUNCH\(|\b(?:cuda|hip)[A-Z]\w*\s*\(|<<<")


def code(path: Path) -> str:
    """The file without comments and #define lines."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"^\s*#\s*define\b.*?(?<!\\)$", "", text, flags=re.M | re.S)


def calls_runtime(path: Path, seen: set) -> bool:
    """Whether the file, or a csrc header it includes (transitively), calls the runtime."""
    if path in seen:
        return False
    seen.add(path)
    text = code(path)
    if RUNTIME_CALL.search(text):
        return True
    return any(calls_runtime((path.parent / h).resolve(), seen)
               for h in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M))


def test_every_host_file_that_calls_the_runtime_is_compiled_as_hip():
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".cu")]
    callers = sorted(p.relative_to(ROOT).as_posix() for p in sources if calls_runtime(p.resolve(), set()))
    assert callers == sorted(p.relative_to(ROOT).as_posix() for p in HOST_SOURCES)


if not HAVE_HIP:
    if REQUIRED:
        raise RuntimeError("RDNA4_COMM_REQUIRE_HIP=1 but clang++-19 or /usr/include/hip is missing")
    pytest.skip("clang++-19 and HIP headers not installed", allow_module_level=True)


def compile_host(source: Path, out_dir: Path) -> Path:
    """An object of `source` as a ROCm build of torch compiles it: a .cu as
    HIP for gfx1201 (its host side here), a .cpp with the C++ compiler and
    the HIP platform macros; against ROCM's headers, which -isystem puts
    ahead of the system's older HIP."""
    out = out_dir / f"{source.name}.o"
    if source.suffix == ".cu":
        cmd = [CLANG, "-x", "hip", "--offload-arch=gfx1201", "-nogpulib", "--cuda-host-only"]
    else:
        cmd = [shutil.which("c++") or CLANG, "-x", "c++", "-D__HIP_PLATFORM_AMD__=1", "-DUSE_ROCM=1"]
    cmd += ["-std=c++17", "-isystem", str(ROCM / "include"), "-O2", "-Wall", "-c", str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr, res.stderr
    return out


def symbols(args: list[str]) -> set[str]:
    """nm's symbol names, without their version (hipMalloc@@hip_4.2)."""
    res = subprocess.run(["nm", *args], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in res.stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def hip_exports() -> set[str]:
    if not HIP_LIBRARY.exists():
        if REQUIRED:
            raise RuntimeError(f"RDNA4_COMM_REQUIRE_HIP=1 but {HIP_LIBRARY} is missing: run scripts/fetch_rocm_headers.sh")
        pytest.skip(f"{HIP_LIBRARY} missing: run scripts/fetch_rocm_headers.sh")
    return symbols(["-D", "--defined-only", str(HIP_LIBRARY)])


@pytest.mark.parametrize("source", HOST_SOURCES, ids=lambda p: p.name)
def test_host_code_compiles_as_hip_against_rocm_and_links_to_its_library(source, hip_exports, tmp_path):
    version = (ROCM / "include" / "hip" / "hip_version.h").read_text()
    assert int(re.search(r"#define HIP_VERSION_MAJOR (\d+)", version).group(1)) >= 6, "ROCm 6 or newer"
    used = {s for s in symbols(["-u", str(compile_host(source, tmp_path))]) if s.lower().startswith(("hip", "__hip"))}
    # Made by the compiler's offload bundling when the device code is linked in.
    used -= {"__hip_fatbin_", "__hip_gpubin_handle_"}
    assert used, f"{source.name}: no HIP runtime symbol used"
    assert not used - hip_exports, f"{source.name}: not exported by {HIP_LIBRARY}: {sorted(used - hip_exports)}"


# The device library's work-item functions (threadIdx and the like), which
# -nogpulib leaves out: inlined, as a ROCm build links them.
WORK_ITEM_IDS = ROOT / "tests" / "hip_work_item_ids.h"


def compile_hip(source: Path, arch: str, out_dir: Path) -> str:
    out = out_dir / f"{source.stem}_{arch}.s"
    # -O3 for RDNA4, whose code the tests below read as a build makes it;
    # the other targets are checked for compiling at all, which -O1 shows
    # in about 60% of the time.
    opt = "-O3" if arch == "gfx1201" else "-O1"
    cmd = [CLANG, "-x", "hip", "-std=c++17", f"--offload-arch={arch}", "-nogpulib", "--cuda-device-only",
           "-include", str(WORK_ITEM_IDS), opt, "-Wall", "-S", str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr, res.stderr
    return out.read_text()


def kernels(asm: str) -> dict[str, str]:
    """Body of every kernel in the assembly, by (mangled) name."""
    bodies = {}
    for m in re.finditer(r"^(_Z\S+):[^\n]*$(.*?)^\.Lfunc_end", asm, re.S | re.M):
        bodies[m.group(1)] = m.group(2)
    return bodies


def test_every_source_is_checked():
    assert [p.name for p in SOURCES] == sorted(KERNELS_OF)


# The targets every source compiles for: RDNA4 (the protocol's checks below
# read its code), RDNA3 (no FP8 conversion instructions) and CDNA3 (64-lane waves).
ARCHS = ("gfx1201", "gfx1100", "gfx942")


@pytest.fixture(scope="module")
def device_asm(tmp_path_factory):
    """Every source's assembly for every target in ARCHS, by (file name,
    arch), as a future: the compiles run side by side, one a core
    (dispatch.cu alone takes about 45 s a target on a CI machine's core),
    and a failed one raises where a test reads its result."""
    out = tmp_path_factory.mktemp("hip")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        yield {(p.name, arch): pool.submit(compile_hip, p, arch, out) for arch in ARCHS for p in SOURCES}


@pytest.fixture(scope="module")
def gfx1201_asm(device_asm) -> dict[str, str]:
    """gfx1201 assembly of every source, by file name."""
    return {p.name: device_asm[(p.name, "gfx1201")].result() for p in SOURCES}


# Kernels that take no part in the protocol (no heap, no flag, no wait):
# the expert layout's, and those only the tests launch. The protocol checks
# below skip them (every source still compiles and is checked for scratch and
# wave size).
NO_PROTOCOL_SOURCES = ("expert_layout.cu", "expert_sum.cu", "testing.cu")


@pytest.fixture(scope="module")
def gfx1201(gfx1201_asm) -> dict[str, str]:
    """Every gfx1201 protocol kernel body, by (mangled) name, over all sources."""
    bodies = {}
    for source, asm in gfx1201_asm.items():
        if source not in NO_PROTOCOL_SOURCES:
            bodies.update(kernels(asm))
    return bodies


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gfx1201"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_for_other_amd_targets(arch, source, device_asm):
    asm = device_asm[(source.name, arch)].result()
    assert len(kernels(asm)) >= len(KERNELS_OF[source.name])
    wave = 64 if arch == "gfx942" else 32
    assert f".wavefront_size: {wave}" in asm


def test_every_kernel_is_there(gfx1201_asm):
    for source, asm in gfx1201_asm.items():
        names = " ".join(kernels(asm))
        for k in KERNELS_OF[source]:
            assert k in names, f"{k} missing from {source}"
    # The top-k 8 fast path and the generic path, for int32 and int64 ids,
    # with 16-byte and 2-byte row vectors; and FP8 rows, quantised or a
    # pair's, for int32 and int64 ids, with 16-byte and 1-byte row vectors.
    assert len([n for n in kernels(gfx1201_asm["dispatch.cu"]) if "dispatch_kernel" in n]) == 8 + 8
    # One combine kernel per dtype and sum loop (8 vectors a lane in flight,
    # or 2: combine_sums_short), and per dtype one that sums an expert
    # layout's pair rows (with the short loop).
    assert len([n for n in kernels(gfx1201_asm["combine.cu"]) if "combine_kernel" in n]) == 3 * 2 + 3
    # The expert layout's placement for int32 and int64 ids with 16-byte and
    # 1-byte row vectors, each for one and two groups of slots (slot_groups);
    # its sums, one kernel per dtype.
    for source, name, count in (("expert_layout.cu", "expert_place_kernel", 8), ("expert_sum.cu", "expert_sum_kernel", 3)):
        names = " ".join(kernels(gfx1201_asm[source]))
        assert names.count(name) == count, (name, names)
    # Rows in registers, rows of vectors, rows of elements, for three dtypes.
    assert len([n for n in kernels(gfx1201_asm["all_reduce_rmsnorm.cu"]) if "all_reduce_rmsnorm_kernel" in n]) == 9


def test_flags_are_published_with_system_scope_stores(gfx1201):
    for name, body in gfx1201.items():
        flag_stores = re.findall(r"(?:global|flat)_store_b64[^\n]*scope:SCOPE_SYS", body)
        assert flag_stores, f"{name}: no system-scope 64-bit flag store"


def test_spins_sleep_and_poll_with_system_scope(gfx1201):
    for name, body in gfx1201.items():
        assert "s_sleep" in body, f"{name}: a spin without s_sleep"
        assert re.search(r"(?:global|flat)_load_b64[^\n]*scope:SCOPE_SYS", body), f"{name}: no system-scope poll"
        assert "MSG_RTN_GET_REALTIME" in body, f"{name}: spins are not bounded by the real-time clock"


def test_no_atomics_beyond_the_device(gfx1201):
    for name, body in gfx1201.items():
        for line in body.splitlines():
            if "atomic" in line and "scope:" in line:
                assert "scope:SCOPE_SYS" not in line, f"{name}: system-scope atomic: {line.strip()}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_scratch_on_rdna4(gfx1201_asm, source):
    # Spills to scratch would put private memory traffic in every copy loop.
    sizes = re.findall(r"\.private_segment_fixed_size:\s+(\d+)", gfx1201_asm[source.name])
    assert sizes and all(int(n) == 0 for n in sizes), sizes


# The callee of a call's address computation in gfx1201 assembly.
CALLEE = re.compile(r"s_add_co_u32\s+s\d+, s\d+, (\w+)@rel32@lo")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_calls_on_rdna4(gfx1201_asm, source):
    # The kernels spell what they need with builtins (platform.h): a call is
    # a device-library function that the compile above leaves undefined, so
    # the registers and scratch checked here would not be a ROCm build's.
    for name, body in kernels(gfx1201_asm[source.name]).items():
        assert "s_swappc_b64" not in body, f"{name}: calls {sorted(set(CALLEE.findall(body)))}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_wave32_on_rdna4(gfx1201_asm, source):
    asm = gfx1201_asm[source.name]
    assert ".wavefront_size: 32" in asm and ".wavefront_size: 64" not in asm
