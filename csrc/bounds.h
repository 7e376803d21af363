// The protocol's bounds: the largest communicator, routing and grids the
// transports accept, and the sizes the heap is laid out in. Plain C++ for
// every transport and the kernels (qualifiers.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rdna4_comm {

// Destination sets are uint32 bitmasks.
constexpr int kMaxWorld = 32;
// Device kernels keep per-destination state in fixed shared-memory arrays.
constexpr int kMaxGpuWorld = 8;
constexpr int kMaxTopk = 64;
// Tokens per rank on the GPU transport, so that a row's index fits the
// words that carry one: a tally word's count (flags.h) and a bad-handle
// word's index (error_words.h), each checked there.
constexpr int64_t kMaxGpuTokensPerRank = int64_t(1) << 18;
// all_reduce flag slots per (parity, phase, source): bounds the grid size.
constexpr int kMaxAllReduceBlocks = 256;
// Blocks of any GPU launch: each has its own generation counter (Layout::counter).
constexpr int kMaxLaunchBlocks = 256;
constexpr int kProbeBytes = 4096;
// Every heap region, and so every all_reduce slot, starts at a multiple of this.
constexpr size_t kAlign = 256;
// Stale peer reads were observed on gfx1201 with small reused cached IPC
// allocations; every exported GPU allocation is at least this large.
constexpr size_t kMinGpuAllocation = size_t(2) << 20;

}  // namespace rdna4_comm
