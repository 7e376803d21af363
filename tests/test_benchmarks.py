"""The demo and the benchmarks, end to end on CPU processes (--quick), as a
user runs them: they succeed, the results file has its header and positive
times, an existing results file is never overwritten, the heatmap is saved.
Plus bench_ep's --cap, and bench_kernels.py on the CPU transport with the
parsers of its GPU-only paths (torch.profiler events:
benchmarks/_harness/profiling.py; ncu's CSV: benchmarks/_harness/ncu.py) on
recorded-format inputs."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as the scripts see it: _common, _harness
FAST = ["--transport", "cpu", "--world", "2", "--rounds", "2", "--samples", "3"]
TIMEOUT_S = 180


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


DEMO_COLUMNS = 100
DEMO_TABLE_OPS = ("all_reduce", "TP MLP block", "dispatch+combine")


def test_demo_checks_pass_and_prints_a_latency_table():
    r = run("-m", "rdna4_comm.demo", *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world of 2 (CPU processes" in r.stdout
    assert "FAIL" not in r.stdout and "demo: all checks passed" in r.stdout
    checks_part, table_part = r.stdout.split("\nlatency: ")

    # A check is its "  ok    " line and the indented lines after it; each
    # names its tolerance (bitwise, or the bound) and why ("as ...").
    checks = re.split(r"^  ok    ", checks_part, flags=re.M)[1:]
    assert len(checks) == 5, checks_part
    for check in checks:
        text = " ".join(check.split())
        bound = r"\|difference\| <= [\d.]+ \+ [\d.]+ x \|dense\|"
        tolerance = re.search(rf"tolerance: (bitwise|{bound}).*?, as \w", text)
        assert tolerance, text
        if tolerance.group(1) != "bitwise":
            assert re.search(r"max \|difference\| [\d.e-]+, no element past \d+% of its allowance", text), text

    # The table and the legend under it fit 100 columns; every op in the
    # table has its legend line, and every row its one baseline.
    lines = ("latency: " + table_part).splitlines()
    assert all(len(line) <= DEMO_COLUMNS for line in lines), [line for line in lines if len(line) > DEMO_COLUMNS]
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert lines[header].split() == ["op", "tokens", "rdna4_comm", "us", "baseline", "baseline", "us", "speedup"]
    rows = lines[header + 2:lines.index("what the rows time:")]
    cells = [row.rsplit(maxsplit=5) for row in rows]  # op names have spaces, no other cell does
    assert {op for op, *_ in cells} == set(DEMO_TABLE_OPS)
    assert all(baseline == ("rdna4_comm_unfused" if op == "TP MLP block" else "gloo")
               for op, _, _, baseline, _, _ in cells), rows
    legend = lines[lines.index("what the rows time:") + 1:]
    for op in DEMO_TABLE_OPS:
        assert any(line.startswith(f"  {op}  ") for line in legend), (op, legend)


@pytest.mark.parametrize("script, op, backends", [
    ("bench_allreduce.py", "all_reduce", {"rdna4_comm", "rdna4_comm_dist", "gloo"}),
    ("bench_ep.py", "dispatch+combine", {"rdna4_comm", "gloo"}),
    ("bench_fused.py", "all_reduce_rmsnorm", {"rdna4_comm", "rdna4_comm_unfused", "gloo"}),
])
def test_quick_benchmark(tmp_path, script, op, backends):
    out = tmp_path / "results.jsonl"
    cmd = [str(ROOT / "benchmarks" / script), "--quick", *FAST, "--out", str(out)]
    r = run(*cmd)
    assert r.returncode == 0, r.stdout + r.stderr

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    header, rows = lines[0], [x for x in lines[1:] if x["type"] == "result"]
    assert header["type"] == "header"
    assert header["world_size"] == 2 and header["transport"] == "cpu"
    assert {"torch", "rdna4_comm", "python"} <= set(header["versions"])
    assert header["device"] and header["timestamp"] and script in header["command"]
    assert rows and {x["backend"] for x in rows} == backends
    for x in rows:
        assert x["op"] == op and x["samples"] == 2 * 3
        assert 0 < x["p10_us"] <= x["p50_us"] <= x["p90_us"]
        assert x["ratio"] > 0 and (x["backend"] != "rdna4_comm" or x["ratio"] == 1.0)
    assert "speedup of rdna4_comm over gloo: geomean" in r.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0

    before = out.read_bytes()
    again = run(*cmd)
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr
    assert out.read_bytes() == before


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("world", [1, 2])
def test_bench_moe_layer_times_both_layouts_against_the_baselines(tmp_path, world):
    # Against the torch.distributed layer and the unconverted HF block; W = 1
    # is the one-GPU case (a world of one on CPUs here).
    out = tmp_path / "results.jsonl"
    r = run(str(ROOT / "benchmarks" / "bench_moe_layer.py"), "--quick", *FAST, "--tokens", "8", "--world", str(world),
            "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [x for x in map(json.loads, out.read_text().splitlines()) if x["type"] == "result"]
    assert {(x["op"], x["backend"]) for x in rows} == {
        (f"MoE layer ({layout} layout)", backend)
        for layout in ("rank", "expert") for backend in ("rdna4_comm", "gloo", "hf_block")}
    assert all(x["p50_us"] > 0 and x["tokens"] == 8 for x in rows)
    assert "speedup of rdna4_comm over hf_block" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_bench_moe_layer_takes_sizes_outside_its_sweep(tmp_path):
    # --tokens/--hidden replace the sweep's values (the documented H = 7168,
    # T = 4096 command on a GPU); on CPUs a small pair off the sweep.
    out = tmp_path / "results.jsonl"
    r = run(str(ROOT / "benchmarks" / "bench_moe_layer.py"), *FAST, "--world", "1", "--tokens", "5", "--hidden", "96",
            "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [x for x in map(json.loads, out.read_text().splitlines()) if x["type"] == "result"]
    assert rows and all(x["tokens"] == 5 and x["hidden"] == 96 for x in rows)


@pytest.mark.parametrize("transport", ["cpu", "dist"])
def test_bench_call_mismatch_times_every_rank_of_every_case(tmp_path, transport):
    out = tmp_path / "mismatch.jsonl"
    r = run(str(ROOT / "benchmarks" / "bench_call_mismatch.py"), "--transport", transport, "--world", "3",
            "--no-call-timeout-ms", "500", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["timeout_ms"] == 30_000
    rows = {x["case"]: x for x in lines[1:]}
    from rdna4_comm._bench.disagreeing_calls import CASES
    assert sorted(rows) == sorted([*CASES, "no_call"])
    for case in CASES:
        odd = 0 if case in ("skipped", "op_kind") else 2
        assert rows[case]["odd_rank"] == odd
        for rank in rows[case]["ranks"]:
            # Every rank raises, long before the 30 s timeout, naming its own call.
            assert rank["raised"] == "ValueError" and "disagree on round" in rank["message"], (case, rank)
            assert f"rank {rank['rank']} called" in rank["message"] and 0 < rank["after_ms"] < 1000, (case, rank)
    waited = [x for x in rows["no_call"]["ranks"] if x["rank"] != 1]
    assert all(x["raised"] == "RuntimeError" and x["after_ms"] >= 450 for x in waited), waited
    assert [x["raised"] for x in rows["no_call"]["ranks"] if x["rank"] == 1] == [None]
    assert "made no call" in r.stdout


def test_bench_ep_fp8_runs_beside_bf16_against_both_gathers(tmp_path):
    out = tmp_path / "ep_fp8.jsonl"
    r = run(str(ROOT / "benchmarks" / "bench_ep.py"), "--quick", *FAST, "--tokens", "8", "--hidden", "256",
            "--dispatch-dtype", "bf16", "fp8", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [x for x in map(json.loads, out.read_text().splitlines()) if x["type"] == "result"]
    assert {(x["op"], x["backend"]) for x in rows} == {
        ("dispatch+combine", "rdna4_comm"), ("dispatch+combine", "gloo"), ("dispatch+combine (fp8)", "rdna4_comm"),
        ("dispatch+combine (fp8)", "gloo"), ("dispatch+combine (fp8)", "gloo_fp8")}
    assert all(x["p50_us"] > 0 for x in rows)
    assert "speedup of rdna4_comm over gloo_fp8" in r.stdout


def test_bench_ep_cap_runs_a_decode_step_on_a_larger_capacity(tmp_path):
    out = tmp_path / "ep_cap.jsonl"
    cmd = [str(ROOT / "benchmarks" / "bench_ep.py"), "--quick", *FAST, "--tokens", "8", "--hidden", "256",
           "--cap", "64", "--out", str(out)]
    r = run(*cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [x for x in map(json.loads, out.read_text().splitlines()) if x["type"] == "result"]
    assert {x["backend"] for x in rows} == {"rdna4_comm", "gloo"}
    for x in rows:
        assert x["op"] == "dispatch+combine (cap 64)" and (x["tokens"], x["hidden"], x["cap"]) == (8, 256, 64)
        assert 0 < x["p50_us"]
    assert "dispatch+combine (cap 64)" in r.stdout and "cap 64" in r.stdout

    bad = run(str(ROOT / "benchmarks" / "bench_ep.py"), "--quick", *FAST, "--tokens", "8", "128", "--cap", "64",
              "--out", str(tmp_path / "bad.jsonl"))
    assert bad.returncode == 2 and "--cap 64 must be" in bad.stderr and not (tmp_path / "bad.jsonl").exists()


BENCH_KERNELS_ROWS = 13


def test_bench_kernels_on_cpu(tmp_path):
    """bench_kernels.py end to end on the CPU transport: every row, checked,
    with positive times and ratios, the header, no overwrite."""
    out = tmp_path / "kernels.jsonl"
    cmd = [str(ROOT / "benchmarks" / "bench_kernels.py"), "--device", "cpu", "--quick", "--out", str(out)]
    r = run(*cmd)
    assert r.returncode == 0, r.stdout + r.stderr

    table = [line for line in r.stdout.splitlines() if re.match(r"^ *\d+\s{2}", line)]
    assert [int(line.split()[0]) for line in table] == list(range(1, BENCH_KERNELS_ROWS + 1)), r.stdout
    for words in ("dispatch T=256 H=512 cap=256", "combine T=256 H=512 cap=256", "dispatch+combine T=8 H=256",
                  "dispatch+combine T=64 H=512", "decode d+c T=8 H=512 cap=256 vs cap=8",
                  "host: eager dispatch T=8 H=512", "host: eager combine T=8 H=512",
                  "expert decode d+c T=8 H=512 cap=8", "expert decode d+c T=8 H=512 cap=256",
                  "expert dispatch T=256 H=512 cap=256", "expert combine T=256 H=512 cap=256"):
        assert words in r.stdout
    for target in ("<= 1.1x", "<= 1.2x", "<= 1.3x", "<= 1.5x", "<= 6.5 us", "<= 1.25x", "<= 2.5x"):
        assert target in r.stdout
    assert "not judged on CPUs" in r.stdout

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    header, rows = lines[0], [x for x in lines if x["type"] == "result"]
    assert header["type"] == "header" and header["benchmark"] == "bench_kernels"
    assert header["world_size"] == 1 and header["transport"] == "cpu"
    assert {"torch", "rdna4_comm", "python"} <= set(header["versions"])
    assert header["device"] and header["timestamp"] and "bench_kernels.py" in header["command"]
    assert [x["row"] for x in rows] == list(range(1, BENCH_KERNELS_ROWS + 1))
    for x in rows:
        own = x["rdna4_comm"]
        assert 0 < own["p10_us"] <= own["p50_us"] <= own["p90_us"] and own["samples"] > 0
        assert x["met"] is None  # GPU targets: not judged on CPUs
        if x["row"] in (3, 4):
            assert x["baseline"] is None and x["ratio"] is None and x["target_kind"] == "us"
        else:
            assert x["baseline"]["p50_us"] > 0 and x["target_kind"] == "ratio"
            assert x["ratio"] == pytest.approx(own["p50_us"] / x["baseline"]["p50_us"]) and x["ratio"] > 0
    assert [x["measure"] for x in rows] == ["device"] * 5 + ["host"] * 2 + ["device"] * 6
    assert rows[4]["cap"] == 256 and rows[4]["baseline"]["op"] == "dc_decode"
    assert rows[7]["baseline"]["op"] == "copy" and rows[8]["baseline"]["op"] == "copy_fp8"
    assert [(x["cap"], x["baseline"]["op"]) for x in rows[9:11]] == [(8, "dc_decode"), (256, "dc_decode_bigcap")]

    before = out.read_bytes()
    again = run(*cmd)
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr
    assert out.read_bytes() == before


def test_bench_kernels_measures_the_rows_asked_for(tmp_path):
    out = tmp_path / "rows.jsonl"
    script = str(ROOT / "benchmarks" / "bench_kernels.py")
    r = run(script, "--device", "cpu", "--quick", "--rows", "10", "3", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    table = [line for line in r.stdout.splitlines() if re.match(r"^ *\d+\s{2}", line)]
    assert [int(line.split()[0]) for line in table] == [3, 10], r.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["rows"] == [3, 10]
    assert [x["row"] for x in lines if x["type"] == "result"] == [3, 10]
    bad = run(script, "--device", "cpu", "--rows", "0", str(BENCH_KERNELS_ROWS + 1), "--out", str(tmp_path / "x.jsonl"))
    assert bad.returncode == 2 and f"--rows must name rows 1 to {BENCH_KERNELS_ROWS}, got 0, {BENCH_KERNELS_ROWS + 1}" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()


def _bench_kernels_module():
    """benchmarks/bench_kernels.py as a module (for its ncu child's command line)."""
    if "bench_kernels" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "bench_kernels.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_kernels"] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["bench_kernels"]


ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
               "at::TensorIteratorBase &)::{lambda()#3}::operator()() const::{lambda(float)#1}, "
               "std::array<char *, 2UL>>(int, T2, T3)")
