#!/usr/bin/env python3
"""Where a step of dispatch + combine spends its device time, kernel by
kernel, on one GPU: a diagnostic beside bench_kernels.py and bench_ep.py
(which time whole steps against baselines); this one has no baseline.

A world of one rank (transport "gpu"), H = 7168, bf16 payload, top-8 of 256
experts (distinct and uniform per token, int64 ids and bf16 weights as a
router gives them), expert_alignment 16 for the expert layout (--alignment). Steps of
(T, cap): (8, 8), (8, 4096), (128, 128), (4096, 4096), each in the rank
layout (``comm.dispatch(x, idx, w)``) and the expert layout
(``layout="expert"``), followed by ``comm.combine(d.x, d.handle)``: no
expert step, the dispatched rows go straight back. Each step is checked
once (with W = 1 every expert is local and x is bf16 noise: the rank layout
returns x, the expert layout 8 x, both exact), warmed up 5 times, then
profiled over 30 eager calls; printed per step: the sum of its kernels'
and copies' device times per call, then each kernel's share, largest
first.

    python3 benchmarks/ep_kernel_times.py [--alignment 1]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import rdna4_comm as rc
from rdna4_comm._launch import free_port

H, K, E = 7168, 8, 256
STEPS = ((8, 8), (8, 4096), (128, 128), (4096, 4096))
WARMUP, CALLS = 5, 30


def kernel_times(tokens: int, cap: int, layout: str, alignment: int) -> None:
    kw = dict(expert_alignment=alignment) if layout == "expert" else {}
    comm = rc.Communicator(max_tokens_per_rank=cap, hidden=H, topk=K, num_experts=E, transport="gpu", **kw)
    g = torch.Generator().manual_seed(tokens)
    idx = torch.rand(tokens, E, generator=g).topk(K, dim=1).indices.cuda()
    w = torch.rand(tokens, K, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16).cuda()

    def step():
        d = comm.dispatch(x, idx, w, layout=layout)
        return comm.combine(d.x, d.handle)

    # Every token's K experts are local and distinct: K expert rows (or one
    # rank row) per token, summed in fp32 and rounded once.
    expected = x * K if layout == "expert" else x
    assert torch.equal(step(), expected), f"T={tokens} cap={cap} layout={layout}: wrong result"
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name] += e.device_time
            count[e.name] += 1
    print(f"T={tokens} cap={cap} layout={layout}{f' alignment={alignment}' if layout == 'expert' else ''}: {sum(total.values()) / CALLS:.1f} us per step")
    for name in sorted(total, key=lambda n: -total[n]):
        print(f"   {total[name] / CALLS:8.2f} us  x{count[name] // CALLS}  {name[:110]}")
    comm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alignment", type=int, default=16, help="the expert layout's expert_alignment (default 16)")
    args = p.parse_args()
    if not (rc._C.with_gpu and torch.cuda.is_available()):
        raise SystemExit("ep_kernel_times: needs a GPU and an rdna4_comm built with GPU support")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    try:
        for tokens, cap in STEPS:
            for layout in ("rank", "expert"):
                kernel_times(tokens, cap, layout, args.alignment)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
