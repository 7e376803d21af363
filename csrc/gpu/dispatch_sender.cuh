// dispatch's sender blocks (dispatch.cu): block b routes chunk b of this
// rank's tokens and pushes each routed row to its destinations, this rank's
// own rows straight to the output. Also the block's shared state, which the
// receiver blocks use too.
#pragma once

#include "../bounds.h"
#include "../flags.h"
#include "../policies.h"
#include "../routing.h"
#include "device/fp8_rows.cuh"
#include "device/routing.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {

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

// Units of a row in the row loops: vectors of RowVector of the row's bytes
// (an FP8 row's q bytes; its scales go with the row's lead warp,
// copy_row_and_scales), or, where the row is quantised, FP8 lanes (fp8_rows.cuh).
template <int kMode, typename RowVector>
RC_DEVICE uint32_t row_units(const Layout& layout, DType x_dtype) {
  if constexpr (kMode == kQuantizeFp8) return fp8_row_units(layout.hidden, x_dtype);
  return uint32_t(layout.hidden * (kMode == kRowsAsIs ? layout.elt : 1) / int64_t(sizeof(RowVector)));
}

// Bytes of a sender's input row: x's (FP8 pair: its q bytes).
template <int kMode>
RC_DEVICE int64_t input_row_bytes(const DispatchArgs& args, const Layout& layout) {
  if constexpr (kMode == kQuantizeFp8) return layout.hidden * dtype_bytes(args.x_dtype);
  return kMode == kFp8Pair ? layout.hidden : layout.hidden * layout.elt;
}

// Sender block b's tokens [t0, t1), ep_own_block_tokens of them (none for
// a receiver block). Token indices fit 32 bits (kMaxGpuTokensPerRank): less
// state to keep.
struct TokenRange {
  int32_t t0, t1;
};
RC_DEVICE TokenRange sender_tokens(const DispatchArgs& args, const EpLaunch& launch, int b) {
  const int32_t T = int32_t(args.ntok), C = int32_t(launch.own_block_tokens), t0 = b * C;
  return {t0, t0 + C < T ? t0 + C : T};
}

// Routing slots of a row per lane of its lead warp.
constexpr int kSlotsPerLane = (kMaxTopk + kMinWarpSize - 1) / kMinWarpSize;

// A sender block's chunk of tokens and where its rows go, from the routing
// to the last row. kFastTopk: the top-k of the routing's fast path (0:
// none); RowVector: the row loops' vector (row_units).
template <typename IdxT, int kFastTopk, typename RowVector, int kMode>
struct DispatchSender {
  const Env& env;
  const DispatchArgs& args;
  DispatchShared& shared;
  const Round& round;
  const Layout& layout;
  const uint64_t gen;
  const int me, world, tid;
  const Routing<IdxT, kFastTopk> route;
  const int topk, send_blocks, block;
  // Bytes of an input row and of an output row (FP8: one per channel).
  const int64_t hidden, scales_per_row, in_row_bytes, out_row_bytes;
  const int32_t ntok, chunk_tokens;
  const TokenRange tokens;  // the chunk's (sender_tokens)
  const uint32_t units_per_row;
  const char* x;
  char* out_x;
  IdxT* out_idx;
  // A chunk of one batch keeps its batch in shared memory from the count to
  // the copies. Where every block routes every token, the batch arrays are
  // indexed by token (batch_first: the chunk's first token) and hold the
  // rows' indices.
  const bool routes_all, one_batch;
  const int32_t batch_first;
  // This rank's own rows in its output follow the rows of every lower rank:
  // their count, once find_own_base has it.
  int64_t own_base = 0;

