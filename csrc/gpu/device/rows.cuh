// Row loops of the EP kernels. A block cuts the vectors of a batch of rows,
// taken row after row, into one contiguous piece per warp, all of one size,
// so every warp moves the same bytes however the rows fall (rows of 42 per
// block dealt whole to 16 warps kept 6 of them idle for the last third of
// the batch). A warp's lanes take strided vectors of each row its piece
// touches, kRowUnroll of them in flight, so a row's pointers are computed
// once per piece or per unrolled step, never per vector.
// Own-rank rows and peer rows go through the same loops; only their
// pointers differ.
#pragma once

#include "../../policies.h"
#include "reduce.cuh"

namespace rdna4_comm {
namespace gpu {

// Vectors in flight per thread in a row copy or sum (a sum's fp32
// accumulators fit beside them: one combine kernel per dtype). A span of at
// most kShortUnroll vectors per lane (a small batch's rows) takes a loop
// unrolled that far instead (policies.h, at kGpuShortUnroll, says why): a
// copy picks per span, a sum per kernel (sum_row's kUnroll).
constexpr int kRowUnroll = 8;
constexpr int kShortUnroll = kGpuShortUnroll;

// This thread's vectors of one row: first, first + stride, ... below end.
// `lead`: the warp's piece starts the row, so this warp also writes the
// row's routing (its lanes: k = lane, lane + stride, ...).
struct RowSpan {
  uint32_t first, stride, end;
  bool lead;
};

// A span of a piece over one slice of a row (vectors from lo on), as the
// row's vectors, below row_end; only a piece of the row's first slice leads.
RC_DEVICE RowSpan slice_span(const RowSpan& s, uint32_t lo, uint32_t row_end) {
  return {lo + s.first, s.stride, lo + s.end < row_end ? lo + s.end : row_end, s.lead && lo == 0};
}

// This warp's piece of a batch of rows * n vectors, taken row after row:
// rows r..r_last, from vector v0 of the first to v_last (exclusive) of the
// last; none where r > r_last. Each piece is a whole number of warp widths
// long (the last one shorter). A batch stays below 2^32 vectors (at most
// 2^11 rows of a combine chunk, 2^21 row bytes): 32-bit indices keep the
// state that lives across the row loops small. Its divisions by n are long
// instruction sequences, so a kernel that knows its first batch can compute
// that batch's piece before it waits for anything (combine_kernel does).
struct RowPieces {
  uint32_t r, v0, r_last, v_last;
};
template <int kPieceThreads = kThreads>
RC_DEVICE RowPieces row_pieces(uint32_t rows, uint32_t n) {
  // A constant, not blockDim.x: a division by a constant is a shift or a
  // multiplication. Pieces over fewer threads than the block's leave its
  // last warps none.
  const uint32_t ws = uint32_t(warp_size()), total = rows * n;
  const uint32_t per = (total + kPieceThreads - 1) / kPieceThreads * ws;
  const uint32_t lo = threadIdx.x / ws * per;
  if (lo >= total) return {1, 0, 0, 0};
  const uint32_t hi = lo + per < total ? lo + per : total;
  const uint32_t r = lo / n, r_last = (hi - 1) / n;
  return {r, lo - r * n, r_last, hi - r_last * n};
}

// Calls piece(r, span) for every row r of the batch that this warp's piece
// `p` (row_pieces(rows, n)) touches, in ascending order.
template <typename Piece>
RC_DEVICE void for_row_pieces(const RowPieces& p, uint32_t n, Piece piece, bool leads = true) {
  const uint32_t ws = uint32_t(warp_size()), lane = uint32_t(lane_id());
  uint32_t v0 = p.v0;
  for (uint32_t r = p.r; r <= p.r_last; ++r, v0 = 0)
    piece(r, RowSpan{v0 + lane, ws, r == p.r_last ? p.v_last : n, leads && v0 == 0});
}
template <typename Piece>
RC_DEVICE void for_row_pieces(uint32_t rows, uint32_t n, Piece piece) {
  for_row_pieces(row_pieces(rows, n), n, piece);
}

// A row's vectors of span `s` from src to row_of(d), for every d in `mask`
// (ranks, or an expert-layout row's pair rows; the same on every lane of
// the warp): each vector is loaded once and stored to every destination,
// the destinations taken one set bit at a time (the loop is as long as the
// mask, not the largest world). kInput: src is memory nothing writes while
// the kernel runs (load_input): an op's input, or heap rows of a dispatch
// that has finished, which no peer overwrites before this rank's next
// dispatch (the expert placement); else heap memory that a peer wrote in
// this op (plain loads, ordered after the flag's acquire).
RC_DEVICE bool short_span(const RowSpan& s) { return s.end <= s.first + kShortUnroll * s.stride; }

template <int U, typename V, bool kInput, typename RowOf, typename Mask>
RC_DEVICE void copy_span(const V* in, RowOf row_of, Mask mask, const RowSpan& s) {
  for (uint32_t v0 = s.first; v0 < s.end; v0 += s.stride * U) {
    V val[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = v0 + u * s.stride;
      if (v < s.end) val[u] = kInput ? load_input(in + v) : in[v];
    }
    for (Mask m = mask; m != 0; m &= m - 1) {
      V* o = reinterpret_cast<V*>(row_of(lowest_bit(m)));
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t v = v0 + u * s.stride;
        if (v < s.end) o[v] = val[u];
      }
    }
  }
}
template <typename V, bool kInput, typename RowOf, typename Mask>
RC_DEVICE void copy_row(const char* src, RowOf row_of, Mask mask, const RowSpan& s) {
  const V* in = reinterpret_cast<const V*>(src);
  if (short_span(s)) copy_span<kShortUnroll, V, kInput>(in, row_of, mask, s);
  else copy_span<kRowUnroll, V, kInput>(in, row_of, mask, s);
}

// Scales a lane of a row's lead warp keeps in flight beside the row's
// vectors (copy_row_and_scales): every scale of a row of up to
// kLaneScales * 32 of them (H <= 8192) on 32-lane warps.
constexpr int kLaneScales = 2;

// A row's vectors (copy_row) and its FP8 scales: n floats from `scales` to
// scales_of(d) for every d in `mask`, by the warp whose piece starts the row
// (s.lead: lanes k = lane, lane + stride, ...). A lead lane loads its first
// kLaneScales scales before the row's vectors and stores them after them:
// loaded and stored after the row, they waited a round trip of their own
// (12.5% of the warp samples of an FP8 pair's dispatch at T = 4096 on an
// H100). kInput: as copy_row's, for the scales too.
template <typename V, bool kInput, typename RowOf, typename ScalesOf, typename Mask>
RC_DEVICE void copy_row_and_scales(const char* src, const float* scales, int64_t n, RowOf row_of, ScalesOf scales_of,
                                   Mask mask, const RowSpan& s) {
  auto load = [&](int64_t k) { return kInput ? load_input(scales + k) : scales[k]; };
  auto store = [&](int64_t k, float v) {
    for (Mask m = mask; m != 0; m &= m - 1) scales_of(lowest_bit(m))[k] = v;
  };
  float first[kLaneScales];
#pragma unroll
  for (int i = 0; i < kLaneScales; ++i) {
    const int64_t k = s.first + int64_t(i) * s.stride;
    if (s.lead && k < n) first[i] = load(k);
  }
  copy_row<V, kInput>(src, row_of, mask, s);
  if (!s.lead) return;
#pragma unroll
  for (int i = 0; i < kLaneScales; ++i) {
    const int64_t k = s.first + int64_t(i) * s.stride;
    if (k < n) store(k, first[i]);
  }
  for (int64_t k = s.first + int64_t(kLaneScales) * s.stride; k < n; k += s.stride) store(k, load(k));
}

// A row's vectors of span `s` of one output row: the sum over the terms i in
// `mask` (ranks, or an expert-layout row's pair rows), ascending, of their
// rows row_of(i), in fp32 starting from the first term, rounded once to D;
// zeros for an empty mask. The order of sum_one, so every transport and the
// reference round alike. The terms are taken one set bit at a time and each
// row's pointer computed when it is read, so the loop is as long as the
// mask, not the largest world. kTerms terms are loaded before any of them
// is added, kUnroll / kTerms vectors of each: a sum of many terms (an
// expert-layout row's pairs) waits for memory once per kTerms terms, not
// once per term (8 pair rows summed one at a time took 8.3 us for a decode
// step's 8 rows on an H200).
template <DType D, typename V, int kTerms = 1, int kUnroll = kRowUnroll, typename RowOf, typename Mask>
RC_DEVICE void sum_row(RowOf row_of, Mask mask, char* out, const RowSpan& s) {
  using E = Elem<D>;
  using Pack = ElemPack<D, V>;
  constexpr int N = Pack::N, U = kUnroll / kTerms;
  static_assert(U * kTerms == kUnroll, "kTerms divides the vectors in flight");
  V* o = reinterpret_cast<V*>(out);
  for (uint32_t v0 = s.first; v0 < s.end; v0 += s.stride * U) {
    float acc[U][N];
    // The next (up to) kTerms terms of m (not empty) into p, taking them off m; how many.
    auto load = [&](Mask& m, Pack (&p)[kTerms][U]) {
      int n = 0;
#pragma unroll
      for (int t = 0; t < kTerms; ++t) {
        if (t > 0 && m == 0) break;
        const V* in = reinterpret_cast<const V*>(row_of(lowest_bit(m)));
        m &= m - 1;
        ++n;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint32_t v = v0 + u * s.stride;
          p[t][u].v = v < s.end ? in[v] : V{};
        }
      }
      return n;
    };
    auto add = [&](const Pack (&p)[kTerms][U], int from, int n) {
#pragma unroll
      for (int t = 0; t < kTerms; ++t) {
        if (t < from) continue;
        if (t >= n) break;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int k = 0; k < N; ++k) acc[u][k] += E::load(p[t][u].e[k]);
      }
    };
    if (mask != 0) {
      Mask m = mask;
      Pack p[kTerms][U];
      const int n = load(m, p);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < N; ++k) acc[u][k] = E::load(p[0][u].e[k]);
      add(p, 1, n);
      while (m != 0) add(p, 0, load(m, p));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = v0 + u * s.stride;
      if (v >= s.end) continue;
      Pack q;
      if (mask == 0) q.v = V{};
      else round_into<D, V>(q, acc[u]);
      o[v] = q.v;
    }
  }
}

