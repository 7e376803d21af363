#include "comm.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "bounds.h"
#include "flags.h"
#include "policies.h"

namespace rdna4_comm {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// torch's Python spelling, which users read in error messages.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    default: return c10::toString(t);
  }
}

void check_device(const char* op, const char* arg, const at::Tensor& t, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.device() == dev, op, ": ", arg, " must be on ", dev,
                    " (the communicator's device), got ", t.device());
}

void check_contiguous(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", arg,
                    " must be contiguous (call .contiguous() first), got strides ", t.strides());
}

void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, op, ": ", arg, " must be ", dtype_name(want), ", got ",
                   dtype_name(t.scalar_type()));
}

// `want` is a view (an initializer list or a tensor's sizes): no allocation
// on the eager path, which checks several shapes per call.
void check_shape(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef want, const char* meaning) {
  TORCH_CHECK_VALUE(t.sizes() == want, op, ": ", arg, " must have shape ", want, " (", meaning, "), got ",
                    shape_str(t));
}

void check_ep(const CommConfig& c, const char* op) {
  TORCH_CHECK(c.has_ep(), op, ": communicator '", c.id,
              "' was created without EP fields; pass max_tokens_per_rank, hidden, topk and "
              "num_experts to Communicator to use dispatch/combine");
}

namespace {
// The EP element size follows the payload dtype (no EP: no EP buffers).
CommConfig with_element_size(CommConfig c) {
  c.elt = c.has_ep() ? int64_t(c10::elementSize(c.dtype)) : 0;
  c.fp8_scales = c.has_ep() && c.fp8() ? fp8_num_scales(c.hidden) : 0;
  return c;
}
}  // namespace

Comm::Comm(CommConfig cfg)
    : cfg_(with_element_size(std::move(cfg))), layout_(make_layout(cfg_)), transport_(find_transport(cfg_.transport)) {}

std::string Comm::timeout_message(int op, int peer, uint64_t round, uint64_t mine,
                                  const uint64_t peer_words[2]) const {
  std::ostringstream s;
  s << "rdna4_comm: " << op_name(op) << " on rank " << cfg_.rank << " of communicator '" << cfg_.id
    << "' timed out after " << cfg_.timeout_ms << " ms waiting for rank " << peer << " in round " << round << " ("
    << call_name(mine) << "). ";
  const uint64_t now = peer_words[round & 1], before = peer_words[(round + 1) & 1];
  if (call_of_round(now, round)) {
    s << "Rank " << peer << " made that call too, but its part did not arrive: it died or stalled inside the call"
      << (transport_.writes_cross_links ? ", or its peer-to-peer writes do not reach this GPU" : "") << ".";
  } else {
    s << "Rank " << peer << " had not made this call by then";
    if (round > 1 && call_of_round(before, round - 1))
      s << " (its last call was round " << round - 1 << ", " << call_name(before) << ")";
    else if (before == 0 && now == 0)
      s << " (it has made no call on this communicator)";
    s << ": it is alive (a peer on this host whose process exits is noticed at once) but busy elsewhere, "
         "waiting in another collective, or not calling this communicator.";
  }
  s << " The communicator is unusable now: close it and create a new one (timeout_ms or RDNA4_COMM_TIMEOUT_MS "
       "sets the bound).";
  return s.str();
}

namespace {
// Event queries and host allocations are not allowed while the current
// stream captures a graph (they would invalidate the capture).
bool capturing(const at::Device& dev) {
#ifdef RDNA4_COMM_WITH_GPU
  return dev.is_cuda() && current_stream_capturing(dev.index());
#else
  return false;
#endif
}
}  // namespace

