// torch.ops.rdna4_comm.*: schemas, one implementation per op shared by the CPU
// and CUDA dispatch keys (the communicator named by `comm` decides the
// transport), and the pybind functions Communicator uses to bootstrap.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "bounds.h"
#include "comm.h"
#include "cpu/cpu_arith.h"
#include "policies.h"
#include "routing.h"

namespace rdna4_comm {
namespace {

// `order` is the process's ordering token for the op's device. Every
// collective declares that it writes it (and none reads it), so compilers
// never drop a collective whose result is unused and never reorder two of
// them: the token's writes are a chain in program order.
void check_order_token(const char* op, const at::Tensor& order, const at::Device& dev) {
  TORCH_CHECK_VALUE(order.device() == dev && order.dim() == 1 && order.numel() == 1, op,
                    ": order must be the ordering token of the communicator's device (", dev,
                    "; rdna4_comm.ops.order_token), got a tensor of shape ", order.sizes(), " on ",
                    order.device());
}

// Runs an op, then the deferred checks (Comm::defer_check) that earlier ops
// left: at the end, after the op's collective ran on every rank, so a
// failed check leaves the ranks in step; and only earlier ops', so an op's
// own check reports at the rank's next call, on every device alike.
template <typename Op>
auto after_earlier_checks(const std::shared_ptr<Comm>& c, Op op) {
  const size_t earlier = c->pending_checks();
  auto out = op();
  c->run_deferred_checks(earlier);
  return out;
}

at::Tensor all_reduce_op(const at::Tensor& x, at::Tensor& order, c10::string_view comm) {
  auto c = find_comm(std::string(comm));
  check_order_token("all_reduce", order, c->device());
  return after_earlier_checks(c, [&] { return c->all_reduce(x); });
}

// The dispatch ops of a communicator: dispatch and dispatch_expert carry
// rows in its dtype; dispatch_fp8 and dispatch_expert_fp8 take an FP8
// communicator's optional pre-quantised scales and return x_scales last.
template <typename Op>
auto run_dispatch(c10::string_view comm, const at::Tensor& order, bool fp8, Op op) {
  auto c = find_comm(std::string(comm));
  check_order_token("dispatch", order, c->device());
  TORCH_CHECK_VALUE(c->config().fp8() == fp8, "dispatch: communicator '", c->config().id,
                    fp8 ? "' does not dispatch in FP8 (made without dispatch_dtype): call rdna4_comm::dispatch"
                        : "' dispatches in FP8: call rdna4_comm::dispatch_fp8, which returns x_scales too");
  return after_earlier_checks(c, [&] { return op(*c); });
}

using RankTuple =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using ExpertTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor, at::Tensor>;
RankTuple fields(const Dispatched& d) {
  return {d.x, d.topk_idx, d.topk_weights, d.counts, d.recv_src, d.src_tokens, d.send_mask, d.dispatch_round};
}
ExpertTuple fields(const ExpertDispatched& d) {
  return {d.x,         d.expert_counts, d.expert_offsets, d.topk_weights,   d.recv_src,
          d.counts,    d.src_tokens,    d.send_mask,      d.expert_rows_of, d.dispatch_round};
}

RankTuple dispatch_op(const at::Tensor& x, const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights,
                      at::Tensor& order, c10::string_view comm) {
  return fields(run_dispatch(comm, order, false, [&](Comm& c) { return c.dispatch(x, {}, topk_idx, topk_weights); }));
}

ExpertTuple dispatch_expert_op(const at::Tensor& x, const at::Tensor& topk_idx,
                               const c10::optional<at::Tensor>& topk_weights, at::Tensor& order,
                               c10::string_view comm) {
  return fields(
      run_dispatch(comm, order, false, [&](Comm& c) { return c.dispatch_expert(x, {}, topk_idx, topk_weights); }));
}

template <typename Result>
auto with_scales(const Result& d) {
  return std::tuple_cat(fields(d), std::make_tuple(d.x_scales));
}

decltype(with_scales(Dispatched{})) dispatch_fp8_op(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                                                    const at::Tensor& topk_idx,
                                                    const c10::optional<at::Tensor>& topk_weights, at::Tensor& order,
                                                    c10::string_view comm) {
  return with_scales(
      run_dispatch(comm, order, true, [&](Comm& c) { return c.dispatch(x, x_scales, topk_idx, topk_weights); }));
}

decltype(with_scales(ExpertDispatched{})) dispatch_expert_fp8_op(const at::Tensor& x,
                                                                 const c10::optional<at::Tensor>& x_scales,
                                                                 const at::Tensor& topk_idx,
                                                                 const c10::optional<at::Tensor>& topk_weights,
                                                                 at::Tensor& order, c10::string_view comm) {
  return with_scales(run_dispatch(
      comm, order, true, [&](Comm& c) { return c.dispatch_expert(x, x_scales, topk_idx, topk_weights); }));
}

at::Tensor combine_expert_op(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& recv_src,
                             const at::Tensor& counts, const at::Tensor& src_tokens, const at::Tensor& send_mask,
                             const at::Tensor& dispatch_round, at::Tensor& order, c10::string_view comm) {
  auto c = find_comm(std::string(comm));
  check_order_token("combine", order, c->device());
  return after_earlier_checks(c, [&] {
    return c->combine_expert(y, expert_rows_of, recv_src, counts, src_tokens, send_mask, dispatch_round);
  });
}

at::Tensor combine_op(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                      const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round,
                      at::Tensor& order, c10::string_view comm) {
  auto c = find_comm(std::string(comm));
  check_order_token("combine", order, c->device());
  return after_earlier_checks(c,
                              [&] { return c->combine(y, recv_src, counts, src_tokens, send_mask, dispatch_round); });
}

std::tuple<at::Tensor, at::Tensor> all_reduce_rmsnorm_op(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                        const at::Tensor& weight, double eps, at::Tensor& order,
                                                        c10::string_view comm) {
  auto c = find_comm(std::string(comm));
  check_order_token("all_reduce_rmsnorm", order, c->device());
  auto [out, residual_out] = after_earlier_checks(c, [&] { return c->all_reduce_rmsnorm(x, residual, weight, eps); });
  return {out, residual_out};
}

// Calls of all_reduce_rmsnorm by path, and how many kept rows in registers.
py::dict rmsnorm_path_counts(const std::string& id) {
  const auto& counts = find_comm(id)->rmsnorm_path_counts();
  py::dict d;
  for (int p = 0; p < kNumRmsNormPaths; ++p) d[rmsnorm_path_name(p)] = counts[p];
  d["row_in_registers"] = counts[Comm::kRowInRegistersCount];
  return d;
}

py::bytes create(const CommConfig& c) {
  std::shared_ptr<Comm> comm;
  if (c.transport == "cpu") {
    comm = make_cpu_comm(c);
  } else if (c.transport == "dist") {
    comm = make_dist_comm(c);
  } else {
#ifdef RDNA4_COMM_WITH_GPU
    comm = make_gpu_comm(c);
#else
    TORCH_CHECK(false, "rdna4_comm was built without GPU support (torch had no CUDA/ROCm when it "
                       "was built); use transport=\"cpu\" or rebuild against a GPU build of torch");
#endif
  }
  py::bytes handle(comm->export_handle());  // binary on the GPU (IPC handles)
  register_comm(std::move(comm));
  return handle;
}

void connect(const std::string& id, const std::vector<std::string>& handles) {
  find_comm(id)->connect(handles);
}

std::string finish(const std::string& id) { return find_comm(id)->finish(); }

void check(const std::string& id) { find_comm(id)->raise_pending(); }

void watch_peers(const std::string& id, const std::vector<std::tuple<int, int, uint64_t>>& peers) {
  std::vector<PeerProcess> v;
  for (const auto& [rank, pid, start] : peers) v.push_back(PeerProcess{rank, pid, start});
  find_comm(id)->watch_peers(v);
}

}  // namespace

// ------------------------------------------------------------ eager calls
// What the Communicator methods call outside torch.compile
// (rdna4_comm._C.eager.<op>). Entering an op from Python through the
// dispatcher (OpOverload.op) boxes every argument into IValues, which the
// dispatcher unboxes for the kernel again: about 9 k instructions a call,
// more than the rest of an eager combine's host work apart from the
// kernel's own (callgrind, CPU transport). These take plain arguments
// straight to the same functions, inside a RecordFunction of the op's name
// so profilers still see the op. Whatever the dispatcher or Python must
// see goes through the op itself (OpOverload.op): a tensor other than a
// plain dense one (a subclass, a wrapper, a sparse or conjugate view, one
// that requires grad while grad mode is on), an argument of another type
// than the schema's, a torch function or dispatch mode, or dispatch keys
// included in this thread.
namespace eager {

// An op's argument kinds, from its registered schema: 'T' Tensor, 'O'
// Tensor?, 'f' float, 's' str.
struct Schema {
  std::string qualified, kinds;
};
Schema schema_of(const char* name) {
  const std::string qualified = std::string("rdna4_comm::") + name;
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "");
  std::string kinds;
  for (const c10::Argument& a : op.schema().arguments()) {
    const c10::TypePtr& t = a.type();
    const bool optional = t->kind() == c10::TypeKind::OptionalType;
    const c10::TypeKind k = optional ? t->containedType(0)->kind() : t->kind();
    const char kind = k == c10::TypeKind::TensorType ? (optional ? 'O' : 'T')
                      : k == c10::TypeKind::FloatType && !optional   ? 'f'
                      : k == c10::TypeKind::StringType && !optional  ? 's'
                                                                     : '?';
    TORCH_CHECK(kind != '?', qualified, ": no eager entry point for argument ", a.name(), " of type ", t->str());
    kinds += kind;
  }
  return {qualified, kinds};
}

// torch.nn.Parameter, set when the module is made (def_all); never released.
PyObject* parameter_type = nullptr;

bool plain_tensor(PyObject* obj) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != THPVariableClass && type != parameter_type) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.requires_grad() && c10::GradMode::is_enabled()) return false;
  // A dense tensor's keys: its backend's, with autocast and (but for
  // inference tensors) autograd ones.
  const c10::DispatchKeySet keys = t.key_set();
  const c10::BackendComponent b = keys.highestBackendKey();
  const c10::DispatchKeySet dense = c10::DispatchKeySet(c10::DispatchKey::Dense) | c10::DispatchKeySet(b) |
                                    c10::getAutocastRelatedKeySetFromBackend(b);
  return keys == dense || keys == (dense | c10::getAutogradRelatedKeySetFromBackend(b));
}

