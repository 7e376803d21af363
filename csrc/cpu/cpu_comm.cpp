// CPU transport: the processes of one host share one POSIX shared-memory
// segment per rank. It runs the same protocol as the GPU kernels (push into
// the reader's segment, single-writer flags, release/acquire, generation
// parity), so every property of the protocol is exercised without a GPU.
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <initializer_list>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "../comm.h"

namespace rdna4_comm {
namespace {

using Clock = std::chrono::steady_clock;

void store_release(uint64_t* flag, uint64_t v) { __atomic_store_n(flag, v, __ATOMIC_RELEASE); }
uint64_t load_acquire(const uint64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

std::string unique_segment_name() {
  static std::atomic<uint64_t> serial{0};
  std::random_device rd;
  std::ostringstream s;
  s << "/rdna4_comm." << getpid() << "." << serial++ << "." << std::hex << rd() << rd();
  return s.str();
}

char* map_segment(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(p != MAP_FAILED, "rdna4_comm: mmap of shared-memory segment ", name, " (", bytes,
              " bytes) failed: ", std::strerror(errno));
  return static_cast<char*>(p);
}

// Element-wise fp32 sum of `srcs` in the given (rank) order, rounded once.
template <typename T>
void sum_rows(T* out, const std::vector<const char*>& srcs, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = float(reinterpret_cast<const T*>(srcs[0])[i]);
    for (size_t r = 1; r < srcs.size(); ++r) acc += float(reinterpret_cast<const T*>(srcs[r])[i]);
    out[i] = T(acc);
  }
}

void sum_in_order(at::ScalarType st, char* out, const std::vector<const char*>& srcs, int64_t n) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "rdna4_comm_sum", [&] {
    sum_rows<scalar_t>(reinterpret_cast<scalar_t*>(out), srcs, n);
  });
}

// The residual add and the norm of rows whose all_reduce sum is c.x, in the
// op's roundings (docs/semantics.md): r = round(s + residual); out =
// round(w * round(r * inv_rms)). The sum of squares runs over kLanes strided
// partial sums combined pairwise, a fixed order (bitwise equal results on
// every rank and run) that stays close to torch's pairwise mean.
template <typename T, typename W>
void rmsnorm_rows(const RmsNormRows& c) {
  constexpr int kLanes = 16;
  const int64_t H = c.hidden;
  const W* w = static_cast<const W*>(c.weight);
  for (int64_t row = 0; row < c.rows; ++row) {
    const T* s = reinterpret_cast<const T*>(c.x) + row * H;
    const T* res = c.residual ? reinterpret_cast<const T*>(c.residual) + row * H : nullptr;
    T* r = reinterpret_cast<T*>(c.residual_out) + row * H;
    T* out = reinterpret_cast<T*>(c.out) + row * H;
    float lanes[kLanes] = {};
    for (int64_t i = 0; i < H; ++i) {
      const T v = res ? T(float(s[i]) + float(res[i])) : s[i];
      r[i] = v;
      lanes[i % kLanes] += float(v) * float(v);
    }
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    const float inv = rmsnorm_inv_rms(lanes[0], H, c.eps);
    for (int64_t i = 0; i < H; ++i) out[i] = T(float(w[i]) * float(T(float(r[i]) * inv)));
  }
}

class CpuComm final : public Comm {
 public:
  explicit CpuComm(CommConfig cfg) : Comm(std::move(cfg)) {
    bytes_ = layout_.signal_bytes + layout_.data_bytes;
    bases_.assign(cfg_.world, nullptr);
  }

  ~CpuComm() override {
    for (char* b : bases_)
      if (b) munmap(b, bytes_);
    if (!unlinked_ && !name_.empty()) shm_unlink(name_.c_str());
  }

