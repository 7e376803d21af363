"""Bounded exchanges for Communicator construction.

Construction exchanges small records between the ranks of a group (process
identities, heap handles, probe results). Through torch.distributed's
collectives a rank that dies or never constructs would hold the others for
the process group's timeout (30 minutes for gloo by default). Here every
exchange goes through the group's key-value store instead and waits at most
until the communicator's deadline, polling: a rank that has not published
its record by then is named in the error, and once the ranks' processes are
known, a rank whose process exits is named at once.
"""
from __future__ import annotations

import glob
import os
import pickle
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import _C

POLL_S = 0.005
# Constructions per group in this process: every rank of a group constructs
# its communicators in the same order, so the n-th construction's keys agree.
_constructions: dict[str, int] = {}


class Rendezvous:
    """The exchanges of one construction over ``group``, bounded by ``timeout_ms``
    from the moment it starts."""

    def __init__(self, group: dist.ProcessGroup, timeout_ms: int):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        name = group.group_name
        n = _constructions[name] = _constructions.get(name, 0) + 1
        self.prefix = f"rdna4_comm/{name}/{n}"
        self.store = dist.distributed_c10d._get_default_store()
        self.timeout_ms = timeout_ms
        self.deadline = time.monotonic() + timeout_ms / 1000
        self.processes: Optional[list[tuple[int, int]]] = None  # (pid, start time) per rank, same host only

    def exchange(self, stage: str, value: Any) -> list:
        """Publish ``value`` and return every rank's, in rank order. Raises
        RuntimeError naming the ranks that did not arrive in time, or whose
        process exited."""
        key = f"{self.prefix}/{stage}/"
        self.store.set(key + str(self.rank), pickle.dumps(value))
        pending = [r for r in range(self.world) if r != self.rank]
        while True:
            pending = [r for r in pending if not self.store.check([key + str(r)])]
            if not pending:
                break
            failed = [r for r in pending if self.store.check([self._failure_key(r)])]
            if failed:
                raise RuntimeError(f"Communicator: construction failed on rank {failed[0]}: "
                                   + self.store.get(self._failure_key(failed[0])).decode())
            exited = [r for r in pending if not self._alive(r)]
            if exited:
                raise RuntimeError(
                    f"Communicator: ranks {exited} exited during construction (stage {stage!r}); "
                    f"rank {self.rank} gave up waiting for them"
                )
            if time.monotonic() > self.deadline:
                raise RuntimeError(
                    f"Communicator: ranks {pending} did not arrive at construction stage {stage!r} within "
                    f"{self.timeout_ms} ms (timeout_ms); they never constructed this communicator, or hang"
                )
            time.sleep(POLL_S)
        return [value if r == self.rank else pickle.loads(self.store.get(key + str(r))) for r in range(self.world)]

    def own_group(self, group: dist.ProcessGroup, name: str, backend: str, timeout: timedelta) -> dist.ProcessGroup:
        """A new process group of the ranks of ``group`` (collective over them),
        named ``name`` as rank 0 gives it.

        dist.new_group names a group either by a world-wide counter (then
        every rank of the world must call it, members of ``group`` or not) or,
        with use_local_synchronization, by its ranks alone (then two groups
        of the same ranks collide in the store). Its helper takes a name,
        which must be unique and the same on every rank."""
        name = self.exchange("dist_group", name)[0]
        ranks = dist.get_process_group_ranks(group)
        pg, _ = c10d._new_process_group_helper(len(ranks), self.rank, ranks, dist.Backend(backend),
                                               c10d._get_default_store(), name, timeout=timeout,
                                               group_desc="rdna4_comm transport 'dist'")
        c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(ranks)}  # as new_group records it
        return pg

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks that this rank's construction failed, so they
        raise at once instead of at the deadline."""
        self.store.set(self._failure_key(self.rank), f"{type(error).__name__}: {error}".encode())

    def _failure_key(self, rank: int) -> str:
        return f"{self.prefix}/failed/{rank}"

    def _alive(self, rank: int) -> bool:
        if self.processes is None or self.processes[rank] is None:
            return True  # unknown yet, or on another host: the deadline bounds it
        pid, start = self.processes[rank]
        return _C.process_alive(pid, start)

    def remove_segments_of_exited(self) -> None:
        """Unlink the CPU transport segments that exited ranks created but never
        got to unlink (names start with the creator's pid, csrc/cpu)."""
        for proc in self.processes or []:
            if proc is not None and not _C.process_alive(*proc):
                for path in glob.glob(f"/dev/shm/rdna4_comm.{proc[0]}.*"):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
