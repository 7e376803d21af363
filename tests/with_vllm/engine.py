"""One vLLM engine run in a process of its own (generate.py here), with or
without the plugin: for tests/test_vllm.py and benchmarks/bench_vllm.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

GENERATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.py")


def generate(spec: dict, plugin: bool, cache_root: str, timeout_s: float) -> dict:
    """generate.py's result for ``spec``; RuntimeError with its stderr's tail when it fails."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1" if spec.get("tp", 1) * spec.get("dp", 1) > 1 else "0",
               VLLM_CACHE_ROOT=cache_root)
    if plugin:
        env["VLLM_PLUGINS"] = "rdna4_comm"
    else:
        env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run([sys.executable, GENERATE, json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run {spec} (plugin {plugin}) exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])
