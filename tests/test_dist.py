"""The torch.distributed transport ("dist") against the CPU transport, bitwise,
on the same inputs; a compiled layer over it; and the automatic choice of a
transport: the pure decision function, simulated hosts, forced transports.
(Every shared property also runs on the dist worlds of the other test files.)"""
from __future__ import annotations

import contextlib
import os
import warnings
from unittest import mock

import gpu_testing
import pytest
import torch
from common import ROUTINGS, assert_bitwise, assert_dispatched, ep_inputs, examples, expert_fn, rand
from conftest import GPU_WORLDS, transport_selected
from harness import World
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ep import ep_cases, ep_config, expected_round_trip, ref_cfg

import rdna4_comm as rc
from rdna4_comm import moe
from rdna4_comm.communicator import TRANSPORT_ENV
from rdna4_comm.transport_policy import HOST_ID_ENV, RankReport, choose_transport

SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, max_examples=examples(15))

# ------------------------------------------------------- dist == cpu, bitwise
#
# Both transports on one device, the CPU: where the ranks see a GPU, "dist"
# runs on it, and a GPU's arithmetic (its NaN, its matmuls) is not the CPU's.
# So these worlds hide the GPUs from their ranks.


@pytest.fixture(scope="module")
def cpu_worlds():
    """cpu_worlds(size) -> a World of CPU ranks that see no GPU (one per size, for this module)."""
    cache: dict = {}
    no_gpu = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}

    def get(size: int) -> World:
        if not (transport_selected("cpu") and transport_selected("dist")):
            pytest.skip("the dist and cpu transports are not both selected by RDNA4_COMM_TEST_TRANSPORTS")
        if size not in cache or not cache[size].alive:
            cache[size] = World(size, "cpu", env_of_rank={r: no_gpu for r in range(size)})
        return cache[size]

    yield get
    for w in cache.values():
        w.close()


AR_CASES = [((1,), torch.float32), ((3, 700), torch.float32), ((70_000,), torch.float32),
            ((5, 9), torch.bfloat16), ((40_000,), torch.float16)]


def special_values(rank: int) -> torch.Tensor:
    """Signed zeros, infinities, NaN and values whose sum depends on the order."""
    return torch.tensor([-0.0, 0.0 if rank else -0.0, float("inf"), float("nan") if rank == 1 else 1.0,
                         3.0e38, 1.0 + 2.0 ** -23 * rank, -1.0e-45, 2.0 ** 24 + rank])


def t_same_inputs_on_both(ctx, cfg, cases):
    by_transport = {}
    for transport in ("cpu", "dist"):
        comm = ctx.comm(transport=transport, **cfg)
        dev = comm.device
        outs = []
        for seed, Ts, kind, weights in cases:
            x, idx, w = ep_inputs(seed, ctx.rank, ctx.world, Ts[ctx.rank], ref_cfg(cfg), kind, weights)
            d = comm.dispatch(x.to(dev), idx.to(dev), None if w is None else w.to(dev))
            # Negated results: combine must start each sum from its first term (-0 + -0 is -0).
            outs.append((d, comm.combine(-expert_fn(d.x, ctx.rank) * 0, d.handle),
                         comm.combine(expert_fn(d.x, ctx.rank), d.handle)))
        sums = [comm.all_reduce(rand(i, ctx.rank, shape, dtype).to(dev)) for i, (shape, dtype) in enumerate(AR_CASES)]
        sums.append(comm.all_reduce(special_values(ctx.rank).to(dev)))
        by_transport[transport] = outs, sums
    return by_transport


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_dist_gives_the_bits_of_the_cpu_transport(cpu_worlds, size):
    cfg = ep_config(10, 24, 5, 3 * size, torch.bfloat16)
    cases = [(s, [10 - (r * 3) % 11 for r in range(size)], kind, s % 2 == 0) for s, kind in enumerate(ROUTINGS)]
    for r, result in enumerate(cpu_worlds(size).run(t_same_inputs_on_both, cfg, cases)):
        (cpu_ep, cpu_sums), (dist_ep, dist_sums) = result["cpu"], result["dist"]
        for i, ((d_cpu, z_cpu, o_cpu), (d_dist, z_dist, o_dist)) in enumerate(zip(cpu_ep, dist_ep)):
            assert_dispatched(d_dist, d_cpu, f"case {i} rank {r}")
            assert_bitwise(z_dist, z_cpu, f"case {i} rank {r} combine of signed zeros")
            assert_bitwise(o_dist, o_cpu, f"case {i} rank {r} combine")
        for i, (a, b) in enumerate(zip(dist_sums, cpu_sums)):
            assert_bitwise(a, b, f"all_reduce {i} rank {r}")


