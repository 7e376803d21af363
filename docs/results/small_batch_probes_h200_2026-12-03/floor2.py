# Instruction fetch at kernel start: thread 0 of each block runs 16 noinline code regions (each ~100
# instructions, its own cache lines) twice in one launch, stamping %globaltimer; pass 1 (cold) vs pass 2.
import statistics, torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__device__ __forceinline__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
template <int R> __device__ __noinline__ unsigned region(unsigned v) {
#pragma unroll
  for (int i = 0; i < 96; ++i) v = (v ^ (v >> 3)) + (2 * R + 3) * i;
  return v;
}
template <int... R> __device__ __forceinline__ unsigned all_regions(unsigned v, std::integer_sequence<int, R...>) {
  ((v = region<R>(v)), ...); return v;
}
__global__ void __launch_bounds__(512) k_regions(unsigned long long* out, unsigned seed, int nreg) {
  if (threadIdx.x != 0) return;
  unsigned v = seed + blockIdx.x;
  unsigned long long t0 = gt();
  v = all_regions(v, std::make_integer_sequence<int, 16>{});
  unsigned long long t1 = gt();
  v = all_regions(v, std::make_integer_sequence<int, 16>{});
  unsigned long long t2 = gt();
  // the same amount of straight-line work, inline (no calls), for comparison
  out[blockIdx.x * 4 + 0] = t1 - t0; out[blockIdx.x * 4 + 1] = t2 - t1; out[blockIdx.x * 4 + 2] = v;
}
__global__ void k_other(float* p) { p[threadIdx.x] += 1.f; }
void regions(torch::Tensor out, int blocks) { k_regions<<<blocks, 512, 0, at::cuda::getCurrentCUDAStream()>>>((unsigned long long*)out.data_ptr<int64_t>(), 7u, 16); }
void other(torch::Tensor p) { k_other<<<1, 32, 0, at::cuda::getCurrentCUDAStream()>>>(p.data_ptr<float>()); }
'''
DECL = "#include <torch/extension.h>\nvoid regions(torch::Tensor out, int blocks); void other(torch::Tensor p);"
m = load_inline("floor2_ext", cpp_sources=DECL, cuda_sources=src, functions=["regions", "other"],
                extra_cuda_cflags=["-O3", "-arch=sm_90"], verbose=False)
out = torch.zeros(9 * 4, dtype=torch.int64, device="cuda")
p = torch.zeros(32, device="cuda")
big = torch.randn(4096, 4096, device="cuda")
def run(mode, n=50):
    c, w = [], []
    for i in range(n):
        if mode == "other kernel between": m.other(p)
        if mode == "matmul between": big @ big
        if mode == "sync only": pass
        torch.cuda.synchronize()
        m.regions(out, 9)
        torch.cuda.synchronize()
        o = out.view(9, 4).cpu()
        c.append(int(o[:, 0].float().median())); w.append(int(o[:, 1].float().median()))
    if mode == "no sync between": pass
    print(f"{mode:24s} pass 1 (cold) p50 {statistics.median(c[5:])} ns, pass 2 p50 {statistics.median(w[5:])} ns", flush=True)
for mode in ("sync only", "other kernel between", "matmul between"):
    run(mode)
# back to back, no sync: the same kernel launched 20 times, stamps of the last
for _ in range(3):
    for i in range(20): m.regions(out, 9)
    torch.cuda.synchronize(); o = out.view(9, 4).cpu()
    print(f"back to back x20, last:    pass 1 {int(o[:, 0].float().median())} ns, pass 2 {int(o[:, 1].float().median())} ns", flush=True)