at::Tensor Comm::check_output(int64_t n) const {
  const at::Device dev = device();
  if (dev.is_cuda() && !capturing(dev)) return at::empty({n}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  return empty({n}, at::kInt);
}

void Comm::defer_check(std::initializer_list<at::Tensor> values, std::function<void(const int32_t*)> check) {
  const at::Device dev = device();
  if (capturing(dev)) return;
  DeferredCheck c{*values.begin(), c10::nullopt, std::move(check)};
  if (values.size() > 1 || !c.host.is_cpu()) {
    int64_t n = 0;
    for (const at::Tensor& t : values) n += t.numel();
    c.host = at::empty({n}, at::TensorOptions().dtype(at::kInt).pinned_memory(dev.is_cuda()));
    int64_t at = 0;
    for (const at::Tensor& t : values) {
      c.host.narrow(0, at, t.numel()).copy_(t.reshape(-1), /*non_blocking=*/dev.is_cuda());
      at += t.numel();
    }
  }
  if (dev.is_cuda()) {
    // The host reads the values once the op's stream has passed the kernels
    // that store them, or the copy.
    c.landed.emplace(dev.type());
    c.landed->record(c10::impl::VirtualGuardImpl(dev.type()).getStream(dev));
  }
  deferred_.push_back(std::move(c));
}

void Comm::run_deferred_checks(size_t most) {
  if (deferred_.empty() || capturing(device())) return;
  for (; most > 0 && !deferred_.empty() && (!deferred_.front().landed || deferred_.front().landed->query()); --most) {
    const DeferredCheck c = std::move(deferred_.front());
    deferred_.pop_front();
    c.check(c.host.data_ptr<int32_t>());
  }
}

void Comm::raise_pending() {
  run_deferred_checks();
  check();
}

at::Tensor Comm::all_reduce(const at::Tensor& x) {
  check();
  static const char* op = "all_reduce";
  const auto dev = device();
  check_device(op, "x", x, dev);
  auto st = x.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op,
                   ": x must be torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(st));
  check_contiguous(op, "x", x);
  at::Tensor out = empty(x.sizes(), st);
  if (cfg_.world == 1) return out.copy_(x);
  call_ = all_reduce_call(call_dtype_of(st), x.numel());
  all_reduce_into(st, static_cast<const char*>(x.data_ptr()), static_cast<char*>(out.data_ptr()), x.numel(),
                  transport_.device_kernels);
  return out;
}

void Comm::all_reduce_into(at::ScalarType st, const char* in, char* out, int64_t n, bool gpu) {
  const int64_t elt = int64_t(c10::elementSize(st));
  const bool one_shot = allreduce_use_one_shot(n * elt, cfg_.world, gpu);
  const int64_t chunk = allreduce_chunk_elems(layout_.ar_slot_bytes, elt, cfg_.world, one_shot);
  // At least one round, an empty one for n = 0: every call announces itself.
  int64_t off = 0;
  do {
    all_reduce_chunk(st, in + off * elt, out + off * elt, std::min(chunk, n - off), one_shot);
    off += chunk;
  } while (off < n);
}

std::pair<at::Tensor, at::Tensor> Comm::all_reduce_rmsnorm(const at::Tensor& x,
                                                           const c10::optional<at::Tensor>& residual,
                                                           const at::Tensor& weight, double eps) {
  check();
  static const char* op = "all_reduce_rmsnorm";
  const auto dev = device();
  check_device(op, "x", x, dev);
  const auto st = x.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op,
                   ": x must be torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(st));
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have shape [..., H] with H >= 1, got ",
                    shape_str(x));
  check_contiguous(op, "x", x);
  const int64_t H = x.size(-1);
  if (residual.has_value()) {
    check_device(op, "residual", *residual, dev);
    check_shape(op, "residual", *residual, x.sizes(), "x's shape");
    check_dtype(op, "residual", *residual, st);
    check_contiguous(op, "residual", *residual);
  }
  check_device(op, "weight", weight, dev);
  check_shape(op, "weight", weight, {H}, "[H], x's last dimension");
  TORCH_CHECK_TYPE(weight.scalar_type() == st || weight.scalar_type() == at::kFloat, op, ": weight must be ",
                   dtype_name(st), st == at::kFloat ? " (x's dtype)" : " (x's dtype) or torch.float32", ", got ",
                   dtype_name(weight.scalar_type()));
  check_contiguous(op, "weight", weight);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0 && std::isfinite(float(eps)), op,
                    ": eps must be a finite float > 0, got ", eps);

  at::Tensor out = empty(x.sizes(), x.scalar_type());
  at::Tensor res_out = empty(x.sizes(), x.scalar_type());
  const int64_t T = x.numel() / H, elt = x.element_size(), row_bytes = H * elt;
  if (cfg_.world == 1 && T == 0) return {out, res_out};
  TORCH_CHECK_VALUE(H <= kCallMaxHidden && T <= kCallMaxRows, op, ": x must have at most ", kCallMaxRows,
                    " rows of at most ", kCallMaxHidden, " elements, got ", shape_str(x));
  call_ = rmsnorm_call(call_dtype_of(st), residual.has_value(), H, T);
  const bool gpu = transport_.device_kernels;
  if (T == 0) {  // no rows: an empty all_reduce round, which still announces the call
    all_reduce_into(st, nullptr, nullptr, 0, gpu);
    return {out, res_out};
  }
  const int path = rmsnorm_path(T, H, elt, cfg_.world, gpu, layout_.ar_slot_bytes);
  RmsNormRows c{};
  c.dtype = st;
  c.x = static_cast<const char*>(x.data_ptr());
  c.residual = residual.has_value() ? static_cast<const char*>(residual->data_ptr()) : nullptr;
  c.weight = weight.data_ptr();
  c.weight_fp32 = weight.scalar_type() != st;
  c.out = static_cast<char*>(out.data_ptr());
  c.residual_out = static_cast<char*>(res_out.data_ptr());
  c.hidden = H;
  c.eps = float(eps);
  c.vectorized = row_bytes % 16 == 0 && aligned16(c.x) && aligned16(c.residual) && aligned16(c.weight) &&
                 aligned16(c.out) && aligned16(c.residual_out);
  rmsnorm_counts_[path] += 1;
  if (gpu && c.vectorized && rmsnorm_row_in_registers(H, elt)) rmsnorm_counts_[kRowInRegistersCount] += 1;
  if (path == kRmsNormAllReduceThenNorm) {
    // The sum lands in residual_out, where the norm reads it back.
    if (cfg_.world == 1)
      res_out.copy_(x);
    else
      all_reduce_into(st, c.x, c.residual_out, x.numel(), gpu);
    c.x = c.residual_out;
    c.rows = T;
    rmsnorm_local(c);
    return {out, res_out};
  }
  const bool one_stage = path == kRmsNormOneStage;
  const int64_t chunk = rmsnorm_chunk_rows(layout_.ar_slot_bytes, row_bytes, cfg_.world, one_stage);
  for (int64_t row = 0; row < T; row += chunk) {
    RmsNormRows part = c;
    const int64_t skip = row * row_bytes;
    part.x += skip;
    if (part.residual) part.residual += skip;
    part.out += skip;
    part.residual_out += skip;
    part.rows = std::min(chunk, T - row);
    all_reduce_rmsnorm_chunk(part, one_stage);
  }
  return {out, res_out};
}

