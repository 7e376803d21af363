// Device kernels of the GPU transport: all_reduce (one-shot, two-shot),
// dispatch, combine and the init-time P2P probe. No torch headers: this file
// compiles as CUDA (nvcc) and as HIP (clang -x hip) from the same source.
//
// Memory-ordering protocol, used by every kernel:
//  * Push, poll locally: a rank writes payload and flags into the READER's
//    memory and spins only on its own memory. Posted writes are cheap over
//    PCIe and NVLink; remote reads would be round trips.
//  * Publication: a block's payload stores, then block_sync(), then one
//    thread per flag issues a system-scope release store of the generation
//    (with any slot metadata stored before it by that same thread).
//  * Waiting: one thread per flag polls with system-scope acquire loads until
//    flag >= gen, then a block barrier hands the observation to the block.
//  * Every flag slot has exactly one writer; no peer atomics anywhere.
//  * Generations come from this rank's own counter, read at kernel start and
//    advanced by the last block to finish: graph replays keep counting.
//  * Every spin is bounded; a timeout is recorded in host-mapped memory and
//    the kernel winds down without touching peers again.
#define RC_KERNELS_ONLY
#include "kernels.h"

namespace rdna4_comm {
namespace gpu {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxWarps = kThreads / 32;
constexpr int kUnroll = 4;

// ------------------------------------------------------------- bookkeeping

RC_DEVICE uint64_t op_generation(const Env& env, int op) {
  return *env.layout.counter(env.sig[env.rank], op) + 1;
}

// The last block to get here advances the op's generation for the next launch.
RC_DEVICE void finish_op(const Env& env, int op, uint64_t gen) {
  block_sync();
  if (threadIdx.x == 0) {
    char* sig = env.sig[env.rank];
    fence_device();
    auto* done = reinterpret_cast<unsigned long long*>(env.layout.block_counter(sig, op));
    if (atomicAdd(done, 1ull) == gridDim.x - 1) {
      *done = 0;
      *env.layout.counter(sig, op) = gen;
      fence_device();
    }
  }
}

RC_DEVICE void record_timeout(const Env& env, int op, int peer, uint64_t gen) {
  if (load_relaxed_sys(env.error) == 0) store_release_sys(env.error, encode_timeout(op, peer, gen));
}

// Bounded wait of one thread for `*flag >= gen`. False on timeout, or once
// another thread has failed (so a broken op drains in one timeout, not many).
RC_DEVICE bool wait_flag(const Env& env, const uint64_t* flag, uint64_t gen, int op, int peer) {
  if (load_acquire_sys(flag) >= gen) return true;
  const uint64_t start = timer_ticks();
  for (uint32_t spin = 1;; ++spin) {
    spin_pause();
    if (load_acquire_sys(flag) >= gen) return true;
    if ((spin & 127) == 0) {
      if (load_relaxed_sys(env.error) != 0) return false;
      if (timer_ticks() - start > env.timeout_ticks) {
        record_timeout(env, op, peer, gen);
        return false;
      }
    }
  }
}

RC_DEVICE uint32_t all_ranks(const Env& env) { return (1u << env.world) - 1; }
RC_DEVICE uint32_t peer_ranks(const Env& env) { return all_ranks(env) & ~(1u << env.rank); }

// Block-wide: wait for flag_of(r) from every rank r in `ranks`. True when all arrived.
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

// ------------------------------------------------------------------ copies

// A pointer per rank, indexed only with unrolled loops so it stays in registers.
struct ConstRankPtrs {
  const char* p[kMaxGpuWorld];
};

template <typename T>
struct VecTag {
  using type = T;
};

// Calls f(VecTag<V>{}) for the vector type of `vec` bytes (16, 8, 4, 2, 1).
template <typename F>
RC_DEVICE void with_vector(int vec, F&& f) {
  switch (vec) {
    case 16: f(VecTag<uint4>{}); break;
    case 8: f(VecTag<uint2>{}); break;
    case 4: f(VecTag<uint32_t>{}); break;
    case 2: f(VecTag<uint16_t>{}); break;
    default: f(VecTag<uint8_t>{}); break;
  }
}

// Rows [0, nrows) of nvec vectors each, copied by the whole block over the
// flattened (row, vector) space: one row still keeps every thread busy, and
// many rows keep kUnroll loads in flight per thread. src_of(r) is the source
// row, mask_of(r) its destinations and dst_of(r, d) the row at destination d:
// the row is loaded once and stored to each. Sizes stay below 2^32 vectors.
template <typename V, typename SrcOf, typename MaskOf, typename DstOf>
RC_DEVICE void block_copy_rows(int64_t nrows, int64_t nvec, SrcOf src_of, MaskOf mask_of, DstOf dst_of) {
  const uint32_t total = uint32_t(nrows * nvec), n = uint32_t(nvec), nt = blockDim.x;
  for (uint32_t i0 = threadIdx.x; i0 < total; i0 += nt * kUnroll) {
    V val[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * nt, row = i / n;
      if (i < total) val[u] = reinterpret_cast<const V*>(src_of(row))[i - row * n];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * nt, row = i / n;
      if (i >= total) continue;
      const uint32_t mask = mask_of(row);
#pragma unroll
      for (int d = 0; d < kMaxGpuWorld; ++d)
        if (mask >> d & 1u) reinterpret_cast<V*>(dst_of(row, d))[i - row * n] = val[u];
    }
  }
}

// One contiguous range, copied by the whole block.
RC_DEVICE void block_copy(char* dst, const char* src, int64_t bytes, int vec) {
  with_vector(vec, [&](auto tag) {
    using V = typename decltype(tag)::type;
    block_copy_rows<V>(
        1, bytes / vec, [&](uint32_t) { return src; }, [](uint32_t) { return 1u; },
        [&](uint32_t, int) { return dst; });
  });
}

// -------------------------------------------------------------- reductions

template <DType D> struct Elem;
template <> struct Elem<DType::kF32> {
  using Raw = float;
  static RC_DEVICE float load(Raw v) { return v; }
  static RC_DEVICE Raw store(float v) { return v; }
};
template <> struct Elem<DType::kBF16> {
  using Raw = uint16_t;
  static RC_DEVICE float load(Raw v) { return bf16_bits_to_float(v); }
  static RC_DEVICE Raw store(float v) { return float_to_bf16_bits(v); }
};
template <> struct Elem<DType::kF16> {
  using Raw = uint16_t;
  static RC_DEVICE float load(Raw v) { return f16_bits_to_float(v); }
  static RC_DEVICE Raw store(float v) { return float_to_f16_bits(v); }
};

// Vector v of the sum over the sources selected by `mask`, in ascending rank
// order, in fp32, rounded once; zeros when the mask is empty.
template <DType D, typename V>
RC_DEVICE V sum_one(const ConstRankPtrs& src, uint32_t mask, uint32_t v) {
  using E = Elem<D>;
  constexpr int N = sizeof(V) / sizeof(typename E::Raw);
  union Pack {
    V v;
    typename E::Raw e[N];
  };
  float acc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = 0.f;
  bool first = true;
#pragma unroll
  for (int r = 0; r < kMaxGpuWorld; ++r) {
    if (!(mask >> r & 1u)) continue;
    Pack p;
    p.v = reinterpret_cast<const V*>(src.p[r])[v];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = first ? E::load(p.e[k]) : acc[k] + E::load(p.e[k]);
    first = false;
  }
  Pack o;
  if (first) {
    o.v = V{};
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) o.e[k] = E::store(acc[k]);
  }
  return o.v;
}

// Vectors [0, total) of a block's sums, thread by thread, kUnroll vectors in
// flight per thread. row_of(i, src, out) selects vector i's sources (mask
// returned) and points `out` at its output vector.
template <DType D, typename V, typename RowOf>
RC_DEVICE void block_sum(uint32_t total, RowOf row_of) {
  const uint32_t nt = blockDim.x;
  for (uint32_t i0 = threadIdx.x; i0 < total; i0 += nt * kUnroll) {
    V res[kUnroll];
    V* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * nt;
      if (i >= total) continue;
      ConstRankPtrs src;
      uint32_t v;
      const uint32_t mask = row_of(i, src, dst[u], v);
      res[u] = sum_one<D, V>(src, mask, v);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * nt < total) *dst[u] = res[u];
  }
}

