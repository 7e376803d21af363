// combine: sender blocks return every received row to its source's inbox;
// receiver blocks sum this rank's tokens over their destination ranks, own
// contributions straight from y. An expert layout's received row is the
// sum of its pair rows of y (CombineArgs::rows_of), summed where it is read.
#include <type_traits>

#include "../bounds.h"
#include "../error_words.h"
#include "../flags.h"
#include "../policies.h"
#include "device/pair_rows.cuh"
#include "device/rows.cuh"
#include "device/routing.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

struct CombineShared {
  Sources src;  // from the handle: what dispatch received from every source
  // Sender: start[c][s], the first row of y from source s's chunk c (its
  // rows lie in token order).
  int32_t start[kEpTargetChunks + 1][kMaxGpuWorld];
  int32_t item_src[kMaxGroup], item_lo[kMaxGroup];
  uint32_t item_first[kMaxGroup + 1];
  int64_t item_chunk[kMaxGroup];
  int32_t run[kMaxGpuWorld];
  int32_t warp_tot[kMaxWarps][kMaxGpuWorld];
  // Receiver batch: each token's destinations and the rank-layout row that
  // holds this rank's own contribution to it (a row of y, or with pair
  // rows the row of rows_of whose pair rows sum to it).
  uint32_t batch_mask[kThreads];
  int32_t own_row[kThreads];
};

// The handle is user input. Its counts pick rows, chunks and flag slots,
// so every block checks them first (all blocks reach the same verdict),
// thread s those of source s (load_sources); a bad one is recorded and the
// kernel then only publishes its flags (below).
RC_DEVICE bool handle_counts_ok(const Env& env, const CombineArgs& a, int s, int64_t n, int64_t t) {
  const int64_t cap = env.layout.cap;
  if (n < 0 || n > cap) {
    if (blockIdx.x == 0) record_error(env, encode_bad_handle(kHandleCounts, s, int32_t(n)));
    return false;
  }
  if (t < 0 || t > cap || (s == env.rank && t != a.ntok)) {
    if (blockIdx.x == 0) record_error(env, encode_bad_handle(kHandleSrcTokens, s, int32_t(t)));
    return false;
  }
  return true;
}

// Token of source s that a recv_src value names, or -1 when it is not one
// (a bad value is skipped where it would pick a store, and recorded by
// check_recv_src).
RC_DEVICE int64_t source_token(int32_t value, const Sources& src, int64_t cap, int s) {
  const int64_t t = value - int64_t(s) * cap;
  return t >= 0 && t < src.ntok[s] ? t : -1;
}
RC_DEVICE int64_t row_token(const CombineArgs& a, const Sources& src, int64_t cap, int s, int64_t j) {
  return source_token(a.recv_src[j], src, cap, s);
}

// With valid counts, the sender blocks check recv_src on every received row,
// each thread a strided share (the receivers check the send_mask values they
// read): a token of the row's source, above the row before it from that
// source (chunks of a source's tokens are runs of its rows, and a row out of
// order would travel with another chunk than its flag announces). recv_src
// past the received rows is never read, so it is not checked. The senders
// read recv_src anyway, and the receivers' sums need none of it.
constexpr int kCheckUnroll = 4;
RC_DEVICE void check_recv_src(const Env& env, const CombineArgs& a, const Sources& src, int b, int nblocks) {
  // 32-bit indices: W * cap rows fit (kMaxGpuTokensPerRank), and a kernel
  // at the register limit keeps its loop state small.
  const int W = env.world;
  const int64_t cap = env.layout.cap;
  const uint32_t stride = uint32_t(nblocks) * kThreads, rows = uint32_t(src.offset[W]);
  for (uint32_t j0 = uint32_t(b) * kThreads + threadIdx.x; j0 < rows; j0 += stride * kCheckUnroll) {
    int32_t value[kCheckUnroll], before[kCheckUnroll];
#pragma unroll
    for (int u = 0; u < kCheckUnroll; ++u) {
      const uint32_t j = j0 + u * stride;
      if (j >= rows) continue;
      value[u] = a.recv_src[j];
      before[u] = j > 0 ? a.recv_src[j - 1] : 0;
    }
#pragma unroll
    for (int u = 0; u < kCheckUnroll; ++u) {
      const uint32_t j = j0 + u * stride;
      if (j >= rows) continue;
      int s = 0;
      while (j >= uint32_t(src.offset[s + 1])) ++s;
      if (source_token(value[u], src, cap, s) < 0 || (j > uint32_t(src.offset[s]) && value[u] <= before[u]))
        record_error(env, encode_bad_handle(kHandleRecvSrc, j, value[u]));
    }
  }
}

