// GPU transport, host side: the peer-mapped symmetric heap (allocation, IPC
// export/import, peer access, the init-time P2P probe) and the torch glue
// that launches the kernels (csrc/gpu/*.cu, interface kernels.h) on the
// current stream.
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "../bounds.h"
#include "../comm.h"
#include "../error_words.h"
#include "../flags.h"
#include "../policies.h"
#include "export_record.h"
#include "kernels.h"
#include "runtime.h"

namespace rdna4_comm {
namespace {

using namespace gpu;

#define RC_GPU_CHECK(expr)                                                                   \
  do {                                                                                       \
    const ::rdna4_comm::gpu::Error rc_err_ = (expr);                                         \
    TORCH_CHECK(rc_err_ == ::rdna4_comm::gpu::kSuccess, "rdna4_comm: ", #expr, " failed: ", \
                ::rdna4_comm::gpu::error_string(rc_err_));                                   \
  } while (0)

int sm_count_of(int device_index) {
  int n = 0;
  RC_GPU_CHECK(multiprocessor_count(&n, device_index));
  return n;
}

// The kernels' dtype of a tensor the ops' checks let through.
DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default: TORCH_CHECK(false, "rdna4_comm: the GPU kernels take no ", dtype_name(t), " values");
  }
}

// The placement's arguments for the rank-layout result d, every row in
// d.x (GpuComm::place_expert_rows then points the peers' rows at its heap
// and this rank's at dispatch's input where they stayed there),
// and its scratch: per (chunk, expert) a bitmask and a prefix
// (expert_layout.cu), to be held until the kernels are launched.
// tally_done: a word that is zero between placements, or nullptr for one
// of the scratch, zeroed for this call.
struct ExpertPlacement {
  ExpertLayoutArgs args;
  at::Tensor scratch;
};
ExpertPlacement expert_placement(const Dispatched& d, int64_t experts, int64_t alignment, ExpertDispatched& out,
                                 const at::Tensor& needed, int sm_count, uint32_t* tally_done) {
  const int64_t R = d.topk_idx.size(0), K = d.topk_idx.size(1);
  ExpertLayoutArgs a{};
  // Only the tally uses the scratch, and only where it is launched: rows
  // that fit one chunk are tallied in shared memory.
  at::Tensor scratch;
  if (expert_tally_launched(R, experts)) {
    const int64_t tables = expert_chunks(R) * experts;
    scratch = at::empty({2 * tables + 1}, d.counts.options());
    a.chunk_masks = reinterpret_cast<uint32_t*>(scratch.data_ptr<int32_t>());
    a.chunk_prefix = scratch.data_ptr<int32_t>() + tables;
    if (!tally_done) {
      scratch.narrow(0, 2 * tables, 1).zero_();
      tally_done = reinterpret_cast<uint32_t*>(scratch.data_ptr<int32_t>() + 2 * tables);
    }
    a.tally_done = tally_done;
  }
  a.ids = d.topk_idx.data_ptr();
  a.ids_int64 = d.topk_idx.scalar_type() == at::kLong;
  a.weights = d.topk_weights.numel() > 0 ? d.topk_weights.data_ptr() : nullptr;
  a.weights_dtype = dtype_of(d.topk_weights.scalar_type());
  a.x = static_cast<const char*>(d.x.data_ptr());
  a.scales = d.x_scales.defined() ? d.x_scales.data_ptr<float>() : nullptr;
  a.counts = d.counts.data_ptr<int32_t>();
  a.world = int(d.counts.size(0));
  a.rows = R;
  a.topk = K;
  a.experts = experts;
  a.alignment = alignment;
  a.expert_rows = out.x.size(0);
  a.row_bytes = d.x.size(1) * int64_t(d.x.element_size());
  a.scales_per_row = d.x_scales.defined() ? d.x_scales.size(1) : 0;
  a.sm_count = sm_count;
  a.out_x = static_cast<char*>(out.x.data_ptr());
  a.out_scales = out.x_scales.defined() ? out.x_scales.data_ptr<float>() : nullptr;
  a.out_weights = a.weights ? out.topk_weights.data_ptr() : nullptr;
  a.out_counts = out.expert_counts.data_ptr<int32_t>();
  a.out_offsets = out.expert_offsets.data_ptr<int32_t>();
  a.out_rows_of = out.expert_rows_of.data_ptr<int32_t>();
  // Device memory, or pinned host memory (Comm::check_output) that the kernels store into.
  void* needed_at = needed.data_ptr();
  if (needed.is_cpu()) RC_GPU_CHECK(host_device_pointer(&needed_at, needed.data_ptr()));
  a.out_needed = static_cast<int32_t*>(needed_at);
  return {a, std::move(scratch)};
}

