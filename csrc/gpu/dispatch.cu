// dispatch: sender block b routes chunk b of this rank's tokens and pushes
// each row to its destinations; receiver blocks take the peers' rows from the
// heap, chunk by chunk, into the fresh outputs (for the expert layout, their
// routing alone: the placement reads the peers' payload in the heap and,
// with own_rows_stay, this rank's in x, the input; expert_layout.cu).
// A rank's own rows skip the heap.
// Then every block writes its share of the padding rows' routing (-1 ids, 0
// weights); the padding rows of x are left unwritten, so the work follows the
// routed rows, not the capacity.
#include "../bounds.h"
#include "../flags.h"
#include "../policies.h"
#include "../routing.h"
#include "device/fp8_rows.cuh"
#include "device/routing.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

struct DispatchShared {
  // Sender: per destination, the rows of the chunks before this block's
  // (prefix) and of those up to its end (chunk_end), the rows below a
  // batch's positions (row_base), the batches' running count (run); each
  // token of a batch: its destinations and its rows' positions; and the
  // rows this rank's lower ranks send it (lower_rows).
  int32_t prefix[kMaxGpuWorld], chunk_end[kMaxGpuWorld], row_base[kMaxGpuWorld], run[kMaxGpuWorld];
  int32_t lower_rows;
  // Aligned: the compiler reads a warp's row in 16-byte loads, which would
  // otherwise take in lower_rows while thread 0 writes it.
  alignas(16) int32_t warp_tot[kMaxWarps][kMaxGpuWorld];
  uint32_t batch_mask[kThreads];
  int32_t batch_pos[kThreads][kMaxGpuWorld];
  Sources src;  // every source's header (receivers; every block before the padding)
  int32_t item_src[kMaxGroup];
  uint32_t item_row_start[kMaxGroup], item_first[kMaxGroup + 1];
};

// What a dispatch row's payload is: x's bytes as they are; FP8 quantised
// from x (fp8.h); or an FP8 pair's bytes and scales (DispatchArgs::x_scales).
enum PayloadMode : int { kRowsAsIs = 0, kQuantizeFp8 = 1, kFp8Pair = 2 };

// Units of a row in the row loops: vectors of V of the row's bytes (an FP8
// row's q bytes; its scales go with the row's lead warp, copy_scales), or,
// where the row is quantised, FP8 lanes (fp8_rows.cuh).
template <int kMode, typename V>
RC_DEVICE uint32_t row_units(const Layout& L) {
  if constexpr (kMode == kQuantizeFp8) return fp8_row_units(L.hidden);
  return uint32_t(L.hidden * (kMode == kRowsAsIs ? L.elt : 1) / int64_t(sizeof(V)));
}

// Bytes of a sender's input row: x's (FP8 pair: its q bytes).
template <int kMode>
RC_DEVICE int64_t input_row_bytes(const DispatchArgs& a, const Layout& L) {
  if constexpr (kMode == kQuantizeFp8) return L.hidden * dtype_bytes(a.x_dtype);
  return kMode == kFp8Pair ? L.hidden : L.hidden * L.elt;
}

// Sender block b's tokens [t0, t1), ep_own_block_tokens of them (none for
// a receiver block). Token indices fit 32 bits (kMaxGpuTokensPerRank): less
// state to keep.
struct TokenRange {
  int32_t t0, t1;
};
RC_DEVICE TokenRange sender_tokens(const DispatchArgs& a, const EpLaunch& lp, int b) {
  const int32_t T = int32_t(a.ntok), C = int32_t(lp.own_block_tokens), t0 = b * C;
  return {t0, t0 + C < T ? t0 + C : T};
}

