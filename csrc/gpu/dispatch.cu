// dispatch: sender blocks route this rank's tokens and push each row to its
// destinations; receiver blocks take the peers' rows from the heap, chunk by
// chunk, into the fresh outputs. A rank's own rows skip the heap.
#include "device/copy.cuh"
#include "device/routing.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

struct DispatchShared {
  int32_t start[kEpTargetChunks + 1][kMaxGpuWorld];  // sender: row prefix per chunk and destination
  int32_t run[kMaxGpuWorld];
  int32_t warp_tot[kMaxWarps][kMaxGpuWorld];
  uint32_t batch_mask[kThreads];
  int32_t batch_pos[kThreads][kMaxGpuWorld];
  Sources src;  // receiver: every source's header; sender: the lower ranks' row counts
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
RC_DEVICE void dispatch_sender(const Env& env, const DispatchArgs& a, DispatchShared& sh, uint64_t gen, int b,
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
    HeadSlot* head = L.dispatch_head(env.sig[tid], gen, me);
    head->ntok = uint32_t(T);
    head->nrows = uint32_t(sh.start[nch][tid]);
    store_release_sys(&head->gen, gen);
  }
  char* out_x = static_cast<char*>(a.out_x);
  // This rank's own rows skip the heap: they go straight to the output, after
  // the rows of every lower rank, whose counts come from their headers.
  int64_t self_base = 0;
  const uint32_t lower = (1u << me) - 1;
  auto head_of = [&](int s) { return L.dispatch_head(env.sig[me], gen, s); };
  auto add_lower_rows = [&] {  // each count is read by the thread that acquired its header
    if (tid < me) sh.src.nrows[tid] = int32_t(head_of(tid)->nrows);
    block_sync();
    for (int s = 0; s < me; ++s) self_base += sh.src.nrows[s];
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
                       : L.dispatch_row(env.data[d], gen, me, sh.batch_pos[r][d]);
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
      ChunkSlot* slot = L.dispatch_chunk(env.sig[tid], gen, me, c);
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

RC_DEVICE void dispatch_receiver(const Env& env, const DispatchArgs& a, DispatchShared& sh, uint64_t gen, int j,
                                 int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x, nt = blockDim.x;
  const int64_t payload = L.hidden * L.elt, K = L.topk, cap = L.cap, nvec = payload / vec;
  char* out_x = static_cast<char*>(a.out_x);

  auto head_of = [&](int s) { return L.dispatch_head(env.sig[me], gen, s); };
  if (!block_wait_ranks(env, gen, kOpDispatch, all_ranks(env), [&](int s) { return &head_of(s)->gen; })) return;
  // Thread s acquired source s's header, so it reads the counts.
  load_sources(env, sh.src, [&](int s, int64_t* ntok, int64_t* nrows) {
    *ntok = head_of(s)->ntok;
    *nrows = head_of(s)->nrows;
  });
  if (j == 0 && tid < W) {
    a.out_counts[tid] = sh.src.nrows[tid];
    a.out_src_tokens[tid] = sh.src.ntok[tid];
  }

  const Items plan = source_items(sh.src, W);
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
        item_to_chunk(item, sh.src.nchunks, W, &s, &c);
        const ChunkSlot* slot = L.dispatch_chunk(env.sig[me], gen, s, c);
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
      const int64_t r0 = sh.item_row_start[g], o0 = sh.src.offset[s] + r0;
      auto row = [&](int64_t r) { return L.dispatch_row(env.data[me], gen, s, r0 + r); };
      block_copy_each_row(
          nr, payload, vec, [&](uint32_t r) { return static_cast<const char*>(row(r)); },
          [&](uint32_t r) { return out_x + (o0 + r) * payload; });
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
  const int64_t pad0 = sh.src.offset[W], npad = int64_t(W) * cap - pad0, per = ceil_div(npad, nblocks);
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
    dispatch_sender<IdxT, KF>(env, a, sh, gen, blockIdx.x, send_blocks, vec);
  else
    dispatch_receiver(env, a, sh, gen, blockIdx.x - send_blocks, gridDim.x - send_blocks, vec);
  finish_op(env, kOpDispatch, gen);
}

}  // namespace

void launch_dispatch(const Env& env, const DispatchArgs& a, Stream s) {
  const EpGrid g = dispatch_grid(a.ntok, env.world, env.sm_count);
  const int vec = widest_vector(env.layout.hidden * env.layout.elt, {a.x, a.out_x});
  const int blocks = g.send_blocks + g.recv_blocks;
  if (env.layout.topk == 8) {
    if (a.idx_is_int64) launch("dispatch", dispatch_kernel<int64_t, 8>, blocks, s, env, a, g.send_blocks, vec);
    else launch("dispatch", dispatch_kernel<int32_t, 8>, blocks, s, env, a, g.send_blocks, vec);
  } else {
    if (a.idx_is_int64) launch("dispatch", dispatch_kernel<int64_t, 0>, blocks, s, env, a, g.send_blocks, vec);
    else launch("dispatch", dispatch_kernel<int32_t, 0>, blocks, s, env, a, g.send_blocks, vec);
  }
}

}  // namespace gpu
}  // namespace rdna4_comm