// The rows of a group of G work items as one batch of n-vector rows
// (for_row_pieces). Before the call, thread g < G has stored item g's row
// count in first[g + 1] and a barrier has passed; this turns first[] into
// each item's first row and calls row(g, k, span) for row k of item g.
template <typename RowFn>
RC_DEVICE void for_item_rows(uint32_t* first, int G, uint32_t n, RowFn row) {
  if (threadIdx.x == 0) {
    first[0] = 0;
    for (int g = 0; g < G; ++g) first[g + 1] += first[g];
  }
  block_sync();
  int g = 0;  // item of row r: a warp's rows ascend, so the search resumes where it stopped
  for_row_pieces(first[G], n, [&](uint32_t r, const RowSpan& s) {
    while (first[g + 1] <= r) ++g;
    row(g, r - first[g], s);
  });
}

// Calls f(VecTag<V>{}) for a row loop's vector: 16 bytes where the rows and
// pointers allow it (`vec` = 16, from row_vector), else the element itself
// (a sum) or 2 bytes (a copy: every EP element size divides, and aligns, that).
template <DType D, typename F>
RC_DEVICE void with_row_vector(int vec, F&& f) {
  if (vec == 16) f(VecTag<uint4>{}); else f(VecTag<typename Elem<D>::Raw>{});
}
// Vectors of with_row_vector's type in `bytes`, by constant divisors (also
// on the host, where launch_combine picks the sum loop from them).
template <DType D>
RC_HD uint32_t row_vectors(int64_t bytes, int vec) {
  return uint32_t(vec == 16 ? bytes / 16 : bytes / int64_t(sizeof(typename Elem<D>::Raw)));
}
template <typename F>
RC_DEVICE void with_copy_vector(int vec, F&& f) {
  if (vec == 16) f(VecTag<uint4>{}); else f(VecTag<uint16_t>{});
}
// Vectors of with_copy_vector's type in `bytes`, by constant divisors.
RC_DEVICE uint32_t copy_vectors(int64_t bytes, int vec) { return uint32_t(vec == 16 ? bytes / 16 : bytes / 2); }

}  // namespace gpu
}  // namespace rdna4_comm
