// A communicator: one rank's view of the symmetric heap, its peers, and the
// four ops (all_reduce, dispatch, combine, all_reduce_rmsnorm). Transports
// (CPU shared memory, GPU peer memory, torch.distributed) implement the same
// interface; argument validation is shared and runs before any protocol
// step, so a rejected call leaves every counter and buffer untouched.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/core/Event.h>

#include <array>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ep_results.h"
#include "fp8.h"
#include "layout.h"
#include "policies.h"
#include "transport.h"

namespace rdna4_comm {

// A CommConfig field as Python sees it (CommConfig::each_field).
struct ConfigField {
  const char* name;  // _C.CommConfig's keyword and attribute
  // The Communicator keyword argument that gives it ("": none), and, with a
  // docstring, the read-only Communicator property of that name.
  const char* argument;
  const char* doc;
  // Every rank must pass the same argument: it shapes the symmetric heap or
  // the ops' collectives, and a rank with another value would lay its rows
  // out otherwise, write past its peers' buffers or run other collectives.
  bool agreed;
};

// Everything a communicator is made of: the heap's sizes (HeapConfig, what
// the layout derives from) and the rest. Built once, with keywords, by the
// Python Communicator (_C.CommConfig, which validates the values first) and
// read-only after; the C++ side validates the ops' arguments and answers the
// fakes' questions about shapes (_C.output_specs).
struct CommConfig : HeapConfig {
  std::string id;
  std::string transport;  // a registered transport's name (transport.h)
  std::string group_name;  // dist: the torch.distributed group the ops run on (c10d::resolve_process_group)
  int rank = 0;
  at::ScalarType dtype = at::kBFloat16;  // EP payload; `elt` follows it
  // Dispatch's rows: Undefined, in dtype; kFloat8_e4m3fn, in FP8 with fp32
  // scales per kFp8Block channels (fp8.h; `fp8_scales` follows it).
  at::ScalarType dispatch_dtype = at::ScalarType::Undefined;
  int64_t timeout_ms = 0;
  int device_index = -1;  // GPU transport: the CUDA/HIP device of this rank
  int64_t expert_alignment = 1;  // expert layout: each expert's block of rows starts at a multiple of this
  int64_t max_expert_rows = 0;   // expert layout: rows of its x; 0 for the worst case (expert_rows())
  // Transport "dist": whether each round first exchanges the ranks' call
  // words (one more collective; the P2P transports always check them).
  bool dist_check_calls = false;

  // Every field that Python sets: f(ConfigField, member pointer). The one
  // list of them: _C.CommConfig's keywords and attributes, and the
  // Communicator's properties and cross-rank agreement check
  // (rdna4_comm/communicator.py), come from it.
  template <typename F>
  static void each_field(F&& f) {
    f(ConfigField{"id", "", "", false}, &CommConfig::id);
    f(ConfigField{"transport", "", "", false}, &CommConfig::transport);
    f(ConfigField{"group_name", "", "", false}, &CommConfig::group_name);
    f(ConfigField{"rank", "", "", false}, &CommConfig::rank);
    f(ConfigField{"world", "", "", false}, &CommConfig::world);
    f(ConfigField{"cap", "max_tokens_per_rank", "``cap``, the most tokens a rank dispatches; 0 without dispatch/combine.", true}, &CommConfig::cap);
    f(ConfigField{"hidden", "hidden", "``H``; 0 without dispatch/combine.", true}, &CommConfig::hidden);
    f(ConfigField{"topk", "topk", "``K``; 0 without dispatch/combine.", true}, &CommConfig::topk);
    f(ConfigField{"num_experts", "num_experts", "``E``; 0 without dispatch/combine.", true}, &CommConfig::num_experts);
    f(ConfigField{"dtype", "dtype", "Payload dtype of dispatch/combine.", true}, &CommConfig::dtype);
    f(ConfigField{"dispatch_dtype", "dispatch_dtype", "torch.float8_e4m3fn for FP8 dispatch, else None.", true},
      &CommConfig::dispatch_dtype);
    f(ConfigField{"ar_slot_bytes", "allreduce_slot_bytes",
                  "Bytes of all_reduce's slot per parity and source (the transport's default when none was given).",
                  true},
      &CommConfig::ar_slot_bytes);
    f(ConfigField{"timeout_ms", "timeout_ms", "Bound of every wait, in milliseconds.", false}, &CommConfig::timeout_ms);
    f(ConfigField{"device_index", "", "", false}, &CommConfig::device_index);
    f(ConfigField{"expert_alignment", "expert_alignment", "Row alignment of each expert's block in the expert layout.",
                  true},
      &CommConfig::expert_alignment);
    f(ConfigField{"max_expert_rows", "max_expert_rows", "", true}, &CommConfig::max_expert_rows);
    f(ConfigField{"dist_check_calls", "dist_check_calls",
                  "Transport \"dist\": whether each op first exchanges the ranks' calls.", true},
      &CommConfig::dist_check_calls);
  }

