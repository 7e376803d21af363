// torch.ops.rdna4_comm.*: the op table (op_table.h) and the TORCH_LIBRARY
// registrations made from it. One kernel per op serves the CPU and CUDA
// dispatch keys: the communicator named by `comm` decides the transport.
#include <torch/library.h>

#include <sstream>

#include "op_table.h"

namespace rdna4_comm {
namespace {

using Dtypes = std::vector<c10::optional<at::ScalarType>>;

// The names, values or specs of a Result<T>'s outputs (for_each_output).
template <template <typename> class Result>
std::vector<std::string> output_names(bool fp8) {
  std::vector<std::string> names;
  for_each_output<Result>(fp8, [&](const char* name, auto, auto) { names.emplace_back(name); });
  return names;
}
template <template <typename> class Result>
std::vector<at::Tensor> output_values(const Result<at::Tensor>& r, bool fp8) {
  std::vector<at::Tensor> values;
  for_each_output<Result>(fp8, [&](const char*, auto tensor, auto) { values.push_back(r.*tensor); });
  return values;
}
template <template <typename> class Result>
std::vector<OutputRule> output_rules(const Result<OutputSpec>& specs, bool fp8) {
  std::vector<OutputRule> rules;
  for_each_output<Result>(fp8, [&](const char*, auto, auto spec) { rules.push_back({-1, specs.*spec}); });
  return rules;
}

// A dispatch op of the FP8 kind `fp8` (it takes x_scales and returns them
// last) on communicator c, which must be of that kind.
void check_fp8_kind(const Comm& c, bool fp8) {
  TORCH_CHECK_VALUE(c.config().fp8() == fp8, "dispatch: communicator '", c.config().id,
                    fp8 ? "' does not dispatch in FP8 (made without dispatch_dtype): call rdna4_comm::dispatch"
                        : "' dispatches in FP8: call rdna4_comm::dispatch_fp8, which returns x_scales too");
}

// The four dispatch ops: the rank or the expert layout, rows in the
// communicator's dtype or in FP8. Arguments: x, [x_scales,] topk_idx,
// topk_weights.
OpDecl dispatch_decl(const char* name, bool expert, bool fp8) {
  std::vector<ArgDecl> args = {{"x", ArgKind::kTensor}};
  if (fp8) args.push_back({"x_scales", ArgKind::kOptionalTensor});
  args.push_back({"topk_idx", ArgKind::kTensor});
  args.push_back({"topk_weights", ArgKind::kOptionalTensor});
  const size_t idx = fp8 ? 2 : 1, weights = idx + 1;
  auto rules = [expert, fp8, idx, weights](const Comm& c, const Dtypes& dtypes) {
    if (expert) return output_rules<ExpertLayoutOf>(c.dispatch_expert_outputs(dtypes[weights]), fp8);
    return output_rules<RankLayoutOf>(c.dispatch_outputs(dtypes[idx].value_or(at::kLong), dtypes[weights]), fp8);
  };
  auto run = [expert, fp8, idx, weights](Comm& c, const OpCall& a) {
    check_fp8_kind(c, fp8);
    const c10::optional<at::Tensor> scales = fp8 ? a.optional(1) : c10::nullopt;
    if (expert)
      return output_values<ExpertLayoutOf>(
          c.dispatch_expert(a.tensor(0), scales, a.tensor(idx), a.optional(weights)), fp8);
    return output_values<RankLayoutOf>(c.dispatch(a.tensor(0), scales, a.tensor(idx), a.optional(weights)), fp8);
  };
  return {name,
          "dispatch",
          std::move(args),
          expert ? output_names<ExpertLayoutOf>(fp8) : output_names<RankLayoutOf>(fp8),
          0,
          true,
          rules,
          run};
}

std::vector<OpDecl> make_op_table() {
  const ArgKind T = ArgKind::kTensor, O = ArgKind::kOptionalTensor, F = ArgKind::kFloat;
  std::vector<OpDecl> ops;
  ops.push_back({"all_reduce", "all_reduce", {{"x", T}}, {"out"}, 0, true,
                 [](const Comm&, const Dtypes&) { return std::vector<OutputRule>{{0}}; },
                 [](Comm& c, const OpCall& a) { return std::vector<at::Tensor>{c.all_reduce(a.tensor(0))}; }});
  ops.push_back({"all_reduce_rmsnorm", "all_reduce_rmsnorm", {{"x", T}, {"residual", O}, {"weight", T}, {"eps", F}},
                 {"out", "residual_out"}, 0, true,
                 [](const Comm&, const Dtypes&) { return std::vector<OutputRule>{{0}, {0}}; },
                 [](Comm& c, const OpCall& a) {
                   auto [out, residual_out] = c.all_reduce_rmsnorm(a.tensor(0), a.optional(1), a.tensor(2), a.real);
                   return std::vector<at::Tensor>{out, residual_out};
                 }});
  ops.push_back(dispatch_decl("dispatch", false, false));
  ops.push_back(dispatch_decl("dispatch_fp8", false, true));
  ops.push_back(dispatch_decl("dispatch_expert", true, false));
  ops.push_back(dispatch_decl("dispatch_expert_fp8", true, true));
  // combine's arguments are the y to send back and the dispatch's handle
  // (the outputs of that name); combine_expert's handle adds expert_rows_of.
  const std::vector<ArgDecl> handle = {
      {"recv_src", T}, {"counts", T}, {"src_tokens", T}, {"send_mask", T}, {"dispatch_round", T}};
  auto combine_rules = [](const Comm& c, const Dtypes&) { return std::vector<OutputRule>{{-1, c.combine_output()}}; };
  std::vector<ArgDecl> args = {{"y", T}};
  args.insert(args.end(), handle.begin(), handle.end());
  ops.push_back({"combine", "combine", args, {"out"}, 4, false, combine_rules, [](Comm& c, const OpCall& a) {
                   return std::vector<at::Tensor>{
                       c.combine(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.tensor(5))};
                 }});
  args.insert(args.begin() + 1, {"expert_rows_of", T});
  ops.push_back({"combine_expert", "combine", args, {"out"}, 5, false, combine_rules, [](Comm& c, const OpCall& a) {
                   return std::vector<at::Tensor>{c.combine_expert(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3),
                                                                   a.tensor(4), a.tensor(5), a.tensor(6))};
                 }});
  for (const OpDecl& op : ops) TORCH_INTERNAL_ASSERT(op.args.size() <= kMostOpArgs, op.name);
  return ops;
}

}  // namespace