  std::string export_handle() override {
    name_ = unique_segment_name();
    int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "rdna4_comm: shm_open(", name_, ") failed: ", std::strerror(errno));
    if (ftruncate(fd, off_t(bytes_)) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(name_.c_str());
      TORCH_CHECK(false, "rdna4_comm: cannot size shared-memory segment ", name_, " to ", bytes_,
                  " bytes: ", std::strerror(e), " (is /dev/shm large enough?)");
    }
    bases_[cfg_.rank] = map_segment(fd, bytes_, name_);
    close(fd);
    return name_;
  }

  void connect(const std::vector<std::string>& names) override {
    TORCH_CHECK(int(names.size()) == cfg_.world, "rdna4_comm: expected ", cfg_.world,
                " peer handles, got ", names.size());
    for (int r = 0; r < cfg_.world; ++r) {
      if (r == cfg_.rank) continue;
      int fd = shm_open(names[r].c_str(), O_RDWR, 0);
      TORCH_CHECK(fd >= 0, "rdna4_comm: rank ", cfg_.rank, " cannot open rank ", r,
                  "'s shared-memory segment ", names[r], ": ", std::strerror(errno),
                  " (the CPU transport needs every rank on one host)");
      bases_[r] = map_segment(fd, bytes_, names[r]);
      close(fd);
    }
  }

  // Every peer has mapped the segment (the caller ran a barrier): the name
  // can go, so nothing is left in /dev/shm even if a rank is killed later.
  std::string finish() override {
    shm_unlink(name_.c_str());
    unlinked_ = true;
    return "";
  }

  at::Device device() const override { return at::Device(at::kCPU); }

  void check() override {
    TORCH_CHECK(failure_.empty(), failure_);
  }

 protected:
  void all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t m, bool one_shot) override {
    exchange(kOpAllReduce, st, in, out, allreduce_shares(m, cfg_.world, int64_t(c10::elementSize(st)), one_shot),
             [](int64_t, int64_t) {}, {out});
  }

  // The shares are whole rows: one-stage, every rank finishes the whole
  // chunk; two-stage, owner o finishes its shard and hands out both outputs.
  void all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool one_stage) override {
    const int64_t H = c.hidden;
    const AllReduceShares rows = rmsnorm_shards(c.rows, cfg_.world, one_stage);
    const int64_t row_bytes = H * int64_t(c10::elementSize(c.dtype));
    auto finish = [&](int64_t e0, int64_t n) {
      RmsNormRows mine = c;
      const int64_t skip = e0 / H * row_bytes;
      mine.x = c.residual_out + skip;  // the sum of this rank's share
      if (mine.residual) mine.residual += skip;
      mine.out += skip;
      mine.residual_out += skip;
      mine.rows = n / H;
      rmsnorm_local(mine);
    };
    exchange(kOpAllReduceRmsNorm, c.dtype, c.x, c.residual_out, {rows.n * H, rows.q * H, one_stage}, finish,
             {c.out, c.residual_out});
  }

  void rmsnorm_local(const RmsNormRows& c) override {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.dtype, "rdna4_comm_rmsnorm", [&] {
      if (c.weight_fp32)
        rmsnorm_rows<scalar_t, float>(c);
      else
        rmsnorm_rows<scalar_t, scalar_t>(c);
    });
  }

  void dispatch_impl(const at::Tensor& x, const at::Tensor& topk_idx,
                     const c10::optional<at::Tensor>& topk_weights, Dispatched& out) override {
    const int W = cfg_.world, me = cfg_.rank;
    const int64_t T = x.size(0), K = cfg_.topk, cap = cfg_.cap;
    const int64_t payload = cfg_.hidden * int64_t(c10::elementSize(cfg_.dtype));
    const at::Tensor ids = topk_idx.to(at::kLong);
    const int64_t* idp = ids.data_ptr<int64_t>();
    const float* wp = topk_weights ? topk_weights->data_ptr<float>() : nullptr;
    const char* xp = static_cast<const char*>(x.data_ptr());
    int32_t* mask_out = out.send_mask.data_ptr<int32_t>();
    const uint64_t gen = next_generation(kOpDispatch);

    // Send: one row per (token, destination rank), in token order.
    std::vector<uint32_t> rows_to(W, 0);
    for (int64_t t = 0; t < T; ++t) {
      uint32_t mask = 0;
      for (int64_t k = 0; k < K; ++k) {
        int owner = expert_owner(idp[t * K + k], cfg_.num_experts, cfg_.experts_per_rank());
        if (owner >= 0) mask |= 1u << owner;
      }
      mask_out[t] = int32_t(mask);
      for (int d = 0; d < W; ++d) {
        if (!(mask >> d & 1u)) continue;
        char* row = layout_.dispatch_row(data(d), gen, me, rows_to[d]++);
        std::memcpy(row, xp + t * payload, size_t(payload));
        int32_t* rid = layout_.row_ids(row);
        float* rw = layout_.row_weights(row);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = idp[t * K + k];
          const bool here = expert_owner(e, cfg_.num_experts, cfg_.experts_per_rank()) == d;
          rid[k] = here ? int32_t(e - d * cfg_.experts_per_rank()) : -1;
          rw[k] = here && wp ? wp[t * K + k] : 0.f;
        }
        *layout_.row_token(row) = int32_t(t);
      }
    }
    for (int d = 0; d < W; ++d) {
      HeadSlot* head = layout_.dispatch_head(signals(d), gen, me);
      head->ntok = uint32_t(T);
      head->nrows = rows_to[d];
      store_release(&head->gen, gen);
    }

    // Receive: compact the sources' rows in rank order.
    char* rx = static_cast<char*>(out.x.data_ptr());
    int32_t* rid_out = out.topk_idx.data_ptr<int32_t>();
    // With T = 0 the weights may be given yet have no storage: test the optional.
    float* rw_out = topk_weights ? out.topk_weights.data_ptr<float>() : nullptr;
    int32_t* src_out = out.recv_src.data_ptr<int32_t>();
    int32_t* counts = out.counts.data_ptr<int32_t>();
    int32_t* src_tokens = out.src_tokens.data_ptr<int32_t>();
    int64_t row_out = 0;
    for (int s = 0; s < W; ++s) {
      HeadSlot* head = layout_.dispatch_head(signals(me), gen, s);
      wait_at_least(&head->gen, gen, kOpDispatch, s);
      counts[s] = int32_t(head->nrows);
      src_tokens[s] = int32_t(head->ntok);
      for (uint32_t j = 0; j < head->nrows; ++j, ++row_out) {
        char* row = layout_.dispatch_row(data(me), gen, s, j);
        std::memcpy(rx + row_out * payload, row, size_t(payload));
        std::memcpy(rid_out + row_out * K, layout_.row_ids(row), size_t(K) * 4);
        if (rw_out) std::memcpy(rw_out + row_out * K, layout_.row_weights(row), size_t(K) * 4);
        src_out[row_out] = int32_t(s * cap + *layout_.row_token(row));
      }
    }
    const int64_t rows = int64_t(W) * cap;
    std::memset(rx + row_out * payload, 0, size_t((rows - row_out) * payload));
    std::fill(rid_out + row_out * K, rid_out + rows * K, -1);
    if (rw_out) std::fill(rw_out + row_out * K, rw_out + rows * K, 0.f);
    std::fill(src_out + row_out, src_out + rows, -1);
  }

  void combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                    const at::Tensor& src_tokens, const at::Tensor& send_mask,
                    at::Tensor& out) override {
    const int W = cfg_.world, me = cfg_.rank;
    const int64_t cap = cfg_.cap, H = cfg_.hidden, T = send_mask.size(0);
    const int64_t payload = H * int64_t(c10::elementSize(cfg_.dtype));
    const int32_t* src = recv_src.data_ptr<int32_t>();
    const int32_t* cnt = counts.data_ptr<int32_t>();
    const int32_t* ntok = src_tokens.data_ptr<int32_t>();
    const int32_t* mask = send_mask.data_ptr<int32_t>();
    const char* yp = static_cast<const char*>(y.data_ptr());
    // A handle is trusted data, but a forged one must not write out of bounds.
    for (int s = 0; s < W; ++s)
      TORCH_CHECK_VALUE(cnt[s] >= 0 && cnt[s] <= cap && ntok[s] >= 0 && ntok[s] <= cap,
                        "combine: handle.counts/src_tokens hold values outside [0, ", cap,
                        "]: the handle is not from this communicator's dispatch");
    TORCH_CHECK_VALUE(ntok[me] == T, "combine: handle.send_mask has ", T, " tokens but handle.src_tokens says ",
                      ntok[me], ": the handle is not from this communicator's dispatch");
    for (int s = 0, j = 0; s < W; ++s)
      for (int32_t k = 0; k < cnt[s]; ++k, ++j)
        TORCH_CHECK_VALUE(src[j] >= s * cap && src[j] < s * cap + ntok[s], "combine: handle.recv_src[", j,
                          "] = ", src[j], " is not a token of source rank ", s, " (expected [", s * cap, ", ",
                          s * cap + ntok[s], "))");
    const uint64_t gen = next_generation(kOpCombine);

    int64_t row = 0;
    for (int s = 0; s < W; ++s) {
      for (int32_t j = 0; j < cnt[s]; ++j, ++row)
        std::memcpy(layout_.combine_row(data(s), gen, me, src[row] - s * cap), yp + row * payload,
                    size_t(payload));
      store_release(layout_.combine_flag(signals(s), gen, me, 0), gen);
    }
    for (int r = 0; r < W; ++r) wait_at_least(layout_.combine_flag(signals(me), gen, r, 0), gen, kOpCombine, r);

    char* o = static_cast<char*>(out.data_ptr());
    std::vector<const char*> parts;
    for (int64_t t = 0; t < T; ++t) {
      parts.clear();
      for (int r = 0; r < W; ++r)
        if (uint32_t(mask[t]) >> r & 1u) parts.push_back(layout_.combine_row(data(me), gen, r, t));
      if (parts.empty())
        std::memset(o + t * payload, 0, size_t(payload));
      else
        sum_in_order(cfg_.dtype, o + t * payload, parts, H);
    }
  }

 private:
  // One round of the all_reduce protocol over a chunk cut into `sh` (elements
  // of st), ops all_reduce and all_reduce_rmsnorm alike (one generation
  // sequence, protocol.h): push every owner its share of `in`, sum this
  // rank's share over the ranks into `sum` at its offset, call
  // finish(begin, size) on that share, and then, unless one-shot, hand this
  // rank's share of each of `outputs` to every peer (output k at k * q in the
  // gather slot) and collect theirs.
  template <typename Finish>
  void exchange(int op, at::ScalarType st, const char* in, char* sum, const AllReduceShares& sh, Finish finish,
                std::initializer_list<char*> outputs) {
    const int W = cfg_.world, me = cfg_.rank;
    const int64_t elt = int64_t(c10::elementSize(st));
    const uint64_t gen = next_generation(kAllReduceSequence);
    for (int o = 0; o < W; ++o) {
      if (o == me) continue;
      std::memcpy(layout_.ar_slot(data(o), gen, me), in + sh.begin(o) * elt, size_t(sh.size(o) * elt));
      store_release(layout_.ar_flag(signals(o), gen, 0, me, 0), gen);
    }
    std::vector<const char*> srcs(W);
    for (int r = 0; r < W; ++r) {
      if (r == me) {
        srcs[r] = in + sh.begin(me) * elt;
        continue;
      }
      wait_at_least(layout_.ar_flag(signals(me), gen, 0, r, 0), gen, op, r);
      srcs[r] = layout_.ar_slot(data(me), gen, r);
    }
    sum_in_order(st, sum + sh.begin(me) * elt, srcs, sh.size(me));
    finish(sh.begin(me), sh.size(me));
    if (sh.one_shot) return;
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      int64_t k = 0;
      for (char* o : outputs)
        std::memcpy(layout_.ar_gather_slot(data(p), gen, me) + k++ * sh.q * elt, o + sh.begin(me) * elt,
                    size_t(sh.size(me) * elt));
      store_release(layout_.ar_flag(signals(p), gen, 1, me, 0), gen);
    }
    for (int o = 0; o < W; ++o) {
      if (o == me) continue;
      wait_at_least(layout_.ar_flag(signals(me), gen, 1, o, 0), gen, op, o);
      int64_t k = 0;
      for (char* dst : outputs)
        std::memcpy(dst + sh.begin(o) * elt, layout_.ar_gather_slot(data(me), gen, o) + k++ * sh.q * elt,
                    size_t(sh.size(o) * elt));
    }
  }

  char* signals(int r) const { return bases_[r]; }
  char* data(int r) const { return bases_[r] + layout_.signal_bytes; }

  // The counter lives in this rank's own segment and only this rank writes it.
  uint64_t next_generation(int op) {
    uint64_t* c = layout_.counter(signals(cfg_.rank), op);
    const uint64_t gen = *c + 1;
    *c = gen;
    return gen;
  }

  // Bounded wait that yields the core: tests run 4 ranks on 2 cores.
  void wait_at_least(const uint64_t* flag, uint64_t gen, int op, int peer) {
    if (load_acquire(flag) >= gen) return;
    const auto start = Clock::now();
    const auto limit = std::chrono::milliseconds(cfg_.timeout_ms);
    auto next_liveness_check = start + std::chrono::milliseconds(kLivenessPeriodMs);
    while (load_acquire(flag) < gen) {
      const auto now = Clock::now();
      const auto waited = now - start;
      if (waited > limit) {
        failure_ = timeout_message(op, peer, gen);
        TORCH_CHECK(false, failure_);
      }
      if (now >= next_liveness_check) {
        next_liveness_check = now + std::chrono::milliseconds(kLivenessPeriodMs);
        if (const int gone = exited_peer(); gone >= 0) {
          failure_ = exit_message(gone);
          TORCH_CHECK(false, failure_);
        }
      }
      if (waited < std::chrono::milliseconds(2))
        sched_yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  size_t bytes_ = 0;
  std::string name_;
  bool unlinked_ = false;
  std::vector<char*> bases_;
  std::string failure_;
};

}  // namespace

std::shared_ptr<Comm> make_cpu_comm(CommConfig cfg) { return std::make_shared<CpuComm>(std::move(cfg)); }

}  // namespace rdna4_comm
