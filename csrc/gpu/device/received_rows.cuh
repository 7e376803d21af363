// The rows the expert layout's kernels go over (expert_layout.cu): the rank
// layout's received rows, not its capacity, sliced over the grid so that a
// decode step's few rows still spread over every multiprocessor
// (expert_row_slices, policies.h).
#pragma once

#include "../../policies.h"
#include "rows.cuh"

namespace rdna4_comm {
namespace gpu {

// The rows received: the sum of counts, clamped to [0, rows] (a combine
// handle's counts are user input; the combine after the sums raises for bad ones).
RC_DEVICE int32_t rows_received(const int32_t* counts, int world, int64_t rows) {
  int64_t n = 0;
  for (int s = 0; s < world; ++s) n += counts[s];
  return int32_t(n < 0 ? 0 : (n > rows ? rows : n));
}

// This block's share of the received rows of nvec vectors: each row cut
// into `slices` runs of `width` vectors (the last one shorter;
// expert_row_slices), and the block's slices u0 .. u1 of them, contiguous.
// A grid sized for the capacity leaves the blocks past a decode step's
// slices an empty share.
struct ReceivedShare {
  int32_t slices, u0, u1;
  uint32_t width, nvec;
  RC_DEVICE bool empty() const { return u0 >= u1; }
};
RC_DEVICE ReceivedShare received_share(int32_t received, int64_t row_bytes, uint32_t nvec) {
  const int32_t slices = int32_t(expert_row_slices(received, row_bytes, nvec, int(gridDim.x)));
  // Fits int32: the received rows, or at most the blocks where slices > 1.
  const int32_t units = received * slices, per = (units + int32_t(gridDim.x) - 1) / int32_t(gridDim.x);
  const int32_t u0 = int32_t(blockIdx.x) * per, u1 = u0 + per < units ? u0 + per : units;
  return {slices, u0, u1, (nvec + uint32_t(slices) - 1) / uint32_t(slices), nvec};
}

// The share's slices, kBatchRows at a time: warp w runs prepare(r, j,
// writes) with all its lanes for slices r = w, w + warps, ... of the batch
// (j: the slice's row; `writes`: the row's first slice, whose block alone
// writes the row's outputs), shared state for the batch; then, after a
// barrier, row(r, j, span) runs for the vectors of every slice of the
// batch (for_row_pieces; the span's indices are the row's, and it leads
// only from the row's first vector).
constexpr int kBatchRows = int(kExpertChunkRows);
template <typename Prepare, typename Row>
RC_DEVICE void for_received_rows(const ReceivedShare& sh, Prepare prepare, Row row) {
  const int nw = kThreads / warp_size(), warp = int(threadIdx.x) / warp_size();
  for (int32_t b0 = sh.u0; b0 < sh.u1; b0 += kBatchRows) {
    const int32_t n = sh.u1 - b0 < kBatchRows ? sh.u1 - b0 : kBatchRows;
    for (int r = warp; r < n; r += nw) prepare(r, (b0 + r) / sh.slices, (b0 + r) % sh.slices == 0);
    block_sync();
    for_row_pieces(uint32_t(n), sh.width, [&](uint32_t r, const RowSpan& s) {
      const int32_t u = b0 + int32_t(r);
      row(int(r), u / sh.slices, slice_span(s, uint32_t(u % sh.slices) * sh.width, sh.nvec));
    });
    block_sync();  // the batch's shared state is read before the next batch's prepare
  }
}

}  // namespace gpu
}  // namespace rdna4_comm