const std::vector<OpDecl>& op_table() {
  static const std::vector<OpDecl> table = make_op_table();
  return table;
}

const OpDecl& find_op(const std::string& name) {
  for (const OpDecl& op : op_table())
    if (name == op.name) return op;
  TORCH_CHECK_VALUE(false, "rdna4_comm: no op named '", name, "'");
}

// Every op declares that it writes `order`, the process's ordering token of
// the op's device (and none reads it), so compilers never drop a collective
// whose result is unused and never reorder two of them: the token's writes
// are a chain in program order.
std::string OpDecl::schema() const {
  std::ostringstream s;
  s << name << "(";
  for (const ArgDecl& a : args)
    s << (a.kind == ArgKind::kTensor ? "Tensor " : a.kind == ArgKind::kOptionalTensor ? "Tensor? " : "float ")
      << a.name << ", ";
  s << "Tensor(a!) order, str comm) -> ";
  if (outputs.size() == 1) return s.str() + "Tensor";
  s << "(";
  for (size_t i = 0; i < outputs.size(); ++i) s << (i ? ", " : "") << "Tensor " << outputs[i];
  s << ")";
  return s.str();
}

// A failed deferred check reports at the end of a later op, after that op's
// collective ran on every rank, so the ranks stay in step; and only earlier
// ops' checks, so an op's own check reports at the rank's next call, on
// every device alike.
std::vector<at::Tensor> OpDecl::call(const OpCall& a) const {
  const std::shared_ptr<Comm> c = find_comm(std::string(a.comm));
  const at::Tensor& order = *a.order;
  TORCH_CHECK_VALUE(order.device() == c->device() && order.dim() == 1 && order.numel() == 1, method,
                    ": order must be the ordering token of the communicator's device (", c->device(),
                    "; rdna4_comm.ops.order_token), got a tensor of shape ", order.sizes(), " on ", order.device());
  const size_t earlier = c->pending_checks();
  std::vector<at::Tensor> out = run(*c, a);
  c->run_deferred_checks(earlier);
  return out;
}

namespace {

// An op's kernel for the dispatcher: its arguments from the stack, its
// outputs onto it.
class OpKernel final : public c10::OperatorKernel {
 public:
  explicit OpKernel(const OpDecl& op) : op_(op) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = op_.args.size() + 2;
    auto args = torch::jit::last(*stack, n);
    OpCall call;
    for (size_t i = 0; i < op_.args.size(); ++i) {
      if (op_.args[i].kind == ArgKind::kFloat)
        call.real = args[i].toDouble();
      else if (!args[i].isNone())
        call.tensors[i] = &args[i].toTensor();
    }
    at::Tensor order = args[n - 2].toTensor();
    call.order = &order;
    call.comm = args[n - 1].toStringRef();
    std::vector<at::Tensor> out = op_.call(call);
    torch::jit::drop(*stack, n);
    for (at::Tensor& t : out) torch::jit::push(*stack, std::move(t));
  }

 private:
  const OpDecl& op_;
};

void impl_ops(torch::Library& m) {
  for (const OpDecl& op : op_table())
    m.impl(op.name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<OpKernel>(op)));
}

}  // namespace

TORCH_LIBRARY(rdna4_comm, m) {
  for (const OpDecl& op : op_table()) m.def(op.schema().c_str());
}

TORCH_LIBRARY_IMPL(rdna4_comm, CPU, m) { impl_ops(m); }

#ifdef RDNA4_COMM_WITH_GPU
// ROCm builds of torch register HIP tensors under the CUDA key as well.
TORCH_LIBRARY_IMPL(rdna4_comm, CUDA, m) { impl_ops(m); }
#endif

}  // namespace rdna4_comm