// What sender block b reads of its inputs first, on its way to L1 while the
// block waits for its generation (a round trip, which the routing's loads
// would otherwise follow): the ids it routes (every token's where it routes
// them all), its chunk's weights, and its chunk's rows where a line per
// thread covers them whole (dispatch_prefetches_chunk: prefetching the start
// of a larger chunk made large dispatches slower on an H200).
// Nothing for a receiver block (its range is empty).
template <typename IdxT, int kMode>
RC_DEVICE void prefetch_sender_inputs(const DispatchArgs& a, const Layout& L, const EpLaunch& lp, int b) {
  const TokenRange range = sender_tokens(a, lp, b);
  const int64_t T = a.ntok, K = L.topk, t0 = range.t0, t1 = range.t1;
  if (t1 <= t0) return;
  const int64_t id_bytes = K * int64_t(sizeof(IdxT)), in_row = input_row_bytes<kMode>(a, L);
  if (dispatch_routes_all_tokens(T)) prefetch_lines_l1(a.topk_idx, T * id_bytes);
  else prefetch_lines_l1(static_cast<const char*>(a.topk_idx) + t0 * id_bytes, (t1 - t0) * id_bytes);
  if (a.topk_weights) {
    const int64_t w_bytes = K * dtype_bytes(a.weights_dtype);
    prefetch_lines_l1(static_cast<const char*>(a.topk_weights) + t0 * w_bytes, (t1 - t0) * w_bytes);
  }
  if (dispatch_prefetches_chunk((t1 - t0) * in_row))
    prefetch_lines_l1(static_cast<const char*>(a.x) + t0 * in_row, (t1 - t0) * in_row);
}

// Routing slots of a row per lane of its lead warp.
constexpr int kSlotsPerLane = (kMaxTopk + kMinWarpSize - 1) / kMinWarpSize;

