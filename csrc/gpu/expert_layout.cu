// The expert layout on the device (docs/semantics.md, "Expert layout";
// ep_layouts.cpp runs the same rule on the host for CPU tensors): a
// rank-layout dispatch result's received rows grouped by local expert
// (launch_expert_layout; expert_sum.cu takes an expert-layout y back to
// rank-layout rows). Plain stream-ordered kernels: they wait for no flag,
// so they need no co-residency; the GPU transport's placement reads the
// rows where dispatch left them (heap_gen):
// the peers' in its heap, this rank's own in dispatch's input (or in its
// rank-layout output: rows the op quantised to FP8, and rows of whole
// 16-byte vectors in an input off 16-byte boundaries). They go over the rows
// received (the sum of counts, read on the device), not the capacity: a
// decode step on a prefill-sized communicator pays for its own rows.
//
// The rows are placed in two kernels, over chunks of kExpertChunkRows
// received rows (policies.h):
//  1. tally: a warp per chunk sets, for each local expert e, the bitmask of
//     the chunk's rows that have e (chunk_masks); then the offsets, by the
//     tally's last block to finish: per expert, the rows of the earlier
//     chunks that have it (chunk_prefix), its count, the aligned offsets,
//     the rows needed;
//  2. place: a share of the received rows' slices per block
//     (for_received_rows). A warp per slice gives its row's pairs their
//     rows (the row's first slice also writes expert_rows_of and the
//     weights), then the block copies its slices, each vector loaded once
//     and stored to each of the row's pair rows; then the alignment padding.
// Rows received that fit one chunk (expert_places_one_chunk) skip 1 (where
// W * cap rows could fill more, the tally is launched and returns at once):
// each placement block runs it itself on its own shared copy of the
// tables (block 0 writes the outputs), and its warps find the rows' pairs
// as they tally them, not after the scan.
#include <type_traits>

#include "../bounds.h"
#include "../policies.h"
#include "device/copy.cuh"
#include "device/expert_tables.cuh"
#include "device/pair_rows.cuh"
#include "device/received_rows.cuh"
#include "device/rows.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

// Experts per pass over a warp's shared bitmasks in the tally.
constexpr int kExpertTile = 256;

// Per expert, the rows of the earlier chunks that have it (chunk_prefix),
// its count, the aligned offsets and the rows needed, from every chunk's
// masks, by one block: a thread per expert goes over the chunks.
RC_DEVICE void expert_offsets(const ExpertLayoutArgs& a, int32_t chunks, int32_t (&warp_tot)[kMaxWarps]) {
  const int64_t E = a.experts;
  auto count = [&](int64_t e) {
    // The masks' loads do not wait for the prefixes' stores, and U of
    // them are in flight (on an H200, the 128 chunks of 4096 rows took
    // 11.2 us in a kernel of their own, 12.7 us at 4).
    constexpr int U = 16;
    int32_t n = 0;
    for (int32_t c0 = 0; c0 < chunks; c0 += U) {
      uint32_t m[U];
#pragma unroll
      for (int u = 0; u < U; ++u) m[u] = c0 + u < chunks ? a.chunk_masks[int64_t(c0 + u) * E + e] : 0u;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c0 + u < chunks) a.chunk_prefix[int64_t(c0 + u) * E + e] = n;
        n += __popc(m[u]);
      }
    }
    return n;
  };
  scan_expert_offsets(
      E, int32_t(a.alignment), count,
      [&](int64_t e, int32_t count, int32_t offset) {
        a.out_counts[e] = count;
        a.out_offsets[e] = offset;
      },
      [&](int32_t end, int32_t needed) {
        a.out_offsets[E] = end;
        a.out_needed[0] = needed;
      },
      warp_tot);
}