  bool has_ep() const { return cap > 0; }
  bool fp8() const { return dispatch_dtype == at::kFloat8_e4m3fn; }
  // The dtype of dispatch's x: FP8 for an FP8 communicator, else dtype.
  at::ScalarType dispatched_dtype() const { return fp8() ? dispatch_dtype : dtype; }
  int64_t experts_per_rank() const { return num_experts / world; }
  // Rows of the expert layout's x: max_expert_rows, or the most a dispatch
  // can need: every received row (W*cap) in min(K, E_loc) experts, plus the
  // alignment padding of every expert.
  int64_t expert_rows() const {
    const int64_t epr = experts_per_rank(), per_row = topk < epr ? topk : epr;
    return max_expert_rows > 0 ? max_expert_rows : int64_t(world) * cap * per_row + epr * (expert_alignment - 1);
  }
};

// The ops' argument checks: each raises naming the op, the argument, what
// it must be and what it is, in torch's Python spelling of dtypes.
std::string shape_str(const at::Tensor& t);
std::string dtype_name(at::ScalarType t);
void check_device(const char* op, const char* arg, const at::Tensor& t, const at::Device& dev);
void check_contiguous(const char* op, const char* arg, const at::Tensor& t);
void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType want);
void check_shape(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef want, const char* meaning);
void check_ep(const CommConfig& c, const char* op);
// The call words' dtype code (calls.h) of an all_reduce dtype.
int call_dtype_of(at::ScalarType st);

// A communicator's all_reduce slot: bytes per (parity, source) inbox, one
// chunk of a larger tensor at a time (one-shot chunks fill at most one slot,
// two-shot chunks at most world_size). `requested`, or the transport's
// default when it is 0, aligned as the heap lays slots out. "dist" has no
// heap: its slot only bounds the temporaries of a chunk.
int64_t allreduce_slot_bytes(const std::string& transport, int64_t requested);

// How often a waiting rank looks whether a watched peer's process exited.
constexpr int kLivenessPeriodMs = 50;

// A peer's process on this host, as this process sees it in /proc.
struct PeerProcess {
  int rank = -1;
  int pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22: tells a reused pid apart
};

// Start time of process `pid` (clock ticks since boot), or 0 when this
// process cannot see it (it exited, or lives in another pid namespace).
uint64_t process_start_time(int pid);
// Whether the process is still the one seen at start_time (not gone, not
// replaced by a reused pid, not a zombie).
bool process_alive(const PeerProcess& p);

// One chunk of all_reduce_rmsnorm: `rows` whole rows of `hidden` elements,
// row-major and contiguous. residual is null without one; weight holds
// `hidden` elements of dtype, or of fp32 when weight_fp32.
struct RmsNormRows {
  at::ScalarType dtype;
  const char* x;
  const char* residual;
  const void* weight;
  bool weight_fp32;
  char* out;
  char* residual_out;
  int64_t rows, hidden;
  float eps;
  // Every pointer 16-byte aligned and rows whole 16-byte vectors (GPU copies
  // and sums in vectors then).
  bool vectorized;
};

class Comm {
 public:
  explicit Comm(CommConfig cfg);
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  const CommConfig& config() const { return cfg_; }
  const Layout& layout() const { return layout_; }
  const Transport& transport() const { return transport_; }

  // Bootstrap, in this order on every rank, with a group barrier between
  // connect() and finish(): export this rank's heap, open every peer's,
  // then release what only init needed and probe the links. finish()
  // returns "" or a description of the links that failed the probe.
  virtual std::string export_handle() = 0;
  virtual void connect(const std::vector<std::string>& handles) = 0;
  virtual std::string finish() = 0;

