"""rdna4_comm on whatever this machine has: ``python -m rdna4_comm.demo``.

Finds the GPUs (one process per GPU when there are at least 2 and rdna4_comm
was built with GPU support; else 2 CPU processes over shared memory), then in
every process:

1. all_reduce of fp32 tensors from 3 elements to 20 MiB (more than the heap's
   buffer: processed in chunks), bitwise equal to rdna4_comm.reference, with
   the algorithm each size takes;
2. an expert-parallel MoE layer (rdna4_comm.moe.ExpertParallelMoE: route,
   dispatch, local experts, combine) against the single-process
   rdna4_comm.moe.dense_moe, within bf16 rounding;
3. a raw dispatch -> combine round trip, bitwise equal to
   rdna4_comm.reference.dispatch/combine, and the same with FP8 dispatch
   (Communicator(dispatch_dtype=torch.float8_e4m3fn));
4. a tensor-parallel MLP block (rdna4_comm.tp.TensorParallelMLP.forward_norm: sharded
   matmuls, then all_reduce_rmsnorm into the next norm) against the
   single-process rdna4_comm.tp.dense_mlp_block, within bf16 rounding;

and, when every check passed on every rank, a latency table of rdna4_comm
against torch.distributed, timed as the benchmarks time it (benchmarks/),
and the TP block with the fused op against the same block unfused.
Exits 1 if anything failed.
"""
from __future__ import annotations

import argparse
import sys

import torch

from . import _C, reference
from ._bench.cases import EP_EXPERTS, EP_TOPK, allreduce_ops, ep_ops, record
from ._checks import assert_same, rand
from ._bench.report import comparison_table
from ._timing import Op, measure
from ._bench.world import describe, launch, resolve_world
from ._ranks import CheckFailed
from ._launch import WorldFailed
from .algorithms import allreduce_algorithm
from .communicator import Communicator
from .fp8 import num_scales
from .moe import ExpertParallelMoE, dense_moe, init_weights
from .tp import LlamaStyleMLP, TensorParallelMLP, dense_mlp_block
from .tp import init_weights as init_tp_weights

# The checks' layer: small enough for CPU processes, big enough for several
# experts per rank and tokens routed to every rank.
CAP, HIDDEN, TOPK, EXPERTS, FFN = 64, 256, 4, 32, 128
# all_reduce shapes, the last (5 Mi elements) larger than the default buffer of
# either transport, so it is chunked.
ALLREDUCE_SHAPES = [(3,), (8, 4096), (512, 4096), (5 << 20,)]
# The latency table: all_reduce [tokens, 4096] fp32; dispatch+combine of
# [tokens, 2048] bf16, top-8 of 256 experts (the benchmark's EP setup).
TABLE_ALLREDUCE_TOKENS = (1, 32, 512)
TABLE_EP_TOKENS = (8, 128)
TABLE_EP_HIDDEN = 2048
# The TP block of the check and the table (bf16), small enough for CPU processes.
TP_HIDDEN, TP_FFN = 1024, 2048
TABLE_TP_TOKENS = (1, 32)


def check_all_reduce(ctx, comm) -> str:
    """Random fp32 tensors summed by rdna4_comm equal reference.all_reduce bitwise."""
    paths = []
    for i, shape in enumerate(ALLREDUCE_SHAPES):
        out = comm.all_reduce(rand(i, ctx.rank, shape).to(ctx.device))
        expected = reference.all_reduce([rand(i, r, shape) for r in range(ctx.world)])
        assert_same(out, expected, f"all_reduce {list(shape)} vs reference.all_reduce")
        paths.append(f"{list(shape)} {allreduce_algorithm(out.numel() * 4, ctx.world, ctx.transport)}")
    return "bitwise equal to reference.all_reduce: " + ", ".join(paths)


