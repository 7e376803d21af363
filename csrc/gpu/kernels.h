// Launch interface of the device kernels, one launch_* per op family, each
// defined in its own .cu (all_reduce.cu, all_reduce_rmsnorm.cu, dispatch.cu,
// combine.cu, expert_layout.cu, expert_sum.cu, probe.cu).
// Plain types only (no torch), so the kernels compile on their own as CUDA or
// as HIP for any target.
#pragma once

#include <cstdint>

#include "../bounds.h"
#include "../layout.h"
#include "platform.h"

namespace rdna4_comm {
namespace gpu {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
RC_HD constexpr int dtype_bytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// Everything a kernel needs about the communicator. Passed by value: it never
// changes after init, so graph-captured launches stay valid.
struct Env {
  Layout layout;
  char* sig[kMaxGpuWorld];   // signal allocation of every rank (own included)
  char* data[kMaxGpuWorld];  // data allocation of every rank
  int rank = 0;
  int world = 1;
  int sm_count = 1;
  // Device view of a host-mapped word that the first kernel thread to give up
  // on a peer sets (error_words.h); the host reads it at the next op.
  uint64_t* error = nullptr;
  uint64_t timeout_ticks = 0;
};

// Raises (defined with the torch glue): a launch of `blocks` blocks of kernel
// `op` would not be resident at once, as the launch policy requires.
[[noreturn]] void raise_not_resident(const char* op, int blocks, int per_sm, int sm_count);

struct AllReduceArgs {
  const void* in;
  void* out;
  int64_t n;  // elements in this chunk (<= one slot for one-shot, W slots for two-shot)
  DType dtype;
  bool one_shot;
  uint64_t call;  // the call's fields (calls.h): an all_reduce's, or an all_reduce_rmsnorm's run as all_reduce
};

// Routing in and out in the caller's dtypes: ids int32 or int64 (both
// topk_idx and out_idx), weights fp32, bf16 or fp16 (both topk_weights and
// out_weights); the heap rows carry int32 ids and fp32 weights.
struct DispatchArgs {
  const void* x;         // [T, H] of x_dtype; FP8 bytes with x_scales
  DType x_dtype;
  const float* x_scales;  // FP8 pair: [T, fp8_scales] (nullptr when T = 0)
  bool fp8_pair;          // FP8: x and x_scales are a pair; else x (of x_dtype) is quantised
  const void* topk_idx;  // [T, K]
  bool idx_is_int64;
  const void* topk_weights;  // [T, K] of weights_dtype, or nullptr
  DType weights_dtype;
  int64_t ntok;
  int64_t num_experts;
  void* out_x;              // [W*cap, H]; rows past the received ones are left unwritten
  // The expert layout's dispatch: the receivers leave the peers' rows in the
  // heap, where the placement reads them (ExpertLayoutArgs::heap_gen), and
  // write only their routing; out_x then holds this rank's own rows alone
  // (none with own_rows_stay).
  bool peer_rows_stay;
  // And the sender writes only the routing of this rank's own rows (x's
  // bytes, not quantised here, where x keeps the rows' 16-byte vectors):
  // the placement reads them in x (ExpertLayoutArgs::own_x).
  bool own_rows_stay;
  float* out_scales;        // FP8: [W*cap, fp8_scales]; else nullptr
  bool fp8_vectors;         // FP8: whole blocks (H % kFp8Block == 0), x and out_x 16-byte aligned
  void* out_idx;            // [W*cap, K]
  void* out_weights;        // [W*cap, K] of weights_dtype, or nullptr
  int32_t* out_counts;      // [W]
  int32_t* out_recv_src;    // [W*cap]
  int32_t* out_src_tokens;  // [W]
  int32_t* out_send_mask;   // [T]
  int64_t* out_dispatch_round;  // [1]: this dispatch's round
  uint64_t call;                // the call's fields (calls.h)
};

struct CombineArgs {
  const void* y;  // [W*cap, H]; with rows_of, an expert layout's [expert_rows, H]
  // An expert layout's expert_rows_of ([W*cap, topk]), whose received row j
  // the kernel takes as the sum of its pair rows of y (pair_rows.cuh);
  // nullptr: y holds the rank layout's rows.
  const int32_t* rows_of;
  int64_t topk, expert_rows;
  const int32_t* recv_src;
  const int32_t* counts;
  const int32_t* src_tokens;
  const int32_t* send_mask;  // [T]
  const int64_t* dispatch_round;  // [1]: the handle's, the value of the call word
  bool expert_layout;             // the handle is an expert layout's
  int64_t ntok;
  DType dtype;
  void* out;  // [T, H]
};

// The expert layout of a rank-layout dispatch result (expert_layout.cu;
// docs/semantics.md, "Expert layout"). R = W*cap rows, of which the first
// sum(counts) were received; E local experts.
struct ExpertLayoutArgs {
  const void* ids;  // [R, K] local ids, -1 where the slot's expert lives elsewhere
  bool ids_int64;
  const void* weights;  // [R, K] of weights_dtype, or nullptr
  DType weights_dtype;
  const char* x;        // [R, row_bytes]
  const float* scales;  // FP8: [R, S]; else nullptr
  // Where dispatch left the peers' rows (DispatchArgs::peer_rows_stay):
  // source s's i-th row at heap.dispatch_row(heap_data, gen, s, i), its
  // scales at heap.row_scales, gen the dispatch's, read from heap_gen on
  // the device (this rank's dispatch counter); x holds the rows of source
  // `rank` alone, unless own_x holds them: the dispatch's input [own_tokens,
  // row_bytes] (its scales own_scales), row j being token recv_src[j] -
  // rank * heap.cap. heap_gen nullptr: every row is in x.
  const uint64_t* heap_gen;
  Layout heap;
  char* heap_data;
  int rank;
  const char* own_x;
  const float* own_scales;
  int64_t own_tokens;
  const int32_t* recv_src;
  const int32_t* counts;  // [W]
  int world;
  int64_t rows, topk, experts, alignment, expert_rows, row_bytes, scales_per_row;
  int sm_count;
  uint32_t* chunk_masks;     // scratch [expert_chunks(R), E]; nullptr where !expert_tally_launched
  int32_t* chunk_prefix;     // scratch [expert_chunks(R), E]; nullptr where !expert_tally_launched
  // Where the tally is launched: zero before it, its blocks count
  // themselves into it, the last resets it (expert_tally_kernel). The GPU
  // transport's word in its heap (stream-ordered launches), else a word of
  // the scratch zeroed for the call.
  uint32_t* tally_done;
  char* out_x;               // [expert_rows, row_bytes]
  float* out_scales;         // FP8: [expert_rows, S]; else nullptr
  void* out_weights;         // [expert_rows] of weights_dtype, or nullptr
  int32_t* out_counts;       // [E]
  int32_t* out_offsets;      // [E + 1]
  int32_t* out_rows_of;      // [R, K]
  int32_t* out_needed;       // [1]: the rows the pairs need (end of the furthest expert's rows)
};

// combine of an expert-layout y, first half: each received row's pair rows
// summed (sum_row), into the rank layout's rows.
struct ExpertSumArgs {
  const void* y;             // [expert_rows, H] of dtype
  const int32_t* rows_of;    // [R, K]
  const int32_t* counts;     // [W] (a handle's: clamped)
  int world;
  int64_t rows, topk, expert_rows, hidden;
  DType dtype;
  int sm_count;
  void* out;                 // [R, H] of dtype; rows past the received ones are left unwritten
};

// One chunk of all_reduce_rmsnorm (whole rows, at most rmsnorm_chunk_rows),
// or, with `local`, the residual add and the norm alone: x then holds the
// reduced rows (it may alias residual_out) and nothing is communicated.
struct AllReduceRmsNormArgs {
  const void* x;         // [rows, hidden]
  const void* residual;  // [rows, hidden] or nullptr
  const void* weight;    // [hidden] of dtype, or fp32 when weight_fp32
  bool weight_fp32;
  void* out;           // [rows, hidden]
  void* residual_out;  // [rows, hidden]
  int64_t rows, hidden;
  float eps;
  DType dtype;
  bool vectorized;  // 16-byte aligned pointers, rows of whole 16-byte vectors
  bool one_stage;
  bool local;
  uint64_t call;  // the call's fields (calls.h)
};

void launch_all_reduce(const Env& env, const AllReduceArgs& a, Stream s);
void launch_dispatch(const Env& env, const DispatchArgs& a, Stream s);
void launch_combine(const Env& env, const CombineArgs& a, Stream s);
void launch_all_reduce_rmsnorm(const Env& env, const AllReduceRmsNormArgs& a, Stream s);
void launch_expert_layout(const ExpertLayoutArgs& a, Stream s);
void launch_expert_sum(const ExpertSumArgs& a, Stream s);
// Writes, per source rank, the number of probe words that arrived wrong (or
// -1 when its flag never came) into `result` (device memory, [W] int32).
void launch_probe(const Env& env, int32_t* result, Stream s);

}  // namespace gpu
}  // namespace rdna4_comm
