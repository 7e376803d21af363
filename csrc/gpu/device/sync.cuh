// How the device kernels order memory and count generations: publication,
// bounded waits, timeouts. Every kernel synchronises with its peers only
// through the functions below.
//
// Push, poll locally: a writer stores payload and flags into the READER's
// memory, and a reader spins only on its own memory. Posted writes are cheap
// over PCIe and NVLink; a remote read is a round trip.
//
// Publication, in this order:
//  1. the block's threads store the payload (plain stores);
//  2. block_sync(): those stores happen before whatever thread r does next;
//  3. thread r, the one thread that owns destination r's flag, stores the
//     slot's metadata (HeadSlot / ChunkSlot fields) with plain stores and
//     then the generation with store_release_sys. A release is cumulative
//     (PTX and the HSA model HIP follows): every store that happens before
//     it, the block's through the barrier and the metadata in program order,
//     is visible to every agent of the system before the flag is. A flag
//     in this rank's own memory that only this GPU's blocks read (its own
//     dispatch header) takes store_release_device: a system-scope release
//     waits for the thread's stores to reach every agent, and the thread's
//     warp with it.
// Observation: one thread polls the flag with load_acquire_sys (wait_flag);
// its later loads see everything released before the flag, and a block
// barrier (block_all) hands that to the whole block.
//
// Every flag slot has one writer, so no peer atomics exist. The only atomics
// act on shared memory (counters of a block).
#pragma once

#include "../../bounds.h"
#include "../../error_words.h"
#include "../../flags.h"
#include "launch.cuh"

