"""rdna4_comm on whatever this machine has: ``python -m rdna4_comm.demo``.

Finds the GPUs (one process per GPU when there are at least 2 and rdna4_comm
was built with GPU support; else 2 CPU processes over shared memory), then in
every process:

1. all_reduce of fp32 tensors from 3 elements to 20 MiB (more than the heap's
   buffer: processed in chunks), bitwise equal to rdna4_comm.reference, with
   the algorithm each size takes;
2. an expert-parallel MoE layer (rdna4_comm.moe.ExpertParallelMoE: route,
   dispatch, local experts, combine) against the single-process
   rdna4_comm.moe.dense_moe, within a few bf16 ulps (DENSE_RTOL, DENSE_ATOL);
3. a raw dispatch -> combine round trip, bitwise equal to
   rdna4_comm.reference.dispatch/combine, and the same with FP8 dispatch
   (Communicator(dispatch_dtype=torch.float8_e4m3fn));
4. a tensor-parallel MLP block (rdna4_comm.tp.TensorParallelMLP.forward_norm: sharded
   matmuls, then all_reduce_rmsnorm into the next norm) against the
   single-process rdna4_comm.tp.dense_mlp_block, within the same bf16 ulps;

each printed with the tolerance it is held to and why; and, when every
check passed on every rank, a latency table of rdna4_comm against
torch.distributed, timed as the benchmarks time it (benchmarks/), and the TP
block with the fused op against the same block unfused, with a line per op
saying what its rows time. Exits 1 if anything failed.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch

from . import _C, reference
from ._bench.cases import EP_EXPERTS, EP_TOPK, allreduce_ops, ep_ops, record, speedup
from ._checks import assert_same, rand
from ._timing import Op, format_table, measure
from ._bench.world import describe, launch, resolve_world
from ._ranks import CheckFailed
from ._launch import WorldFailed
from .transport_policy import TRANSPORT_RECORDS
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
TABLE_ALLREDUCE_HIDDEN = 4096
TABLE_EP_TOKENS = (8, 128)
TABLE_EP_HIDDEN = 2048
# The TP block of the check and the table (bf16), small enough for CPU processes.
TP_HIDDEN, TP_FFN = 1024, 2048
TABLE_TP_TOKENS = (1, 32)
# The MoE and TP checks compare bf16 layers with single-process computations
# that round to bf16 fewer times (see each check), so they allow
# |difference| <= DENSE_ATOL + DENSE_RTOL * |dense| (torch.testing.assert_close's
# rule): bf16 keeps 8 significant bits, an ulp is 2^-8 to 2^-7 of a value, so
# this is at least 4 ulps at any magnitude.
DENSE_RTOL = DENSE_ATOL = 3e-2
DENSE_TOLERANCE = f"|difference| <= {DENSE_ATOL} + {DENSE_RTOL} x |dense| (at least 4 bf16 ulps)"
# The output's width: the table, its legend and the checks fit a 100-column terminal.
COLUMNS = 100


def check_all_reduce(ctx, comm) -> str:
    """Random fp32 tensors summed by rdna4_comm equal reference.all_reduce bitwise."""
    paths = []
    for i, shape in enumerate(ALLREDUCE_SHAPES):
        out = comm.all_reduce(rand(i, ctx.rank, shape).to(ctx.device))
        expected = reference.all_reduce([rand(i, r, shape) for r in range(ctx.world)])
        assert_same(out, expected, f"all_reduce {list(shape)} vs reference.all_reduce")
        paths.append(f"{list(shape)} ({allreduce_algorithm(out.numel() * 4, ctx.world, ctx.transport)})")
    return "fp32 " + ", ".join(paths) + ": bitwise equal"


def assert_within_dense_tolerance(actual: torch.Tensor, dense: torch.Tensor, what: str) -> str:
    """Raise AssertionError unless ``actual`` is within DENSE_TOLERANCE of
    ``dense``; else say how close: the max difference, and the largest share
    of its allowance any element uses."""
    a, d = actual.detach().cpu().float(), dense.detach().cpu().float()
    torch.testing.assert_close(a, d, rtol=DENSE_RTOL, atol=DENSE_ATOL, msg=lambda m: f"{what}: {m}")
    difference = (a - d).abs()
    share = (difference / (DENSE_ATOL + DENSE_RTOL * d.abs())).max().item()
    return f"max |difference| {difference.max().item():.3g}, no element past {share:.0%} of its allowance"


def check_moe(ctx, comm) -> str:
    """ExpertParallelMoE over the ranks equals dense_moe within DENSE_TOLERANCE."""
    layer = ExpertParallelMoE(comm, ffn=FFN, seed=1)
    weights = (w.to(ctx.device) for w in init_weights(1, EXPERTS, HIDDEN, FFN))
    tokens = CAP - 5 * (ctx.rank % 4)  # token counts may differ between ranks
    # A quarter of rand's values (std 4; exact in bf16) keeps the activations
    # near 1, where the bf16 roundings stay far inside the tolerance below.
    x = (rand(100, ctx.rank, (tokens, HIDDEN), torch.bfloat16) / 4).to(ctx.device)
    difference = assert_within_dense_tolerance(layer(x), dense_moe(x, *weights, TOPK), "MoE layer vs dense_moe")
    return f"{tokens} tokens x {HIDDEN}, top-{TOPK} of {EXPERTS} experts: {difference}"


def check_round_trip(ctx, comm) -> str:
    """dispatch -> combine equals reference.dispatch/combine bitwise (every field)."""
    op = ep_ops(ctx, comm, CAP)[0]
    op.check(op.run())
    return f"{CAP} tokens x {HIDDEN}: every dispatch output and the combine result bitwise equal"


def check_fp8_round_trip(ctx, comm) -> str:
    """FP8 dispatch (x quantised in the op) -> dequantised rows -> combine:
    the FP8 bytes and scales bitwise equal to the reference's, combine to
    reference.combine of the dequantised rows."""
    with Communicator(ctx.cpu_group, max_tokens_per_rank=CAP, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS,
                      dtype=torch.bfloat16, transport=ctx.transport, dispatch_dtype=torch.float8_e4m3fn) as fp8:
        op = ep_ops(ctx, fp8, CAP)[0]
        op.check(op.run())
    return (f"{CAP} tokens x {HIDDEN}, {HIDDEN + 4 * num_scales(HIDDEN)} payload bytes a row (bf16: {2 * HIDDEN}): "
            "FP8 rows, scales and the combine bitwise equal")


def check_tp(ctx, comm) -> str:
    """TensorParallelMLP over the ranks equals dense_mlp_block within DENSE_TOLERANCE."""
    weights = init_tp_weights(2, TP_HIDDEN, TP_FFN)
    mlp = TensorParallelMLP(LlamaStyleMLP(weights, ctx.device), comm)
    normed = rand(200, 0, (16, TP_HIDDEN), torch.bfloat16) / 4  # unit scale, exact in bf16
    residual = rand(201, 0, (16, TP_HIDDEN), torch.bfloat16) / 4
    out, residual_out = mlp.forward_norm(normed.to(ctx.device), residual.to(ctx.device),
                                         weights["next_norm"].to(ctx.device))
    dense_out, dense_residual = dense_mlp_block(normed, residual, weights)
    residual_difference = assert_within_dense_tolerance(residual_out, dense_residual, "TP block residual_out")
    out_difference = assert_within_dense_tolerance(out, dense_out, "TP block out")
    return (f"16 tokens x {TP_HIDDEN}, ffn {TP_FFN} over {ctx.world} ranks: "
            f"out {out_difference}; residual_out {residual_difference}")


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


@dataclass(frozen=True)
class Check:
    """One check of the demo: ``run(ctx, comm)`` raises when it fails, else
    returns what it ran and measured; ``tolerance`` is what it is held to
    and why, for a reader who has not read ``run``."""

    name: str
    run: Callable[..., str]
    tolerance: str


CHECKS = [
    Check("all_reduce vs reference.all_reduce", check_all_reduce,
          "bitwise, as both add the ranks' fp32 tensors in rank order"),
    Check("MoE layer (dispatch -> experts -> combine) vs dense_moe", check_moe,
          f"{DENSE_TOLERANCE}, as the EP layer rounds to bf16 twice (each rank's expert sum, then "
          "combine's sum over ranks) where dense_moe rounds once"),
    Check("dispatch/combine round trip vs reference.dispatch/combine", check_round_trip,
          "bitwise, as dispatch copies rows unchanged and combine adds them in fp32 in rank order, "
          "as the reference does"),
    Check("FP8 dispatch/combine round trip vs reference.dispatch/combine", check_fp8_round_trip,
          "bitwise, as the op applies rdna4_comm.fp8's quantisation rule (an fp32 scale per "
          "128 channels, round to nearest even) exactly, as the reference does"),
    Check("tensor-parallel MLP block (all_reduce_rmsnorm) vs dense_mlp_block", check_tp,
          f"{DENSE_TOLERANCE} on out and on residual_out, as each rank rounds its share of down_proj "
          "to bf16 before the fp32 sum where dense_mlp_block rounds the whole sum once"),
]


def wrapped(text: str, indent: int, first: str = "") -> str:
    """``first`` + ``text``, wrapped to COLUMNS with ``indent`` spaces before
    every later line."""
    return textwrap.fill(text, COLUMNS, initial_indent=first, subsequent_indent=" " * indent,
                         break_on_hyphens=False)


def check_report(check: Check, errors: list[str], measured: str) -> str:
    """A check's lines: ok/FAIL, its name and what it measured (or the
    ranks' errors), then its tolerance."""
    outcome = "; ".join(errors) if errors else measured
    return (wrapped(f"{check.name}: {outcome}", 8, f"  {'FAIL' if errors else 'ok  '}  ") + "\n"
            + wrapped(f"tolerance: {check.tolerance}", 10, " " * 8))