template <DType D, typename V>
RC_DEVICE void sum_vectors(char* out, const ConstRankPtrs& src, uint32_t mask, int64_t begin, int64_t end) {
  if (end <= begin) return;
  block_sum<D, V>(uint32_t(end - begin), [&](uint32_t i, ConstRankPtrs& s, V*& dst, uint32_t& v) {
    s = src;
    v = uint32_t(begin + i);
    dst = reinterpret_cast<V*>(out) + v;
    return mask;
  });
}

// Element range [e0, e1) of a sum: 16-byte vectors where everything is
// aligned, single elements for the rest.
template <DType D>
RC_DEVICE void sum_elements(char* out, const ConstRankPtrs& src, uint32_t mask, int64_t e0, int64_t e1,
                            bool aligned) {
  using Raw = typename Elem<D>::Raw;
  constexpr int kPerVec = 16 / sizeof(Raw);
  int64_t scalar_from = e0;
  if (aligned && e0 % kPerVec == 0) {
    const int64_t v1 = e1 / kPerVec;
    sum_vectors<D, uint4>(out, src, mask, e0 / kPerVec, v1);
    scalar_from = v1 * kPerVec > e0 ? v1 * kPerVec : e0;
  }
  sum_vectors<D, Raw>(out, src, mask, scalar_from, e1);
}

template <DType D>
struct DTypeTag {
  static constexpr DType value = D;
};

// Calls f(DTypeTag<d>{}) so one generic body serves every element type.
template <typename F>
RC_DEVICE void with_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kF32: f(DTypeTag<DType::kF32>{}); break;
    case DType::kBF16: f(DTypeTag<DType::kBF16>{}); break;
    default: f(DTypeTag<DType::kF16>{}); break;
  }
}

RC_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// -------------------------------------------------------------- all_reduce

// Element range of block b when n elements are split into `blocks` pieces of
// whole 16-byte vectors.
RC_DEVICE void block_range(int64_t n, int elt, int b, int blocks, int64_t* e0, int64_t* e1) {
  const int64_t per_vec = 16 / elt;
  const int64_t per = ceil_div(ceil_div(n, blocks), per_vec) * per_vec;
  *e0 = per * b < n ? per * b : n;
  *e1 = per * (b + 1) < n ? per * (b + 1) : n;
}