at::Tensor Comm::empty(at::IntArrayRef sizes, at::ScalarType dtype) const {
  return at::empty(sizes, at::TensorOptions().device(device()).dtype(dtype));
}

Dispatched Comm::dispatch(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                          const c10::optional<at::Tensor>& topk_weights) {
  return dispatch_rows(x, x_scales, topk_idx, topk_weights, false, false);
}

Dispatched Comm::dispatch_rows(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                               const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights,
                               bool expert_layout, bool rows_stay) {
  check();
  static const char* op = "dispatch";
  check_ep(cfg_, op);
  const auto dev = device();
  check_device(op, "x", x, dev);
  // Leading dimensions are tokens: [..., H] holds T = numel / H of them.
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.size(-1) == cfg_.hidden, op, ": x must have shape [..., ", cfg_.hidden,
                    "] (tokens, hidden) with at most ", cfg_.cap, " tokens (max_tokens_per_rank), got ",
                    shape_str(x));
  const int64_t T = x.numel() / cfg_.hidden;
  TORCH_CHECK_VALUE(T <= cfg_.cap, op, ": x must have shape [..., ", cfg_.hidden, "] with at most ", cfg_.cap,
                    " tokens (max_tokens_per_rank), got ", shape_str(x), " = ", T, " tokens");
  // A tensor that has x's leading dimensions and `cols` columns, or is flat: [T, cols].
  auto check_per_token = [&](const char* arg, const at::Tensor& t, int64_t cols, const char* what) {
    check_device(op, arg, t, dev);
    const bool flat = t.dim() == 2 && t.size(0) == T && t.size(1) == cols;
    const bool like_x = t.dim() == x.dim() && t.size(-1) == cols &&
                        t.sizes().slice(0, t.dim() - 1) == x.sizes().slice(0, x.dim() - 1);
    if (!flat && !like_x) {
      std::vector<int64_t> want(x.sizes().begin(), x.sizes().end() - 1);
      want.push_back(cols);
      // A [T, H] x has one expected shape; x of more dims, two.
      std::ostringstream flat_too;
      if (x.dim() > 2) flat_too << " or [" << T << ", " << cols << "]";
      TORCH_CHECK_VALUE(false, op, ": ", arg, " must have shape ", at::IntArrayRef(want), " (x's tokens, ", what, ")",
                        flat_too.str(), ", got ", shape_str(t));
    }
    check_contiguous(op, arg, t);
  };
  if (x_scales.has_value()) {
    TORCH_CHECK_VALUE(cfg_.fp8(), op, ": a pre-quantised (q, scales) pair needs a communicator made with "
                      "dispatch_dtype=torch.float8_e4m3fn; this one dispatches ", dtype_name(cfg_.dtype));
    check_dtype(op, "x (the pair's q)", x, at::kFloat8_e4m3fn);
    check_dtype(op, "x_scales (the pair's scales)", *x_scales, at::kFloat);
    check_per_token("x_scales (the pair's scales)", *x_scales, cfg_.fp8_scales, "ceil(hidden / 128)");
  } else {
    TORCH_CHECK_TYPE(x.scalar_type() == cfg_.dtype, op, ": x must be ", dtype_name(cfg_.dtype),
                     cfg_.fp8() ? " (quantised to FP8 by the op) or a (q, scales) pair from rdna4_comm.quantize_fp8"
                                : "",
                     ", got ", dtype_name(x.scalar_type()));
  }
  check_contiguous(op, "x", x);
  const auto it = topk_idx.scalar_type();
  TORCH_CHECK_TYPE(it == at::kInt || it == at::kLong, op, ": topk_idx must be torch.int32 or torch.int64, got ",
                   dtype_name(it));
  check_per_token("topk_idx", topk_idx, cfg_.topk, "topk");
  c10::optional<at::ScalarType> wt;
  if (topk_weights.has_value()) {
    wt = topk_weights->scalar_type();
    TORCH_CHECK_TYPE(*wt == at::kFloat || *wt == at::kBFloat16 || *wt == at::kHalf, op,
                     ": topk_weights must be torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(*wt));
    check_per_token("topk_weights", *topk_weights, cfg_.topk, "topk");
  }
  Dispatched out = allocate_dispatched(T, it, wt);
  call_ = dispatch_call(expert_layout, x_scales.has_value());
  // The transports take [T, H] and [T, K]; a view is an op call of its own
  // (a quarter of the host time of an eager dispatch), so flat inputs pass as they are.
  auto flat = [T](const at::Tensor& t, int64_t cols) { return t.dim() == 2 ? t : t.view({T, cols}); };
  c10::optional<at::Tensor> weights, scales;
  if (topk_weights.has_value()) weights = flat(*topk_weights, cfg_.topk);
  if (x_scales.has_value()) scales = flat(*x_scales, cfg_.fp8_scales);
  const at::Tensor rows = flat(x, cfg_.hidden);
  if (rows_stay) {
    out.peer_rows_in_heap = true;
    // Rows the op quantises exist only in its output; and rows that start
    // off the 16-byte vectors of a fresh output would slow every row's copy.
    const int64_t row_bytes = cfg_.hidden * int64_t(rows.element_size());
    const bool vectors_kept = row_bytes % 16 != 0 || aligned16(rows.data_ptr());
    if ((!cfg_.fp8() || scales) && vectors_kept) {
      out.own_rows = rows;
      if (scales) out.own_scales = *scales;
    }
  }
  dispatch_impl(rows, scales, flat(topk_idx, cfg_.topk), weights, out);
  return out;
}

