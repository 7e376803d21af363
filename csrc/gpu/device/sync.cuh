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

#include "launch.cuh"

namespace rdna4_comm {
namespace gpu {

// Generations. A kernel of a communicator starts only after the one before it
// has finished, on any stream (the host orders them: in_stream_order in
// gpu_comm.cpp). Each block of a launch has its own counter: it reads its
// generation, counter + 1, at start (op_generation) and stores it back when
// it finishes (finish_op), and block 0 also stores it into the counters of
// the blocks this launch does not have, which a later, larger grid reads.
// Nothing of this launch reads another block's counter, so the blocks never
// wait for each other to finish, and the next kernel of the kind, started
// after this one ended, reads the same value in every block. The host never
// passes a generation, so a replayed graph keeps counting.
// Every grid fits the counters: ep_grid_budget clamps the EP grids to
// kMaxLaunchBlocks, allreduce_blocks and rmsnorm_blocks to kMaxAllReduceBlocks.
static_assert(kMaxAllReduceBlocks <= kMaxLaunchBlocks, "a generation counter for every block of every grid");
RC_DEVICE uint64_t op_generation(const Env& env, int op) {
  return *env.layout.counter(env.sig[env.rank], op, blockIdx.x) + 1;
}

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

// The first thread to fail leaves one word for the host: a timeout
// (encode_timeout) or a bad handle value (encode_bad_handle).
RC_DEVICE void record_error(const Env& env, uint64_t word) {
  if (load_relaxed_sys(env.error) == 0) store_release_sys(env.error, word);
}

// Bounded wait of one thread until ready() holds, for op `op` of generation
// gen on `peer`. False on timeout, or once another thread has failed, so a
// broken op drains in one timeout, not one per wait.
template <typename Ready>
RC_DEVICE bool wait_until(const Env& env, uint64_t gen, int op, int peer, Ready ready) {
  if (ready()) return true;
  const uint64_t start = timer_ticks();
  for (uint32_t spin = 1;; ++spin) {
    spin_pause();
    if (ready()) return true;
    if ((spin & 127) == 0) {
      if (load_relaxed_sys(env.error) != 0) return false;
      if (timer_ticks() - start > env.timeout_ticks) {
        record_error(env, encode_timeout(op, peer, gen));
        return false;
      }
    }
  }
}

// Bounded wait for `*flag >= gen` (why `>=`: protocol.h, at HeadSlot).
RC_DEVICE bool wait_flag(const Env& env, const uint64_t* flag, uint64_t gen, int op, int peer) {
  return wait_until(env, gen, op, peer, [&] { return load_acquire_sys(flag) >= gen; });
}

RC_DEVICE uint32_t all_ranks(const Env& env) { return (1u << env.world) - 1; }
RC_DEVICE uint32_t peer_ranks(const Env& env) { return all_ranks(env) & ~(1u << env.rank); }

// Block-wide: thread r waits for flag_of(r), for every rank r in `ranks`.
// True on every thread when all arrived.
template <typename FlagOf>
RC_DEVICE bool block_wait_ranks(const Env& env, uint64_t gen, int op, uint32_t ranks, FlagOf flag_of) {
  bool ok = true;
  const int r = threadIdx.x;
  if (r < env.world && (ranks >> r & 1u)) ok = wait_flag(env, flag_of(r), gen, op, r);
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
RC_DEVICE bool exchange_phase(const Env& env, uint64_t gen, int op, int phase, int b, bool ok = true) {
  const Layout& L = env.layout;
  const int me = env.rank;
  block_sync();
  if (ok) block_signal_ranks(env, gen, peer_ranks(env), [&](int r) { return L.ar_flag(env.sig[r], gen, phase, me, b); });
  return ok && block_wait_ranks(env, gen, op, peer_ranks(env),
                                [&](int r) { return L.ar_flag(env.sig[me], gen, phase, r, b); });
}

}  // namespace gpu
}  // namespace rdna4_comm
