// dispatch: sender block b routes chunk b of this rank's tokens and pushes
// each row to its destinations; receiver blocks take the peers' rows from the
// heap, chunk by chunk, into the fresh outputs (for the expert layout, their
// routing alone: the placement reads the peers' payload in the heap and,
// with own_rows_stay, this rank's in x, the input; expert_layout.cu).
// A rank's own rows skip the heap.
// Then every block writes its share of the padding rows' routing (-1 ids, 0
// weights); the padding rows of x are left unwritten, so the work follows the
// routed rows, not the capacity.
#include "../bounds.h"
#include "../flags.h"
#include "../policies.h"
#include "device/routing.cuh"
#include "device/sync.cuh"
#include "dispatch_sender.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

// What sender block b reads of its inputs first, on its way to L1 while the
// block waits for its generation (a round trip, which the routing's loads
// would otherwise follow): the ids it routes (every token's where it routes
// them all), its chunk's weights, and its chunk's rows where a line per
// thread covers them whole (block_prefetch_covers: prefetching the start
// of a larger chunk made large dispatches slower on an H200).
// Nothing for a receiver block (its range is empty).
template <typename IdxT, int kMode>
RC_DEVICE void prefetch_sender_inputs(const DispatchArgs& a, const Layout& L, const EpLaunch& lp, int b) {
  const TokenRange range = sender_tokens(a, lp, b);
  const int64_t T = a.ntok, K = L.topk, t0 = range.t0, t1 = range.t1;
  if (t1 <= t0) return;
  const int64_t id_bytes = K * int64_t(sizeof(IdxT)), in_row = input_row_bytes<kMode>(a, L);
  if (dispatch_routes_all_tokens(T)) prefetch_lines_l1(a.topk_idx, T * id_bytes);
  else prefetch_lines_l1(static_cast<const char*>(a.topk_idx) + t0 * id_bytes, (t1 - t0) * id_bytes);
  if (a.topk_weights) {
    const int64_t w_bytes = K * dtype_bytes(a.weights_dtype);
    prefetch_lines_l1(static_cast<const char*>(a.topk_weights) + t0 * w_bytes, (t1 - t0) * w_bytes);
  }
  if (block_prefetch_covers((t1 - t0) * in_row))
    prefetch_lines_l1(static_cast<const char*>(a.x) + t0 * in_row, (t1 - t0) * in_row);
}

// Every source's header, once it has arrived, into sh.src (thread s reads
// the counts of the header it acquired). False on a timeout.
RC_DEVICE bool load_headers(const Env& env, DispatchShared& sh, const Round& round) {
  const Layout& L = env.layout;
  const int me = env.rank;
  return load_sources(env, sh.src, [&](int s, int64_t* ntok, int64_t* nrows, int64_t* chunk_tokens) {
    const HeadSlot* head = L.dispatch_head(env.sig[me], round.gen, s);
    if (!wait_flag(env, round, &head->gen, s)) return false;
    *ntok = head->ntok;
    *nrows = head->nrows;
    *chunk_tokens = head->chunk_tokens;
    return true;
  });
}

// The rows this rank receives in all, where its padding starts, found by
// each warp of a sender block itself (a sender needs no more of the
// headers): lane s < W takes source s's row count from its header (this
// rank's own from sh.run where the block routed every token), and a warp
// sum adds them up, with no block barrier. False, on the whole warp, when a
// wait failed.
RC_DEVICE bool received_rows(const Env& env, const DispatchShared& sh, const Round& round, bool own_known,
                             int32_t* rows) {
  const int s = lane_id();
  bool ok = true;
  int32_t n = 0;
  if (s < env.world) {
    if (own_known && s == env.rank) {
      n = sh.run[s];
    } else {
      const HeadSlot* head = env.layout.dispatch_head(env.sig[env.rank], round.gen, s);
      ok = wait_flag(env, round, &head->gen, s);
      n = ok ? int32_t(head->nrows) : 0;
    }
  }
  *rows = warp_sum(n);
  return warp_ballot(!ok) == 0;
}

