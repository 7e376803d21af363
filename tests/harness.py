"""Multi-process test harness.

A :class:`World` spawns W ranks once (spawning costs seconds: a test module
feeds one world many cases, hypothesis examples included), through
rdna4_comm._launch. Each rank runs module-level task functions
``task(ctx, *args)``, with ``ctx`` its rdna4_comm._ranks.RankContext; :meth:`World.run` runs
one task on every rank and returns the results in rank order, or raises with
every failing rank's traceback. Results come back pickled by value, tensors
moved to the CPU.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from rdna4_comm._launch import Member, ProcessWorld
from rdna4_comm._ranks import RankContext, runs_on_gpus

TASK_TIMEOUT_S = float(os.environ.get("RDNA4_COMM_TEST_TASK_TIMEOUT_S", 300))


def _setup(member: Member, transport: str, env_of_rank: dict) -> RankContext:
    os.environ.update(env_of_rank.get(member.rank, {}))
    torch.set_num_threads(1)

    # Ranks share GPUs round-robin where there are fewer GPUs than ranks
    # (only with RDNA4_COMM_ALLOW_SHARED_GPU=1; see gpu_world_sizes).
    on_gpu = runs_on_gpus(transport)
    device = torch.device("cuda", member.rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    return RankContext(member.rank, member.world, transport, device, member.init_method, member=member)


class World(ProcessWorld):
    """``size`` ranks on ``transport``, each with a gloo process group;
    ``env_of_rank`` maps a rank to environment variables set in its process
    before anything else (e.g. RDNA4_COMM_HOST_ID: simulated hosts)."""

    def __init__(self, size: int, transport: str = "cpu", env_of_rank: Optional[dict] = None):
        super().__init__(size, _setup, (transport, env_of_rank or {}))
        self.transport = transport

    def run(self, fn, *args, per_rank=None, timeout: float = TASK_TIMEOUT_S, ranks=None, dies=()):
        """Run ``fn(ctx, *args, *per_rank[r])`` on every rank (or only ``ranks``);
        the ranks of ``dies`` may die meanwhile (see ProcessWorld.call)."""
        ranks = range(self.size) if ranks is None else ranks
        return self.call(fn, {r: args + (tuple(per_rank[r]) if per_rank is not None else ()) for r in ranks},
                         timeout=timeout, dies=dies)