__global__ void __launch_bounds__(kThreads) all_reduce_kernel(Env env, AllReduceArgs a) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, b = blockIdx.x;
  const uint64_t gen = op_generation(env, kOpAllReduce);
  const int elt = a.dtype == DType::kF32 ? 4 : 2;
  const char* in = static_cast<const char*>(a.in);
  char* out = static_cast<char*>(a.out);
  const bool aligned = aligned16(in) && aligned16(out);

  // One-shot: the whole input is one share, owned by everyone. Two-shot:
  // rank o owns elements [o*q, o*q + share(o)) (allreduce_share).
  const int64_t q = a.one_shot ? a.n : allreduce_share(a.n, W, elt);
  auto share_len = [&](int o) {
    const int64_t s = a.n - (a.one_shot ? 0 : o * q);
    return s < 0 ? int64_t(0) : (s < q ? s : q);
  };
  auto share_begin = [&](int o) { return a.one_shot ? int64_t(0) : o * q; };
  // Ranges start on 16-byte boundaries; whole-vector ranges of aligned
  // tensors copy in 16-byte vectors, the rest element by element.
  auto vector_bytes = [&](int64_t elems) { return aligned && elems * elt % 16 == 0 ? 16 : elt; };

  // Phase 0: push this block's part of every peer's share into its inbox.
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    int64_t e0, e1;
    block_range(share_len(p), elt, b, gridDim.x, &e0, &e1);
    block_copy(L.ar_slot(env.data[p], gen, me) + e0 * elt, in + (share_begin(p) + e0) * elt, (e1 - e0) * elt,
               vector_bytes(e1 - e0));
  }
  block_sync();
  block_signal_ranks(env, gen, peer_ranks(env), [&](int r) { return L.ar_flag(env.sig[r], gen, 0, me, b); });
  bool ok = block_wait_ranks(env, gen, kOpAllReduce, peer_ranks(env),
                             [&](int r) { return L.ar_flag(env.sig[me], gen, 0, r, b); });

  // Reduce this block's part of our own share, rank by rank.
  int64_t e0, e1;
  block_range(share_len(me), elt, b, gridDim.x, &e0, &e1);
  const int64_t mine = share_begin(me);
  if (ok) {
    ConstRankPtrs src{};
#pragma unroll
    for (int r = 0; r < kMaxGpuWorld; ++r)
      if (r < W) src.p[r] = (r == me ? in + mine * elt : L.ar_slot(env.data[me], gen, r)) + e0 * elt;
    char* dst = out + (mine + e0) * elt;
    with_dtype(a.dtype, [&](auto d) {
      sum_elements<decltype(d)::value>(dst, src, all_ranks(env), 0, e1 - e0, aligned);
    });
  }
  if (!a.one_shot) {
    // Phase 1: hand the reduced part to every peer, then collect theirs.
    block_sync();
    if (ok) {
      const uint32_t peers = peer_ranks(env);
      const char* reduced = out + (mine + e0) * elt;
      with_vector(vector_bytes(e1 - e0), [&](auto tag) {
        using V = typename decltype(tag)::type;
        block_copy_rows<V>(
            1, (e1 - e0) * elt / int64_t(sizeof(V)), [&](uint32_t) { return reduced; },
            [&](uint32_t) { return peers; },
            [&](uint32_t, int p) { return L.ar_gather_slot(env.data[p], gen, me) + e0 * elt; });
      });
    }
    block_sync();
    if (ok) block_signal_ranks(env, gen, peer_ranks(env), [&](int r) { return L.ar_flag(env.sig[r], gen, 1, me, b); });
    ok = ok && block_wait_ranks(env, gen, kOpAllReduce, peer_ranks(env),
                                [&](int r) { return L.ar_flag(env.sig[me], gen, 1, r, b); });
    if (ok) {
      for (int o = 0; o < W; ++o) {
        if (o == me) continue;
        int64_t f0, f1;
        block_range(share_len(o), elt, b, gridDim.x, &f0, &f1);
        block_copy(out + (share_begin(o) + f0) * elt, L.ar_gather_slot(env.data[me], gen, o) + f0 * elt,
                   (f1 - f0) * elt, vector_bytes(f1 - f0));
      }
    }
  }
  finish_op(env, kOpAllReduce, gen);
}

// ------------------------------------------------------------------ routing

template <typename IdxT, int KF>
struct Routing {
  const IdxT* idx;
  int K;
  int64_t num_experts, epr;
  RC_DEVICE int topk() const { return KF > 0 ? KF : K; }
  RC_DEVICE uint32_t mask(int64_t t) const {
    uint32_t m = 0;
    const IdxT* row = idx + t * topk();
    if constexpr (KF > 0) {
      // Top-k fast path: the slot count is a compile-time constant, so the
      // loads are unrolled and all in flight at once.
#pragma unroll
      for (int k = 0; k < KF; ++k) {
        const int o = expert_owner(int64_t(row[k]), num_experts, epr);
        if (o >= 0) m |= 1u << o;
      }
    } else {
      for (int k = 0; k < K; ++k) {
        const int o = expert_owner(int64_t(row[k]), num_experts, epr);
        if (o >= 0) m |= 1u << o;
      }
    }
    return m;
  }
};

// Within-batch positions: for each destination d, the number of earlier
// tokens of the batch (threads below this one) that go to d, plus run[d];
// then run[d] grows by the batch's total. Ballots over each warp, warp totals
// through shared memory.
RC_DEVICE void batch_positions(uint32_t m, int W, int32_t (&pos)[kMaxGpuWorld], int32_t (*warp_tot)[kMaxGpuWorld],
                               int32_t* run) {
  const int ws = warp_size(), lane = lane_id(), warp = threadIdx.x / ws, nw = blockDim.x / ws;
  const uint64_t below = lane == 0 ? 0ull : (~0ull >> (64 - lane));
#pragma unroll
  for (int d = 0; d < kMaxGpuWorld; ++d) {
    if (d >= W) break;
    const uint64_t bal = warp_ballot(m >> d & 1u);
    pos[d] = popcount64(bal & below);
    if (lane == 0) warp_tot[warp][d] = popcount64(bal);
  }
  block_sync();
#pragma unroll
  for (int d = 0; d < kMaxGpuWorld; ++d) {
    if (d >= W) break;
    int32_t off = run[d];
    for (int w = 0; w < warp; ++w) off += warp_tot[w][d];
    pos[d] += off;
  }
  block_sync();
  if (int(threadIdx.x) < W)
    for (int w = 0; w < nw; ++w) run[threadIdx.x] += warp_tot[w][threadIdx.x];
  block_sync();
}