// False (on every thread) when a wait failed: sh.src may then be incomplete.
template <typename IdxT, typename V, bool kFp8>
RC_DEVICE bool dispatch_receiver(const Env& env, const DispatchArgs& a, DispatchShared& sh, const Round& round,
                                 int j, int nblocks) {
  const Layout& L = env.layout;
  const uint64_t gen = round.gen;
  const int me = env.rank, W = env.world, tid = threadIdx.x;
  const int64_t H = L.hidden, S = L.fp8_scales, payload = kFp8 ? H : H * L.elt, K = L.topk, cap = L.cap;
  // A received row is its bytes; a row left in the heap (peer_rows_stay) is
  // its routing alone, one row per warp step.
  const uint32_t nvec = a.peer_rows_stay ? 1u : row_units<kFp8 ? kFp8Pair : kRowsAsIs, V>(L, a.x_dtype);
  char* out_x = static_cast<char*>(a.out_x);
  IdxT* out_idx = static_cast<IdxT*>(a.out_idx);

  if (!load_headers(env, sh, round)) return false;
  if (j == 0 && tid < W) {
    a.out_counts[tid] = sh.src.nrows[tid];
    a.out_src_tokens[tid] = sh.src.ntok[tid];
  }

  const Items plan = source_items(sh.src, W);
  const int64_t items = plan.count;
  const int G = plan.group;
  // This block owns items j, j + nblocks, ...; it takes G of them at a time,
  // their rows as one batch (item_first: each item's first row in it).
  for (int64_t first = j; first < items; first += int64_t(nblocks) * G) {
    bool got = true;
    if (tid < G) {
      const int64_t item = first + int64_t(tid) * nblocks;
      uint32_t nrows = 0;
      if (item < items) {
        int s;
        int64_t c;
        item_to_chunk(item, sh.src.nchunks, W, &s, &c);
        const ChunkSlot* slot = L.dispatch_chunk(env.sig[me], gen, s, c);
        got = wait_flag(env, round, &slot->gen, s);
        sh.item_src[tid] = s;
        sh.item_row_start[tid] = got ? slot->row_start : 0;
        nrows = got ? slot->nrows : 0;
      }
      sh.item_first[tid + 1] = nrows;
    }
    if (!block_all(got)) return false;
    for_item_rows(sh.item_first, G, nvec, [&](int g, int64_t row_in_item, const RowSpan& rs) {
      const int s = sh.item_src[g];
      const int64_t hr = sh.item_row_start[g] + row_in_item;  // the source's row
      const int64_t o = sh.src.offset[s] + hr;                // its output row
      char* row = L.dispatch_row(env.data[me], gen, s, hr);
      if (!a.peer_rows_stay) {
        auto out_row = [&](int) { return out_x + o * payload; };
        if constexpr (kFp8)
          copy_row_and_scales<V, false>(row, L.row_scales(row), S, out_row, [&](int) { return a.out_scales + o * S; },
                                        1u, rs);
        else copy_row<V, false>(row, out_row, 1u, rs);
      }
      if (!rs.lead) return;
      for (int k = int(rs.first); k < K; k += int(rs.stride)) {
        out_idx[o * K + k] = IdxT(L.row_ids(row)[k]);
        if (a.out_weights) store_from_float(a.out_weights, o * K + k, a.weights_dtype, L.row_weights(row)[k]);
      }
      if (rs.first == 0) a.out_recv_src[o] = int32_t(s * cap + *L.row_token(row));
    });
    block_sync();
  }
  return true;
}

// Padding rows [pad0, W*cap), pad0 the rows received, a block's worth of
// elements at a time over the grid (a contiguous share per block takes a
// division by the grid's size, a long instruction sequence, on every
// call): -1 ids, 0 weights, -1 source. Their x is not written (unspecified).
template <typename IdxT>
RC_DEVICE void dispatch_padding(const Env& env, const DispatchArgs& a, int32_t pad0) {
  // 32-bit: W * cap * K < 2^27 (kMaxGpuWorld, kMaxGpuTokensPerRank, kMaxTopk).
  const int32_t K = int32_t(env.layout.topk), rows = env.world * int32_t(env.layout.cap);
  const int32_t step = int32_t(gridDim.x) * kThreads, first = int32_t(blockIdx.x) * kThreads + int32_t(threadIdx.x);
  IdxT* out_idx = static_cast<IdxT*>(a.out_idx);
  for (int32_t i = pad0 * K + first; i < rows * K; i += step) {
    out_idx[i] = IdxT(-1);
    if (a.out_weights) store_from_float(a.out_weights, i, a.weights_dtype, 0.f);
  }
  for (int32_t r = pad0 + first; r < rows; r += step) a.out_recv_src[r] = -1;
}

