// Call words: how the ranks of a communicator check that they make the same
// calls (docs/semantics.md, "Calls that disagree"). Plain C++ (no torch, no
// CUDA runtime), read by every transport and by the device kernels.
//
// An op call runs one or more protocol rounds (an all_reduce one per chunk);
// every round of every op takes the next round number of the communicator,
// the same on every rank while their calls agree: the sum of the op
// sequences' generations (all_reduce with all_reduce_rmsnorm, dispatch,
// combine), plus one. Before it waits for any peer, a round publishes one
// 64-bit call word into every peer's slot [round & 1][this rank]
// (Layout::call_slot), and every wait for a peer in that round also reads
// the peer's slot: a word of this round that differs from this rank's is a
// mismatch, found however the peer's op would have gone on (a different op
// waits for flags that never come). Why two slots suffice: a peer's word in
// a slot is of this round or of the round two before (not announced yet),
// never of a later one, because every round is a full exchange (each rank
// waits for every peer's flags of it) so no rank starts round n + 2 before
// every peer has started round n + 1, which it does after it finished n.
//
// The word: the round number modulo 256 (enough to tell round n from n - 2),
// the op, two flag bits, the dtype and a value, so that the fields every
// rank must agree on (docs/semantics.md) decide equality of the words:
//   all_reduce          dtype, numel
//   all_reduce_rmsnorm  dtype, residual given (flag 0), hidden, rows
//   dispatch            expert layout (flag 0), FP8 pair (flag 1)
//   combine             expert layout (flag 0), the round of the dispatch its handle comes from
#pragma once

#include <cstdint>

#include "qualifiers.h"

namespace rdna4_comm {

enum CallOp : int { kCallAllReduce = 1, kCallAllReduceRmsNorm = 2, kCallDispatch = 3, kCallCombine = 4 };
enum CallDtype : int { kCallF32 = 0, kCallBF16 = 1, kCallF16 = 2 };
constexpr int kCallRoundBits = 8;
constexpr int kCallValueBits = 49;
constexpr uint64_t kCallValueMask = (uint64_t(1) << kCallValueBits) - 1;
// all_reduce_rmsnorm's value: hidden in the low bits, rows above.
constexpr int kCallHiddenBits = 20;
constexpr int64_t kCallMaxHidden = (int64_t(1) << kCallHiddenBits) - 1;
constexpr int64_t kCallMaxRows = (int64_t(1) << (kCallValueBits - kCallHiddenBits)) - 1;

// The number of the round that follows `all_reduce`, `dispatch` and `combine`
// rounds of those op sequences (their generation counters).
RC_HD uint64_t next_round(uint64_t all_reduce, uint64_t dispatch, uint64_t combine) {
  return all_reduce + dispatch + combine + 1;
}

// A call's fields without its round (the round is stamped per round: call_word).
RC_HD uint64_t call_fields(int op, int flags, int dtype, uint64_t value) {
  return uint64_t(op & 7) << 53 | uint64_t(flags & 3) << 51 | uint64_t(dtype & 3) << 49 | (value & kCallValueMask);
}
RC_HD uint64_t call_word(uint64_t fields, uint64_t round) {
  return (round & ((uint64_t(1) << kCallRoundBits) - 1)) << 56 | fields;
}
RC_HD bool call_of_round(uint64_t word, uint64_t round) {
  return word != 0 && (word >> 56) == (round & ((uint64_t(1) << kCallRoundBits) - 1));
}
// The round's low bits a word holds (enough for its slot and call_of_round).
RC_HD uint64_t call_round_bits(uint64_t word) { return word >> 56; }
RC_HD int call_op(uint64_t word) { return int(word >> 53 & 7); }
RC_HD int call_flags(uint64_t word) { return int(word >> 51 & 3); }
RC_HD int call_dtype(uint64_t word) { return int(word >> 49 & 3); }
RC_HD uint64_t call_value(uint64_t word) { return word & kCallValueMask; }

RC_HD uint64_t all_reduce_call(int dtype, int64_t numel) { return call_fields(kCallAllReduce, 0, dtype, uint64_t(numel)); }
RC_HD uint64_t rmsnorm_call(int dtype, bool residual, int64_t hidden, int64_t rows) {
  return call_fields(kCallAllReduceRmsNorm, residual ? 1 : 0, dtype, uint64_t(rows) << kCallHiddenBits | uint64_t(hidden));
}
RC_HD uint64_t dispatch_call(bool expert_layout, bool fp8_pair) {
  return call_fields(kCallDispatch, (expert_layout ? 1 : 0) | (fp8_pair ? 2 : 0), 0, 0);
}
RC_HD uint64_t combine_call(bool expert_layout, uint64_t dispatch_round) {
  return call_fields(kCallCombine, expert_layout ? 1 : 0, 0, dispatch_round);
}

}  // namespace rdna4_comm