// start[c][s] for every peer source s and c in [0, its chunks]: one pass
// over its rows, row j setting the chunks from the one after row j - 1's up
// to its own. A handle whose rows are not in token order (recorded by
// check_recv_src) gives wrong ranges, but every one lies within the
// source's rows.
RC_DEVICE void peer_chunk_starts(const Env& env, const CombineArgs& a, CombineShared& sh) {
  const int me = env.rank, W = env.world, tid = threadIdx.x, nt = kThreads;
  const int64_t cap = env.layout.cap;
  for (int s = 0; s < W; ++s) {
    const int32_t end = sh.src.offset[s] + sh.src.nrows[s];
    for (int c = tid; c <= sh.src.nchunks[s]; c += nt) sh.start[c][s] = end;
  }
  block_sync();
  for (int s = 0; s < W; ++s) {
    if (s == me || sh.src.nchunks[s] == 0) continue;
    const int64_t C = sh.src.chunk_tokens[s];
    auto chunk_of = [&](int64_t j) {
      const int64_t t = row_token(a, sh.src, cap, s, j);
      return t < 0 ? int64_t(-1) : t / C;
    };
    for (int64_t j = sh.src.offset[s] + tid; j < sh.src.offset[s] + sh.src.nrows[s]; j += nt) {
      const int64_t c = chunk_of(j);
      for (int64_t k = j == sh.src.offset[s] ? 0 : chunk_of(j - 1) + 1; k <= c; ++k) sh.start[k][s] = int32_t(j);
    }
  }
  block_sync();
}

// Rows go back to their source's inbox, a group of (source, chunk) items at a
// time, their rows as one batch; each item's flag follows its rows.
template <DType D, bool kPairs>
RC_DEVICE void combine_sender(const Env& env, const CombineArgs& a, CombineShared& sh, uint64_t gen, int b,
                              int nblocks, int vec) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x, K = int(a.topk);
  const int64_t payload = L.hidden * L.elt, cap = L.cap;
  const uint32_t nvec = kPairs ? row_vectors<D>(payload, vec) : copy_vectors(payload, vec);
  const char* y = static_cast<const char*>(a.y);
  check_recv_src(env, a, sh.src, b, nblocks);
  peer_chunk_starts(env, a, sh);
  const Items plan = source_items(sh.src, W);
  const int64_t items = plan.count;
  const int G = plan.group;
  for (int64_t first = b; first < items; first += int64_t(nblocks) * G) {
    if (tid < G) {
      const int64_t item = first + int64_t(tid) * nblocks;
      sh.item_src[tid] = -1;
      int32_t nrows = 0;
      if (item < items) {
        int s;
        int64_t c;
        item_to_chunk(item, sh.src.nchunks, W, &s, &c);
        sh.item_src[tid] = s;
        sh.item_chunk[tid] = c;
        sh.item_lo[tid] = sh.start[c][s];
        nrows = sh.start[c + 1][s] - sh.start[c][s];
      }
      sh.item_first[tid + 1] = uint32_t(nrows > 0 ? nrows : 0);
    }
    block_sync();
    for_item_rows(sh.item_first, G, nvec, [&](int g, int64_t k, const RowSpan& rs) {
      const int s = sh.item_src[g];
      const int64_t j = sh.item_lo[g] + k;
      const int64_t t = row_token(a, sh.src, cap, s, j);
      if (t < 0) return;
      char* inbox = L.combine_row(env.data[s], gen, me, t);
      if (kPairs) {
        const int32_t* rows_of = a.rows_of + j * K;
        const uint64_t terms = pair_terms(rows_of, K, a.expert_rows);
        sum_pair_rows<D, kPairTermsInFlight>(y, payload, rows_of, terms, inbox, vec, rs);
        return;
      }
      with_copy_vector(vec, [&](auto tag) {
        copy_row<typename decltype(tag)::type, true>(y + j * payload, [&](int) { return inbox; }, 1u, rs);
      });
    });
    block_sync();
    if (tid < G && sh.item_src[tid] >= 0)
      store_release_sys(L.combine_flag(env.sig[sh.item_src[tid]], gen, me, sh.item_chunk[tid]), gen);
  }
}

