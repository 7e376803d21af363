// Expert-parallel routing on the device, shared by dispatch and combine:
// destination sets, row positions, and the (source, chunk) items receivers
// take (chunkings: policies.h, at ep_chunks).
#pragma once

#include "../../bounds.h"
#include "../../policies.h"
#include "../../routing.h"
#include "launch.cuh"

namespace rdna4_comm {
namespace gpu {

// An EP launch's geometry, computed once on the host for every block (on
// the GPU a 64-bit division by a run-time value is a long instruction
// sequence, and every block would repeat it before its first load).
struct EpLaunch {
  int64_t own_block_tokens;  // tokens per block of the own-token role (ep_own_block_tokens)
  int64_t experts_per_rank;
  int send_blocks;
  int vec;  // the row loops' vector (row_vector)
  // This rank's tokens in combine chunks: ep_chunk_tokens of them, and the
  // group size (group_size) for that chunk.
  int32_t own_chunk_tokens, own_group;
  // Combine's receiver blocks per range of tokens, each a column slice of
  // the range's rows of slice_vectors vectors (combine_recv_slices).
  int32_t recv_slices;
  uint32_t slice_vectors;
};

// Ids a token's routing loads at once without the top-k fast path.
constexpr int kIdGroup = 8;

template <typename IdxT, int KF>
struct Routing {
  const IdxT* idx;
  int K;
  int64_t num_experts, epr;
  int world;
  RC_DEVICE int topk() const { return KF > 0 ? KF : K; }
  // A token's destinations. Its ids are loaded kIdGroup at a time (KF with
  // the fast path), all of a group before the first is tested: the owner
  // test branches (a loop over the ranks), and with the loads interleaved
  // the compiler issued each after the test before it, so they waited for
  // one another (seen in the SASS).
  RC_DEVICE uint32_t mask(int64_t t) const {
    constexpr int G = KF > 0 ? KF : kIdGroup;
    const IdxT* row = idx + t * topk();
    uint32_t m = 0;
    for (int k0 = 0; k0 < topk(); k0 += G) {
      IdxT id[G];
#pragma unroll
      for (int i = 0; i < G; ++i) id[i] = KF > 0 || k0 + i < K ? row[k0 + i] : IdxT(-1);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const int o = expert_owner(int64_t(id[i]), num_experts, epr, world);
        if (o >= 0) m |= 1u << o;
      }
    }
    return m;
  }
};

// Sum of v over the warp's lanes, on every lane.
RC_DEVICE int32_t warp_sum(int32_t v) {
  for (int o = warp_size() / 2; o > 0; o /= 2) v += warp_shfl_xor(v, o);
  return v;
}

// Within-batch positions: for each destination d, the number of earlier
// tokens of the batch (threads below this one) that go to d, plus run[d];
// then run[d] grows by the batch's total. Ballots over each warp, then warp
// d scans destination d's warp totals (shared memory) with shuffles. Two
// block barriers; back-to-back calls need none between them (a warp
// rewrites only its own warp_tot row, after a warp barrier past its lanes'
// last reads of it, and warp d reads run[d] and warp_tot's column d before
// the second block barrier).
RC_DEVICE void batch_positions(uint32_t m, int W, int32_t (&pos)[kMaxGpuWorld],
                               int32_t (&warp_tot)[kMaxWarps][kMaxGpuWorld], int32_t* run) {
  const int ws = warp_size(), lane = lane_id(), warp = int(threadIdx.x) / ws, nw = kThreads / ws;
  const uint64_t below = lane == 0 ? 0ull : (~0ull >> (64 - lane));
  warp_sync();  // the lanes' reads of the warp's row in an earlier call come first
#pragma unroll
  for (int d = 0; d < kMaxGpuWorld; ++d) {
    if (d >= W) break;
    const uint64_t bal = warp_ballot(m >> d & 1u);
    pos[d] = popcount64(bal & below);
    if (lane == 0) warp_tot[warp][d] = popcount64(bal);
  }
  block_sync();
  if (warp < W) {  // warp_tot[w][d] becomes run[d] plus the totals of the warps below w
    const int d = warp;
    const int32_t base = run[d], v = lane < nw ? warp_tot[lane][d] : 0;
    int32_t inclusive = v;
    for (int o = 1; o < nw; o *= 2) {
      const int32_t lower = warp_shfl_up(inclusive, o);
      if (lane >= o) inclusive += lower;
    }
    warp_sync();  // every lane has read run[d] before lane nw - 1 rewrites it
    if (lane < nw) warp_tot[lane][d] = base + inclusive - v;
    if (lane == nw - 1) run[d] = base + inclusive;
  }
  block_sync();
#pragma unroll
  for (int d = 0; d < kMaxGpuWorld; ++d) {
    if (d >= W) break;
    pos[d] += warp_tot[warp][d];
  }
}

// Receive items are (source, chunk) pairs ordered chunk-major, so receivers
// take chunks in the order senders produce them. Round c holds the sources
// with more than c chunks.
RC_DEVICE void item_to_chunk(int64_t item, const int32_t* nchunks, int W, int* src, int64_t* chunk) {
  auto before = [&](int64_t c) {
    int64_t n = 0;
    for (int s = 0; s < W; ++s) n += nchunks[s] < c ? nchunks[s] : c;
    return n;
  };
  int64_t lo = 0, hi = kEpTargetChunks;  // largest c with before(c) <= item
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (before(mid) <= item) lo = mid; else hi = mid - 1;
  }
  int64_t k = item - before(lo);
  for (int s = 0; s < W; ++s) {
    if (nchunks[s] <= lo) continue;
    if (k-- == 0) {
      *src = s;
      *chunk = lo;
      return;
    }
  }
}

