// Row loops of the EP kernels. A group of warps takes one row at a time and
// each of its threads strided vectors of that row, so a row's pointers (its
// source, its destinations, its contributors) are computed once per row, not
// per vector, and a thread keeps kRowUnroll vectors in flight. Own-rank rows
// and peer rows go through the same loops; only their pointers differ.
#pragma once

#include "reduce.cuh"

namespace rdna4_comm {
namespace gpu {

// Vectors in flight per thread in a row copy, and in a row sum (whose fp32
// accumulators take more registers).
constexpr int kRowUnroll = 8;
constexpr int kSumUnroll = 4;

// A pointer per rank, indexed only with unrolled loops so it stays in registers.
struct RankPtrs {
  char* p[kMaxGpuWorld];
};

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

// Vectors [0, n) of a row from src to dst.p[d], for every rank d in `mask`
// (the same on every thread of the group): each vector is loaded once and
// stored to every destination. kInput: src is an op's input, which nothing
// writes while the kernel runs (load_input); else heap memory that a peer
// wrote in this op (plain loads, ordered after the flag's acquire).
template <typename V, bool kInput>
RC_DEVICE void copy_row(const char* src, const RankPtrs& dst, uint32_t mask, uint32_t n, const RowGroups& g) {
  const V* s = reinterpret_cast<const V*>(src);
  for (uint32_t v0 = g.first; v0 < n; v0 += g.stride * kRowUnroll) {
    V val[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const uint32_t v = v0 + u * g.stride;
      if (v < n) val[u] = kInput ? load_input(s + v) : s[v];
    }
#pragma unroll
    for (int d = 0; d < kMaxGpuWorld; ++d) {
      if (!(mask >> d & 1u)) continue;
      V* o = reinterpret_cast<V*>(dst.p[d]);
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const uint32_t v = v0 + u * g.stride;
        if (v < n) o[v] = val[u];
      }
    }
  }
}

// Vectors [0, n) of one output row: the sum over the ranks r in `mask`,
// ascending, of their rows src.p[r], in fp32 starting from the first term,
// rounded once to D; zeros for an empty mask. The order of sum_one, so every
// transport and the reference round alike.
template <DType D, typename V>
RC_DEVICE void sum_row(const ConstRankPtrs& src, uint32_t mask, char* out, uint32_t n, const RowGroups& g) {
  using E = Elem<D>;
  using Pack = ElemPack<D, V>;
  constexpr int N = Pack::N;
  V* o = reinterpret_cast<V*>(out);
  for (uint32_t v0 = g.first; v0 < n; v0 += g.stride * kSumUnroll) {
    float acc[kSumUnroll][N];
    bool first = true;
#pragma unroll
    for (int r = 0; r < kMaxGpuWorld; ++r) {
      if (!(mask >> r & 1u)) continue;
      const V* s = reinterpret_cast<const V*>(src.p[r]);
      Pack p[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const uint32_t v = v0 + u * g.stride;
        p[u].v = v < n ? s[v] : V{};
      }
      if (first) {
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
          for (int k = 0; k < N; ++k) acc[u][k] = E::load(p[u].e[k]);
      } else {
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
          for (int k = 0; k < N; ++k) acc[u][k] += E::load(p[u].e[k]);
      }
      first = false;
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const uint32_t v = v0 + u * g.stride;
      if (v >= n) continue;
      Pack q;
      if (first) {
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
// pointers allow it (`vec`, from widest_vector), else the element itself.
template <DType D, typename F>
RC_DEVICE void with_row_vector(int vec, F&& f) {
  if (vec == 16) f(VecTag<uint4>{}); else f(VecTag<typename Elem<D>::Raw>{});
}

// Block-wide. For c in [0, nch]: start[c][d] = how many of the tokens before
// chunk c (chunks of C tokens, ep_chunk_tokens) have bit d in mask_of(t),
// for d < nd. Every block that calls it derives the same table from the
// same tokens, so no block waits for another. Per window of a warp's tokens:
// a ballot per destination, and the first lane of each chunk in the window
// adds its chunk's count (shared atomics, one per chunk and window).
template <typename MaskOf>
RC_DEVICE void chunk_row_starts(int64_t T, int64_t C, int64_t nch, int nd, MaskOf mask_of,
                                int32_t (*start)[kMaxGpuWorld]) {
  const int tid = threadIdx.x, nt = blockDim.x, ws = warp_size(), lane = lane_id();
  for (int i = tid; i < (kEpTargetChunks + 1) * kMaxGpuWorld; i += nt) (&start[0][0])[i] = 0;
  block_sync();
  for (int64_t base = int64_t(tid) - lane; base < T; base += nt) {  // warp-uniform: every lane takes each ballot
    const int64_t t = base + lane;
    const bool here = t < T;
    const uint32_t m = here ? mask_of(t) : 0u;
    const int64_t c = here ? int64_t(uint32_t(t) / uint32_t(C)) : 0;  // T <= kMaxGpuTokensPerRank < 2^32
    // The lanes [lo, hi) of this window that hold tokens of chunk c.
    int64_t lo = 0, hi = 0;
    if (here) {
      lo = (c * C > base ? c * C : base) - base;
      hi = ((c + 1) * C < T ? (c + 1) * C : T) - base;
      hi = hi < ws ? hi : ws;
    }
    const uint64_t lanes = (hi >= 64 ? ~0ull : (1ull << hi) - 1) & ~((1ull << lo) - 1);
#pragma unroll
    for (int d = 0; d < kMaxGpuWorld; ++d) {
      if (d >= nd) break;
      const uint64_t bal = warp_ballot(m >> d & 1u);
      const int n = popcount64(bal & lanes);
      if (here && lane == lo && n > 0) atomicAdd(&start[c][d], n);
    }
  }
  block_sync();
  // Exclusive prefix over chunks, warp d for destination d: lane l holds
  // chunks [l * per, (l + 1) * per), a shuffle scan adds the lanes below.
  const int warp = tid / ws;
  if (warp < nd) {
    const int per = (kEpTargetChunks + ws) / ws;  // covers chunks 0..kEpTargetChunks
    int32_t local = 0;
    for (int i = 0; i < per; ++i) {
      const int64_t c = int64_t(lane) * per + i;
      if (c <= nch) local += start[c][warp];
    }
    int32_t inclusive = local;
    for (int o = 1; o < ws; o *= 2) {
      const int32_t below = warp_shfl_up(inclusive, o);
      if (lane >= o) inclusive += below;
    }
    int32_t run = inclusive - local;
    for (int i = 0; i < per; ++i) {
      const int64_t c = int64_t(lane) * per + i;
      if (c > nch) break;
      const int32_t v = start[c][warp];
      start[c][warp] = run;
      run += v;
    }
  }
  block_sync();
}

}  // namespace gpu
}  // namespace rdna4_comm
