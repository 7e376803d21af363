// The pair-row sums that take an expert-layout y back to rank-layout rows
// (docs/semantics.md, "Expert layout"), for the transports whose combine
// takes rank-layout rows: the dist transport's GPU path (the GPU
// transport's combine sums the pair rows itself, combine.cu). A plain
// stream-ordered kernel over the rows received (the sum of counts, read on
// the device), not the capacity, each block a share of their slices
// (received_rows.cuh), like the placement (expert_layout.cu).
#include "../policies.h"
#include "device/pair_rows.cuh"
#include "device/received_rows.cuh"
#include "device/rows.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

// Each received row of the rank layout: its pair rows of y summed
// (pair_rows.cuh), for the transports whose combine takes rank-layout rows.
template <DType D>
__global__ void __launch_bounds__(kThreads) expert_sum_kernel(ExpertSumArgs a, int vec) {
  __shared__ uint64_t terms[kBatchRows];
  const int K = int(a.topk);
  const int64_t payload = a.hidden * int64_t(sizeof(typename Elem<D>::Raw));
  const char* y = static_cast<const char*>(a.y);
  char* out = static_cast<char*>(a.out);
  const int32_t received = rows_received(a.counts, a.world, a.rows);
  auto prepare = [&](int r, int32_t j, bool) {
    const uint64_t m = pair_terms(a.rows_of + int64_t(j) * K, K, a.expert_rows);
    if (lane_id() == 0) terms[r] = m;
  };
  const uint32_t nvec = row_vectors<D>(payload, vec);
  const int64_t vector_bytes = payload / nvec;
  for_received_rows(received_share(received, payload, nvec), prepare, [&](int r, int32_t j, const RowSpan& s) {
    const int32_t* rows_of = a.rows_of + int64_t(j) * K;
    auto row_of = [&](int k) { return y + int64_t(rows_of[k]) * payload; };
    // The terms' first lines of this lane's span are on their way before
    // the sum reads them a term at a time.
    for (uint64_t m = terms[r]; m != 0; m &= m - 1)
      prefetch_l1(row_of(lowest_bit(m)) + int64_t(s.first) * vector_bytes);
    sum_pair_rows<D, kRowUnroll>(y, payload, rows_of, terms[r], out + int64_t(j) * payload, vec, s);
  });
}

}  // namespace

void launch_expert_sum(const ExpertSumArgs& a, Stream s) {
  const int vec = row_vector(a.hidden * dtype_bytes(a.dtype), {a.y, a.out});
  auto run = [&](auto kernel) {
    RC_LAUNCH(kernel, expert_row_blocks(a.rows, a.sm_count, resident_blocks_per_sm(kernel, kThreads)), kThreads, 0, s,
              a, vec);
  };
  with_dtype(a.dtype, [&](auto dtype) { run(expert_sum_kernel<decltype(dtype)::value>); });
}

}  // namespace gpu
}  // namespace rdna4_comm
