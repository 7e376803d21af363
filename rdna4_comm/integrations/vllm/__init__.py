"""vLLM plugin: vLLM's tensor-parallel all_reduce and its expert-parallel
dispatch/combine over rdna4_comm, with no edit to vLLM.

Install rdna4_comm beside vLLM and name the plugin (vLLM loads every
installed plugin when ``VLLM_PLUGINS`` is unset; this one then does nothing,
so an engine that did not ask for it is never changed)::

    VLLM_PLUGINS=rdna4_comm vllm serve MODEL --tensor-parallel-size 2 \\
        --additional-config '{"rdna4_comm": {}}'

    # offline: the same variable, and additional_config={"rdna4_comm": {...}} in LLM(...)

What it routes (docs/integrations.md, "vLLM"):

- the all_reduce of every tensor-parallel group: ``comm.all_reduce`` of a
  communicator over that group (:mod:`.collectives`);
- the MoE layers' dispatch and combine where vLLM runs expert parallelism,
  as a prepare/finalize of vLLM's modular MoE kernel: the rank layout for
  experts of the Standard format, the expert layout for BatchedExperts
  (:mod:`.moe`); with tensor parallelism, each rank of a TP group dispatches
  its share of the group's tokens and the shares meet again in an all_reduce;
- on CUDA/ROCm, a compile pass that fuses the all_reduce with the fused
  residual add + RMSNorm that follows it (:mod:`.fusion`).

Options: :class:`.config.PluginConfig` (the keys of
``additional_config["rdna4_comm"]``). The plugin refuses vLLM versions it was
not tested with (:data:`TESTED_VLLM_VERSIONS`) unless
``RDNA4_COMM_VLLM_UNTESTED=1``.
"""
from __future__ import annotations

import os

PLUGIN_NAME = "rdna4_comm"
TESTED_VLLM_VERSIONS = ("0.32.0",)
UNTESTED_ENV = "RDNA4_COMM_VLLM_UNTESTED"

_installed = False


def requested(env: "dict[str, str] | os._Environ" = os.environ) -> bool:
    """Whether ``VLLM_PLUGINS`` (comma-separated) names this plugin. Unset,
    vLLM loads every installed plugin: this one then stays out of the way."""
    names = env.get("VLLM_PLUGINS")
    return names is not None and PLUGIN_NAME in (n.strip() for n in names.split(","))


def check_version(version: str, env: "dict[str, str] | os._Environ" = os.environ) -> None:
    """Raise RuntimeError unless ``version`` was tested or ``RDNA4_COMM_VLLM_UNTESTED=1``."""
    if version in TESTED_VLLM_VERSIONS or env.get(UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"rdna4_comm's vLLM plugin was tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}, not {version}: it "
        f"patches vLLM internals that change between releases. Install a tested version, leave "
        f"{PLUGIN_NAME!r} out of VLLM_PLUGINS, or set {UNTESTED_ENV}=1 to try anyway"
    )


def register() -> None:
    """The ``vllm.general_plugins`` entry point. vLLM calls it in every
    process (front end, engine core, workers) before it creates its process
    groups and builds the model; communicators are created later, collectively,
    when the groups and the MoE layers exist."""
    global _installed
    if _installed or not requested():
        return
    import vllm

    check_version(vllm.__version__)
    from . import collectives, fusion, moe

    collectives.install()
    moe.install()
    fusion.install()
    _installed = True
