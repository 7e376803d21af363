import collections
import os

import pytest
import torch

import gpu_testing
from harness import World

import rdna4_comm as rc


def gpu_world_sizes() -> list[int]:
    """GPU worlds to test: 2 and, where more GPUs exist, all of them. With
    RDNA4_COMM_ALLOW_SHARED_GPU=1, ranks share GPUs, so one GPU tests 2 and 4
    ranks (RDNA4_COMM_TEST_SHARED_WORLDS overrides: "2,3")."""
    if not (rc._C.with_gpu and torch.cuda.is_available()):
        return []
    n = min(torch.cuda.device_count(), rc._C.transports()['gpu'].max_world)
    if rc.transport_policy.shared_gpus_allowed():
        return [int(w) for w in os.environ.get("RDNA4_COMM_TEST_SHARED_WORLDS", "2,4").split(",")]
    return sorted({2, n}) if n >= 2 else []


def transport_selected(transport: str) -> bool:
    wanted = os.environ.get("RDNA4_COMM_TEST_TRANSPORTS", "cpu,dist,gpu").split(",")
    return transport in wanted


# Worlds that run on the CPU here (dist runs on GPUs where every rank has one).
# dist runs the shared suites at W = 2 and 4 only, to keep the whole suite
# within CI's minutes on 2 cores; test_dist checks it bitwise against the
# CPU transport at W = 1 to 4.
CPU_WORLDS = ([("cpu", w) for w in (1, 2, 3, 4)] if transport_selected("cpu") else []) + (
    [("dist", w) for w in (2, 4)] if transport_selected("dist") else [])
GPU_WORLDS = [("gpu", w) for w in gpu_world_sizes()] if transport_selected("gpu") else []
ALL_WORLDS = CPU_WORLDS + GPU_WORLDS
# Transports of the tests that kill a rank (each starts worlds of its own).
KILL_TRANSPORTS = ["cpu", "dist"] + (["gpu"] if GPU_WORLDS else [])
world_ids = [f"{t}{w}" for t, w in ALL_WORLDS]


@pytest.fixture(scope="session")
def worlds():
    """worlds(transport, size) -> a live World, spawned once per session; the
    calling test skips where RDNA4_COMM_TEST_TRANSPORTS leaves the transport
    out (tests that name a world of their own, e.g. worlds("cpu", 2), too)."""
    cache: dict = {}

    def get(transport: str, size: int) -> World:
        if not transport_selected(transport):
            pytest.skip(f"transport {transport!r} not selected by RDNA4_COMM_TEST_TRANSPORTS")
        w = cache.get((transport, size))
        if w is None or not w.alive:
            w = cache[(transport, size)] = World(size, transport)
        return w

    yield get
    for w in cache.values():
        w.close()


@pytest.fixture(scope="session")
def testing_extension():
    """The testing extension (tests/gpu_testing.py), built once a session
    before any rank process loads it; skips without a GPU build and a GPU."""
    if not (rc._C.with_gpu and torch.cuda.is_available()):
        pytest.skip("needs a GPU and a GPU build")
    return gpu_testing.load()


@pytest.fixture(scope="session", params=ALL_WORLDS, ids=world_ids)
def world(request, worlds) -> World:
    return worlds(*request.param)


@pytest.fixture(scope="session", params=CPU_WORLDS + GPU_WORLDS[:1], ids=[f"{t}{w}" for t, w in CPU_WORLDS + GPU_WORLDS[:1]])
def world_small(request, worlds) -> World:
    """Every CPU world and the smallest GPU world (for the slower tests)."""
    return worlds(*request.param)


class FailuresAtOnce:
    """Each failing test's id and report appended to a file as it fails, so
    that a run cut off by a time limit (the device machines' commands) still
    says what failed: pytest's summary comes only at the end."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, "a") as f:
                f.write(f"=== {report.nodeid} [{report.when}] {report.duration:.1f} s\n{report.longreprtext}\n")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a minute or more on the 2-core CI machine (-m 'not slow' skips them)")
    config.addinivalue_line("markers", "vllm: end to end through vLLM's CPU build (-m vllm runs them alone)")
    # RDNA4_COMM_FAILURES=path: FailuresAtOnce, in the process that prints
    # the results (pytest-xdist's workers hand their reports to it).
    path = os.environ.get("RDNA4_COMM_FAILURES")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FailuresAtOnce(path), "rdna4_comm_failures_at_once")


def pytest_collection_modifyitems(config, items):
    # pytest-xdist's loadfile hands the files out in this order (scripts/
    # test.sh turns its own reordering off): the vLLM engines' files first,
    # the longest, then those with more tests before those with fewer, so
    # that no long file ends a run alone.
    tests_in = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.get_closest_marker("vllm") is None, -tests_in[item.path]))
    if not ALL_WORLDS:
        skip = pytest.mark.skip(reason="no transport selected by RDNA4_COMM_TEST_TRANSPORTS")
        for item in items:
            if "world" in getattr(item, "fixturenames", ()):
                item.add_marker(skip)
