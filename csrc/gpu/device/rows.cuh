// Row loops of the EP kernels. A group of warps takes one row at a time and
// each of its threads strided vectors of that row, kRowUnroll (kSumUnroll)
// of them in flight, so a row's pointers are computed once per row or per
// unrolled step, never per vector. Own-rank rows and peer rows go through
// the same loops; only their pointers differ.
#pragma once

#include "reduce.cuh"

namespace rdna4_comm {
namespace gpu {

// Vectors in flight per thread in a row copy, and in a row sum (whose fp32
// accumulators take more registers).
constexpr int kRowUnroll = 8;
constexpr int kSumUnroll = 4;

// How a block's warps share rows: `groups` groups of equal size, a power of
// two of warps each (so none is idle), as many warps per row as the rows
// leave: a batch of one row has the whole block on it, 16 rows or more one
// warp each. This thread is in group `group`; it takes vectors first,
// first + stride, ... of the group's row.
struct RowGroups {
  int group, groups;
  uint32_t first, stride;
};

RC_DEVICE RowGroups row_groups(int64_t rows) {
  const int ws = warp_size(), nw = int(blockDim.x) / ws, warp = int(threadIdx.x) / ws;
  int per = 1;
  while (per * 2 <= nw && int64_t(per) * 2 * rows <= nw) per *= 2;
  return {warp / per, nw / per, uint32_t((warp % per) * ws + lane_id()), uint32_t(per * ws)};
}

// Vectors [0, n) of a row from src to row_of(d), for every rank d in `mask`
// (the same on every thread of the group): each vector is loaded once and
// stored to every destination, the destinations taken one set bit at a time
// (the loop is as long as the mask, not the largest world). kInput: src is
// an op's input, which nothing writes while the kernel runs (load_input);
// else heap memory that a peer wrote in this op (plain loads, ordered after
// the flag's acquire).
template <typename V, bool kInput, typename RowOf>
RC_DEVICE void copy_row(const char* src, RowOf row_of, uint32_t mask, uint32_t n, const RowGroups& g) {
  const V* s = reinterpret_cast<const V*>(src);
  for (uint32_t v0 = g.first; v0 < n; v0 += g.stride * kRowUnroll) {
    V val[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const uint32_t v = v0 + u * g.stride;
      if (v < n) val[u] = kInput ? load_input(s + v) : s[v];
    }
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      V* o = reinterpret_cast<V*>(row_of(lowest_bit(m)));
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const uint32_t v = v0 + u * g.stride;
        if (v < n) o[v] = val[u];
      }
    }
  }
}

// Vectors [0, n) of one output row: the sum over the ranks r in `mask`,
// ascending, of their rows row_of(r), in fp32 starting from the first term,
// rounded once to D; zeros for an empty mask. The order of sum_one, so every
// transport and the reference round alike. The ranks are taken one set bit
// at a time and each row's pointer computed when it is read, so the loop is
// as long as the mask, not the largest world.
template <DType D, typename V, typename RowOf>
RC_DEVICE void sum_row(RowOf row_of, uint32_t mask, char* out, uint32_t n, const RowGroups& g) {
  using E = Elem<D>;
  using Pack = ElemPack<D, V>;
  constexpr int N = Pack::N;
  V* o = reinterpret_cast<V*>(out);
  for (uint32_t v0 = g.first; v0 < n; v0 += g.stride * kSumUnroll) {
    float acc[kSumUnroll][N];
    auto load = [&](uint32_t m, Pack (&p)[kSumUnroll]) {
      const V* s = reinterpret_cast<const V*>(row_of(lowest_bit(m)));
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const uint32_t v = v0 + u * g.stride;
        p[u].v = v < n ? s[v] : V{};
      }
    };
    if (mask != 0) {
      Pack p[kSumUnroll];
      load(mask, p);
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
        for (int k = 0; k < N; ++k) acc[u][k] = E::load(p[u].e[k]);
      for (uint32_t m = mask & (mask - 1); m != 0; m &= m - 1) {
        load(m, p);
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
          for (int k = 0; k < N; ++k) acc[u][k] += E::load(p[u].e[k]);
      }
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const uint32_t v = v0 + u * g.stride;
      if (v >= n) continue;
      Pack q;
      if (mask == 0) {
        q.v = V{};
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) q.e[k] = E::store(acc[u][k]);
      }
      o[v] = q.v;
    }
  }
}

// The rows of a group of G work items as one batch, each row on a group of
// warps (row_groups). Before the call, thread g < G has stored item g's row
// count in first[g + 1] and a barrier has passed; this turns first[] into
// each item's first row and calls row(g, k, groups) for row k of item g.
template <typename RowFn>
RC_DEVICE void for_item_rows(uint32_t* first, int G, RowFn row) {
  if (threadIdx.x == 0) {
    first[0] = 0;
    for (int g = 0; g < G; ++g) first[g + 1] += first[g];
  }
  block_sync();
  const int64_t rows = first[G];
  const RowGroups rg = row_groups(rows);
  int g = 0;  // item of row r: rows ascend, so the search resumes where it stopped
  for (int64_t r = rg.group; r < rows; r += rg.groups) {
    while (int64_t(first[g + 1]) <= r) ++g;
    row(g, r - int64_t(first[g]), rg);
  }
}

// Calls f(VecTag<V>{}) for a row loop's vector: 16 bytes where the rows and
// pointers allow it (`vec` = 16, from row_vector), else the element itself
// (a sum) or 2 bytes (a copy: every EP element size divides, and aligns, that).
template <DType D, typename F>
RC_DEVICE void with_row_vector(int vec, F&& f) {
  if (vec == 16) f(VecTag<uint4>{}); else f(VecTag<typename Elem<D>::Raw>{});
}
template <typename F>
RC_DEVICE void with_copy_vector(int vec, F&& f) {
  if (vec == 16) f(VecTag<uint4>{}); else f(VecTag<uint16_t>{});
}

}  // namespace gpu
}  // namespace rdna4_comm
