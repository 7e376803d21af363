// Transport "dist": every op as a few fixed-size collectives of a
// torch.distributed process group (gloo for CPU tensors, NCCL/RCCL for GPU
// tensors), for ranks without working peer-to-peer memory or on several
// hosts. The results are bitwise those of the P2P transports: the same rows
// in the same order, and every sum in fp32 in ascending rank order, rounded
// once (never a backend all_reduce, whose summation order is unspecified).
//
// No op reads a device value on the host: every collective moves a
// capacity-padded buffer whose size follows from the configuration and the
// local token count, and the receivers compact rows with tensor ops. So NCCL
// ops need no host synchronisation (a NCCL Work's wait() makes the current
// stream wait), trace under torch.compile and can be captured in graphs.
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/version.h>

#include <c10/util/Exception.h>

#include <array>
#include <functional>
#include <limits>
#include <sstream>

#include "../comm.h"
#include "../flags.h"
#include "../policies.h"

namespace rdna4_comm {
namespace {

// After this much more than the communicator's timeout a gloo wait gives up
// even if the backend ignored the collective's own timeout (which it passes
// to gloo and which normally ends the collective first).
constexpr int64_t kHostWaitGraceMs = 5000;

// Per destination block of the dispatch all-to-all, after its cap rows: the
// number of rows sent and the sender's token count (int32 each, padded).
constexpr int64_t kDispatchHeaderBytes = 16;

// Element-wise sum of parts[0] + parts[1] + ... (the first dimension is the
// rank), in fp32, left to right from the first term, rounded once to `st`:
// the order every transport and rdna4_comm.reference use.
at::Tensor sum_in_rank_order(const at::Tensor& parts, at::ScalarType st) {
  at::Tensor acc = parts[0].to(at::kFloat);
  for (int64_t r = 1; r < parts.size(0); ++r) acc = acc + parts[r].to(at::kFloat);
  return acc.to(st);
}

// Bytes [offset, offset + bytes) of every row of `rows` (uint8 [..., row]),
// viewed as `st` without a copy: the protocol's row layout keeps every field
// aligned to its element size.
at::Tensor field(const at::Tensor& rows, int64_t offset, int64_t bytes, at::ScalarType st) {
  return rows.narrow(-1, offset, bytes).view(st);
}

// The FP8 rule (fp8.h) in tensor ops, for rows on any device: [T, H] of a
// float dtype -> (q [T, H] uint8 holding float8_e4m3fn bits, scales [T, S]
// fp32). The same ops as rdna4_comm.quantize_fp8, so the same bits.
std::pair<at::Tensor, at::Tensor> quantize_fp8_rows(const at::Tensor& x) {
  const int64_t T = x.size(0), H = x.size(1), S = fp8_num_scales(H);
  const at::Tensor x32 = x.to(at::kFloat);
  at::Tensor magnitude = x32.abs();
  if (S * kFp8Block != H) magnitude = at::constant_pad_nd(magnitude, {0, S * kFp8Block - H});
  const at::Tensor amax = magnitude.view({T, S, kFp8Block}).amax(-1);
  // A tensor divisor: a CUDA tensor divided by a number is multiplied by its
  // reciprocal, which is not the IEEE quotient.
  const at::Tensor scales = at::clamp_min(amax, kFp8AmaxFloor) / at::full_like(amax, kFp8Max);
  const at::Tensor block_of = at::floor_divide(at::arange(H, x.options().dtype(at::kLong)), kFp8Block);
  const at::Tensor q = (x32 / scales.index_select(1, block_of)).to(at::kFloat8_e4m3fn);
  return {q.view(at::kByte), scales};
}

class DistComm final : public Comm {
 public:
  explicit DistComm(CommConfig cfg)
      : Comm(std::move(cfg)),
        group_(c10d::resolve_process_group(cfg_.group_name)),
        device_(cfg_.device_index >= 0 ? at::Device(at::kCUDA, c10::DeviceIndex(cfg_.device_index))
                                       : at::Device(at::kCPU)) {
    TORCH_CHECK(group_->getSize() == cfg_.world && group_->getRank() == cfg_.rank, "rdna4_comm: process group '",
                cfg_.group_name, "' has rank ", group_->getRank(), " of ", group_->getSize(),
                ", the communicator expects rank ", cfg_.rank, " of ", cfg_.world);
  }

