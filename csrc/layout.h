// Where each buffer and flag lives in the symmetric heap (Layout), derived
// from a communicator's sizes (HeapConfig) alone, so every rank computes the
// same offsets. Plain C++ for every transport and the kernels (qualifiers.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "bounds.h"
#include "calls.h"
#include "flags.h"
#include "policies.h"
#include "qualifiers.h"

namespace rdna4_comm {

struct HeapConfig {
  int world = 1;
  int64_t cap = 0;          // max tokens per rank (0: no EP buffers)
  int64_t hidden = 0;
  int64_t topk = 0;
  int64_t num_experts = 0;
  int64_t elt = 0;          // bytes per element of the EP dtype
  int64_t ar_slot_bytes = 0;
  int64_t fp8_scales = 0;   // FP8 dispatch: scales per token (fp8_num_scales); 0: rows travel in the EP dtype
};

// Byte offsets of every region. Signals (counters and flags) and data are
// two allocations on the GPU (signals uncached on HIP) and one segment on the
// CPU. Every region the peers write is split in two by generation parity: an
// op of generation g writes only parity g & 1, and no rank starts op g + 1
// before every peer has published op g, which each peer does only after it
// finished reading op g - 1. So nobody overwrites a buffer a peer still reads.
struct Layout {
  int world = 1;
  int64_t cap = 0, hidden = 0, topk = 0, elt = 0, ar_slot_bytes = 0, max_chunks = 1, fp8_scales = 0;
  size_t payload_stride = 0;    // bytes of one hidden row in the EP dtype (combine's rows), 16-byte aligned
  size_t dispatch_payload = 0;  // a dispatch row's payload: payload_stride, or FP8's q bytes then its scales
  size_t scales_offset = 0;     // FP8: where a dispatch row's fp32 scales start, 16-byte aligned
  size_t row_stride = 0;        // dispatch row: payload, topk ids, weights, source token

  size_t counters = 0;         // [kNumOps][kMaxLaunchBlocks] own generation counters, one per GPU block
  size_t ar_flags = 0;         // [2][2 phases][W][kMaxAllReduceBlocks] u64
  size_t dispatch_heads = 0;   // [2][W] HeadSlot
  size_t dispatch_chunks = 0;  // [2][W][max_chunks] ChunkSlot
  size_t dispatch_tally = 0;   // [max_chunks][W] tally words, own use
  size_t combine_flags = 0;    // [2][W][max_chunks] u64
  size_t probe_flags = 0;      // [W] u64
  size_t call_slots = 0;       // [2][W] u64: each source's call word of a round (calls.h)
  size_t mismatches = 0;       // [W][2] u64, own use: this rank's and a peer's differing call words
  size_t expert_tally = 0;     // u32, own use: the expert tally's finished blocks (ExpertLayoutArgs::tally_done)
  size_t signal_bytes = 0;

  size_t ar_inbox = 0;       // [2][W][ar_slot_bytes]: input (one-shot) or scatter share (two-shot)
  size_t ar_gather = 0;      // [2][W][ar_slot_bytes]: reduced shares (two-shot)
  size_t dispatch_recv = 0;  // [2][W src][cap][row_stride]
  size_t combine_inbox = 0;  // [2][W dst][cap][payload_stride]
  size_t probe = 0;          // [W][kProbeBytes]
  size_t data_bytes = 0;

