// combine: sender blocks return every received row to its source's inbox;
// receiver blocks sum this rank's tokens over their destination ranks, own
// contributions straight from y.
#include "device/copy.cuh"
#include "device/reduce.cuh"
#include "device/routing.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

struct CombineShared {
  Sources src;  // from the handle: what dispatch received from every source
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

// The handle is user input. Its counts pick rows, chunks and flag slots,
// so every block checks them first (all blocks reach the same verdict); a
// bad one is recorded and the kernel then only publishes its flags (below).
RC_DEVICE bool handle_counts_ok(const Env& env, const CombineArgs& a) {
  const int s = threadIdx.x;
  const int64_t cap = env.layout.cap;
  bool ok = true;
  if (s < env.world) {
    const int32_t n = a.counts[s], t = a.src_tokens[s];
    if (n < 0 || n > cap) {
      ok = false;
      if (blockIdx.x == 0) record_error(env, encode_bad_handle(kHandleCounts, s, n));
    } else if (t < 0 || t > cap || (s == env.rank && t != a.ntok)) {
      ok = false;
      if (blockIdx.x == 0) record_error(env, encode_bad_handle(kHandleSrcTokens, s, t));
    }
  }
  return block_all(ok);
}

// Token of source s that row j of y answers, or -1 when the handle's value
// is not one (a bad value is skipped where it would pick a store, and
// recorded by check_handle_rows).
RC_DEVICE int64_t row_token(const CombineArgs& a, const Sources& src, int64_t cap, int s, int64_t j) {
  const int64_t t = a.recv_src[j] - int64_t(s) * cap;
  return t >= 0 && t < src.ntok[s] ? t : -1;
}

// With valid counts: the grid checks every row of recv_src (a source's token
// below the received rows, -1 past them) and every send_mask bit (ranks of
// the world only), each thread a strided share.
RC_DEVICE void check_handle_rows(const Env& env, const CombineArgs& a, const Sources& src) {
  const int W = env.world;
  const int64_t cap = env.layout.cap, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t j = first; j < int64_t(W) * cap; j += stride) {
    int s = 0;
    while (s < W && j >= src.offset[s + 1]) ++s;
    if (s < W ? row_token(a, src, cap, s, j) < 0 : a.recv_src[j] != -1)
      record_error(env, encode_bad_handle(kHandleRecvSrc, j, a.recv_src[j]));
  }
  for (int64_t t = first; t < a.ntok; t += stride)
    if (uint32_t(a.send_mask[t]) & ~all_ranks(env))
      record_error(env, encode_bad_handle(kHandleSendMask, t, a.send_mask[t]));
}

// Rows [lo, hi) of y that came from source s's chunk c: dispatch lays each
// source's rows out in token order.
RC_DEVICE void chunk_rows(const CombineArgs& a, const Sources& src, int64_t cap, int s, int64_t c, int32_t* lo,
                          int32_t* hi) {
  const int64_t C = ep_chunk_tokens(src.ntok[s]), base = int64_t(s) * cap;
  const int32_t last_row = src.offset[s] + src.nrows[s];
  *lo = lower_bound_token(a.recv_src, src.offset[s], last_row, base, c * C);
  *hi = lower_bound_token(a.recv_src, *lo, last_row, base, (c + 1) * C);
}

