"""The workload scripts/gpu_sanitize.sh runs under compute-sanitizer: every
op once, small (dispatch and combine in both layouts; FP8 dispatch that
quantises x in the op, rank layout, and of a (q, scales) pair, expert
layout), with W = 2 ranks on the GPU (sharing it where there is one),
eager and under graph replay, each result checked bitwise against
rdna4_comm.reference (the fused op's `out` against its contract).

    python3 scripts/sanitize_ops.py [--plant-oob]

--plant-oob: rank 1 also makes one store past the end of an allocation of
its own, which memcheck must report: the proof that the sanitizer
instruments the rank processes, not only this launcher."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import rdna4_comm as rc
from rdna4_comm import reference
from rdna4_comm.reference import assert_rmsnorm_within_contract
from rdna4_comm._checks import assert_dispatched, assert_expert_dispatched, assert_same
from rdna4_comm._launch import Member, ProcessWorld, to_cpu
from rdna4_comm._ranks import RankContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gpu_testing  # noqa: E402  (the testing extension, for --plant-oob)

W, CAP, H, TOPK = 2, 16, 64, 2
H8 = 256  # FP8 dispatch's rows: two whole scale blocks, the quantising loop's vector path
FP8 = torch.float8_e4m3fn
EXPERTS = 4 * W
ALIGNMENT = 4  # the expert layout's: padding rows to write
TIMEOUT_MS = 600_000  # the sanitizer slows kernels by orders of magnitude
EPS = 1e-6


def gpu_rank(member: Member) -> RankContext:
    """A rank on the GPUs, shared round-robin where there are fewer than ranks."""
    device = torch.device("cuda", member.rank % torch.cuda.device_count())
    return RankContext(member.rank, member.world, "gpu", device, member.init_method, member=member)


def tensor(seed: int, rank: int, shape, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g).to(dtype)


def ep_inputs(rank: int, seed: int, T: int):
    g = torch.Generator().manual_seed(7000 * seed + rank)
    idx = torch.randint(0, EXPERTS, (T, TOPK), generator=g, dtype=torch.int32)
    return tensor(seed, rank, (T, H)), idx, torch.rand((T, TOPK), generator=g)


SLOT = 8192  # all_reduce slot bytes: small, so modest rows take every path W = 2 has


def wide_hidden() -> int:
    """The narrowest rows the fused op's gate sends down its all_reduce-then-
    norm path (rows wider than a slot). With W = 2 the other path is
    one_stage; two_stage needs W >= 3."""
    return next(h for h in range(H, 1 << 16, 64)
                if rc.all_reduce_rmsnorm_algorithm(3, h, torch.bfloat16, W, "gpu", SLOT) == "all_reduce_then_norm")


AR_ONE_SHOT, AR_TWO_SHOT = (5, 100), (300_000,)  # fp32: below and above the one-shot bound


def fp8_bytes(d):
    """A dispatch result with its FP8 x as bytes: FP8 storages do not pickle."""
    return d._replace(x=d.x.view(torch.uint8))


def every_op(ctx: RankContext, plant: bool):
    dev, r = ctx.device, ctx.rank
    config = dict(max_tokens_per_rank=CAP, topk=TOPK, num_experts=EXPERTS, dtype=torch.bfloat16,
                  allreduce_slot_bytes=SLOT, timeout_ms=TIMEOUT_MS, expert_alignment=ALIGNMENT)
    comm = rc.Communicator(hidden=H, **config)
    comm8 = rc.Communicator(hidden=H8, dispatch_dtype=FP8, **config)
    H2 = wide_hidden()
    x, idx, w = (t.to(dev) for t in ep_inputs(r, 1, 11))
    a1, a2 = tensor(2, r, AR_ONE_SHOT, torch.float32).to(dev), tensor(3, r, AR_TWO_SHOT, torch.float32).to(dev)
    f1, f2 = tensor(4, r, (3, H)).to(dev), tensor(5, r, (3, H2)).to(dev)
    residual1, residual2 = tensor(6, 0, (3, H)).to(dev), tensor(7, 0, (3, H2)).to(dev)
    weight1, weight2 = tensor(8, 0, (H,)).to(dev), tensor(9, 0, (H2,)).to(dev)
    x8 = tensor(10, r, (11, H8)).to(dev)
    pair8 = rc.quantize_fp8(x8)

    def step():
        d = comm.dispatch(x, idx, w)
        out = comm.combine(d.x * 2, d.handle)
        e = comm.dispatch(x, idx, w, layout="expert")
        out_e = comm.combine(e.x * 2, e.handle)
        fused1 = comm.all_reduce_rmsnorm(f1, residual1, weight1, EPS)
        fused2 = comm.all_reduce_rmsnorm(f2, residual2, weight2, EPS)
        q = fp8_bytes(comm8.dispatch(x8, idx, w))
        q_e = fp8_bytes(comm8.dispatch(pair8, idx, w, layout="expert"))
        return d, out, e, out_e, q, q_e, comm.all_reduce(a1), comm.all_reduce(a2), fused1, fused2

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(to_cpu(captured))  # the next replay overwrites them
    if plant and r == 1:
        gpu_testing.load().store_out_of_bounds(dev.index)
    torch.cuda.synchronize()
    comm.close()
    comm8.close()
    return eager, replays, H2


def check(per_rank) -> None:
    H2 = per_rank[0][2]
    xs, idxs, ws = zip(*(ep_inputs(r, 1, 11) for r in range(W)))

    def ref_dispatch(rows, **options):  # the ranks' routing, as every_op's calls take it
        return reference.dispatch(list(rows), list(idxs), list(ws), num_experts=EXPERTS, max_tokens_per_rank=CAP,
                                  **options)

    expert = dict(layout="expert", expert_alignment=ALIGNMENT)
    ref, ref_e = ref_dispatch(xs), ref_dispatch(xs, **expert)
    ref_out = reference.combine([ref[r].x * 2 for r in range(W)], ref)
    ref_e_out = reference.combine([ref_e[r].x * 2 for r in range(W)], ref_e)
    x8s = [tensor(10, r, (11, H8)) for r in range(W)]
    ref_q, ref_q_e = ref_dispatch(x8s, dispatch_dtype=FP8), ref_dispatch(x8s, dispatch_dtype=FP8, **expert)
    sums = [reference.all_reduce([tensor(s, r, shape, torch.float32) for r in range(W)])
            for s, shape in ((2, AR_ONE_SHOT), (3, AR_TWO_SHOT))]
    fused_inputs = [(4, 6, 8, (3, H)), (5, 7, 9, (3, H2))]
    for r in range(W):
        eager, replays, _ = per_rank[r]
        for what, (d, out, e, out_e, q, q_e, s1, s2, *fused) in [("eager", eager)] + [(f"replay {i}", p) for i, p in enumerate(replays)]:
            assert_dispatched(d, ref[r], f"rank {r} {what}: dispatch")
            assert_expert_dispatched(e, ref_e[r], f"rank {r} {what}: dispatch, expert layout")
            assert_dispatched(q, fp8_bytes(ref_q[r]), f"rank {r} {what}: FP8 dispatch")
            assert_expert_dispatched(q_e, fp8_bytes(ref_q_e[r]), f"rank {r} {what}: FP8 pair, expert layout")
            for name, got, want in (("combine", out, ref_out[r]), ("combine of the expert layout", out_e, ref_e_out[r]),
                                    ("all_reduce one-shot", s1, sums[0]), ("all_reduce two-shot", s2, sums[1])):
                assert_same(got, want, f"rank {r} {what}: {name} against rdna4_comm.reference")
            for (out_f, residual_out), (xs_seed, res_seed, w_seed, shape) in zip(fused, fused_inputs):
                residual, weight = tensor(res_seed, 0, shape), tensor(w_seed, 0, shape[-1:])
                _, want_residual = reference.all_reduce_rmsnorm(
                    [tensor(xs_seed, q, shape) for q in range(W)], residual, weight, EPS)
                assert_same(residual_out, want_residual, f"rank {r} {what}: fused residual_out {shape}")
                assert_rmsnorm_within_contract(out_f, residual_out, weight, EPS, f"rank {r} {what}: fused {shape}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plant-oob", action="store_true", help="rank 1 makes one out-of-bounds store")
    args = p.parse_args(argv)
    if args.plant_oob:
        gpu_testing.load()  # built here, before the ranks load it
    with ProcessWorld(W, gpu_rank) as world:
        per_rank = world.call(every_op, {r: (args.plant_oob,) for r in range(W)})
    check(per_rank)
    print(f"sanitize_ops: every op checked on {W} ranks (eager and 2 graph replays), FP8 dispatch quantised "
          f"and of a pair, the fused op one_stage "
          f"and all_reduce_then_norm (H = {per_rank[0][2]})"
          + (", planted out-of-bounds store made by rank 1" if args.plant_oob else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
