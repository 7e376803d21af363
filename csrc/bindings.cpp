// rdna4_comm._C: what Python needs beyond the ops (ops.cpp): the
// communicator's configuration and bootstrap, the op table and output
// shapes the fakes read, the transports' records, limits, the predicates the
// ops use (for planning and the tests), and the protocol's policies for the
// tests.
#include <torch/python.h>

#include "bounds.h"
#include "calls.h"
#include "comm.h"
#include "cpu/cpu_arith.h"
#include "eager.h"
#include "op_table.h"
#include "policies.h"
#include "routing.h"

namespace rdna4_comm {
namespace {

// Calls of all_reduce_rmsnorm by path, and how many kept rows in registers.
py::dict rmsnorm_path_counts(const std::string& id) {
  const auto& counts = find_comm(id)->rmsnorm_path_counts();
  py::dict d;
  for (int p = 0; p < kNumRmsNormPaths; ++p) d[rmsnorm_path_name(p)] = counts[p];
  d["row_in_registers"] = counts[Comm::kRowInRegistersCount];
  return d;
}

py::bytes create(const CommConfig& c) {
  TORCH_CHECK_VALUE(c.dispatch_dtype == at::ScalarType::Undefined || c.fp8(),
                    "Communicator: dispatch_dtype must be None or torch.float8_e4m3fn, got ",
                    dtype_name(c.dispatch_dtype));
  std::shared_ptr<Comm> comm = find_transport(c.transport).make(c);
  py::bytes handle(comm->export_handle());  // binary on the GPU (IPC handles)
  register_comm(std::move(comm));
  return handle;
}

void watch_peers(const std::string& id, const std::vector<std::tuple<int, int, uint64_t>>& peers) {
  std::vector<PeerProcess> v;
  for (const auto& [rank, pid, start] : peers) v.push_back(PeerProcess{rank, pid, start});
  find_comm(id)->watch_peers(v);
}

// A field's value as Python sees it: a dtype field left Undefined is None.
template <typename T>
py::object to_python(const T& v) {
  return py::cast(v);
}
template <>
py::object to_python(const at::ScalarType& v) {
  return v == at::ScalarType::Undefined ? py::none() : py::cast(v);
}
template <typename T>
T from_python(const py::handle& v) {
  return v.cast<T>();
}
template <>
at::ScalarType from_python(const py::handle& v) {
  return v.is_none() ? at::ScalarType::Undefined : v.cast<at::ScalarType>();
}

// _C.CommConfig, from CommConfig::each_field: made once, with every field
// as a keyword, by Communicator (which validates the values first);
// read-only after that, since the C++ communicator owns it.
void bind_config(py::module_& m) {
  py::class_<CommConfig> cls(m, "CommConfig", "What a communicator is made of");
  cls.def(py::init([](const py::kwargs& kwargs) {
    CommConfig c;
    size_t used = 0;
    CommConfig::each_field([&](const ConfigField& f, auto member) {
      using T = std::remove_reference_t<decltype(c.*member)>;
      TORCH_CHECK_TYPE(kwargs.contains(f.name), "CommConfig: missing keyword ", f.name);
      c.*member = from_python<T>(kwargs[f.name]);
      ++used;
    });
    if (used != kwargs.size()) {  // name the keywords that are no field
      std::string unknown;
      for (const auto& item : kwargs) {
        const std::string key = py::cast<std::string>(item.first);
        bool known = false;
        CommConfig::each_field([&](const ConfigField& f, auto) { known = known || key == f.name; });
        if (!known) unknown += (unknown.empty() ? "" : ", ") + key;
      }
      TORCH_CHECK_TYPE(false, "CommConfig: unknown keywords: ", unknown);
    }
    return c;
  }));
  py::list fields;
  CommConfig::each_field([&](const ConfigField& f, auto member) {
    cls.def_property_readonly(f.name, [member](const CommConfig& c) { return to_python(c.*member); });
    fields.append(py::dict(py::arg("name") = f.name, py::arg("argument") = f.argument, py::arg("doc") = f.doc,
                           py::arg("agreed") = f.agreed));
  });
  cls.attr("fields") = fields;
  cls.def_property_readonly("expert_rows", &CommConfig::expert_rows);
}

// The op table for rdna4_comm/ops.py, and the fakes' output shapes.
void bind_op_table(py::module_& m) {
  m.def("op_table", [] {
    py::list ops;
    for (const OpDecl& op : op_table()) {
      py::list args;
      for (const ArgDecl& a : op.args) args.append(py::make_tuple(a.name, std::string(1, char(a.kind))));
      ops.append(py::dict(py::arg("name") = op.name, py::arg("method") = op.method, py::arg("args") = args,
                          py::arg("outputs") = op.outputs, py::arg("tokens_arg") = op.tokens_arg,
                          py::arg("tokens_leading") = op.tokens_leading));
    }
    return ops;
  }, "Every op: name, method, args [(name, kind: T tensor, O optional tensor, f float)], outputs, token source");
  m.def("output_specs", [](const std::string& name, const std::string& id,
                           const std::vector<c10::optional<at::ScalarType>>& dtypes) {
    const OpDecl& op = find_op(name);
    TORCH_CHECK_VALUE(dtypes.size() == op.args.size(), name, ": ", op.args.size(), " argument dtypes expected");
    py::list out;
    for (const OutputRule& r : op.rules(*find_comm(id), dtypes)) {
      py::tuple shape(r.spec.dims > 0 ? r.spec.dims : 0);
      for (int k = 0; k < r.spec.dims; ++k) shape[k] = r.spec.shape[k];
      out.append(r.like_arg >= 0 ? py::object(py::int_(r.like_arg)) : py::object(py::make_tuple(shape, r.spec.dtype)));
    }
    return out;
  }, py::arg("op"), py::arg("id"), py::arg("dtypes"),
        "An op's outputs for the tensor arguments' dtypes (None where absent or not a tensor), in order: "
        "(shape, dtype) with token_dim where the call's token count goes, or the index of the argument it is like");
  m.attr("token_dim") = kTokenDim;
}

void bind_transports(py::module_& m) {
  py::class_<Transport>(m, "Transport", "What a transport can do (csrc/transport.h)")
      .def_readonly("name", &Transport::name)
      .def_readonly("built", &Transport::built)
      .def_readonly("device_kernels", &Transport::device_kernels)
      .def_readonly("writes_cross_links", &Transport::writes_cross_links)
      .def_readonly("process_group", &Transport::process_group)
      .def_readonly("device_tensors", &Transport::device_tensors)
      .def_readonly("graph_capture", &Transport::graph_capture)
      .def_readonly("max_world", &Transport::max_world)
      .def_readonly("max_tokens_per_rank", &Transport::max_tokens_per_rank)
      .def_readonly("default_slot_bytes", &Transport::default_slot_bytes)
      .def_property_readonly("one_shot_max_bytes", &one_shot_max_bytes);
  m.def("transports", [] {
    py::dict d;
    for (const Transport* t : transports()) d[t->name] = py::cast(t, py::return_value_policy::reference);
    return d;
  }, "Every transport's record, by name");
}

// The protocol's policies and predicates, bound so that the tests (and
// callers who plan around them: rdna4_comm.algorithms) check the functions
// the transports and kernels themselves call.
// The FP8 rule of fp8.h (what the CPU transport and the kernels run), on
// CPU tensors, for the tests: the conversion alone, and whole rows.
void bind_fp8_rule(py::module_& testing) {
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
}

void bind_policies(py::module_& m) {
  auto testing = m.def_submodule("testing", "The protocol's policies (policies.h), for the tests");
  testing.def("ep_chunk_tokens", &ep_chunk_tokens, py::arg("ntok"));
  testing.def("ep_num_chunks", &ep_num_chunks, py::arg("ntok"));
  testing.def("ep_max_chunks", &ep_max_chunks, py::arg("cap"));
  testing.def("ep_chunks", &ep_chunks, py::arg("ntok"), py::arg("chunk_tokens"));
  testing.def("ep_own_role_share", &ep_own_role_share, py::arg("world"), py::arg("sm_count"));
  testing.def("ep_own_block_tokens", &ep_own_block_tokens, py::arg("ntok"), py::arg("world"), py::arg("sm_count"));
  testing.def("dispatch_routes_all_tokens", &dispatch_routes_all_tokens, py::arg("ntok"));
  testing.def("block_prefetch_covers", &block_prefetch_covers, py::arg("bytes"));
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
  testing.def("expert_row_blocks", &expert_row_blocks, py::arg("rows"), py::arg("sm_count"),
              py::arg("resident_per_sm"));
  testing.def("expert_row_slices", &expert_row_slices, py::arg("received"), py::arg("row_bytes"), py::arg("vectors"),
              py::arg("blocks"));
  testing.attr("expert_slice_bytes") = kExpertSliceBytes;
  testing.def("combine_recv_slices", &combine_recv_slices, py::arg("ntok"), py::arg("world"), py::arg("sm_count"),
              py::arg("row_bytes"), py::arg("vectors"), py::arg("pair_rows"));
  testing.def("expert_place_blocks", &expert_place_blocks, py::arg("rows"), py::arg("experts"), py::arg("alignment"),
              py::arg("sm_count"), py::arg("resident_per_sm"));
  testing.attr("expert_chunk_rows") = kExpertChunkRows;
  testing.attr("expert_one_chunk_experts") = kExpertOneChunkExperts;
  testing.def("expert_places_one_chunk", &expert_places_one_chunk, py::arg("received"), py::arg("experts"));
  testing.def("expert_tally_launched", &expert_tally_launched, py::arg("rows"), py::arg("experts"));
  // (signal bytes, data bytes) of the heap layout of a configuration.
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
  testing.def("rmsnorm_use_one_stage", &rmsnorm_use_one_stage, py::arg("tokens"), py::arg("row_bytes"),
              py::arg("world"), py::arg("gpu"));
  testing.def("rmsnorm_chunk_rows", &rmsnorm_chunk_rows, py::arg("slot_bytes"), py::arg("row_bytes"),
              py::arg("world"), py::arg("one_stage"));
  testing.def("rmsnorm_register_row_elems", &rmsnorm_register_row_elems, py::arg("elt"));
  py::dict one_shot_max;
  for (const Transport* t : transports()) one_shot_max[t->name] = one_shot_max_bytes(*t);
  testing.attr("one_shot_max_bytes") = one_shot_max;
  testing.attr("max_launch_blocks") = kMaxLaunchBlocks;
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
  // The fused op's gate: the predicates the op itself uses (policies.h).
  m.def("rmsnorm_path", [](int64_t tokens, int64_t hidden, int64_t elt, int world, const std::string& transport,
                           int64_t slot_bytes) {
    const bool gpu = find_transport(transport).device_kernels;
    return std::string(rmsnorm_path_name(rmsnorm_path(tokens, hidden, elt, world, gpu, slot_bytes)));
  }, py::arg("tokens"), py::arg("hidden"), py::arg("elt"), py::arg("world"), py::arg("transport"),
        py::arg("slot_bytes"));
  m.def("rmsnorm_row_in_registers", &rmsnorm_row_in_registers, py::arg("hidden"), py::arg("elt"));
  m.def("allreduce_slot_bytes", &allreduce_slot_bytes, py::arg("transport"), py::arg("requested") = 0,
        "The all_reduce slot of a communicator: requested, or the transport's default when 0, aligned");
  bind_fp8_rule(testing);
}

}  // namespace
}  // namespace rdna4_comm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace rdna4_comm;
  m.doc() = "rdna4_comm C++ core: communicator bootstrap, op table, transports, limits and predicates";
  bind_config(m);
  bind_op_table(m);
  bind_transports(m);
  m.def("create", &create, py::arg("config"), "Create this rank's communicator and heap; returns its export handle");
  m.def("connect", [](const std::string& id, const std::vector<std::string>& handles) {
    find_comm(id)->connect(handles);
  }, "Open every rank's heap from the gathered export handles");
  m.def("finish", [](const std::string& id) { return find_comm(id)->finish(); },
        "Finish bootstrap after a group barrier (unlink, P2P probe)");
  m.def("destroy", &remove_comm, "Release this rank's communicator");
  // The fakes' (rdna4_comm/ops.py) view of a communicator: its device, or
  // None once it is closed.
  m.def("comm_device", [](const std::string& id) -> py::object {
    auto c = lookup_comm(id);
    if (!c) return py::none();
    return py::cast(c->device());
  }, py::arg("id"));
  m.def("check", [](const std::string& id) { find_comm(id)->raise_pending(); },
        "Raise if an earlier op of the communicator failed");
  py::module_ eager = m.def_submodule("eager", "The ops' eager entry points (eager.cpp)");
  eager::def_all(eager);
  m.def("watch_peers", &watch_peers, "Watch the peers' processes: [(rank, pid, start_time)]");
  m.def("process_start_time", &process_start_time, py::arg("pid"),
        "Start time of a process as /proc shows it, 0 if not visible");
  m.def("process_alive", [](int pid, uint64_t start_time) { return process_alive(PeerProcess{-1, pid, start_time}); },
        py::arg("pid"), py::arg("start_time"), "Whether that process still runs (not gone, reused or a zombie)");
  m.attr("with_gpu") = find_transport("gpu").built;
  m.def("allreduce_use_one_shot", [](int64_t nbytes, int world, const std::string& transport) {
    return allreduce_use_one_shot(nbytes, world, find_transport(transport).device_kernels);
  }, py::arg("nbytes"), py::arg("world"), py::arg("transport"));
  m.attr("max_world") = kMaxWorld;
  m.attr("max_topk") = kMaxTopk;
  m.def("rmsnorm_path_counts", &rmsnorm_path_counts, "Calls of all_reduce_rmsnorm by path");

  bind_policies(m);
}