// Sender block b takes chunk b of this rank's tokens (ep_own_block_tokens
// each) and sends each routed row to its destinations. A chunk's rows for
// destination d follow those of the chunks before it: where the rank's
// tokens fit one block (dispatch_routes_all_tokens), every block routes all
// of them and counts the earlier chunks' rows itself; otherwise it adds up
// the other blocks' tallies (a published count per block and destination).
// False (on every thread) when a wait failed.
template <typename IdxT, int KF, typename V, int kMode>
RC_DEVICE bool dispatch_sender(const Env& env, const DispatchArgs& a, const EpLaunch& lp, DispatchShared& sh,
                               const Round& round, int b) {
  const Layout& L = env.layout;
  const uint64_t gen = round.gen;
  const int me = env.rank, W = env.world, tid = threadIdx.x, nt = kThreads;
  const Routing<IdxT, KF> route{static_cast<const IdxT*>(a.topk_idx), int(L.topk), a.num_experts,
                                lp.experts_per_rank, W};
  const int K = route.topk(), nblocks = lp.send_blocks;
  constexpr bool kFp8 = kMode != kRowsAsIs;
  // Bytes of an input row and of an output row (FP8: one per channel).
  const int64_t H = L.hidden, S = L.fp8_scales, in_row = input_row_bytes<kMode>(a, L);
  const int64_t payload = kFp8 ? H : H * L.elt;
  const int32_t T = int32_t(a.ntok), C = int32_t(lp.own_block_tokens);
  const TokenRange range = sender_tokens(a, lp, b);
  const int32_t t0 = range.t0, t1 = range.t1;
  const uint32_t nvec = row_units<kMode, V>(L);
  const char* x = static_cast<const char*>(a.x);
  char* out_x = static_cast<char*>(a.out_x);
  IdxT* out_idx = static_cast<IdxT*>(a.out_idx);
  // A chunk of one batch keeps its batch in shared memory from the count to
  // the copies. Where every block routes every token, the batch arrays are
  // indexed by token (batch_first: t0) and hold the rows' indices.
  const bool routes_all = dispatch_routes_all_tokens(T), one_batch = t1 - t0 <= nt;
  const int32_t batch_first = routes_all ? t0 : 0;

  // Destinations of the batch of tokens from tb, and the positions of their
  // rows (sh.run: rows of the chunk's batches before it), into sh.batch_*
  // when `keep`.
  auto route_batch = [&](int32_t tb, bool count_pass, bool keep) {
    const int32_t t = tb + tid;
    const uint32_t m = t < t1 ? route.mask(t) : 0u;
    if (count_pass && t < t1) a.out_send_mask[t] = int32_t(m);
    int32_t pos[kMaxGpuWorld];
    batch_positions(m, W, pos, sh.warp_tot, sh.run);
    if (keep) {
      sh.batch_mask[tid] = m;
#pragma unroll
      for (int d = 0; d < kMaxGpuWorld; ++d)
        if (d < W) sh.batch_pos[tid][d] = pos[d];
    }
  };

  if (tid < W) sh.run[tid] = 0;  // read after batch_positions' first barrier
  if (routes_all) {
    // Thread t routes token t; the positions of tokens t0 and t1 bound the
    // chunk, and sh.run ends as every destination's total. The arrays are
    // read after the barrier of the lower ranks' headers (below).
    const uint32_t m = tid < T ? route.mask(tid) : 0u;
    if (tid >= t0 && tid < t1) a.out_send_mask[tid] = int32_t(m);
    int32_t pos[kMaxGpuWorld];
    batch_positions(m, W, pos, sh.warp_tot, sh.run);
    sh.batch_mask[tid] = m;
#pragma unroll
    for (int d = 0; d < kMaxGpuWorld; ++d) {
      if (d >= W) break;
      sh.batch_pos[tid][d] = pos[d];
      if (tid == t0) sh.prefix[d] = pos[d];
      if (tid == t1 && t1 < T) sh.chunk_end[d] = pos[d];
    }
    if (tid < W) {
      sh.row_base[tid] = 0;
      if (t1 == T) sh.chunk_end[tid] = sh.run[tid];
    }
  } else {
    // Count: the chunk's rows per destination.
    for (int32_t tb = t0; tb < t1; tb += nt) route_batch(tb, true, one_batch);
    // Tally: this block's count per destination for the blocks after it (the
    // last block has none), then the sum of the earlier blocks' into
    // sh.prefix. Every block publishes before it waits, and the grid is
    // resident (the launch policy), so the waits end.
    if (tid < W) {
      if (b + 1 < nblocks) store_relaxed_device(L.tally(env.sig[me], b, tid), tally_word(gen, sh.run[tid]));
      sh.prefix[tid] = 0;
    }
    block_sync();
    // Thread i < b reads block i's words; each warp adds up its threads'.
    bool ok = true;
    if (int(threadIdx.x) / warp_size() * warp_size() < b) {
      for (int d = 0; d < W; ++d) {
        uint64_t word = 0;
        const uint64_t* slot = L.tally(env.sig[me], tid, d);
        if (tid < b && ok)
          ok = wait_until(env, round, me, [&] { return tally_gen(word = load_relaxed_device(slot)) >= gen; });
        const int32_t sum = warp_sum(ok ? tally_rows(word) : 0);
        if (lane_id() == 0) atomicAdd(&sh.prefix[d], sum);
      }
    }
    if (!block_all(ok)) return false;
    if (tid < W) {
      sh.row_base[tid] = sh.prefix[tid];
      sh.chunk_end[tid] = sh.prefix[tid] + sh.run[tid];
    }
  }
  // The last chunk's block knows every destination's total: the headers
  // (how many tokens, rows and which chunking each destination is to expect).
  if (b == nblocks - 1 && tid < W) {
    HeadSlot* head = L.dispatch_head(env.sig[tid], gen, me);
    head->ntok = uint32_t(T);
    head->nrows = uint32_t(sh.chunk_end[tid]);
    head->chunk_tokens = uint32_t(C);
    if (tid == me) store_release_device(&head->gen, gen);  // read by this GPU's blocks alone
    else store_release_sys(&head->gen, gen);
  }

  // This rank's own rows skip the heap: they go straight to the output (their
  // routing alone where they stay in x: own_rows_stay), after the rows of
  // every lower rank, whose counts come from their headers:
  // thread s < me reads header s's once it has arrived (`wait`: a bounded
  // wait, else one poll), warp 0 adds them up. True on every thread, with
  // self_base set, when every one had.
  int64_t self_base = 0;
  auto head_of = [&](int s) { return L.dispatch_head(env.sig[me], gen, s); };
  auto lower_rows = [&](bool wait) {
    bool got = true;
    int32_t rows = 0;
    if (tid < me) {
      const uint64_t* flag = &head_of(tid)->gen;
      got = wait ? wait_flag(env, round, flag, tid) : load_acquire_sys(flag) >= gen;
      if (got) rows = int32_t(head_of(tid)->nrows);
    }
    if (tid < warp_size()) {
      rows = warp_sum(rows);
      if (tid == 0) sh.lower_rows = rows;
    }
    const bool all = block_all(got);
    if (all) self_base = sh.lower_rows;
    return all;
  };

  // Row r of the batch from tb (its place `at` in the batch arrays) at
  // destination d: j of the rows this rank sends d; this rank's own are the
  // output's, after the lower ranks' rows.
  auto row_index = [&](uint32_t at, int d) { return int64_t(sh.row_base[d]) + sh.batch_pos[at][d]; };
  auto row_at = [&](uint32_t at, int d) {
    return d == me ? out_x + (self_base + row_index(at, d)) * payload
                   : L.dispatch_row(env.data[d], gen, me, row_index(at, d));
  };
  // Slot k of token tok's routing (e its id, wbits its weight's bits) at
  // every destination in tm: the local id where the slot's expert lives
  // there, else -1 and weight 0; slot 0 also writes the source token.
  auto store_slot = [&](uint32_t at, int64_t tok, uint32_t tm, int k, int64_t e, uint32_t wbits) {
    const int owner = expert_owner(e, a.num_experts, route.epr, W);
    const float w = bits_as_float(wbits, a.weights_dtype);
    for (uint32_t m = tm; m != 0; m &= m - 1) {
      const int d = lowest_bit(m);
      const int64_t id = owner == d ? e - d * route.epr : -1;
      const float wd = owner == d ? w : 0.f;
      if (d == me) {
        const int64_t o = (self_base + row_index(at, d)) * K + k;
        out_idx[o] = IdxT(id);
        if (a.out_weights) store_from_float(a.out_weights, o, a.weights_dtype, wd);
        if (k == 0) a.out_recv_src[self_base + row_index(at, d)] = int32_t(me * L.cap + tok);
      } else {
        char* row = row_at(at, d);
        L.row_ids(row)[k] = int32_t(id);
        L.row_weights(row)[k] = wd;
        if (k == 0) *L.row_token(row) = int32_t(tok);
      }
    }
  };
  auto slot_weight_bits = [&](int64_t tok, int k) {
    return a.topk_weights ? element_bits(a.topk_weights, tok * K + k, a.weights_dtype) : 0u;
  };

  // The chunk's rows for the destinations in `dests`, a batch at a time:
  // each token's row is loaded once and stored to every destination it has
  // among them (but this rank where own_rows_stay), then its routing.
  // The batch arrays are complete here: one batch's were written before a
  // barrier (the lower ranks' headers); the others are routed again here.
  // A batch whose routing fits one warp's lanes (dispatch_routing_warp) has
  // it written by the block's last warp, which takes no share of the copy
  // (with warps of kMinWarpSize lanes; a wider one copies its first lanes'
  // share too). FP8 rows keep the lead warp: their scales go with it.
  auto send = [&](uint32_t dests) {
    if (!one_batch && tid < W) sh.run[tid] = 0;  // read after batch_positions' first barrier
    for (int32_t tb = t0; tb < t1; tb += nt) {
      if (!one_batch) {
        route_batch(tb, false, true);
        block_sync();
      }
      const int32_t batch = t1 - tb < nt ? t1 - tb : nt;
      const bool routing_warp = kMode == kRowsAsIs && dispatch_routing_warp(batch, K);
      auto piece = [&](uint32_t r, const RowSpan& s) {
        const uint32_t at = uint32_t(batch_first) + r;  // the token's place in the batch arrays
        const uint32_t tm = sh.batch_mask[at] & dests;
        if (tm == 0) return;
        const int64_t tok = tb + int32_t(r);
        // The lead warp loads each slot's id and weight once for every
        // destination, before the copy so the loads overlap (the weight as
        // its bits: converting it here would wait).
        int64_t slot_id[kSlotsPerLane];
        uint32_t slot_w[kSlotsPerLane];
#pragma unroll
        for (int i = 0; i < kSlotsPerLane; ++i) {
          const int k = int(s.first + i * s.stride);
          if (!s.lead || k >= K) continue;
          slot_id[i] = int64_t(route.idx[tok * K + k]);
          slot_w[i] = slot_weight_bits(tok, k);
        }
        auto dest_row = [&](int d) { return row_at(at, d); };
        // An FP8 row's scales: the output's own rows or the heap row's.
        auto scales_at = [&](int d) {
          return d == me ? a.out_scales + (self_base + row_index(at, d)) * S : L.row_scales(row_at(at, d));
        };
        // The payload to every destination but this rank where its own rows stay in x.
        const uint32_t pm = a.own_rows_stay ? tm & ~(1u << me) : tm;
        if constexpr (kMode == kQuantizeFp8) {
          quantize_fp8_row(x + tok * in_row, a.x_dtype, H, a.fp8_vectors, dest_row, scales_at, pm, s);
        } else if (pm != 0) {
          copy_row<V, true>(x + tok * in_row, dest_row, pm, s);
          if (kMode == kFp8Pair && s.lead) copy_scales<true>(a.x_scales + tok * S, S, scales_at, pm, s);
        }
        if (!s.lead) return;
#pragma unroll
        for (int i = 0; i < kSlotsPerLane; ++i) {
          const int k = int(s.first + i * s.stride);
          if (k < K) store_slot(at, tok, tm, k, slot_id[i], slot_w[i]);
        }
      };
      if (routing_warp) {
        for_row_pieces(row_pieces<kThreads - kMinWarpSize>(uint32_t(batch), nvec), nvec, piece, false);
        const int l = lane_id();
        if (tid >= nt - warp_size() && l < batch * K) {
          const uint32_t r = uint32_t(l / K), at = uint32_t(batch_first) + r;
          const int k = l - int(r) * K;
          const uint32_t tm = sh.batch_mask[at] & dests;
          const int64_t tok = tb + int32_t(r);
          if (tm != 0) store_slot(at, tok, tm, k, int64_t(route.idx[tok * K + k]), slot_weight_bits(tok, k));
        }
      } else {
        for_row_pieces(uint32_t(batch), nvec, piece);
      }
      block_sync();
    }
  };

  // Headers that have already arrived (a poll, not a wait) let the block
  // send its chunk to every destination in one pass. Otherwise the chunk
  // goes to the peers before the block waits for the headers, and to this
  // rank's output after: no peer waits for the chunk behind this wait, and
  // every rank publishes its headers after waits on its own blocks alone.
  const bool have_base = lower_rows(false);
  send(have_base ? all_ranks(env) : peer_ranks(env));
  if (tid < W && tid != me) {  // the chunk to every peer, empty or not
    ChunkSlot* slot = L.dispatch_chunk(env.sig[tid], gen, me, b);
    slot->row_start = uint32_t(sh.prefix[tid]);
    slot->nrows = uint32_t(sh.chunk_end[tid] - sh.prefix[tid]);
    store_release_sys(&slot->gen, gen);
  }
  if (!have_base) {
    if (!lower_rows(true)) return false;
    send(1u << me);
  }
  return true;
}

