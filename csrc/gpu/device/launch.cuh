// Included first by every device header: the launch interface, the block
// size of every kernel, and the host-side launch helpers of the launch_*
// functions.
#pragma once

#include "../../policies.h"
#include "../kernels.h"

#include <initializer_list>
#include <map>
#include <tuple>

namespace rdna4_comm {
namespace gpu {

constexpr int kThreads = kGpuBlockThreads;  // policies.h
// Warps are 32 lanes or wider (64 on CDNA); warp_size() is a constant on
// NVIDIA and read at run time on HIP. Per-warp arrays hold
// kThreads / kMinWarpSize entries, enough for a block of any warp size.
constexpr int kMinWarpSize = 32;
static_assert(kGpuRoutingLanes == kMinWarpSize, "a routing warp's slots fit every warp width");
constexpr int kMaxWarps = kThreads / kMinWarpSize;
static_assert(kThreads % 64 == 0, "a block is whole warps for every warp size");

template <DType D>
struct DTypeTag {
  static constexpr DType value = D;
};

// Calls f(DTypeTag<D>{}) for the dtype D of `d` (F16 for any but F32 and
// BF16), so one generic body serves every element type: in a kernel, or in
// a launcher that launches one kernel per dtype.
RC_NO_EXEC_SPACE_CHECK
template <typename F>
__host__ __device__ __forceinline__ void with_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kF32: f(DTypeTag<DType::kF32>{}); break;
    case DType::kBF16: f(DTypeTag<DType::kBF16>{}); break;
    default: f(DTypeTag<DType::kF16>{}); break;
  }
}

// Blocks of `threads` threads of `kernel` that one multiprocessor holds at
// once, given the kernel's registers and its static shared memory plus the
// launch's dynamic `smem` bytes: asked of the runtime once per kernel,
// block size, dynamic size and host thread (a cache of each thread's own:
// every launch asks, and needs no lock). Kernels of one signature share a
// type, so the answers are kept by the kernel's address.
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads, int smem = 0) {
  thread_local std::map<std::tuple<const void*, int, int>, int> known;
  const std::tuple<const void*, int, int> key{reinterpret_cast<const void*>(kernel), threads, smem};
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  int n = 0;
  if (RC_RT(OccupancyMaxActiveBlocksPerMultiprocessor)(&n, kernel, threads, size_t(smem)) != RC_RT(Success)) n = 0;
  known.emplace(key, n);
  return n;
}

// Every kernel runs kThreads threads a block; `blocks` comes from the grid
// policies in policies.h (dispatch_grid, combine_grid, allreduce_blocks).
// Co-residency: those policies count on one block per multiprocessor; the
// kernel's real occupancy (registers, shared memory) must hold the whole
// grid at once, or the launch raises instead of risking a block that waits
// for one that never runs.
template <typename Kernel, typename... Args>
void launch(const char* op, Kernel kernel, int blocks, Stream s, const Env& env, Args... args) {
  const int per_sm = resident_blocks_per_sm(kernel, kThreads);
  if (int64_t(blocks) > int64_t(per_sm) * env.sm_count) raise_not_resident(op, blocks, per_sm, env.sm_count);
  RC_LAUNCH(kernel, blocks, kThreads, 0, s, env, args...);
}

// Widest vector (16, 8, 4, 2 or 1 bytes) that divides a row and aligns every pointer.
inline int widest_vector(int64_t row_bytes, std::initializer_list<const void*> ptrs) {
  for (int v : {16, 8, 4, 2}) {
    bool ok = row_bytes % v == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % v == 0;
    if (ok) return v;
  }
  return 1;
}
// The EP row loops' vector (with_row_vector, with_copy_vector): 16 bytes, or
// 2 (the loops then take elements, or 2-byte pieces).
inline int row_vector(int64_t row_bytes, std::initializer_list<const void*> ptrs) {
  return widest_vector(row_bytes, ptrs) == 16 ? 16 : 2;
}

}  // namespace gpu
}  // namespace rdna4_comm
