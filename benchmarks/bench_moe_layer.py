#!/usr/bin/env python3
"""One Hugging Face MoE layer end to end (router, dispatch, experts,
combine): rdna4_comm's ExpertParallelMoEBlock with the rank layout and with
the expert layout, each against the same layer over torch.distributed in
the same run: all_gather of this rank's tokens and routing, this rank's
experts over every gathered token, reduce_scatter of the results (NCCL/RCCL
on GPUs, gloo on CPU processes), and against the unconverted HF block
("hf_block": every expert on the rank, this rank's tokens, no
communication; at W = 1 the layer the conversion replaces).

Layer: transformers' MixtralSparseMoeBlock with hidden H, intermediate H,
8 experts per rank (E = 8 W), top-2, bf16, grouped_mm experts; every rank
builds it from the same seed and keeps its E / W experts; T tokens per rank.
Sweep: hidden {1024, 4096} x tokens per rank {8, 128, 1024}; --tokens and
--hidden replace the sweep's values (any sizes: DeepSeek's H = 7168, a
prefill's T = 4096); --quick: hidden 256 x tokens {8, 64}, which they
filter. Each backend's output is checked against the HF block's own
forward on this rank's tokens (bf16: to 3e-2). Records are named
"MoE layer (rank layout)" and "MoE layer (expert layout)", each with its
baseline; the expert layout's cost over the rank layout is the ratio of
their rdna4_comm p50s. Needs transformers (setup.py extra "transformers").

    python benchmarks/bench_moe_layer.py --quick --transport cpu
    python benchmarks/bench_moe_layer.py --hidden 4096 --tokens 8 128
    python benchmarks/bench_moe_layer.py --transport gpu --world 1 --hidden 7168 --tokens 8 128 4096
"""
import sys

import _common
import torch
import torch.distributed as dist

from rdna4_comm import Communicator
from rdna4_comm._bench.cases import record
from rdna4_comm._timing import Op, measure

HIDDEN = (1024, 4096)
TOKENS = (8, 128, 1024)
QUICK = [(t, 256) for t in (8, 64)]
DTYPE = torch.bfloat16
EXPERTS_PER_RANK, TOPK, SEED = 8, 2, 0


def mixtral_block(hidden: int, experts: int):
    """The same random MixtralSparseMoeBlock on every rank (grouped_mm experts, bf16)."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=hidden, num_local_experts=experts,
                                     num_experts_per_tok=TOPK)
    cfg._experts_implementation = "grouped_mm"
    block = MixtralSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block.to(DTYPE).eval()


def layer_ops(ctx, comm, tokens: int, hidden: int, layout: str) -> list[Op]:
    from rdna4_comm.integrations.transformers import ExpertParallelMoEBlock

    W, E, dev = ctx.world, EXPERTS_PER_RANK * ctx.world, ctx.device
    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(ctx.rank)) / 4).to(DTYPE).to(dev)
    x3 = x.unsqueeze(0)  # the block takes [batch, sequence, hidden]
    hf = mixtral_block(hidden, E).to(dev)  # the unconverted block: every expert on this rank
    with torch.no_grad():
        expected = hf(x3).view(tokens, hidden)
        ep = ExpertParallelMoEBlock(mixtral_block(hidden, E).to(dev), comm, layout=layout)
        base = ExpertParallelMoEBlock(mixtral_block(hidden, E).to(dev), comm)  # its router and this rank's experts
    xg = torch.empty(W * tokens, hidden, dtype=DTYPE, device=dev)
    ig = torch.empty(W * tokens, TOPK, dtype=torch.int64, device=dev)
    wg = torch.empty(W * tokens, TOPK, dtype=DTYPE, device=dev)
    out = torch.empty(tokens, hidden, dtype=DTYPE, device=dev)
    first = ctx.rank * EXPERTS_PER_RANK

    @torch.no_grad()
    def run_baseline():
        _, w, idx = base.gate(x)
        dist.all_gather_into_tensor(xg, x, group=ctx.group)
        dist.all_gather_into_tensor(ig, idx, group=ctx.group)
        dist.all_gather_into_tensor(wg, w.to(DTYPE), group=ctx.group)
        local = ig - first
        local = torch.where((local >= 0) & (local < EXPERTS_PER_RANK), local, EXPERTS_PER_RANK)
        dist.reduce_scatter_tensor(out, base.experts(xg, local, wg), group=ctx.group)
        return out

    def check(result):
        torch.testing.assert_close(result.view(tokens, hidden).float(), expected.float(), rtol=3e-2, atol=3e-2)

    return [
        Op("rdna4_comm", torch.no_grad()(lambda: ep(x3)), check,
           detail=f"ExpertParallelMoEBlock(layout={layout!r}): router, dispatch, experts, combine"),
        Op(ctx.baseline, run_baseline, check,
           detail="router, all_gather of x and the routing, this rank's experts on every token, reduce_scatter"),
        Op("hf_block", torch.no_grad()(lambda: hf(x3)), check,
           detail="the unconverted MixtralSparseMoeBlock on this rank's tokens, all E experts on the rank, no communication"),
    ]


def worker(ctx, configs, rounds, samples) -> None:
    for tokens, hidden in configs:
        with Communicator(ctx.cpu_group, max_tokens_per_rank=tokens, hidden=hidden, topk=TOPK,
                          num_experts=EXPERTS_PER_RANK * ctx.world, dtype=DTYPE, transport=ctx.transport) as comm:
            for layout in ("rank", "expert"):
                ops = layer_ops(ctx, comm, tokens, hidden, layout)
                stats = measure(ctx, ops, rounds=rounds, samples=samples)
                ctx.emit(record(f"MoE layer ({layout} layout)", tokens, hidden, DTYPE, ops, stats))
                del ops
        ctx.release()


def main(argv=None) -> int:
    args = _common.parse_args(__doc__, argv)
    if args.quick:
        configs = _common.select(QUICK, args)
    else:
        configs = [(t, h) for h in (args.hidden or HIDDEN) for t in (args.tokens or TOKENS)]
    return _common.run("bench_moe_layer", args, configs, worker)


if __name__ == "__main__":
    sys.exit(main())
