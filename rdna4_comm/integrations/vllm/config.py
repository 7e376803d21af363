"""The plugin's options: vLLM's ``additional_config={"rdna4_comm": {...}}``
(``--additional-config '{"rdna4_comm": {...}}'`` on the command line), which
vLLM hashes into its compile cache key. ``{}`` means the defaults."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ...transport_policy import TRANSPORTS


@dataclass(frozen=True)
class PluginConfig:
    """Keys of ``additional_config["rdna4_comm"]``.

    - ``all_reduce`` (True): every tensor-parallel group's all_reduce goes
      through ``comm.all_reduce``.
    - ``expert_parallel`` (True): where vLLM runs expert parallelism, the MoE
      layers' dispatch and combine go through ``comm.dispatch`` and
      ``comm.combine``.
    - ``fuse_all_reduce_rmsnorm`` (True): on CUDA/ROCm, where vLLM compiles,
      an all_reduce followed by vLLM's fused residual add + RMSNorm becomes
      one ``comm.all_reduce_rmsnorm``.
    - ``transport`` ("auto"): the communicators' transport ("auto", "gpu",
      "cpu" or "dist"; see docs/transports.md).
    - ``timeout_ms`` (None: the library's default): the bound of every wait.
    - ``max_tokens_per_rank`` (None: vLLM's ``max_num_batched_tokens``, split
      over the tensor-parallel ranks): the most tokens one rank dispatches
      in one MoE layer; it sizes the receive buffers.
    - ``strict`` (False): vLLM's own all_reduce of the tensor-parallel groups
      and its own all2all of the expert-parallel groups raise, and a MoE layer
      the plugin cannot route is an error instead of a warning: nothing goes
      around the library unnoticed.
    """

    all_reduce: bool = True
    expert_parallel: bool = True
    fuse_all_reduce_rmsnorm: bool = True
    transport: str = "auto"
    timeout_ms: Optional[int] = None
    max_tokens_per_rank: Optional[int] = None
    strict: bool = False

    @classmethod
    def from_additional_config(cls, additional_config: Optional[dict]) -> "PluginConfig":
        """The options under ``"rdna4_comm"``; ValueError for an unknown key
        or a value of the wrong kind, naming it."""
        raw: Any = (additional_config or {}).get("rdna4_comm", {})
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f'rdna4_comm: additional_config["rdna4_comm"] must be a dict, got {raw!r}')
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f'rdna4_comm: unknown key(s) {unknown} in additional_config["rdna4_comm"]; '
                             f"the keys are {sorted(known)}")
        for key in ("all_reduce", "expert_parallel", "fuse_all_reduce_rmsnorm", "strict"):
            if key in raw and not isinstance(raw[key], bool):
                raise ValueError(f'rdna4_comm: additional_config["rdna4_comm"]["{key}"] must be true or false, '
                                 f"got {raw[key]!r}")
        if raw.get("transport", "auto") not in TRANSPORTS:
            raise ValueError(f'rdna4_comm: additional_config["rdna4_comm"]["transport"] must be one of '
                             f"{TRANSPORTS}, got {raw['transport']!r}")
        for key in ("timeout_ms", "max_tokens_per_rank"):
            value = raw.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f'rdna4_comm: additional_config["rdna4_comm"]["{key}"] must be a positive '
                                 f"integer or null, got {value!r}")
        return cls(**raw)


def current() -> PluginConfig:
    """The options of the vLLM config being built or run in this process."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        raise RuntimeError("rdna4_comm: no current vLLM config; the plugin reads its options from it")
    return PluginConfig.from_additional_config(config.additional_config)
