"""The demo and both benchmarks, end to end on CPU processes (--quick), as a
user runs them: they succeed, the results file has its header and positive
times, an existing results file is never overwritten, the heatmap is saved."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--transport", "cpu", "--world", "2", "--rounds", "2", "--samples", "3"]
TIMEOUT_S = 180


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_demo_checks_pass_and_prints_a_latency_table():
    r = run("-m", "rdna4_comm.demo", *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world of 2 (CPU processes" in r.stdout
    assert r.stdout.count("  ok    ") == 4 and "FAIL" not in r.stdout
    assert "TP MLP block" in r.stdout and "rdna4_comm_unfused p50 us" in r.stdout
    assert "rdna4_comm p50 us" in r.stdout and "gloo p50 us" in r.stdout
    assert "demo: all checks passed" in r.stdout


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