// One kernel per (id type, top-k fast path, row vector, payload mode): each
// holds the registers of its own loops only.
template <typename IdxT, int KF, typename V, int kMode>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(Env env, DispatchArgs a, EpLaunch lp) {
  __shared__ DispatchShared sh;
  prefetch_sender_inputs<IdxT, kMode>(a, env.layout, lp, blockIdx.x);
  const Round round = begin_round(env, kOpDispatch, a.call, a.out_dispatch_round);
  // The padding's start, known once the headers have arrived: they usually
  // have by now; a late peer keeps the block waiting (bounded like every
  // wait), and after a failed wait it does not pad. The verdicts come from
  // shared memory or the warp: polling the host-mapped error word here, on
  // every thread, cost each warp a PCIe read (about 1 us, serialised: 1 ms
  // per launch of 64 blocks on an H200).
  int32_t pad0 = 0;
  bool have_headers;
  if (int(blockIdx.x) < lp.send_blocks) {
    have_headers = dispatch_sender<IdxT, KF, V, kMode>(env, a, lp, sh, round, blockIdx.x) &&
                   received_rows(env, sh, round, dispatch_routes_all_tokens(a.ntok), &pad0);
  } else {
    have_headers = dispatch_receiver<IdxT, V, kMode != kRowsAsIs>(env, a, sh, round, blockIdx.x - lp.send_blocks,
                                                                 gridDim.x - lp.send_blocks);
    pad0 = sh.src.offset[env.world];
  }
  if (have_headers) dispatch_padding<IdxT>(env, a, pad0);
  finish_op(env, kOpDispatch, round.gen);
}

}  // namespace

void launch_dispatch(const Env& env, const DispatchArgs& a, Stream s) {
  const EpGrid g = dispatch_grid(a.ntok, env.world, env.sm_count);
  const EpLaunch lp{ep_own_block_tokens(a.ntok, env.world, env.sm_count), a.num_experts / env.world, g.send_blocks,
                    row_vector(env.layout.hidden * env.layout.elt, {a.x, a.out_x})};
  const int blocks = g.send_blocks + g.recv_blocks;
  auto go = [&](auto kernel) { launch("dispatch", kernel, blocks, s, env, a, lp); };
  if (env.layout.fp8_scales > 0) {
    // FP8 rows: the generic top-k loop, one kernel per input form. Rows that
    // are FP8 already (a pair's in the sender, every row in the receivers)
    // move in 16-byte vectors where H and the pointers they touch allow it,
    // else byte by byte; rows quantised in the sender have their own lanes.
    const bool pair = a.fp8_pair;
    const bool v16 = pair ? widest_vector(env.layout.hidden, {a.x, a.out_x}) == 16
                          : widest_vector(env.layout.hidden, {a.out_x}) == 16;
    auto fp8 = [&](auto idx) {
      using IdxT = typename decltype(idx)::type;
      if (pair) v16 ? go(dispatch_kernel<IdxT, 0, uint4, kFp8Pair>) : go(dispatch_kernel<IdxT, 0, uint8_t, kFp8Pair>);
      else v16 ? go(dispatch_kernel<IdxT, 0, uint4, kQuantizeFp8>) : go(dispatch_kernel<IdxT, 0, uint8_t, kQuantizeFp8>);
    };
    a.idx_is_int64 ? fp8(VecTag<int64_t>{}) : fp8(VecTag<int32_t>{});
    return;
  }
  // A row vector of 16 bytes where rows and pointers allow it, else 2-byte pieces.
  const bool v16 = lp.vec == 16, k8 = env.layout.topk == 8;
  if (a.idx_is_int64) {
    if (k8) v16 ? go(dispatch_kernel<int64_t, 8, uint4, kRowsAsIs>) : go(dispatch_kernel<int64_t, 8, uint16_t, kRowsAsIs>);
    else v16 ? go(dispatch_kernel<int64_t, 0, uint4, kRowsAsIs>) : go(dispatch_kernel<int64_t, 0, uint16_t, kRowsAsIs>);
  } else {
    if (k8) v16 ? go(dispatch_kernel<int32_t, 8, uint4, kRowsAsIs>) : go(dispatch_kernel<int32_t, 8, uint16_t, kRowsAsIs>);
    else v16 ? go(dispatch_kernel<int32_t, 0, uint4, kRowsAsIs>) : go(dispatch_kernel<int32_t, 0, uint16_t, kRowsAsIs>);
  }
}

}  // namespace gpu
}  // namespace rdna4_comm