DISPATCH = ("rdna4_comm::gpu::(anonymous namespace)::dispatch_kernel(rdna4_comm::gpu::Env, "
            "rdna4_comm::gpu::DispatchArgs, int, int)")
COMBINE = ("rdna4_comm::gpu::(anonymous namespace)::combine_kernel(rdna4_comm::gpu::Env, "
           "rdna4_comm::gpu::CombineArgs, int, int)")


def test_bench_kernels_reads_ncu_csv_and_matches_its_kernels_to_the_ops():
    from _harness import ncu

    assert ncu.function_base(ELEMENTWISE) == "vectorized_elementwise_kernel"
    assert ncu.function_base(DISPATCH) == "dispatch_kernel" and ncu.function_base("combine_kernel") == "combine_kernel"

    cols = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
            "Grid Size", "Device", "CC", "dram__bytes.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "gpu__time_duration.sum", "smsp__inst_executed.sum", "smsp__warps_launched.sum"]

    def line(values):
        return ",".join(f'"{v}"' for v in values)

    def kernel(i, name, nbytes, pct, ns, inst, warps):
        return line([i, "99", "python3", "host", name, "1", "7", "(512, 1, 1)", "(66, 1, 1)", "0", "9.0",
                     nbytes, pct, ns, inst, warps])

    wide = "\n".join([
        "==PROF== Connected to process 99", line(cols), line([""] * 11 + ["byte", "%", "nsecond", "inst", "warp"]),
        kernel(0, ELEMENTWISE, "4,096", "1.50", "2,000", "8,192", "4"),
        kernel(1, DISPATCH, "117,440,512", "80.25", "40,000", "1,174,405", "1,056"),
        kernel(2, COMBINE, "117,440,512", "75", "50,000", "0", "0"),
    ])
    kernels = ncu.parse_ncu_csv(wide)
    assert [k["id"] for k in kernels] == [0, 1, 2]
    assert kernels[1]["dram__bytes.sum"] == 117_440_512 and kernels[1]["gpu__time_duration.sum"] == 40_000
    assert kernels[0]["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 1.5

    long_rows = [line(["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"])]
    for k in kernels:
        for metric in ncu.NCU_METRICS:
            unit = {"dram__bytes.sum": "Mbyte", "gpu__time_duration.sum": "usecond"}.get(metric, "")
            value = k[metric] / {"Mbyte": 1e6, "usecond": 1e3}.get(unit, 1)
            long_rows.append(line([k["id"], k["name"], metric, unit, f"{value:.9g}"]))
    assert ncu.parse_ncu_csv("\n".join(long_rows)) == kernels

    by_op = ncu.match_ncu(kernels, {"dispatch": [ELEMENTWISE, DISPATCH], "copy": [], "combine": [COMBINE]},
                          ("dispatch", "copy", "combine"))
    assert [k["kernel"] for k in by_op["dispatch"]] == ["vectorized_elementwise_kernel", "dispatch_kernel"]
    assert by_op["copy"] == [] and by_op["combine"][0]["inst_per_byte"] == 0
    d = by_op["dispatch"][1]
    assert d["time_us"] == 40 and d["dram_gbs"] == pytest.approx(117_440_512 / 40_000)
    assert d["inst_per_byte"] == pytest.approx(1_174_405 / 117_440_512)
    assert d["warps"] == 1056 and d["inst_per_warp"] == pytest.approx(1_174_405 / 1056)
    assert by_op["dispatch"][0]["inst_per_warp"] == 2048 and math.isnan(by_op["combine"][0]["inst_per_warp"])
    total = ncu.aggregate(by_op["dispatch"])
    assert total["kernels"] == 2 and total["time_us"] == 42 and total["dram_bytes"] == 117_440_512 + 4096
    assert total["dram_pct"] == pytest.approx((1.5 * 2 + 80.25 * 40) / 42)
    with pytest.raises(ValueError, match="profiled 3 kernels"):
        ncu.match_ncu(kernels, {"dispatch": [DISPATCH], "combine": [COMBINE]}, ("dispatch", "combine"))
    with pytest.raises(ValueError, match="torch.profiler saw"):
        ncu.match_ncu(kernels, {"combine": [COMBINE, DISPATCH, ELEMENTWISE]}, ("combine",))


def test_bench_kernels_groups_profiler_events_by_call():
    """The device activities of a torch.profiler trace go to the call whose
    record_function range launched them (through the launching op, else by
    time); range annotations on the GPU timeline and syncs are left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from _harness import profiling

    a = profiling.ANNOTATION

    def ev(id_, name, start, end, kind, device=DeviceType.CPU, linked=0, parent=None):
        return SimpleNamespace(id=id_, name=name, time_range=SimpleNamespace(start=start, end=end),
                               activity_type=kind, device_type=device, linked_correlation_id=linked, cpu_parent=parent)

    r0 = ev(1, f"{a}dispatch#0", 0, 10, "user_annotation")
    op0 = ev(2, "rdna4_comm::dispatch", 1, 9, "cpu_op", parent=r0)
    r1 = ev(3, f"{a}copy#0", 20, 30, "user_annotation")
    op1 = ev(4, "aten::copy_", 21, 29, "cpu_op", parent=r1)
    launch = ev(50, "cudaLaunchKernel", 2, 3, "cuda_runtime", linked=2)
    events = [r0, op0, r1, op1, launch,
              ev(100, DISPATCH, 5, 12, "kernel", DeviceType.CUDA, linked=2),
              ev(101, ELEMENTWISE, 13, 14, "kernel", DeviceType.CUDA, linked=2),
              ev(102, f"{a}dispatch#0", 5, 14, "gpu_user_annotation", DeviceType.CUDA, linked=1),
              ev(103, "Memcpy DtoD (Device -> Device)", 24, 28, "gpu_memcpy", DeviceType.CUDA, linked=0),
              ev(104, "Event Sync", 28, 29, "cuda_sync", DeviceType.CUDA, linked=4)]
    got = profiling.attribute_device_events(events)
    assert got == {"dispatch#0": [(DISPATCH, "kernel", 7), (ELEMENTWISE, "kernel", 1)],
                   "copy#0": [("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 4)]}
    with pytest.raises(RuntimeError, match="in no timed call"):
        profiling.attribute_device_events([r1, ev(105, COMBINE, 1, 2, "kernel", DeviceType.CUDA)])


def test_bench_kernels_runs_ncu_and_reads_its_report(tmp_path):
    """run_ncu's plumbing against a stand-in ncu (a script): the profiling
    command (flags, bench_kernels' child command line), the --import of the
    report it wrote, and the kernels split into the ops; and a failing ncu
    reported."""
    from _harness import ncu

    bk = _bench_kernels_module()
    csv_text = "\n".join([
        '"ID","Kernel Name","dram__bytes.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",'
        '"gpu__time_duration.sum","smsp__inst_executed.sum","smsp__warps_launched.sum"',
        '"","","byte","%","nsecond","inst","warp"',
        f'"0","{DISPATCH}","1000","50","100","10","5"',
        f'"1","{COMBINE}","2000","60","200","20","4"',
    ])
    (tmp_path / "report.csv").write_text(csv_text + "\n")
    fake = tmp_path / "ncu"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/calls
case "$1" in
  --import) cat {tmp_path}/report.csv ;;
  *) while [ $# -gt 0 ]; do [ "$1" = --export ] && touch "$2.ncu-rep"; shift; done ;;
esac
""")
    fake.chmod(0o755)
    expected = {k: [] for k in bk.NCU_OPS}
    expected["dispatch"], expected["combine"] = [DISPATCH], [COMBINE]
    got, why = ncu.run_ncu(str(fake), bk.ncu_child_command(["--device", "cuda"]), expected, bk.NCU_OPS)
    assert why == "" and got["dispatch"][0]["dram_gbs"] == 10 and got["combine"][0]["inst_per_byte"] == 0.01
    assert got["dispatch"][0]["inst_per_warp"] == 2 and got["combine"][0]["inst_per_warp"] == 5
    profile, imported = (tmp_path / "calls").read_text().splitlines()
    for flag in ("--profile-from-start off", "--kernel-name-base demangled",
                 f"--kernel-name regex:{ncu.NCU_KERNEL_REGEX}", "--metrics " + ",".join(ncu.NCU_METRICS),
                 "--launch-count 18", "bench_kernels.py --ncu-child --device cuda"):
        assert flag in profile
    assert imported.startswith("--import ") and imported.endswith("--csv --page raw --print-units base")

    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM' >&2\nexit 1\n")
    got, why = ncu.run_ncu(str(fake), bk.ncu_child_command([]), expected, bk.NCU_OPS)
    assert got is None and "exited with 1" in why and "ERR_NVGPUCTRPERM" in why


def test_auto_world_is_the_library_choice_for_one_process_per_gpu():
    """--transport auto (benchmarks, demo) means what it means to a
    Communicator: choose_transport over the world's ranks, here one process
    per usable GPU where there are 2 or more, else 2 CPU processes."""
    from rdna4_comm._bench.world import resolve_world
    from rdna4_comm._ranks import usable_gpus
    from rdna4_comm.transport_policy import choose_transport, device_report

    gpus = usable_gpus()
    transport, world = resolve_world("auto")
    if gpus < 2:
        assert (transport, world) == ("cpu", 2)
    else:
        reports = [device_report(d) for d in range(gpus)]
        expected = choose_transport("auto", reports, with_gpu=True, allow_shared_gpu=False).transport
        assert (transport, world) == (expected, gpus) and transport in ("gpu", "dist")
    assert resolve_world("auto", 3)[1] == 3
    assert resolve_world("cpu") == ("cpu", 2)
    # "dist" takes the GPUs where there are any, as a Communicator's does, else CPU processes.
    assert resolve_world("dist") == ("dist", gpus if gpus else 2)
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'cpu', 'dist', 'gpu'\)"):
        resolve_world("nccl")


