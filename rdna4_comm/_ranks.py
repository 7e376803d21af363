"""The rank context of every world of processes the package starts: the
tests' (tests/harness.py), the benchmarks' and the demo's
(:mod:`rdna4_comm._bench`) and the doctor's (:mod:`rdna4_comm.doctor`).
One class, :class:`RankContext`; each kind of world only picks the device
and whether NCCL joins (:func:`bench_rank`; the tests, the doctor and
benchmarks/bench_kernels.py build theirs where they start their worlds)."""
from __future__ import annotations

import gc
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _C
from ._launch import Member
from .transport_policy import TRANSPORT_RECORDS


class CheckFailed(AssertionError):
    """A result check failed on at least one rank (raised on every rank)."""


def usable_gpus() -> int:
    """GPUs the GPU transport can use here: 0 unless rdna4_comm was built with
    GPU support and torch sees GPUs."""
    if not (_C.with_gpu and torch.cuda.is_available()):
        return 0
    return min(torch.cuda.device_count(), TRANSPORT_RECORDS["gpu"].max_world)


class RankContext:
    """One rank of a world: ``rank``, ``world``, ``transport`` (the
    communicators' default), ``device``, and its process groups.

    - ``cpu_group``: gloo; bootstraps communicators and carries barriers,
      check verdicts and timings, so none of that touches a GPU being measured.
    - ``group``: where torch.distributed baselines run: NCCL (RCCL on ROCm)
      over the GPUs with ``nccl``, else the gloo group.

    ``member`` (of rdna4_comm._launch) is how rank 0 streams messages to the
    launching process (:meth:`emit`); a world of one process has none.
    ``baseline`` names what the benchmarks compare with where that is not
    ``group``'s backend (a world of one: torch's own ops).
    """

    MAX_CACHED_COMMS = 6

    def __init__(self, rank: int, world: int, transport: str, device: torch.device, init_method: str, *,
                 nccl: bool = False, member: Optional[Member] = None, baseline: Optional[str] = None):
        self.rank, self.world, self.transport, self.device = rank, world, transport, device
        self._member, self._baseline = member, baseline
        self._comms: dict = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init = dict(init_method=init_method, rank=rank, world_size=world)
        if nccl:
            # device_id makes NCCL set up its communicator now, not inside a capture.
            dist.init_process_group("nccl", device_id=device, **init)
            self.cpu_group = dist.new_group(backend="gloo")
        else:
            dist.init_process_group("gloo", **init)
            self.cpu_group = dist.group.WORLD
        self.group = dist.group.WORLD

    @property
    def baseline(self) -> str:
        """What the benchmarks compare with: the torch.distributed backend of
        ``group`` (nccl, rccl or gloo) unless the world said otherwise."""
        if self._baseline is not None:
            return self._baseline
        name = str(dist.get_backend(self.group))
        return "rccl" if name == "nccl" and torch.version.hip else name

    @property
    def captures_graphs(self) -> bool:
        """Whether this rank's ops can be captured in CUDA graphs: on GPUs,
        except a transport over a process group where ranks share a GPU (NCCL
        refuses that, so the group is gloo, which synchronises the stream on
        the host)."""
        record = TRANSPORT_RECORDS[self.transport]
        return (self.device.type == "cuda" and record.graph_capture
                and (not record.process_group or torch.cuda.device_count() >= self.world))

    def comm(self, **kwargs):
        """A communicator with these arguments (transport: this rank's unless
        given), created collectively on first use and cached; past
        MAX_CACHED_COMMS the least recently asked for is closed (so a caller
        holding the few it asked for last keeps them open). Every rank must
        ask for the same ones in the same order."""
        import rdna4_comm as rc

        key = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
        c = self._comms.pop(key, None)
        if c is None or c.closed:
            if len(self._comms) >= self.MAX_CACHED_COMMS:
                self._comms.pop(next(iter(self._comms))).close()
            kwargs.setdefault("transport", self.transport)
            c = rc.Communicator(**kwargs)
        self._comms[key] = c
        return c

    def drop_comms(self) -> None:
        for c in self._comms.values():
            c.close()
        self._comms.clear()

    def emit(self, obj: Any) -> None:
        """Send ``obj`` (picklable) to the launching process. Only rank 0 sends;
        on other ranks this does nothing, so callers need not branch on rank."""
        if self.rank == 0 and self._member is not None:
            self._member.tell(obj)

    def note(self, text: str) -> None:
        """Emit a note for the launching process to print."""
        self.emit({"note": text})

    def errors(self, error: Optional[str]) -> list[str]:
        """Collective: every rank passes its error (or None) and gets all of
        them, as "rank r: error" lines; so all ranks take the same branch."""
        # As UTF-8 bytes in tensors, not all_gather_object: that one needs
        # numpy, which torch does not require.
        mine = torch.tensor(list((error or "").encode()), dtype=torch.uint8)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(lengths, torch.tensor([mine.numel()]), group=self.cpu_group)
        longest = max(int(n) for n in lengths)
        padded = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(padded, torch.cat([mine, mine.new_zeros(longest - mine.numel())]), group=self.cpu_group)
        texts = [bytes(p[:int(n)].tolist()).decode() for p, n in zip(padded, lengths)]
        return [f"rank {r}: {t}" for r, t in enumerate(texts) if t]

    def agree(self, error: Optional[str], what: str) -> None:
        """Collective: raise :class:`CheckFailed` on every rank if any rank
        passes an error, so that no rank is left waiting in a later collective."""
        bad = self.errors(error)
        if bad:
            raise CheckFailed(f"{what}:\n" + "\n".join(bad))

    def sync(self) -> None:
        """Wait for this rank's queued GPU work (CPU: nothing to wait for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Return freed memory (GPU: to the driver) between configurations."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Close the cached communicators, wait for the GPU's queued work, then
        leave the process groups."""
        self.drop_comms()
        self.sync()
        dist.destroy_process_group()


def runs_on_gpus(transport: str) -> bool:
    """Whether a rank of ``transport`` takes a GPU: always where it runs the
    GPU kernels, where it takes device tensors when this process sees a usable
    GPU (then every rank of one host does)."""
    record = TRANSPORT_RECORDS[transport]
    return record.device_kernels or (record.device_tensors and usable_gpus() > 0)


def bench_rank(member: Member, transport: str) -> RankContext:
    """A rank of a benchmark or demo world: one process per GPU (transport
    "gpu", or "dist" where GPUs are usable; NCCL for the baselines) or a CPU
    process."""
    # The CPU reference checks are the only heavy host work; share the cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // member.world))
    on_gpu = runs_on_gpus(transport)
    device = torch.device("cuda", member.rank) if on_gpu else torch.device("cpu")
    return RankContext(member.rank, member.world, transport, device, member.init_method, nccl=on_gpu, member=member)

