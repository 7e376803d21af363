// The ops' eager entry points (rdna4_comm._C.eager.<op>), what the
// Communicator methods call outside torch.compile. Entering an op from
// Python through the dispatcher (OpOverload.op) boxes every argument into
// IValues: about 9 k instructions a call, more than the rest of an eager
// combine's host work apart from the kernel's own (callgrind, CPU
// transport). These take plain arguments straight to the op (OpDecl::call),
// inside a RecordFunction of the op's name so profilers still see it.
// Whatever the dispatcher or Python must see goes through the op itself
// (OpOverload.op): a tensor other than a plain dense one (a subclass, a
// wrapper, a sparse or conjugate view, one that requires grad while grad
// mode is on), an argument of another type than the schema's, a torch
// function or dispatch mode, or dispatch keys included in this thread.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include "eager.h"
#include "op_table.h"

namespace rdna4_comm {
namespace eager {
namespace {

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

// The predicate: whether a call of the op may skip the dispatcher. Its
// arguments: the op's own, then the ordering token and the communicator's id.
bool plain_call(const OpDecl& op, const py::args& args, const py::kwargs& kwargs) {
  const size_t n = op.args.size();
  if (kwargs.size() != 0 || args.size() != n + 2) return false;
  if (at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() != 0) return false;
  if (!(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty()) return false;
  for (size_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args.ptr(), Py_ssize_t(i));
    const ArgKind kind = op.args[i].kind;
    const bool ok = kind == ArgKind::kFloat                          ? PyFloat_Check(a)
                    : kind == ArgKind::kOptionalTensor && a == Py_None ? true
                                                                       : plain_tensor(a);
    if (!ok) return false;
  }
  return plain_tensor(PyTuple_GET_ITEM(args.ptr(), Py_ssize_t(n))) &&
         PyUnicode_Check(PyTuple_GET_ITEM(args.ptr(), Py_ssize_t(n + 1)));
}

// The OpCall of a call that plain_call accepted, readable without the GIL:
// it points into the call's argument tuple, which outlives the call, so
// reading it touches no reference count; a tensor's or float's value is a
// field of its object, and the str's text is taken here.
OpCall plain_args(const OpDecl& op, const py::args& args) {
  OpCall call;
  auto item = [&](size_t i) { return PyTuple_GET_ITEM(args.ptr(), Py_ssize_t(i)); };
  const size_t n = op.args.size();
  for (size_t i = 0; i < n; ++i) {
    if (op.args[i].kind == ArgKind::kFloat)
      call.real = PyFloat_AS_DOUBLE(item(i));
    else if (item(i) != Py_None)
      call.tensors[i] = &THPVariable_Unpack(item(i));
  }
  // The order token: the ops' schemas mark it written; nothing writes it.
  call.order = const_cast<at::Tensor*>(&THPVariable_Unpack(item(n)));
  Py_ssize_t len = 0;
  const char* p = PyUnicode_AsUTF8AndSize(item(n + 1), &len);
  if (p == nullptr) throw py::error_already_set();
  call.comm = c10::string_view(p, size_t(len));
  return call;
}

py::object to_python(std::vector<at::Tensor>&& out) {
  if (out.size() == 1) return py::cast(std::move(out[0]));
  py::tuple t(out.size());
  for (size_t i = 0; i < out.size(); ++i) t[i] = py::cast(std::move(out[i]));
  return std::move(t);
}

}  // namespace

void def_all(py::module_& m) {
  parameter_type = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  const py::object ops = py::module_::import("torch").attr("ops").attr("rdna4_comm");
  for (const OpDecl& op : op_table()) {
    // The op's own callable, looked up once; never released, like the op.
    PyObject* dispatcher = py::object(ops.attr(op.name).attr("default").attr("op")).release().ptr();
    const std::string qualified = std::string("rdna4_comm::") + op.name;
    m.def(op.name, [&op, dispatcher, qualified](const py::args& args, const py::kwargs& kwargs) -> py::object {
      if (!plain_call(op, args, kwargs)) return py::reinterpret_borrow<py::object>(dispatcher)(*args, **kwargs);
      const OpCall call = plain_args(op, args);
      // Without the GIL, as the dispatcher's Python entry runs an op: a CPU
      // transport op waits for its peers.
      std::vector<at::Tensor> out = [&] {
        py::gil_scoped_release no_gil;
        RECORD_FUNCTION(qualified.c_str(), std::vector<c10::IValue>());
        return op.call(call);
      }();
      return to_python(std::move(out));
    });
  }
  // The predicate, for the tests: would this call of op `name` skip the dispatcher?
  m.def("is_plain_call", [](const std::string& name, const py::args& args, const py::kwargs& kwargs) {
    return plain_call(find_op(name), args, kwargs);
  }, py::arg("name"));
}

}  // namespace eager
}  // namespace rdna4_comm