  virtual at::Device device() const = 0;
  // A fresh contiguous output on device(). Transports may allocate it more
  // cheaply than at::empty does (no dispatcher round per tensor: dispatch
  // makes seven).
  virtual at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) const;
  // Raises if an earlier op failed (e.g. timed out); ops call it on entry.
  // This one raises failure_; a transport whose failures the device
  // records (GPU) reads those after it.
  virtual void check() { TORCH_CHECK(failure_.empty(), failure_); }

  // Peers whose process this process can see (same host and pid namespace),
  // so a wait gives up as soon as one of them exits, long before the timeout.
  // Peers it cannot see are bounded by the timeout alone.
  virtual void watch_peers(const std::vector<PeerProcess>& peers);

  // The EP ops' output shapes (x_scales: an FP8 communicator's only).
  OutputShapes output_shapes(at::ScalarType idx_dtype, c10::optional<at::ScalarType> weights_dtype) const;
  RankLayoutOf<OutputSpec> dispatch_outputs(at::ScalarType idx_dtype,
                                            c10::optional<at::ScalarType> weights_dtype) const {
    return output_specs<RankLayoutOf>(output_shapes(idx_dtype, weights_dtype));
  }
  ExpertLayoutOf<OutputSpec> dispatch_expert_outputs(c10::optional<at::ScalarType> weights_dtype) const {
    return output_specs<ExpertLayoutOf>(output_shapes(at::kInt, weights_dtype));
  }
  OutputSpec combine_output() const;
  // A fresh output of `spec` for `ntok` tokens (empty()). Each output is an
  // allocation of its own: outputs of one op that share a storage (disjoint
  // views of one allocation) fail torch.library.opcheck's schema test.
  at::Tensor empty_output(const OutputSpec& spec, int64_t ntok) const;

  at::Tensor all_reduce(const at::Tensor& x);
  // x_scales: an FP8 communicator's pre-quantised input (x is then the FP8
  // q); none: x in dtype, quantised here when the communicator is FP8.
  Dispatched dispatch(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                      const c10::optional<at::Tensor>& topk_weights);
  at::Tensor combine(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                     const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round);
  // The expert layout: dispatch, then its rows grouped by local expert; and
  // combine of an expert-layout result (each received row's expert rows
  // summed in ascending expert order first).
  ExpertDispatched dispatch_expert(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                                   const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights);
  at::Tensor combine_expert(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& recv_src,
                            const at::Tensor& counts, const at::Tensor& src_tokens, const at::Tensor& send_mask,
                            const at::Tensor& dispatch_round);
  // Runs the first `most` deferred checks (defer_check) whose values have
  // landed, oldest first; they raise for a value an op computed on the
  // device that is wrong. Every op ends here (ops.cpp).
  void run_deferred_checks(size_t most = SIZE_MAX);
  size_t pending_checks() const { return deferred_.size(); }
  // comm.check(): the deferred checks, then check().
  void raise_pending();
  // (out, residual_out); see docs/semantics.md, "all_reduce_rmsnorm".
  std::pair<at::Tensor, at::Tensor> all_reduce_rmsnorm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                       const at::Tensor& weight, double eps);

  // Calls of all_reduce_rmsnorm by path (RmsNormPath), and, last, how many
  // of them kept their rows in registers (GPU transport only).
  static constexpr int kRowInRegistersCount = kNumRmsNormPaths;
  const std::array<int64_t, kNumRmsNormPaths + 1>& rmsnorm_path_counts() const { return rmsnorm_counts_; }

 protected:
  // combine_expert after its checks: each received row's pair rows of the
  // expert-layout y summed into a rank-layout y ([W*cap, H]: on the host
  // for CPU tensors, else sum_expert_rows_on_gpu), which combine_impl then
  // takes. A transport whose combine kernel sums the pair rows where it
  // reads each row overrides it.
  virtual at::Tensor combine_expert_checked(const at::Tensor& y, const at::Tensor& expert_rows_of,
                                            const at::Tensor& recv_src, const at::Tensor& counts,
                                            const at::Tensor& src_tokens, const at::Tensor& send_mask,
                                            const at::Tensor& dispatch_round);
  // Called with validated, contiguous arguments. all_reduce runs chunk by
  // chunk: n elements of dtype st (at most allreduce_chunk_elems), W > 1.
  virtual void all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t n, bool one_shot) = 0;
  // all_reduce_rmsnorm of one chunk (at most rmsnorm_chunk_rows rows), one
  // round of the all_reduce protocol.
  virtual void all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool one_stage) = 0;
  // The residual add and the norm alone, no communication: c.x holds the
  // reduced rows already (it may alias c.residual_out).
  virtual void rmsnorm_local(const RmsNormRows& c) = 0;
  // x [T, H], topk_idx [T, K] and topk_weights [T, K] in the caller's
  // dtypes; each transport writes `out` in those dtypes (the heap carries
  // weights as fp32, exact for bf16 and fp16). An FP8 communicator's x is
  // in dtype (the transport quantises it, fp8.h) or, with x_scales [T,
  // fp8_scales], FP8 already; out.x and out.x_scales receive the bytes sent.
  virtual void dispatch_impl(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                             const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights,
                             Dispatched& out) = 0;
  // dispatch_impl writes out.dispatch_round; combine_impl gets the handle's
  // and announces it (call_, below, holds the rest of the call).
  virtual void combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                            const at::Tensor& src_tokens, const at::Tensor& send_mask,
                            const at::Tensor& dispatch_round, at::Tensor& out) = 0;

  // Checks of values an op computed on the device, without a host
  // synchronisation: check(values) runs at the first run_deferred_checks()
  // after the op's stream has passed the op. `values` (int32): one
  // check_output(n), which in an eager call on a GPU is pinned host memory
  // that the op's kernels store into (no copy on the stream), or device
  // tensors, copied behind the op into pinned host memory. Not under a
  // graph capture (a replay's values land when the host does not look);
  // there check_output is device memory, which the graph keeps for its
  // replays.
  at::Tensor check_output(int64_t n) const;
  void defer_check(std::initializer_list<at::Tensor> values, std::function<void(const int32_t*)> check);
  // The deferred check of an expert-layout dispatch: `needed` ([1] int32)
  // rows must fit expert_rows.
  void check_expert_rows_later(const at::Tensor& needed);
  // dispatch_expert's rule over the received rows of d, on the host, into
  // out's layout fields and `needed` (as expert_layout_on_gpu).
  void expert_layout_on_host(const Dispatched& d, ExpertDispatched& out, const at::Tensor& needed);
  // dispatch_expert's placement of d's rows into out: on the host for CPU
  // tensors, else expert_layout_on_gpu. A transport whose dispatch can
  // leave the rows where they are (places_from_heap) reads them there
  // instead.
  virtual bool places_from_heap() const { return false; }
  virtual void place_expert_rows(const Dispatched& d, ExpertDispatched& out, const at::Tensor& needed);
  // A combine handle's tensor fields: device, dtype, contiguity, shape.
  void check_handle_fields(const char* op, const at::Tensor& recv_src, const at::Tensor& counts,
                           const at::Tensor& src_tokens, const at::Tensor& send_mask,
                           const at::Tensor& dispatch_round) const;

  // The call being run (calls.h: its fields; each round stamps its number):
  // set by the ops before their first round, read by the transports. A
  // combine's value, the round of the dispatch its handle comes from, is the
  // transport's to add (it lies in handle.dispatch_round, on the device on
  // GPUs): call_ holds 0 there.
  uint64_t call_ = 0;
  // "all_reduce(dtype=torch.float32, numel=1024)", from a call word.
  static std::string call_name(uint64_t word);
  // Rank `peer`'s word of round `round` differs from this rank's `mine`.
  std::string mismatch_message(uint64_t round, uint64_t mine, int peer, uint64_t theirs) const;
  // That mismatch's first report, a ValueError on every transport; it stays
  // in failure_ for the later calls.
  void raise_mismatch(uint64_t round, uint64_t mine, int peer, uint64_t theirs);
  // A failure reported once (a call mismatch, a timeout, a dead peer, a bad
  // handle found after its op): every later call and check() raise its
  // text as a RuntimeError.
  std::string failure_;
  // A wait of round `round` (this rank's call word `mine`) on `peer` timed
  // out; `peer_words` are the peer's two call slots in this rank's memory,
  // which tell whether it made this round's call at all.
  std::string timeout_message(int op, int peer, uint64_t round, uint64_t mine, const uint64_t peer_words[2]) const;
  // The handle is user input: every value that picks a row, a chunk or a
  // rank is checked before the first protocol step, so a bad one raises a
  // ValueError and the communicator stays usable. For handles the host can
  // read (the CPU transport, and "dist" on CPUs; "dist" on GPUs checks a
  // copy of the handle once it has landed, after the op); the GPU kernel
  // checks the same values (combine.cu) and check() reports them
  // (device_bad_handle_message).
  void check_handle_values(const int32_t* recv_src, const int32_t* counts, const int32_t* src_tokens,
                           const int32_t* send_mask, int64_t ntok) const;
  // "combine: handle.<field>[index] = value is out of range: expected ...".
  static std::string bad_handle_message(int field, int64_t index, int64_t value, const std::string& expected);
  // What a handle value must be, in words: the one table of both checks.
  // The host check knows the values around the bad one (`facts`); a word the
  // combine kernel left (encode_bad_handle) says only field, index and value.
  struct HandleFacts {
    bool host = false;
    int64_t source = -1, source_tokens = 0;  // recv_src: the row's source and its token count
    int64_t previous = -1, previous_value = 0;  // recv_src: the row before, when out of order
    int64_t tokens = -1;  // src_tokens[rank]: this rank's token count, when it differs
  };
  std::string handle_expectation(int field, int64_t index, const HandleFacts& facts) const;
  std::string device_bad_handle_message(uint64_t word) const;
  // "rdna4_comm: <message> (found on rank r of communicator 'id' <found>).
  // The communicator is unusable now: ...": a bad handle found after its
  // combine ran, which leaves the communicator failed.
  std::string bad_handle_failure(const std::string& message, const char* found) const;
  // The rank of a watched peer whose process has exited, or -1.
  int exited_peer() const;
  std::string exit_message(int peer) const;

  CommConfig cfg_;
  Layout layout_;
  const Transport& transport_;  // cfg_.transport's record
  std::vector<PeerProcess> watched_;
  std::array<int64_t, kNumRmsNormPaths + 1> rmsnorm_counts_{};

 private:
  struct DeferredCheck {
    at::Tensor host;
    c10::optional<c10::Event> landed;  // none: a CPU op wrote them
    std::function<void(const int32_t*)> check;
  };
  std::deque<DeferredCheck> deferred_;  // oldest first
  Dispatched allocate_dispatched(int64_t ntok, at::ScalarType idx_dtype,
                                 c10::optional<at::ScalarType> weights_dtype) const;
  // combine once y [W*cap, H] and the handle's fields have passed its checks.
  at::Tensor combine_checked(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                             const at::Tensor& src_tokens, const at::Tensor& send_mask,
                             const at::Tensor& dispatch_round);
  // dispatch (for the expert layout with expert_layout); with rows_stay, the
  // rows left where they are (Dispatched::peer_rows_in_heap).
  Dispatched dispatch_rows(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                           const at::Tensor& topk_idx, const c10::optional<at::Tensor>& topk_weights,
                           bool expert_layout, bool rows_stay);
  // The chunk loop of all_reduce: n elements of dtype st from in to out.
  void all_reduce_into(at::ScalarType st, const char* in, char* out, int64_t n, bool gpu);
};