void Comm::check_handle_fields(const char* op, const at::Tensor& recv_src, const at::Tensor& counts,
                               const at::Tensor& src_tokens, const at::Tensor& send_mask,
                               const at::Tensor& dispatch_round) const {
  const auto dev = device();
  const int64_t rows = int64_t(cfg_.world) * cfg_.cap;
  const std::pair<const char*, const at::Tensor*> handle[] = {
      {"handle.recv_src", &recv_src}, {"handle.counts", &counts},
      {"handle.src_tokens", &src_tokens}, {"handle.send_mask", &send_mask}};
  for (const auto& [name, t] : handle) {
    check_device(op, name, *t, dev);
    check_dtype(op, name, *t, at::kInt);
    check_contiguous(op, name, *t);
  }
  check_shape(op, "handle.recv_src", recv_src, {rows}, "[world_size * max_tokens_per_rank]");
  check_shape(op, "handle.counts", counts, {cfg_.world}, "[world_size]");
  check_shape(op, "handle.src_tokens", src_tokens, {cfg_.world}, "[world_size]");
  TORCH_CHECK_VALUE(send_mask.dim() == 1 && send_mask.size(0) <= cfg_.cap, op,
                    ": handle.send_mask must have shape [T] with T <= ", cfg_.cap, ", got ",
                    shape_str(send_mask));
  check_device(op, "handle.dispatch_round", dispatch_round, dev);
  check_dtype(op, "handle.dispatch_round", dispatch_round, at::kLong);
  check_shape(op, "handle.dispatch_round", dispatch_round, {1}, "one round number");
}

