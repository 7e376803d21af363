"""Multi-process test harness.

A :class:`World` spawns W ranks once (spawning costs seconds: a test module
feeds one world many cases, hypothesis examples included). Each rank runs a
loop that executes module-level task functions ``task(ctx, *args)`` and sends
back their results; :meth:`World.run` runs one task on every rank and returns
the results in rank order, or raises with every failing rank's traceback.

Results travel pickled by value (tensors moved to the CPU), never through
torch's shared-memory tensor passing, so /dev/shm only ever holds what the
library itself creates.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import traceback

import torch
import torch.multiprocessing as mp

TASK_TIMEOUT_S = float(os.environ.get("RDNA4_COMM_TEST_TASK_TIMEOUT_S", 300))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


class Ctx:
    """Per-rank state that tasks share: rank, world size, transport, device,
    and communicators cached by their constructor arguments."""

    MAX_CACHED = 6

    def __init__(self, rank: int, world: int, transport: str):
        self.rank, self.world, self.transport = rank, world, transport
        # Ranks share GPUs round-robin where there are fewer GPUs than ranks
        # (only with RDNA4_COMM_ALLOW_SHARED_GPU=1; see gpu_world_sizes).
        self.device = (
            torch.device("cuda", rank % torch.cuda.device_count()) if transport == "gpu" else torch.device("cpu")
        )
        self._comms: dict = {}
        self.scratch: dict = {}

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
        if self.transport == "gpu":
            torch.cuda.synchronize(self.device)


def _worker(rank: int, world: int, port: int, transport: str, conn) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a crash in C++ still names the Python line
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    ctx = Ctx(rank, world, transport)
    if transport == "gpu":
        torch.cuda.set_device(ctx.device)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if msg is None:
            break
        fn, args = msg
        try:
            reply = ("ok", to_cpu(fn(ctx, *args)))
        except BaseException as e:  # noqa: BLE001  (reported to the test)
            reply = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(reply))
    ctx.drop_comms()
    dist.destroy_process_group()


class WorldError(AssertionError):
    pass


class World:
    def __init__(self, world_size: int, transport: str = "cpu"):
        ctx = mp.get_context("spawn")
        self.size, self.transport = world_size, transport
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world_size, port, transport, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, *args, per_rank=None, timeout: float = TASK_TIMEOUT_S, ranks=None):
        """Run ``fn(ctx, *args, *per_rank[r])`` on every rank (or only ``ranks``)."""
        ranks = list(range(self.size)) if ranks is None else ranks
        for r in ranks:
            extra = tuple(per_rank[r]) if per_rank is not None else ()
            self.conns[r].send_bytes(pickle.dumps((fn, args + extra)))
        results, errors = {}, []
        for r in ranks:
            waited = 0.0
            while not self.conns[r].poll(0.5):
                waited += 0.5
                if not self.procs[r].is_alive():
                    self.kill()
                    raise WorldError(f"rank {r} died (exit code {self.procs[r].exitcode}) in {fn.__name__}")
                if waited >= timeout:
                    self.kill()
                    raise WorldError(f"rank {r} did not answer {fn.__name__} within {timeout} s (world killed)")
            status, value = pickle.loads(self.conns[r].recv_bytes())
            if status == "ok":
                results[r] = value
            else:
                errors.append(f"--- rank {r} ---\n{value}")
        if errors:
            raise WorldError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [results[r] for r in ranks]

    def kill_rank(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(30)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(30)

    def close(self) -> None:
        for r, c in enumerate(self.conns):
            if self.procs[r].is_alive():
                try:
                    c.send_bytes(pickle.dumps(None))
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(30)
        self.kill()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)