// Every source's header, once it has arrived, into sh.src (thread s reads
// the counts of the header it acquired). False on a timeout.
RC_DEVICE bool load_headers(const Env& env, DispatchShared& sh, const Round& round) {
  const Layout& L = env.layout;
  const int me = env.rank;
  return load_sources(env, sh.src, [&](int s, int64_t* ntok, int64_t* nrows, int64_t* chunk_tokens) {
    const HeadSlot* head = L.dispatch_head(env.sig[me], round.gen, s);
    if (!wait_flag(env, round, &head->gen, s)) return false;
    *ntok = head->ntok;
    *nrows = head->nrows;
    *chunk_tokens = head->chunk_tokens;
    return true;
  });
}

// The rows this rank receives in all, where its padding starts, found by
// each warp of a sender block itself (a sender needs no more of the
// headers): lane s < W takes source s's row count from its header (this
// rank's own from sh.run where the block routed every token), and a warp
// sum adds them up, with no block barrier. False, on the whole warp, when a
// wait failed.
RC_DEVICE bool received_rows(const Env& env, const DispatchShared& sh, const Round& round, bool own_known,
                             int32_t* rows) {
  const int s = lane_id();
  bool ok = true;
  int32_t n = 0;
  if (s < env.world) {
    if (own_known && s == env.rank) {
      n = sh.run[s];
    } else {
      const HeadSlot* head = env.layout.dispatch_head(env.sig[env.rank], round.gen, s);
      ok = wait_flag(env, round, &head->gen, s);
      n = ok ? int32_t(head->nrows) : 0;
    }
  }
  *rows = warp_sum(n);
  return warp_ballot(!ok) == 0;
}

