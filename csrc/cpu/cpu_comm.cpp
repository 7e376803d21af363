// The CPU transport's shared-memory segments, all_reduce and
// all_reduce_rmsnorm, and the rounds and waits every op runs (cpu_comm.h).
#include "cpu_comm.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "../bounds.h"
#include "../calls.h"
#include "../flags.h"
#include "cpu_arith.h"

namespace rdna4_comm {
namespace cpu {
namespace {

using Clock = std::chrono::steady_clock;

// The "multiprocessor count" the CPU sizes all_reduce with (allreduce_blocks):
// shares of more than 32 KiB run as several pieces, each with its own flag
// slot, as on a small GPU. Every rank runs this binary, so all agree.
constexpr int kCpuMultiprocessors = 8;

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

}  // namespace

CpuComm::CpuComm(CommConfig cfg) : Comm(std::move(cfg)) {
  bytes_ = layout_.signal_bytes + layout_.data_bytes;
  bases_.assign(cfg_.world, nullptr);
}

CpuComm::~CpuComm() {
  for (char* b : bases_)
    if (b) munmap(b, bytes_);
  if (!unlinked_ && !name_.empty()) shm_unlink(name_.c_str());
}

std::string CpuComm::export_handle() {
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

void CpuComm::connect(const std::vector<std::string>& names) {
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
std::string CpuComm::finish() {
  shm_unlink(name_.c_str());
  unlinked_ = true;
  return "";
}

// all_reduce, as the GPU runs it: rank o owns share o (allreduce_shares),
// cut into allreduce_blocks pieces, and piece b flags slot b. This thread
// runs the GPU grid's blocks one after another, in block order on every
// rank: piece b waits only for the peers' piece b, which each publishes
// before any wait of its own piece b.
void CpuComm::all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t m, bool one_shot) {
  const int elt = int(c10::elementSize(st));
  const AllReduceShares share = allreduce_shares(m, cfg_.world, elt, one_shot);
  const int blocks = allreduce_blocks(share.q * elt, kCpuMultiprocessors);
  auto piece = [&](int o, int b, int64_t* e0, int64_t* e1) { allreduce_piece(share.size(o), elt, b, blocks, e0, e1); };
  exchange(kOpAllReduce, st, in, out, share, blocks, piece, [](int64_t, int64_t) {}, {out});
}

// The shares are whole rows: one-stage, every rank finishes the whole
// chunk; two-stage, owner o finishes its shard and hands out both outputs.
// Pieces are rows, as the GPU kernel's blocks take them.
void CpuComm::all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool one_stage) {
  const int64_t H = c.hidden;
  const AllReduceShares rows = rmsnorm_shards(c.rows, cfg_.world, one_stage);
  const int blocks = rmsnorm_blocks(rows.q, kCpuMultiprocessors);
  const int64_t row_bytes = H * int64_t(c10::elementSize(c.dtype));
  auto piece = [&](int o, int b, int64_t* e0, int64_t* e1) {
    rmsnorm_piece(rows.size(o), b, blocks, e0, e1);
    *e0 *= H;
    *e1 *= H;
  };
  auto finish = [&](int64_t e0, int64_t n) {
    RmsNormRows mine = c;
    const int64_t skip = e0 / H * row_bytes;
    mine.x = c.residual_out + skip;  // the sum of these rows
    if (mine.residual) mine.residual += skip;
    mine.out += skip;
    mine.residual_out += skip;
    mine.rows = n / H;
    rmsnorm_local(mine);
  };
  exchange(kOpAllReduceRmsNorm, c.dtype, c.x, c.residual_out, {rows.n * H, rows.q * H, one_stage}, blocks, piece,
           finish, {c.out, c.residual_out});
}

void CpuComm::rmsnorm_local(const RmsNormRows& c) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.dtype, "rdna4_comm_rmsnorm", [&] {
    if (c.weight_fp32)
      rmsnorm_rows<scalar_t, float>(c);
    else
      rmsnorm_rows<scalar_t, scalar_t>(c);
  });
}

