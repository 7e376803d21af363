// The expert layout's tables (expert_layout.cu): which local experts a
// received row's slots start pairs of, each chunk's bitmask of the rows
// that have an expert, and each expert's count and aligned offset. The
// tally kernel builds them in global memory; a decode step's placement
// builds one chunk's in shared memory.
#pragma once

#include "../../bounds.h"
#include "../../policies.h"
#include "launch.cuh"

namespace rdna4_comm {
namespace gpu {

constexpr int kChunkRows = int(kExpertChunkRows);
static_assert(kChunkRows <= kMinWarpSize && kChunkRows == 32, "a chunk's bitmask is one 32-bit word, a row per lane");
static_assert(kMaxTopk <= 64, "a row's pairs are one 64-bit mask");
// A row's slots, a lane each: slot k is lane k % warp size's, of its group
// k / warp size. The placement is compiled for the groups a K takes on the
// narrowest warp (slot_groups): a decode step's K = 8 pays for one group's
// registers and shuffles, not kMaxTopk's.
static_assert(kMaxTopk % kMinWarpSize == 0, "a row's slots fill whole groups of lanes");
constexpr int kMaxSlotGroups = kMaxTopk / kMinWarpSize;
static_assert(kMaxSlotGroups == 2, "the placement is compiled for 1 and 2 groups");
RC_HD constexpr int slot_groups(int64_t topk) { return topk <= kMinWarpSize ? 1 : kMaxSlotGroups; }
// Slots k of a received row (its K local ids, -1 where the expert lives
// elsewhere) that start a pair: slot k names a local expert that no earlier
// slot names. One bit per slot. The ids come a group at a time, the group's
// loads in flight together (the earlier groups' are read again from cache).
// An id outside [-1, E) starts none: a dispatch that failed (a timeout, a
// peer that exited) leaves its ids unwritten, and the kernels after it run
// anyway; they must stay in bounds until the host raises the failure.
template <typename IdxT>
RC_DEVICE uint64_t pair_slots(const IdxT* ids, int K, int64_t E) {
  constexpr int G = 8;
  uint64_t first = 0;
  for (int k0 = 0; k0 < K; k0 += G) {
    IdxT g[G];
#pragma unroll
    for (int u = 0; u < G; ++u) g[u] = k0 + u < K ? ids[k0 + u] : IdxT(-1);
#pragma unroll
    for (int u = 0; u < G; ++u) {
      bool seen = g[u] < 0 || int64_t(g[u]) >= E;
#pragma unroll
      for (int v = 0; v < u; ++v) seen = seen || g[v] == g[u];
      for (int i = 0; i < k0 && !seen; ++i) seen = ids[i] == g[u];
      if (!seen) first |= uint64_t(1) << (k0 + u);
    }
  }
  return first;
}

// Exclusive prefix sum of v over the block's threads; *total gets the
// block's sum on every thread. Its warps read warp_tot after its barrier,
// and a slower warp may still be reading it when a faster one returns: a
// barrier must pass before the next call writes it.
RC_DEVICE int32_t block_exclusive_sum(int32_t v, int32_t* total, int32_t (&warp_tot)[kMaxWarps]) {
  const int ws = warp_size(), nw = kThreads / ws, warp = int(threadIdx.x) / ws, lane = lane_id();
  int32_t inclusive = v;
  for (int o = 1; o < ws; o *= 2) {
    const int32_t lower = warp_shfl_up(inclusive, o);
    if (lane >= o) inclusive += lower;
  }
  if (lane == ws - 1) warp_tot[warp] = inclusive;
  block_sync();
  int32_t before = 0, sum = 0;
  for (int w = 0; w < nw; ++w) {
    before += w < warp ? warp_tot[w] : 0;
    sum += warp_tot[w];
  }
  *total = sum;
  return before + inclusive - v;
}

// Each expert's offset from its count: the counts of the experts before it,
// each rounded up to the alignment A, summed. Thread e % kThreads calls
// count(e) once for each expert e (passes of kThreads experts) and
// store(e, count, offset); in the last pass the thread of the last expert
// calls finish(end, needed) with the end of the last expert's rows
// (offsets[E]) and the rows the pairs need (the furthest end of an
// expert's rows: its alignment padding need not fit). A barrier must pass
// before other threads read what store and finish wrote. Every thread of
// the block calls it, E >= 1 (num_experts is a positive multiple of the
// world size). Offsets and counts fit int32, the outputs' dtype.
template <typename Count, typename Store, typename Finish>
RC_DEVICE void scan_expert_offsets(int64_t E, int32_t A, Count count, Store store, Finish finish,
                                   int32_t (&warp_tot)[kMaxWarps]) {
  int32_t carry = 0;
  for (int64_t e0 = 0; e0 < E; e0 += kThreads) {
    if (e0 > 0) block_sync();  // every warp has read warp_tot of the last pass
    const int64_t e = e0 + threadIdx.x;
    const int32_t n = e < E ? count(e) : 0;
    int32_t total = 0;
    const int32_t offset = carry + block_exclusive_sum((n + A - 1) / A * A, &total, warp_tot);
    if (e < E) store(e, n, offset);
    carry += total;
    // Expert e's rows end at offset + n <= offsets[e + 1] <= offsets[E - 1]:
    // the last expert's end is the furthest.
    if (e == E - 1) finish(carry, offset + n);
  }
}

// Where the placement reads each expert's offset and count and each
// (chunk, expert)'s bitmask and prefix: the outputs and scratch of the
// tally kernel, or a block's own tables of one chunk (counts
// and prefixes none: a count is its one mask's bits, and no chunk comes
// before the first).
struct ExpertTables {
  const int32_t* offsets;  // [E + 1]
  const int32_t* counts;   // [E], or nullptr
  const uint32_t* masks;   // [chunks, E]
  const int32_t* prefix;   // [chunks, E], or nullptr
  RC_DEVICE int32_t count(int64_t e) const { return counts ? counts[e] : __popc(masks[e]); }
};

}  // namespace gpu
}  // namespace rdna4_comm