// Receive items are (source, chunk) pairs ordered chunk-major, so receivers
// take chunks in the order senders produce them. Round c holds the sources
// with more than c chunks.
RC_DEVICE void item_to_chunk(int64_t item, const int32_t* nchunks, int W, int* src, int64_t* chunk) {
  auto before = [&](int64_t c) {
    int64_t n = 0;
    for (int s = 0; s < W; ++s) n += nchunks[s] < c ? nchunks[s] : c;
    return n;
  };
  int64_t lo = 0, hi = kEpTargetChunks;  // largest c with before(c) <= item
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (before(mid) <= item) lo = mid; else hi = mid - 1;
  }
  int64_t k = item - before(lo);
  for (int s = 0; s < W; ++s) {
    if (nchunks[s] <= lo) continue;
    if (k-- == 0) {
      *src = s;
      *chunk = lo;
      return;
    }
  }
}

// ----------------------------------------------------------------- dispatch

// A receiver waits for a group of its items' flags together and then copies
// them, so tiny chunks (one token each up to T = 128) do not each cost a wait
// and a barrier; groups hold about kGroupRows tokens' worth of chunks.
constexpr int kMaxGroup = 32;
constexpr int64_t kGroupRows = 64;

RC_DEVICE int group_size(int64_t chunk_tokens) {
  const int64_t g = kGroupRows / chunk_tokens;
  return int(g < 1 ? 1 : (g > kMaxGroup ? kMaxGroup : g));
}

// The (source, chunk) items of every source, and the group size that fits
// the largest chunk among them. A source listed with no chunks (this rank:
// its own rows never pass through the heap) has no items.
struct Items {
  int64_t count;
  int group;
};
RC_DEVICE Items source_items(const int32_t* nchunks, const int32_t* ntok, int W) {
  int64_t count = 0, cmax = 1;
  for (int s = 0; s < W; ++s) {
    if (nchunks[s] == 0) continue;
    count += nchunks[s];
    cmax = ep_chunk_tokens(ntok[s]) > cmax ? ep_chunk_tokens(ntok[s]) : cmax;
  }
  return {count, group_size(cmax)};
}

struct DispatchShared {
  int32_t start[kEpTargetChunks + 1][kMaxGpuWorld];  // sender: row prefix per chunk and destination
  int32_t run[kMaxGpuWorld];
  int32_t warp_tot[kMaxWarps * 2][kMaxGpuWorld];
  uint32_t batch_mask[kThreads];
  int32_t batch_pos[kThreads][kMaxGpuWorld];
  int32_t ntok[kMaxGpuWorld], nrows[kMaxGpuWorld], nchunks[kMaxGpuWorld], offset[kMaxGpuWorld + 1];
  int32_t item_src[kMaxGroup];
  uint32_t item_row_start[kMaxGroup], item_nrows[kMaxGroup];
};

// Where one dispatched row's routing goes: the destination's heap row, or,
// for this rank's own rows, the output tensors themselves.
struct RowMeta {
  int32_t* ids;      // [K] local expert ids
  float* weights;    // [K], or nullptr when the op has no weights
  int32_t* src;      // the row's source slot
  int32_t src_value;
};