def t_compiled_layer_on_both(ctx, seed):
    outs = {}
    for transport in ("cpu", "dist"):
        comm = ctx.comm(transport=transport, max_tokens_per_rank=8, hidden=16, topk=3, num_experts=4 * ctx.world,
                        dtype=torch.float32, allreduce_slot_bytes=4096, timeout_ms=120_000)
        layer = moe.ExpertParallelMoE(comm, ffn=16, seed=seed)

        def step(x, layer=layer, comm=comm):
            y = layer(x)
            # Token counts differ between ranks; the all_reduce takes a [hidden] sum, the same shape everywhere.
            return y + x, comm.all_reduce((y * x).sum(0))

        f = torch.compile(step, fullgraph=True)
        outs[transport] = [f(rc.mark_dynamic_tokens(rand(seed + i, ctx.rank, ((3 * i + ctx.rank) % 9, 16)).to(comm.device)))
                           for i in range(3)]
    return outs


def test_compiled_layer_over_dist_gives_the_bits_of_the_cpu_transport(cpu_worlds):
    for outs in cpu_worlds(2).run(t_compiled_layer_on_both, 3):
        for (out_dist, sum_dist), (out_cpu, sum_cpu) in zip(outs["dist"], outs["cpu"]):
            assert_bitwise(out_dist, out_cpu, "compiled layer, dist vs cpu")
            assert_bitwise(sum_dist, sum_cpu, "compiled all_reduce, dist vs cpu")


# ------------------------------------------------------ the decision function

A, B = "hostA/boot1", "hostB/boot2"


def gpus(*hosts_and_gpus, blocked=()):
    """RankReports: (host, gpu) per rank; ``blocked`` (rank, peer rank) pairs without peer access."""
    reps = [RankReport(h, g, ()) for h, g in hosts_and_gpus]
    for a, b in blocked:
        reps[a] = reps[a]._replace(no_peer_access=reps[a].no_peer_access + (reps[b].gpu,))
    return reps


def choose(requested, reports, with_gpu=True, allow_shared_gpu=False):
    return choose_transport(requested, reports, with_gpu=with_gpu, allow_shared_gpu=allow_shared_gpu,
                            forced_by="the test")


AUTO_CASES = {
    "one host, a GPU each": (gpus((A, "g0"), (A, "g1"), (A, "g2")), {}, "gpu", False, "peer access between every pair"),
    "one host, no GPUs": (gpus((A, None), (A, None)), {}, "cpu", False, "one host without a GPU"),
    "CPU-only build": (gpus((A, None), (A, None)), dict(with_gpu=False), "cpu", False, "without GPU support"),
    "one host, one rank without a GPU": (gpus((A, "g0"), (A, None)), {}, "cpu", False, "ranks [1] have no GPU"),
    "two hosts, no GPUs": (gpus((A, None), (A, None), (B, None), (B, None)), {}, "dist", True,
                           "span 2 hosts (ranks [0, 1] on hostA/boot1; ranks [2, 3] on hostB/boot2)"),
    "two hosts, GPUs": (gpus((A, "g0"), (B, "g1")), {}, "dist", True, "span 2 hosts"),
    "shared GPU": (gpus((A, "g0"), (A, "g1"), (A, "g0")), {}, "dist", True, "rank 0 and rank 2"),
    "shared GPU, allowed": (gpus((A, "g0"), (A, "g0")), dict(allow_shared_gpu=True), "gpu", False,
                            "RDNA4_COMM_ALLOW_SHARED_GPU=1"),
    "no peer access": (gpus((A, "g0"), (A, "g1"), (A, "g2"), blocked=[(2, 1)]), {}, "dist", True,
                       "rank 2's GPU has no peer access to rank 1's GPU"),
    "more ranks than the GPU kernels take": (gpus(*[(A, f"g{i}") for i in range(rc._C.transports()['gpu'].max_world + 1)]), {},
                                             "dist", True, f"at most {rc._C.transports()['gpu'].max_world} ranks"),
    "one rank": (gpus((A, "g0")), {}, "gpu", False, "a GPU per rank"),
}


