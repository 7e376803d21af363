"""Multi-process test harness.

A :class:`World` spawns W ranks once (spawning costs seconds: a test module
feeds one world many cases, hypothesis examples included), through
rdna4_comm._launch. Each rank runs module-level task functions
``task(ctx, *args)``, with ``ctx`` its :class:`Rank`; :meth:`World.run` runs
one task on every rank and returns the results in rank order, or raises with
every failing rank's traceback. Results come back pickled by value, tensors
moved to the CPU.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from rdna4_comm._launch import Member, ProcessWorld

TASK_TIMEOUT_S = float(os.environ.get("RDNA4_COMM_TEST_TASK_TIMEOUT_S", 300))


class Rank:
    """Per-rank state that tasks share: rank, world size, transport, device,
    and communicators cached by their constructor arguments."""

    MAX_CACHED = 6

    def __init__(self, rank: int, world: int, transport: str):
        import rdna4_comm as rc

        self.rank, self.world, self.transport = rank, world, transport
        # Ranks share GPUs round-robin where there are fewer GPUs than ranks
        # (only with RDNA4_COMM_ALLOW_SHARED_GPU=1; see gpu_world_sizes).
        # "dist" runs on the GPUs where every rank has one.
        on_gpu = transport == "gpu" or (transport == "dist" and rc._C.with_gpu and torch.cuda.is_available())
        self.device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
        self._comms: dict = {}

    @property
    def captures_graphs(self) -> bool:
        """Whether this rank's ops can be captured in CUDA graphs: on GPUs,
        except transport "dist" where ranks share a GPU (NCCL refuses that, so
        its group is gloo, which synchronises the stream on the host)."""
        return self.device.type == "cuda" and (self.transport != "dist" or torch.cuda.device_count() >= self.world)

    def comm(self, **kwargs):
        """A communicator with these arguments, created collectively on first use.
        Every rank must ask for the same ones in the same order."""
        import rdna4_comm as rc

        key = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
        c = self._comms.get(key)
        if c is None or c.closed:
            if len(self._comms) >= self.MAX_CACHED:
                old = next(iter(self._comms))
                self._comms.pop(old).close()
            kwargs.setdefault("transport", self.transport)
            c = self._comms[key] = rc.Communicator(**kwargs)
        return c

    def drop_comms(self):
        for c in self._comms.values():
            c.close()
        self._comms.clear()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self):
        self.drop_comms()
        dist.destroy_process_group()


def _setup(member: Member, transport: str, env_of_rank: dict) -> Rank:
    os.environ.update(env_of_rank.get(member.rank, {}))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=member.init_method, rank=member.rank, world_size=member.world)
    ctx = Rank(member.rank, member.world, transport)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    return ctx


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