template <typename IdxT, int KF>
RC_DEVICE void dispatch_send(const Env& env, const DispatchArgs& a, DispatchShared& sh, uint64_t gen, int b,
                             int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x, nt = blockDim.x;
  const Routing<IdxT, KF> route{static_cast<const IdxT*>(a.topk_idx), int(L.topk), a.num_experts,
                                a.num_experts / W};
  const int K = route.topk();
  const int64_t T = a.ntok, C = ep_chunk_tokens(T), nch = ep_num_chunks(T);
  const int64_t payload = L.hidden * L.elt;
  const char* x = static_cast<const char*>(a.x);

  // Rows per (chunk, destination) over all tokens, then prefix sums: every
  // sender block derives the same table, so no block waits for another.
  for (int i = tid; i < (kEpTargetChunks + 1) * kMaxGpuWorld; i += nt) (&sh.start[0][0])[i] = 0;
  block_sync();
  for (int64_t t = tid; t < T; t += nt) {
    const uint32_t m = route.mask(t);
    for (int d = 0; d < W; ++d)
      if (m >> d & 1u) atomicAdd(&sh.start[t / C][d], 1);
  }
  block_sync();
  if (tid < W) {
    int32_t run = 0;
    for (int64_t c = 0; c <= nch; ++c) {
      const int32_t v = c < nch ? sh.start[c][tid] : 0;
      sh.start[c][tid] = run;
      run += v;
    }
  }
  block_sync();
  // The header tells each destination how many tokens (hence chunks) and rows to expect.
  if (b == 0 && tid < W) {
    HeadSlot* head = L.ep_head(env.sig[tid], gen, me);
    head->ntok = uint32_t(T);
    head->nrows = uint32_t(sh.start[nch][tid]);
    store_release_sys(&head->gen, gen);
  }
  char* out_x = static_cast<char*>(a.out_x);
  // This rank's own rows skip the heap: they go straight to the output, after
  // the rows of every lower rank, whose counts come from their headers.
  int64_t self_base = 0;
  const uint32_t lower = (1u << me) - 1;
  auto head_of = [&](int s) { return L.ep_head(env.sig[me], gen, s); };
  auto add_lower_rows = [&] {  // each count is read by the thread that acquired its header
    if (tid < me) sh.nrows[tid] = int32_t(head_of(tid)->nrows);
    block_sync();
    for (int s = 0; s < me; ++s) self_base += sh.nrows[s];
  };

  // Rows of chunk c for the destinations in `dests`: each token's row is
  // loaded once and stored to every destination it has among them.
  auto send_chunk = [&](int64_t c, uint32_t dests) {
    const int64_t t_end = (c + 1) * C < T ? (c + 1) * C : T;
    if (tid < W) sh.run[tid] = sh.start[c][tid];
    block_sync();
    for (int64_t t0 = c * C; t0 < t_end; t0 += nt) {
      const int64_t t = t0 + tid;
      const uint32_t m = t < t_end ? route.mask(t) : 0u;
      if (t < t_end) a.out_send_mask[t] = int32_t(m);
      int32_t pos[kMaxGpuWorld];
      batch_positions(m, W, pos, sh.warp_tot, sh.run);
      sh.batch_mask[tid] = m & dests;
#pragma unroll
      for (int d = 0; d < kMaxGpuWorld; ++d)
        if (d < W) sh.batch_pos[tid][d] = pos[d];
      block_sync();
      const int batch = int(t_end - t0 < nt ? t_end - t0 : nt);
      auto row_in = [&](uint32_t r, int d) {
        return d == me ? out_x + (self_base + sh.batch_pos[r][d]) * payload
                       : L.ep_row(env.data[d], gen, me, sh.batch_pos[r][d]);
      };
      auto meta_of = [&](uint32_t r, int d) {
        if (d == me) {
          const int64_t o = self_base + sh.batch_pos[r][d];
          return RowMeta{a.out_idx + o * K, a.out_weights ? a.out_weights + o * K : nullptr, a.out_recv_src + o,
                         int32_t(me * L.cap + t0 + r)};
        }
        char* row = row_in(r, d);
        return RowMeta{L.row_ids(row), L.row_weights(row), L.row_token(row), int32_t(t0 + r)};
      };
      with_vector(vec, [&](auto tag) {
        using V = typename decltype(tag)::type;
        block_copy_rows<V>(
            batch, payload / vec, [&](uint32_t r) { return x + (t0 + r) * payload; },
            [&](uint32_t r) { return sh.batch_mask[r]; }, row_in);
      });
      // Routing metadata of every (token, slot): local id where the slot's
      // expert lives on the destination, else -1 and weight 0.
      for (int i = tid; i < batch * K; i += nt) {
        const int r = i / K, k = i - r * K;
        const uint32_t tm = sh.batch_mask[r];
        if (tm == 0) continue;
        const int64_t tok = t0 + r;
        const int64_t e = int64_t(route.idx[tok * K + k]);
        const int owner = expert_owner(e, a.num_experts, route.epr);
        const float w = a.topk_weights ? a.topk_weights[tok * K + k] : 0.f;
#pragma unroll
        for (int d = 0; d < kMaxGpuWorld; ++d) {
          if (!(tm >> d & 1u)) continue;
          const RowMeta m = meta_of(r, d);
          m.ids[k] = owner == d ? int32_t(e - d * route.epr) : -1;
          if (m.weights) m.weights[k] = owner == d ? w : 0.f;
        }
      }
      for (int r = tid; r < batch; r += nt) {
        const uint32_t tm = sh.batch_mask[r];
#pragma unroll
        for (int d = 0; d < kMaxGpuWorld; ++d) {
          if (!(tm >> d & 1u)) continue;
          const RowMeta m = meta_of(r, d);
          *m.src = m.src_value;
        }
      }
      block_sync();
    }
  };

  // Headers that have already arrived (a poll, not a wait) let the block
  // send its first chunk to every destination in one pass.
  bool have_base = block_all(tid >= me || load_acquire_sys(&head_of(tid)->gen) >= gen);
  if (have_base) add_lower_rows();
  for (int64_t c = b; c < nch; c += nblocks) {
    send_chunk(c, have_base ? all_ranks(env) : peer_ranks(env));
    if (tid < W && tid != me) {  // chunk c to every peer, empty or not
      ChunkSlot* slot = L.ep_chunk(env.sig[tid], gen, me, c);
      slot->row_start = uint32_t(sh.start[c][tid]);
      slot->nrows = uint32_t(sh.start[c + 1][tid] - sh.start[c][tid]);
      store_release_sys(&slot->gen, gen);
    }
    if (!have_base) {
      // Otherwise the block's first chunk goes to the peers before the block
      // waits for the headers, and to this rank's output after: no peer waits
      // for that chunk behind this wait. Headers are published before any
      // wait, so with every block resident (the launch policy) it cannot
      // deadlock.
      if (!block_wait_ranks(env, gen, kOpDispatch, lower, [&](int s) { return &head_of(s)->gen; })) return;
      add_lower_rows();
      have_base = true;
      send_chunk(c, 1u << me);
    }
  }
}