template <typename Piece, typename Finish>
void CpuComm::exchange(int op, at::ScalarType st, const char* in, char* sum, const AllReduceShares& sh, int blocks,
                       Piece piece, Finish finish, std::initializer_list<char*> outputs) {
  const int W = cfg_.world, me = cfg_.rank;
  const int64_t elt = int64_t(c10::elementSize(st));
  const uint64_t gen = begin_round(kAllReduceSequence, call_);
  std::vector<const char*> srcs(W);
  for (int b = 0; b < blocks; ++b) {
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      int64_t e0, e1;
      piece(p, b, &e0, &e1);
      if (e1 > e0)
        std::memcpy(layout_.ar_slot(data(p), gen, me) + e0 * elt, in + (sh.begin(p) + e0) * elt,
                    size_t((e1 - e0) * elt));
      store_release(layout_.ar_flag(signals(p), gen, 0, me, b), gen);
    }
    int64_t e0, e1;
    piece(me, b, &e0, &e1);
    for (int r = 0; r < W; ++r) {
      if (r == me) {
        srcs[r] = in + (sh.begin(me) + e0) * elt;
        continue;
      }
      wait_at_least(layout_.ar_flag(signals(me), gen, 0, r, b), gen, op, r);
      srcs[r] = layout_.ar_slot(data(me), gen, r) + e0 * elt;
    }
    if (e1 > e0) {
      sum_in_order(st, sum + (sh.begin(me) + e0) * elt, srcs, e1 - e0);
      finish(sh.begin(me) + e0, e1 - e0);
    }
    if (sh.one_shot) continue;
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      int64_t k = 0;
      for (const char* o : outputs)
        std::memcpy(layout_.ar_gather_slot(data(p), gen, me) + (k++ * sh.q + e0) * elt,
                    o + (sh.begin(me) + e0) * elt, size_t((e1 - e0) * elt));
      store_release(layout_.ar_flag(signals(p), gen, 1, me, b), gen);
    }
    for (int o = 0; o < W; ++o) {
      if (o == me) continue;
      wait_at_least(layout_.ar_flag(signals(me), gen, 1, o, b), gen, op, o);
      int64_t f0, f1;
      piece(o, b, &f0, &f1);
      int64_t k = 0;
      for (char* dst : outputs)
        std::memcpy(dst + (sh.begin(o) + f0) * elt, layout_.ar_gather_slot(data(me), gen, o) + (k++ * sh.q + f0) * elt,
                    size_t((f1 - f0) * elt));
    }
  }
  finish_op(kAllReduceSequence, gen);
}

uint64_t CpuComm::begin_round(int op, uint64_t fields) {
  char* own = signals(cfg_.rank);
  round_ = next_round(*layout_.counter(own, kAllReduceSequence), *layout_.counter(own, kOpDispatch),
                      *layout_.counter(own, kOpCombine));
  word_ = call_word(fields, round_);
  for (int r = 0; r < cfg_.world; ++r) store_release(layout_.call_slot(signals(r), round_, cfg_.rank), word_);
  return op_generation(op);
}

void CpuComm::check_call_of(int peer) {
  const uint64_t theirs = load_acquire(layout_.call_slot(signals(cfg_.rank), round_, peer));
  if (call_of_round(theirs, round_) && theirs != word_) {
    raise_mismatch(round_, word_, peer, theirs);
  }
}

void CpuComm::wait_at_least(const uint64_t* flag, uint64_t gen, int op, int peer) {
  if (load_acquire(flag) >= gen) return check_call_of(peer);
  const auto start = Clock::now();
  const auto limit = std::chrono::milliseconds(cfg_.timeout_ms);
  auto next_liveness_check = start + std::chrono::milliseconds(kLivenessPeriodMs);
  while (load_acquire(flag) < gen) {
    check_call_of(peer);
    const auto now = Clock::now();
    const auto waited = now - start;
    if (waited > limit) {
      char* own = signals(cfg_.rank);
      const uint64_t words[2] = {load_acquire(layout_.call_slot(own, 0, peer)),
                                 load_acquire(layout_.call_slot(own, 1, peer))};
      failure_ = timeout_message(op, peer, round_, word_, words);
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
  check_call_of(peer);
}

}  // namespace cpu

namespace {
std::shared_ptr<Comm> make_cpu_comm(CommConfig cfg) { return std::make_shared<cpu::CpuComm>(std::move(cfg)); }
RDNA4_COMM_REGISTER_TRANSPORT("cpu", /*built=*/true, /*device_kernels=*/false, /*writes_cross_links=*/false,
                              /*process_group=*/false, /*device_tensors=*/false, /*graph_capture=*/false, kMaxWorld,
                              std::numeric_limits<int64_t>::max(), /*default_slot_bytes=*/int64_t(1) << 20,
                              make_cpu_comm);
}  // namespace

}  // namespace rdna4_comm
