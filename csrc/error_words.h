// The error word: how a failure found on the device reaches the host. One
// 64-bit word in host-mapped memory (gpu::Env::error), 0 while nothing has
// failed, written by the kernels (record_error, gpu/device/sync.cuh) and by
// the host's peer watchdog, and read by the host at the next op. Bit 63 is
// set in every word, so none is 0; bits 56..62 hold its cause, which says
// what the bits below carry. Plain C++ for every transport and the kernels
// (qualifiers.h).
#pragma once

#include <cstdint>

#include "bounds.h"
#include "flags.h"
#include "qualifiers.h"

namespace rdna4_comm {

// A cause is an op (Op) whose wait on a peer timed out, or one of these.
enum ErrorCause : int { kErrorCallMismatch = 0x7d, kErrorBadHandle = 0x7e, kErrorPeerExited = 0x7f };
static_assert(int(kNumOps) < int(kErrorCallMismatch), "an op and an error cause never share a code");
RC_HD int error_cause(uint64_t word) { return int((word >> 56) & 0x7f); }

// A failure with a peer: the peer in bits 48..55, the round (calls.h) below.
RC_HD uint64_t encode_peer_error(int cause, int peer, uint64_t round) {
  return (uint64_t(1) << 63) | (uint64_t(cause) << 56) | (uint64_t(peer & 0xff) << 48) |
         (round & 0xffffffffffffull);
}
RC_HD int error_peer(uint64_t word) { return int((word >> 48) & 0xff); }
RC_HD uint64_t error_round(uint64_t word) { return word & 0xffffffffffffull; }
// A kernel's wait of op `op` on `peer` in `round` timed out.
RC_HD uint64_t encode_timeout(int op, int peer, uint64_t round) { return encode_peer_error(op, peer, round); }
// A kernel found `peer`'s call word of `round` differ from its own (the two
// words: Layout::mismatch).
RC_HD uint64_t encode_call_mismatch(int peer, uint64_t round) {
  return encode_peer_error(kErrorCallMismatch, peer, round);
}
// The host's peer watchdog (GPU transport) saw `peer`'s process exit; the
// kernels' waits poll the word, so spinning kernels stop at once. It knows
// no round.
RC_HD uint64_t encode_peer_exit(int peer) { return encode_peer_error(kErrorPeerExited, peer, 0); }

// Dispatch handles are user input. A combine kernel that finds a value out
// of range leaves a kErrorBadHandle word: the handle field in bits 54..55,
// the element's index in bits 32..53, the value below. The host names the
// field, the index and the value.
enum HandleField : int { kHandleRecvSrc = 0, kHandleCounts = 1, kHandleSrcTokens = 2, kHandleSendMask = 3 };
RC_HD const char* handle_field_name(int field) {
  return field == kHandleRecvSrc     ? "handle.recv_src"
         : field == kHandleCounts    ? "handle.counts"
         : field == kHandleSrcTokens ? "handle.src_tokens"
                                     : "handle.send_mask";
}
static_assert(kMaxGpuWorld * kMaxGpuTokensPerRank <= (int64_t(1) << 22), "a recv_src index fits its 22 bits");
RC_HD uint64_t encode_bad_handle(int field, int64_t index, int32_t value) {
  return (uint64_t(1) << 63) | (uint64_t(kErrorBadHandle) << 56) | (uint64_t(field & 3) << 54) |
         (uint64_t(index & 0x3fffff) << 32) | uint64_t(uint32_t(value));
}
RC_HD int bad_handle_field(uint64_t word) { return int((word >> 54) & 3); }
RC_HD int64_t bad_handle_index(uint64_t word) { return int64_t((word >> 32) & 0x3fffff); }
RC_HD int32_t bad_handle_value(uint64_t word) { return int32_t(uint32_t(word & 0xffffffffull)); }

}  // namespace rdna4_comm