void register_comm(std::shared_ptr<Comm> comm);
std::shared_ptr<Comm> find_comm(const std::string& id);  // raises when there is none
std::shared_ptr<Comm> lookup_comm(const std::string& id);  // nullptr when there is none
void remove_comm(const std::string& id);

#ifdef RDNA4_COMM_WITH_GPU
std::shared_ptr<Comm> make_gpu_comm(CommConfig cfg);  // registered by gpu/gpu_transport.cpp
// Whether the current stream of the device is capturing a graph.
bool current_stream_capturing(int device_index);
// The expert layout on the device (csrc/gpu/expert_layout.cu), on the
// current stream, over the rows received alone: out's x, x_scales,
// topk_weights, expert_counts, expert_offsets and expert_rows_of (allocated
// by the caller, in the shapes of Comm::dispatch_expert_outputs) from the
// rank-layout result d (every row in d.x), and `needed` ([1] int32) the
// rows its pairs need.
void expert_layout_on_gpu(const Dispatched& d, int64_t experts, int64_t alignment, ExpertDispatched& out,
                          const at::Tensor& needed);
// combine_expert's first half on the device: each received row's pair rows
// of y (expert_rows_of) summed into `rows` ([W*cap, H], fresh).
void sum_expert_rows_on_gpu(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& counts,
                            const at::Tensor& rows);
#endif

}  // namespace rdna4_comm