@pytest.mark.parametrize("case", AUTO_CASES, ids=list(AUTO_CASES))
def test_auto_choice(case):
    reports, kwargs, transport, fallback, why = AUTO_CASES[case]
    choice = choose("auto", reports, **kwargs)
    assert (choice.transport, choice.fallback) == (transport, fallback), choice
    assert why in choice.reason, choice.reason


def test_forced_transports():
    two_hosts = gpus((A, None), (B, None))
    with pytest.raises(RuntimeError, match=r"transport='cpu' is not possible: .* span 2 hosts .* use transport='dist'"):
        choose("cpu", two_hosts)
    with pytest.raises(RuntimeError, match=r"transport='gpu' is not possible: ranks \[0, 1\] have no GPU"):
        choose("gpu", gpus((A, None), (A, None)))
    with pytest.raises(RuntimeError, match="transport='gpu' is not possible: the ranks span 2 hosts"):
        choose("gpu", gpus((A, "g0"), (B, "g1")))
    with pytest.raises(RuntimeError, match="no peer access"):
        choose("gpu", gpus((A, "g0"), (A, "g1"), blocked=[(0, 1)]))
    assert choose("dist", two_hosts) == ("dist", "forced by the test", False)
    assert choose("cpu", gpus((A, "g0"), (A, "g1"))) == ("cpu", "forced by the test", False)
    assert choose("gpu", gpus((A, "g0"), (A, "g1"))).transport == "gpu"


report_st = st.builds(RankReport, st.sampled_from([A, B]), st.sampled_from([None, "g0", "g1", "g2", "g3"]),
                      st.lists(st.sampled_from(["g0", "g1", "g2", "g3"]), max_size=2).map(tuple))


@settings(deadline=None, derandomize=True, max_examples=examples(300))
@given(reports=st.lists(report_st, min_size=1, max_size=10), with_gpu=st.booleans(), shared=st.booleans())
def test_auto_choice_on_any_reports(reports, with_gpu, shared):
    choice = choose("auto", reports, with_gpu=with_gpu, allow_shared_gpu=shared)
    assert choice == choose("auto", list(reports), with_gpu=with_gpu, allow_shared_gpu=shared)  # pure
    one_host = len({r.host for r in reports}) == 1
    assert choice.transport != "cpu" or one_host  # shared memory needs one host
    assert choice.fallback == (choice.transport == "dist")
    if choice.transport == "gpu":
        assert with_gpu and one_host and all(r.gpu for r in reports)
        assert choose("gpu", reports, with_gpu=with_gpu, allow_shared_gpu=shared).transport == "gpu"
    else:
        with pytest.raises(RuntimeError, match="transport='gpu' is not possible"):
            choose("gpu", reports, with_gpu=with_gpu, allow_shared_gpu=shared)


# ------------------------------------------------- simulated hosts, forced ones

TWO_HOSTS = {r: {HOST_ID_ENV: f"simulated-host-{r // 2}"} for r in range(4)}