// A receiver block's tokens: the range [t0, t1) (ep_own_block_tokens each),
// taken a group of combine chunks (chunk_tokens each) at a time, chunks
// [c0, c_end), and within a group a batch of at most a block of tokens at a
// time; first_end ends the first batch. Thread (waiter_g, waiter_r) waits
// for chunk waiter_g of a group from peer waiter_r. Token indices fit 32
// bits (kMaxGpuTokensPerRank), which keeps the state that lives across the
// sums small. Computed before the block waits for anything: each division
// by a run-time value is a long instruction sequence.
struct OwnRange {
  int32_t t0, t1, chunk_tokens, first_end, group, c0, c_end;
  int waiter_g, waiter_r;
};
RC_DEVICE OwnRange own_range(const Env& env, int64_t T, const EpLaunch& lp, int j) {
  const int32_t C = lp.own_chunk_tokens, G = lp.own_group, per = int32_t(lp.own_block_tokens);
  const int32_t t0 = j * per, t1 = t0 + per < int32_t(T) ? t0 + per : int32_t(T);
  const int32_t c0 = t0 / C, group_end = (c0 + G) * C;
  int32_t first_end = t0 + kThreads;
  first_end = first_end < group_end ? first_end : group_end;
  first_end = first_end < t1 ? first_end : t1;
  // A rank with no tokens still has chunk 0 (ep_chunks): see combine_receiver.
  const int32_t c_end = t1 > t0 ? (t1 - 1) / C + 1 : 1;
  const int g = int(threadIdx.x) / env.world;
  return {t0, t1, C, first_end, G, c0, c_end, g, int(threadIdx.x) - g * env.world};
}

// A block's first reads, all issued before any is used: each used at once,
// they waited for one another (the generation, then send_mask, then the
// handle's counts, a round trip each). A receiver's token's mask in the
// first batch and the first word of its strided share of send_mask before
// its range; thread s < W: the handle's counts of source s.
struct FirstReads {
  uint32_t first_mask, before;
  int32_t src_tokens, counts;
};
RC_DEVICE FirstReads first_reads(const Env& env, const CombineArgs& a, const OwnRange& r, bool receiver) {
  const int tid = threadIdx.x;
  const int32_t t = r.t0 + tid;
  FirstReads f;
  f.first_mask = receiver && t < r.first_end ? uint32_t(a.send_mask[t]) : 0u;
  f.before = receiver && tid < r.t0 ? uint32_t(a.send_mask[tid]) : 0u;
  f.src_tokens = tid < env.world ? a.src_tokens[tid] : 0;
  f.counts = tid < env.world ? a.counts[tid] : 0;
  return f;
}

// A receiver thread's share of the own-rank bits in send_mask before the
// block's range (strided; its first word is FirstReads::before).
RC_DEVICE int32_t own_rows_before(const Env& env, const CombineArgs& a, const OwnRange& r, uint32_t first_word) {
  const int32_t nt = kThreads;
  int32_t n = int32_t(first_word >> env.rank & 1u);
#pragma unroll 4
  for (int32_t t = threadIdx.x + nt; t < r.t0; t += nt) n += int32_t(uint32_t(a.send_mask[t]) >> env.rank & 1u);
  return n;
}

