"""The public API: :class:`Communicator` (what its ops return: rdna4_comm.results;
which algorithm they take: rdna4_comm.algorithms)."""
from __future__ import annotations

import itertools
import os
import warnings
import weakref
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _C
from ._rendezvous import Rendezvous
from ._ep_methods import EpMethods
from .fp8 import FP8_DTYPE
from .transport_policy import (TRANSPORT_RECORDS, TRANSPORTS, RankReport, TransportChoice, choose_transport, host_identity,
                               rank_report, shared_gpus_allowed)
from .ops import op_callable, order_token

EP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Long enough for one rank to compile a model cold while its peers already
# wait in the first collective (docs/semantics.md, "Timeouts"). A peer whose
# process exits is noticed within kLivenessPeriodMs whatever this bound is.
DEFAULT_TIMEOUT_MS = 300_000
DIST_SETUP_MS = 30_000
TRANSPORT_ENV = "RDNA4_COMM_TRANSPORT"

_ids = itertools.count()


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Communicator: {name} must be a positive int, got {value!r}")
    return value


def _timeout_ms(timeout_ms: Optional[int]) -> int:
    """The bound of every wait: the argument, else RDNA4_COMM_TIMEOUT_MS, else the default."""
    if timeout_ms is None:
        env = os.environ.get("RDNA4_COMM_TIMEOUT_MS", str(DEFAULT_TIMEOUT_MS))
        try:
            timeout_ms = int(env)
        except ValueError:
            raise ValueError(f"RDNA4_COMM_TIMEOUT_MS must be a positive integer (milliseconds), got {env!r}") from None
    return _positive_int("timeout_ms", timeout_ms)


