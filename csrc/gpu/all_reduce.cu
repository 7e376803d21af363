// all_reduce: one-shot (every rank pushes its whole chunk to every peer and
// reduces locally) and two-shot (reduce-scatter, then all-gather). Block b
// moves piece b of every share (allreduce_piece) and has its own flag slots.
#include "../bounds.h"
#include "../flags.h"
#include "../policies.h"
#include "device/copy.cuh"
#include "device/reduce.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

__global__ void __launch_bounds__(kThreads) all_reduce_kernel(Env env, AllReduceArgs a) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, b = blockIdx.x;
  const Round round = begin_round(env, kAllReduceSequence, a.call);
  const uint64_t gen = round.gen;
  const int elt = dtype_bytes(a.dtype);
  const char* in = static_cast<const char*>(a.in);
  char* out = static_cast<char*>(a.out);
  const bool aligned = aligned16(in) && aligned16(out);
  const AllReduceShares share = allreduce_shares(a.n, W, elt, a.one_shot);
  auto piece = [&](int o, int64_t* e0, int64_t* e1) { allreduce_piece(share.size(o), elt, b, gridDim.x, e0, e1); };
  // Pieces start on 16-byte boundaries; whole-vector pieces of aligned
  // tensors copy in 16-byte vectors, the rest element by element.
  auto vector_bytes = [&](int64_t elems) { return aligned && elems * elt % 16 == 0 ? 16 : elt; };

  // Phase 0: push this block's piece of every peer's share into its inbox.
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    int64_t e0, e1;
    piece(p, &e0, &e1);
    block_copy(L.ar_slot(env.data[p], gen, me) + e0 * elt, in + (share.begin(p) + e0) * elt, (e1 - e0) * elt,
               vector_bytes(e1 - e0));
  }
  bool ok = exchange_phase(env, round, 0, b);

  // Reduce this block's piece of our own share, rank by rank.
  int64_t e0, e1;
  piece(me, &e0, &e1);
  const int64_t mine = share.begin(me);
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
    // Phase 1: hand the reduced piece to every peer, then collect theirs.
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
    gather_phase(env, round, b, ok, piece, [&](int o, int64_t f0, int64_t f1, const char* slot) {
      block_copy(out + (share.begin(o) + f0) * elt, slot + f0 * elt, (f1 - f0) * elt, vector_bytes(f1 - f0));
    });
  }
  finish_op(env, kAllReduceSequence, gen);
}

}  // namespace

void launch_all_reduce(const Env& env, const AllReduceArgs& a, Stream s) {
  const int elt = dtype_bytes(a.dtype);
  const int64_t per_rank = allreduce_shares(a.n, env.world, elt, a.one_shot).q;
  launch("all_reduce", all_reduce_kernel, allreduce_blocks(per_rank * elt, env.sm_count), s, env, a);
}

}  // namespace gpu
}  // namespace rdna4_comm