// False (on every thread) when a wait failed: sh.src may then be incomplete.
template <typename IdxT, typename V, bool kFp8>
RC_DEVICE bool dispatch_receiver(const Env& env, const DispatchArgs& a, DispatchShared& sh, const Round& round,
                                 int j, int nblocks) {
  const Layout& L = env.layout;
  const uint64_t gen = round.gen;
  const int me = env.rank, W = env.world, tid = threadIdx.x;
  const int64_t H = L.hidden, S = L.fp8_scales, payload = kFp8 ? H : H * L.elt, K = L.topk, cap = L.cap;
  // A received row is its bytes; a row left in the heap (peer_rows_stay) is
  // its routing alone, one row per warp step.
  const uint32_t nvec = a.peer_rows_stay ? 1u : row_units<kFp8 ? kFp8Pair : kRowsAsIs, V>(L);
  char* out_x = static_cast<char*>(a.out_x);
  IdxT* out_idx = static_cast<IdxT*>(a.out_idx);

  if (!load_headers(env, sh, round)) return false;
  if (j == 0 && tid < W) {
    a.out_counts[tid] = sh.src.nrows[tid];
    a.out_src_tokens[tid] = sh.src.ntok[tid];
  }

  const Items plan = source_items(sh.src, W);
  const int64_t items = plan.count;
  const int G = plan.group;
  // This block owns items j, j + nblocks, ...; it takes G of them at a time,
  // their rows as one batch (item_first: each item's first row in it).
  for (int64_t first = j; first < items; first += int64_t(nblocks) * G) {
    bool got = true;
    if (tid < G) {
      const int64_t item = first + int64_t(tid) * nblocks;
      uint32_t nrows = 0;
      if (item < items) {
        int s;
        int64_t c;
        item_to_chunk(item, sh.src.nchunks, W, &s, &c);
        const ChunkSlot* slot = L.dispatch_chunk(env.sig[me], gen, s, c);
        got = wait_flag(env, round, &slot->gen, s);
        sh.item_src[tid] = s;
        sh.item_row_start[tid] = got ? slot->row_start : 0;
        nrows = got ? slot->nrows : 0;
      }
      sh.item_first[tid + 1] = nrows;
    }
    if (!block_all(got)) return false;
    for_item_rows(sh.item_first, G, nvec, [&](int g, int64_t row_in_item, const RowSpan& rs) {
      const int s = sh.item_src[g];
      const int64_t hr = sh.item_row_start[g] + row_in_item;  // the source's row
      const int64_t o = sh.src.offset[s] + hr;                // its output row
      char* row = L.dispatch_row(env.data[me], gen, s, hr);
      if (!a.peer_rows_stay) {
        auto out_row = [&](int) { return out_x + o * payload; };
        copy_row<V, false>(row, out_row, 1u, rs);
        if (kFp8 && rs.lead)
          copy_scales<false>(L.row_scales(row), S, [&](int) { return a.out_scales + o * S; }, 1u, rs);
      }
      if (!rs.lead) return;
      for (int k = int(rs.first); k < K; k += int(rs.stride)) {
        out_idx[o * K + k] = IdxT(L.row_ids(row)[k]);
        if (a.out_weights) store_from_float(a.out_weights, o * K + k, a.weights_dtype, L.row_weights(row)[k]);
      }
      if (rs.first == 0) a.out_recv_src[o] = int32_t(s * cap + *L.row_token(row));
    });
    block_sync();
  }
  return true;
}