at::Tensor Comm::combine(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                         const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round) {
  check();
  static const char* op = "combine";
  check_ep(cfg_, op);
  const auto dev = device();
  const int64_t rows = int64_t(cfg_.world) * cfg_.cap;
  check_device(op, "y", y, dev);
  check_shape(op, "y", y, {rows, cfg_.hidden}, "[world_size * max_tokens_per_rank, hidden]");
  check_dtype(op, "y", y, cfg_.dtype);
  check_contiguous(op, "y", y);
  check_handle_fields(op, recv_src, counts, src_tokens, send_mask, dispatch_round);
  call_ = combine_call(false, 0);
  return combine_checked(y, recv_src, counts, src_tokens, send_mask, dispatch_round);
}

at::Tensor Comm::combine_checked(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                                 const at::Tensor& src_tokens, const at::Tensor& send_mask,
                                 const at::Tensor& dispatch_round) {
  at::Tensor out = empty_output(combine_output(), send_mask.size(0));
  combine_impl(y, recv_src, counts, src_tokens, send_mask, dispatch_round, out);
  return out;
}

namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<std::string, std::shared_ptr<Comm>>& registry() {
  static std::unordered_map<std::string, std::shared_ptr<Comm>> r;
  return r;
}
}  // namespace

void register_comm(std::shared_ptr<Comm> comm) {
  std::lock_guard<std::mutex> g(registry_mutex());
  const std::string id = comm->config().id;
  TORCH_CHECK(registry().emplace(id, std::move(comm)).second, "rdna4_comm: communicator id '", id,
              "' is already registered");
}

int64_t allreduce_slot_bytes(const std::string& transport, int64_t requested) {
  const int64_t slot = requested > 0 ? requested : find_transport(transport).default_slot_bytes;
  return int64_t(align_up(size_t(slot), kAlign));
}

std::shared_ptr<Comm> lookup_comm(const std::string& id) {
  std::lock_guard<std::mutex> g(registry_mutex());
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

std::shared_ptr<Comm> find_comm(const std::string& id) {
  auto c = lookup_comm(id);
  TORCH_CHECK_VALUE(c, "rdna4_comm: no open communicator with id '", id,
                    "' in this process (it was closed, or never created here)");
  return c;
}

void remove_comm(const std::string& id) {
  std::shared_ptr<Comm> doomed;  // destroyed outside the lock
  std::lock_guard<std::mutex> g(registry_mutex());
  auto it = registry().find(id);
  if (it != registry().end()) {
    doomed = std::move(it->second);
    registry().erase(it);
  }
}

}  // namespace rdna4_comm
