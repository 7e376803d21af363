"""The ops' eager entry points (rdna4_comm._C.eager, what the Communicator
methods call outside torch.compile): plain calls skip the dispatcher and
give the op's results; everything the dispatcher or Python must see (modes,
tensor subclasses, inputs that require grad, keyword or mistyped
arguments) goes through the op itself, and profilers see the op either way."""
from __future__ import annotations

import torch
from common import assert_bitwise, ep_inputs, rand
from torch.utils._python_dispatch import TorchDispatchMode

import rdna4_comm as rc
from rdna4_comm import _C

CAP, H, K = 6, 8, 3


def ep_cfg(W):
    return dict(max_tokens_per_rank=CAP, hidden=H, topk=K, num_experts=2 * W, dtype=torch.bfloat16)


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Tagged(torch.Tensor):
    """A subclass whose __torch_function__ counts the calls it sees."""
    seen = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def t_predicate(ctx):
    comm = ctx.comm(**ep_cfg(ctx.world))
    x, idx, w = (t.to(ctx.device) for t in ep_inputs(1, ctx.rank, ctx.world, 4, dict(ep_cfg(ctx.world)), "random"))
    args = (x, idx, w, comm._order, comm.id)
    plain = _C.eager.is_plain_call
    with torch.inference_mode():
        inference_x = x.clone()
    grad_x = x.clone().requires_grad_()
    with torch.no_grad():
        no_grad = plain("dispatch", grad_x, *args[1:])
    mode = RecordOps()
    with mode:
        under_mode = plain("dispatch", *args)
    return {
        "plain": plain("dispatch", *args),
        "no weights": plain("dispatch", x, idx, None, comm._order, comm.id),
        "inference tensor": plain("dispatch", inference_x, *args[1:]),
        "requires grad": plain("dispatch", grad_x, *args[1:]),
        "requires grad, no_grad": no_grad,
        "subclass": plain("dispatch", x.as_subclass(Tagged), *args[1:]),
        "dispatch mode": under_mode,
        "keyword": plain("dispatch", *args[:-1], comm=comm.id),
        "too few": plain("dispatch", *args[:-1]),
        "str for a tensor": plain("dispatch", "x", *args[1:]),
        "int for the eps float": plain("all_reduce_rmsnorm", x, None, x[0], 1, comm._order, comm.id),
        "conjugate view": plain("all_reduce", torch.ones(4, dtype=torch.complex64, device=ctx.device).conj(),
                                comm._order, comm.id),
    }


def test_the_predicate_sends_plain_calls_past_the_dispatcher_and_the_rest_to_the_op(world_small):
    expected = {
        "plain": True, "no weights": True, "inference tensor": True, "requires grad": False,
        "requires grad, no_grad": True, "subclass": False, "dispatch mode": False, "keyword": False,
        "too few": False, "str for a tensor": False, "int for the eps float": False, "conjugate view": False,
    }
    for got in world_small.run(t_predicate):
        assert got == expected


def t_both_paths(ctx):
    W = ctx.world
    comm = ctx.comm(**ep_cfg(W))
    x, idx, w = (t.to(ctx.device) for t in ep_inputs(2, ctx.rank, W, 5, dict(ep_cfg(W)), "random"))
    ops = torch.ops.rdna4_comm
    # The same collectives in the same order on every rank: eager entry, op, the entry under a mode, the
    # entry with a subclass, with profiling.
    fast = _C.eager.dispatch(x, idx, w, comm._order, comm.id)
    slow = ops.dispatch.default(x, idx, w, comm._order, comm.id)
    mode = RecordOps()
    with mode:
        moded = _C.eager.dispatch(x, idx, w, comm._order, comm.id)
    Tagged.seen = 0
    tagged = _C.eager.dispatch(x.as_subclass(Tagged), idx, w, comm._order, comm.id)
    counts, recv_src, src_tokens, send_mask, dispatch_round = fast[3:]
    y = fast[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = _C.eager.combine(y, recv_src, counts, src_tokens, send_mask, dispatch_round, comm._order, comm.id)
    out_op = ops.combine.default(y, recv_src, counts, src_tokens, send_mask, dispatch_round, comm._order, comm.id)
    names = {e.name for e in prof.events()}
    ar = _C.eager.all_reduce(rand(3, ctx.rank, (16,)).to(ctx.device), comm._order, comm.id)
    return ([t.cpu() for t in fast], [t.cpu() for t in slow], [t.cpu() for t in moded], [t.cpu() for t in tagged],
            mode.ops, Tagged.seen, "rdna4_comm::combine" in names, out.cpu(), out_op.cpu(), ar.cpu())


def test_eager_entry_points_give_the_ops_results_and_keep_modes_subclasses_and_profilers(world_small):
    results = world_small.run(t_both_paths)
    ref_ar = rc.reference.all_reduce([rand(3, r, (16,)) for r in range(world_small.size)])
    for fast, slow, moded, tagged, mode_ops, seen, profiled, out, out_op, ar in results:
        received = int(fast[3].sum())
        # dispatch_round, the last output, counts the four dispatches.
        assert [int(o[-1]) for o in (fast, slow, moded, tagged)] == [int(fast[-1]) + i for i in range(4)]
        for a, b, c, d in zip(fast[:-1], slow[:-1], moded[:-1], tagged[:-1]):
            if a.dim() == 2 and a.dtype == torch.bfloat16:  # x: its padding rows are unspecified
                a, b, c, d = (t[:received] for t in (a, b, c, d))
            assert_bitwise(a, b)
            assert_bitwise(c, b)
            assert_bitwise(d, b)
        assert mode_ops == ["rdna4_comm.dispatch.default"]
        assert seen >= 1
        assert profiled
        assert_bitwise(out, out_op)
        assert_bitwise(ar, ref_ar)
