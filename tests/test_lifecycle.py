"""Construction, close, context manager, use after close, dead or absent
peers (an error within the timeout, never a hang), /dev/shm hygiene."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from common import assert_bitwise, rand, short_timeout_ms, shm_segments
from conftest import KILL_TRANSPORTS
from harness import World

import rdna4_comm as rc
from rdna4_comm import reference


def t_lifecycle(ctx):
    x = rand(3, ctx.rank, (64,)).to(ctx.device)
    c = rc.Communicator(transport=ctx.transport)
    first = c.all_reduce(x)
    segments_while_open = shm_segments(os.getpid())
    c.close()
    c.close()  # idempotent
    errors = []
    for call in (lambda: c.all_reduce(x), lambda: c.check()):
        try:
            call()
        except RuntimeError as e:
            errors.append(str(e))
    try:
        torch.ops.rdna4_comm.all_reduce(x, rc.ops.order_token(x.device), c.id)
    except ValueError as e:
        errors.append(str(e))
    with rc.Communicator(transport=ctx.transport) as c2:
        second = c2.all_reduce(x)
    return first, second, errors, c2.closed, segments_while_open, repr(c)


def test_close_context_manager_and_use_after_close(world_small):
    results = world_small.run(t_lifecycle)
    ref = reference.all_reduce([rand(3, r, (64,)) for r in range(world_small.size)])
    for first, second, errors, closed, segments, text in results:
        assert_bitwise(first, ref)
        assert_bitwise(second, ref)
        assert closed and "closed" in text
        assert len(errors) == 3 and all("closed" in e for e in errors), errors
        # Names are unlinked once every peer has mapped them.
        assert segments == []
    assert shm_segments(*(p.pid for p in world_small.procs)) == []


def t_comm_cache_keeps_the_recently_asked(ctx):
    # The test worlds' cache closes the least recently asked-for communicator
    # past MAX_CACHED_COMMS: one a test asked for again stays open.
    held = ctx.comm(allreduce_slot_bytes=4096)
    closed_early = []
    for i in range(ctx.MAX_CACHED_COMMS + 2):
        ctx.comm(allreduce_slot_bytes=4096 * (i + 2))
        closed_early.append(held.closed)
        assert ctx.comm(allreduce_slot_bytes=4096) is held
    x = rand(6, ctx.rank, (64,)).to(ctx.device)
    return closed_early, held.all_reduce(x), len(ctx._comms)


def test_the_test_worlds_comm_cache_closes_the_least_recently_asked(world_small):
    results = world_small.run(t_comm_cache_keeps_the_recently_asked)
    ref = reference.all_reduce([rand(6, r, (64,)) for r in range(world_small.size)])
    for closed_early, out, cached in results:
        assert not any(closed_early)
        assert_bitwise(out, ref)
        assert cached <= rc._ranks.RankContext.MAX_CACHED_COMMS
    world_small.run(t_drop_communicators)


def t_rank_errors_reach_every_rank(ctx):
    # Rank 1 fails with a non-ASCII message, the others pass.
    mine = "bad tensor: max |Δ| = 0.5" if ctx.rank == 1 else None
    try:
        ctx.agree(mine, "the check")
        raised = None
    except rc._ranks.CheckFailed as e:
        raised = str(e)
    return ctx.errors(mine), ctx.errors(None), raised


def test_the_worlds_error_exchange_gives_every_rank_every_error(world_small):
    expected = ["rank 1: bad tensor: max |Δ| = 0.5"] if world_small.size > 1 else []
    for errors, none, raised in world_small.run(t_rank_errors_reach_every_rank):
        assert errors == expected and none == []
        assert raised == ("the check:\n" + expected[0] if expected else None)


def t_sleep(ctx, seconds):
    time.sleep(seconds)
    return ctx.rank


class Interrupted(Exception):
    pass


def test_a_call_interrupted_with_replies_owed_kills_the_world():
    # A test's own timeout (pytest-timeout) interrupts World.run mid-wait: the
    # world is killed, so the next test asks for a fresh one and never takes
    # the abandoned task's replies for its own.
    def interrupt(signum, frame):
        raise Interrupted()

    with World(2, "cpu") as world:
        world.run(t_sleep, 0)
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(Interrupted):
                world.run(t_sleep, 30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert not world.alive
    with World(2, "cpu") as fresh:
        assert fresh.run(t_sleep, 0) == [0, 1]


def test_a_world_of_an_unselected_transport_skips_its_test(worlds, monkeypatch):
    # The GPU runs select "gpu" alone: the tests that name a CPU world of
    # their own skip there instead of loading the machine (CI runs them).
    monkeypatch.setenv("RDNA4_COMM_TEST_TRANSPORTS", "gpu")
    with pytest.raises(pytest.skip.Exception, match="'cpu' not selected"):
        worlds("cpu", 2)


def test_failures_reach_their_file_as_they_happen(tmp_path):
    # scripts/gpu_check.sh sets RDNA4_COMM_FAILURES: a run cut off by the
    # device command's limit has no summary, but the file names what failed.
    (tmp_path / "test_two.py").write_text("def test_fails():\n    assert 1 == 2\n\ndef test_passes():\n    pass\n")
    here = os.path.dirname(os.path.abspath(__file__))
    failures = tmp_path / "failures.txt"
    env = dict(os.environ, RDNA4_COMM_FAILURES=str(failures),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          str(tmp_path / "test_two.py")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    text = failures.read_text()
    assert text.startswith("=== test_two.py::test_fails [call]") and "assert 1 == 2" in text, text
    assert "test_passes" not in text


def t_skip_one_call(ctx, skipper):
    c = ctx.comm(timeout_ms=short_timeout_ms(ctx.transport), allreduce_slot_bytes=4096)
    x = rand(5, ctx.rank, (256,)).to(ctx.device)
    c.all_reduce(x)
    c.check()
    if ctx.rank == skipper:
        return None
    start = time.monotonic()
    try:
        c.all_reduce(x)
        c.check()
        message = None
    except RuntimeError as e:
        message = str(e)
    elapsed = time.monotonic() - start
    try:
        c.all_reduce(x)
        again = None
    except RuntimeError as e:
        again = str(e)
    return message, elapsed, again


def t_drop_communicators(ctx):
    ctx.drop_comms()


def t_fresh_communicator_works(ctx):
    with rc.Communicator(transport=ctx.transport) as c:
        return c.all_reduce(rand(8, ctx.rank, (300,)).to(ctx.device))


def test_a_rank_that_skips_a_call_makes_the_others_raise(world_small):
    if world_small.size == 1:
        pytest.skip("needs a peer")
    skipper = world_small.size - 1
    results = world_small.run(t_skip_one_call, skipper)
    for r, res in enumerate(results):
        if r == skipper:
            continue
        message, elapsed, again = res
        assert message is not None, "the call without its peer returned"
        # The P2P transports know whose flag never came; a collective does not.
        waited_for = "in torch.distributed" if world_small.transport == "dist" else f"waiting for rank {skipper}"
        assert "all_reduce" in message and waited_for in message, message
        assert "timed out" in message
        if world_small.transport != "dist":  # the round, and that the peer had not made the call
            assert "round 2" in message and f"Rank {skipper} had not made this call" in message, message
        assert elapsed < short_timeout_ms(world_small.transport) / 1000 + 5
        assert again is not None and "timed out" in again  # the communicator stays failed
    # The world (and the GPU) stays usable for new communicators.
    world_small.run(t_drop_communicators)
    outs = world_small.run(t_fresh_communicator_works)
    ref = reference.all_reduce([rand(8, r, (300,)) for r in range(world_small.size)])
    for out in outs:
        assert_bitwise(out, ref)


def t_disagreeing_construction(ctx, field, mine, others):
    """Rank 0 passes `mine` for `field`, the others `others`; returns the error."""
    kw = dict(max_tokens_per_rank=4, hidden=8, topk=2, num_experts=2 * ctx.world)
    if field == "ep":  # EP fields on rank 0 only
        kw = kw if ctx.rank == 0 else {}
    else:
        kw[field] = mine if ctx.rank == 0 else others
    try:
        ctx.comm(**kw)
    except ValueError as e:
        return str(e)
    return None


# One disagreement per argument the ranks must agree on, and EP fields on one rank only.
DISAGREEMENTS = [("max_tokens_per_rank", 4, 5), ("hidden", 8, 16), ("topk", 2, 1), ("num_experts", 24, 48),
                 ("dtype", torch.bfloat16, torch.float16), ("dispatch_dtype", torch.float8_e4m3fn, None),
                 ("allreduce_slot_bytes", None, 1 << 20), ("expert_alignment", 1, 16), ("max_expert_rows", None, 64),
                 ("dist_check_calls", False, True), ("ep", 0, None)]


def test_every_argument_the_ranks_must_agree_on_is_tested():
    agreed = {f["argument"] for f in rc._C.CommConfig.fields if f["agreed"]}
    assert agreed == {field for field, _, _ in DISAGREEMENTS} - {"ep"}


@pytest.mark.parametrize("field,mine,others", DISAGREEMENTS)
def test_ranks_that_disagree_on_the_heap_all_raise(world_small, field, mine, others):
    """An argument that lays out the heap or decides the collectives,
    different on one rank: every rank raises naming it (none writes past a
    peer's buffers or runs other collectives), and the world constructs
    communicators afterwards."""
    if world_small.size == 1:
        pytest.skip("needs a peer")
    for r, message in enumerate(world_small.run(t_disagreeing_construction, field, mine, others)):
        if field == "ep":  # the ranks without EP fields passed None, and the message says so
            others = ", ".join(f"{p}: None" for p in range(1, world_small.size))
            want = f"every rank must pass the same max_tokens_per_rank; the ranks passed {{0: 4, {others}}}"
        else:
            want = f"every rank must pass the same {field}"
        assert message is not None and want in message, (r, message)
    outs = world_small.run(t_fresh_communicator_works)
    ref = reference.all_reduce([rand(8, r, (300,)) for r in range(world_small.size)])
    for out in outs:
        assert_bitwise(out, ref)


def t_open(ctx):
    c = ctx.comm()  # the default timeout: minutes
    c.all_reduce(rand(1, ctx.rank, (16,)).to(ctx.device))
    c.check()
    return shm_segments(os.getpid())


def t_call_dead_peer(ctx):
    start = time.monotonic()
    try:
        c = ctx.comm()
        c.all_reduce(rand(2, ctx.rank, (16,)).to(ctx.device))
        c.check()
        return None, time.monotonic() - start
    except RuntimeError as e:
        return str(e), time.monotonic() - start


@pytest.mark.parametrize("transport", KILL_TRANSPORTS)
def test_a_killed_rank_makes_the_peer_raise_at_once_and_leaves_no_shm(transport):
    """The peer's process is watched: its exit ends the wait within a liveness
    period, long before the (default, minutes-long) timeout. On dist, the
    dead peer's closed connections end the collective."""
    world = World(2, transport)
    pids = [p.pid for p in world.procs]
    try:
        assert world.run(t_open) == [[], []]
        world.kill_rank(1)
        assert shm_segments(*pids) == []
        [(message, elapsed)] = world.run(t_call_dead_peer, ranks=[0])
        gone = "timed out or failed in torch.distributed" if transport == "dist" else "rank 1 (pid"
        assert message is not None and gone in message and ("exited" in message or transport == "dist"), message
        assert elapsed < 2.0, elapsed
    finally:
        world.kill()
    assert shm_segments(*pids) == []


def t_construct(ctx, timeout_ms):
    import torch._dynamo  # noqa: F401  (Communicator imports it before its deadline starts; not timed here)

    start = time.monotonic()
    try:
        rc.Communicator(transport=ctx.transport, timeout_ms=timeout_ms).close()
        return None, time.monotonic() - start, shm_segments(os.getpid())
    except RuntimeError as e:
        return str(e), time.monotonic() - start, shm_segments(os.getpid())


def t_construct_in_background(ctx):
    """Start constructing and return while the construction waits for rank 0."""
    import threading

    import torch._dynamo  # noqa: F401  (slow first import: before the construction starts)

    threading.Thread(target=lambda: rc.Communicator(transport=ctx.transport), daemon=True).start()
    time.sleep(0.5)  # long enough to publish its first record


def t_wait_then_construct(ctx, delay_s, timeout_ms):
    time.sleep(delay_s)
    return t_construct(ctx, timeout_ms)


@pytest.mark.parametrize("transport", KILL_TRANSPORTS)
def test_construction_is_bounded_when_a_rank_never_constructs(transport):
    world = World(2, transport)
    try:
        [(message, elapsed, segments)] = world.run(t_construct, 1500, ranks=[0])
        assert message is not None and "ranks [1] did not arrive" in message and "1500 ms" in message, message
        assert 1.4 < elapsed < 2.5, elapsed
        assert segments == []
    finally:
        world.kill()


@pytest.mark.parametrize("transport", KILL_TRANSPORTS)
def test_construction_raises_at_once_when_a_rank_is_killed_during_it(transport):
    world = World(2, transport)
    pids = [p.pid for p in world.procs]
    try:
        world.run(t_construct_in_background, ranks=[1])
        world.kill_rank(1)  # SIGKILL while its construction waits
        [(message, elapsed, segments)] = world.run(t_wait_then_construct, 0.0, 60_000, ranks=[0])
        assert message is not None and "ranks [1] exited during construction" in message, message
        # The liveness check, not the 60 s bound (the GPU heap's set-up takes seconds).
        assert elapsed < 20.0, elapsed
        assert segments == []
    finally:
        world.kill()
    assert shm_segments(*pids) == []
