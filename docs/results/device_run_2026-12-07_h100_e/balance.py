"""Is the row loops' shape slower than copy_ because its blocks finish at
different times? Copies rows 1-2's bytes (4096 rows of 14336 bytes) with
128 blocks of 512 threads, 8 16-byte vectors a lane in flight:
  static: a contiguous range a block, a contiguous piece a warp (the EP
    kernels' order); each block's start and end (%globaltimer) and its
    multiprocessor are recorded, to see whether the slow blocks are the
    same multiprocessors call after call;
  claim G: every warp (or every block: its warps a sixteenth each) takes
    the next chunk of G vectors from a counter in global memory until none is left, so a
    fast multiprocessor copies more chunks (the last warp to finish resets
    the counter for the next launch).
Device time per call: CUDA events over 50 calls, median of 7 (pattern.py's
timed)."""
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "device_run_2026-12-07_h100_d"))
from pattern import timed  # noqa: E402

SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

constexpr int U = 8;

__device__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void copy_piece(const uint4* in, uint4* out, long v0, long v1, int lane) {
  for (long v = v0 + lane; v < v1; v += 32 * U) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { long i = v + u * 32; if (i < v1) x[u] = __ldg(in + i); }
#pragma unroll
    for (int u = 0; u < U; ++u) { long i = v + u * 32; if (i < v1) out[i] = x[u]; }
  }
}

__global__ void __launch_bounds__(512) static_copy(const uint4* __restrict__ in, uint4* __restrict__ out, long total,
                                                   long long* rec) {
  const unsigned long long t0 = now_ns();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long per_block = (total + gridDim.x - 1) / gridDim.x;
  const long b0 = blockIdx.x * per_block, b1 = min(total, b0 + per_block);
  const long per_warp = (b1 - b0 + 15) / 16;
  const long w0 = b0 + warp * per_warp, w1 = min(b1, w0 + per_warp);
  copy_piece(in, out, w0, w1, lane);
  __syncthreads();
  if (rec && threadIdx.x == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    rec[blockIdx.x * 3] = t0;
    rec[blockIdx.x * 3 + 1] = now_ns();
    rec[blockIdx.x * 3 + 2] = smid;
  }
}

__global__ void __launch_bounds__(512) claim_copy(const uint4* __restrict__ in, uint4* __restrict__ out, long total,
                                                  long G, bool by_block, unsigned* counter) {
  __shared__ long chunk;
  const int lane = threadIdx.x % 32;
  const long nchunks = (total + G - 1) / G;
  for (;;) {
    long c;
    if (by_block) {
      if (threadIdx.x == 0) chunk = atomicAdd(&counter[0], 1u);
      __syncthreads();
      c = chunk;
      __syncthreads();
    } else {
      unsigned got = 0;
      if (lane == 0) got = atomicAdd(&counter[0], 1u);
      c = __shfl_sync(0xffffffffu, got, 0);
    }
    if (c >= nchunks) break;
    if (by_block) {
      const long v0 = c * G + (threadIdx.x / 32) * (G / 16);
      copy_piece(in, out, v0, min(total, v0 + G / 16), lane);
    } else {
      copy_piece(in, out, c * G, min(total, c * G + G), lane);
    }
  }
  // The last of the grid's claimers resets the counters for the next launch.
  const unsigned claimers = by_block ? gridDim.x : gridDim.x * (blockDim.x / 32);
  if ((by_block && threadIdx.x == 0) || (!by_block && lane == 0)) {
    __threadfence();
    if (atomicAdd(&counter[1], 1u) == claimers - 1) { counter[0] = 0; counter[1] = 0; }
  }
}

