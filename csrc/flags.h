// What the flags carry: the ops' generation sequences, the rule a reader
// waits by, the dispatch slots that carry metadata beside their generation,
// and the tally words of dispatch's sender blocks. Where each lives in the
// heap: layout.h; the call word each round publishes beside them: calls.h.
// Plain C++ for every transport and the kernels (qualifiers.h).
#pragma once

#include <cstdint>

#include "bounds.h"
#include "qualifiers.h"

namespace rdna4_comm {

// The ops, each with a generation counter of its own (Layout::counter).
enum Op : int {
  kOpAllReduce = 0,
  kOpDispatch = 1,
  kOpCombine = 2,
  kOpProbe = 3,
  kOpAllReduceRmsNorm = 4,
  kNumOps = 5
};

RC_HD const char* op_name(int op) {
  return op == kOpAllReduce          ? "all_reduce"
         : op == kOpDispatch         ? "dispatch"
         : op == kOpCombine          ? "combine"
         : op == kOpAllReduceRmsNorm ? "all_reduce_rmsnorm"
                                     : "p2p_probe";
}

// all_reduce_rmsnorm shares all_reduce's generation counter, flag slots and
// regions: to the protocol it is one more all_reduce. Why that is safe: both
// ops are full exchanges (every rank waits for every peer's flags of the op
// before it finishes it), so one counter over both keeps the invariant the
// parity rule rests on (a writer is at most one generation of the sequence
// ahead of any reader), and every flag slot still only grows. Own regions
// would double the largest part of the heap for nothing. Timeouts still name
// the op that waited (kOpAllReduceRmsNorm) and the generation of the sequence.
constexpr int kAllReduceSequence = kOpAllReduce;

// A flag word holds the generation of the op that wrote it, and a reader of
// op gen waits until `flag >= gen`. Why that is exact: a slot of parity
// gen & 1 holds 0 from init, then the generations of that parity its one
// writer published, so it only grows, and anything below gen is stale (an
// older op of the same parity, or 0). Nothing above gen can be there before
// this reader finished op gen: its writer stores gen + 2 only in op gen + 2,
// which it starts after finishing op gen + 1, and finishing op gen + 1 needs
// this rank's op gen + 1 flags, which this rank publishes only after it
// finished op gen (stream order on the GPU, program order on the CPU). So
// `>=` and `==` accept the same values; `>=` is the test that follows from
// monotone flags alone.
//
// Slots with metadata: the writer stores the metadata with plain stores and
// then the generation with a release (system scope on the GPU); the reader
// acquires the generation before it reads the metadata.
struct HeadSlot {  // dispatch: one per (parity, source), written by the source
  uint64_t gen;
  uint32_t ntok;          // tokens the source holds (T_s)
  uint32_t nrows;         // rows the source sends to this rank
  uint32_t chunk_tokens;  // the source's chunking: chunks of this many tokens, the last one shorter
  uint32_t unused;
};
struct ChunkSlot {  // dispatch: one per (parity, source, token chunk)
  uint64_t gen;
  uint32_t row_start;  // first row of this chunk within the source's rows
  uint32_t nrows;
};
static_assert(sizeof(HeadSlot) == 24 && sizeof(ChunkSlot) == 16, "slot layout");

// A dispatch sender block's rows for one destination, for the sender blocks
// after it (GPU transport, own memory): one 64-bit word per (block,
// destination) holding the generation above the row count. The count
// travels in the word that announces it, so a relaxed 64-bit store
// publishes it and a relaxed load reads it whole: no release, no acquire.
// Readers wait for `tally_gen(word) >= gen` (as for flags: the word only
// grows, one writer). A count is at most cap rows.
constexpr int kTallyRowBits = 24;
static_assert(kMaxGpuTokensPerRank < (int64_t(1) << kTallyRowBits), "a tally word holds a block's row count");
RC_HD uint64_t tally_word(uint64_t gen, int64_t rows) { return gen << kTallyRowBits | uint64_t(rows); }
RC_HD uint64_t tally_gen(uint64_t word) { return word >> kTallyRowBits; }
RC_HD int32_t tally_rows(uint64_t word) { return int32_t(word & ((uint64_t(1) << kTallyRowBits) - 1)); }

}  // namespace rdna4_comm
