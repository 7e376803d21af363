// The test kernels' launchers (testing.cu), torch-free like
// csrc/gpu/kernels.h, for the testing extension's glue (module.cpp).
#pragma once

#include <cstdint>

#include "../gpu/platform.h"

namespace rdna4_comm {
namespace gpu {

// occupy: `blocks` blocks of kOccupyThreads threads that spin for `ticks`
// timer ticks; store_out_of_bounds: one store to p[index].
constexpr int kOccupyThreads = 1024;
int occupy_blocks_per_sm();
void launch_occupy(int blocks, uint64_t ticks, Stream s);
void launch_store_out_of_bounds(int32_t* p, int64_t index, Stream s);
// fp8_conversion_check: counts the fp32 patterns (all 2^32) whose byte from
// the kernels' FP8 conversion differs from fp8.h's, and the lowest of them
// (first must start at 0xffffffff, count at 0).
void launch_fp8_conversion_check(unsigned long long* count, uint32_t* first, int blocks, Stream s);

}  // namespace gpu
}  // namespace rdna4_comm