def ncu_source_page(path, columns: list, instructions: list):
    """ncu --page source --csv --print-source sass, in its recorded format:
    a kernel-name line (void k(int)), the column names (Address, then
    ``columns``), one line per instruction (its address, then its values)."""
    lines = ['"Kernel Name","void k(int)",', ",".join(f'"{c}"' for c in ["Address", *columns])]
    lines += [",".join(f'"{v}"' for v in (f"0x{16 * n:x}", *row)) for n, row in enumerate(instructions)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_ncu_stalls_cuts_a_kernel_at_its_barriers(tmp_path):
    cols = ["Source", "# Samples", "Instructions Executed", "stall_barrier", "stall_long_sb",
            "stall_barrier (Not Issued)"]
    ins = [("LDG.E R2, [R4]", 5, 16, 0, 0, 0), ("IADD3 R0, R2, 0x1", 30, 16, 0, 30, 0),
           ("BAR.SYNC.DEFER_BLOCKING 0x0", 60, 16, 60, 0, 0), ("STG.E [R6], R0", 5, 16, 0, 5, 0),
           ("EXIT", 0, 16, 0, 0, 0), ("BRA 0x0", 0, 0, 0, 0, 0)]
    page = ncu_source_page(tmp_path / "page.csv", cols, ins)
    r = run("benchmarks/ncu_stalls.py", str(page), "--top", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "void k(int)" in out and "samples 100, warp instructions executed 80" in out
    # Two pieces: up to the barrier (95 samples), then up to the exit (5).
    assert re.search(r"0-2\s+95\s+95\.0%\s+48\s+BAR\.SYNC", out), out
    assert re.search(r"3-4\s+5\s+5\.0%\s+32\s+EXIT\s+long_sb 5", out), out
    assert "barrier 60" in out and "long_sb 35" in out
    assert "instructions run at least once 5 of 6" in out


def test_ncu_stalls_adds_the_samples_outside_barrier_waits_by_source_line(tmp_path):
    # A page of one kernel, and nvdisasm -g -c output holding that kernel
    # (its opcodes, predicated or not) after one that is not it: the
    # barrier's wait leaves the lines, the working warps' samples stay.
    cols = ["Source", "# Samples", "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_no_instructions"]
    ins = [("LDG.E R2, [R4]", 5, 16, 0, 0, 5), ("@P0 IADD3 R0, R2, 0x1", 30, 16, 0, 30, 0),
           ("BAR.SYNC.DEFER_BLOCKING 0x0", 60, 16, 60, 0, 0), ("STG.E [R6], R0", 5, 16, 0, 5, 0)]
    page = ncu_source_page(tmp_path / "page.csv", cols, ins)
    src = tmp_path / "k.cu"
    src.write_text("int x = load();\nint y = x + 1;\n__syncthreads();\n")
    sass = tmp_path / "k.sass"
    sass.write_text("\n".join([
        ".text._Z5otheri:", "        /*0000*/                   EXIT ;",
        ".text._Z1ki:",
        f'\t//## File "{src}", line 1', "        /*0000*/                   LDG.E R2, [R4] ;",
        f'\t//## File "{src}", line 2', "        /*0010*/               @P0 IADD3 R0, R2, 0x1 ;",
        f'\t//## File "{src}", line 3', "        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        f'\t//## File "{src}", line 2', "        /*0030*/                   STG.E [R6], R0 ;", ""]))
    r = run("benchmarks/ncu_stalls.py", str(page), "--lines", str(sass))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "outside barrier waits: samples 40, long_sb 35, no_instructions 5" in out, out
    assert re.search(r"35\s+87\.5%\s+\S*k\.cu:2\s+int y = x \+ 1;\s+long_sb 35", out), out
    assert re.search(r"5\s+12\.5%\s+\S*k\.cu:1\s+int x = load\(\);\s+no_instructions 5", out), out
    assert "k.cu:3" not in out
    # A SASS without the kernel says so.
    other = tmp_path / "other.sass"
    other.write_text(".text._Z5otheri:\n        /*0000*/                   EXIT ;\n")
    r = run("benchmarks/ncu_stalls.py", str(page), "--lines", str(other))
    assert r.returncode == 0 and "the SASS given does not hold this kernel" in r.stdout, r.stdout + r.stderr
