// The EP ops' outputs: their shapes and dtypes (one definition for the
// transports and the fakes), and the expert layout, which dispatch_expert
// builds from the rank layout's rows with tensor ops on the op's device
// (no host synchronisation; every transport gives the same bits, since
// every transport's rank layout does) and combine_expert takes back.
#include "comm.h"

#include <c10/util/Exception.h>

namespace rdna4_comm {

std::array<OutputSpec, kDispatchOutputs> Comm::dispatch_outputs(at::ScalarType idx_dtype,
                                                                c10::optional<at::ScalarType> weights_dtype) const {
  const int64_t rows = int64_t(cfg_.world) * cfg_.cap, K = cfg_.topk;
  return {{{{rows, cfg_.hidden}, 2, cfg_.dispatched_dtype()},
           {{rows, K}, 2, idx_dtype},
           {{weights_dtype ? rows : 0, K}, 2, weights_dtype.value_or(at::kFloat)},
           {{cfg_.world, 0}, 1, at::kInt},
           {{rows, 0}, 1, at::kInt},
           {{cfg_.world, 0}, 1, at::kInt},
           {{kTokenDim, 0}, 1, at::kInt}}};
}

OutputSpec Comm::combine_output() const { return {{kTokenDim, cfg_.hidden}, 2, cfg_.dtype}; }

at::Tensor Comm::empty_output(const OutputSpec& spec, int64_t ntok) const {
  const std::array<int64_t, 2> n = spec.with_tokens(ntok);
  return empty(at::IntArrayRef(n.data(), spec.dims), spec.dtype);
}

Dispatched Comm::allocate_dispatched(int64_t ntok, at::ScalarType idx_dtype,
                                     c10::optional<at::ScalarType> weights_dtype) const {
  const auto specs = dispatch_outputs(idx_dtype, weights_dtype);
  Dispatched d;
  at::Tensor* fields[kDispatchOutputs] = {&d.x, &d.topk_idx, &d.topk_weights, &d.counts,
                                          &d.recv_src, &d.src_tokens, &d.send_mask};
  for (int i = 0; i < kDispatchOutputs; ++i) *fields[i] = empty_output(specs[i], ntok);
  if (cfg_.fp8()) d.x_scales = empty_output(dispatch_scales_output(false), ntok);
  return d;
}

OutputSpec Comm::dispatch_scales_output(bool expert_layout) const {
  const int64_t rows = expert_layout ? cfg_.expert_rows() : int64_t(cfg_.world) * cfg_.cap;
  return {{rows, cfg_.fp8_scales}, 2, at::kFloat};
}

std::array<OutputSpec, kExpertDispatchOutputs> Comm::dispatch_expert_outputs(
    c10::optional<at::ScalarType> weights_dtype) const {
  const int64_t rows = int64_t(cfg_.world) * cfg_.cap, E = cfg_.experts_per_rank(), n = cfg_.expert_rows();
  return {{{{n, cfg_.hidden}, 2, cfg_.dispatched_dtype()},
           {{E, 0}, 1, at::kInt},
           {{E + 1, 0}, 1, at::kInt},
           {{weights_dtype ? n : 0, 0}, 1, weights_dtype.value_or(at::kFloat)},
           {{rows, 0}, 1, at::kInt},
           {{cfg_.world, 0}, 1, at::kInt},
           {{cfg_.world, 0}, 1, at::kInt},
           {{kTokenDim, 0}, 1, at::kInt},
           {{rows, cfg_.topk}, 2, at::kInt}}};
}

// Received row j of the rank layout goes to one expert row per distinct
// local expert e among its slots: offsets[e] + (rows before j that have e).
// Slot k of row j is e's "first" slot when no earlier slot of the row names
// e; it carries the pair's destination, the pair's weight (the fp32 sum of
// the row's weights for e, in slot order from the first, rounded once) and,
// through it, the combine's map from rows back to expert rows.
ExpertDispatched Comm::dispatch_expert(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                                       const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights) {
  Dispatched d = dispatch(x, x_scales, topk_idx, topk_weights);
  const int64_t E = cfg_.experts_per_rank(), K = cfg_.topk, A = cfg_.expert_alignment, n = cfg_.expert_rows();
  const at::Tensor ids = d.topk_idx.to(at::kLong);  // [R, K]: local ids, -1 where the expert is elsewhere
  const int64_t R = ids.size(0);
  const at::Tensor here = ids >= 0;
  // same[j, k, k']: slots k and k' of row j name the same expert; earlier[k, k']: k' < k.
  const at::Tensor same = (ids.unsqueeze(2) == ids.unsqueeze(1)) & here.unsqueeze(2);
  const at::Tensor slot = at::arange(K, ids.options());
  const at::Tensor earlier = slot.view({1, K}) < slot.view({K, 1});
  // first[j, k]: no earlier slot of row j names the same expert.
  const at::Tensor first = here & ~(same & earlier).any(2);
  const at::Tensor e = at::where(first, ids, 0);
  // has[j, e]: row j has expert e; counts, aligned offsets, row positions.
  const at::Tensor has = at::zeros({R, E + 1}, ids.options()).scatter_(1, at::where(here, ids, E), 1).narrow(1, 0, E);
  const at::Tensor counts = has.sum(0);
  const at::Tensor offsets = at::cat({at::zeros({1}, ids.options()), (at::floor_divide(counts + (A - 1), A) * A).cumsum(0)});
  const at::Tensor before = has.cumsum(0) - has;  // rows above j with e
  const at::Tensor dest = offsets.index_select(0, e.reshape(-1)).view({R, K}) + before.gather(1, e);
  // A pair past the layout's rows (max_expert_rows too small) is dropped:
  // it goes to the extra row n, which no output keeps.
  const at::Tensor kept = first & (dest < n);
  const at::Tensor to = at::where(kept, dest, n).reshape(-1);
  // The rows the pairs need: up to the end of the last nonempty block (its
  // alignment padding need not fit).
  const at::Tensor needed_rows = (offsets.narrow(0, 0, E) + counts).amax().view({1});
  defer_check({needed_rows.to(at::kInt)}, [this, n](const int32_t* needed) {
    TORCH_CHECK_VALUE(*needed <= n, "dispatch: the expert layout of an earlier call needed ", *needed,
                      " rows, more than this communicator's expert_rows = ", n,
                      " (max_expert_rows): the rows past it were dropped and nothing was written out of bounds. "
                      "Pass a larger max_expert_rows, or none for the worst case");
  });

  ExpertDispatched out;
  at::Tensor source = at::full({n + 1}, -1, ids.options());
  source.scatter_(0, to, at::arange(R, ids.options()).view({R, 1}).expand({R, K}).reshape(-1));
  source = source.narrow(0, 0, n);
  // Rows without a pair (alignment padding, the tail) are zeros, scales too.
  // FP8 rows move as their bytes.
  const at::Tensor paired = (source >= 0).unsqueeze(1), at_source = source.clamp_min(0);
  auto expert_rows = [&](const at::Tensor& rows) { return at::where(paired, rows.index_select(0, at_source), 0); };
  out.x = cfg_.fp8() ? expert_rows(d.x.view(at::kByte)).view(cfg_.dispatched_dtype()) : expert_rows(d.x);
  if (cfg_.fp8()) out.x_scales = expert_rows(d.x_scales);
  out.expert_counts = counts.to(at::kInt);
  out.expert_offsets = offsets.to(at::kInt);
  if (topk_weights.has_value()) {
    // The pair's weight: its slots' weights summed in slot order, from its first slot.
    const at::Tensor w = d.topk_weights, w32 = w.to(at::kFloat);
    const at::Tensor later_same = same & earlier.t();  // [j, k, k']: k' > k names the same expert
    at::Tensor acc = w32;
    for (int64_t k = 1; k < K; ++k) acc = at::where(later_same.select(2, k), acc + w32.narrow(1, k, 1), acc);
    out.topk_weights = at::zeros({n + 1}, w.options()).scatter_(0, to, acc.to(w.scalar_type()).reshape(-1)).narrow(0, 0, n);
  } else {
    out.topk_weights = at::empty({0}, d.x.options().dtype(at::kFloat));
  }
  out.recv_src = d.recv_src;
  out.counts = d.counts;
  out.src_tokens = d.src_tokens;
  out.send_mask = d.send_mask;
  // A row's expert rows in ascending expert order (what combine sums), then -1.
  const at::Tensor order = std::get<1>(at::sort(at::where(kept, ids, E), c10::optional<bool>(true), /*dim=*/1, /*descending=*/false));
  out.expert_rows_of = at::where(kept, dest, -1).gather(1, order).to(at::kInt).contiguous();
  return out;
}

at::Tensor Comm::combine_expert(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& recv_src,
                                const at::Tensor& counts, const at::Tensor& src_tokens, const at::Tensor& send_mask) {
  check();
  static const char* op = "combine";
  check_ep(cfg_, op);
  const int64_t n = cfg_.expert_rows(), R = int64_t(cfg_.world) * cfg_.cap, K = cfg_.topk;
  const auto dev = device();
  check_device(op, "y", y, dev);
  check_shape(op, "y", y, {n, cfg_.hidden}, "[comm.expert_rows, hidden] for an expert-layout handle");
  check_dtype(op, "y", y, cfg_.dtype);
  check_device(op, "handle.expert_rows_of", expert_rows_of, dev);
  check_dtype(op, "handle.expert_rows_of", expert_rows_of, at::kInt);
  check_shape(op, "handle.expert_rows_of", expert_rows_of, {R, K}, "[world_size * max_tokens_per_rank, topk]");
  // Each received row: its expert rows summed in fp32 in ascending expert
  // order, from the first, rounded once. A value outside [0, n) (a forged
  // handle) names no row.
  const at::Tensor rows = expert_rows_of.to(at::kLong);
  const at::Tensor valid = (rows >= 0) & (rows < n);
  const at::Tensor at_row = at::where(valid, rows, 0);
  auto term = [&](int64_t k) { return y.index_select(0, at_row.select(1, k)).to(at::kFloat); };
  auto ok = [&](int64_t k) { return valid.narrow(1, k, 1); };
  // -0.0 is the sum of no terms: x + -0.0 == x for every x, -0.0 included.
  at::Tensor acc = at::where(ok(0), term(0), -0.f);
  for (int64_t k = 1; k < K; ++k) acc = at::where(ok(k), acc + term(k), acc);
  return combine(acc.to(cfg_.dtype).contiguous(), recv_src, counts, src_tokens, send_mask);
}

}  // namespace rdna4_comm
