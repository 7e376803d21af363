"""Does the order in which a grid's warps walk a copy change its DRAM speed?

Copies 4096 rows of 14336 bytes (rows 1-2's bytes) with 512-thread blocks,
each block a contiguous range of rows (as the EP kernels cut them), 8
16-byte vectors a lane in flight, in four orders:
  0 warp pieces: warp w of a block takes one contiguous 1/16 of its range
    (what for_row_pieces does today);
  1 warp chunks: the range cut into chunks of 256 vectors (8 a lane),
    dealt to the block's warps round robin;
  2 block stride: the block's 512 threads take 512 consecutive vectors a
    slot, 8 slots a step (the classic grid-stride copy, within the range);
  3 grid chunks: chunks of 256 vectors dealt to every warp of the grid
    round robin (no ranges at all);
  4, 5: groups of 4 (2) warps share one contiguous piece, lanes at a
    stride of 128 (64) vectors.
SUM: each vector goes through bf16 -> fp32 -> bf16 (what combine's one-term
sum does). Prints device time per call (CUDA events, median of 7 x 50).
"""
import statistics
import sys

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <cuda_bf16.h>
#include <cstdint>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

template <bool SUM>
__device__ __forceinline__ uint4 pass(uint4 v) {
  if (!SUM) return v;
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xffff0000u);
    __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    w[i] = *reinterpret_cast<uint32_t*>(&b);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool SUM>
__device__ __forceinline__ void step(const uint4* __restrict__ in, uint4* __restrict__ out, long v0, long stride, long end) {
  uint4 x[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) { long v = v0 + u * stride; if (v < end) x[u] = __ldg(in + v); }
#pragma unroll
  for (int u = 0; u < 8; ++u) { long v = v0 + u * stride; if (v < end) out[v] = pass<SUM>(x[u]); }
}

template <int MODE, bool SUM>
__global__ void __launch_bounds__(512) pattern(const uint4* __restrict__ in, uint4* __restrict__ out, long total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long per_block = (total + gridDim.x - 1) / gridDim.x;
  const long b0 = blockIdx.x * per_block, b1 = min(total, b0 + per_block);
  if (MODE == 0) {
    const long per_warp = ((b1 - b0 + 511) / 512) * 32;
    const long w0 = b0 + warp * per_warp, w1 = min(b1, w0 + per_warp);
    for (long v0 = w0 + lane; v0 < w1; v0 += 256) step<SUM>(in, out, v0, 32, w1);
  } else if (MODE == 1) {
    for (long c = b0 + warp * 256; c < b1; c += 16 * 256) step<SUM>(in, out, c + lane, 32, min(b1, c + 256));
  } else if (MODE == 2) {
    for (long v0 = b0 + threadIdx.x; v0 < b1; v0 += 4096) step<SUM>(in, out, v0, 512, b1);
  } else if (MODE >= 4) {
    // Groups of G warps share one contiguous piece, lanes at stride G * 32.
    constexpr int G = MODE == 4 ? 4 : 2;
    const long per = ((b1 - b0 + 511) / 512) * 32 * G;
    const int g = threadIdx.x / (32 * G), gl = threadIdx.x % (32 * G);
    const long w0 = b0 + g * per, w1 = min(b1, w0 + per);
    for (long v0 = w0 + gl; v0 < w1; v0 += 8 * 32 * G) step<SUM>(in, out, v0, 32 * G, w1);
  } else {
    const long gw = long(blockIdx.x) * 16 + warp, nw = long(gridDim.x) * 16;
    for (long c = gw * 256; c < total; c += nw * 256) step<SUM>(in, out, c + lane, 32, min(total, c + 256));
  }
}

void run(torch::Tensor in, torch::Tensor out, int64_t mode, bool sum, int64_t blocks) {
  const long total = in.numel() * in.element_size() / 16;
  auto s = at::cuda::getCurrentCUDAStream();
  const uint4* i = reinterpret_cast<const uint4*>(in.data_ptr());
  uint4* o = reinterpret_cast<uint4*>(out.data_ptr());
#define GO(M, S) pattern<M, S><<<blocks, 512, 0, s>>>(i, o, total)
  if (sum) { if (mode == 0) GO(0, true); else if (mode == 1) GO(1, true); else if (mode == 2) GO(2, true); else if (mode == 3) GO(3, true); else if (mode == 4) GO(4, true); else GO(5, true); }
  else { if (mode == 0) GO(0, false); else if (mode == 1) GO(1, false); else if (mode == 2) GO(2, false); else if (mode == 3) GO(3, false); else if (mode == 4) GO(4, false); else GO(5, false); }
}
"""

def timed(fn, reps=7, calls=50):
    fn(); torch.cuda.synchronize()
    res = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record(); torch.cuda.synchronize()
        res.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(res)


def main():
    mod = load_inline("pattern", cpp_sources="void run(torch::Tensor in, torch::Tensor out, int64_t mode, bool sum, int64_t blocks);",
                      cuda_sources=SRC, functions=["run"], extra_cuda_cflags=["-O3", "-arch=sm_90"], verbose=False)
    T, H = 4096, 7168
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "SMs", sm)
    print(f"torch copy_: {timed(lambda: y.copy_(x)):.2f} us")
    for sum_ in (False, True):
        for blocks in (128, sm - 2, sm):
            for mode in (0, 1, 2, 3, 4, 5):
                t = timed(lambda: mod.run(x, y, mode, sum_, blocks))
                assert torch.equal(x, y)
                y.zero_()
                print(f"sum={int(sum_)} blocks={blocks} mode={mode}: {t:.2f} us")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