  // No heap: the group is the whole connection.
  std::string export_handle() override { return ""; }
  void connect(const std::vector<std::string>&) override {}
  std::string finish() override { return ""; }

  at::Device device() const override { return device_; }

 protected:
  // The fused op: the rows' rank-ordered sum through all_reduce_chunk, then
  // the residual add and the norm with ATen ops on the op's device (this
  // transport has no kernels of its own). Every rank computes the same
  // deterministic ops on the same sum, so out is the same on every rank.
  // The P2P kernels' one-stage/two-stage choice has no counterpart here:
  // both stages give the same bits, and the sum takes all_reduce's own
  // one-shot/two-shot choice.
  void all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool /*one_stage*/) override {
    const int64_t n = c.rows * c.hidden, elt = int64_t(c10::elementSize(c.dtype));
    all_reduce_chunk(c.dtype, c.x, c.residual_out, n, allreduce_use_one_shot(n * elt, cfg_.world, /*gpu=*/false));
    RmsNormRows summed = c;
    summed.x = c.residual_out;
    rmsnorm_local(summed);
  }

  void rmsnorm_local(const RmsNormRows& c) override {
    auto rows = [&](const void* p) { return over(p, {c.rows, c.hidden}, c.dtype); };
    at::Tensor r = rows(c.x);
    if (c.residual) r = (r.to(at::kFloat) + rows(c.residual).to(at::kFloat)).to(c.dtype);
    const at::Tensor r32 = r.to(at::kFloat);
    // rmsnorm_inv_rms's arithmetic: the squares summed in fp64, the mean
    // rounded once to fp32, then correctly rounded fp32 steps. Each step runs
    // in fp64 and is rounded to fp32, since ATen's fp32 sqrt and rsqrt are
    // not always correctly rounded (Sleef on the CPU, approximate on CUDA).
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).to(at::kDouble); };
    const at::Tensor mean = f32(r32.to(at::kDouble).pow(2).sum(-1, /*keepdim=*/true) / double(c.hidden));
    const at::Tensor inv = f32(1.0 / f32(f32(mean + double(c.eps)).sqrt()));
    const at::Tensor normed = (r32.to(at::kDouble) * inv).to(at::kFloat).to(c.dtype);
    const at::Tensor w = over(c.weight, {c.hidden}, c.weight_fp32 ? at::kFloat : c.dtype);
    rows(c.out).copy_((w.to(at::kFloat) * normed.to(at::kFloat)).to(c.dtype));
    rows(c.residual_out).copy_(r);
  }

  // One-shot: an all-gather of every input, then each rank sums all W in
  // rank order. Two-shot: an all-to-all of the shares (rank o owns elements
  // [o*q, min((o+1)*q, m)), allreduce_share), each rank sums its share's W
  // parts in rank order, then an all-gather of the sums. Both give the bits
  // of the P2P transports' paths of the same name.
  void all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t m, bool one_shot) override {
    const int W = cfg_.world;
    const auto opts = at::TensorOptions().device(device_).dtype(st);
    at::Tensor input = over(in, {m}, st);
    at::Tensor output = over(out, {m}, st);
    const uint64_t gen = begin_round(kOpAllReduce, call_);
    if (one_shot) {
      at::Tensor inputs = at::empty({W, m}, opts);
      all_gather(kOpAllReduce, gen, inputs, input);
      output.copy_(sum_in_rank_order(inputs, st));
      return;
    }
    const int64_t q = allreduce_share(m, W, int64_t(c10::elementSize(st)));
    at::Tensor shares = at::zeros({W, q}, opts);  // the tail past m sums zeros and is dropped
    shares.view({-1}).narrow(0, 0, m).copy_(input);
    at::Tensor parts = at::empty({W, q}, opts);
    all_to_all(kOpAllReduce, gen, parts, shares);
    at::Tensor mine = sum_in_rank_order(parts, st);
    at::Tensor sums = at::empty({W, q}, opts);
    all_gather(kOpAllReduce, gen, sums, mine);
    output.copy_(sums.view({-1}).narrow(0, 0, m));
  }

  // Each rank packs, per destination d, a block of cap rows in the
  // protocol's row layout (payload, local expert ids, fp32 weights, source
  // token), its rows first in token order, plus a header (row count, T).
  // One all-to-all of [W, block] bytes; the receiver compacts the rows by
  // source rank, then source token, into the fixed [W*cap] outputs.
  void dispatch_impl(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                     const c10::optional<at::Tensor>& topk_weights, Dispatched& out) override {
    const int W = cfg_.world;
    const int64_t T = x.size(0), K = cfg_.topk, cap = cfg_.cap, H = cfg_.hidden, epr = cfg_.experts_per_rank();
    const auto i64 = at::TensorOptions().device(device_).dtype(at::kLong);
    const uint64_t gen = begin_round(kOpDispatch, call_);
    out.dispatch_round.fill_(int64_t(round_));

    // Routing (expert_owner): the owner of every slot, -1 when dropped.
    const at::Tensor& ids = topk_idx;  // int32 or int64: the ops below take either
    const at::Tensor owner =
        at::where((ids >= 0) & (ids < cfg_.num_experts), at::floor_divide(ids, epr), at::full_like(ids, -1));
    const at::Tensor ranks = at::arange(W, i64);
    const at::Tensor hits = (owner.unsqueeze(-1) == ranks).any(1);  // [T, W]: token t goes to rank d
    const at::Tensor bits = at::bitwise_left_shift(at::ones_like(ranks), ranks);
    out.send_mask.copy_((hits.to(at::kLong) * bits).sum(1).to(at::kInt));
    const at::Tensor sent = hits.sum(0);  // [W] rows per destination

    // Slot (d, j) holds the j-th token sent to d; empty slots name token T,
    // an appended row of zeros (and routing -1, weight 0).
    const at::Tensor slot = at::where(hits, ranks * cap + hits.cumsum(0) - 1, at::full_like(ranks, W * cap));
    at::Tensor token_of = at::full({W * cap + 1}, T, i64);  // + 1: where tokens not sent land
    token_of.scatter_(0, slot.flatten(), at::arange(T, i64).unsqueeze(1).expand({T, W}).flatten());
    token_of = token_of.narrow(0, 0, W * cap);
    auto with_pad_row = [&](const at::Tensor& t, const at::Scalar& pad) {
      return at::cat({t, at::full({1, t.size(1)}, pad, t.options())}).index_select(0, token_of).view({W, cap, -1});
    };
    const at::Tensor slot_ids = with_pad_row(ids, -1), slot_owner = with_pad_row(owner, -1);
    const at::Tensor here = slot_owner == ranks.view({W, 1, 1});  // slot k's expert lives on d

    const int64_t rs = int64_t(layout_.row_stride), ps = int64_t(layout_.dispatch_payload);
    const int64_t S = layout_.fp8_scales, so = int64_t(layout_.scales_offset);
    const int64_t block = cap * rs + kDispatchHeaderBytes;
    at::Tensor send = at::empty({W, block}, i64.dtype(at::kByte));
    at::Tensor rows = send.narrow(1, 0, cap * rs).view({W, cap, rs});
    if (S > 0) {  // FP8: the q bytes and the scales, as given or quantised here
      const auto [q, scales] = x_scales ? std::make_pair(x.view(at::kByte), *x_scales) : quantize_fp8_rows(x);
      field(rows, 0, H, at::kByte).copy_(with_pad_row(q, 0));
      field(rows, so, 4 * S, at::kFloat).copy_(with_pad_row(scales, 0));
    } else {
      field(rows, 0, H * cfg_.elt, cfg_.dtype).copy_(with_pad_row(x, 0));
    }
    field(rows, ps, 4 * K, at::kInt).copy_(at::where(here, slot_ids - ranks.view({W, 1, 1}) * epr, -1));
    field(rows, ps + 4 * K, 4 * K, at::kFloat)
        .copy_(topk_weights ? at::where(here, with_pad_row(*topk_weights, 0), 0.f) : at::zeros({W, cap, K}, i64.dtype(at::kFloat)));
    field(rows, ps + 8 * K, 4, at::kInt).copy_(token_of.view({W, cap, 1}));
    at::Tensor header = field(send, cap * rs, kDispatchHeaderBytes, at::kInt);  // [W, 4]
    header.select(1, 0).copy_(sent);
    header.select(1, 1).fill_(T);
    header.narrow(1, 2, 2).zero_();

    at::Tensor recv = at::empty_like(send);
    all_to_all(kOpDispatch, gen, recv, send);

    const at::Tensor recv_header = field(recv, cap * rs, kDispatchHeaderBytes, at::kInt);
    out.counts.copy_(recv_header.select(1, 0));
    out.src_tokens.copy_(recv_header.select(1, 1));
    // Output row i is row j of source s, where the sources' counts before s
    // sum to at most i; rows past the total are padding.
    const at::Tensor ends = out.counts.to(at::kLong).cumsum(0);
    const at::Tensor i = at::arange(W * cap, i64);
    const at::Tensor src = at::searchsorted(ends, i, /*out_int32=*/false, /*right=*/true).clamp_max(W - 1);
    const at::Tensor valid = i < ends[W - 1];
    const at::Tensor j = i - (ends.index_select(0, src) - out.counts.to(at::kLong).index_select(0, src));
    c10::List<std::optional<at::Tensor>> source_row;
    source_row.push_back(src);
    source_row.push_back(at::where(valid, j, 0));
    const at::Tensor picked = recv.narrow(1, 0, cap * rs).view({W, cap, rs}).index(source_row);  // [W*cap, rs]
    const at::Tensor valid_col = valid.unsqueeze(1);
    // Padding rows: unspecified.
    if (S > 0) {
      out.x.view(at::kByte).copy_(field(picked, 0, H, at::kByte));
      out.x_scales.copy_(field(picked, so, 4 * S, at::kFloat));
    } else {
      out.x.copy_(field(picked, 0, H * cfg_.elt, cfg_.dtype));
    }
    out.topk_idx.copy_(at::where(valid_col, field(picked, ps, 4 * K, at::kInt), -1));
    if (topk_weights) out.topk_weights.copy_(at::where(valid_col, field(picked, ps + 4 * K, 4 * K, at::kFloat), 0.f));
    out.recv_src.copy_(at::where(valid, src * cap + field(picked, ps + 8 * K, 4, at::kInt).squeeze(1), -1));
  }

  // The reverse all-to-all: each received row goes back to its source, at
  // the slot of its source token ([W source][cap] rows of H); then every
  // source sums its tokens' rows over their destinations (send_mask bits),
  // ascending, in fp32 from the first term, rounded once.
  // A handle on the CPU is checked first, by the CPU transport's checker
  // (a ValueError before the exchange: the peers wait for the repeated
  // call). On a GPU, reading it would synchronise every combine: it is
  // copied to pinned host memory behind the op instead (defer_check), and
  // checked by the same checker once the copy has landed. A bad one then
  // fails the communicator, as on the GPU transport: the peers complete
  // this combine and this rank raises at the end of its next op or at
  // comm.check(). Combines captured in a graph are not checked: a replay's
  // copy would land when the host does not look.
  void combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                    const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round,
                    at::Tensor& out) override {
    const int W = cfg_.world;
    const int64_t cap = cfg_.cap, H = cfg_.hidden, T = send_mask.size(0);
    if (!y.is_cuda())
      check_handle_values(recv_src.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), src_tokens.data_ptr<int32_t>(),
                          send_mask.data_ptr<int32_t>(), T);
    else
      defer_check({recv_src, counts, src_tokens, send_mask}, [this, T](const int32_t* p) {
        const int64_t rows = int64_t(cfg_.world) * cfg_.cap;
        try {
          check_handle_values(p, p + rows, p + rows + cfg_.world, p + rows + 2 * cfg_.world, T);
        } catch (const c10::ValueError& e) {
          failure_ = bad_handle_failure(e.what_without_backtrace(),
                                        "after that combine ran, which read nothing outside the exchanged buffers");
          check();
        }
      });
    // The handle's dispatch round is needed on the host only where the calls are checked.
    const uint64_t gen = begin_round(
        kOpCombine, cfg_.dist_check_calls ? combine_call(call_flags(call_) & 1, uint64_t(dispatch_round.item<int64_t>()))
                                          : call_);
    // Padding rows (and, on a GPU, any value outside [0, W*cap) of a forged
    // handle) land in an extra slot that is never sent.
    const at::Tensor slot_of = recv_src.to(at::kLong);
    const at::Tensor slot = at::where((slot_of >= 0) & (slot_of < W * cap), slot_of, W * cap);
    at::Tensor send = at::empty({W * cap + 1, H}, y.options());
    c10::List<std::optional<at::Tensor>> rows_of_y;
    rows_of_y.push_back(slot);
    send.index_put_(rows_of_y, y);
    send = send.narrow(0, 0, W * cap).view({W, cap, H});
    at::Tensor recv = at::empty_like(send);
    all_to_all(kOpCombine, gen, recv, send);

    const at::Tensor mask = send_mask.to(at::kLong);
    at::Tensor acc = at::zeros({T, H}, y.options().dtype(at::kFloat));  // tokens routed nowhere stay +0
    at::Tensor started = at::zeros({T, 1}, mask.options().dtype(at::kBool));
    for (int r = 0; r < W; ++r) {
      const at::Tensor from_r = mask.bitwise_and(int64_t(1) << r).ne(0).unsqueeze(1);
      const at::Tensor part = recv[r].narrow(0, 0, T).to(at::kFloat);
      acc = at::where(from_r, at::where(started, acc + part, part), acc);
      started = started | from_r;
    }
    out.copy_(acc.to(cfg_.dtype));
  }

 private:
  uint64_t next_generation(int op) { return ++generations_[op]; }

  // A tensor over an op's memory on this rank's device, which is given, not
  // looked up from the pointer: an empty tensor's pointer is null, and
  // CUDA's lookup refuses that.
  at::Tensor over(const void* p, at::IntArrayRef sizes, at::ScalarType st) const {
    return at::for_blob(const_cast<void*>(p), sizes)
        .options(at::TensorOptions().device(device_).dtype(st))
        .target_device(device_)
        .make_tensor();
  }

  // A round's start: its generation of op sequence `op` and, with
  // dist_check_calls, an all-gather of the ranks' call words (calls.h),
  // compared before the round's own collectives: a rank whose call differs
  // raises here, on every rank, instead of entering a collective its peers
  // do not (gloo then waits out its timeout). Off by default: a collective
  // more per round, and on GPUs a host synchronisation (docs/transports.md).
  uint64_t begin_round(int op, uint64_t fields) {
    round_ = next_round(generations_[kOpAllReduce], generations_[kOpDispatch], generations_[kOpCombine]);
    const uint64_t gen = next_generation(op);
    if (!cfg_.dist_check_calls) return gen;
    const uint64_t word = call_word(fields, round_);
    at::Tensor mine = at::full({1}, int64_t(word), at::TensorOptions().device(device_).dtype(at::kLong));
    at::Tensor every = at::empty({cfg_.world, 1}, mine.options());
    all_gather(op, gen, every, mine);
    const at::Tensor words = every.cpu();
    for (int r = 0; r < cfg_.world; ++r) {
      const uint64_t theirs = uint64_t(words.data_ptr<int64_t>()[r]);
      if (theirs != word) {
        raise_mismatch(round_, word, r, theirs);
      }
    }
    return gen;
  }

  void all_to_all(int op, uint64_t gen, at::Tensor& recv, at::Tensor& send) {
    std::vector<int64_t> equal_splits;
    c10d::AllToAllOptions opts;
    opts.timeout = std::chrono::milliseconds(cfg_.timeout_ms);
    // torch 2.13 renamed alltoall_base (deprecated since) to all_to_all_single.
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
    run(op, gen, "all_to_all_single", [&] { return group_->all_to_all_single(recv, send, equal_splits, equal_splits, opts); });
#else
    run(op, gen, "all_to_all_single", [&] { return group_->alltoall_base(recv, send, equal_splits, equal_splits, opts); });
#endif
  }

  // gathered: [W, ...mine's shape], contiguous.
  void all_gather(int op, uint64_t gen, const at::Tensor& gathered, at::Tensor& mine) {
    c10d::AllgatherOptions opts;
    opts.timeout = std::chrono::milliseconds(cfg_.timeout_ms);
    at::Tensor flat = gathered.view({-1});  // gloo splits the output by the input's shape
    // torch 2.13 renamed _allgather_base (deprecated since) to all_gather_single.
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
    run(op, gen, "all_gather_single", [&] { return group_->all_gather_single(flat, mine, opts); });
#else
    run(op, gen, "all_gather_single", [&] { return group_->_allgather_base(flat, mine, opts); });
#endif
  }

  // Starts a collective and waits for it. The collective carries the
  // communicator's timeout, which gloo and NCCL enforce themselves. A gloo
  // wait blocks the host (CPU tensors); a NCCL wait only makes the current
  // stream wait, so it takes no host-side bound (one would block the host).
  void run(int op, uint64_t gen, const char* collective, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
#ifdef RDNA4_COMM_WITH_GPU
    // gloo synchronises the stream of a CUDA tensor on the host, which a
    // capture forbids (and which would invalidate it): refuse before that.
    TORCH_CHECK_VALUE(!(device_.is_cuda() && group_->getBackendType() == c10d::ProcessGroup::BackendType::GLOO &&
                        current_stream_capturing(device_.index())),
                      op_name(op), ": transport 'dist' runs over gloo here (ranks share a GPU, which NCCL refuses), "
                      "and gloo cannot be captured in a CUDA graph: run it eagerly, or capture with one GPU per rank "
                      "(NCCL) or transport 'gpu'");
#endif
    try {
      auto work = start();
      if (device_.is_cpu())
        work->wait(std::chrono::milliseconds(cfg_.timeout_ms + kHostWaitGraceMs));
      else
        work->wait();
    } catch (const std::exception& e) {
      std::ostringstream s;
      s << "rdna4_comm: " << op_name(op) << " on rank " << cfg_.rank << " of communicator '" << cfg_.id
        << "' timed out or failed in torch.distributed " << collective << " (generation " << gen << ", bound "
        << cfg_.timeout_ms << " ms): a peer never made the matching call, died or lost its connection. "
        << "The communicator is unusable now: close it and create a new one (timeout_ms or "
           "RDNA4_COMM_TIMEOUT_MS sets the bound). "
        << collective << " said: " << e.what();
      failure_ = s.str();
    }
    check();
  }


  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device device_;
  std::array<uint64_t, kNumOps> generations_{};
  uint64_t round_ = 0;  // the round being run (calls.h)
};

}  // namespace

namespace {
std::shared_ptr<Comm> make_dist_comm(CommConfig cfg) { return std::make_shared<DistComm>(std::move(cfg)); }
// Captured on GPUs with NCCL/RCCL; over gloo (ranks sharing a GPU) a
// capture is refused (DistComm::run).
RDNA4_COMM_REGISTER_TRANSPORT("dist", /*built=*/true, /*device_kernels=*/false, /*writes_cross_links=*/false, /*process_group=*/true,
                              /*device_tensors=*/true, /*graph_capture=*/true, kMaxWorld,
                              std::numeric_limits<int64_t>::max(), /*default_slot_bytes=*/int64_t(16) << 20,
                              make_dist_comm);
}  // namespace

}  // namespace rdna4_comm
