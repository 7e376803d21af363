"""Worlds of spawned processes on this host, one per rank (package-internal).

The tests, the benchmarks and the demo all start their worlds here. A
:class:`ProcessWorld` spawns W processes that meet at one rendezvous: a
torch.distributed file store in a directory of the world's own, so that
worlds started at once (pytest-xdist workers) never race for a TCP port.
Each builds its per-rank state with a ``setup`` function, then runs the tasks
the launcher sends until it is closed. A task may send messages to the
launcher while it runs (:meth:`Member.tell`).

Everything between the processes travels over one pipe per rank, pickled by
value, with tensors moved to the CPU. Torch's shared-memory tensor passing is
never used, so /dev/shm only ever holds what rdna4_comm itself creates. A rank
that dies is seen at once, as the end of its pipe.
"""
from __future__ import annotations

import faulthandler
import gc
import math
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Collection, Mapping, Optional

import torch

# Set in every rank process before its setup runs: NVLink SHARP / multicast
# stay off for NCCL and for torch's symmetric memory.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Once one rank has failed, how long the others get to answer before they are
# killed: they may be waiting for the failed rank in a collective.
FAILURE_GRACE_S = 5.0
# How long a closed rank gets to shut down before it is killed.
CLOSE_TIMEOUT_S = 30.0
# What the launcher sends a rank to make it shut down (no task pickles to it).
_CLOSE = b"close"


class WorldFailed(RuntimeError):
    """A task raised on some rank, or a rank died or did not answer in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for the rendezvous of a
    one-process world (a benchmark's own process as its only rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_cpu(obj):
    """``obj`` with every tensor in it (in tuples, named tuples, lists and dicts)
    moved to the CPU, so that it unpickles in a process without a GPU context."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class Member:
    """What a rank process knows of its world when its setup runs: its rank,
    the world size, the rendezvous (an init_method) for torch.distributed, and its
    pipe to the launcher."""

    rank: int
    world: int
    init_method: str
    _conn: Connection

    def tell(self, obj: Any) -> None:
        """Send ``obj`` (picklable) to the launcher's ``on_message`` now."""
        self._conn.send_bytes(pickle.dumps(("message", obj)))


def _failure_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _rank_main(member: Member, setup: Callable, setup_args: tuple) -> None:
    """A rank process: set up, serve tasks until told to stop, shut down."""
    os.environ.update(CHILD_ENV)
    faulthandler.enable()  # a crash in C++ still names the Python line
    conn = member._conn
    try:
        state = setup(member, *setup_args)
    except BaseException as e:  # noqa: BLE001  (reported to the launcher)
        conn.send_bytes(pickle.dumps(("error", "setup failed: " + _failure_text(e))))
        os._exit(1)
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the launcher is gone
            break
        if task == _CLOSE:
            break
        failed = False
        try:
            fn, args = pickle.loads(task)
            reply = pickle.dumps(("done", to_cpu(fn(state, *args))))
        except BaseException as e:  # noqa: BLE001  (reported to the launcher)
            reply, failed = pickle.dumps(("error", _failure_text(e))), True
        if failed:
            # Out of the except block the failed frames are gone; collecting now
            # runs the finalizers of communicators they held (unlinking shared
            # memory) before the launcher may kill this process.
            gc.collect()
        conn.send_bytes(reply)
    status = 0
    try:
        state.close()
    except BaseException:  # noqa: BLE001  (nobody is waiting for an answer any more)
        traceback.print_exc()
        status = 1
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch loaded it takes seconds. The state's
    # close() has released what the rank held.
    os._exit(status)