// A warp per chunk sets, for each local expert e, the bitmask of the
// chunk's rows that have e (chunk_masks); then the last block to finish
// computes the offsets (expert_offsets): no launch of their own.
template <typename IdxT>
__global__ void __launch_bounds__(kThreads) expert_tally_kernel(ExpertLayoutArgs a) {
  __shared__ uint32_t tile[kMaxWarps][kExpertTile];
  __shared__ int32_t warp_tot[kMaxWarps];
  __shared__ bool last;
  const int ws = warp_size(), nw = kThreads / ws, warp = int(threadIdx.x) / ws, lane = lane_id(), K = int(a.topk);
  const int64_t E = a.experts;
  const int32_t received = rows_received(a.counts, a.world, a.rows), chunks = int32_t(expert_chunks(received));
  if (expert_places_one_chunk(received, E)) return;  // every block: the placement tallies the chunk itself
  const IdxT* ids = static_cast<const IdxT*>(a.ids);
  // Block-uniform loops: every warp reaches every barrier.
  for (int32_t c0 = int32_t(blockIdx.x) * nw; c0 < chunks; c0 += int32_t(gridDim.x) * nw) {
    const int32_t c = c0 + warp, j = c * kChunkRows + lane;
    const IdxT* row = ids + int64_t(j) * K;
    const uint64_t slots = c < chunks && lane < kChunkRows && j < received ? pair_slots(row, K, E) : 0;
    for (int64_t e0 = 0; e0 < E; e0 += kExpertTile) {
      for (int i = lane; i < kExpertTile; i += ws) tile[warp][i] = 0;
      block_sync();
      for (uint64_t m = slots; m != 0; m &= m - 1) {
        const int64_t e = int64_t(row[lowest_bit(m)]) - e0;
        if (e >= 0 && e < kExpertTile) atomicOr(&tile[warp][e], 1u << lane);
      }
      block_sync();
      if (c < chunks)
        for (int64_t i = lane; i < kExpertTile && e0 + i < E; i += ws) a.chunk_masks[int64_t(c) * E + e0 + i] = tile[warp][i];
      block_sync();  // the tile is read before the next pass clears it
    }
  }
  // The last block: each thread's mask stores come before its fence, and
  // the fences before the barrier and the block's count (a device-scope
  // atomic on this GPU's own memory, never a peer's); the block that
  // counts last has seen every other count, and its loads of the masks
  // follow its own fence. No block waits for another, so the grid needs
  // no co-residency.
  device_fence();
  block_sync();
  if (threadIdx.x == 0) {
    last = atomicAdd(a.tally_done, 1u) == gridDim.x - 1;
    if (last) *a.tally_done = 0;  // the next tally starts after this kernel has ended
  }
  block_sync();
  if (!last) return;
  device_fence();
  expert_offsets(a, chunks, warp_tot);
}

// The first chunk's ids, weights and recv_src values (what the one-chunk
// pairs read first, where received_row_source reads its sources) into L1
// while the counts load: a decode step's rows are that chunk, and the
// W * cap rows hold it whatever the counts say.
template <typename IdxT>
RC_DEVICE void prefetch_first_chunk(const ExpertLayoutArgs& a) {
  const int64_t rows = a.rows < kChunkRows ? a.rows : kChunkRows, K = a.topk;
  prefetch_lines_l1(a.ids, rows * K * int64_t(sizeof(IdxT)));
  if (a.weights) prefetch_lines_l1(a.weights, rows * K * dtype_bytes(a.weights_dtype));
  if (a.heap_gen && a.own_x) prefetch_lines_l1(a.recv_src, rows * int64_t(sizeof(int32_t)));
}