// The predicate: whether a call of the op may skip the dispatcher.
bool plain_call(const Schema& schema, const py::args& args, const py::kwargs& kwargs) {
  if (kwargs.size() != 0 || args.size() != schema.kinds.size()) return false;
  if (at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() != 0) return false;
  if (!(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty()) return false;
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* a = PyTuple_GET_ITEM(args.ptr(), Py_ssize_t(i));
    const char kind = schema.kinds[i];
    const bool ok = kind == 's'   ? PyUnicode_Check(a)
                    : kind == 'f' ? PyFloat_Check(a)
                    : kind == 'O' && a == Py_None ? true
                                                 : plain_tensor(a);
    if (!ok) return false;
  }
  return true;
}

// The arguments of a call that plain_call accepted, as the op takes them,
// read without the GIL: made (with the GIL) from borrowed pointers to the
// call's argument tuple, which outlives the call, so reading them touches
// no reference count; a tensor's or float's value is a field of its object,
// and the str's text is taken here.
struct Args {
  static constexpr size_t kMost = 9;
  PyObject* item[kMost];
  c10::string_view comm;  // the call's str argument, the communicator's id
  Args(const py::args& args, const Schema& schema) {
    TORCH_INTERNAL_ASSERT(args.size() <= kMost);
    for (size_t i = 0; i < args.size(); ++i) item[i] = PyTuple_GET_ITEM(args.ptr(), Py_ssize_t(i));
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(item[schema.kinds.find('s')], &n);
    if (p == nullptr) throw py::error_already_set();
    comm = c10::string_view(p, size_t(n));
  }
  const at::Tensor& tensor(size_t i) const { return THPVariable_Unpack(item[i]); }
  // The order token: the ops' schemas mark it written; nothing writes it.
  at::Tensor& order(size_t i) const { return const_cast<at::Tensor&>(tensor(i)); }
  c10::optional<at::Tensor> optional(size_t i) const {
    return item[i] == Py_None ? c10::nullopt : c10::optional<at::Tensor>(tensor(i));
  }
  double real(size_t i) const { return PyFloat_AS_DOUBLE(item[i]); }
};

