"""Which transport a communicator's ranks take, and what they tell each
other to decide it: this host's identity, each rank's GPU and its peer
access (:class:`RankReport`), and :func:`choose_transport`, a pure function
of the reports, so every rank that sees the same reports chooses the same
(docs/transports.md)."""
from __future__ import annotations

import os
import socket
from typing import NamedTuple, Optional, Sequence

import torch

from . import _C

# What each transport can do, as it registered itself (csrc/transport.h):
# name -> _C.Transport. The choice below reads these records.
TRANSPORT_RECORDS = _C.transports()
TRANSPORTS = ("auto", *sorted(TRANSPORT_RECORDS))
HOST_ID_ENV = "RDNA4_COMM_HOST_ID"
SHARED_GPU_ENV = "RDNA4_COMM_ALLOW_SHARED_GPU"


def shared_gpus_allowed() -> bool:
    """Whether ranks may share a GPU (``RDNA4_COMM_ALLOW_SHARED_GPU=1``).

    For testing the GPU transport on fewer GPUs than ranks: the peer mapping
    then runs through IPC between processes on one device, which is correct
    but slow, since the GPU time-slices the ranks' spinning kernels."""
    return os.environ.get(SHARED_GPU_ENV, "0") == "1"


def host_identity() -> str:
    """This host's identity: hostname and boot id (``RDNA4_COMM_HOST_ID``
    replaces it, for containers that share a host and for tests)."""
    forced = os.environ.get(HOST_ID_ENV)
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def _gpu_uuid(dev: int) -> str:
    props = torch.cuda.get_device_properties(dev)
    return str(getattr(props, "uuid", dev))


class RankReport(NamedTuple):
    """What one rank tells the others before they choose a transport."""

    host: str  # host_identity()
    gpu: Optional[str]  # the uuid of its current GPU; None without one (or a CPU-only build)
    no_peer_access: tuple  # uuids of the GPUs it sees that its GPU cannot access as a peer


def device_report(dev: Optional[int]) -> RankReport:
    """The :class:`RankReport` of a rank of this host on GPU ``dev`` (None: no GPU)."""
    if dev is None:
        return RankReport(host_identity(), None, ())
    blocked = tuple(_gpu_uuid(d) for d in range(torch.cuda.device_count())
                    if d != dev and not torch.cuda.can_device_access_peer(dev, d))
    return RankReport(host_identity(), _gpu_uuid(dev), blocked)


def rank_report() -> RankReport:
    """This rank's :class:`RankReport`."""
    on_gpu = _C.with_gpu and torch.cuda.is_available()
    return device_report(torch.cuda.current_device() if on_gpu else None)


class TransportChoice(NamedTuple):
    transport: str  # "gpu", "cpu" or "dist"
    reason: str  # why (Communicator.transport_reason)
    fallback: bool  # "auto" chose "dist" because something failed: every rank warns


def _ranks_by_host(reports: Sequence[RankReport]) -> str:
    hosts: dict = {}
    for r, rep in enumerate(reports):
        hosts.setdefault(rep.host, []).append(r)
    return "; ".join(f"ranks {ranks} on {host}" for host, ranks in hosts.items())


def _gpu_transport_problem(reports: Sequence[RankReport], *, with_gpu: bool, allow_shared_gpu: bool) -> Optional[str]:
    """Why the GPU transport cannot work for these ranks, or None (the
    functional probe at construction still has the last word)."""
    if len({rep.host for rep in reports}) > 1:
        return f"the ranks span {len({rep.host for rep in reports})} hosts ({_ranks_by_host(reports)})"
    if not with_gpu:
        return "rdna4_comm was built without GPU support"
    lacking = [r for r, rep in enumerate(reports) if rep.gpu is None]
    if lacking:
        return f"ranks {lacking} have no GPU"
    if len(reports) > TRANSPORT_RECORDS["gpu"].max_world:
        return f"it supports at most {TRANSPORT_RECORDS['gpu'].max_world} ranks, got {len(reports)}"
    gpus = [rep.gpu for rep in reports]
    if len(set(gpus)) < len(gpus) and not allow_shared_gpu:
        shared = sorted({(gpus.index(g), r) for r, g in enumerate(gpus) if gpus.index(g) != r})
        return (f"ranks share GPUs ({', '.join(f'rank {a} and rank {b}' for a, b in shared)}); give each rank its "
                f"own GPU with torch.cuda.set_device, or set {SHARED_GPU_ENV}=1 to test on fewer GPUs")
    for a, rep in enumerate(reports):
        for b, other in enumerate(reports):
            if other.gpu in rep.no_peer_access:
                return f"rank {a}'s GPU has no peer access to rank {b}'s GPU"
    return None


def choose_transport(requested: str, reports: Sequence[RankReport], *, with_gpu: bool, allow_shared_gpu: bool,
                     forced_by: str = "the transport argument") -> TransportChoice:
    """The transport for ranks that reported ``reports`` (in rank order): a
    pure function, so that every rank, given the same reports, chooses the
    same. ``requested`` is "auto" or a forced transport, which raises
    RuntimeError when it cannot work."""
    one_host = len({rep.host for rep in reports}) == 1
    gpu_problem = _gpu_transport_problem(reports, with_gpu=with_gpu, allow_shared_gpu=allow_shared_gpu)
    forced = f"forced by {forced_by}"
    if requested == "cpu":
        if not one_host:
            raise RuntimeError(
                f"Communicator: transport='cpu' is not possible: it shares memory between the processes of one "
                f"host, and the ranks span {len({rep.host for rep in reports})} hosts ({_ranks_by_host(reports)}); "
                "use transport='dist'")
        return TransportChoice("cpu", forced, False)
    if requested == "gpu":
        if gpu_problem:
            raise RuntimeError(f"Communicator: transport='gpu' is not possible: {gpu_problem}")
        return TransportChoice("gpu", forced, False)
    if requested == "dist":
        return TransportChoice("dist", forced, False)
    if gpu_problem is None:
        shared = len({rep.gpu for rep in reports}) < len(reports)
        return TransportChoice("gpu", "one host, " + (f"ranks sharing GPUs ({SHARED_GPU_ENV}=1)" if shared else
                                                      "a GPU per rank with peer access between every pair"), False)
    if one_host and any(rep.gpu is None for rep in reports):
        return TransportChoice("cpu", f"one host without a GPU on every rank ({gpu_problem})", False)
    return TransportChoice("dist", f"the GPU transport is not possible: {gpu_problem}", True)
