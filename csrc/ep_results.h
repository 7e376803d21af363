// The EP ops' results, declared once: each output's name, field and shape
// rule (outputs()), from which the transports allocate them, the op table
// (ops.cpp) lists them and the fakes (rdna4_comm.ops, through
// _C.output_specs) build theirs.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

namespace rdna4_comm {

// An EP op's output: its shape, kTokenDim standing for the caller's token
// count, and dtype. The transports' outputs and the fakes (rdna4_comm.ops,
// through _C.output_specs) are built from these alone.
constexpr int64_t kTokenDim = -1;
struct OutputSpec {
  std::array<int64_t, 2> shape;
  int dims;
  at::ScalarType dtype;
  // The shape for `ntok` tokens (its first `dims` entries).
  std::array<int64_t, 2> with_tokens(int64_t ntok) const {
    return {shape[0] == kTokenDim ? ntok : shape[0], shape[1] == kTokenDim ? ntok : shape[1]};
  }
};

// What the shape rules of the EP outputs read: a communicator's sizes and
// the dtypes of the call's routing.
struct OutputShapes {
  int64_t rows;         // W*cap: the rank layout's received rows
  int64_t expert_rows;  // the expert layout's (CommConfig::expert_rows)
  int64_t world, hidden, topk, local_experts, scales;  // scales: fp8_num_scales(hidden) for FP8, else 0
  at::ScalarType payload;  // dispatch's x: FP8 or the communicator's dtype
  at::ScalarType ids;      // topk_idx's
  c10::optional<at::ScalarType> weights;  // topk_weights', none without them
};

// The shapes of the handle's outputs, which both layouts return.
inline OutputSpec per_source_rank(const OutputShapes& s) { return {{s.world, 0}, 1, at::kInt}; }
inline OutputSpec per_received_row(const OutputShapes& s) { return {{s.rows, 0}, 1, at::kInt}; }
inline OutputSpec per_token(const OutputShapes&) { return {{kTokenDim, 0}, 1, at::kInt}; }
inline OutputSpec one_round(const OutputShapes&) { return {{1, 0}, 1, at::kLong}; }

// An output of an EP op: its name, its field in the op's result struct,
// and the rule for its shape and dtype.
template <typename Result, typename T>
struct OutputDecl {
  const char* name;
  T Result::*field;
  OutputSpec (*shape)(const OutputShapes&);
};

// The EP ops' results are structs of named outputs, each a T: at::Tensor
// for the values, OutputSpec for their shapes. outputs() declares them,
// by name, in the op's order and with their shape rules: the one list of an
// op's outputs (ops.cpp makes the schemas, the kernels' and eager calls'
// results and the fakes' specs from it). x_scales, last, is the FP8 ops'
// alone.
template <typename T>
struct RankLayoutOf {
  T x, topk_idx, topk_weights, counts, recv_src, src_tokens, send_mask, dispatch_round, x_scales;
  static constexpr std::array<OutputDecl<RankLayoutOf, T>, 9> outputs() {
    using S = const OutputShapes&;
    return {{// [W*cap, H]: the received rows
             {"x", &RankLayoutOf::x, [](S s) { return OutputSpec{{s.rows, s.hidden}, 2, s.payload}; }},
             // [W*cap, K]: local expert id or -1
             {"topk_idx", &RankLayoutOf::topk_idx, [](S s) { return OutputSpec{{s.rows, s.topk}, 2, s.ids}; }},
             // [W*cap, K], or [0, K] without weights
             {"topk_weights", &RankLayoutOf::topk_weights,
              [](S s) { return OutputSpec{{s.weights ? s.rows : 0, s.topk}, 2, s.weights.value_or(at::kFloat)}; }},
             // [W] int32: rows received per source
             {"counts", &RankLayoutOf::counts, per_source_rank},
             // [W*cap] int32: source rank * cap + source token, -1 for padding
             {"recv_src", &RankLayoutOf::recv_src, per_received_row},
             // [W] int32: T of each source rank
             {"src_tokens", &RankLayoutOf::src_tokens, per_source_rank},
             // [T] int32: bit d set when the token was sent to rank d
             {"send_mask", &RankLayoutOf::send_mask, per_token},
             // [1] int64: this dispatch's round (calls.h), the same on every rank
             {"dispatch_round", &RankLayoutOf::dispatch_round, one_round},
             // FP8: [W*cap, fp8_num_scales(H)] fp32, x's scales
             {"x_scales", &RankLayoutOf::x_scales,
              [](S s) { return OutputSpec{{s.rows, s.scales}, 2, at::kFloat}; }}}};
  }
};

// dispatch's result. Rows of x from counts.sum() on are unspecified (never
// written: a decode step must not pay for the capacity); the routing of
// those rows is -1 ids and 0 weights.
struct Dispatched : RankLayoutOf<at::Tensor> {
  // The expert layout's dispatch on the GPU transport leaves the rows where
  // they are, for the placement to read (Comm::place_expert_rows): the
  // peers' in the heap; this rank's own in own_rows (and own_scales), the
  // caller's x ([T, H]) and scales, where the payload is the input's bytes
  // (not FP8 quantised by the op) on 16-byte vectors; else in x and x_scales.
  bool peer_rows_in_heap = false;
  at::Tensor own_rows, own_scales;
};

// The expert layout (docs/semantics.md, "Expert layout"): dispatch's rows
// grouped by local expert, built from the rank layout's; the handle's
// outputs are the rank layout's.
template <typename T>
struct ExpertLayoutOf {
  T x, expert_counts, expert_offsets, topk_weights, recv_src, counts, src_tokens, send_mask, expert_rows_of,
      dispatch_round, x_scales;
  static constexpr std::array<OutputDecl<ExpertLayoutOf, T>, 11> outputs() {
    using S = const OutputShapes&;
    return {{// [expert_rows, H]: the pairs' rows, by local expert
             {"x", &ExpertLayoutOf::x, [](S s) { return OutputSpec{{s.expert_rows, s.hidden}, 2, s.payload}; }},
             // [E_loc] int32
             {"expert_counts", &ExpertLayoutOf::expert_counts,
              [](S s) { return OutputSpec{{s.local_experts, 0}, 1, at::kInt}; }},
             // [E_loc + 1] int32, aligned to expert_alignment
             {"expert_offsets", &ExpertLayoutOf::expert_offsets,
              [](S s) { return OutputSpec{{s.local_experts + 1, 0}, 1, at::kInt}; }},
             // [expert_rows], or [0] without weights
             {"topk_weights", &ExpertLayoutOf::topk_weights,
              [](S s) { return OutputSpec{{s.weights ? s.expert_rows : 0, 0}, 1, s.weights.value_or(at::kFloat)}; }},
             {"recv_src", &ExpertLayoutOf::recv_src, per_received_row},
             {"counts", &ExpertLayoutOf::counts, per_source_rank},
             {"src_tokens", &ExpertLayoutOf::src_tokens, per_source_rank},
             {"send_mask", &ExpertLayoutOf::send_mask, per_token},
             // [W*cap, K] int32: a received row's expert rows, ascending expert, then -1
             {"expert_rows_of", &ExpertLayoutOf::expert_rows_of,
              [](S s) { return OutputSpec{{s.rows, s.topk}, 2, at::kInt}; }},
             {"dispatch_round", &ExpertLayoutOf::dispatch_round, one_round},
             // FP8: [expert_rows, fp8_num_scales(H)] fp32
             {"x_scales", &ExpertLayoutOf::x_scales,
              [](S s) { return OutputSpec{{s.expert_rows, s.scales}, 2, at::kFloat}; }}}};
  }
};
using ExpertDispatched = ExpertLayoutOf<at::Tensor>;

// f(name, tensor field, spec field) for each output of an op whose result
// is a Result<T>, in order: x_scales only for an FP8 op.
template <template <typename> class Result, typename F>
void for_each_output(bool fp8, F&& f) {
  constexpr auto tensors = Result<at::Tensor>::outputs();
  constexpr auto specs = Result<OutputSpec>::outputs();
  for (size_t i = 0; i < tensors.size() - (fp8 ? 0 : 1); ++i) f(tensors[i].name, tensors[i].field, specs[i].field);
}

// Every output's spec of a Result, by its shape rule.
template <template <typename> class Result>
Result<OutputSpec> output_specs(const OutputShapes& shapes) {
  Result<OutputSpec> specs;
  for (const auto& o : Result<OutputSpec>::outputs()) specs.*(o.field) = o.shape(shapes);
  return specs;
}

}  // namespace rdna4_comm
