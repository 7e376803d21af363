// The EP ops' outputs: their shapes and dtypes (one definition for the
// transports and the fakes), and the expert layout, which dispatch_expert
// builds from the rank layout's rows and combine_expert takes back (every
// transport gives the same bits, since every transport's rank layout
// does). Both run over the received rows alone: as loops on CPU tensors,
// as kernels on device tensors (csrc/gpu/expert_layout.cu, with no host
// synchronisation).
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

OutputShapes Comm::output_shapes(at::ScalarType idx_dtype, c10::optional<at::ScalarType> weights_dtype) const {
  return {int64_t(cfg_.world) * cfg_.cap, cfg_.expert_rows(), cfg_.world, cfg_.hidden, cfg_.topk,
          cfg_.experts_per_rank(), cfg_.fp8_scales, cfg_.dispatched_dtype(), idx_dtype, weights_dtype};
}

OutputSpec Comm::combine_output() const { return {{kTokenDim, cfg_.hidden}, 2, cfg_.dtype}; }

at::Tensor Comm::empty_output(const OutputSpec& spec, int64_t ntok) const {
  const std::array<int64_t, 2> n = spec.with_tokens(ntok);
  return empty(at::IntArrayRef(n.data(), spec.dims), spec.dtype);
}

Dispatched Comm::allocate_dispatched(int64_t ntok, at::ScalarType idx_dtype,
                                     c10::optional<at::ScalarType> weights_dtype) const {
  const RankLayoutOf<OutputSpec> specs = dispatch_outputs(idx_dtype, weights_dtype);
  Dispatched d;
  for_each_output<RankLayoutOf>(cfg_.fp8(), [&](const char*, auto tensor, auto spec) {
    d.*tensor = empty_output(specs.*spec, ntok);
  });
  return d;
}

// Received row j of the rank layout goes to one expert row per distinct
// local expert e among its slots: offsets[e] + (rows before j that have e).
// Slot k of row j is e's "first" slot when no earlier slot of the row names
// e; it carries the pair's destination, the pair's weight (the fp32 sum of
// the row's weights for e, in slot order from the first, rounded once) and,
// through it, the combine's map from rows back to expert rows. A pair past
// expert_rows is dropped (check_expert_rows_later raises for it).
ExpertDispatched Comm::dispatch_expert(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                                       const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights) {
  Dispatched d = dispatch_rows(x, x_scales, topk_idx, topk_weights, true, places_from_heap());
  const bool weights = topk_weights.has_value();
  const ExpertLayoutOf<OutputSpec> specs = dispatch_expert_outputs(
      weights ? c10::optional<at::ScalarType>(d.topk_weights.scalar_type()) : c10::nullopt);
  ExpertDispatched out;
  // The layout's own outputs; the handle's are the rank layout's (below).
  out.x = empty_output(specs.x, 0);
  out.topk_weights = empty_output(specs.topk_weights, 0);
  out.expert_counts = empty_output(specs.expert_counts, 0);
  out.expert_offsets = empty_output(specs.expert_offsets, 0);
  out.expert_rows_of = empty_output(specs.expert_rows_of, 0);
  if (cfg_.fp8()) out.x_scales = empty_output(specs.x_scales, 0);
  const at::Tensor needed = check_output(1);
  place_expert_rows(d, out, needed);
  check_expert_rows_later(needed);
  out.recv_src = d.recv_src;
  out.counts = d.counts;
  out.src_tokens = d.src_tokens;
  out.send_mask = d.send_mask;
  out.dispatch_round = d.dispatch_round;
  return out;
}