void run_static(torch::Tensor in, torch::Tensor out, int64_t blocks, torch::Tensor rec) {
  const long total = in.numel() * in.element_size() / 16;
  static_copy<<<blocks, 512, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(in.data_ptr()), reinterpret_cast<uint4*>(out.data_ptr()), total,
      rec.numel() ? reinterpret_cast<long long*>(rec.data_ptr<int64_t>()) : nullptr);
}
void run_claim(torch::Tensor in, torch::Tensor out, int64_t blocks, int64_t G, bool by_block, torch::Tensor counter) {
  const long total = in.numel() * in.element_size() / 16;
  claim_copy<<<blocks, 512, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(in.data_ptr()), reinterpret_cast<uint4*>(out.data_ptr()), total, G, by_block,
      reinterpret_cast<unsigned*>(counter.data_ptr<int32_t>()));
}
"""


def main():
    mod = load_inline("balance", cpp_sources="void run_static(torch::Tensor in, torch::Tensor out, int64_t blocks, torch::Tensor rec);\n"
                      "void run_claim(torch::Tensor in, torch::Tensor out, int64_t blocks, int64_t G, bool by_block, torch::Tensor counter);",
                      cuda_sources=SRC, functions=["run_static", "run_claim"], extra_cuda_cflags=["-O3", "-arch=sm_90"])
    x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    none = torch.empty(0, dtype=torch.int64, device="cuda")
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    print(torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"copy_: {timed(lambda: y.copy_(x)):.2f} us")
    y.zero_()
    print(f"static 128: {timed(lambda: mod.run_static(x, y, 128, none)):.2f} us")
    assert torch.equal(x, y)
    for G, by_block in ((256, False), (896, False), (2048, False), (4096, True), (14336, True)):
        for blocks in (128, 132):
            y.zero_()
            t = timed(lambda: mod.run_claim(x, y, blocks, G, by_block, counter))
            assert torch.equal(x, y) and counter.sum().item() == 0
            print(f"claim G={G} {'a block' if by_block else 'a warp'} blocks={blocks}: {t:.2f} us")
    # Each block's duration in 5 static calls, back to back after warm-up.
    recs = [torch.zeros(128 * 3, dtype=torch.int64, device="cuda") for _ in range(5)]
    for _ in range(10):
        mod.run_static(x, y, 128, none)
    for r in recs:
        mod.run_static(x, y, 128, r)
    torch.cuda.synchronize()
    by_sm = {}
    for i, r in enumerate(recs):
        r = r.view(128, 3).cpu()
        start = r[:, 0].min().item()
        dur = ((r[:, 1] - r[:, 0]) / 1000).tolist()
        late = ((r[:, 0] - start) / 1000).tolist()
        end = ((r[:, 1] - start) / 1000).tolist()
        q = sorted(dur)
        print(f"call {i}: block duration us min {q[0]:.1f} p10 {q[12]:.1f} p50 {q[64]:.1f} p90 {q[115]:.1f} "
              f"max {q[-1]:.1f}; last start {max(late):.2f}; kernel {max(end):.1f}; mean duration {statistics.mean(dur):.1f}")
        for b in range(128):
            by_sm.setdefault(int(r[b, 2]), []).append(dur[b])
    # Is a slow multiprocessor slow in every call? Rank correlation of the
    # per-SM durations between calls 0 and 4.
    sms = sorted(s for s, d in by_sm.items() if len(d) == 5)
    a = [by_sm[s][0] for s in sms]
    b = [by_sm[s][4] for s in sms]
    ra = {s: i for i, s in enumerate(sorted(sms, key=lambda s: by_sm[s][0]))}
    rb = {s: i for i, s in enumerate(sorted(sms, key=lambda s: by_sm[s][4]))}
    n = len(sms)
    rho = 1 - 6 * sum((ra[s] - rb[s]) ** 2 for s in sms) / (n * (n * n - 1)) if n > 2 else float("nan")
    print(f"SMs seen in all 5 calls: {n}; Spearman rho of their durations, call 0 vs 4: {rho:.2f}")
    slow = sorted(sms, key=lambda s: -statistics.mean(by_sm[s]))[:8]
    fast = sorted(sms, key=lambda s: statistics.mean(by_sm[s]))[:8]
    print("slowest SMs (mean us):", [(s, round(statistics.mean(by_sm[s]), 1)) for s in slow])
    print("fastest SMs (mean us):", [(s, round(statistics.mean(by_sm[s]), 1)) for s in fast])
    print(f"copy_: {timed(lambda: y.copy_(x)):.2f} us")


if __name__ == "__main__":
    main()