class ProcessWorld:
    """``size`` spawned processes, ranks 0..size-1, each connected to this
    process by a pipe. Rank r runs ``state = setup(Member(r, ...), *setup_args)``
    once (``setup`` importable, ``state`` with a ``close()`` that runs when the
    world closes), then the tasks of :meth:`call`.

    Leaving a ``with`` block closes the world; leaving it by an exception kills
    it instead, since ranks may then be waiting for each other.
    """

    def __init__(self, size: int, setup: Callable, setup_args: tuple = ()):
        spawn = multiprocessing.get_context("spawn")
        self._rendezvous = tempfile.mkdtemp(prefix="rdna4_comm_world_")
        init_method = "file://" + os.path.join(self._rendezvous, "store")
        self.size = size
        self._conns: list[Connection] = []
        self.procs: list = []
        for r in range(size):
            ours, theirs = spawn.Pipe()
            member = Member(r, size, init_method, theirs)
            p = spawn.Process(target=_rank_main, args=(member, setup, setup_args), daemon=True)
            p.start()
            theirs.close()
            self._conns.append(ours)
            self.procs.append(p)

    def __enter__(self) -> "ProcessWorld":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()

    def call(self, fn: Callable, args_of: Mapping[int, tuple], *, timeout: Optional[float] = None,
             on_message: Callable[[Any], None] = print, dies: Collection[int] = ()) -> list:
        """Run ``fn(state, *args_of[r])`` on each rank r of ``args_of`` (``fn``
        importable) and return the results in the order of ``args_of``.

        Messages the ranks send meanwhile reach ``on_message``, in order per
        rank. Raises :class:`WorldFailed` naming every rank that raised (with
        its traceback), died, or did not answer: within ``timeout`` seconds, or
        within :data:`FAILURE_GRACE_S` of another rank's failure. If any rank
        died or did not answer, the whole world is killed.

        The ranks of ``dies`` are expected to die during the call (a fault
        test's victims): their exit code is their result, and their death
        leaves the others running.
        """
        for r, args in args_of.items():
            try:
                self._conns[r].send_bytes(pickle.dumps((fn, tuple(args))))
            except OSError:  # the rank has exited; its pipe still holds why
                pass
        rank_of = {self._conns[r]: r for r in args_of}
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        died = False
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        try:
            while rank_of and time.monotonic() < deadline:
                for conn in wait(list(rank_of), timeout=None if deadline == math.inf else deadline - time.monotonic()):
                    r = rank_of[conn]
                    try:
                        kind, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self.procs[r].join(1)
                        if r in dies:
                            kind, value = "done", self.procs[r].exitcode
                        else:
                            kind, value, died = "error", f"died (exit code {self.procs[r].exitcode})", True
                    if kind == "message":
                        on_message(value)
                        continue
                    del rank_of[conn]
                    if kind == "done":
                        results[r] = value
                    else:
                        if not failures:
                            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                        failures[r] = value
        except BaseException:
            # Interrupted (a test's own timeout, Ctrl-C) with replies still
            # owed: a later call would take them for its own.
            if rank_of:
                self.kill()
            raise
        within = f"{FAILURE_GRACE_S} s of the first failure" if failures else f"{timeout} s"
        for r in rank_of.values():
            failures[r] = f"did not answer within {within}"
        if died or rank_of:
            self.kill()  # a world that lacks a rank can run nothing more
        if failures:
            raise WorldFailed(f"{getattr(fn, '__name__', fn)} failed:\n"
                              + "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)))
        return [results[r] for r in args_of]

    def kill_rank(self, rank: int) -> None:
        """Kill one rank (SIGKILL) and wait for it."""
        self.procs[rank].kill()
        self.procs[rank].join(CLOSE_TIMEOUT_S)

    def kill(self) -> None:
        """Kill every rank still alive (SIGKILL) and wait for them; remove the
        rendezvous directory."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(CLOSE_TIMEOUT_S)
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def close(self) -> None:
        """Tell every live rank to close its state and exit; kill those that
        have not exited within :data:`CLOSE_TIMEOUT_S`."""
        for conn, p in zip(self._conns, self.procs):
            if p.is_alive():
                try:
                    conn.send_bytes(_CLOSE)
                except OSError:  # it died meanwhile
                    pass
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    @property
    def alive(self) -> bool:
        """Whether every rank is still running."""
        return all(p.is_alive() for p in self.procs)