namespace rdna4_comm {
namespace gpu {

// Generations. A kernel of a communicator starts only after the one before it
// has finished, on any stream (the host orders them: in_stream_order in
// gpu_comm.cpp). Each block of a launch has its own counter: it reads its
// generation, counter + 1, at start (begin_round) and stores it back when
// it finishes (finish_op), and block 0 also stores it into the counters of
// the blocks this launch does not have, which a later, larger grid reads.
// Nothing of this launch reads another block's counter, so the blocks never
// wait for each other to finish, and the next kernel of the kind, started
// after this one ended, reads the same value in every block. The host never
// passes a generation, so a replayed graph keeps counting.
// Every grid fits the counters: ep_grid_budget clamps the EP grids to
// kMaxLaunchBlocks, allreduce_blocks and rmsnorm_blocks to kMaxAllReduceBlocks.
static_assert(kMaxAllReduceBlocks <= kMaxLaunchBlocks, "a generation counter for every block of every grid");

// The barrier: every thread of the block has read its generation before
// thread 0 overwrites it.
RC_DEVICE void finish_op(const Env& env, int op, uint64_t gen) {
  block_sync();
  char* sig = env.sig[env.rank];
  if (threadIdx.x == 0) *env.layout.counter(sig, op, blockIdx.x) = gen;
  if (blockIdx.x == 0)
    for (int b = int(gridDim.x + threadIdx.x); b < kMaxLaunchBlocks; b += kThreads)
      *env.layout.counter(sig, op, b) = gen;
}

// A round of the protocol (calls.h) as a block runs it: its generation of
// the op's sequence. This rank's call word of the round, which holds the
// round's low bits (0: the probe, which is no call), is in shared memory
// (round_word): the EP kernels' row loops leave no registers for it.
struct Round {
  uint64_t gen;
};
__shared__ uint64_t round_word;

// The block's counters of the three op sequences that count rounds, which
// only the block's own finish_op changes, at its end.
struct RoundCounters {
  uint64_t all_reduce, dispatch, combine;
  // The number of the round the block is in: one more than the rounds they hold.
  RC_DEVICE uint64_t number() const { return next_round(all_reduce, dispatch, combine); }
  // Sequence `sequence`'s counter: every sequence whose kernels make calls is one of the three.
  RC_DEVICE uint64_t of(int sequence) const {
    return sequence == kOpDispatch ? dispatch : sequence == kOpCombine ? combine : all_reduce;
  }
};
RC_DEVICE RoundCounters round_counters(const Env& env) {
  const Layout& L = env.layout;
  char* own = env.sig[env.rank];
  const int b = blockIdx.x;
  return {load_relaxed_device(L.counter(own, kAllReduceSequence, b)),
          load_relaxed_device(L.counter(own, kOpDispatch, b)), load_relaxed_device(L.counter(own, kOpCombine, b))};
}
RC_DEVICE uint64_t round_number(const Env& env) { return round_counters(env).number(); }

// The op a round's timeout names.
RC_DEVICE int round_op() {
  switch (call_op(round_word)) {
    case kCallAllReduce: return kOpAllReduce;
    case kCallAllReduceRmsNorm: return kOpAllReduceRmsNorm;
    case kCallDispatch: return kOpDispatch;
    case kCallCombine: return kOpCombine;
    default: return kOpProbe;
  }
}

// A block's round of op sequence `sequence`: its generation from the
// block's own counter, which finish_op keeps alike in every block between
// launches. A call's generation and round number come from one set of
// loads, issued together (no load waits behind the word's store, and the
// loads are relaxed: plain ones let the compiler schedule the kernel's
// registers differently, and all_reduce_rmsnorm's fp32 row loop spilled).
// Block 0 announces the call word `fields` stamped with the round
// into every rank's slot (its own too: the host reads it for messages),
// before the launch's first wait on a peer can need it; a peer that reads a
// flag of this round before the word has landed waits for the word too.
// Every thread stores the same word into round_word, so each reads its own
// store back with no barrier. Block 0's thread 0 also stores the round's
// number into *number_out where one is given (a dispatch's handle).
RC_DEVICE Round begin_round(const Env& env, int sequence, uint64_t fields, int64_t* number_out = nullptr) {
  const Layout& L = env.layout;
  if (fields == 0) {
    round_word = 0;
    return Round{*L.counter(env.sig[env.rank], sequence, blockIdx.x) + 1};
  }
  const RoundCounters counters = round_counters(env);
  const Round round{counters.of(sequence) + 1};
  const uint64_t number = counters.number(), word = call_word(fields, number);
  const int p = threadIdx.x;
  // A relaxed store: the word is its whole message, and it orders nothing
  // (a release's system-wide wait would delay block 0 at every launch).
  if (blockIdx.x == 0 && p < env.world) store_relaxed_sys(L.call_slot(env.sig[p], number, env.rank), word);
  if (number_out && blockIdx.x == 0 && p == 0) *number_out = int64_t(number);
  round_word = word;
  return round;
}

// The first thread to fail leaves one word for the host: a timeout
// (encode_timeout), a call that differs from a peer's (encode_call_mismatch, the
// two call words in this rank's mismatch slot of that peer first) or a bad
// handle value (encode_bad_handle).
RC_DEVICE void record_error(const Env& env, uint64_t word) {
  if (load_relaxed_sys(env.error) == 0) store_release_sys(env.error, word);
}
RC_DEVICE void record_mismatch(const Env& env, int peer, uint64_t theirs) {
  uint64_t* words = env.layout.mismatch(env.sig[env.rank], peer);
  words[0] = round_word;  // every thread that finds this mismatch stores the same two words
  words[1] = theirs;
  record_error(env, encode_call_mismatch(peer, round_number(env)));
}

// Bounded wait of one thread until ready() holds and `peer`'s call word of
// the round agrees with this rank's, for round r on `peer` (this rank
// itself: no word to check). False on timeout, on a word that differs (both
// recorded), or once another thread has failed, so a broken op drains in one
// timeout, not one per wait. The word is read before the flag: a relaxed
// load that an acquire does not order after itself, so both are in flight
// at once.
template <typename Ready>
RC_DEVICE bool wait_until(const Env& env, const Round& r, int peer, Ready ready) {
  const uint64_t mine = round_word;
  const uint64_t* slot =
      mine != 0 && peer != env.rank ? env.layout.call_slot(env.sig[env.rank], call_round_bits(mine), peer) : nullptr;
  // 1: done; 0: wait on; -1: the peer's call differs (recorded).
  auto verdict = [&] {
    const uint64_t theirs = slot ? load_relaxed_sys(slot) : 0;
    const bool flag = ready();
    if (!slot) return flag ? 1 : 0;
    if (!call_of_round(theirs, call_round_bits(mine))) return 0;
    if (theirs != mine) {
      record_mismatch(env, peer, theirs);
      return -1;
    }
    return flag ? 1 : 0;
  };
  int v = verdict();
  if (v != 0) return v > 0;
  const uint64_t start = timer_ticks();
  for (uint32_t spin = 1;; ++spin) {
    spin_pause();
    v = verdict();
    if (v != 0) return v > 0;
    if ((spin & 127) == 0) {
      if (load_relaxed_sys(env.error) != 0) return false;
      if (timer_ticks() - start > env.timeout_ticks) {
        record_error(env, encode_timeout(round_op(), peer, round_number(env)));
        return false;
      }
    }
  }
}

// Bounded wait for `*flag >= gen` (why `>=`: flags.h, at HeadSlot).
RC_DEVICE bool wait_flag(const Env& env, const Round& r, const uint64_t* flag, int peer) {
  return wait_until(env, r, peer, [&] { return load_acquire_sys(flag) >= r.gen; });
}

RC_DEVICE uint32_t all_ranks(const Env& env) { return (1u << env.world) - 1; }
RC_DEVICE uint32_t peer_ranks(const Env& env) { return all_ranks(env) & ~(1u << env.rank); }

// Block-wide: thread p waits for flag_of(p), for every rank p in `ranks`.
// True on every thread when all arrived.
template <typename FlagOf>
RC_DEVICE bool block_wait_ranks(const Env& env, const Round& r, uint32_t ranks, FlagOf flag_of) {
  bool ok = true;
  const int p = threadIdx.x;
  if (p < env.world && (ranks >> p & 1u)) ok = wait_flag(env, r, flag_of(p), p);
  return block_all(ok);
}

// After a block barrier: thread r publishes gen into flag_of(r), for every rank r in `ranks`.
template <typename FlagOf>
RC_DEVICE void block_signal_ranks(const Env& env, uint64_t gen, uint32_t ranks, FlagOf flag_of) {
  const int r = threadIdx.x;
  if (r < env.world && (ranks >> r & 1u)) store_release_sys(flag_of(r), gen);
}

// One phase of the all_reduce exchange (phase 0: the partials are in the
// peers' slots; 1: the finished shares are), for block b: once the block's
// pushes are done (the barrier), flag every peer, then wait for every peer's
// block b. With `ok` false (an earlier wait failed; block-uniform) it
// neither signals nor waits, so a broken op drains. True when all arrived.
RC_DEVICE bool exchange_phase(const Env& env, const Round& r, int phase, int b, bool ok = true) {
  const Layout& L = env.layout;
  const int me = env.rank;
  const uint64_t gen = r.gen;
  block_sync();
  if (ok) block_signal_ranks(env, gen, peer_ranks(env), [&](int p) { return L.ar_flag(env.sig[p], gen, phase, me, b); });
  return ok && block_wait_ranks(env, r, peer_ranks(env), [&](int p) { return L.ar_flag(env.sig[me], gen, phase, p, b); });
}

// Phase 1 of a two-shot exchange, for block b: once the block has pushed
// its finished piece into every peer's gather slot, exchange_phase flags
// the peers and waits for theirs; then copy_out(o, f0, f1, slot) takes
// peer o's piece [f0, f1) of its share (piece_of(o, &f0, &f1)) from slot,
// o's gather slot in this rank's memory. Nothing is copied after a failed
// wait (`ok` false: an earlier one failed).
template <typename PieceOf, typename CopyOut>
RC_DEVICE void gather_phase(const Env& env, const Round& r, int b, bool ok, PieceOf piece_of, CopyOut copy_out) {
  if (!exchange_phase(env, r, 1, b, ok)) return;
  for (int o = 0; o < env.world; ++o) {
    if (o == env.rank) continue;
    int64_t f0, f1;
    piece_of(o, &f0, &f1);
    copy_out(o, f0, f1, env.layout.ar_gather_slot(env.data[env.rank], r.gen, o));
  }
}

}  // namespace gpu
}  // namespace rdna4_comm
