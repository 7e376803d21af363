# Floors on this GPU: device time (torch.profiler) of tiny kernels shaped like the EP kernels
# (512 threads a block, 9 blocks, ~600 B of parameters), one call at a time with a sync between.
import statistics, sys, torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
struct Big { long long v[76]; };
#define LB __launch_bounds__(512)
__global__ void LB k_empty(Big p, int* out) { if (threadIdx.x == 0 && p.v[3] == 12345) out[blockIdx.x] = 1; }
__global__ void LB k_bars(Big p, int* out, int n) { for (int i = 0; i < n; ++i) __syncthreads(); if (threadIdx.x == 0 && p.v[3] == 12345) out[0] = 1; }
__global__ void LB k_chain(Big p, const int64_t* chain, int* out, int n) {
  if (threadIdx.x == 0) { long long i = 0; for (int k = 0; k < n; ++k) i = chain[i]; if (i == 12345) out[0] = 1; }
}
__global__ void LB k_copy(Big p, const uint4* x, uint4* y, int nvec) { int i = blockIdx.x * 512 + threadIdx.x; if (i < nvec) y[i] = x[i]; }
__global__ void LB k_params_serial(Big p, int* out) {
  if (threadIdx.x == 0) { long long s = 0;
#pragma unroll
    for (int i = 0; i < 76; i += 8) s += p.v[i];
    if (s == 12345) out[0] = 1; }
}
__global__ void LB k_params_warps(Big p, int* out) {
  long long s = 0; const int w = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < 10; ++i) if (w == i) s = p.v[i * 8];
  if (s == 12345) out[0] = 1;
}
__global__ void LB k_fence_sys(Big p, int* out) { if (threadIdx.x == 0) { out[blockIdx.x] = 0; __threadfence_system(); out[blockIdx.x + 64] = 1; } }
__global__ void LB k_fence_dev(Big p, int* out) { if (threadIdx.x == 0) { out[blockIdx.x] = 0; __threadfence(); out[blockIdx.x + 64] = 1; } }
// straight-line code: n_iter iterations of a 64-instruction body that is not unrolled further
__global__ void LB k_code(Big p, int* out) {
  float a = threadIdx.x, b = 1.0001f;
#pragma unroll
  for (int i = 0; i < 1024; ++i) { a = a * b + float(i & 7); }
  if (a == 12345.f) out[0] = 1;
}
static cudaStream_t st() { return at::cuda::getCurrentCUDAStream(); }
void empty(int blocks, torch::Tensor out) { Big p{}; k_empty<<<blocks, 512, 0, st()>>>(p, out.data_ptr<int>()); }
void bars(int n, torch::Tensor out) { Big p{}; k_bars<<<9, 512, 0, st()>>>(p, out.data_ptr<int>(), n); }
void chain(int n, torch::Tensor c, torch::Tensor out) { Big p{}; k_chain<<<9, 512, 0, st()>>>(p, c.data_ptr<int64_t>(), out.data_ptr<int>(), n); }
void copy(torch::Tensor x, torch::Tensor y) { Big p{}; int n = x.numel() * 2 / 16; k_copy<<<(n + 511) / 512, 512, 0, st()>>>(p, (const uint4*)x.data_ptr(), (uint4*)y.data_ptr(), n); }
void params_serial(torch::Tensor out) { Big p{}; k_params_serial<<<9, 512, 0, st()>>>(p, out.data_ptr<int>()); }
void params_warps(torch::Tensor out) { Big p{}; k_params_warps<<<9, 512, 0, st()>>>(p, out.data_ptr<int>()); }
void fence_sys(torch::Tensor out) { Big p{}; k_fence_sys<<<9, 512, 0, st()>>>(p, out.data_ptr<int>()); }
void fence_dev(torch::Tensor out) { Big p{}; k_fence_dev<<<9, 512, 0, st()>>>(p, out.data_ptr<int>()); }
void code(torch::Tensor out) { Big p{}; k_code<<<9, 512, 0, st()>>>(p, out.data_ptr<int>()); }
'''
DECL = """#include <torch/extension.h>
void empty(int blocks, torch::Tensor out); void bars(int n, torch::Tensor out); void chain(int n, torch::Tensor c, torch::Tensor out);
void copy(torch::Tensor x, torch::Tensor y); void params_serial(torch::Tensor out); void params_warps(torch::Tensor out);
void fence_sys(torch::Tensor out); void fence_dev(torch::Tensor out); void code(torch::Tensor out);"""
m = load_inline("floor_ext", cpp_sources=DECL, cuda_sources=src, functions=["empty", "bars", "chain", "copy", "params_serial", "params_warps", "fence_sys", "fence_dev", "code"],
                extra_cuda_cflags=["-O3", "-arch=sm_90"], verbose=False)
out = torch.zeros(256, dtype=torch.int32, device="cuda")
N = 1 << 16
perm = torch.randperm(N // 128) * 128
ch = torch.zeros(N, dtype=torch.int64)
for a, b in zip(perm.tolist(), perm.roll(-1).tolist()): ch[a] = b
ch = ch.cuda()
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16); y = torch.empty_like(x)
cases = {
    "empty 9 blocks": lambda: m.empty(9, out), "empty 130 blocks": lambda: m.empty(130, out),
    "6 barriers": lambda: m.bars(6, out), "20 barriers": lambda: m.bars(20, out),
    "1 L2 load (thread 0)": lambda: m.chain(1, ch, out), "3 dependent L2 loads": lambda: m.chain(3, ch, out),
    "10 dependent L2 loads": lambda: m.chain(10, ch, out),
    "copy 64 KB (16 blocks)": lambda: m.copy(x, y), "torch add [8]": lambda: torch.add(out[:8], out[8:16]),
    "params 10 lines, one thread": lambda: m.params_serial(out), "params 10 lines, a warp each": lambda: m.params_warps(out),
    "fence.sys after a store": lambda: m.fence_sys(out), "fence.gpu after a store": lambda: m.fence_dev(out),
    "1024 dependent FMAs": lambda: m.code(out),
}
from torch.profiler import profile, ProfilerActivity
for f in cases.values():
    for _ in range(5): f()
torch.cuda.synchronize()
res = {}
for name, f in cases.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(100):
            f(); torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    durs = [e.time_range.elapsed_us() for e in ks]
    res[name] = statistics.median(durs) if durs else float("nan")
    print(f"{name:40s} p50 {res[name]:.2f} us (n={len(durs)})", flush=True)