class GpuComm final : public Comm {
 public:
  explicit GpuComm(CommConfig cfg) : Comm(std::move(cfg)) {
    // Communicator validated the configuration; Env's arrays depend on this.
    TORCH_INTERNAL_ASSERT(cfg_.world <= kMaxGpuWorld && cfg_.device_index >= 0 && cfg_.cap <= kMaxGpuTokensPerRank);
    env_.layout = layout_;
    env_.rank = cfg_.rank;
    env_.world = cfg_.world;
  }

  ~GpuComm() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> g(watchdog_mutex_);
        stop_watchdog_ = true;
      }
      watchdog_wake_.notify_all();
      watchdog_.join();
    }
    // Ops were drained by Communicator.close(); errors here cannot be raised.
    c10::cuda::CUDAGuard guard(cfg_.device_index);
    for (int r = 0; r < cfg_.world; ++r) {
      if (r == cfg_.rank) continue;
      if (env_.sig[r]) (void)ipc_close_handle(env_.sig[r]);
      if (env_.data[r]) (void)ipc_close_handle(env_.data[r]);
    }
    if (env_.sig[cfg_.rank]) (void)free_device(env_.sig[cfg_.rank]);
    if (env_.data[cfg_.rank]) (void)free_device(env_.data[cfg_.rank]);
    if (error_host_) (void)free_host(error_host_);
    if (probe_result_) (void)free_device(probe_result_);
    if (last_launch_) (void)event_destroy(last_launch_);
  }

  std::string export_handle() override {
    c10::cuda::CUDAGuard guard(cfg_.device_index);
    const int dev = cfg_.device_index;
    RC_GPU_CHECK(multiprocessor_count(&env_.sm_count, dev));
    uint64_t ticks_per_ms = 0;
    RC_GPU_CHECK(timer_ticks_per_ms(&ticks_per_ms, dev));
    env_.timeout_ticks = uint64_t(cfg_.timeout_ms) * ticks_per_ms;

    // Whole allocations, never sub-allocations: an imported handle opens at
    // its allocation's base. Each is at least kMinGpuAllocation.
    void* sig = nullptr;
    void* data = nullptr;
    const size_t sig_bytes = std::max(layout_.signal_bytes, kMinGpuAllocation);
    const size_t data_bytes = std::max(layout_.data_bytes, kMinGpuAllocation);
    RC_GPU_CHECK(malloc_signals(&sig, sig_bytes));
    env_.sig[cfg_.rank] = static_cast<char*>(sig);
    RC_GPU_CHECK(malloc_data(&data, data_bytes));
    env_.data[cfg_.rank] = static_cast<char*>(data);
    // Counters and flags start at generation 0.
    RC_GPU_CHECK(memset_device(sig, 0, sig_bytes));

    void* host = nullptr;
    RC_GPU_CHECK(host_alloc_mapped(&host, sizeof(uint64_t)));
    error_host_ = static_cast<uint64_t*>(host);
    *error_host_ = 0;
    void* dev_view = nullptr;
    RC_GPU_CHECK(host_device_pointer(&dev_view, host));
    env_.error = static_cast<uint64_t*>(dev_view);
    void* probe = nullptr;
    RC_GPU_CHECK(malloc_data(&probe, sizeof(int32_t) * kMaxGpuWorld));
    probe_result_ = static_cast<int32_t*>(probe);
    RC_GPU_CHECK(event_create(&last_launch_));
    RC_GPU_CHECK(device_synchronize());

    ExportRecord rec{};
    RC_GPU_CHECK(ipc_get_handle(&rec.signals, sig));
    RC_GPU_CHECK(ipc_get_handle(&rec.data, data));
    RC_GPU_CHECK(pci_bus_id(rec.pci_bus_id, sizeof(rec.pci_bus_id), dev));
    return std::string(reinterpret_cast<const char*>(&rec), sizeof(rec));
  }

  void connect(const std::vector<std::string>& handles) override {
    c10::cuda::CUDAGuard guard(cfg_.device_index);
    TORCH_CHECK(int(handles.size()) == cfg_.world, "rdna4_comm: expected ", cfg_.world, " heap handles, got ",
                handles.size());
    for (int r = 0; r < cfg_.world; ++r) {
      if (r == cfg_.rank) continue;
      TORCH_CHECK(handles[r].size() == sizeof(ExportRecord), "rdna4_comm: malformed heap handle from rank ", r);
      ExportRecord rec;
      std::memcpy(&rec, handles[r].data(), sizeof(rec));
      enable_peer(r, rec.pci_bus_id);
      void* sig = nullptr;
      void* data = nullptr;
      RC_GPU_CHECK(ipc_open_handle(&sig, rec.signals));
      env_.sig[r] = static_cast<char*>(sig);
      RC_GPU_CHECK(ipc_open_handle(&data, rec.data));
      env_.data[r] = static_cast<char*>(data);
    }
  }

  // Every peer writes a pattern through the real mapping and flag protocol;
  // this rank verifies what arrived. Returns "" or what failed, per pair.
  std::string finish() override {
    c10::cuda::CUDAGuard guard(cfg_.device_index);
    if (cfg_.world == 1) return "";
    launch_probe(env_, probe_result_, c10::cuda::getCurrentCUDAStream(cfg_.device_index).stream());
    RC_GPU_CHECK(get_last_error());
    RC_GPU_CHECK(device_synchronize());
    int32_t bad[kMaxGpuWorld] = {};
    RC_GPU_CHECK(memcpy_to_host(bad, probe_result_, sizeof(bad)));
    std::ostringstream problems;
    for (int s = 0; s < cfg_.world; ++s) {
      if (s == cfg_.rank) continue;
      if (bad[s] < 0)
        problems << "rank " << s << " -> rank " << cfg_.rank << ": the probe flag never arrived within "
                 << cfg_.timeout_ms << " ms (peer writes are not reaching this GPU; check ACS/IOMMU); ";
      else if (bad[s] > 0)
        problems << "rank " << s << " -> rank " << cfg_.rank << ": " << bad[s] << " of " << kProbeBytes / 4
                 << " probe words arrived wrong (peer writes are corrupted or dropped); ";
    }
    *error_host_ = 0;  // a probe timeout is reported above, not at the next op
    return problems.str();
  }

  at::Device device() const override { return at::Device(at::kCUDA, c10::DeviceIndex(cfg_.device_index)); }

  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) const override {
    return at::detail::empty_cuda(sizes, dtype, device(), c10::nullopt);
  }

  void check() override {
    Comm::check();
    const uint64_t word = __atomic_load_n(error_host_, __ATOMIC_ACQUIRE);
    if (word == 0) return;
    TORCH_CHECK(error_cause(word) != kErrorPeerExited, exit_message(error_peer(word)));
    TORCH_CHECK(error_cause(word) != kErrorBadHandle, device_bad_handle_message(word));
    // The call words the kernels left in this rank's signal memory (the
    // failed op has ended: its kernel records the word before it exits).
    const int peer = error_peer(word);
    const uint64_t round = error_round(word);
    char* own = env_.sig[cfg_.rank];
    if (error_cause(word) == kErrorCallMismatch) {
      uint64_t words[2] = {};
      RC_GPU_CHECK(memcpy_to_host(words, layout_.mismatch(own, peer), sizeof(words)));
      raise_mismatch(round, words[0], peer, words[1]);
    }
    uint64_t mine = 0, theirs[2] = {};
    RC_GPU_CHECK(memcpy_to_host(&mine, layout_.call_slot(own, round, cfg_.rank), sizeof(mine)));
    for (int parity = 0; parity < 2; ++parity)
      RC_GPU_CHECK(memcpy_to_host(&theirs[parity], layout_.call_slot(own, parity, peer), sizeof(uint64_t)));
    TORCH_CHECK(false, timeout_message(error_cause(word), peer, round, mine, theirs));
  }

  // Kernels cannot see a peer's process, so a host thread watches it: when
  // one exits, the thread leaves the abort word that every spin polls, and
  // waiting kernels stop within a poll instead of at the timeout.
  void watch_peers(const std::vector<PeerProcess>& peers) override {
    Comm::watch_peers(peers);
    if (watched_.empty() || watchdog_.joinable()) return;
    watchdog_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(watchdog_mutex_);
      while (!watchdog_wake_.wait_for(lock, std::chrono::milliseconds(kLivenessPeriodMs),
                                      [this] { return stop_watchdog_; })) {
        if (__atomic_load_n(error_host_, __ATOMIC_ACQUIRE) != 0) continue;
        const int gone = exited_peer();
        if (gone >= 0) __atomic_store_n(error_host_, encode_peer_exit(gone), __ATOMIC_RELEASE);
      }
    });
  }

 protected:
  void all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t n, bool one_shot) override {
    in_stream_order(
        [&](Stream s) { launch_all_reduce(env_, AllReduceArgs{in, out, n, dtype_of(st), one_shot, call_}, s); });
  }

  void all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool one_stage) override { launch_rmsnorm(c, one_stage, false); }

  void rmsnorm_local(const RmsNormRows& c) override { launch_rmsnorm(c, true, true); }

  void dispatch_impl(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                     const c10::optional<at::Tensor>& topk_weights, Dispatched& out) override {
    DispatchArgs a{};
    a.x = x.data_ptr();
    a.fp8_pair = x_scales.has_value();
    // What an FP8 layout quantises; a pair's q is moved as bytes, of no dtype the kernels read.
    a.x_dtype = a.fp8_pair ? DType::kF32 : dtype_of(x.scalar_type());
    a.x_scales = x_scales ? x_scales->data_ptr<float>() : nullptr;
    a.out_scales = out.x_scales.defined() ? out.x_scales.data_ptr<float>() : nullptr;
    a.fp8_vectors =
        cfg_.fp8() && cfg_.hidden % kFp8Block == 0 && aligned16(x.data_ptr()) && aligned16(out.x.data_ptr());
    a.topk_idx = topk_idx.data_ptr();
    a.idx_is_int64 = topk_idx.scalar_type() == at::kLong;
    a.topk_weights = topk_weights ? topk_weights->data_ptr() : nullptr;
    a.weights_dtype = dtype_of(topk_weights ? topk_weights->scalar_type() : at::kFloat);
    a.ntok = x.size(0);
    a.num_experts = cfg_.num_experts;
    a.out_x = out.x.data_ptr();
    a.peer_rows_stay = out.peer_rows_in_heap;
    a.own_rows_stay = out.own_rows.defined();
    a.out_idx = out.topk_idx.data_ptr();
    a.out_weights = topk_weights ? out.topk_weights.data_ptr() : nullptr;
    a.out_counts = out.counts.data_ptr<int32_t>();
    a.out_recv_src = out.recv_src.data_ptr<int32_t>();
    a.out_src_tokens = out.src_tokens.data_ptr<int32_t>();
    a.out_send_mask = out.send_mask.data_ptr<int32_t>();
    a.out_dispatch_round = out.dispatch_round.data_ptr<int64_t>();
    a.call = call_;
    in_stream_order([&](Stream s) { launch_dispatch(env_, a, s); });
  }

  void combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                    const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round,
                    at::Tensor& out) override {
    launch_combine_of(y, nullptr, recv_src, counts, src_tokens, send_mask, dispatch_round, out);
  }

  // The combine kernel sums an expert layout's pair rows itself: no
  // [W*cap, H] of sums written and read back, and no kernel for them.
  at::Tensor combine_expert_checked(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& recv_src,
                                    const at::Tensor& counts, const at::Tensor& src_tokens,
                                    const at::Tensor& send_mask, const at::Tensor& dispatch_round) override {
    at::Tensor out = empty_output(combine_output(), send_mask.size(0));
    launch_combine_of(y, &expert_rows_of, recv_src, counts, src_tokens, send_mask, dispatch_round, out);
    return out;
  }

  void launch_combine_of(const at::Tensor& y, const at::Tensor* expert_rows_of, const at::Tensor& recv_src,
                         const at::Tensor& counts, const at::Tensor& src_tokens, const at::Tensor& send_mask,
                         const at::Tensor& dispatch_round, at::Tensor& out) {
    CombineArgs a{};
    a.dispatch_round = dispatch_round.data_ptr<int64_t>();
    a.expert_layout = call_flags(call_) & 1;
    a.y = y.data_ptr();
    a.rows_of = expert_rows_of ? expert_rows_of->data_ptr<int32_t>() : nullptr;
    a.topk = expert_rows_of ? expert_rows_of->size(1) : 0;
    a.expert_rows = y.size(0);
    a.recv_src = recv_src.data_ptr<int32_t>();
    a.counts = counts.data_ptr<int32_t>();
    a.src_tokens = src_tokens.data_ptr<int32_t>();
    a.send_mask = send_mask.data_ptr<int32_t>();
    a.ntok = send_mask.size(0);
    a.dtype = dtype_of(cfg_.dtype);
    a.out = out.data_ptr();
    in_stream_order([&](Stream s) { launch_combine(env_, a, s); });
  }

  // The expert layout reads the peers' rows in the heap, where this rank's
  // dispatch left them (DispatchArgs::peer_rows_stay), and this rank's own
  // in the caller's x where they are its bytes (own_rows_stay): one pass
  // over the payload. The placement is launched in the communicator's
  // stream order, so the next dispatch, whose peers may overwrite this
  // parity of the heap two dispatches on, starts after it on any stream.
  bool places_from_heap() const override { return true; }
  void place_expert_rows(const Dispatched& d, ExpertDispatched& out, const at::Tensor& needed) override {
    TORCH_INTERNAL_ASSERT(d.peer_rows_in_heap, "place_expert_rows: the dispatch copied the peers' rows out of the heap");
    // The heap's word: this communicator's placements run one after another.
    ExpertPlacement p = expert_placement(d, cfg_.experts_per_rank(), cfg_.expert_alignment, out, needed,
                                         env_.sm_count, layout_.expert_tally_done(env_.sig[cfg_.rank]));
    p.args.heap_gen = layout_.counter(env_.sig[cfg_.rank], kOpDispatch, 0);
    p.args.heap = layout_;
    p.args.heap_data = env_.data[cfg_.rank];
    p.args.rank = cfg_.rank;
    if (d.own_rows.defined()) {
      p.args.own_x = static_cast<const char*>(d.own_rows.data_ptr());
      p.args.own_scales = d.own_scales.defined() ? d.own_scales.data_ptr<float>() : nullptr;
      p.args.own_tokens = d.own_rows.size(0);
      p.args.recv_src = d.recv_src.data_ptr<int32_t>();
    }
    in_stream_order([&](Stream s) { launch_expert_layout(p.args, s); });
  }

 private:
  // Stream order. A kernel's blocks read their generation at start and store
  // it back at their end (device/sync.cuh), so a kernel of this communicator
  // may start only once the one before it, on whatever stream, has finished.
  // Launches on one stream are ordered by the stream itself, so event work is
  // done only where that does not hold:
  //  - on a stream change, the new stream waits for last_launch_, recorded
  //    after the previous launch (if it was not, it is recorded now on the
  //    previous stream: that covers the previous launch, and perhaps later
  //    work there too, which only adds a wait);
  //  - once a launch was captured, replays of that graph run when the host
  //    does not see it, on any stream: every launch then records
  //    last_launch_ after it and waits for it before, and under capture the
  //    record and the wait are external graph nodes, so a replay waits for
  //    the launch before it and the launch after a replay waits for the replay.
  template <typename Launch>
  void in_stream_order(Launch&& launch) {
    c10::cuda::CUDAGuard guard(cfg_.device_index);
    const Stream s = c10::cuda::getCurrentCUDAStream(cfg_.device_index).stream();
    bool capturing = false;
    RC_GPU_CHECK(stream_is_capturing(s, &capturing));
    ever_captured_ = ever_captured_ || capturing;
    if (launched_ && (s != last_stream_ || ever_captured_)) {
      if (!recorded_) RC_GPU_CHECK(event_record(last_launch_, last_stream_, false));
      RC_GPU_CHECK(stream_wait_event(s, last_launch_, capturing));
    }
    launch(s);
    RC_GPU_CHECK(get_last_error());
    recorded_ = ever_captured_;
    if (recorded_) RC_GPU_CHECK(event_record(last_launch_, s, capturing));
    launched_ = true;
    last_stream_ = s;
  }

  void launch_rmsnorm(const RmsNormRows& c, bool one_stage, bool local) {
    AllReduceRmsNormArgs a{};
    a.x = c.x;
    a.residual = c.residual;
    a.weight = c.weight;
    a.weight_fp32 = c.weight_fp32;
    a.out = c.out;
    a.residual_out = c.residual_out;
    a.rows = c.rows;
    a.hidden = c.hidden;
    a.eps = c.eps;
    a.dtype = dtype_of(c.dtype);
    a.vectorized = c.vectorized;
    a.one_stage = one_stage;
    a.local = local;
    a.call = call_;
    in_stream_order([&](Stream s) { launch_all_reduce_rmsnorm(env_, a, s); });
  }

  // Peer access for the peer's device as this process numbers it (IPC opens
  // with lazy peer access too, for ranks that see only their own GPU).
  // "Already enabled" is success; it leaves a sticky error, cleared here.
  void enable_peer(int r, const char* bus_id) {
    int peer_dev = -1;
    if (device_by_pci_bus_id(&peer_dev, bus_id) != kSuccess || peer_dev == cfg_.device_index) {
      (void)get_last_error();
      return;
    }
    int can = 0;
    RC_GPU_CHECK(can_access_peer(&can, cfg_.device_index, peer_dev));
    TORCH_CHECK(can, "rdna4_comm: GPU ", cfg_.device_index, " (rank ", cfg_.rank, ") cannot access GPU ", peer_dev,
                " (rank ", r, ", PCI ", bus_id, ") as a peer; peer-to-peer is disabled on this platform");
    const Error e = enable_peer_access(peer_dev);
    (void)get_last_error();
    TORCH_CHECK(e == kSuccess || e == kPeerAccessAlreadyEnabled, "rdna4_comm: enabling peer access from GPU ",
                cfg_.device_index, " to GPU ", peer_dev, " failed: ", error_string(e));
  }

  Env env_;
  uint64_t* error_host_ = nullptr;
  int32_t* probe_result_ = nullptr;
  Event last_launch_ = nullptr;
  bool launched_ = false;
  Stream last_stream_ = nullptr;  // of the last launch, once launched_
  bool recorded_ = false;         // last_launch_ was recorded after the last launch
  bool ever_captured_ = false;
  std::thread watchdog_;
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_wake_;
  bool stop_watchdog_ = false;
};

}  // namespace