// Where received row j's payload and scales are: in x, the rank-layout
// rows, or, where dispatch left them (heap_gen), a peer's in the heap and
// this rank's own in own_x. The sources' rows follow one another in rank
// order. A failed dispatch leaves counts unwritten: its rows are then kept
// within the heap.
struct RowSource {
  const char* row;
  const float* scales;  // none for rows without scales
};
RC_DEVICE RowSource received_row_source(const ExpertLayoutArgs& a, uint64_t heap_gen, int32_t j) {
  const int64_t S = a.scales_per_row, rb = a.row_bytes;
  const char* src = a.x + int64_t(j) * rb;
  const float* scales = a.scales ? a.scales + int64_t(j) * S : nullptr;
  if (a.heap_gen) {
    int s = 0;
    int64_t first = 0;
    while (s + 1 < a.world && j >= first + a.counts[s]) first += a.counts[s++];
    if (s != a.rank) {
      const int64_t i = j - first, cap = a.heap.cap;
      char* heap_row = a.heap.dispatch_row(a.heap_data, heap_gen, s, i < 0 ? 0 : (i < cap ? i : cap - 1));
      src = heap_row;
      if (scales) scales = a.heap.row_scales(heap_row);
    } else if (a.own_x && a.own_tokens > 0) {
      // The token is kept within the input, as the heap row above.
      const int64_t t = int64_t(a.recv_src[j]) - int64_t(a.rank) * a.heap.cap;
      const int64_t tok = t < 0 ? 0 : (t < a.own_tokens ? t : a.own_tokens - 1);
      src = a.own_x + tok * rb;
      if (scales) scales = a.own_scales + tok * S;
    }
  }
  return {src, scales};
}

// Received row j's pairs, by one warp (pair_slots' rule, a lane per slot:
// slot k is lane k % warp size's, of group k / warp size): each lane loads
// its slots' ids and weights at once, and shuffles over the slots in order
// tell each slot whether it starts a pair (no earlier slot names its
// expert), the pair's weight (its slots' weights summed in fp32 in slot
// order from the first) and its place among the row's pairs (the pairs of
// smaller experts come first).
template <int G>
struct RowPairs {
  int32_t expert[G];  // the slot's local expert; -1 for none (-1, past K, or outside [0, E))
  float weight[G];    // the pair's weight, where the slot starts one
  int place[G];
  bool starts[G];
};
template <typename IdxT, int G>
RC_DEVICE RowPairs<G> row_pairs(const ExpertLayoutArgs& a, int32_t j) {
  const int ws = warp_size(), lane = lane_id(), K = int(a.topk);
  const int64_t E = a.experts, w0 = int64_t(j) * K;
  const IdxT* ids = static_cast<const IdxT*>(a.ids) + w0;
  RowPairs<G> p;
  float own[G];  // the slot's own weight, for the later slots of its expert
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int k = g * ws + lane;
    const IdxT id = k < K ? ids[k] : IdxT(-1);
    p.expert[g] = id >= 0 && int64_t(id) < E ? int32_t(id) : -1;
    own[g] = a.weights && k < K ? load_as_float(a.weights, w0 + k, a.weights_dtype) : 0.f;
    p.weight[g] = own[g];
    p.starts[g] = p.expert[g] >= 0;
    p.place[g] = 0;
  }
#pragma unroll
  for (int gi = 0; gi < G; ++gi) {
    const int slots = K - gi * ws < ws ? K - gi * ws : ws;  // the group's slots (none past K)
    // Four slots a step, unrolled by hand: HIP's clang unrolls a loop of
    // shuffles (convergent) only whole, never by a count with a remainder.
#pragma unroll 1
    for (int l0 = 0; l0 < slots; l0 += 4)
#pragma unroll
      for (int li = l0; li < l0 + 4; ++li) {
        if (li >= slots) break;
        const int i = gi * ws + li;
        const int32_t ei = warp_shfl(p.expert[gi], li);
        const float wi = __int_as_float(warp_shfl(__float_as_int(own[gi]), li));
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const int k = g * ws + lane;
          if (p.expert[g] < 0 || ei != p.expert[g]) continue;
          if (i < k) p.starts[g] = false;
          else if (i > k) p.weight[g] += wi;
        }
      }
  }
#pragma unroll
  for (int gi = 0; gi < G; ++gi)
    for (uint64_t m = gi * ws < K ? warp_ballot(p.starts[gi]) : 0; m != 0; m &= m - 1) {
      const int32_t ei = warp_shfl(p.expert[gi], lowest_bit(m));
#pragma unroll
      for (int g = 0; g < G; ++g) p.place[g] += ei < p.expert[g];
    }
  return p;
}

