// all_reduce + residual add + RMSNorm on the all_reduce protocol (one
// generation sequence with all_reduce, flags.h at kAllReduceSequence).
// A block finishes whole rows: the rank-ordered fp32 sum of the row's
// partials rounded once, plus the residual rounded once (residual_out), then
// the block's sum of squares, then weight * round(r * inv_rms).
//   one-stage: every rank pushes its rows to every peer and finishes them all
//              (one barrier);
//   two-stage: rank o finishes its shard of rows and pushes the shard's out
//              and residual_out rows to every peer (two barriers).
// Block b moves rows piece b of every shard (rmsnorm_piece) and has its own
// flag slots, as in all_reduce.
#include "../bounds.h"
#include "../flags.h"
#include "../policies.h"
#include "../rmsnorm_arith.h"
#include "device/copy.cuh"
#include "device/reduce.cuh"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

// Sum of every thread's v in a fixed tree order (bitwise equal on every rank
// and run), in fp64 (rmsnorm_inv_rms says why). `red` holds kThreads
// doubles of shared memory.
RC_DEVICE double block_sum_squares(double v, double* red) {
  const int tid = threadIdx.x;
  red[tid] = v;
  block_sync();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (tid < width) red[tid] += red[tid + width];
    block_sync();
  }
  const double total = red[0];
  block_sync();  // every thread has read red[0] before the next row's writes
  return total;
}

// One row, block-wide. Thread t takes vectors t, t + kThreads, ... (V is a
// 16-byte vector, or one element when the row is not whole aligned vectors).
// The sum of squares adds a thread's vectors in that order, element by
// element, so both variants (kInRegisters keeps the rounded row in registers,
// the other re-reads it from residual_out, which this thread wrote) give the
// same bits.
template <DType D, typename V, bool kInRegisters>
RC_DEVICE void finish_row(const AllReduceRmsNormArgs& a, const ConstRankPtrs& src, uint32_t mask, int64_t row,
                          double* red) {
  using E = Elem<D>;
  using Raw = typename E::Raw;
  using Pack = ElemPack<D, V>;
  constexpr int N = Pack::N;
  const int64_t H = a.hidden;
  const uint32_t nvec = uint32_t(H / N), nt = kThreads;
  const V* residual = a.residual ? reinterpret_cast<const V*>(static_cast<const Raw*>(a.residual) + row * H) : nullptr;
  V* rout = reinterpret_cast<V*>(static_cast<Raw*>(a.residual_out) + row * H);
  V* out = reinterpret_cast<V*>(static_cast<Raw*>(a.out) + row * H);
  double squares = 0.0;
  auto residual_add = [&](uint32_t v) {
    Pack s;
    s.v = sum_one<D, V>(src, mask, v);
    if (residual) {
      Pack q;
      q.v = residual[v];
#pragma unroll
      for (int j = 0; j < N; ++j) s.e[j] = E::store(E::load(s.e[j]) + E::load(q.e[j]));
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const double f = E::load(s.e[j]);
      squares += f * f;
    }
    rout[v] = s.v;
    return s.v;
  };
  float inv = 0.f;
  auto normalise = [&](uint32_t v, const V& rounded) {
    Pack r;
    r.v = rounded;
    float w[N];
    if (a.weight_fp32) {
#pragma unroll
      for (int j = 0; j < N; ++j) w[j] = static_cast<const float*>(a.weight)[int64_t(v) * N + j];
    } else {
      Pack p;
      p.v = static_cast<const V*>(a.weight)[v];
#pragma unroll
      for (int j = 0; j < N; ++j) w[j] = E::load(p.e[j]);
    }
    Pack o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.e[j] = E::store(w[j] * E::load(E::store(E::load(r.e[j]) * inv)));
    out[v] = o.v;
  };
  if constexpr (kInRegisters) {
    // Static indices only, so `keep` stays in registers.
    V keep[kRmsNormRowVectorsPerThread];
#pragma unroll
    for (int k = 0; k < kRmsNormRowVectorsPerThread; ++k) {
      const uint32_t v = threadIdx.x + k * nt;
      if (v < nvec) keep[k] = residual_add(v);
    }
    inv = rmsnorm_inv_rms(block_sum_squares(squares, red), H, a.eps);
#pragma unroll
    for (int k = 0; k < kRmsNormRowVectorsPerThread; ++k) {
      const uint32_t v = threadIdx.x + k * nt;
      if (v < nvec) normalise(v, keep[k]);
    }
  } else {
    for (uint32_t v = threadIdx.x; v < nvec; v += nt) residual_add(v);
    inv = rmsnorm_inv_rms(block_sum_squares(squares, red), H, a.eps);
    for (uint32_t v = threadIdx.x; v < nvec; v += nt) normalise(v, rout[v]);
  }
}