def row_meanings(ctx) -> dict[str, str]:
    """What a table row of each op times, by op name."""
    return {
        "all_reduce": f"one call summing a [tokens, {TABLE_ALLREDUCE_HIDDEN}] fp32 tensor per rank over the "
                      f"{ctx.world} ranks: rdna4_comm.all_reduce (out of place) vs torch.distributed.all_reduce "
                      f"({ctx.baseline}, in place)",
        "TP MLP block": f"a whole tensor-parallel MLP block on [tokens, {TP_HIDDEN}] bf16, ffn {TP_FFN} split over "
                        "the ranks: gate/up/down matmuls, then all_reduce_rmsnorm (rdna4_comm) or all_reduce + add "
                        "+ RMSNorm (rdna4_comm_unfused); its time includes the matmuls, which the other rows do not do",
        "dispatch+combine": f"one MoE layer's communication of [tokens, {TABLE_EP_HIDDEN}] bf16 per rank, "
                            f"top-{EP_TOPK} of {EP_EXPERTS} experts, no expert compute: dispatch + combine "
                            f"(rdna4_comm) vs all_gather + reduce_scatter ({ctx.baseline})",
    }


def latency_table(ctx, records: list[dict], rounds: int, samples: int) -> str:
    """The latency table, one row per record, each against its one baseline
    (torch.distributed or the unfused block), then what each op's rows time."""
    rows = []
    for rec in records:
        (baseline,) = [b for b in rec["stats"] if b != "rdna4_comm"]
        rows.append([rec["op"], rec["tokens"], rec["stats"]["rdna4_comm"].p50_us, baseline,
                     rec["stats"][baseline].p50_us, speedup(rec["stats"], baseline)])
    call = "one CUDA-graph replay" if TRANSPORT_RECORDS[ctx.transport].device_kernels else "one eager call"
    lead = (f"latency: p50 of {rounds} rounds x {samples} samples, a sample being {call} on every rank, "
            "timed on the slowest rank; speedup = baseline us / rdna4_comm us (> 1: rdna4_comm is faster):")
    table = format_table(["op", "tokens", "rdna4_comm us", "baseline", "baseline us", "speedup"], rows)
    meanings = row_meanings(ctx)
    width = max(len(op) for op in meanings)
    legend = [wrapped(meanings[op], width + 4, f"  {op.ljust(width)}  ")
              for op in dict.fromkeys(rec["op"] for rec in records)]
    return "\n".join([wrapped(lead, 0), table, "what the rows time:", *legend])