// Received row j's pairs (`p`, by the warp) get their rows: the expert's
// offset, plus its rows in earlier chunks, plus the chunk's earlier rows
// that have it. pair_row[place] gets the row and `kept` its bit, where it
// falls within expert_rows (a prefix: rows grow with the expert, so only
// the last experts' pairs can fall past it; -1 and no bit for the others).
// With `writes`, the warp also writes the row's expert_rows_of (the places'
// rows in order, then -1) and the pairs' weights.
template <int G>
RC_DEVICE void place_pairs(const ExpertLayoutArgs& a, const ExpertTables& t, int32_t j, const RowPairs<G>& p,
                           bool writes, int32_t* pair_row, uint64_t* kept) {
  const int ws = warp_size(), lane = lane_id(), K = int(a.topk);
  const int64_t E = a.experts, w0 = int64_t(j) * K;
  for (int k = lane; k < K; k += ws) pair_row[k] = -1;
  warp_sync();  // every place's -1 is stored before a pair's row overwrites it
  const int64_t c = j / kChunkRows;
  const uint32_t below = (1u << (j % kChunkRows)) - 1u;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (!p.starts[g]) continue;
    const int64_t at = c * E + p.expert[g];
    const int64_t dest = int64_t(t.offsets[p.expert[g]]) + (t.prefix ? t.prefix[at] : 0) + __popc(t.masks[at] & below);
    if (dest >= a.expert_rows) continue;  // dropped, and raised at a later op (out_needed)
    pair_row[p.place[g]] = int32_t(dest);
    if (writes && a.weights) store_from_float(a.out_weights, dest, a.weights_dtype, p.weight[g]);
  }
  warp_sync();  // the pairs' rows are stored before the lanes read them back
  const uint64_t keep = pair_terms(pair_row, K, a.expert_rows);  // the places that got a row
  if (lane == 0) *kept = keep;
  if (writes)
    for (int k = lane; k < K; k += ws) a.out_rows_of[w0 + k] = pair_row[k];
}

// The placement's shared memory, sized by K and E at the launch: a decode
// step's K = 8 over 256 experts takes 6.4 KB where kMaxTopk and
// kExpertOneChunkExperts would take 34 KB, which a 64 KB LDS (gfx942,
// RDNA) holds once a unit. The host (the launch's size) and the kernel
// carve it with the same function; 8-byte items first keep all aligned.
struct PlaceShared {
  int64_t kept, src, one_src, pair_row, one_expert, one_weight, one_pairs, masks, offsets, bytes;
};
RC_HD PlaceShared place_shared(int64_t K, int64_t E) {
  // The one-chunk tables and rows exist where a chunk can be placed alone.
  const int64_t one = expert_one_chunk_capable(E) ? 1 : 0;
  PlaceShared p{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += bytes;
    return here;
  };
  p.kept = take(kBatchRows * int64_t(sizeof(uint64_t)));
  p.src = take(kBatchRows * int64_t(sizeof(RowSource)));
  p.one_src = take(one * kChunkRows * int64_t(sizeof(RowSource)));
  p.pair_row = take(kBatchRows * K * int64_t(sizeof(int32_t)));
  p.one_expert = take(one * kChunkRows * K * int64_t(sizeof(int32_t)));
  p.one_weight = take(one * kChunkRows * K * int64_t(sizeof(float)));
  p.one_pairs = take(one * kChunkRows * int64_t(sizeof(int32_t)));
  p.masks = take(one * E * int64_t(sizeof(uint32_t)));
  p.offsets = take(one * (E + 1) * int64_t(sizeof(int32_t)));
  p.bytes = at;
  return p;
}
static_assert(sizeof(RowSource) % 8 == 0 && alignof(RowSource) <= 8, "the 8-byte items keep the rest aligned");