  RC_HD uint64_t* counter(char* sig, int op, int block = 0) const {
    return reinterpret_cast<uint64_t*>(sig + counters) + size_t(op) * kMaxLaunchBlocks + block;
  }
  RC_HD uint64_t* ar_flag(char* sig, uint64_t gen, int phase, int src, int block) const {
    return reinterpret_cast<uint64_t*>(sig + ar_flags) +
           ((size_t(gen & 1) * 2 + phase) * world + src) * kMaxAllReduceBlocks + block;
  }
  RC_HD HeadSlot* dispatch_head(char* sig, uint64_t gen, int src) const {
    return reinterpret_cast<HeadSlot*>(sig + dispatch_heads) + size_t(gen & 1) * world + src;
  }
  RC_HD ChunkSlot* dispatch_chunk(char* sig, uint64_t gen, int src, int64_t chunk) const {
    return reinterpret_cast<ChunkSlot*>(sig + dispatch_chunks) +
           (size_t(gen & 1) * world + src) * max_chunks + chunk;
  }
  // One set, no parity: only the blocks of one launch use it, and the next
  // dispatch starts after they all finished.
  RC_HD uint64_t* tally(char* sig, int64_t block, int dst) const {
    return reinterpret_cast<uint64_t*>(sig + dispatch_tally) + size_t(block) * world + dst;
  }
  RC_HD uint64_t* combine_flag(char* sig, uint64_t gen, int src, int64_t chunk) const {
    return reinterpret_cast<uint64_t*>(sig + combine_flags) +
           (size_t(gen & 1) * world + src) * max_chunks + chunk;
  }
  RC_HD uint64_t* probe_flag(char* sig, int src) const {
    return reinterpret_cast<uint64_t*>(sig + probe_flags) + src;
  }
  RC_HD uint64_t* call_slot(char* sig, uint64_t round, int src) const {
    return reinterpret_cast<uint64_t*>(sig + call_slots) + size_t(round & 1) * world + src;
  }
  RC_HD uint64_t* mismatch(char* sig, int peer) const {
    return reinterpret_cast<uint64_t*>(sig + mismatches) + size_t(peer) * 2;
  }
  RC_HD uint32_t* expert_tally_done(char* sig) const { return reinterpret_cast<uint32_t*>(sig + expert_tally); }
  RC_HD char* ar_slot(char* data, uint64_t gen, int src) const {
    return data + ar_inbox + (size_t(gen & 1) * world + src) * size_t(ar_slot_bytes);
  }
  RC_HD char* ar_gather_slot(char* data, uint64_t gen, int owner) const {
    return data + ar_gather + (size_t(gen & 1) * world + owner) * size_t(ar_slot_bytes);
  }
  RC_HD char* dispatch_row(char* data, uint64_t gen, int src, int64_t row) const {
    return data + dispatch_recv + ((size_t(gen & 1) * world + src) * size_t(cap) + size_t(row)) * row_stride;
  }
  RC_HD char* combine_row(char* data, uint64_t gen, int dst, int64_t token) const {
    return data + combine_inbox +
           ((size_t(gen & 1) * world + dst) * size_t(cap) + size_t(token)) * payload_stride;
  }
  RC_HD char* probe_buf(char* data, int src) const { return data + probe + size_t(src) * kProbeBytes; }

  // Dispatch row: [payload][topk local ids, int32][topk weights, fp32][source token, int32];
  // an FP8 payload is [hidden fp8 bytes][fp8_scales fp32 scales at scales_offset].
  RC_HD int32_t* row_ids(char* row) const { return reinterpret_cast<int32_t*>(row + dispatch_payload); }
  RC_HD float* row_weights(char* row) const {
    return reinterpret_cast<float*>(row + dispatch_payload + size_t(topk) * 4);
  }
  RC_HD int32_t* row_token(char* row) const {
    return reinterpret_cast<int32_t*>(row + dispatch_payload + size_t(topk) * 8);
  }
  RC_HD float* row_scales(char* row) const { return reinterpret_cast<float*>(row + scales_offset); }
};

inline Layout make_layout(const HeapConfig& c) {
  Layout l;
  l.world = c.world;
  l.cap = c.cap;
  l.hidden = c.hidden;
  l.topk = c.topk;
  l.elt = c.elt;
  l.ar_slot_bytes = int64_t(align_up(size_t(c.ar_slot_bytes), kAlign));
  l.max_chunks = ep_max_chunks(c.cap);
  l.fp8_scales = c.fp8_scales;
  l.payload_stride = align_up(size_t(c.hidden * c.elt), 16);
  l.scales_offset = align_up(size_t(c.hidden), 16);
  l.dispatch_payload = c.fp8_scales > 0 ? align_up(l.scales_offset + size_t(c.fp8_scales) * 4, 16) : l.payload_stride;
  l.row_stride = align_up(l.dispatch_payload + size_t(c.topk) * 8 + 4, 16);
  const size_t W = size_t(c.world);

  size_t off = 0;
  auto take = [&off](size_t bytes) {
    size_t at = off;
    off = align_up(off + bytes, kAlign);
    return at;
  };
  l.counters = take(sizeof(uint64_t) * kNumOps * kMaxLaunchBlocks);
  l.ar_flags = take(sizeof(uint64_t) * 2 * 2 * W * kMaxAllReduceBlocks);
  l.dispatch_heads = take(sizeof(HeadSlot) * 2 * W);
  l.dispatch_chunks = take(sizeof(ChunkSlot) * 2 * W * size_t(l.max_chunks));
  l.dispatch_tally = take(sizeof(uint64_t) * size_t(l.max_chunks) * W);
  l.combine_flags = take(sizeof(uint64_t) * 2 * W * size_t(l.max_chunks));
  l.probe_flags = take(sizeof(uint64_t) * W);
  l.call_slots = take(sizeof(uint64_t) * 2 * W);
  l.mismatches = take(sizeof(uint64_t) * 2 * W);
  l.expert_tally = take(sizeof(uint64_t));
  l.signal_bytes = off;

  off = 0;
  l.ar_inbox = take(2 * W * size_t(l.ar_slot_bytes));
  l.ar_gather = take(2 * W * size_t(l.ar_slot_bytes));
  l.dispatch_recv = take(2 * W * size_t(c.cap) * l.row_stride);
  l.combine_inbox = take(2 * W * size_t(c.cap) * l.payload_stride);
  l.probe = take(W * kProbeBytes);
  l.data_bytes = off;
  return l;
}

}  // namespace rdna4_comm