class Communicator(EpMethods):
    """Communicator over peer-to-peer memory between the ranks of one host,
    or over torch.distributed collectives ("dist") anywhere.

    Collective: every rank of ``group`` constructs it with the same arguments.
    Construction allocates the symmetric heap, exchanges its handles through
    ``group`` and, on GPUs, probes every peer link; the ops themselves never
    allocate heap memory, exchange handles or synchronise the host, so they
    can be captured in CUDA/HIP graphs and compiled with
    ``torch.compile(fullgraph=True)``.

    Args:
        group: torch.distributed process group (default: WORLD). Must be
            initialised; any backend works (gloo, NCCL/RCCL).
        max_tokens_per_rank: ``cap``, the most tokens a rank passes to one
            dispatch. With ``hidden``, ``topk`` and ``num_experts`` it enables
            dispatch/combine; leave all four None for an all_reduce-only
            communicator.
        hidden: ``H``, elements per token.
        topk: ``K``, expert slots per token, 1..64.
        num_experts: ``E``, global experts; a multiple of the world size
            ``W``. Rank ``r`` owns experts ``[r*E/W, (r+1)*E/W)``.
        dtype: payload dtype of dispatch/combine: torch.bfloat16 (default),
            torch.float16 or torch.float32.
        transport: ``"auto"`` (``RDNA4_COMM_TRANSPORT`` replaces it; chosen
            collectively, see :func:`choose_transport` and docs/transports.md:
            ``"gpu"`` on one host with a GPU per rank, peer access and a
            passing probe; ``"cpu"`` on one host without GPUs; else
            ``"dist"``, with a warning naming why), ``"gpu"`` (peer-mapped
            GPU memory), ``"cpu"`` (POSIX shared memory between the processes
            of one host) or ``"dist"`` (torch.distributed collectives of a
            group of its own: gloo for CPU tensors, NCCL/RCCL for GPU ones;
            any hosts). A forced transport that cannot work raises
            RuntimeError. ``comm.transport`` and ``comm.transport_reason`` say
            what was chosen and why.
        allreduce_slot_bytes: all_reduce buffer per (parity, source rank);
            default 1 MiB on CPU, 16 MiB on GPU and dist (no buffer there:
            it bounds a chunk's temporaries). Larger tensors are processed
            in chunks of this size (one-shot) or W times it (two-shot).
        timeout_ms: bound of every wait (default: env ``RDNA4_COMM_TIMEOUT_MS``
            or 300000, enough for a peer's cold torch.compile). A peer that
            does not make the matching call within it makes the op raise
            ``RuntimeError`` (GPU: at the next call or :meth:`check`) naming
            the op, the peer and the generation; the communicator is unusable
            afterwards. A peer on this host whose process exits is noticed
            within about 50 ms, whatever the bound.

        expert_alignment: the expert layout (``dispatch(..., layout="expert")``)
            starts every local expert's rows at a multiple of this (e.g. the
            grouped GEMM's tile rows).
        max_expert_rows: rows of the expert layout's ``x`` (``expert_rows``);
            default the most a dispatch can need, ``W*cap*min(K, E/W) +
            (E/W)*(expert_alignment - 1)``. A dispatch that needs more keeps
            the rows that fit, writes nothing out of bounds and raises
            ValueError at a later call (on a GPU, once the device has
            computed the rows) or at :meth:`check`.
        dispatch_dtype: None (dispatch carries ``dtype``) or
            torch.float8_e4m3fn: dispatch carries FP8 rows with an fp32 scale
            per 128 channels (:func:`rdna4_comm.quantize_fp8`), about half
            the bytes; combine stays in ``dtype``.
        name: the communicator's id (``comm.id``), which the ops carry as a
            string and compiled code holds as a constant. Default
            ``"rdna4_comm.<pid>.<n>"``, unique but different in every process;
            a name of your own (the same on every rank, unique among this
            process's open communicators) keeps compiled graphs valid in
            another process, e.g. one loaded from a compile cache.
        dist_check_calls: transport "dist" only: check before each op
            that every rank makes the same call (op, dtype, sizes, the
            dispatch a combine's handle comes from), at the cost of one more
            collective per op and, on GPUs, a host synchronisation. The P2P
            transports always check, at no such cost (docs/semantics.md,
            "Calls that disagree").

    Heap size per rank: about ``4 * W * allreduce_slot_bytes`` plus, with EP
    fields, ``2 * W * cap * (2*H*elt + 8*K + 4)`` bytes (FP8 dispatch:
    ``H*elt + H + 4*ceil(H/128)`` in place of ``2*H*elt``).

    Ordering: every rank issues a communicator's ops in the same order, and
    on one rank they run in stream order (issue them on one stream; each op's
    kernels take the next generation of the op's counter when they start and
    store it back when they finish). Under torch.compile every op stays in
    program order and is never dropped (see ``rdna4_comm.ops``); mark the
    token dimension of a compiled function's inputs with
    :func:`rdna4_comm.mark_dynamic_tokens` so that changing token counts do not
    recompile while peers wait.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        max_tokens_per_rank: Optional[int] = None,
        hidden: Optional[int] = None,
        topk: Optional[int] = None,
        num_experts: Optional[int] = None,
        dtype: torch.dtype = torch.bfloat16,
        transport: str = "auto",
        allreduce_slot_bytes: Optional[int] = None,
        timeout_ms: Optional[int] = None,
        expert_alignment: int = 1,
        max_expert_rows: Optional[int] = None,
        dispatch_dtype: Optional[torch.dtype] = None,
        name: Optional[str] = None,
        dist_check_calls: bool = False,
    ):
        # Every argument as given, before validation: the ranks must agree on
        # some (the heap's shape, the collectives each op runs; _agree).
        arguments = dict(locals())
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Communicator: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (gloo works for bootstrap)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if transport not in TRANSPORTS:
            raise ValueError(f"Communicator: transport must be one of {TRANSPORTS}, got {transport!r}")
        cap, hidden, topk, num_experts = self._ep_fields(max_tokens_per_rank, hidden, topk, num_experts, dtype)
        expert_alignment = _positive_int("expert_alignment", expert_alignment)
        if max_expert_rows is not None:
            max_expert_rows = _positive_int("max_expert_rows", max_expert_rows)
        if dispatch_dtype not in (None, FP8_DTYPE):
            raise TypeError(f"Communicator: dispatch_dtype must be None or {FP8_DTYPE}, got {dispatch_dtype!r}")
        self._fp8 = dispatch_dtype is not None  # read on every dispatch: a plain attribute
        timeout_ms = _timeout_ms(timeout_ms)
        if not isinstance(dist_check_calls, bool):
            raise TypeError(f"Communicator: dist_check_calls must be a bool, got {dist_check_calls!r}")
        slot_bytes = None if allreduce_slot_bytes is None else _positive_int("allreduce_slot_bytes", allreduce_slot_bytes)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"Communicator: name must be a non-empty str, got {name!r}")
        comm_id = name if name is not None else f"rdna4_comm.{os.getpid()}.{next(_ids)}"

        # The ordering token needs torch._dynamo, whose first import takes
        # seconds: done before the construction's deadline starts.
        import torch._dynamo  # noqa: F401

        # Every exchange of the construction is bounded by timeout_ms (_rendezvous).
        rendezvous = Rendezvous(self.group, timeout_ms)
        reports = self._agree(rendezvous, comm_id, arguments)
        env_transport = os.environ.get(TRANSPORT_ENV)
        if transport == "auto" and env_transport:
            if env_transport not in TRANSPORTS:
                raise ValueError(f"{TRANSPORT_ENV} must be one of {TRANSPORTS}, got {env_transport!r}")
            transport, forced_by = env_transport, TRANSPORT_ENV
        else:
            forced_by = "the transport argument"
        choice = choose_transport(transport, reports, with_gpu=_C.with_gpu, allow_shared_gpu=shared_gpus_allowed(),
                                  forced_by=forced_by)
        most = TRANSPORT_RECORDS[choice.transport].max_tokens_per_rank
        if cap > most:
            raise ValueError(f"Communicator: max_tokens_per_rank must be at most {most} on the {choice.transport} "
                             f"transport, got {cap}")

        # The fields of _C.CommConfig that every transport's start shares.
        settings = dict(rank=self.rank, world=self.world_size, cap=cap, hidden=hidden, topk=topk,
                        num_experts=num_experts, dtype=dtype, timeout_ms=timeout_ms,
                        expert_alignment=expert_alignment, max_expert_rows=max_expert_rows or 0,
                        dispatch_dtype=dispatch_dtype, dist_check_calls=dist_check_calls)
        # A transport that takes device tensors runs on the GPUs when every rank has one.
        on_gpu = all(rep.gpu is not None for rep in reports) and TRANSPORT_RECORDS[choice.transport].device_tensors
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.id = comm_id
        self._order = order_token(self.device)
        self._open = False

        try:
            problems = self._start(choice.transport, slot_bytes, reports, rendezvous, settings)
            if problems:
                probe = "peer-to-peer probe failed: " + "; ".join(problems)
                if transport != "auto":
                    raise RuntimeError(f"Communicator: {probe}")
                # Every rank saw the same problems, so every rank falls back.
                choice = TransportChoice("dist", probe, True)
                self._start("dist", slot_bytes, reports, rendezvous, settings)
        except BaseException as e:
            rendezvous.fail(e)
            rendezvous.remove_segments_of_exited()
            if self._open:
                self.close()
            raise
        self.transport, self.transport_reason = choice.transport, choice.reason
        if choice.fallback:
            warnings.warn(f"rdna4_comm: Communicator on rank {self.rank} uses transport 'dist' (torch.distributed "
                          f"collectives, slower than peer-to-peer memory): {choice.reason}", stacklevel=2)
        _C.watch_peers(self.id, [(r, *p) for r, p in enumerate(rendezvous.processes) if p is not None])

    def _ep_fields(self, max_tokens_per_rank, hidden, topk, num_experts, dtype) -> tuple:
        """(cap, hidden, topk, num_experts), validated: all four given, or
        none (all_reduce alone: zeros)."""
        ep = (max_tokens_per_rank, hidden, topk, num_experts)
        if all(v is None for v in ep):
            return 0, 0, 0, 0
        if any(v is None for v in ep):
            raise ValueError(
                "Communicator: max_tokens_per_rank, hidden, topk and num_experts are needed "
                f"together for dispatch/combine, got {dict(zip(('max_tokens_per_rank', 'hidden', 'topk', 'num_experts'), ep))}"
            )
        cap = _positive_int("max_tokens_per_rank", max_tokens_per_rank)
        hidden = _positive_int("hidden", hidden)
        topk = _positive_int("topk", topk)
        num_experts = _positive_int("num_experts", num_experts)
        if topk > _C.max_topk:
            raise ValueError(f"Communicator: topk must be in [1, {_C.max_topk}], got {topk}")
        if num_experts % self.world_size:
            raise ValueError(
                f"Communicator: num_experts ({num_experts}) must be a multiple of the world size ({self.world_size})"
            )
        if dtype not in EP_DTYPES:
            raise TypeError(f"Communicator: dtype must be one of {EP_DTYPES}, got {dtype}")
        if self.world_size > _C.max_world:
            raise ValueError(f"Communicator: at most {_C.max_world} ranks are supported, got {self.world_size}")
        return cap, hidden, topk, num_experts

    def _agree(self, rendezvous: Rendezvous, comm_id: str, arguments: dict) -> list:
        """The first exchange: every rank's report (its host and GPU), process
        and arguments. Raises on every rank unless they passed the same
        arguments where they must (the agreed fields of _C.CommConfig) and
        the id is free everywhere. Returns the reports."""
        agreed = {f["argument"]: arguments[f["argument"]] for f in _C.CommConfig.fields if f["agreed"]}
        hello = rendezvous.exchange("hello", dict(report=rank_report(), pid=os.getpid(),
                                                  start=_C.process_start_time(os.getpid()), agreed=agreed,
                                                  id_taken=_C.comm_device(comm_id) is not None))
        taken = [r for r, h in enumerate(hello) if h["id_taken"]]
        if taken:
            raise ValueError(f"Communicator: name {comm_id!r} is already the id of an open communicator on ranks "
                             f"{taken}; close that one first or pass another name")
        for argument, mine in agreed.items():
            every = [h["agreed"][argument] for h in hello]
            if any(v != mine for v in every):
                raise ValueError(f"Communicator: every rank must pass the same {argument}; the ranks passed "
                                 f"{dict(enumerate(every))}")
        reports = [h["report"] for h in hello]
        host = reports[self.rank].host
        rendezvous.processes = [(h["pid"], h["start"]) if h["report"].host == host and h["start"] else None
                                for h in hello]
        return reports

    def _start(self, transport: str, slot_bytes: Optional[int], reports: Sequence[RankReport],
               rendezvous: Rendezvous, settings: dict) -> list:
        """Create this rank's transport from ``settings`` (the validated fields
        of its _C.CommConfig) and connect it to its peers (collective).
        Returns the links that failed the GPU probe, in the same words on every
        rank; with any, the transport is released again."""
        dist_group = None
        if TRANSPORT_RECORDS[transport].process_group:
            # A group of its own: a collective that timed out leaves its group
            # out of step, and this one goes with the communicator, while
            # `group` and other communicators stay usable. Its backend follows
            # the device, whatever bootstraps `group`. NCCL needs a GPU per rank.
            gpus = {(rep.host, rep.gpu) for rep in reports}
            nccl = self.device.type == "cuda" and len(gpus) == len(reports)
            # The group's own timeout bounds its connection set-up (every
            # collective carries timeout_ms itself): at least DIST_SETUP_MS,
            # which connecting gloo's pairs can take on a loaded host.
            setup = timedelta(milliseconds=max(settings["timeout_ms"], DIST_SETUP_MS))
            dist_group = rendezvous.own_group(self.group, f"rdna4_comm:{host_identity()}:{rendezvous.prefix}",
                                              "nccl" if nccl else "gloo", setup)
        self._config = _C.CommConfig(
            id=self.id, transport=transport, group_name=dist_group.group_name if dist_group is not None else "",
            ar_slot_bytes=_C.allreduce_slot_bytes(transport, slot_bytes or 0),
            device_index=-1 if self.device.index is None else self.device.index, **settings)
        handle = _C.create(self._config)
        self._open = True
        self._finalizer = weakref.finalize(self, _release, self.id, dist_group)
        # Stage names carry the transport: a fallback to dist exchanges anew.
        _C.connect(self.id, rendezvous.exchange(f"{transport}/heap", handle))
        rendezvous.exchange(f"{transport}/connected", None)  # every rank has opened every heap
        problems = rendezvous.exchange(f"{transport}/probe", _C.finish(self.id))
        bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if bad:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._open = False
            self._finalizer()
        return bad

    # The configuration has one holder, the CommConfig the C++ communicator
    # was created from (self._config, read-only): the properties of its
    # documented fields are made from _C.CommConfig.fields (below the class).
    expert_rows = property(lambda self: self._config.expert_rows, doc="Rows of the expert layout's ``x``.")

    @property
    def num_local_experts(self) -> int:
        """Experts per rank, ``E / W``."""
        return self.num_experts // self.world_size

    @property
    def local_experts(self) -> range:
        """This rank's global expert ids, ``[rank*E/W, (rank+1)*E/W)``."""
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    # ------------------------------------------------------------------ ops

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks. Collective; out of place.

        Args:
            x: any shape, contiguous, torch.float32 (torch.bfloat16 and
                torch.float16 are accepted and accumulated in float32), on the
                communicator's device. Same shape and dtype on every rank.

        Returns:
            A new tensor of x's shape and dtype: the sum over ranks in ascending
            rank order, in float32, rounded once. Bitwise identical on every rank
            and from run to run. Small tensors take the one-shot path (one
            barrier), large ones the two-shot path; see
            ``rdna4_comm.allreduce_algorithm``.
        """
        self._check_open()
        return op_callable("all_reduce")(x, self._order, self.id)

    def all_reduce_rmsnorm(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """all_reduce, residual add and RMSNorm in one collective: the
        tensor-parallel step after a row-parallel layer. Collective.

        Args:
            x: [..., H] torch.bfloat16, torch.float16 or torch.float32,
                contiguous: this rank's partial sums; the same shape and dtype
                on every rank.
            residual: x's shape and dtype, or None.
            weight: [H] of x's dtype or torch.float32.
            eps: finite float > 0.

        Returns:
            ``(out, residual_out)``, both of x's shape and dtype:
            ``residual_out = round(all_reduce(x) + residual)`` (just the sum
            without residual), bitwise ``comm.all_reduce(x) + residual``;
            ``out = round(weight * round(r * rsqrt(mean(r**2, -1) + eps)))``
            with r = residual_out in float32. Bitwise identical on every rank
            and run to run; see docs/semantics.md, "all_reduce_rmsnorm", for
            the bound against the torch composition and the paths
            (``rdna4_comm.all_reduce_rmsnorm_algorithm``).
        """
        self._check_open()
        if not isinstance(eps, (float, int)) or isinstance(eps, bool):
            raise TypeError(f"all_reduce_rmsnorm: eps must be a float, got {type(eps).__name__}")
        return op_callable("all_reduce_rmsnorm")(x, residual, weight, float(eps), self._order, self.id)

    def fused_path_counts(self) -> dict[str, int]:
        """Calls of :meth:`all_reduce_rmsnorm` on this rank by path ("one_stage",
        "two_stage", "all_reduce_then_norm"), and "row_in_registers": how many
        of them kept each row in registers (GPU transport)."""
        self._check_open()
        return _C.rmsnorm_path_counts(self.id)

    # ---------------------------------------------------------- lifecycle

    def check(self) -> None:
        """Wait for this rank's queued ops (GPU: synchronise the device); raise
        RuntimeError if any failed (e.g. timed out on a peer), ValueError if an
        expert-layout dispatch needed more than ``expert_rows`` rows."""
        self._check_open()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        _C.check(self.id)

    def close(self) -> None:
        """Release this rank's heap. Local (no collective): call it on every
        rank after its last op. Idempotent."""
        if self._open:
            self._open = False
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._open

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        ep = (
            f", cap={self.max_tokens_per_rank}, hidden={self.hidden}, topk={self.topk}, "
            f"num_experts={self.num_experts}, dtype={self.dtype}"
            if self.max_tokens_per_rank
            else ""
        )
        state = "closed" if self.closed else self.transport
        return f"Communicator(rank={self.rank}/{self.world_size}, {state}{ep})"

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"Communicator {self.id!r} is closed")


def _config_property(name: str, doc: str) -> property:
    """The read-only property of CommConfig field `name`: a plain function,
    which torch.compile traces (an operator.attrgetter it does not)."""
    return property(lambda self: getattr(self._config, name), doc=doc)


for _field in _C.CommConfig.fields:
    if _field["doc"]:
        setattr(Communicator, _field["argument"], _config_property(_field["name"], _field["doc"]))


def _release(comm_id: str, dist_group: Optional[dist.ProcessGroup]) -> None:
    _C.destroy(comm_id)
    # After the process group is destroyed (at exit, say), its subgroups are gone too.
    if dist_group is not None and dist.is_initialized():
        dist.destroy_process_group(dist_group)