void Comm::place_expert_rows(const Dispatched& d, ExpertDispatched& out, const at::Tensor& needed) {
  if (d.x.is_cpu()) {
    expert_layout_on_host(d, out, needed);
    return;
  }
#ifdef RDNA4_COMM_WITH_GPU
  expert_layout_on_gpu(d, cfg_.experts_per_rank(), cfg_.expert_alignment, out, needed);
#else
  TORCH_CHECK(false, "dispatch: the expert layout of device tensors needs rdna4_comm's GPU kernels, and this "
              "build has none (built without CUDA or ROCm): rebuild it with a GPU build of torch (README.md)");
#endif
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
void Comm::expert_layout_on_host(const Dispatched& d, ExpertDispatched& out, const at::Tensor& needed) {
  const int64_t E = cfg_.experts_per_rank(), K = cfg_.topk, A = cfg_.expert_alignment, n = cfg_.expert_rows();
  const int64_t received = received_rows(d.counts);
  const bool fp8 = cfg_.fp8(), weights = d.topk_weights.numel() > 0;
  const int64_t row_bytes = cfg_.hidden * int64_t(c10::elementSize(cfg_.dispatched_dtype()));
  const int64_t S = fp8 ? d.x_scales.size(1) : 0;
  out.expert_rows_of.fill_(-1);
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
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, offsets[size_t(e)] + counts[size_t(e)]);
  *needed.data_ptr<int32_t>() = int32_t(most);
  for (int64_t e = 0; e <= E; ++e) {
    if (e < E) out.expert_counts.data_ptr<int32_t>()[e] = int32_t(counts[size_t(e)]);
    out.expert_offsets.data_ptr<int32_t>()[e] = int32_t(offsets[size_t(e)]);
  }
}

at::Tensor Comm::combine_expert(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& recv_src,
                                const at::Tensor& counts, const at::Tensor& src_tokens, const at::Tensor& send_mask,
                                const at::Tensor& dispatch_round) {
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
  // counts picks the rows summed: its device, dtype and shape first.
  check_handle_fields(op, recv_src, counts, src_tokens, send_mask, dispatch_round);
  call_ = combine_call(true, 0);
  return combine_expert_checked(y.contiguous(), expert_rows_of.contiguous(), recv_src, counts, src_tokens, send_mask,
                                dispatch_round);
}

at::Tensor Comm::combine_expert_checked(const at::Tensor& yc, const at::Tensor& of, const at::Tensor& recv_src,
                                        const at::Tensor& counts, const at::Tensor& src_tokens,
                                        const at::Tensor& send_mask, const at::Tensor& dispatch_round) {
  const int64_t n = cfg_.expert_rows(), R = int64_t(cfg_.world) * cfg_.cap, K = cfg_.topk;
  // Each received row: its expert rows summed in fp32 in ascending expert
  // order, from the first, rounded once. A value outside [0, n) (a forged
  // handle) names no row, and a forged count reads no row outside [0, R):
  // combine raises for it.
  const at::Tensor rows = empty({R, cfg_.hidden}, cfg_.dtype);
  if (yc.is_cpu()) {
    const int64_t received = std::min(std::max(received_rows(counts), int64_t(0)), R), H = cfg_.hidden;
    const int32_t* rows_of = of.data_ptr<int32_t>();
    std::vector<float> acc(static_cast<size_t>(H));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cfg_.dtype, "combine_expert", [&] {
      const scalar_t* in = yc.data_ptr<scalar_t>();
      scalar_t* sums = rows.data_ptr<scalar_t>();
      for (int64_t j = 0; j < received; ++j) {
        // Starting from -0.0 is starting from the first term (x + -0.0 == x
        // for every x, -0.0 included); a row with no terms is zeros.
        std::fill(acc.begin(), acc.end(), -0.f);
        bool any = false;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = rows_of[j * K + k];
          if (r < 0 || r >= n) continue;
          any = true;
          for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += static_cast<float>(in[r * H + h]);
        }
        for (int64_t h = 0; h < H; ++h) sums[j * H + h] = static_cast<scalar_t>(any ? acc[size_t(h)] : 0.f);
      }
    });
  } else {
#ifdef RDNA4_COMM_WITH_GPU
    sum_expert_rows_on_gpu(yc, of, counts, rows);
#else
    TORCH_CHECK(false, "combine: the expert layout of device tensors needs rdna4_comm's GPU kernels, and this "
                "build has none (built without CUDA or ROCm): rebuild it with a GPU build of torch (README.md)");
#endif
  }
  // rows is this op's own, and the handle's fields were checked before.
  return combine_checked(rows, recv_src, counts, src_tokens, send_mask, dispatch_round);
}

}  // namespace rdna4_comm