RC_DEVICE void dispatch_recv(const Env& env, const DispatchArgs& a, DispatchShared& sh, uint64_t gen, int j,
                             int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x, nt = blockDim.x;
  const int64_t payload = L.hidden * L.elt, K = L.topk, cap = L.cap, nvec = payload / vec;
  char* out_x = static_cast<char*>(a.out_x);

  if (!block_wait_ranks(env, gen, kOpDispatch, all_ranks(env), [&](int s) { return &L.ep_head(env.sig[me], gen, s)->gen; }))
    return;
  if (tid < W) {
    const HeadSlot* head = L.ep_head(env.sig[me], gen, tid);
    sh.ntok[tid] = int32_t(head->ntok);
    sh.nrows[tid] = int32_t(head->nrows);
    sh.nchunks[tid] = tid == me ? 0 : int32_t(ep_num_chunks(head->ntok));  // own rows: written by senders
  }
  block_sync();
  if (tid == 0) {
    sh.offset[0] = 0;
    for (int s = 0; s < W; ++s) sh.offset[s + 1] = sh.offset[s] + sh.nrows[s];
  }
  block_sync();
  if (j == 0 && tid < W) {
    a.out_counts[tid] = sh.nrows[tid];
    a.out_src_tokens[tid] = sh.ntok[tid];
  }

  const Items plan = source_items(sh.nchunks, sh.ntok, W);
  const int64_t items = plan.count;
  const int G = plan.group;
  // This block owns items j, j + nblocks, ...; it takes G of them at a time.
  for (int64_t first = j; first < items; first += int64_t(nblocks) * G) {
    bool got = true;
    if (tid < G) {
      const int64_t item = first + int64_t(tid) * nblocks;
      sh.item_nrows[tid] = 0;
      if (item < items) {
        int s;
        int64_t c;
        item_to_chunk(item, sh.nchunks, W, &s, &c);
        const ChunkSlot* slot = L.ep_chunk(env.sig[me], gen, s, c);
        got = wait_flag(env, &slot->gen, gen, kOpDispatch, s);
        sh.item_src[tid] = s;
        sh.item_row_start[tid] = got ? slot->row_start : 0;
        sh.item_nrows[tid] = got ? slot->nrows : 0;
      }
    }
    if (!block_all(got)) return;
    for (int g = 0; g < G; ++g) {
      const int64_t nr = sh.item_nrows[g];
      if (nr == 0) continue;
      const int s = sh.item_src[g];
      const int64_t r0 = sh.item_row_start[g], o0 = sh.offset[s] + r0;
      auto row = [&](int64_t r) { return L.ep_row(env.data[me], gen, s, r0 + r); };
      with_vector(vec, [&](auto tag) {
        using V = typename decltype(tag)::type;
        block_copy_rows<V>(
            nr, nvec, [&](uint32_t r) { return static_cast<const char*>(row(r)); }, [](uint32_t) { return 1u; },
            [&](uint32_t r, int) { return out_x + (o0 + r) * payload; });
      });
      for (int64_t i = tid; i < nr * K; i += nt) {
        const int64_t r = i / K, k = i - r * K;
        a.out_idx[(o0 + r) * K + k] = L.row_ids(row(r))[k];
        if (a.out_weights) a.out_weights[(o0 + r) * K + k] = L.row_weights(row(r))[k];
      }
      for (int64_t r = tid; r < nr; r += nt) a.out_recv_src[o0 + r] = int32_t(s * cap + *L.row_token(row(r)));
    }
    block_sync();
  }

  // Padding rows after the received ones, a contiguous share per block:
  // zeros, -1 ids, 0 weights, -1 source.
  const int64_t pad0 = sh.offset[W], npad = int64_t(W) * cap - pad0, per = ceil_div(npad, nblocks);
  const int64_t p0 = pad0 + int64_t(j) * per, p1 = p0 + per < pad0 + npad ? p0 + per : pad0 + npad;
  if (p1 > p0) {
    with_vector(vec, [&](auto tag) {
      using V = typename decltype(tag)::type;
      V* rows = reinterpret_cast<V*>(out_x + p0 * payload);
      for (int64_t i = tid; i < (p1 - p0) * nvec; i += nt) rows[i] = V{};
    });
    for (int64_t i = tid; i < (p1 - p0) * K; i += nt) {
      a.out_idx[p0 * K + i] = -1;
      if (a.out_weights) a.out_weights[p0 * K + i] = 0.f;
    }
    for (int64_t r = p0 + tid; r < p1; r += nt) a.out_recv_src[r] = -1;
  }
}

template <typename IdxT, int KF>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(Env env, DispatchArgs a, int send_blocks, int vec) {
  __shared__ DispatchShared sh;
  const uint64_t gen = op_generation(env, kOpDispatch);
  if (int(blockIdx.x) < send_blocks)
    dispatch_send<IdxT, KF>(env, a, sh, gen, blockIdx.x, send_blocks, vec);
  else
    dispatch_recv(env, a, sh, gen, blockIdx.x - send_blocks, gridDim.x - send_blocks, vec);
  finish_op(env, kOpDispatch, gen);
}

// ------------------------------------------------------------------ combine

struct CombineShared {
  int32_t count[kMaxGpuWorld], offset[kMaxGpuWorld + 1], ntok[kMaxGpuWorld], nchunks[kMaxGpuWorld];
  int32_t item_src[kMaxGroup], item_lo[kMaxGroup], item_hi[kMaxGroup];
  int64_t item_chunk[kMaxGroup];
  // Receiver: the row of y that holds this rank's own contribution to each
  // token of a group of chunks (a group never exceeds kMaxGpuChunkTokens).
  int32_t own_row[kMaxGpuChunkTokens];
};

// First row in [lo, hi) whose source token is >= t (rows are sorted by token).
RC_DEVICE int32_t lower_bound_token(const int32_t* recv_src, int32_t lo, int32_t hi, int64_t base, int64_t t) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (recv_src[mid] - base < t) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Rows [lo, hi) of y that came from source s's chunk c: dispatch lays each
// source's rows out in token order.
RC_DEVICE void chunk_rows(const CombineArgs& a, const CombineShared& sh, int64_t cap, int s, int64_t c, int32_t* lo,
                          int32_t* hi) {
  const int64_t C = ep_chunk_tokens(sh.ntok[s]), base = int64_t(s) * cap;
  const int32_t last_row = sh.offset[s] + sh.count[s];
  *lo = lower_bound_token(a.recv_src, sh.offset[s], last_row, base, c * C);
  *hi = lower_bound_token(a.recv_src, *lo, last_row, base, (c + 1) * C);
}