  RC_DEVICE DispatchSender(const Env& env, const DispatchArgs& args, const EpLaunch& launch, DispatchShared& shared,
                           const Round& round, int block)
      : env(env),
        args(args),
        shared(shared),
        round(round),
        layout(env.layout),
        gen(round.gen),
        me(env.rank),
        world(env.world),
        tid(threadIdx.x),
        route{static_cast<const IdxT*>(args.topk_idx), int(layout.topk), args.num_experts, launch.experts_per_rank,
              world},
        topk(route.topk()),
        send_blocks(launch.send_blocks),
        block(block),
        hidden(layout.hidden),
        scales_per_row(layout.fp8_scales),
        in_row_bytes(input_row_bytes<kMode>(args, layout)),
        out_row_bytes(kMode != kRowsAsIs ? hidden : hidden * layout.elt),
        ntok(int32_t(args.ntok)),
        chunk_tokens(int32_t(launch.own_block_tokens)),
        tokens(sender_tokens(args, launch, block)),
        units_per_row(row_units<kMode, RowVector>(layout, args.x_dtype)),
        x(static_cast<const char*>(args.x)),
        out_x(static_cast<char*>(args.out_x)),
        out_idx(static_cast<IdxT*>(args.out_idx)),
        routes_all(dispatch_routes_all_tokens(ntok)),
        one_batch(tokens.t1 - tokens.t0 <= kThreads),
        batch_first(routes_all ? tokens.t0 : 0) {}

  // The running counts of a pass of route_batch start at zero: batch_positions
  // reads them after its first barrier.
  RC_DEVICE void restart_batches() {
    if (tid < world) shared.run[tid] = 0;
  }

  // Destinations of the batch of tokens from tb, and the positions of their
  // rows (shared.run: rows of the chunk's batches before it), into
  // shared.batch_* when `keep`; the count pass also stores send_mask.
  RC_DEVICE void route_batch(int32_t tb, bool count_pass, bool keep) {
    const int32_t t = tb + tid;
    const uint32_t m = t < tokens.t1 ? route.mask(t) : 0u;
    if (count_pass && t < tokens.t1) args.out_send_mask[t] = int32_t(m);
    int32_t pos[kMaxGpuWorld];
    batch_positions(m, world, pos, shared.warp_tot, shared.run);
    if (keep) {
      shared.batch_mask[tid] = m;
#pragma unroll
      for (int d = 0; d < kMaxGpuWorld; ++d)
        if (d < world) shared.batch_pos[tid][d] = pos[d];
    }
  }

  // Where the rank's tokens fit one block: thread t routes token t; the
  // positions of the chunk's first token and of the one after it bound the
  // chunk, and shared.run ends as every destination's total.
  RC_DEVICE void route_every_token() {
    const uint32_t m = tid < ntok ? route.mask(tid) : 0u;
    if (tid >= tokens.t0 && tid < tokens.t1) args.out_send_mask[tid] = int32_t(m);
    int32_t pos[kMaxGpuWorld];
    batch_positions(m, world, pos, shared.warp_tot, shared.run);
    shared.batch_mask[tid] = m;
#pragma unroll
    for (int d = 0; d < kMaxGpuWorld; ++d) {
      if (d >= world) break;
      shared.batch_pos[tid][d] = pos[d];
      if (tid == tokens.t0) shared.prefix[d] = pos[d];
      if (tid == tokens.t1 && tokens.t1 < ntok) shared.chunk_end[d] = pos[d];
    }
    if (tid < world) {
      shared.row_base[tid] = 0;
      if (tokens.t1 == ntok) shared.chunk_end[tid] = shared.run[tid];
    }
  }