std::shared_ptr<Comm> make_gpu_comm(CommConfig cfg) { return std::make_shared<GpuComm>(std::move(cfg)); }

namespace gpu {
void raise_not_resident(const char* op, int blocks, int per_sm, int sm_count) {
  TORCH_CHECK(false, "rdna4_comm: ", op, " launches ", blocks, " blocks whose blocks wait on each other, but this GPU ",
              "holds only ", per_sm, " of them per multiprocessor x ", sm_count,
              " multiprocessors at once: every block must be resident (the launch policy in csrc/policies.h)");
}
}  // namespace gpu

bool current_stream_capturing(int device_index) {
  bool capturing = false;
  RC_GPU_CHECK(gpu::stream_is_capturing(c10::cuda::getCurrentCUDAStream(device_index).stream(), &capturing));
  return capturing;
}

void expert_layout_on_gpu(const Dispatched& d, int64_t experts, int64_t alignment, ExpertDispatched& out,
                          const at::Tensor& needed) {
  const int dev = d.x.get_device();
  c10::cuda::CUDAGuard guard(dev);
  const ExpertPlacement p = expert_placement(d, experts, alignment, out, needed, sm_count_of(dev), nullptr);
  launch_expert_layout(p.args, c10::cuda::getCurrentCUDAStream(dev).stream());
  RC_GPU_CHECK(get_last_error());
}

void sum_expert_rows_on_gpu(const at::Tensor& y, const at::Tensor& expert_rows_of, const at::Tensor& counts,
                            const at::Tensor& rows) {
  const int dev = y.get_device();
  c10::cuda::CUDAGuard guard(dev);
  ExpertSumArgs a{};
  a.y = y.data_ptr();
  a.rows_of = expert_rows_of.data_ptr<int32_t>();
  a.counts = counts.data_ptr<int32_t>();
  a.world = int(counts.size(0));
  a.rows = rows.size(0);
  a.topk = expert_rows_of.size(1);
  a.expert_rows = y.size(0);
  a.hidden = y.size(1);
  a.dtype = dtype_of(y.scalar_type());
  a.sm_count = sm_count_of(dev);
  a.out = rows.data_ptr();
  launch_expert_sum(a, c10::cuda::getCurrentCUDAStream(dev).stream());
  RC_GPU_CHECK(get_last_error());
}

}  // namespace rdna4_comm