// One chunk's rows (received <= kChunkRows), each found by a warp before
// any table exists (row_pairs) and kept in shared memory: the pairs'
// experts and weights by place (K a row), their count, and where the row's
// payload is.
struct OneChunkRows {
  int32_t* expert;  // [kChunkRows, K]
  float* weight;    // [kChunkRows, K]
  int32_t* pairs;   // [kChunkRows]
  RowSource* src;   // [kChunkRows]
  int K;
  // Row j's pairs as row_pairs gave them, a pair per slot by place.
  template <int G>
  RC_DEVICE RowPairs<G> of(int32_t j) const {
    const int ws = warp_size();
    RowPairs<G> p;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int k = g * ws + lane_id();
      p.starts[g] = k < pairs[j];
      p.expert[g] = p.starts[g] ? expert[j * K + k] : -1;
      p.weight[g] = p.starts[g] ? weight[j * K + k] : 0.f;
      p.place[g] = k;
    }
    return p;
  }
  // Row j's pairs (`p`, by the warp) set the chunk's masks and are kept.
  template <int G>
  RC_DEVICE void keep(int32_t j, const RowPairs<G>& p, const RowSource& rs, uint32_t* masks) {
    int32_t n = 0;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (p.starts[g]) {
        expert[j * K + p.place[g]] = p.expert[g];
        weight[j * K + p.place[g]] = p.weight[g];
        atomicOr(&masks[p.expert[g]], 1u << j);
      }
      n += __popcll(warp_ballot(p.starts[g]));
    }
    if (lane_id() == 0) {
      pairs[j] = n;
      src[j] = rs;
    }
  }
};

// The block's slices of received row j (from `row`, vectors of V) into L1.
template <typename V>
RC_DEVICE void prefetch_row_share(const ReceivedShare& sh, int32_t j, const char* row) {
  const int32_t first = j * sh.slices;
  const int32_t u0 = first > sh.u0 ? first : sh.u0, u1 = first + sh.slices < sh.u1 ? first + sh.slices : sh.u1;
  if (u0 >= u1) return;
  const int64_t v0 = int64_t(u0 - first) * sh.width, v1 = int64_t(u1 - first) * sh.width;
  const int64_t end = v1 < int64_t(sh.nvec) ? v1 : int64_t(sh.nvec);
  warp_prefetch_lines_l1(row + v0 * int64_t(sizeof(V)), (end - v0) * int64_t(sizeof(V)));
}

// The grid writes expert_rows_of of the rows not received: -1.
RC_DEVICE void place_unreceived(const ExpertLayoutArgs& a, int32_t received) {
  const int K = int(a.topk);
  const int64_t gthread = int64_t(blockIdx.x) * kThreads + threadIdx.x, gthreads = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(received) * K + gthread; i < a.rows * K; i += gthreads) a.out_rows_of[i] = -1;
}

// Padding rows an expert can have: warps of the placement grid that zero one.
RC_DEVICE int64_t padding_warps(const ExpertLayoutArgs& a) { return a.experts * (a.alignment - 1); }

// After the placement, the grid writes the alignment padding rows that fit
// (zeros, their scales and weights too), a warp per row: padding row
// i < alignment - 1 of expert e is warp (e * (alignment - 1) + i) of the
// grid (expert_place_blocks), or a later one in its stride.
template <typename V>
RC_DEVICE void place_padding(const ExpertLayoutArgs& a, const ExpertTables& t, int64_t nvec) {
  const int64_t n = a.expert_rows, S = a.scales_per_row, rb = a.row_bytes;
  const int64_t gthread = int64_t(blockIdx.x) * kThreads + threadIdx.x, gthreads = int64_t(gridDim.x) * kThreads;
  const int ws = warp_size(), lane = lane_id();
  const int64_t pad = a.alignment - 1;
  for (int64_t w = gthread / ws; w < padding_warps(a); w += gthreads / ws) {
    const int64_t e = w / pad;
    const int64_t r = t.offsets[e] + int64_t(t.count(e)) + (w - e * pad), next = t.offsets[e + 1];
    if (r >= next || r >= n) continue;
    V* o = reinterpret_cast<V*>(a.out_x + r * rb);
    for (int64_t v = lane; v < nvec; v += ws) o[v] = V{};
    if (a.out_scales)
      for (int64_t k = lane; k < S; k += ws) a.out_scales[r * S + k] = 0.f;
    if (a.out_weights && lane == 0) store_from_float(a.out_weights, r, a.weights_dtype, 0.f);
  }
}