// rdna4_comm._C.eager.<name>: run(Args) for a plain call, else the op's
// own callable (torch.ops.rdna4_comm.<name>.default.op, looked up once,
// when the module is made; never released, like the op).
template <typename Run>
void def(py::module_& m, const char* name, Run run) {
  const Schema schema = schema_of(name);
  const py::object ops = py::module_::import("torch").attr("ops").attr("rdna4_comm");
  PyObject* op = py::object(ops.attr(name).attr("default").attr("op")).release().ptr();
  m.def(name, [schema, op, run](const py::args& args, const py::kwargs& kwargs) -> py::object {
    if (!plain_call(schema, args, kwargs)) return py::reinterpret_borrow<py::object>(op)(*args, **kwargs);
    const Args plain(args, schema);
    // Without the GIL, as the dispatcher's Python entry runs an op: a CPU
    // transport op waits for its peers.
    auto out = [&] {
      py::gil_scoped_release no_gil;
      RECORD_FUNCTION(schema.qualified.c_str(), std::vector<c10::IValue>());
      return run(plain);
    }();
    return py::cast(std::move(out));
  });
}

void def_all(py::module_& m) {
  parameter_type = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  def(m, "all_reduce", [](const Args& a) { return all_reduce_op(a.tensor(0), a.order(1), a.comm); });
  def(m, "dispatch", [](const Args& a) {
    return dispatch_op(a.tensor(0), a.tensor(1), a.optional(2), a.order(3), a.comm);
  });
  def(m, "dispatch_fp8", [](const Args& a) {
    return dispatch_fp8_op(a.tensor(0), a.optional(1), a.tensor(2), a.optional(3), a.order(4), a.comm);
  });
  def(m, "combine", [](const Args& a) {
    return combine_op(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.tensor(5), a.order(6),
                      a.comm);
  });
  def(m, "dispatch_expert", [](const Args& a) {
    return dispatch_expert_op(a.tensor(0), a.tensor(1), a.optional(2), a.order(3), a.comm);
  });
  def(m, "dispatch_expert_fp8", [](const Args& a) {
    return dispatch_expert_fp8_op(a.tensor(0), a.optional(1), a.tensor(2), a.optional(3), a.order(4), a.comm);
  });
  def(m, "combine_expert", [](const Args& a) {
    return combine_expert_op(a.tensor(0), a.tensor(1), a.tensor(2), a.tensor(3), a.tensor(4), a.tensor(5),
                             a.tensor(6), a.order(7), a.comm);
  });
  def(m, "all_reduce_rmsnorm", [](const Args& a) {
    return all_reduce_rmsnorm_op(a.tensor(0), a.optional(1), a.tensor(2), a.real(3), a.order(4), a.comm);
  });
  // The predicate, for the tests: would this call of op `name` skip the dispatcher?
  m.def("is_plain_call", [](const std::string& name, const py::args& args, const py::kwargs& kwargs) {
    return plain_call(schema_of(name.c_str()), args, kwargs);
  }, py::arg("name"));
}

}  // namespace eager