def check_moe(ctx, comm) -> str:
    """ExpertParallelMoE over the ranks equals dense_moe within bf16 rounding."""
    layer = ExpertParallelMoE(comm, ffn=FFN, seed=1)
    weights = (w.to(ctx.device) for w in init_weights(1, EXPERTS, HIDDEN, FFN))
    tokens = CAP - 5 * (ctx.rank % 4)  # token counts may differ between ranks
    # A quarter of rand's values (std 4; exact in bf16) keeps the activations
    # near 1, where the bf16 roundings stay far inside the tolerance below.
    x = (rand(100, ctx.rank, (tokens, HIDDEN), torch.bfloat16) / 4).to(ctx.device)
    out, dense = layer(x), dense_moe(x, *weights, TOPK)
    # Two bf16 roundings (expert rows, then combine) against dense's one.
    torch.testing.assert_close(out.float(), dense.float(), rtol=3e-2, atol=3e-2)
    return (f"{tokens} tokens x {HIDDEN}, top-{TOPK} of {EXPERTS} experts: "
            f"max |difference| {(out.float() - dense.float()).abs().max().item():.3g}")


def check_round_trip(ctx, comm) -> str:
    """dispatch -> combine equals reference.dispatch/combine bitwise (every field)."""
    op = ep_ops(ctx, comm, CAP)[0]
    op.check(op.run())
    return f"{CAP} tokens x {HIDDEN}: every dispatch output and the combine result bitwise equal to the reference"


def check_fp8_round_trip(ctx, comm) -> str:
    """FP8 dispatch (x quantised in the op) -> dequantised rows -> combine:
    the FP8 bytes and scales bitwise equal to the reference's, combine to
    reference.combine of the dequantised rows."""
    with Communicator(ctx.cpu_group, max_tokens_per_rank=CAP, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS,
                      dtype=torch.bfloat16, transport=ctx.transport, dispatch_dtype=torch.float8_e4m3fn) as fp8:
        op = ep_ops(ctx, fp8, CAP)[0]
        op.check(op.run())
    return (f"{CAP} tokens x {HIDDEN}, {HIDDEN + 4 * num_scales(HIDDEN)} payload bytes a row (bf16: {2 * HIDDEN}): "
            "FP8 rows, scales and the combine bitwise equal to the reference")


def check_tp(ctx, comm) -> str:
    """TensorParallelMLP over the ranks equals dense_mlp_block within bf16 rounding."""
    weights = init_tp_weights(2, TP_HIDDEN, TP_FFN)
    mlp = TensorParallelMLP(LlamaStyleMLP(weights, ctx.device), comm)
    normed = rand(200, 0, (16, TP_HIDDEN), torch.bfloat16) / 4  # unit scale, exact in bf16
    residual = rand(201, 0, (16, TP_HIDDEN), torch.bfloat16) / 4
    out, residual_out = mlp.forward_norm(normed.to(ctx.device), residual.to(ctx.device),
                                         weights["next_norm"].to(ctx.device))
    dense_out, dense_residual = dense_mlp_block(normed, residual, weights)
    torch.testing.assert_close(residual_out.cpu().float(), dense_residual.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.cpu().float(), dense_out.float(), rtol=3e-2, atol=3e-2)
    return (f"16 tokens x {TP_HIDDEN}, ffn {TP_FFN} over {ctx.world} ranks: max |difference| "
            f"{(out.cpu().float() - dense_out.float()).abs().max().item():.3g}")


def tp_block_ops(ctx, comm, tokens: int) -> list[Op]:
    """The TP block with all_reduce_rmsnorm against the same block unfused
    (all_reduce, add, RMSNorm): the same residual_out bitwise."""
    weights = init_tp_weights(2, TP_HIDDEN, TP_FFN)
    mlp = TensorParallelMLP(LlamaStyleMLP(weights, ctx.device), comm)
    norm = weights["next_norm"].to(ctx.device)
    normed = (rand(300, 0, (tokens, TP_HIDDEN), torch.bfloat16) / 4).to(ctx.device)
    residual = (rand(301, 0, (tokens, TP_HIDDEN), torch.bfloat16) / 4).to(ctx.device)
    expected = mlp.forward_norm_unfused(normed, residual, norm)[1].cpu()

    def check(result):
        assert_same(result[1].cpu(), expected, f"TP block [{tokens}, {TP_HIDDEN}] residual_out, fused vs unfused")

    return [Op("rdna4_comm", lambda: mlp.forward_norm(normed, residual, norm), check,
               detail="TP block, all_reduce_rmsnorm"),
            Op("rdna4_comm_unfused", lambda: mlp.forward_norm_unfused(normed, residual, norm), check,
               detail="TP block, all_reduce + add + RMSNorm")]


