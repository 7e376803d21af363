// The EP ops' outputs: their shapes and dtypes (one definition for the
// transports and the fakes), and the expert layout, which dispatch_expert
// builds from the rank layout's rows and combine_expert takes back (every
// transport gives the same bits, since every transport's rank layout
// does). On CPU tensors both run as loops over the received rows alone;
// on device tensors, until kernels place the rows there, as tensor ops
// over all W*cap row slots (no host synchronisation).
#include "comm.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace rdna4_comm {
namespace {

// Slot k of a received row (ids: its K local ids, -1 where the expert lives
// elsewhere) starts a pair when it names a local expert that no earlier
// slot of the row names; the pair's weight is the fp32 sum of the row's
// weights for that expert in slot order from there, rounded once.
template <typename IdxT>
bool starts_pair(const IdxT* ids, int64_t k) {
  if (ids[k] < 0) return false;
  for (int64_t i = 0; i < k; ++i)
    if (ids[i] == ids[k]) return false;
  return true;
}
template <typename IdxT, typename WT>
WT pair_weight(const IdxT* ids, const WT* w, int64_t k, int64_t K) {
  float acc = static_cast<float>(w[k]);
  for (int64_t i = k + 1; i < K; ++i)
    if (ids[i] == ids[k]) acc += static_cast<float>(w[i]);
  return static_cast<WT>(acc);
}

int64_t received_rows(const at::Tensor& counts) {
  const int32_t* c = counts.data_ptr<int32_t>();
  int64_t n = 0;
  for (int64_t s = 0; s < counts.numel(); ++s) n += c[s];
  return n;
}

}  // namespace

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
  if (d.x.is_cpu()) return expert_layout_on_host(d, topk_weights.has_value());
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
  check_expert_rows_later((offsets.narrow(0, 0, E) + counts).amax().view({1}).to(at::kInt));

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

void Comm::check_expert_rows_later(const at::Tensor& needed) {
  const int64_t n = cfg_.expert_rows();
  defer_check({needed}, [n](const int32_t* rows) {
    TORCH_CHECK_VALUE(*rows <= n, "dispatch: the expert layout of an earlier call needed ", *rows,
                      " rows, more than this communicator's expert_rows = ", n,
                      " (max_expert_rows): the rows past it were dropped and nothing was written out of bounds. "
                      "Pass a larger max_expert_rows, or none for the worst case");
  });
}

