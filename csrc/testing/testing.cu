// Kernels only the tests launch (through the testing extension, module.cpp):
// one that keeps most of the GPU busy while the ops run (co-residency under
// load), one planted out-of-bounds store that shows compute-sanitizer
// instruments the rank processes (scripts/gpu_sanitize.sh), and one that
// checks the kernels' FP8 conversion against fp8.h's over every fp32 bit
// pattern.
#include "../gpu/device/launch.cuh"
#include "testing.h"

namespace rdna4_comm {
namespace gpu {
namespace {

// Occupies its multiprocessor's thread slots until `ticks` have passed.
__global__ void __launch_bounds__(kOccupyThreads) occupy_kernel(uint64_t ticks) {
  const uint64_t start = timer_ticks();
  while (timer_ticks() - start < ticks) spin_pause();
}

__global__ void store_out_of_bounds_kernel(int32_t* p, int64_t index) { p[index] = 1; }

// Patterns whose byte from fp8x4_bits differs from fp8_e4m3fn_bits (two NaNs
// match), into count; the lowest such pattern into first.
__global__ void fp8_conversion_check_kernel(unsigned long long* count, uint32_t* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x * 4;
  for (uint64_t base = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; base < (uint64_t(1) << 32);
       base += stride) {
    float v[4];
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(uint32_t(base + i));
    const uint32_t got = fp8x4_bits(v);
    for (int i = 0; i < 4; ++i) {
      const uint32_t a = (got >> (8 * i)) & 0xffu, b = fp8_e4m3fn_bits(v[i]);
      if (a != b && !((a & 0x7fu) == 0x7fu && (b & 0x7fu) == 0x7fu)) {
        atomicAdd(count, 1ull);
        atomicMin(first, uint32_t(base + i));
      }
    }
  }
}

}  // namespace

int occupy_blocks_per_sm() { return resident_blocks_per_sm(occupy_kernel, kOccupyThreads); }

void launch_occupy(int blocks, uint64_t ticks, Stream s) {
  RC_LAUNCH(occupy_kernel, blocks, kOccupyThreads, 0, s, ticks);
}

void launch_store_out_of_bounds(int32_t* p, int64_t index, Stream s) {
  RC_LAUNCH(store_out_of_bounds_kernel, 1, 1, 0, s, p, index);
}

void launch_fp8_conversion_check(unsigned long long* count, uint32_t* first, int blocks, Stream s) {
  RC_LAUNCH(fp8_conversion_check_kernel, blocks, kThreads, 0, s, count, first);
}

}  // namespace gpu
}  // namespace rdna4_comm
