"""all_reduce: bitwise against the reference on every world, both algorithms,
chunking, back-to-back calls, torch.compile, opcheck and bad inputs."""
from __future__ import annotations

import pytest
import torch
from common import assert_bitwise, examples, rand
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdna4_comm as rc
from rdna4_comm import reference

# A small slot makes modest tensors take several chunks on both paths.
SLOT = 8 << 10
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    max_examples=examples(100))


def t_all_reduce(ctx, seed, shapes, dtypes, slot):
    comm = ctx.comm(allreduce_slot_bytes=slot)
    outs = [comm.all_reduce(rand(seed + i, ctx.rank, s, d).to(ctx.device)) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    return outs  # fetched only after the last call: no host sync in between


def check_against_reference(world, seed, shapes, dtypes, slot=SLOT):
    outs = world.run(t_all_reduce, seed, shapes, dtypes, slot)
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        ref = reference.all_reduce([rand(seed + i, r, shape, dtype) for r in range(world.size)])
        for r in range(world.size):
            assert_bitwise(outs[r][i], ref, f"call {i} shape {shape} {dtype} rank {r}")


shape_st = st.one_of(
    st.tuples(st.integers(1, 5000)),
    st.tuples(st.integers(1, 64), st.integers(1, 300)),
    st.tuples(st.integers(1, 4), st.integers(1, 8), st.integers(1, 33)),
)


@SETTINGS
@given(seed=st.integers(0, 2**20), shapes=st.lists(shape_st, min_size=1, max_size=4),
       dtype=st.sampled_from(DTYPES))
def test_matches_reference(world, seed, shapes, dtype):
    check_against_reference(world, seed, shapes, [dtype] * len(shapes))


def test_empty_tensors_between_others(world):
    """Empty tensors (whose data pointer is null) reduce to empty results,
    and the calls around them to the reference's."""
    check_against_reference(world, 5, [(0,), (7,), (3, 0), (9,)], DTYPES + [torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_sides_of_the_algorithm_boundary(world, dtype):
    elt = torch.tensor([], dtype=dtype).element_size()
    limit = rc._C.testing.one_shot_max_bytes[world.transport]
    sizes = [limit // elt - 1, limit // elt, limit // elt + 1, 3 * limit // elt + 7]
    algos = {rc.allreduce_algorithm(n * elt, world.size, world.transport) for n in sizes}
    if world.size > 2:
        assert algos == {"one_shot", "two_shot"}
    check_against_reference(world, 11, [(n,) for n in sizes], [dtype] * len(sizes), slot=256 << 10)


def test_algorithm_predicate():
    for transport in ("cpu", "gpu"):
        limit = rc._C.testing.one_shot_max_bytes[transport]
        assert rc.allreduce_algorithm(limit, 4, transport) == "one_shot"
        assert rc.allreduce_algorithm(limit + 1, 4, transport) == "two_shot"
        # Two ranks move the same bytes either way; one-shot saves a barrier.
        assert rc.allreduce_algorithm(1 << 30, 2, transport) == "one_shot"
        assert rc.allreduce_algorithm(1, 1, transport) == "one_shot"


def test_back_to_back_500_calls_changing_shapes(world_small):
    g = torch.Generator().manual_seed(5)
    n = 500
    sizes = torch.randint(1, 3000, (n,), generator=g).tolist()
    kinds = torch.randint(0, 3, (n,), generator=g).tolist()
    check_against_reference(world_small, 1000, [(s,) for s in sizes], [DTYPES[k] for k in kinds])


def t_compiled(ctx, seed):
    comm = ctx.comm(allreduce_slot_bytes=SLOT)

    def tp_block(x, w):
        return torch.relu(comm.all_reduce(x @ w) * 0.5 + 1.0)

    compiled = torch.compile(tp_block, fullgraph=True)
    out = []
    for i, t in enumerate((3, 8, 5)):
        x = rand(seed + i, ctx.rank, (t, 16)).to(ctx.device)
        w = rand(seed, 0, (16, 24)).to(ctx.device)
        out.append((tp_block(x, w), compiled(x, w)))
    return out


def test_torch_compile_fullgraph_equals_eager(worlds):
    world = worlds("cpu", 2)
    for pairs in world.run(t_compiled, 3):
        for eager, compiled in pairs:
            assert_bitwise(compiled, eager, "compiled vs eager")


def t_opcheck(ctx):
    comm = ctx.comm(allreduce_slot_bytes=SLOT)
    for dtype in DTYPES:
        x = rand(1, ctx.rank, (7, 5), dtype).to(ctx.device)
        torch.library.opcheck(torch.ops.rdna4_comm.all_reduce.default, (x, rc.ops.order_token(x.device), comm.id))
    return True


def test_opcheck(world_small):
    assert all(world_small.run(t_opcheck))


def t_large_tensor_is_chunked(ctx):
    comm = ctx.comm(allreduce_slot_bytes=SLOT)
    # 40x the slot: one-shot and two-shot both take many chunks.
    return comm.all_reduce(rand(77, ctx.rank, (40 * SLOT // 4,)).to(ctx.device))


def test_tensor_larger_than_the_heap_buffer_is_processed_in_chunks(world_small):
    outs = world_small.run(t_large_tensor_is_chunked)
    ref = reference.all_reduce([rand(77, r, (40 * SLOT // 4,)) for r in range(world_small.size)])
    for out in outs:
        assert_bitwise(out, ref, "chunked all_reduce")