// Rows go back to their source's inbox, a group of (source, chunk) items at a
// time; each item's flag follows its rows.
RC_DEVICE void combine_send(const Env& env, const CombineArgs& a, CombineShared& sh, uint64_t gen, int b,
                            int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x;
  const int64_t payload = L.hidden * L.elt, cap = L.cap, nvec = payload / vec;
  const char* y = static_cast<const char*>(a.y);
  const Items plan = source_items(sh.nchunks, sh.ntok, W);
  const int64_t items = plan.count;
  const int G = plan.group;
  for (int64_t first = b; first < items; first += int64_t(nblocks) * G) {
    if (tid < G) {
      const int64_t item = first + int64_t(tid) * nblocks;
      sh.item_src[tid] = -1;
      if (item < items) {
        int s;
        int64_t c;
        item_to_chunk(item, sh.nchunks, W, &s, &c);
        sh.item_src[tid] = s;
        sh.item_chunk[tid] = c;
        chunk_rows(a, sh, cap, s, c, &sh.item_lo[tid], &sh.item_hi[tid]);
      }
    }
    block_sync();
    for (int g = 0; g < G; ++g) {
      const int s = sh.item_src[g];
      if (s < 0) continue;
      const int64_t lo = sh.item_lo[g];
      with_vector(vec, [&](auto tag) {
        using V = typename decltype(tag)::type;
        block_copy_rows<V>(
            sh.item_hi[g] - lo, nvec, [&](uint32_t r) { return y + (lo + r) * payload; },
            [](uint32_t) { return 1u; },
            [&](uint32_t r, int) { return L.cb_row(env.data[s], gen, me, a.recv_src[lo + r] - int64_t(s) * cap); });
      });
    }
    block_sync();
    if (tid < G && sh.item_src[tid] >= 0)
      store_release_sys(L.cb_flag(env.sig[sh.item_src[tid]], gen, me, sh.item_chunk[tid]), gen);
  }
}

// Each token's output: its rows from every destination rank, summed in
// ascending rank order (sum_one). Peers' rows come from the inbox; this
// rank's own come straight from y. Thread (g, r) of a group waits for chunk
// g's flag from peer r, while threads from kThreads / 2 (W * G never reaches
// them) locate each chunk's own rows.
static_assert(kMaxGpuWorld * kMaxGroup <= kThreads / 2, "combine waiters must leave the upper half-block free");
static_assert(kGroupRows <= kMaxGpuChunkTokens, "a group of small chunks must fit CombineShared::own_row");
template <DType D>
RC_DEVICE void combine_recv(const Env& env, const CombineArgs& a, CombineShared& sh, uint64_t gen, int j,
                            int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x, nt = blockDim.x;
  const int64_t payload = L.hidden * L.elt, own_base = int64_t(me) * L.cap;
  const int64_t T = a.ntok, C = ep_chunk_tokens(T), nch = ep_num_chunks(T);
  const int G = group_size(C);
  const char* y = static_cast<const char*>(a.y);
  char* out = static_cast<char*>(a.out);
  // Row 0 until mapped: a handle whose send_mask and recv_src disagree then
  // reads a wrong row of y, never memory outside it.
  for (int i = tid; i < kMaxGpuChunkTokens; i += nt) sh.own_row[i] = 0;
  for (int64_t first = j; first < nch; first += int64_t(nblocks) * G) {
    const int g = tid / W, r = tid - g * W;
    const int64_t c = first + int64_t(g) * nblocks;
    bool ok = true;
    if (g < G && c < nch && r != me) ok = wait_flag(env, L.cb_flag(env.sig[me], gen, r, c), gen, kOpCombine, r);
    const int q = tid - kThreads / 2;
    if (q >= 0 && q < G && first + int64_t(q) * nblocks < nch)
      chunk_rows(a, sh, L.cap, me, first + int64_t(q) * nblocks, &sh.item_lo[q], &sh.item_hi[q]);
    if (!block_all(ok)) return;
    for (int gg = 0; gg < G; ++gg) {
      const int64_t cc = first + int64_t(gg) * nblocks;
      if (cc >= nch) break;
      for (int32_t i = sh.item_lo[gg] + tid; i < sh.item_hi[gg]; i += nt) {
        const int64_t k = a.recv_src[i] - own_base - cc * C;
        if (k >= 0 && k < C) sh.own_row[gg * C + k] = i;
      }
    }
    block_sync();
    for (int gg = 0; gg < G; ++gg) {
      const int64_t cc = first + int64_t(gg) * nblocks;
      if (cc >= nch) break;
      const int64_t t0 = cc * C, t1 = (cc + 1) * C < T ? (cc + 1) * C : T;
      const int32_t* own = sh.own_row + gg * C;
      auto sum_rows = [&](auto v_tag) {
        using V = typename decltype(v_tag)::type;
        const uint32_t n = uint32_t(payload / sizeof(V));
        block_sum<D, V>(uint32_t((t1 - t0) * n), [&](uint32_t i, ConstRankPtrs& src, V*& dst, uint32_t& v) {
          const uint32_t row = i / n;
          const int64_t t = t0 + row;
          const uint32_t m = uint32_t(a.send_mask[t]);
#pragma unroll
          for (int rr = 0; rr < kMaxGpuWorld; ++rr)
            if (m >> rr & 1u) src.p[rr] = rr == me ? y + own[row] * payload : L.cb_row(env.data[me], gen, rr, t);
          v = i - row * n;
          dst = reinterpret_cast<V*>(out + t * payload) + v;
          return m;
        });
      };
      if (vec == 16) sum_rows(VecTag<uint4>{}); else sum_rows(VecTag<typename Elem<D>::Raw>{});
    }
  }
}