// Padding rows [pad0, W*cap), pad0 the rows received, a block's worth of
// elements at a time over the grid (a contiguous share per block takes a
// division by the grid's size, a long instruction sequence, on every
// call): -1 ids, 0 weights, -1 source. Their x is not written (unspecified).
template <typename IdxT>
RC_DEVICE void dispatch_padding(const Env& env, const DispatchArgs& a, int32_t pad0) {
  // 32-bit: W * cap * K < 2^27 (kMaxGpuWorld, kMaxGpuTokensPerRank, kMaxTopk).
  const int32_t K = int32_t(env.layout.topk), rows = env.world * int32_t(env.layout.cap);
  const int32_t step = int32_t(gridDim.x) * kThreads, first = int32_t(blockIdx.x) * kThreads + int32_t(threadIdx.x);
  IdxT* out_idx = static_cast<IdxT*>(a.out_idx);
  for (int32_t i = pad0 * K + first; i < rows * K; i += step) {
    out_idx[i] = IdxT(-1);
    if (a.out_weights) store_from_float(a.out_weights, i, a.weights_dtype, 0.f);
  }
  for (int32_t r = pad0 + first; r < rows; r += step) a.out_recv_src[r] = -1;
}

// One kernel per (id type, top-k fast path, row vector, payload mode): each
// holds the registers of its own loops only.
template <typename IdxT, int KF, typename V, int kMode>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(Env env, DispatchArgs a, EpLaunch lp) {
  __shared__ DispatchShared sh;
  prefetch_sender_inputs<IdxT, kMode>(a, env.layout, lp, blockIdx.x);
  const Round round = begin_round(env, kOpDispatch, a.call);
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.out_dispatch_round = int64_t(round_number(env));
  // The padding's start, known once the headers have arrived: they usually
  // have by now; a late peer keeps the block waiting (bounded like every
  // wait), and after a failed wait it does not pad. The verdicts come from
  // shared memory or the warp: polling the host-mapped error word here, on
  // every thread, cost each warp a PCIe read (about 1 us, serialised: 1 ms
  // per launch of 64 blocks on an H200).
  int32_t pad0 = 0;
  bool have_headers;
  if (int(blockIdx.x) < lp.send_blocks) {
    have_headers = dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, round, blockIdx.x) &&
                   received_rows(env, sh, round, dispatch_routes_all_tokens(a.ntok), &pad0);
  } else {
    have_headers = dispatch_receiver<IdxT, V, kMode != kRowsAsIs>(env, a, sh, round, blockIdx.x - lp.send_blocks,
                                                                 gridDim.x - lp.send_blocks);
    pad0 = sh.src.offset[env.world];
  }
  if (have_headers) dispatch_padding<IdxT>(env, a, pad0);
  finish_op(env, kOpDispatch, round.gen);
}

}  // namespace