TORCH_LIBRARY(rdna4_comm, m) {
  m.def("all_reduce(Tensor x, Tensor(a!) order, str comm) -> Tensor");
  m.def(
      "dispatch(Tensor x, Tensor topk_idx, Tensor? topk_weights, Tensor(a!) order, str comm) -> "
      "(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor counts, Tensor recv_src, "
      "Tensor src_tokens, Tensor send_mask, Tensor dispatch_round)");
  m.def(
      "dispatch_fp8(Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor? topk_weights, Tensor(a!) order, "
      "str comm) -> (Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor counts, Tensor recv_src, "
      "Tensor src_tokens, Tensor send_mask, Tensor dispatch_round, Tensor x_scales)");
  m.def(
      "combine(Tensor y, Tensor recv_src, Tensor counts, Tensor src_tokens, Tensor send_mask, "
      "Tensor dispatch_round, Tensor(a!) order, str comm) -> Tensor");
  m.def(
      "dispatch_expert(Tensor x, Tensor topk_idx, Tensor? topk_weights, Tensor(a!) order, str comm) -> "
      "(Tensor x, Tensor expert_counts, Tensor expert_offsets, Tensor topk_weights, Tensor recv_src, "
      "Tensor counts, Tensor src_tokens, Tensor send_mask, Tensor expert_rows_of, Tensor dispatch_round)");
  m.def(
      "dispatch_expert_fp8(Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor? topk_weights, Tensor(a!) order, "
      "str comm) -> (Tensor x, Tensor expert_counts, Tensor expert_offsets, Tensor topk_weights, "
      "Tensor recv_src, Tensor counts, Tensor src_tokens, Tensor send_mask, Tensor expert_rows_of, "
      "Tensor dispatch_round, Tensor x_scales)");
  m.def(
      "combine_expert(Tensor y, Tensor expert_rows_of, Tensor recv_src, Tensor counts, Tensor src_tokens, "
      "Tensor send_mask, Tensor dispatch_round, Tensor(a!) order, str comm) -> Tensor");
  m.def(
      "all_reduce_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor(a!) order, str comm) -> "
      "(Tensor out, Tensor residual_out)");
}