// Each received row's pairs get their rows (row_pairs, place_pairs); then
// the row is loaded once, from x or where dispatch left it
// (received_row_source), and stored to each of its pair rows (its scales
// too). Then the rows not received (place_unreceived) and the alignment
// padding (place_padding).
//
// One chunk's rows (expert_places_one_chunk) are found before the tables:
// a warp per row finds its pairs, sets the chunk's masks (the tally) and,
// where block_prefetch_covers allows, prefetches the row's slices in the
// block's share into L1 (prefetch_l1: none on HIP), so that after the
// offsets' scan a slice only looks its pairs' rows up.
template <typename IdxT, typename V, int G>
__global__ void __launch_bounds__(kThreads) expert_place_kernel(ExpertLayoutArgs a) {
  // Slice r of the batch: its row's pairs' rows (pair_row + r * K), which
  // of them are kept, and where its payload and scales are; the tables of
  // one chunk (ExpertTables) and its rows (place_shared).
  extern __shared__ uint64_t place_smem[];
  char* const smem = reinterpret_cast<char*>(place_smem);
  const PlaceShared ps = place_shared(a.topk, a.experts);
  uint64_t* const kept = reinterpret_cast<uint64_t*>(smem + ps.kept);
  RowSource* const src = reinterpret_cast<RowSource*>(smem + ps.src);
  int32_t* const pair_row = reinterpret_cast<int32_t*>(smem + ps.pair_row);
  uint32_t* const one_masks = reinterpret_cast<uint32_t*>(smem + ps.masks);
  int32_t* const one_offsets = reinterpret_cast<int32_t*>(smem + ps.offsets);
  OneChunkRows one_rows{reinterpret_cast<int32_t*>(smem + ps.one_expert), reinterpret_cast<float*>(smem + ps.one_weight),
                        reinterpret_cast<int32_t*>(smem + ps.one_pairs), reinterpret_cast<RowSource*>(smem + ps.one_src),
                        int(a.topk)};
  __shared__ int32_t warp_tot[kMaxWarps];
  const int64_t E = a.experts, S = a.scales_per_row, rb = a.row_bytes;
  const int64_t nvec = rb / int64_t(sizeof(V));
  const int nw = kThreads / warp_size(), warp = int(threadIdx.x) / warp_size(), K = int(a.topk);
  // The dispatch before this kernel on the stream stored its generation in
  // the counter at its end; the next dispatch starts after this kernel
  // (the GPU transport launches both in its stream order), and no peer
  // writes this parity of the heap before that dispatch has published.
  __shared__ uint64_t heap_gen_shared;
  if (threadIdx.x == 0) heap_gen_shared = a.heap_gen ? *a.heap_gen : 0;
  prefetch_first_chunk<IdxT>(a);
  const int32_t received = rows_received(a.counts, a.world, a.rows);  // loaded beside the counter
  const ReceivedShare share = received_share(received, rb, uint32_t(nvec));
  const bool one_chunk = expert_places_one_chunk(received, E);  // block-uniform
  if (one_chunk)
    for (int64_t e = threadIdx.x; e < E; e += kThreads) one_masks[e] = 0;
  block_sync();  // one load of the counter (uncached on HIP) per block; the masks are clear
  const uint64_t heap_gen = heap_gen_shared;
  // A grid sized for the capacity has blocks past a decode step's slices
  // and padding rows: they skip the tables, whose chain of loads and
  // barriers costs as much as a copying block's, and would make a second
  // wave of the grid as long as the first. Block 0 stays: it writes the
  // outputs of one chunk's tables. (Block-uniform.)
  if (blockIdx.x > 0 && share.empty() && int64_t(blockIdx.x) * nw >= padding_warps(a)) {
    place_unreceived(a, received);
    return;
  }
  ExpertTables tables{a.out_offsets, a.out_counts, a.chunk_masks, a.chunk_prefix};
  if (one_chunk) {
    const bool prefetches = block_prefetch_covers(int64_t(share.u1 - share.u0) * share.width * int64_t(sizeof(V)));
    for (int32_t j = warp; j < received; j += nw) {
      const RowSource rs = received_row_source(a, heap_gen, j);
      if (prefetches) prefetch_row_share<V>(share, j, rs.row);
      one_rows.keep(j, row_pairs<IdxT, G>(a, j), rs, one_masks);
    }
    block_sync();  // the masks hold every row's pairs
    const bool outputs = blockIdx.x == 0;
    scan_expert_offsets(
        E, int32_t(a.alignment), [&](int64_t e) { return int32_t(__popc(one_masks[e])); },
        [&](int64_t e, int32_t count, int32_t offset) {
          one_offsets[e] = offset;
          if (outputs) {
            a.out_counts[e] = count;
            a.out_offsets[e] = offset;
          }
        },
        [&](int32_t end, int32_t needed) {
          one_offsets[E] = end;
          if (outputs) {
            a.out_offsets[E] = end;
            a.out_needed[0] = needed;
          }
        },
        warp_tot);
    block_sync();  // the offsets are read by every thread
    tables = {one_offsets, nullptr, one_masks, nullptr};
  }
  auto prepare = [&](int r, int32_t j, bool writes) {
    if (one_chunk) {
      if (lane_id() == 0) src[r] = one_rows.src[j];
      place_pairs(a, tables, j, one_rows.of<G>(j), writes, pair_row + r * K, &kept[r]);
    } else {
      if (lane_id() == 0) src[r] = received_row_source(a, heap_gen, j);
      place_pairs(a, tables, j, row_pairs<IdxT, G>(a, j), writes, pair_row + r * K, &kept[r]);
    }
  };
  for_received_rows(share, prepare, [&](int r, int32_t j, const RowSpan& s) {
    auto row_at = [&](int p) { return a.out_x + int64_t(pair_row[r * K + p]) * rb; };
    auto scales_at = [&](int p) { return a.out_scales + int64_t(pair_row[r * K + p]) * S; };
    copy_row_and_scales<V, true>(src[r].row, src[r].scales, src[r].scales ? S : 0, row_at, scales_at, kept[r], s);
  });
  place_unreceived(a, received);
  place_padding<V>(a, tables, nvec);
}

}  // namespace

