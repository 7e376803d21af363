// Kernels only the tests launch (through rdna4_comm._C.testing): one that
// keeps most of the GPU busy while the ops run (co-residency under load),
// and one planted out-of-bounds store that shows compute-sanitizer
// instruments the rank processes (scripts/gpu_sanitize.sh).
#include "device/launch.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

// Occupies its multiprocessor's thread slots until `ticks` have passed.
__global__ void __launch_bounds__(kOccupyThreads) occupy_kernel(uint64_t ticks) {
  const uint64_t start = timer_ticks();
  while (timer_ticks() - start < ticks) spin_pause();
}

__global__ void store_out_of_bounds_kernel(int32_t* p, int64_t index) { p[index] = 1; }

}  // namespace

int occupy_blocks_per_sm() { return resident_blocks_per_sm(occupy_kernel, kOccupyThreads); }

void launch_occupy(int blocks, uint64_t ticks, Stream s) {
  RC_LAUNCH(occupy_kernel, blocks, kOccupyThreads, 0, s, ticks);
}

void launch_store_out_of_bounds(int32_t* p, int64_t index, Stream s) {
  RC_LAUNCH(store_out_of_bounds_kernel, 1, 1, 0, s, p, index);
}

}  // namespace gpu
}  // namespace rdna4_comm