namespace {
// One implementation per op for every dispatch key: the communicator named
// by `comm` decides the transport.
void impl_ops(torch::Library& m) {
  m.impl("all_reduce", &all_reduce_op);
  m.impl("dispatch", &dispatch_op);
  m.impl("dispatch_fp8", &dispatch_fp8_op);
  m.impl("combine", &combine_op);
  m.impl("dispatch_expert", &dispatch_expert_op);
  m.impl("dispatch_expert_fp8", &dispatch_expert_fp8_op);
  m.impl("combine_expert", &combine_expert_op);
  m.impl("all_reduce_rmsnorm", &all_reduce_rmsnorm_op);
}
}  // namespace

TORCH_LIBRARY_IMPL(rdna4_comm, CPU, m) { impl_ops(m); }

#ifdef RDNA4_COMM_WITH_GPU
// ROCm builds of torch register HIP tensors under the CUDA key as well.
TORCH_LIBRARY_IMPL(rdna4_comm, CUDA, m) { impl_ops(m); }
#endif

}  // namespace rdna4_comm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace rdna4_comm;
  m.doc() = "rdna4_comm C++ core: communicator bootstrap, limits and the all_reduce predicate";
  // Built once, with keywords, by Communicator (which validates the values);
  // read-only after that: the C++ communicator owns it.
  py::class_<CommConfig>(m, "CommConfig", "What a communicator is made of")
      .def(py::init([](std::string id, std::string transport, std::string group_name, int rank, int world,
                       int64_t cap, int64_t hidden, int64_t topk, int64_t num_experts, at::ScalarType dtype,
                       int64_t ar_slot_bytes, int64_t timeout_ms, int device_index, int64_t expert_alignment,
                       int64_t max_expert_rows, c10::optional<at::ScalarType> dispatch_dtype,
                       bool dist_check_calls) {
             TORCH_CHECK_VALUE(!dispatch_dtype || *dispatch_dtype == at::kFloat8_e4m3fn,
                               "Communicator: dispatch_dtype must be None or torch.float8_e4m3fn, got ",
                               dtype_name(*dispatch_dtype));
             CommConfig c;
             c.id = std::move(id);
             c.transport = std::move(transport);
             c.group_name = std::move(group_name);
             c.rank = rank;
             c.world = world;
             c.cap = cap;
             c.hidden = hidden;
             c.topk = topk;
             c.num_experts = num_experts;
             c.dtype = dtype;
             c.ar_slot_bytes = ar_slot_bytes;
             c.timeout_ms = timeout_ms;
             c.device_index = device_index;
             c.expert_alignment = expert_alignment;
             c.max_expert_rows = max_expert_rows;
             c.dispatch_dtype = dispatch_dtype.value_or(at::ScalarType::Undefined);
             c.dist_check_calls = dist_check_calls;
             return c;
           }),
           py::kw_only(), py::arg("id"), py::arg("transport"), py::arg("group_name"), py::arg("rank"),
           py::arg("world"), py::arg("cap"), py::arg("hidden"), py::arg("topk"), py::arg("num_experts"),
           py::arg("dtype"), py::arg("ar_slot_bytes"), py::arg("timeout_ms"), py::arg("device_index"),
           py::arg("expert_alignment") = 1, py::arg("max_expert_rows") = 0, py::arg("dispatch_dtype") = py::none(),
           py::arg("dist_check_calls") = false)
      .def_readonly("id", &CommConfig::id)
      .def_readonly("transport", &CommConfig::transport)
      .def_readonly("group_name", &CommConfig::group_name)
      .def_readonly("rank", &CommConfig::rank)
      .def_readonly("world", &CommConfig::world)
      .def_readonly("cap", &CommConfig::cap)
      .def_readonly("hidden", &CommConfig::hidden)
      .def_readonly("topk", &CommConfig::topk)
      .def_readonly("num_experts", &CommConfig::num_experts)
      .def_readonly("dtype", &CommConfig::dtype)
      .def_readonly("ar_slot_bytes", &CommConfig::ar_slot_bytes)
      .def_readonly("timeout_ms", &CommConfig::timeout_ms)
      .def_readonly("device_index", &CommConfig::device_index)
      .def_readonly("expert_alignment", &CommConfig::expert_alignment)
      .def_readonly("dist_check_calls", &CommConfig::dist_check_calls)
      .def_property_readonly("dispatch_dtype", [](const CommConfig& c) -> c10::optional<at::ScalarType> {
        if (c.fp8()) return c.dispatch_dtype;
        return c10::nullopt;
      })
      .def_readonly("max_expert_rows", &CommConfig::max_expert_rows)
      .def_property_readonly("expert_rows", &CommConfig::expert_rows);
  m.def("create", &create, py::arg("config"), "Create this rank's communicator and heap; returns its export handle");
  m.def("connect", &connect, "Open every rank's heap from the gathered export handles");
  m.def("finish", &finish, "Finish bootstrap after a group barrier (unlink, P2P probe)");
  m.def("destroy", &remove_comm, "Release this rank's communicator");
  // The fakes' (rdna4_comm/ops.py) view of a communicator: its device, or
  // None once it is closed.
  m.def("comm_device", [](const std::string& id) -> py::object {
    auto c = lookup_comm(id);
    if (!c) return py::none();
    return py::cast(c->device());
  }, py::arg("id"));
  // The fakes' output shapes (token_dim where the caller's token count goes) and dtypes.
  auto specs_to_py = [](const OutputSpec* specs, int n) {
    py::list out;
    for (int i = 0; i < n; ++i) {
      py::tuple shape(specs[i].dims);
      for (int k = 0; k < specs[i].dims; ++k) shape[k] = specs[i].shape[k];
      out.append(py::make_tuple(shape, specs[i].dtype));
    }
    return out;
  };
  m.def("dispatch_outputs", [specs_to_py](const std::string& id, at::ScalarType idx_dtype,
                                          c10::optional<at::ScalarType> weights_dtype) {
    const auto specs = find_comm(id)->dispatch_outputs(idx_dtype, weights_dtype);
    return specs_to_py(specs.data(), kDispatchOutputs);
  }, py::arg("id"), py::arg("idx_dtype"), py::arg("weights_dtype"),
        "dispatch's outputs, in order: [(shape, dtype)]");
  m.def("dispatch_expert_outputs", [specs_to_py](const std::string& id, c10::optional<at::ScalarType> weights_dtype) {
    const auto specs = find_comm(id)->dispatch_expert_outputs(weights_dtype);
    return specs_to_py(specs.data(), kExpertDispatchOutputs);
  }, py::arg("id"), py::arg("weights_dtype"), "dispatch_expert's outputs, in order: [(shape, dtype)]");
  m.def("dispatch_scales_output", [specs_to_py](const std::string& id, bool expert_layout) {
    const OutputSpec spec = find_comm(id)->dispatch_scales_output(expert_layout);
    return py::object(specs_to_py(&spec, 1)[0]);
  }, py::arg("id"), py::arg("expert_layout"), "an FP8 dispatch's x_scales: (shape, dtype)");
  m.def("combine_output", [specs_to_py](const std::string& id) {
    const OutputSpec spec = find_comm(id)->combine_output();
    return py::object(specs_to_py(&spec, 1)[0]);
  }, py::arg("id"), "combine's output: (shape, dtype)");
  m.attr("token_dim") = kTokenDim;
  m.def("check", &check, "Raise if an earlier op of the communicator failed");
  py::module_ eager = m.def_submodule("eager", "The ops' eager entry points (ops.cpp, at namespace eager)");
  eager::def_all(eager);
  m.def("watch_peers", &watch_peers, "Watch the peers' processes: [(rank, pid, start_time)]");
  m.def("process_start_time", &process_start_time, py::arg("pid"),
        "Start time of a process as /proc shows it, 0 if not visible");
  m.def("process_alive", [](int pid, uint64_t start_time) { return process_alive(PeerProcess{-1, pid, start_time}); },
        py::arg("pid"), py::arg("start_time"), "Whether that process still runs (not gone, reused or a zombie)");
