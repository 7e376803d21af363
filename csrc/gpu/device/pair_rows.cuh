// An expert-layout y's rows back to rank-layout rows (docs/semantics.md,
// "Expert layout"): received row j is the sum of its pair rows, the valid
// values of expert_rows_of[j] in their order (ascending expert), as sum_row
// sums (fp32 from the first, rounded once; zeros for none). The expert
// layout's sum kernel (expert_sum.cu) writes them out; the GPU
// transport's combine sums them where it reads row j (combine.cu).
#pragma once

#include "rows.cuh"

namespace rdna4_comm {
namespace gpu {

// Pair rows of a sum loaded together: a row has up to K of them, where a
// rank-layout row has one per rank.
constexpr int kPairTermsInFlight = 4;

// The pair rows of a received row (its K values of expert_rows_of, a lane
// per slot: slot k is lane k % warp size's), by a whole warp: bit k for
// each slot that names a row of y. A forged value names none.
RC_DEVICE uint64_t pair_terms(const int32_t* rows_of, int K, int64_t expert_rows) {
  const int ws = warp_size();
  uint64_t m = 0;
  for (int g = 0; g * ws < K; ++g) {
    const int k = g * ws + lane_id();
    const int32_t p = k < K ? rows_of[k] : -1;
    m |= warp_ballot(p >= 0 && p < expert_rows) << (g * ws);
  }
  return m;
}

// Span `s` of the received row whose pair rows of y (payload bytes each)
// are rows_of's `terms`, into `out` (vec: the row loops' vector,
// row_vector), kUnroll vectors in flight per lane (sum_row): kRowUnroll in
// the sum kernel, a vector of each term in combine's, whose own loops
// leave the registers for no more.
template <DType D, int kUnroll>
RC_DEVICE void sum_pair_rows(const char* y, int64_t payload, const int32_t* rows_of, uint64_t terms, char* out,
                             int vec, const RowSpan& s) {
  auto row_of = [&](int k) { return y + int64_t(rows_of[k]) * payload; };
  with_row_vector<D>(vec, [&](auto tag) {
    sum_row<D, typename decltype(tag)::type, kPairTermsInFlight, kUnroll>(row_of, terms, out, s);
  });
}

}  // namespace gpu
}  // namespace rdna4_comm