// Each token's output: its rows from every destination rank, summed in
// ascending rank order (sum_row). Peers' rows come from the inbox, at the
// token's slot; this rank's own from y (with pair rows: their sum, stored
// into the output row first), at the token's place among its own rows
// (dispatch laid them out in token order: the block's first token's
// comes after one row per earlier token whose send_mask has this rank, the
// threads' shares of that count summed into sh.run[0], which the kernel
// zeroed before its first barrier). The block waits for the chunks that
// overlap its range a group at a time: thread (g, r) waits for chunk g's
// flag from peer r, then the group's tokens in the range are summed in
// batches of a block. A block sums the columns [col0, col0 + cols) of its
// tokens' rows (kPairs: a column slice, combine_recv_slices; else the whole
// rows).
static_assert(kMaxGpuWorld * kMaxGroup <= kThreads, "combine waiters fit a block");
template <DType D, int kSumUnroll, bool kPairs>
RC_DEVICE void combine_receiver(const Env& env, const CombineArgs& a, CombineShared& sh, const Round& round,
                                const OwnRange& range, const FirstReads& first, const RowPieces& first_pieces,
                                int vec, uint32_t col0, uint32_t cols) {
  const Layout& L = env.layout;
  const uint64_t gen = round.gen;
  const int me = env.rank, W = env.world, tid = threadIdx.x, K = int(a.topk);
  const int32_t t0 = range.t0, t1 = range.t1, C = range.chunk_tokens, nt = kThreads;
  const int G = range.group;
  const int64_t payload = L.hidden * L.elt;
  const int32_t rows = W * int32_t(L.cap);
  const uint32_t nsum = row_vectors<D>(payload, vec);
  const char* y = static_cast<const char*>(a.y);
  char* out = static_cast<char*>(a.out);
  const int32_t own_base = sh.src.offset[me];
  const int32_t before = warp_sum(own_rows_before(env, a, range, first.before));
  if (lane_id() == 0 && before != 0) atomicAdd(&sh.run[0], before);  // read after the next barriers
  // A rank with no tokens still has chunk 0 (ep_chunks), and its receiver
  // blocks (one range, its slices) wait for it from every peer: every combine sees each
  // peer publish this generation, which the inbox's parity needs (layout.h).
  // Without that wait, such a rank could run two combines ahead and
  // overwrite rows that a slow peer has yet to read.
  const int32_t c_end = range.c_end;
  for (int32_t g0 = range.c0; g0 < c_end; g0 += G) {
    const int32_t g1 = g0 + G < c_end ? g0 + G : c_end;
    const int g = range.waiter_g, r = range.waiter_r;
    bool ok = true;
    if (g0 + g < g1 && r != me) ok = wait_flag(env, round, L.combine_flag(env.sig[me], gen, r, g0 + g), r);
    if (!block_all(ok)) return;
    const int32_t b_begin = g0 * C > t0 ? g0 * C : t0, b_end = g1 * C < t1 ? g1 * C : t1;
    for (int32_t b0 = b_begin; b0 < b_end; b0 += nt) {
      const int32_t t = b0 + tid;
      uint32_t m = 0;
      if (t < b_end) m = b0 == t0 ? first.first_mask : uint32_t(a.send_mask[t]);
      if (m & ~all_ranks(env)) record_error(env, encode_bad_handle(kHandleSendMask, t, int32_t(m)));
      m &= all_ranks(env);
      int32_t pos[kMaxGpuWorld];
      batch_positions(m >> me & 1u, 1, pos, sh.warp_tot, sh.run);
      sh.batch_mask[tid] = m;
      // A handle whose send_mask and counts disagree reads a wrong row of y, never memory outside it.
      sh.own_row[tid] = own_base + pos[0] < rows ? own_base + pos[0] : rows - 1;
      block_sync();
      const int32_t batch = b_end - b0 < nt ? b_end - b0 : nt;
      const RowPieces pieces = b0 == t0 ? first_pieces : row_pieces(uint32_t(batch), cols);
      for_row_pieces(pieces, cols, [&](uint32_t i, const RowSpan& piece) {
        const RowSpan s = kPairs ? slice_span(piece, col0, nsum) : piece;
        const int64_t tok = b0 + int32_t(i), own_row = sh.own_row[i];
        char* out_row = out + tok * payload;
        // An expert layout's own contribution: its pair rows summed into
        // the output row first, where the sum below reads it back (each
        // lane reads the vectors it stored, the spans being the same).
        const bool own_pairs = kPairs && (sh.batch_mask[i] >> me & 1u);
        if (own_pairs) {
          const int32_t* rows_of = a.rows_of + own_row * K;
          const uint64_t terms = pair_terms(rows_of, K, a.expert_rows);
          sum_pair_rows<D, kPairTermsInFlight>(y, payload, rows_of, terms, out_row, vec, s);
          // A token of this rank alone: that sum is its output (a value the
          // sum below would round again, to itself).
          if (sh.batch_mask[i] == 1u << me) return;
        }
        auto row_of = [&](int rr) {
          return rr != me ? L.combine_row(env.data[me], gen, rr, tok) : own_pairs ? out_row : y + own_row * payload;
        };
        with_row_vector<D>(vec, [&](auto tag) {
          sum_row<D, typename decltype(tag)::type, 1, kSumUnroll>(row_of, sh.batch_mask[i], out_row, s);
        });
      });
      block_sync();
    }
  }
}

