// The launch and algorithm policies: how dispatch and combine chunk a
// rank's tokens, which algorithm all_reduce and all_reduce_rmsnorm run and
// how they cut their work into pieces, and the grid of every GPU launch.
// Plain C++ for every transport and the kernels (qualifiers.h);
// tests/test_policy.py checks them through rdna4_comm._C.testing.
#pragma once

#include <cstdint>

#include "bounds.h"
#include "qualifiers.h"

namespace rdna4_comm {

// Token chunking for dispatch/combine. A chunk is the unit of publication:
// its rows travel together and one flag announces them. A chunking is a
// chunk size: chunks of C tokens, the last one shorter, at least one chunk
// (T = 0 still publishes one, empty). combine chunks a rank's tokens with
// ep_chunk_tokens, from the token count alone, so the peers returning rows
// need nothing but that count; a dispatch source says its chunk size in its
// header (the CPU transport's is ep_chunk_tokens, the GPU's one chunk per
// sender block: ep_own_block_tokens).
constexpr int64_t kEpTargetChunks = 128;
RC_HD int64_t ep_chunks(int64_t ntok, int64_t chunk_tokens) {
  const int64_t n = ceil_div(ntok, chunk_tokens);
  return n < 1 ? 1 : n;
}
RC_HD int64_t ep_chunk_tokens(int64_t ntok) {
  int64_t c = ceil_div(ntok, kEpTargetChunks);
  return c < 1 ? 1 : c;
}
RC_HD int64_t ep_num_chunks(int64_t ntok) { return ep_chunks(ntok, ep_chunk_tokens(ntok)); }
// The most chunks a source of T <= cap tokens publishes, with either
// chunking: min(cap, 128). (Not ep_num_chunks(cap), which is not monotone:
// 200 tokens make 100 chunks of 2, 257 tokens 86 chunks of 3.)
RC_HD int64_t ep_max_chunks(int64_t cap) { return cap < kEpTargetChunks ? (cap < 1 ? 1 : cap) : kEpTargetChunks; }

// Threads of every GPU block (the kernels' kThreads): the policies below
// that depend on what one block does at once take it from here.
constexpr int kGpuBlockThreads = 512;

// Dispatch senders: where a rank's tokens fit one block, one thread each,
// every sender block routes all of them (T x K ids, one load round) and
// finds its own rows' positions itself; otherwise a block routes its own
// range and adds up the earlier blocks' published counts (the tally), one
// round more. Both give every row the same position.
RC_HD bool dispatch_routes_all_tokens(int64_t ntok) { return ntok <= kGpuBlockThreads; }

// A block prefetches rows into L1 ahead of its copies (dispatch's senders
// their chunk of input rows, the expert placement its share of the
// received rows) only where their bytes are at most as many lines of
// kPrefetchLineBytes as the block has threads (csrc/gpu/dispatch.cu says why).
constexpr int64_t kPrefetchLineBytes = 128;
RC_HD bool block_prefetch_covers(int64_t bytes) { return bytes <= int64_t(kGpuBlockThreads) * kPrefetchLineBytes; }

// The EP kernels' row loops keep 8 vectors a lane in flight; a span of at
// most kGpuShortUnroll vectors a lane (a small batch's rows) takes a loop
// unrolled that far instead, which issues a fraction of the code (at T = 8
// every warp of a block runs the loop body once, and the body is what the
// warps wait for). A copy picks its loop per span (csrc/gpu/device/rows.cuh);
// combine's receivers sum with one loop per kernel, the short one where no
// lane of a launch can have more (combine_sums_short), or always where the
// kernel also sums an expert layout's pair rows: both loops in one kernel
// spill its registers. A receiver block sums at most block_tokens
// rows of row_vectors vectors at once, a block's share of them a lane.
constexpr int kGpuShortUnroll = 2;
RC_HD bool combine_sums_short(int64_t block_tokens, int64_t row_vectors) {
  return ceil_div(block_tokens * row_vectors, kGpuBlockThreads) <= kGpuShortUnroll;
}

// Dispatch senders write a batch's routing (each row's K slots: ids,
// weights, the source token) with one lane a slot where the lanes of one
// warp hold them all: the block's last warp does, and takes no share of the
// batch's copy, so the routing runs beside the copy instead of after a
// lead warp's share of it (at T = 8 about 0.3 us of a dispatch on an H200).
// A larger batch leaves each row's routing to the warp whose share of the
// copy starts the row. kGpuRoutingLanes: the narrowest warp we build for (32
// lanes on NVIDIA and RDNA; CDNA's 64).
constexpr int kGpuRoutingLanes = 32;
RC_HD bool dispatch_routing_warp(int64_t batch_rows, int64_t topk) { return batch_rows * topk <= kGpuRoutingLanes; }

// all_reduce algorithm predicate. One-shot: every rank pushes its whole
// input to every peer and sums locally (one barrier, (W-1)*N bytes out per
// rank). Two-shot: reduce-scatter then all-gather (two barriers,
// 2*(W-1)/W*N bytes out per rank). One-shot wins while latency dominates.
// At W = 2 both move the same bytes. The GPU threshold for W > 2 is an
// estimate no measurement backs; the CPU one keeps memcpy traffic down for
// W > 2 beyond a few pages.
constexpr int64_t kCpuOneShotMaxBytes = int64_t(64) << 10;
constexpr int64_t kGpuOneShotMaxBytes = int64_t(512) << 10;
// The largest all_reduce that takes one-shot beyond 2 ranks.
RC_HD int64_t allreduce_one_shot_max_bytes(bool gpu) { return gpu ? kGpuOneShotMaxBytes : kCpuOneShotMaxBytes; }
RC_HD bool allreduce_use_one_shot(int64_t nbytes, int world, bool gpu) {
  if (world <= 2) return true;  // same link bytes either way; one barrier fewer
  return nbytes <= allreduce_one_shot_max_bytes(gpu);
}

// Elements per all_reduce chunk, larger tensors being processed chunk by
// chunk: one-shot sends a peer the whole chunk, so it fills one slot;
// two-shot sends each owner its share, so every share fills at most one.
RC_HD int64_t allreduce_chunk_elems(int64_t slot_bytes, int64_t elt, int world, bool one_shot) {
  return (one_shot ? 1 : world) * (slot_bytes / elt);
}

// Two-shot all_reduce of an n-element chunk: rank o owns elements
// [o*q, min((o+1)*q, n)), q rounded up to whole 16-byte vectors so every
// share starts aligned. q * elt never exceeds a slot when n <= W * slot / elt.
RC_HD int64_t allreduce_share(int64_t n, int world, int64_t elt) {
  const int64_t per_vec = 16 / elt;
  return ceil_div(ceil_div(n, world), per_vec) * per_vec;
}
// Where rank o's share of an n-element chunk lies. One-shot: the whole chunk,
// which every rank reduces. Two-shot: q = allreduce_share elements from o * q,
// shorter or empty for the last ranks.
struct AllReduceShares {
  int64_t n, q;
  bool one_shot;
  RC_HD int64_t begin(int o) const { return one_shot ? 0 : o * q; }
  RC_HD int64_t size(int o) const {
    const int64_t s = n - begin(o);
    return s < 0 ? 0 : (s < q ? s : q);
  }
};
RC_HD AllReduceShares allreduce_shares(int64_t n, int world, int64_t elt, bool one_shot) {
  return {n, one_shot ? n : allreduce_share(n, world, elt), one_shot};
}

// all_reduce grid: one block per this many bytes of a rank's share.
constexpr int64_t kAllReduceBytesPerBlock = int64_t(32) << 10;
// Element range [*e0, *e1) of piece b when an n-element share is cut into
// `blocks` pieces of whole 16-byte vectors. Piece b has its own flag slot, so
// writer and reader must cut a share alike: same function, same block count.
RC_HD void allreduce_piece(int64_t n, int elt, int b, int blocks, int64_t* e0, int64_t* e1) {
  const int64_t per_vec = 16 / elt;
  const int64_t per = ceil_div(ceil_div(n, blocks), per_vec) * per_vec;
  *e0 = per * b < n ? per * b : n;
  *e1 = per * (b + 1) < n ? per * (b + 1) : n;
}

// GPU launch policy. All blocks of a launch must be resident at once: a
// block spins on flags that other blocks publish, of this launch or of a
// peer's, and a block queued behind spinning ones would never run. The
// kernels take one block per multiprocessor, and EP grids leave
// kEpReservedSms multiprocessors to others: a stray kernel on one or two of
// them cannot leave a block waiting for a slot. The row loops keep a
// block's loads in flight per multiprocessor, so the bytes in flight grow
// with the grid: on an H200 dispatch and combine of 4096 tokens took 5%
// longer on 3/4 of the multiprocessors, and 1-1.5% longer with one in 16
// left out. dispatch/combine split that budget between senders and
// receivers by the memory streams each role runs per row: dispatch senders
// read a row of x once and write it to each of its destinations (about W
// streams at most, W + 1 counted), receivers read the heap and write the
// output for the (W - 1) / W of the rows that came from peers (2 (W - 1)
// counted); combine mirrors that. The split follows this count alone, no
// measurement. Each role keeps at least one block. The role that handles
// this rank's own tokens (dispatch senders, combine receivers) cuts them
// into one contiguous range per block, all of one size (the last shorter),
// so every block moves the same rows: whole chunks per block would leave
// blocks idle (128 chunks on 123 blocks run as two rounds whichever way
// they are dealt).
struct EpGrid {
  int send_blocks;
  int recv_blocks;
};
RC_HD int clamp_blocks(int64_t want, int64_t most) {
  return int(want < 1 ? 1 : (want > most ? (most < 1 ? 1 : most) : want));
}
constexpr int kEpReservedSms = 2;
RC_HD int ep_grid_budget(int sm_count) {
  const int b = sm_count - kEpReservedSms < kMaxLaunchBlocks ? sm_count - kEpReservedSms : kMaxLaunchBlocks;
  return b < 2 ? 2 : b;
}
// Most blocks of the own-token role: its share (W + 1) / (3W - 1) of the
// budget, one block left to the other role, and at most kEpTargetChunks (a
// dispatch sender block is one chunk, and there are ep_max_chunks slots).
RC_HD int64_t ep_own_role_share(int world, int sm_count) {
  const int64_t budget = ep_grid_budget(sm_count);
  int64_t share = budget * (world + 1) / (3 * world - 1);
  share = share < budget - 1 ? share : budget - 1;
  share = share < kEpTargetChunks ? share : kEpTargetChunks;
  return share < 1 ? 1 : share;
}
// Tokens per block of the own-token role; its blocks: ep_chunks(T, this).
// On the GPU a dispatch chunk is one sender block's range.
RC_HD int64_t ep_own_block_tokens(int64_t ntok, int world, int sm_count) {
  return ceil_div(ntok < 1 ? 1 : ntok, ep_own_role_share(world, sm_count));
}
RC_HD int ep_own_role_blocks(int64_t ntok, int world, int sm_count) {
  return int(ep_chunks(ntok, ep_own_block_tokens(ntok, world, sm_count)));
}
RC_HD EpGrid dispatch_grid(int64_t ntok, int world, int sm_count) {
  // Senders: one chunk of this rank's tokens each; receivers take (peer,
  // chunk) items (own rows skip the heap), about as many chunks per peer.
  const int send = ep_own_role_blocks(ntok, world, sm_count);
  return {send, clamp_blocks(int64_t(world - 1) * send, ep_grid_budget(sm_count) - send)};
}
RC_HD EpGrid combine_grid(int64_t ntok, int world, int sm_count) {
  // Senders return rows for every peer's chunks (ep_num_chunks of them per
  // peer); receivers sum this rank's tokens, a range each.
  const int recv = ep_own_role_blocks(ntok, world, sm_count);
  return {clamp_blocks(int64_t(world - 1) * ep_num_chunks(ntok), ep_grid_budget(sm_count) - recv), recv};
}
// The expert layout on GPUs (csrc/gpu/expert_layout.cu) takes the received
// rows in chunks of 32, one per lane of a warp, so the rows of a chunk that
// have an expert are one 32-bit word; its scratch holds two words per
// (chunk, local expert): that bitmask, and the rows of the earlier chunks
// that have the expert. Its tally takes a chunk per warp; its placement
// (with the row copies) and its sums split the rows received among the
// blocks, each row cut into slices of about kExpertSliceBytes or more
// where the grid has more blocks than rows (expert_row_slices), so that a
// few rows (a decode step) still spread over every multiprocessor; the
// placement also zeroes the alignment padding, a warp per padding row an
// expert can have (experts * (alignment - 1) of them at most). The tally's
// grid is at most kExpertBlocksPerSm blocks per multiprocessor. The
// placement's and the sums' grids are sized for the most rows (rows = W *
// cap) and padding rows, at least a block and at most one wave per
// multiprocessor (resident_per_sm: the blocks of the kernel that one holds
// at once): the rows received and the padding are known on the device
// alone, so on a prefill-sized capacity a decode step leaves most blocks
// without rows, and each wave of them would still wait for the counts
// before it returns (a block left with neither slices nor padding rows
// returns before the tables).
//
// Rows received that fit one chunk (a decode step) take one kernel: each
// placement block with work tallies the chunk and computes the offsets itself, in
// shared memory of kExpertOneChunkExperts words per table, and the tally
// kernel (which computes the offsets in its last block) returns at once;
// the host launches it only where W * cap rows can fill more than one
// chunk (expert_tally_launched).
constexpr int64_t kExpertChunkRows = 32;
constexpr int64_t kExpertOneChunkExperts = 1024;
RC_HD bool expert_one_chunk_capable(int64_t experts) { return experts <= kExpertOneChunkExperts; }
RC_HD bool expert_places_one_chunk(int64_t received, int64_t experts) {
  return received <= kExpertChunkRows && expert_one_chunk_capable(experts);
}
RC_HD bool expert_tally_launched(int64_t rows, int64_t experts) { return !expert_places_one_chunk(rows, experts); }
constexpr int64_t kExpertBlocksPerSm = 4;
RC_HD int64_t expert_chunks(int64_t rows) { return ceil_div(rows, kExpertChunkRows); }
RC_HD int expert_chunk_blocks(int64_t rows, int sm_count) {
  return clamp_blocks(ceil_div(expert_chunks(rows), kGpuBlockThreads / kExpertChunkRows), kExpertBlocksPerSm * sm_count);
}
RC_HD int expert_row_blocks(int64_t rows, int sm_count, int resident_per_sm) {
  return clamp_blocks(rows > sm_count ? rows : sm_count, int64_t(resident_per_sm > 1 ? resident_per_sm : 1) * sm_count);
}
constexpr int64_t kExpertSliceBytes = 1024;
// Slices per received row of `row_bytes` bytes in `vectors` vectors, over a
// grid of `blocks`: as many as the blocks per row and kExpertSliceBytes
// allow, each ceil(vectors / slices) vectors (the last one shorter), and no
// slice left empty by that rounding. The placement's blocks compute it
// first thing, so its divisions are 32-bit (on GPUs a 64-bit one is a
// call): blocks fit, and so do a row's vectors (at most 2^21 row bytes:
// device/rows.cuh).
RC_HD int64_t expert_row_slices(int64_t received, int64_t row_bytes, int64_t vectors, int blocks) {
  if (received >= blocks || vectors <= 1) return 1;  // a block per row at most
  const uint32_t by_blocks = uint32_t(blocks) / uint32_t(received > 1 ? received : 1);
  const int64_t by_size = row_bytes / kExpertSliceBytes;
  const uint32_t most = by_size < by_blocks ? uint32_t(by_size) : by_blocks, v = uint32_t(vectors);
  if (most <= 1) return 1;
  const uint32_t width = (v - 1) / most + 1;
  return (v - 1) / width + 1;
}
// A combine whose receivers sum an expert layout's pair rows (the GPU
// transport's) reads up to K rows a token where the rank layout's reads
// one a rank, and at a decode step's token or so per receiver block, that
// block's loads in flight wait for several round trips. Its receivers then
// cut their range's rows into column slices, a block each, by
// expert_row_slices' rule over the blocks the senders leave (slices of
// kExpertSliceBytes or more, none empty). The rank layout's receivers keep
// whole rows, and so does a rank without tokens (its one range only waits).
RC_HD int combine_recv_slices(int64_t ntok, int world, int sm_count, int64_t row_bytes, int64_t vectors,
                              bool pair_rows) {
  if (!pair_rows || ntok == 0) return 1;
  const EpGrid g = combine_grid(ntok, world, sm_count);
  return int(expert_row_slices(g.recv_blocks, row_bytes, vectors, ep_grid_budget(sm_count) - g.send_blocks));
}
RC_HD int expert_place_blocks(int64_t rows, int64_t experts, int64_t alignment, int sm_count, int resident_per_sm) {
  const int64_t padding_blocks = ceil_div(experts * (alignment - 1), kGpuBlockThreads / kExpertChunkRows);
  return expert_row_blocks(rows > padding_blocks ? rows : padding_blocks, sm_count, resident_per_sm);
}

RC_HD int allreduce_blocks(int64_t share_bytes, int sm_count) {
  const int64_t most = sm_count / 2 < kMaxAllReduceBlocks ? sm_count / 2 : kMaxAllReduceBlocks;
  return clamp_blocks(ceil_div(share_bytes, kAllReduceBytesPerBlock), most);
}

// all_reduce_rmsnorm's rows. Its GPU kernel gives each row to one block of
// kGpuBlockThreads threads; a thread takes the row's 16-byte vectors t,
// t + threads, ... A row of at most kRmsNormRowVectorsPerThread vectors per
// thread stays in registers between the sum of squares and the
// normalisation; longer rows, and rows that are not whole vectors, are
// re-read from residual_out (any H works).
constexpr int kRmsNormRowVectorsPerThread = 4;
RC_HD int64_t rmsnorm_vector_elems(int64_t elt) { return 16 / elt; }
RC_HD int64_t rmsnorm_register_row_elems(int64_t elt) {
  return int64_t(kGpuBlockThreads) * kRmsNormRowVectorsPerThread * rmsnorm_vector_elems(elt);
}
// The fast-path predicate for a row of `hidden` elements of `elt` bytes
// (the tensors must also be 16-byte aligned, which fresh torch tensors are).
RC_HD bool rmsnorm_row_in_registers(int64_t hidden, int64_t elt) {
  return hidden % rmsnorm_vector_elems(elt) == 0 && hidden <= rmsnorm_register_row_elems(elt);
}

// One-stage: every rank pushes its partial rows to every peer and finishes
// every row (one barrier). Two-stage: rank o owns a shard of the tokens,
// finishes it and pushes its out and residual_out rows to every peer (two
// barriers, the norm's work split W ways). As for all_reduce, one-stage
// while the rows are small (the same size cap) and always at W <= 2 (fewer
// link bytes: (W-1)*N against 3*(W-1)/W*N); also while there are fewer
// tokens than ranks, where two-stage would leave ranks without a row.
RC_HD bool rmsnorm_use_one_stage(int64_t tokens, int64_t row_bytes, int world, bool gpu) {
  return world <= 2 || tokens < world || allreduce_use_one_shot(tokens * row_bytes, world, gpu);
}
// Rows per chunk, chunks being whole rows: one-stage sends a peer the whole
// chunk, which fills at most one all_reduce slot; two-stage sends each owner
// its shard and gets back the owner's out and residual_out rows, both in one
// gather slot. 0: a row is wider than that, and the op runs all_reduce (its
// own chunking) and then the residual add and the norm locally.
RC_HD int64_t rmsnorm_chunk_rows(int64_t slot_bytes, int64_t row_bytes, int world, bool one_stage) {
  return one_stage ? slot_bytes / row_bytes : world * (slot_bytes / (2 * row_bytes));
}
enum RmsNormPath : int { kRmsNormOneStage = 0, kRmsNormTwoStage = 1, kRmsNormAllReduceThenNorm = 2, kNumRmsNormPaths = 3 };
RC_HD const char* rmsnorm_path_name(int path) {
  return path == kRmsNormOneStage ? "one_stage" : path == kRmsNormTwoStage ? "two_stage" : "all_reduce_then_norm";
}
RC_HD int rmsnorm_path(int64_t tokens, int64_t hidden, int64_t elt, int world, bool gpu, int64_t slot_bytes) {
  const bool one_stage = rmsnorm_use_one_stage(tokens, hidden * elt, world, gpu);
  if (rmsnorm_chunk_rows(slot_bytes, hidden * elt, world, one_stage) == 0) return kRmsNormAllReduceThenNorm;
  return one_stage ? kRmsNormOneStage : kRmsNormTwoStage;
}
// Two-stage shards of a chunk of n rows: owner o finishes rows
// [o*q, min((o+1)*q, n)), q = ceil(n / W); the last shards may be short or empty.
RC_HD AllReduceShares rmsnorm_shards(int64_t n, int world, bool one_stage) {
  return {n, one_stage ? n : ceil_div(n, world), one_stage};
}

// Fused grid: a block finishes whole rows, block b the rows [b*per, (b+1)*per)
// of every shard (per = ceil(shard rows / blocks)); block b has its own flag
// slots, so every rank derives the same block count from the shard size.
RC_HD int rmsnorm_blocks(int64_t shard_rows, int sm_count) {
  const int64_t most = sm_count / 2 < kMaxAllReduceBlocks ? sm_count / 2 : kMaxAllReduceBlocks;
  return clamp_blocks(shard_rows, most);
}
RC_HD void rmsnorm_piece(int64_t n, int b, int blocks, int64_t* r0, int64_t* r1) {
  const int64_t per = ceil_div(n, blocks);
  *r0 = per * b < n ? per * b : n;
  *r1 = per * (b + 1) < n ? per * (b + 1) : n;
}

}  // namespace rdna4_comm