  // Otherwise the block counts its chunk's rows per destination and
  // publishes that tally for the blocks after it (the last block has none),
  // then adds up the earlier blocks' tallies into shared.prefix. Every block
  // publishes before it waits, and the grid is resident (the launch policy),
  // so the waits end. False (on every thread) when a wait failed.
  RC_DEVICE bool tally_chunks() {
    for (int32_t tb = tokens.t0; tb < tokens.t1; tb += kThreads) route_batch(tb, true, one_batch);
    if (tid < world) {
      if (block + 1 < send_blocks)
        store_relaxed_device(layout.tally(env.sig[me], block, tid), tally_word(gen, shared.run[tid]));
      shared.prefix[tid] = 0;
    }
    block_sync();
    // Thread i < block reads block i's words; each warp adds up its threads'.
    bool ok = true;
    if (int(threadIdx.x) / warp_size() * warp_size() < block) {
      for (int d = 0; d < world; ++d) {
        uint64_t word = 0;
        const uint64_t* slot = layout.tally(env.sig[me], tid, d);
        if (tid < block && ok)
          ok = wait_until(env, round, me, [&] { return tally_gen(word = load_relaxed_device(slot)) >= gen; });
        const int32_t sum = warp_sum(ok ? tally_rows(word) : 0);
        if (lane_id() == 0) atomicAdd(&shared.prefix[d], sum);
      }
    }
    if (!block_all(ok)) return false;
    if (tid < world) {
      shared.row_base[tid] = shared.prefix[tid];
      shared.chunk_end[tid] = shared.prefix[tid] + shared.run[tid];
    }
    return true;
  }

  // The last chunk's block knows every destination's total: the headers
  // (how many tokens, rows and which chunking each destination is to expect).
  RC_DEVICE void publish_headers() {
    if (block != send_blocks - 1 || tid >= world) return;
    HeadSlot* head = layout.dispatch_head(env.sig[tid], gen, me);
    head->ntok = uint32_t(ntok);
    head->nrows = uint32_t(shared.chunk_end[tid]);
    head->chunk_tokens = uint32_t(chunk_tokens);
    if (tid == me) store_release_device(&head->gen, gen);  // read by this GPU's blocks alone
    else store_release_sys(&head->gen, gen);
  }

  // own_base, from the lower ranks' headers: thread s < me reads header s's
  // count once it has arrived (`wait`: a bounded wait, else one poll), warp
  // 0 adds them up. True on every thread, with own_base set, when every one
  // had.
  RC_DEVICE bool find_own_base(bool wait) {
    bool got = true;
    int32_t rows = 0;
    if (tid < me) {
      const HeadSlot* head = layout.dispatch_head(env.sig[me], gen, tid);
      got = wait ? wait_flag(env, round, &head->gen, tid) : load_acquire_sys(&head->gen) >= gen;
      if (got) rows = int32_t(head->nrows);
    }
    if (tid < warp_size()) {
      rows = warp_sum(rows);
      if (tid == 0) shared.lower_rows = rows;
    }
    const bool all = block_all(got);
    if (all) own_base = shared.lower_rows;
    return all;
  }

  // The row of the token at `at` in the batch arrays at destination d: j of
  // the rows this rank sends d; this rank's own are the output's, after the
  // lower ranks' rows.
  RC_DEVICE int64_t row_index(uint32_t at, int d) const {
    return int64_t(shared.row_base[d]) + shared.batch_pos[at][d];
  }
  RC_DEVICE char* dest_row(uint32_t at, int d) const {
    return d == me ? out_x + (own_base + row_index(at, d)) * out_row_bytes
                   : layout.dispatch_row(env.data[d], gen, me, row_index(at, d));
  }
  // An FP8 row's scales: the output's own rows or the heap row's.
  RC_DEVICE float* dest_scales(uint32_t at, int d) const {
    return d == me ? args.out_scales + (own_base + row_index(at, d)) * scales_per_row
                   : layout.row_scales(dest_row(at, d));
  }

  // The bits of slot k's weight of token tok (0 without weights).
  RC_DEVICE uint32_t weight_bits(int64_t tok, int k) const {
    return args.topk_weights ? element_bits(args.topk_weights, tok * topk + k, args.weights_dtype) : 0u;
  }