// One kernel per dtype, sum loop (kRowUnroll, or kShortUnroll where
// combine_sums_short) and y (kPairs: an expert layout's, CombineArgs::
// rows_of): the receivers' sum loop takes the registers that one dtype's
// loop leaves, not the most of three, and the rank layout's kernels carry
// no pair sums. The pair sums leave the registers of kShortUnroll's loop.
template <DType D, int kSumUnroll, bool kPairs>
__global__ void __launch_bounds__(kThreads) combine_kernel(Env env, CombineArgs a, EpLaunch lp) {
  __shared__ CombineShared sh;
  // Loaded first: the call word of the round needs it (calls.h).
  const uint64_t dispatch_round = uint64_t(*a.dispatch_round);
  const bool receiver = int(blockIdx.x) >= lp.send_blocks;
  // A receiver's range of tokens, and its column slice of their rows
  // (pair rows: combine_recv_slices; the rank layout's take whole rows).
  const int j = int(blockIdx.x) - lp.send_blocks, range_j = kPairs && receiver ? j / lp.recv_slices : j;
  const uint32_t nsum = row_vectors<D>(env.layout.hidden * env.layout.elt, lp.vec);
  const uint32_t col0 = kPairs && receiver ? uint32_t(j - range_j * lp.recv_slices) * lp.slice_vectors : 0u;
  const uint32_t cols = kPairs ? (col0 + lp.slice_vectors < nsum ? lp.slice_vectors : nsum - col0) : nsum;
  const OwnRange range = own_range(env, a.ntok, lp, range_j);
  const FirstReads first = first_reads(env, a, range, receiver);
  const Round round = begin_round(env, kOpCombine, combine_call(a.expert_layout, dispatch_round));
  const uint64_t gen = round.gen;
  // The first batch's piece of the sums (row_pieces), while the loads are in flight.
  const int32_t first_rows = receiver && range.first_end > range.t0 ? range.first_end - range.t0 : 0;
  const RowPieces pieces = row_pieces(uint32_t(first_rows), cols);
  if (threadIdx.x == 0) sh.run[0] = 0;
  const bool counts_ok = load_sources(env, sh.src, [&](int s, int64_t* ntok, int64_t* nrows, int64_t* chunk_tokens) {
    *ntok = first.src_tokens;  // load_sources calls this on thread s for source s
    *nrows = first.counts;
    *chunk_tokens = ep_chunk_tokens(*ntok);
    return handle_counts_ok(env, a, s, *nrows, *ntok);
  });
  if (!counts_ok) {
    // Peers still wait for this rank's flags: the senders publish every chunk
    // a peer can expect (ep_max_chunks: it holds at most cap tokens) with no
    // rows, and no receiver runs.
    load_sources(env, sh.src, [&](int, int64_t* ntok, int64_t* nrows, int64_t* chunk_tokens) {
      *ntok = 0;
      *nrows = 0;
      *chunk_tokens = 1;
      return true;
    });
    if (int(threadIdx.x) < env.world && int(threadIdx.x) != env.rank)
      sh.src.nchunks[threadIdx.x] = int32_t(ep_max_chunks(env.layout.cap));
    block_sync();
  }
  if (!receiver) {
    combine_sender<D, kPairs>(env, a, sh, gen, blockIdx.x, lp.send_blocks, lp.vec);
  } else if (counts_ok) {
    combine_receiver<D, kSumUnroll, kPairs>(env, a, sh, round, range, first, pieces, lp.vec, col0, cols);
  }
  finish_op(env, kOpCombine, gen);
}

}  // namespace

void launch_combine(const Env& env, const CombineArgs& a, Stream s) {
  const EpGrid g = combine_grid(a.ntok, env.world, env.sm_count);
  const int64_t C = ep_chunk_tokens(a.ntok);
  const int64_t payload = env.layout.hidden * env.layout.elt;
  const int vec = row_vector(payload, {a.y, a.out});
  with_dtype(a.dtype, [&](auto dtype) {
    constexpr DType D = decltype(dtype)::value;
    // The sum loop's vectors of a row, as the receivers count them.
    const uint32_t nsum = row_vectors<D>(payload, vec);
    const int slices = combine_recv_slices(a.ntok, env.world, env.sm_count, payload, nsum, a.rows_of != nullptr);
    const EpLaunch lp{ep_own_block_tokens(a.ntok, env.world, env.sm_count), 0, g.send_blocks, vec, int32_t(C),
                      group_size(C), slices, uint32_t(ceil_div(nsum, slices))};
    const int blocks = g.send_blocks + g.recv_blocks * slices;
    auto go = [&](auto kernel) { launch("combine", kernel, blocks, s, env, a, lp); };
    if (a.rows_of) go(combine_kernel<D, kShortUnroll, true>);
    else if (combine_sums_short(lp.own_block_tokens, nsum))
      go(combine_kernel<D, kShortUnroll, false>);
    else go(combine_kernel<D, kRowUnroll, false>);
  });
}

}  // namespace gpu
}  // namespace rdna4_comm