// Rows go back to their source's inbox, a group of (source, chunk) items at a
// time; each item's flag follows its rows.
RC_DEVICE void combine_sender(const Env& env, const CombineArgs& a, CombineShared& sh, uint64_t gen, int b,
                              int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x;
  const int64_t payload = L.hidden * L.elt, cap = L.cap;
  const char* y = static_cast<const char*>(a.y);
  const Items plan = source_items(sh.src, W);
  const int64_t items = plan.count;
  const int G = plan.group;
  for (int64_t first = b; first < items; first += int64_t(nblocks) * G) {
    if (tid < G) {
      const int64_t item = first + int64_t(tid) * nblocks;
      sh.item_src[tid] = -1;
      if (item < items) {
        int s;
        int64_t c;
        item_to_chunk(item, sh.src.nchunks, W, &s, &c);
        sh.item_src[tid] = s;
        sh.item_chunk[tid] = c;
        chunk_rows(a, sh.src, cap, s, c, &sh.item_lo[tid], &sh.item_hi[tid]);
      }
    }
    block_sync();
    for (int g = 0; g < G; ++g) {
      const int s = sh.item_src[g];
      if (s < 0) continue;
      const int64_t lo = sh.item_lo[g];
      with_vector(vec, [&](auto tag) {
        block_copy_rows<typename decltype(tag)::type>(
            sh.item_hi[g] - lo, payload / vec, [&](uint32_t r) { return y + (lo + r) * payload; },
            [&](uint32_t r) { return uint32_t(row_token(a, sh.src, cap, s, lo + r) >= 0); },
            [&](uint32_t r, int) { return L.combine_row(env.data[s], gen, me, row_token(a, sh.src, cap, s, lo + r)); });
      });
    }
    block_sync();
    if (tid < G && sh.item_src[tid] >= 0)
      store_release_sys(L.combine_flag(env.sig[sh.item_src[tid]], gen, me, sh.item_chunk[tid]), gen);
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
RC_DEVICE void combine_receiver(const Env& env, const CombineArgs& a, CombineShared& sh, uint64_t gen, int j,
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
    if (g < G && c < nch && r != me) ok = wait_flag(env, L.combine_flag(env.sig[me], gen, r, c), gen, kOpCombine, r);
    const int q = tid - kThreads / 2;
    if (q >= 0 && q < G && first + int64_t(q) * nblocks < nch)
      chunk_rows(a, sh.src, L.cap, me, first + int64_t(q) * nblocks, &sh.item_lo[q], &sh.item_hi[q]);
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
          const uint32_t m = uint32_t(a.send_mask[t]) & all_ranks(env);  // other bits: check_handle_rows
#pragma unroll
          for (int rr = 0; rr < kMaxGpuWorld; ++rr)
            if (m >> rr & 1u) src.p[rr] = rr == me ? y + own[row] * payload : L.combine_row(env.data[me], gen, rr, t);
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
  load_sources(env, sh.src, [&](int s, int64_t* ntok, int64_t* nrows) {
    *ntok = a.src_tokens[s];
    *nrows = a.counts[s];
  });
  const bool counts_ok = handle_counts_ok(env, a);
  if (counts_ok) {
    check_handle_rows(env, a, sh.src);
  } else {
    // Peers still wait for this rank's flags: the senders publish every chunk
    // a peer can expect (its T <= cap) with no rows, and no receiver runs.
    load_sources(env, sh.src, [&](int, int64_t* ntok, int64_t* nrows) {
      *ntok = ep_max_chunks(env.layout.cap);
      *nrows = 0;
    });
  }
  if (int(blockIdx.x) < send_blocks) {
    combine_sender(env, a, sh, gen, blockIdx.x, send_blocks, vec);
  } else if (counts_ok) {
    with_dtype(a.dtype, [&](auto d) {
      combine_receiver<decltype(d)::value>(env, a, sh, gen, blockIdx.x - send_blocks, gridDim.x - send_blocks, vec);
    });
  }
  finish_op(env, kOpCombine, gen);
}

}  // namespace

void launch_combine(const Env& env, const CombineArgs& a, Stream s) {
  const EpGrid g = combine_grid(a.ntok, env.world, env.sm_count);
  const int vec = widest_vector(env.layout.hidden * env.layout.elt, {a.y, a.out});
  launch("combine", combine_kernel, g.send_blocks + g.recv_blocks, s, env, a, g.send_blocks, vec);
}

}  // namespace gpu
}  // namespace rdna4_comm