CHECKS = [
    ("all_reduce", check_all_reduce),
    ("MoE layer (dispatch -> experts -> combine) vs dense_moe", check_moe),
    ("dispatch/combine round trip", check_round_trip),
    ("FP8 dispatch/combine round trip", check_fp8_round_trip),
    ("tensor-parallel MLP block (all_reduce_rmsnorm) vs dense_mlp_block", check_tp),
]


def _demo(ctx, rounds: int, samples: int) -> None:
    info = describe(ctx)
    ctx.emit(f"rank 0: {info['device']}; torch {info['versions']['torch']}; "
             f"baseline torch.distributed backend: {info['baseline_backend']}")
    failed = False
    with Communicator(ctx.cpu_group, max_tokens_per_rank=CAP, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS,
                      dtype=torch.bfloat16, transport=ctx.transport) as comm:
        ctx.emit(f"checks on every rank ({comm!r} on rank 0):")
        for name, check in CHECKS:
            try:
                detail, error = check(ctx, comm), None
            except Exception as e:  # noqa: BLE001  (reported, and agreed on by all ranks)
                detail, error = "", f"{type(e).__name__}: {e}"
            bad = ctx.errors(error)
            failed |= bool(bad)
            ctx.emit(f"  {'FAIL' if bad else 'ok  '}  {name}: " + ("; ".join(bad) if bad else detail))
        if failed:
            raise CheckFailed("demo: a check failed (see above)")

        records = []
        for tokens in TABLE_ALLREDUCE_TOKENS:
            ops = allreduce_ops(ctx, comm, tokens, 4096)
            records.append(record("all_reduce", tokens, 4096, torch.float32, ops,
                                  measure(ctx, ops, rounds=rounds, samples=samples)))
        for tokens in TABLE_TP_TOKENS:
            ops = tp_block_ops(ctx, comm, tokens)
            records.append(record("TP MLP block", tokens, TP_HIDDEN, torch.bfloat16, ops,
                                  measure(ctx, ops, rounds=rounds, samples=samples)))
    for tokens in TABLE_EP_TOKENS:
        with Communicator(ctx.cpu_group, max_tokens_per_rank=tokens, hidden=TABLE_EP_HIDDEN, topk=EP_TOPK,
                          num_experts=EP_EXPERTS, dtype=torch.bfloat16, transport=ctx.transport) as comm:
            ops = ep_ops(ctx, comm, tokens)
            records.append(record("dispatch+combine", tokens, TABLE_EP_HIDDEN, torch.bfloat16, ops,
                                  measure(ctx, ops, rounds=rounds, samples=samples)))
    ctx.emit(f"\nlatency, p50 over {rounds} rounds x {samples} samples of the max over ranks "
             f"({'CUDA-graph replays' if ctx.transport == 'gpu' else 'eager calls'}; "
             f"x = speedup of rdna4_comm, > 1 is faster):\n" + comparison_table(records))


def _print(msg) -> None:
    print(f"note: {msg['note']}" if isinstance(msg, dict) else msg, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rdna4_comm.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto (default): the library's own choice for one process per GPU when >= 2 are usable "
                        "(gpu, or dist without peer access), else for CPU processes (cpu)")
    p.add_argument("--world", type=int, help="processes (default: every GPU, or 2 CPU processes)")
    p.add_argument("--rounds", type=int, default=4, help="timing rounds (default 4)")
    p.add_argument("--samples", type=int, default=10, help="timed calls per backend per round (default 10)")
    args = p.parse_args(argv)
    for name in ("world", "rounds", "samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"found: {gpus} GPU(s) visible to torch {torch.__version__}; rdna4_comm "
          f"{'has' if _C.with_gpu else 'was built without'} GPU support", flush=True)
    try:
        transport, world = resolve_world(args.transport, args.world)
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    where = "one process per GPU" if transport == "gpu" else "CPU processes, shared memory"
    print(f"running: world of {world} ({where}), transport {transport}", flush=True)
    try:
        launch(_demo, (args.rounds, args.samples), transport=transport, world=world, on_message=_print)
    except WorldFailed as e:
        print(f"demo FAILED: {e}", file=sys.stderr)
        return 1
    print("demo: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