void launch_dispatch(const Env& env, const DispatchArgs& a, Stream s) {
  const EpGrid g = dispatch_grid(a.ntok, env.world, env.sm_count);
  const EpLaunch lp{ep_own_block_tokens(a.ntok, env.world, env.sm_count), a.num_experts / env.world, g.send_blocks,
                    row_vector(env.layout.hidden * env.layout.elt, {a.x, a.out_x})};
  const int blocks = g.send_blocks + g.recv_blocks;
  auto go = [&](auto kernel) { launch("dispatch", kernel, blocks, s, env, a, lp); };
  if (env.layout.fp8_scales > 0) {
    // FP8 rows: the generic top-k loop, one kernel per input form. Rows that
    // are FP8 already (a pair's in the sender, every row in the receivers)
    // move in 16-byte vectors where H and the pointers they touch allow it,
    // else byte by byte; rows quantised in the sender have their own lanes.
    const bool pair = a.fp8_pair;
    const bool v16 = pair ? widest_vector(env.layout.hidden, {a.x, a.out_x}) == 16
                          : widest_vector(env.layout.hidden, {a.out_x}) == 16;
    auto fp8 = [&](auto idx) {
      using IdxT = typename decltype(idx)::type;
      if (pair) v16 ? go(dispatch_kernel<IdxT, 0, uint4, kFp8Pair>) : go(dispatch_kernel<IdxT, 0, uint8_t, kFp8Pair>);
      else v16 ? go(dispatch_kernel<IdxT, 0, uint4, kQuantizeFp8>) : go(dispatch_kernel<IdxT, 0, uint8_t, kQuantizeFp8>);
    };
    a.idx_is_int64 ? fp8(VecTag<int64_t>{}) : fp8(VecTag<int32_t>{});
    return;
  }
  // A row vector of 16 bytes where rows and pointers allow it, else 2-byte pieces.
  const bool v16 = lp.vec == 16, k8 = env.layout.topk == 8;
  if (a.idx_is_int64) {
    if (k8) v16 ? go(dispatch_kernel<int64_t, 8, uint4, kRowsAsIs>) : go(dispatch_kernel<int64_t, 8, uint16_t, kRowsAsIs>);
    else v16 ? go(dispatch_kernel<int64_t, 0, uint4, kRowsAsIs>) : go(dispatch_kernel<int64_t, 0, uint16_t, kRowsAsIs>);
  } else {
    if (k8) v16 ? go(dispatch_kernel<int32_t, 8, uint4, kRowsAsIs>) : go(dispatch_kernel<int32_t, 8, uint16_t, kRowsAsIs>);
    else v16 ? go(dispatch_kernel<int32_t, 0, uint4, kRowsAsIs>) : go(dispatch_kernel<int32_t, 0, uint16_t, kRowsAsIs>);
  }
}

}  // namespace gpu
}  // namespace rdna4_comm