  // Slot k of token tok's routing (expert its id, wbits its weight's bits)
  // at every destination in token_dests: the local id where the slot's
  // expert lives there, else -1 and weight 0; slot 0 also writes the
  // source token.
  RC_DEVICE void store_slot(uint32_t at, int64_t tok, uint32_t token_dests, int k, int64_t expert,
                            uint32_t wbits) const {
    const int owner = expert_owner(expert, args.num_experts, route.epr, world);
    const float w = bits_as_float(wbits, args.weights_dtype);
    for (uint32_t m = token_dests; m != 0; m &= m - 1) {
      const int d = lowest_bit(m);
      const int64_t id = owner == d ? expert - d * route.epr : -1;
      const float wd = owner == d ? w : 0.f;
      if (d == me) {
        const int64_t o = (own_base + row_index(at, d)) * topk + k;
        out_idx[o] = IdxT(id);
        if (args.out_weights) store_from_float(args.out_weights, o, args.weights_dtype, wd);
        if (k == 0) args.out_recv_src[own_base + row_index(at, d)] = int32_t(me * layout.cap + tok);
      } else {
        char* row = dest_row(at, d);
        layout.row_ids(row)[k] = int32_t(id);
        layout.row_weights(row)[k] = wd;
        if (k == 0) *layout.row_token(row) = int32_t(tok);
      }
    }
  }

  // Span s of row r of the batch from tb, to its destinations among
  // `dests`: the payload (but to this rank where own_rows_stay), then, by
  // the row's lead warp, its routing slots.
  RC_DEVICE void send_row(int32_t tb, uint32_t dests, uint32_t r, const RowSpan& s) const {
    const uint32_t at = uint32_t(batch_first) + r;  // the token's place in the batch arrays
    const uint32_t token_dests = shared.batch_mask[at] & dests;
    if (token_dests == 0) return;
    const int64_t tok = tb + int32_t(r);
    // The lead warp loads each slot's id and weight once for every
    // destination, before the copy so the loads overlap (the weight as its
    // bits: converting it here would wait).
    int64_t slot_id[kSlotsPerLane];
    uint32_t slot_w[kSlotsPerLane];
#pragma unroll
    for (int i = 0; i < kSlotsPerLane; ++i) {
      const int k = int(s.first + i * s.stride);
      if (!s.lead || k >= topk) continue;
      slot_id[i] = int64_t(route.idx[tok * topk + k]);
      slot_w[i] = weight_bits(tok, k);
    }
    auto row_of = [&](int d) { return dest_row(at, d); };
    auto scales_of = [&](int d) { return dest_scales(at, d); };
    const uint32_t payload_dests = args.own_rows_stay ? token_dests & ~(1u << me) : token_dests;
    if (payload_dests != 0) {
      if constexpr (kMode == kQuantizeFp8)
        quantize_fp8_row(x + tok * in_row_bytes, args.x_dtype, hidden, args.fp8_vectors, row_of, scales_of,
                         payload_dests, s);
      else if constexpr (kMode == kFp8Pair)
        copy_row_and_scales<RowVector, true>(x + tok * in_row_bytes, args.x_scales + tok * scales_per_row,
                                             scales_per_row, row_of, scales_of, payload_dests, s);
      else copy_row<RowVector, true>(x + tok * in_row_bytes, row_of, payload_dests, s);
    }
    if (!s.lead) return;
#pragma unroll
    for (int i = 0; i < kSlotsPerLane; ++i) {
      const int k = int(s.first + i * s.stride);
      if (k < topk) store_slot(at, tok, token_dests, k, slot_id[i], slot_w[i]);
    }
  }

  // The routing of a batch of `batch` tokens from tb, a slot per lane of the
  // block's last warp (dispatch_routing_warp).
  RC_DEVICE void send_batch_routing(int32_t tb, int32_t batch, uint32_t dests) const {
    const int l = lane_id();
    if (tid < kThreads - warp_size() || l >= batch * topk) return;
    const uint32_t r = uint32_t(l / topk), at = uint32_t(batch_first) + r;
    const int k = l - int(r) * topk;
    const uint32_t token_dests = shared.batch_mask[at] & dests;
    const int64_t tok = tb + int32_t(r);
    if (token_dests != 0)
      store_slot(at, tok, token_dests, k, int64_t(route.idx[tok * topk + k]), weight_bits(tok, k));
  }

