"""Does a copy of rows 1-2's bytes reach copy_'s speed with more warps a
multiprocessor, or more vectors a lane in flight? The row loops' shape
(a contiguous range a block, a contiguous piece a warp, U 16-byte
vectors a lane: U loads, then U stores), over grids of 128-1024 blocks of
128-1024 threads. Device time per call: CUDA events over 50 calls,
median of 7."""
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pattern import timed  # noqa: E402  (CUDA events, the same method as pattern.py's)

SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

template <int U>
__global__ void piece_copy(const uint4* __restrict__ in, uint4* __restrict__ out, long total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const long per_block = (total + gridDim.x - 1) / gridDim.x;
  const long b0 = blockIdx.x * per_block, b1 = min(total, b0 + per_block);
  const long per_warp = ((b1 - b0 + blockDim.x - 1) / blockDim.x) * 32;
  const long w0 = b0 + warp * per_warp, w1 = min(b1, w0 + per_warp);
  for (long v0 = w0 + lane; v0 < w1; v0 += 32 * U) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { long v = v0 + u * 32; if (v < w1) x[u] = __ldg(in + v); }
#pragma unroll
    for (int u = 0; u < U; ++u) { long v = v0 + u * 32; if (v < w1) out[v] = x[u]; }
  }
}

void run(torch::Tensor in, torch::Tensor out, int64_t unroll, int64_t blocks, int64_t threads) {
  const long total = in.numel() * in.element_size() / 16;
  auto s = at::cuda::getCurrentCUDAStream();
  auto i = reinterpret_cast<const uint4*>(in.data_ptr());
  auto o = reinterpret_cast<uint4*>(out.data_ptr());
  if (unroll == 4) piece_copy<4><<<blocks, threads, 0, s>>>(i, o, total);
  else if (unroll == 8) piece_copy<8><<<blocks, threads, 0, s>>>(i, o, total);
  else piece_copy<16><<<blocks, threads, 0, s>>>(i, o, total);
}
"""

mod = load_inline("occupancy", cpp_sources="void run(torch::Tensor in, torch::Tensor out, int64_t unroll, int64_t blocks, int64_t threads);",
                  cuda_sources=SRC, functions=["run"], extra_cuda_cflags=["-O3", "-arch=sm_90"], verbose=False)


x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
y = torch.empty_like(x)
print(torch.cuda.get_device_name())
print(f"copy_: {timed(lambda: y.copy_(x)):.2f} us")
for threads, blocks, unroll in [(512, 128, 8), (512, 128, 4), (512, 128, 16), (512, 256, 8), (512, 512, 8),
                                (256, 256, 8), (256, 512, 8), (1024, 128, 8), (1024, 128, 4), (128, 1024, 8)]:
    t = timed(lambda: mod.run(x, y, unroll, blocks, threads))
    assert torch.equal(x, y)
    y.zero_()
    print(f"threads={threads} blocks={blocks} unroll={unroll} warps/SM~{threads * blocks / 32 / 132:.0f}: {t:.2f} us")
print(f"copy_: {timed(lambda: y.copy_(x)):.2f} us")
