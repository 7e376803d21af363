// Block-wide copies in vectors of `vec` bytes, the widest a row's size and
// alignment allow (widest_vector, launch.cuh).
#pragma once

#include "../../bounds.h"
#include "../../policies.h"
#include "launch.cuh"

namespace rdna4_comm {
namespace gpu {

// Vectors in flight per thread in every copy and sum loop.
constexpr int kUnroll = 4;

template <typename T>
struct VecTag {
  using type = T;
};

// Calls f(VecTag<V>{}) for the vector type of `vec` bytes (16, 8, 4, 2, 1).
template <typename F>
RC_DEVICE void with_vector(int vec, F&& f) {
  switch (vec) {
    case 16: f(VecTag<uint4>{}); break;
    case 8: f(VecTag<uint2>{}); break;
    case 4: f(VecTag<uint32_t>{}); break;
    case 2: f(VecTag<uint16_t>{}); break;
    default: f(VecTag<uint8_t>{}); break;
  }
}

// The lines of kPrefetchLineBytes that hold [p, p + bytes): the first
// one, and the bytes from its start to the range's end (0 for no bytes).
struct LineSpan {
  uintptr_t first;
  int64_t span;
};
RC_DEVICE LineSpan lines_of(const void* p, int64_t bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p), line = at & ~uintptr_t(kPrefetchLineBytes - 1);
  return {line, bytes > 0 ? bytes + int64_t(at - line) : 0};
}

// The lines of [p, p + bytes) into this multiprocessor's L1 (prefetch_l1),
// a line per thread of the block: at most kThreads lines from p's line on.
RC_DEVICE void prefetch_lines_l1(const void* p, int64_t bytes) {
  const LineSpan l = lines_of(p, bytes);
  const int64_t off = int64_t(threadIdx.x) * kPrefetchLineBytes;
  if (off < l.span) prefetch_l1(reinterpret_cast<const char*>(l.first + uintptr_t(off)));
}
// All of them by one warp, a line per lane and pass.
RC_DEVICE void warp_prefetch_lines_l1(const void* p, int64_t bytes) {
  const LineSpan l = lines_of(p, bytes);
  for (int64_t off = int64_t(lane_id()) * kPrefetchLineBytes; off < l.span; off += warp_size() * kPrefetchLineBytes)
    prefetch_l1(reinterpret_cast<const char*>(l.first + uintptr_t(off)));
}

// Rows [0, nrows) of nvec vectors each, copied by the whole block over the
// flattened (row, vector) space: one row still keeps every thread busy, and
// many rows keep kUnroll loads in flight per thread. src_of(r) is the source
// row, mask_of(r) its destinations and dst_of(r, d) the row at destination d:
// the row is loaded once and stored to each. Sizes stay below 2^32 vectors.
template <typename V, typename SrcOf, typename MaskOf, typename DstOf>
RC_DEVICE void block_copy_rows(int64_t nrows, int64_t nvec, SrcOf src_of, MaskOf mask_of, DstOf dst_of) {
  const uint32_t total = uint32_t(nrows * nvec), n = uint32_t(nvec), nt = kThreads;
  for (uint32_t i0 = threadIdx.x; i0 < total; i0 += nt * kUnroll) {
    V val[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * nt, row = i / n;
      if (i < total) val[u] = reinterpret_cast<const V*>(src_of(row))[i - row * n];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * nt, row = i / n;
      if (i >= total) continue;
      const uint32_t mask = mask_of(row);
#pragma unroll
      for (int d = 0; d < kMaxGpuWorld; ++d)
        if (mask >> d & 1u) reinterpret_cast<V*>(dst_of(row, d))[i - row * n] = val[u];
    }
  }
}

// Rows [0, nrows) of row_bytes each, row r from src_of(r) to dst_of(r), in
// vectors of `vec` bytes.
template <typename SrcOf, typename DstOf>
RC_DEVICE void block_copy_each_row(int64_t nrows, int64_t row_bytes, int vec, SrcOf src_of, DstOf dst_of) {
  with_vector(vec, [&](auto tag) {
    using V = typename decltype(tag)::type;
    block_copy_rows<V>(
        nrows, row_bytes / vec, src_of, [](uint32_t) { return 1u; }, [&](uint32_t r, int) { return dst_of(r); });
  });
}

// One contiguous range, copied by the whole block.
RC_DEVICE void block_copy(char* dst, const char* src, int64_t bytes, int vec) {
  block_copy_each_row(
      1, bytes, vec, [&](uint32_t) { return src; }, [&](uint32_t) { return dst; });
}

}  // namespace gpu
}  // namespace rdna4_comm
