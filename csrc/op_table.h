// The ops of torch.ops.rdna4_comm, each declared once (ops.cpp, op_table):
// its arguments, its outputs by name, the rule that gives their shapes and
// the function that runs it. From these alone come the TORCH_LIBRARY
// schemas and kernels (ops.cpp), the eager entry points (_C.eager,
// eager.cpp), and, through _C.op_table and _C.output_specs, the fakes and
// the Communicator methods' access to outputs by name (rdna4_comm/ops.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "comm.h"

namespace rdna4_comm {

// An argument's kind; every op also takes, last, the ordering token
// (`Tensor(a!) order`, rdna4_comm.ops.order_token) and the communicator's
// id (`str comm`), which the declarations leave out.
enum class ArgKind : char { kTensor = 'T', kOptionalTensor = 'O', kFloat = 'f' };
struct ArgDecl {
  const char* name;
  ArgKind kind;
};

// One call's arguments, from the dispatcher's stack or from Python objects
// (eager.cpp): borrowed, valid during the call.
constexpr size_t kMostOpArgs = 8;
struct OpCall {
  const at::Tensor* tensors[kMostOpArgs] = {};  // Tensor and Tensor? arguments; nullptr: None
  double real = 0;                               // the float argument
  at::Tensor* order = nullptr;
  c10::string_view comm;

  const at::Tensor& tensor(size_t i) const { return *tensors[i]; }
  c10::optional<at::Tensor> optional(size_t i) const {
    return tensors[i] == nullptr ? c10::nullopt : c10::optional<at::Tensor>(*tensors[i]);
  }
};

// What the fakes make of an output: empty_like(argument `like_arg`) when it
// is >= 0, else a tensor of `spec`, kTokenDim being the call's token count.
struct OutputRule {
  int like_arg = -1;
  OutputSpec spec{};
};

struct OpDecl {
  const char* name;    // torch.ops.rdna4_comm.<name>
  const char* method;  // the Communicator method it serves, as its errors name it
  std::vector<ArgDecl> args;
  std::vector<std::string> outputs;
  // The fakes' token count: the product of the leading dimensions of
  // argument `tokens_arg` (all but its last one), or its first dimension.
  int tokens_arg;
  bool tokens_leading;
  // The outputs' shapes, given the dtypes of the tensor arguments (none for
  // an absent optional one), in `outputs`' order.
  std::function<std::vector<OutputRule>(const Comm&, const std::vector<c10::optional<at::ScalarType>>&)> rules;
  // The op, on the communicator the call names, after the ordering token
  // was checked: its outputs, in `outputs`' order.
  std::function<std::vector<at::Tensor>(Comm&, const OpCall&)> run;

  std::string schema() const;
  // The op, in full: finds the communicator, checks the token, runs it,
  // then the deferred checks that earlier ops left (Comm::run_deferred_checks).
  std::vector<at::Tensor> call(const OpCall& call) const;
};

const std::vector<OpDecl>& op_table();
const OpDecl& find_op(const std::string& name);  // raises for an unknown name

}  // namespace rdna4_comm