template <DType D, typename V, bool kInRegisters>
__global__ void __launch_bounds__(kThreads) all_reduce_rmsnorm_kernel(Env env, AllReduceRmsNormArgs a) {
  __shared__ double red[kThreads];
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, b = blockIdx.x, G = gridDim.x;
  const int64_t row_bytes = a.hidden * int64_t(sizeof(typename Elem<D>::Raw));
  const int vec = int(sizeof(V));
  const char* x = static_cast<const char*>(a.x);
  const bool exchange = !a.local;
  // Local launches take no round: they are no op of the protocol.
  const Round round = exchange ? begin_round(env, kAllReduceSequence, a.call) : Round{};
  const uint64_t gen = round.gen;
  const AllReduceShares shard = rmsnorm_shards(a.rows, exchange ? W : 1, a.one_stage || !exchange);
  auto piece = [&](int o, int64_t* r0, int64_t* r1) { rmsnorm_piece(shard.size(o), b, G, r0, r1); };
  const int own = exchange ? me : 0;

  bool ok = true;
  if (exchange) {
    // Phase 0: push this block's rows of every peer's shard into its inbox.
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      int64_t r0, r1;
      piece(p, &r0, &r1);
      block_copy(L.ar_slot(env.data[p], gen, me) + r0 * row_bytes, x + (shard.begin(p) + r0) * row_bytes,
                 (r1 - r0) * row_bytes, vec);
    }
    ok = exchange_phase(env, round, 0, b);
  }

  // Finish this block's rows of this rank's shard.
  int64_t r0, r1;
  piece(own, &r0, &r1);
  const int64_t first = shard.begin(own);
  if (ok) {
    for (int64_t row = r0; row < r1; ++row) {
      ConstRankPtrs src{};
#pragma unroll
      for (int r = 0; r < kMaxGpuWorld; ++r)
        if (r < W) src.p[r] = r == me || !exchange ? x + (first + row) * row_bytes
                                                   : L.ar_slot(env.data[me], gen, r) + row * row_bytes;
      finish_row<D, V, kInRegisters>(a, src, exchange ? all_ranks(env) : 1u << me, first + row, red);
    }
  }
  if (exchange && !a.one_stage) {
    // Phase 1: hand the finished rows (out, then residual_out, in the gather
    // slot) to every peer, then collect theirs.
    char* out = static_cast<char*>(a.out);
    char* rout = static_cast<char*>(a.residual_out);
    const int64_t out_at = 0, rout_at = shard.q * row_bytes;
    block_sync();
    if (ok) {
      const uint32_t peers = peer_ranks(env);
      const int64_t bytes = (r1 - r0) * row_bytes, off = r0 * row_bytes;
      for (int k = 0; k < 2; ++k) {
        const char* src = (k == 0 ? out : rout) + first * row_bytes + off;
        const int64_t at = (k == 0 ? out_at : rout_at) + off;
        with_vector(vec, [&](auto tag) {
          using VC = typename decltype(tag)::type;
          block_copy_rows<VC>(
              1, bytes / vec, [&](uint32_t) { return src; }, [&](uint32_t) { return peers; },
              [&](uint32_t, int p) { return L.ar_gather_slot(env.data[p], gen, me) + at; });
        });
      }
    }
    gather_phase(env, round, b, ok, piece, [&](int o, int64_t f0, int64_t f1, const char* slot) {
      const int64_t bytes = (f1 - f0) * row_bytes, dst = (shard.begin(o) + f0) * row_bytes;
      block_copy(out + dst, slot + out_at + f0 * row_bytes, bytes, vec);
      block_copy(rout + dst, slot + rout_at + f0 * row_bytes, bytes, vec);
    });
  }
  if (exchange) finish_op(env, kAllReduceSequence, gen);
}

// The three variants of a dtype: rows in registers, rows of vectors, rows of
// single elements (any H, any alignment).
template <DType D>
void launch_variant(const Env& env, const AllReduceRmsNormArgs& a, int blocks, Stream s) {
  const bool in_registers = a.vectorized && rmsnorm_row_in_registers(a.hidden, dtype_bytes(D));
  if (in_registers)
    launch("all_reduce_rmsnorm", all_reduce_rmsnorm_kernel<D, uint4, true>, blocks, s, env, a);
  else if (a.vectorized)
    launch("all_reduce_rmsnorm", all_reduce_rmsnorm_kernel<D, uint4, false>, blocks, s, env, a);
  else
    launch("all_reduce_rmsnorm", all_reduce_rmsnorm_kernel<D, typename Elem<D>::Raw, false>, blocks, s, env, a);
}

}  // namespace

void launch_all_reduce_rmsnorm(const Env& env, const AllReduceRmsNormArgs& a, Stream s) {
  const int world = a.local ? 1 : env.world;
  const int blocks = rmsnorm_blocks(rmsnorm_shards(a.rows, world, a.one_stage || a.local).q, env.sm_count);
  with_dtype(a.dtype, [&](auto dtype) { launch_variant<decltype(dtype)::value>(env, a, blocks, s); });
}

}  // namespace gpu
}  // namespace rdna4_comm