// A receiver waits for a group of its items' flags together and then copies
// them, so tiny chunks (one token each up to T = 128) do not each cost a wait
// and a barrier; groups hold about kGroupRows tokens' worth of chunks.
constexpr int kMaxGroup = 32;
constexpr int64_t kGroupRows = 64;

RC_HD int group_size(int64_t chunk_tokens) {
  const int64_t g = kGroupRows / chunk_tokens;
  return int(g < 1 ? 1 : (g > kMaxGroup ? kMaxGroup : g));
}

// The (source, chunk) items of every source, and the group size that fits
// the largest chunk among them. A source listed with no chunks (this rank:
// its own rows never pass through the heap) has no items.
struct Items {
  int64_t count;
  int group;
};

// What a block knows about every source rank: its token count and
// chunking, the rows it sent this rank, the chunks to take from the heap,
// and where its rows start in the received rows (sources in rank order).
struct Sources {
  int32_t ntok[kMaxGpuWorld], chunk_tokens[kMaxGpuWorld], nrows[kMaxGpuWorld], nchunks[kMaxGpuWorld];
  int32_t offset[kMaxGpuWorld + 1];
};

// Block-wide, one barrier: thread s fills source s from counts_of(s, &ntok,
// &nrows, &chunk_tokens), which returns false when they are not to be used
// (a failed wait, a bad handle value), and warp 0 adds up the row offsets.
// True on every thread when every source's counts were. This rank's own
// rows never pass through the heap, so it is listed with no chunks.
template <typename CountsOf>
RC_DEVICE bool load_sources(const Env& env, Sources& src, CountsOf counts_of) {
  const int W = env.world, tid = threadIdx.x;
  bool ok = true;
  int32_t nrows32 = 0;
  if (tid < W) {
    int64_t ntok = 0, nrows = 0, chunk_tokens = 1;
    ok = counts_of(tid, &ntok, &nrows, &chunk_tokens);
    src.ntok[tid] = int32_t(ntok);
    src.chunk_tokens[tid] = int32_t(chunk_tokens);
    src.nrows[tid] = nrows32 = int32_t(nrows);
    src.nchunks[tid] = tid == env.rank || !ok ? 0 : int32_t(ep_chunks(ntok, chunk_tokens));
  }
  if (tid < warp_size()) {
    // A handle's counts are summed before the verdict: each is clamped to
    // [0, 2^24] first, so the W <= 8 of them cannot overflow (a valid one,
    // at most kMaxGpuTokensPerRank, is unchanged).
    static_assert(kMaxGpuWorld << 24 <= INT32_MAX && kMaxGpuTokensPerRank <= (1 << 24), "offsets fit int32");
    int32_t at = nrows32 < 0 ? 0 : (nrows32 > (1 << 24) ? (1 << 24) : nrows32);
    for (int o = 1; o < kMaxGpuWorld; o *= 2) {
      const int32_t lower = warp_shfl_up(at, o);
      if (tid >= o) at += lower;
    }
    if (tid < W) src.offset[tid + 1] = at;
    if (tid == 0) src.offset[0] = 0;
  }
  return block_all(ok);
}

RC_DEVICE Items source_items(const Sources& src, int W) {
  int64_t count = 0, cmax = 1;
  for (int s = 0; s < W; ++s) {
    if (src.nchunks[s] == 0) continue;
    count += src.nchunks[s];
    cmax = src.chunk_tokens[s] > cmax ? src.chunk_tokens[s] : cmax;
  }
  return {count, group_size(cmax)};
}

}  // namespace gpu
}  // namespace rdna4_comm