@pytest.fixture(scope="module")
def two_hosts():
    """4 ranks as 2 hosts x 2 (RDNA4_COMM_HOST_ID per rank)."""
    with World(4, "dist", env_of_rank=TWO_HOSTS) as world:
        yield world


def t_auto_round_trip(ctx, cfg, seed, Ts, kind, weights):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = ctx.comm(transport="auto", **cfg)
    x, idx, w = (t if t is None else t.to(comm.device)
                 for t in ep_inputs(seed, ctx.rank, ctx.world, Ts[ctx.rank], ref_cfg(cfg), kind, weights))
    d = comm.dispatch(x, idx, w)
    out = comm.combine(expert_fn(d.x, ctx.rank), d.handle)
    s = comm.all_reduce(rand(seed, ctx.rank, (1 + seed % 3000,)).to(comm.device))
    return comm.transport, comm.transport_reason, [str(c.message) for c in caught], d, out, s


@SETTINGS
@given(data=st.data())
def test_auto_on_two_simulated_hosts_chooses_dist_and_matches_the_reference(two_hosts, data):
    cfg, seed, Ts, kind, weights = data.draw(ep_cases(4))
    ref, ref_out = expected_round_trip(4, cfg, seed, Ts, kind, weights)
    ref_sum = rc.reference.all_reduce([rand(seed, r, (1 + seed % 3000,)) for r in range(4)])
    for r, (transport, reason, warned, d, out, s) in enumerate(two_hosts.run(t_auto_round_trip, cfg, seed, Ts, kind,
                                                                             weights)):
        assert transport == "dist" and "span 2 hosts" in reason, reason
        # One warning per rank and communicator, when it is constructed (cached ones say nothing).
        assert all("uses transport 'dist'" in w and "span 2 hosts" in w for w in warned) and len(warned) <= 1, warned
        assert_dispatched(d, ref[r], f"rank {r}")
        assert_bitwise(out, ref_out[r], f"rank {r} combine")
        assert_bitwise(s, ref_sum, f"rank {r} all_reduce")


def t_construct(ctx, env, kwargs):
    """Construct a communicator with ``env`` set; its (transport, reason), or the error's (type, message)."""
    os.environ.update(env)
    try:
        with rc.Communicator(**kwargs) as comm:
            return comm.transport, comm.transport_reason
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, str(e)
    finally:
        for name in env:
            del os.environ[name]


def test_forced_transports_on_two_simulated_hosts(two_hosts):
    runs = {name: two_hosts.run(t_construct, env, kwargs) for name, (env, kwargs) in {
        "cpu": ({}, dict(transport="cpu")),
        "cpu by env": ({TRANSPORT_ENV: "cpu"}, {}),
        "gpu": ({}, dict(transport="gpu")),
        "dist by env": ({TRANSPORT_ENV: "dist"}, {}),
        "argument over env": ({TRANSPORT_ENV: "cpu"}, dict(transport="dist")),
        "bad env": ({TRANSPORT_ENV: "nvlink"}, {}),
    }.items()}
    for kind, message in runs["cpu"] + runs["cpu by env"]:
        assert kind == "RuntimeError" and "transport='cpu' is not possible" in message, message
        assert "span 2 hosts (ranks [0, 1] on simulated-host-0; ranks [2, 3] on simulated-host-1)" in message
    for kind, message in runs["gpu"]:
        assert kind == "RuntimeError" and "transport='gpu' is not possible" in message, message
    assert runs["dist by env"] == [("dist", f"forced by {TRANSPORT_ENV}")] * 4
    assert runs["argument over env"] == [("dist", "forced by the transport argument")] * 4
    for kind, message in runs["bad env"]:
        assert kind == "ValueError" and f"{TRANSPORT_ENV} must be one of" in message