__global__ void __launch_bounds__(kThreads) combine_kernel(Env env, CombineArgs a, int send_blocks, int vec) {
  __shared__ CombineShared sh;
  const uint64_t gen = op_generation(env, kOpCombine);
  const int W = env.world, tid = threadIdx.x;
  if (tid < W) {
    sh.count[tid] = a.counts[tid];
    sh.ntok[tid] = a.src_tokens[tid];
    // Own rows are summed straight from y: no item carries them.
    sh.nchunks[tid] = tid == env.rank ? 0 : int32_t(ep_num_chunks(a.src_tokens[tid]));
  }
  block_sync();
  if (tid == 0) {
    sh.offset[0] = 0;
    for (int s = 0; s < W; ++s) sh.offset[s + 1] = sh.offset[s] + sh.count[s];
  }
  block_sync();
  if (int(blockIdx.x) < send_blocks) {
    combine_send(env, a, sh, gen, blockIdx.x, send_blocks, vec);
  } else {
    with_dtype(a.dtype, [&](auto d) {
      combine_recv<decltype(d)::value>(env, a, sh, gen, blockIdx.x - send_blocks, gridDim.x - send_blocks, vec);
    });
  }
  finish_op(env, kOpCombine, gen);
}

// -------------------------------------------------------------------- probe

RC_DEVICE uint32_t probe_word(int src, int dst, int i, uint64_t gen) {
  return (uint32_t(src) * 0x9E3779B1u) ^ (uint32_t(dst) * 0x85EBCA77u) ^ (uint32_t(i) * 0xC2B2AE3Du) ^
         uint32_t(gen * 0x27D4EB2Fu);
}

// corrupt_dst >= 0 (a test hook): this rank writes a wrong pattern to that peer.
__global__ void __launch_bounds__(kThreads) probe_kernel(Env env, int32_t* result, int corrupt_dst) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x;
  const uint64_t gen = op_generation(env, kOpProbe);
  constexpr int kWords = kProbeBytes / 4;
  __shared__ int32_t bad[kMaxGpuWorld];
  if (tid < W) bad[tid] = 0;
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    uint32_t* buf = reinterpret_cast<uint32_t*>(L.probe_buf(env.data[p], me));
    const uint32_t flip = p == corrupt_dst ? 1u : 0u;
    for (int i = tid; i < kWords; i += blockDim.x) buf[i] = probe_word(me, p, i, gen) ^ flip;
  }
  block_sync();
  block_signal_ranks(env, gen, peer_ranks(env), [&](int r) { return L.probe_flag(env.sig[r], me); });
  bool arrived = true;
  if (tid < W && tid != me) arrived = wait_flag(env, L.probe_flag(env.sig[me], tid), gen, kOpProbe, tid);
  if (tid < W && !arrived) bad[tid] = -1;
  block_sync();
  for (int s = 0; s < W; ++s) {
    if (s == me || bad[s] < 0) continue;
    const uint32_t* buf = reinterpret_cast<const uint32_t*>(L.probe_buf(env.data[me], s));
    int32_t wrong = 0;
    for (int i = tid; i < kWords; i += blockDim.x) wrong += buf[i] != probe_word(s, me, i, gen);
    if (wrong) atomicAdd(&bad[s], wrong);
  }
  block_sync();
  if (tid < W) result[tid] = bad[tid];
  finish_op(env, kOpProbe, gen);
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, int blocks, Stream s, Args... args) {
  RC_LAUNCH(kernel, blocks, kThreads, 0, s, args...);
}

int widest_vector(int64_t row_bytes, std::initializer_list<const void*> ptrs) {
  for (int v : {16, 8, 4, 2}) {
    bool ok = row_bytes % v == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % v == 0;
    if (ok) return v;
  }
  return 1;
}

}  // namespace

void launch_all_reduce(const Env& env, const AllReduceArgs& a, Stream s) {
  const int elt = a.dtype == DType::kF32 ? 4 : 2;
  const int64_t per_rank = a.one_shot ? a.n : allreduce_share(a.n, env.world, elt);
  launch(all_reduce_kernel, allreduce_blocks(per_rank * elt, env.sm_count), s, env, a);
}

void launch_dispatch(const Env& env, const DispatchArgs& a, Stream s) {
  const EpGrid g = dispatch_grid(a.ntok, env.world, env.sm_count);
  const int vec = widest_vector(env.layout.hidden * env.layout.elt, {a.x, a.out_x});
  const int blocks = g.send_blocks + g.recv_blocks;
  if (env.layout.topk == 8) {
    if (a.idx_is_int64) launch(dispatch_kernel<int64_t, 8>, blocks, s, env, a, g.send_blocks, vec);
    else launch(dispatch_kernel<int32_t, 8>, blocks, s, env, a, g.send_blocks, vec);
  } else {
    if (a.idx_is_int64) launch(dispatch_kernel<int64_t, 0>, blocks, s, env, a, g.send_blocks, vec);
    else launch(dispatch_kernel<int32_t, 0>, blocks, s, env, a, g.send_blocks, vec);
  }
}

void launch_combine(const Env& env, const CombineArgs& a, Stream s) {
  const EpGrid g = combine_grid(a.ntok, env.world, env.sm_count);
  const int vec = widest_vector(env.layout.hidden * env.layout.elt, {a.y, a.out});
  launch(combine_kernel, g.send_blocks + g.recv_blocks, s, env, a, g.send_blocks, vec);
}

void launch_probe(const Env& env, int32_t* result, int corrupt_dst, Stream s) {
  launch(probe_kernel, 1, s, env, result, corrupt_dst);
}

}  // namespace gpu
}  // namespace rdna4_comm