#ifdef RDNA4_COMM_WITH_GPU
  m.attr("with_gpu") = true;
#else
  m.attr("with_gpu") = false;
#endif
  m.def("allreduce_use_one_shot", &allreduce_use_one_shot, py::arg("nbytes"), py::arg("world"),
        py::arg("gpu"));
  m.attr("max_world") = kMaxWorld;
  m.attr("max_gpu_world") = kMaxGpuWorld;
  m.attr("max_gpu_tokens_per_rank") = kMaxGpuTokensPerRank;
  m.attr("max_topk") = kMaxTopk;

  // The protocol's policies, bound so that the tests check the functions the
  // transports and kernels themselves call.
  auto testing = m.def_submodule("testing", "protocol.h policies, for the tests");
  testing.def("ep_chunk_tokens", &ep_chunk_tokens, py::arg("ntok"));
  testing.def("ep_num_chunks", &ep_num_chunks, py::arg("ntok"));
  testing.def("ep_max_chunks", &ep_max_chunks, py::arg("cap"));
  testing.def("ep_chunks", &ep_chunks, py::arg("ntok"), py::arg("chunk_tokens"));
  testing.def("ep_own_role_share", &ep_own_role_share, py::arg("world"), py::arg("sm_count"));
  testing.def("ep_own_block_tokens", &ep_own_block_tokens, py::arg("ntok"), py::arg("world"), py::arg("sm_count"));
  testing.def("dispatch_routes_all_tokens", &dispatch_routes_all_tokens, py::arg("ntok"));
  testing.def("dispatch_prefetches_chunk", &dispatch_prefetches_chunk, py::arg("chunk_bytes"));
  testing.def("combine_sums_short", &combine_sums_short, py::arg("block_tokens"), py::arg("row_vectors"));
  testing.def("dispatch_routing_warp", &dispatch_routing_warp, py::arg("batch_rows"), py::arg("topk"));
  testing.attr("gpu_routing_lanes") = kGpuRoutingLanes;
  testing.attr("gpu_short_unroll") = kGpuShortUnroll;
  testing.attr("gpu_block_threads") = kGpuBlockThreads;
  testing.def("expert_owner", &expert_owner, py::arg("e"), py::arg("num_experts"), py::arg("experts_per_rank"),
              py::arg("world"));
  // (send_blocks, recv_blocks) of a launch policy.
  auto bind_grid = [&testing](const char* name, EpGrid (*policy)(int64_t, int, int)) {
    testing.def(name, [policy](int64_t ntok, int world, int sm_count) {
      const EpGrid g = policy(ntok, world, sm_count);
      return std::make_pair(g.send_blocks, g.recv_blocks);
    }, py::arg("ntok"), py::arg("world"), py::arg("sm_count"));
  };
  bind_grid("dispatch_grid", &dispatch_grid);
  bind_grid("combine_grid", &combine_grid);
  testing.def("allreduce_blocks", &allreduce_blocks, py::arg("share_bytes"), py::arg("sm_count"));
  testing.def("expert_chunks", &expert_chunks, py::arg("rows"));
  testing.def("expert_chunk_blocks", &expert_chunk_blocks, py::arg("rows"), py::arg("sm_count"));
  testing.def("expert_row_blocks", &expert_row_blocks, py::arg("rows"), py::arg("sm_count"));
  testing.def("expert_place_blocks", &expert_place_blocks, py::arg("rows"), py::arg("experts"), py::arg("alignment"),
              py::arg("sm_count"));
  testing.attr("expert_chunk_rows") = kExpertChunkRows;
  // (signal bytes, data bytes) of the heap layout of a configuration.
  // The FP8 rule of fp8.h (what the CPU transport and the kernels run), on
  // CPU tensors: the conversion alone, and whole rows.
  testing.def("fp8_e4m3fn_bits", [](const at::Tensor& f) {
    TORCH_CHECK_VALUE(f.scalar_type() == at::kFloat && f.device().is_cpu(), "fp8_e4m3fn_bits: a CPU float32 tensor");
    const at::Tensor in = f.contiguous();
    at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kByte));
    const float* p = in.data_ptr<float>();
    uint8_t* o = out.data_ptr<uint8_t>();
    for (int64_t i = 0; i < in.numel(); ++i) o[i] = fp8_e4m3fn_bits(p[i]);
    return out;
  }, py::arg("f"));
  testing.def("quantize_fp8_rows", [](const at::Tensor& x) {
    TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu(), "quantize_fp8_rows: a CPU [T, H] tensor");
    const at::Tensor in = x.contiguous();
    const int64_t T = in.size(0), H = in.size(1), S = fp8_num_scales(H);
    at::Tensor q = at::empty({T, H}, in.options().dtype(at::kByte));
    at::Tensor scales = at::empty({T, S}, in.options().dtype(at::kFloat));
    const char* p = static_cast<const char*>(in.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      cpu::quantize_fp8_row(in.scalar_type(), p + t * H * in.element_size(), H,
                            static_cast<char*>(q.data_ptr()) + t * H, scales.data_ptr<float>() + t * S);
    return std::make_pair(q.view(at::kFloat8_e4m3fn), scales);
  }, py::arg("x"));
  testing.def("heap_bytes", [](int world, int64_t cap, int64_t hidden, int64_t topk, int64_t elt, int64_t slot_bytes) {
    HeapConfig c;
    c.world = world;
    c.cap = cap;
    c.hidden = hidden;
    c.topk = topk;
    c.elt = elt;
    c.ar_slot_bytes = slot_bytes;
    const Layout l = make_layout(c);
    return std::make_pair(l.signal_bytes, l.data_bytes);
  }, py::arg("world"), py::arg("cap"), py::arg("hidden"), py::arg("topk"), py::arg("elt"), py::arg("slot_bytes"));
  m.def("rmsnorm_path_counts", &rmsnorm_path_counts, "Calls of all_reduce_rmsnorm by path");
  // The call words of calls.h, for the tests.
  py::module_ calls = m.def_submodule("calls", "Call words (csrc/calls.h)");
  calls.def("all_reduce", [](int dtype, int64_t numel) { return all_reduce_call(dtype, numel); });
  calls.def("rmsnorm", [](int dtype, bool residual, int64_t hidden, int64_t rows) {
    return rmsnorm_call(dtype, residual, hidden, rows);
  });
  calls.def("dispatch", [](bool expert_layout, bool fp8_pair) { return dispatch_call(expert_layout, fp8_pair); });
  calls.def("combine", [](bool expert_layout, uint64_t round) { return combine_call(expert_layout, round); });
  calls.def("stamp", [](uint64_t fields, uint64_t round) { return call_word(fields, round); });
  calls.def("of_round", [](uint64_t word, uint64_t round) { return call_of_round(word, round); });
  // The fused op's gate: the predicates the op itself uses (protocol.h).
  m.def("rmsnorm_path", [](int64_t tokens, int64_t hidden, int64_t elt, int world, bool gpu, int64_t slot_bytes) {
    return std::string(rmsnorm_path_name(rmsnorm_path(tokens, hidden, elt, world, gpu, slot_bytes)));
  }, py::arg("tokens"), py::arg("hidden"), py::arg("elt"), py::arg("world"), py::arg("gpu"), py::arg("slot_bytes"));
  m.def("rmsnorm_row_in_registers", &rmsnorm_row_in_registers, py::arg("hidden"), py::arg("elt"));
  m.def("allreduce_slot_bytes", &allreduce_slot_bytes, py::arg("transport"), py::arg("requested") = 0,
        "The all_reduce slot of a communicator: requested, or the transport's default when 0, aligned");
  testing.def("rmsnorm_use_one_stage", &rmsnorm_use_one_stage, py::arg("tokens"), py::arg("row_bytes"),
              py::arg("world"), py::arg("gpu"));
  testing.def("rmsnorm_chunk_rows", &rmsnorm_chunk_rows, py::arg("slot_bytes"), py::arg("row_bytes"),
              py::arg("world"), py::arg("one_stage"));
  testing.def("rmsnorm_register_row_elems", &rmsnorm_register_row_elems, py::arg("elt"));
  py::dict one_shot_max;
  one_shot_max["cpu"] = kCpuOneShotMaxBytes;
  one_shot_max["gpu"] = kGpuOneShotMaxBytes;
  one_shot_max["dist"] = kCpuOneShotMaxBytes;  // the GPU threshold is tuned to the GPU kernels only
  testing.attr("one_shot_max_bytes") = one_shot_max;
  testing.attr("max_launch_blocks") = kMaxLaunchBlocks;
#ifdef RDNA4_COMM_WITH_GPU
  testing.def("occupy_gpu", &occupy_gpu, py::arg("device"), py::arg("fraction"), py::arg("ms"),
              "Keep `fraction` of the GPU's thread slots spinning for `ms` ms, on the current stream");
  testing.def("store_out_of_bounds", &store_out_of_bounds, py::arg("device"),
              "One store just past the end of a fresh 256-byte allocation (for compute-sanitizer)");
  testing.def("fp8_conversion_mismatches", &fp8_conversion_mismatches, py::arg("device"),
              "(count, lowest) of the fp32 patterns whose FP8 byte from the kernels differs from fp8.h's");
#endif
}