  // The chunk's rows for the destinations in `dests`, a batch at a time:
  // each token's row is loaded once and stored to every destination it has
  // among them (but this rank where own_rows_stay), then its routing.
  // The batch arrays are complete here: one batch's were written before a
  // barrier (find_own_base's, over the lower ranks' headers); the others are
  // routed again here.
  // A batch whose routing fits one warp's lanes (dispatch_routing_warp) has
  // it written by the block's last warp, which takes no share of the copy
  // (with warps of kMinWarpSize lanes; a wider one copies its first lanes'
  // share too). FP8 rows keep the lead warp: their scales go with it.
  RC_DEVICE void send_rows(uint32_t dests) {
    if (!one_batch) restart_batches();
    for (int32_t tb = tokens.t0; tb < tokens.t1; tb += kThreads) {
      if (!one_batch) {
        route_batch(tb, false, true);
        block_sync();
      }
      const int32_t batch = tokens.t1 - tb < kThreads ? tokens.t1 - tb : kThreads;
      const bool routing_warp = kMode == kRowsAsIs && dispatch_routing_warp(batch, topk);
      auto row = [&](uint32_t r, const RowSpan& s) RC_INLINE_LAMBDA { send_row(tb, dests, r, s); };
      if (routing_warp) {
        for_row_pieces(row_pieces<kThreads - kMinWarpSize>(uint32_t(batch), units_per_row), units_per_row, row, false);
        send_batch_routing(tb, batch, dests);
      } else {
        for_row_pieces(uint32_t(batch), units_per_row, row);
      }
      block_sync();
    }
  }

  // The chunk's rows and place to every peer, empty or not.
  RC_DEVICE void publish_chunk() const {
    if (tid >= world || tid == me) return;
    ChunkSlot* slot = layout.dispatch_chunk(env.sig[tid], gen, me, block);
    slot->row_start = uint32_t(shared.prefix[tid]);
    slot->nrows = uint32_t(shared.chunk_end[tid] - shared.prefix[tid]);
    store_release_sys(&slot->gen, gen);
  }
};

// Sender block b takes chunk b of this rank's tokens (ep_own_block_tokens
// each) and sends each routed row to its destinations. A chunk's rows for
// destination d follow those of the chunks before it: where the rank's
// tokens fit one block (dispatch_routes_all_tokens), every block routes all
// of them and counts the earlier chunks' rows itself; otherwise it adds up
// the other blocks' tallies (a published count per block and destination).
// False (on every thread) when a wait failed.
template <typename IdxT, int kFastTopk, typename RowVector, int kMode>
RC_DEVICE bool dispatch_sender(const Env& env, const DispatchArgs& args, const EpLaunch& launch, DispatchShared& shared,
                               const Round& round, int b) {
  DispatchSender<IdxT, kFastTopk, RowVector, kMode> sender(env, args, launch, shared, round, b);
  sender.restart_batches();
  if (sender.routes_all) sender.route_every_token();
  else if (!sender.tally_chunks()) return false;
  sender.publish_headers();
  // Headers that have already arrived (a poll, not a wait) let the block
  // send its chunk to every destination in one pass. Otherwise the chunk
  // goes to the peers before the block waits for the headers, and to this
  // rank's output after: no peer waits for the chunk behind this wait, and
  // every rank publishes its headers after waits on its own blocks alone.
  const bool have_base = sender.find_own_base(false);
  sender.send_rows(have_base ? all_ranks(env) : peer_ranks(env));
  sender.publish_chunk();
  if (!have_base) {
    if (!sender.find_own_base(true)) return false;
    sender.send_rows(1u << env.rank);
  }
  return true;
}

}  // namespace gpu
}  // namespace rdna4_comm