def test_one_host_auto_and_env(worlds):
    """One host without GPUs (on a GPU box: with them hidden): auto is "cpu";
    RDNA4_COMM_TRANSPORT=dist replaces auto."""
    hidden = {r: {"CUDA_VISIBLE_DEVICES": ""} for r in range(2)}
    with contextlib.ExitStack() as stack:
        world = stack.enter_context(World(2, "cpu", env_of_rank=hidden)) if GPU_WORLDS else worlds("cpu", 2)
        for transport, reason in world.run(t_construct, {}, dict(transport="auto")):
            assert transport == "cpu" and reason.startswith("one host without a GPU on every rank"), reason
        assert world.run(t_construct, {TRANSPORT_ENV: "dist"}, {}) == [("dist", f"forced by {TRANSPORT_ENV}")] * 2


# ------------------------------------------- GPU probe failure (fault injection)

@pytest.mark.skipif(not GPU_WORLDS, reason="needs 2+ GPUs and a GPU build")
def test_a_failed_gpu_probe_falls_back_to_dist_under_auto_and_raises_under_gpu(testing_extension):
    """Rank 0's probe words never reach rank 1's heap (t_losing_peer_writes);
    rank 1's real verification catches it."""
    with World(2, "gpu") as world:
        for transport, reason in world.run(t_losing_peer_writes, t_auto_round_trip_warned):
            assert transport == "dist" and "peer-to-peer probe failed" in reason and "rank 0 -> rank 1" in reason
        for kind, message in world.run(t_losing_peer_writes, t_construct, {}, dict(transport="gpu")):
            assert kind == "RuntimeError" and "rank 0 -> rank 1" in message, message


def t_losing_peer_writes(ctx, task, *args):
    """task(ctx, *args) with rank 1 publishing, for each GPU heap it makes, a
    spare allocation as the heap's data (gpu_testing's with_spare_data):
    rank 0 writes its probe words there and its flag into rank 1's signal
    memory, so rank 1 sees the flag and not the words."""
    if ctx.rank != 1:
        return task(ctx, *args)
    create = rc._C.create

    def create_with_spare_data(config):
        record = create(config)
        if config.transport != "gpu":
            return record
        # The heap's data size (heap_bytes knows no FP8 dispatch; these communicators have none).
        elt = torch.empty((), dtype=config.dtype).element_size()
        _, data_bytes = rc._C.testing.heap_bytes(config.world, config.cap, config.hidden, config.topk, elt,
                                                 config.ar_slot_bytes)
        return gpu_testing.load().with_spare_data(record, config.device_index, data_bytes)

    with mock.patch.object(rc._C, "create", create_with_spare_data):
        return task(ctx, *args)


def t_auto_round_trip_warned(ctx):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rc.Communicator(transport="auto") as comm:
            x = rand(1, ctx.rank, (300,)).to(comm.device)
            got = comm.all_reduce(x)
            assert_bitwise(got, rc.reference.all_reduce([rand(1, r, (300,)) for r in range(ctx.world)]).to(got.device))
            warned = [str(c.message) for c in caught]
            assert len(warned) == 1 and "rank 0 -> rank 1" in warned[0], warned
            return comm.transport, comm.transport_reason


# ------------------------------------------- gloo over CUDA tensors


def t_capture_over_gloo(ctx):
    comm = ctx.comm(allreduce_slot_bytes=4096)
    x = rand(5, ctx.rank, (300,)).to(ctx.device)
    comm.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            comm.all_reduce(x)
        refused = None
    except ValueError as e:
        refused = str(e)
    return refused, comm.all_reduce(x)


@pytest.mark.skipif(not GPU_WORLDS or torch.cuda.device_count() >= 2,
                    reason="needs ranks sharing a GPU, where dist's group is gloo over CUDA tensors")
def test_dist_over_gloo_refuses_a_graph_capture_and_stays_usable(worlds):
    for refused, after in worlds("dist", 2).run(t_capture_over_gloo):
        assert refused is not None and "gloo cannot be captured in a CUDA graph" in refused, refused
        assert_bitwise(after, rc.reference.all_reduce([rand(5, r, (300,)) for r in range(2)]), "eager after")