def _demo(ctx, rounds: int, samples: int) -> None:
    info = describe(ctx)
    ctx.emit(f"rank 0: {info['device']}; torch {info['versions']['torch']}; "
             f"baseline torch.distributed backend: {info['baseline_backend']}")
    failed = False
    with Communicator(ctx.cpu_group, max_tokens_per_rank=CAP, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS,
                      dtype=torch.bfloat16, transport=ctx.transport) as comm:
        ctx.emit(wrapped(f"checks on every rank (numbers from rank 0; its communicator: {comm!r}):", 0))
        for check in CHECKS:
            try:
                measured, error = check.run(ctx, comm), None
            except Exception as e:  # noqa: BLE001  (reported, and agreed on by all ranks)
                measured, error = "", f"{type(e).__name__}: {e}"
            bad = ctx.errors(error)
            failed |= bool(bad)
            ctx.emit(check_report(check, bad, measured))
        if failed:
            raise CheckFailed("demo: a check failed (see above)")

        records = []
        for tokens in TABLE_ALLREDUCE_TOKENS:
            ops = allreduce_ops(ctx, comm, tokens, TABLE_ALLREDUCE_HIDDEN)
            records.append(record("all_reduce", tokens, TABLE_ALLREDUCE_HIDDEN, torch.float32, ops,
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
    ctx.emit("\n" + latency_table(ctx, records, rounds, samples))


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
    where = "one process per GPU" if TRANSPORT_RECORDS[transport].device_kernels else "CPU processes, shared memory"
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