// The rule of dispatch_expert above, row by row over the rows received.
ExpertDispatched Comm::expert_layout_on_host(const Dispatched& d, bool weights) {
  const int64_t E = cfg_.experts_per_rank(), K = cfg_.topk, A = cfg_.expert_alignment, n = cfg_.expert_rows();
  const int64_t R = d.topk_idx.size(0), received = received_rows(d.counts);
  const bool fp8 = cfg_.fp8();
  const int64_t row_bytes = cfg_.hidden * int64_t(c10::elementSize(cfg_.dispatched_dtype()));
  const int64_t S = fp8 ? d.x_scales.size(1) : 0;
  ExpertDispatched out;
  out.x = empty({n, cfg_.hidden}, cfg_.dispatched_dtype());
  if (fp8) out.x_scales = empty({n, S}, at::kFloat);
  out.topk_weights = weights ? empty({n}, d.topk_weights.scalar_type()) : empty({0}, at::kFloat);
  out.expert_rows_of = at::full({R, K}, -1, d.topk_idx.options().dtype(at::kInt));
  const size_t nE = static_cast<size_t>(E);
  std::vector<int64_t> counts(nE, 0), offsets(nE + 1, 0), next(nE, 0);
  const char* x_in = static_cast<const char*>(d.x.data_ptr());
  char* x_out = static_cast<char*>(out.x.data_ptr());
  int32_t* rows_of = out.expert_rows_of.data_ptr<int32_t>();
  AT_DISPATCH_INDEX_TYPES(d.topk_idx.scalar_type(), "dispatch_expert", [&] {
    const index_t* ids = d.topk_idx.data_ptr<index_t>();
    for (int64_t j = 0; j < received; ++j)
      for (int64_t k = 0; k < K; ++k)
        if (starts_pair(ids + j * K, k)) ++counts[size_t(ids[j * K + k])];
    for (size_t e = 0; e < nE; ++e) offsets[e + 1] = offsets[e] + (counts[e] + A - 1) / A * A;
    // Alignment padding rows (those that fit) are zeros, their scales and weights too.
    for (size_t e = 0; e < nE; ++e) {
      const int64_t lo = std::min(offsets[e] + counts[e], n), hi = std::min(offsets[e + 1], n);
      if (hi <= lo) continue;
      std::memset(x_out + lo * row_bytes, 0, size_t((hi - lo) * row_bytes));
      if (fp8) out.x_scales.narrow(0, lo, hi - lo).zero_();
      if (weights) out.topk_weights.narrow(0, lo, hi - lo).zero_();
    }
    std::copy(offsets.begin(), offsets.end() - 1, next.begin());
    const float* scales_in = fp8 ? d.x_scales.data_ptr<float>() : nullptr;
    float* scales_out = fp8 ? out.x_scales.data_ptr<float>() : nullptr;
    const at::ScalarType w_dtype = weights ? d.topk_weights.scalar_type() : at::kFloat;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w_dtype, "dispatch_expert", [&] {
      const scalar_t* w_in = weights ? d.topk_weights.data_ptr<scalar_t>() : nullptr;
      scalar_t* w_out = weights ? out.topk_weights.data_ptr<scalar_t>() : nullptr;
      std::vector<std::pair<index_t, int32_t>> pairs;  // (expert, row) of a received row's kept pairs
      for (int64_t j = 0; j < received; ++j) {
        const index_t* row_ids = ids + j * K;
        pairs.clear();
        for (int64_t k = 0; k < K; ++k) {
          if (!starts_pair(row_ids, k)) continue;
          const int64_t at = next[size_t(row_ids[k])]++;
          if (at >= n) continue;  // past expert_rows: dropped, and raised at a later op
          std::memcpy(x_out + at * row_bytes, x_in + j * row_bytes, size_t(row_bytes));
          if (fp8) std::memcpy(scales_out + at * S, scales_in + j * S, size_t(S) * sizeof(float));
          if (weights) w_out[at] = pair_weight(row_ids, w_in + j * K, k, K);
          pairs.emplace_back(row_ids[k], int32_t(at));
        }
        std::sort(pairs.begin(), pairs.end());
        for (size_t i = 0; i < pairs.size(); ++i) rows_of[j * K + int64_t(i)] = pairs[i].second;
      }
    });
  });
  int64_t needed = 0;
  for (int64_t e = 0; e < E; ++e) needed = std::max(needed, offsets[size_t(e)] + counts[size_t(e)]);
  out.expert_counts = empty({E}, at::kInt);
  out.expert_offsets = empty({E + 1}, at::kInt);
  for (int64_t e = 0; e <= E; ++e) {
    if (e < E) out.expert_counts.data_ptr<int32_t>()[e] = int32_t(counts[size_t(e)]);
    out.expert_offsets.data_ptr<int32_t>()[e] = int32_t(offsets[size_t(e)]);
  }
  check_expert_rows_later(at::full({1}, needed, d.counts.options()));
  out.recv_src = d.recv_src;
  out.counts = d.counts;
  out.src_tokens = d.src_tokens;
  out.send_mask = d.send_mask;
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
  if (y.is_cpu()) {
    check_handle_fields(op, recv_src, counts, src_tokens, send_mask);
    // A forged count reads no row outside [0, R); combine raises for it.
    const int64_t received = std::min(std::max(received_rows(counts), int64_t(0)), R), H = cfg_.hidden;
    const at::Tensor yc = y.contiguous(), of = expert_rows_of.contiguous();
    at::Tensor rows = empty({R, H}, cfg_.dtype);
    const int32_t* rows_of = of.data_ptr<int32_t>();
    std::vector<float> acc(static_cast<size_t>(H));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cfg_.dtype, "combine_expert", [&] {
      const scalar_t* in = yc.data_ptr<scalar_t>();
      scalar_t* sums = rows.data_ptr<scalar_t>();
      for (int64_t j = 0; j < received; ++j) {
        // -0.0 is the sum of no terms: x + -0.0 == x for every x, -0.0 included.
        std::fill(acc.begin(), acc.end(), -0.f);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = rows_of[j * K + k];
          if (r < 0 || r >= n) continue;
          for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += static_cast<float>(in[r * H + h]);
        }
        for (int64_t h = 0; h < H; ++h) sums[j * H + h] = static_cast<scalar_t>(acc[size_t(h)]);
      }
    });
    return combine(rows, recv_src, counts, src_tokens, send_mask);
  }
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