void launch_expert_layout(const ExpertLayoutArgs& a, Stream s) {
  // Rows in 16-byte vectors where rows and pointers allow it, else bytes.
  const bool v16 = widest_vector(a.row_bytes, {a.x, a.own_x, a.out_x}) == 16;
  // The placement's grid: one wave at most (expert_place_blocks), with its
  // shared memory sized for this K and E (place_shared).
  auto place = [&](auto kernel) {
    const int smem = int(place_shared(a.topk, a.experts).bytes);
    const int blocks = expert_place_blocks(a.rows, a.experts, a.alignment, a.sm_count,
                                           resident_blocks_per_sm(kernel, kThreads, smem));
    RC_LAUNCH(kernel, blocks, kThreads, smem, s, a);
  };
  auto go = [&](auto idx) {
    using IdxT = typename decltype(idx)::type;
    if (expert_tally_launched(a.rows, a.experts))
      RC_LAUNCH(expert_tally_kernel<IdxT>, expert_chunk_blocks(a.rows, a.sm_count), kThreads, 0, s, a);
    auto groups = [&](auto g) {
      constexpr int G = decltype(g)::value;
      if (v16) place(expert_place_kernel<IdxT, uint4, G>);
      else place(expert_place_kernel<IdxT, uint8_t, G>);
    };
    if (slot_groups(a.topk) == 1) groups(std::integral_constant<int, 1>{});
    else groups(std::integral_constant<int, kMaxSlotGroups>{});
  };
  a.ids_int64 ? go(VecTag<int64_t>{}) : go(VecTag<int32_t>{});
}

}  // namespace gpu
}  // namespace rdna4_comm
