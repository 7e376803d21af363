// CPU transport: the processes of one host share one POSIX shared-memory
// segment per rank. Each op runs the GPU kernels' protocol on the calling
// thread: the same heap layout and flag slots (per-chunk dispatch slots,
// per-chunk combine flags, per-block all_reduce flags), generation parity and
// counting, single-writer flags published with release and polled with
// acquire, and the same own-row path, so every property of the protocol is
// exercised without a GPU. docs/protocol.md lists what still differs.
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <initializer_list>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../comm.h"
#include "../flags.h"
#include "../policies.h"
#include "../routing.h"
#include "cpu_arith.h"

namespace rdna4_comm {
namespace {

using Clock = std::chrono::steady_clock;
using cpu::rmsnorm_rows;
using cpu::sum_in_order;

// The "multiprocessor count" the CPU sizes all_reduce with (allreduce_blocks):
// shares of more than 32 KiB run as several pieces, each with its own flag
// slot, as on a small GPU. Every rank runs this binary, so all agree.
constexpr int kCpuMultiprocessors = 8;

// Publication and observation between the processes, through the shared
// mapping: the payload and slot metadata are plain stores before a release
// store of the generation; a reader's acquire load that sees it makes them
// visible to the reader's later loads.
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
  // all_reduce, as the GPU runs it: rank o owns share o (allreduce_shares),
  // cut into allreduce_blocks pieces, and piece b flags slot b. This thread
  // runs the GPU grid's blocks one after another, in block order on every
  // rank: piece b waits only for the peers' piece b, which each publishes
  // before any wait of its own piece b.
  void all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t m, bool one_shot) override {
    const int elt = int(c10::elementSize(st));
    const AllReduceShares share = allreduce_shares(m, cfg_.world, elt, one_shot);
    const int blocks = allreduce_blocks(share.q * elt, kCpuMultiprocessors);
    auto piece = [&](int o, int b, int64_t* e0, int64_t* e1) { allreduce_piece(share.size(o), elt, b, blocks, e0, e1); };
    exchange(kOpAllReduce, st, in, out, share, blocks, piece, [](int64_t, int64_t) {}, {out});
  }

  // The shares are whole rows: one-stage, every rank finishes the whole
  // chunk; two-stage, owner o finishes its shard and hands out both outputs.
  // Pieces are rows, as the GPU kernel's blocks take them.
  void all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool one_stage) override {
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

  void rmsnorm_local(const RmsNormRows& c) override {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.dtype, "rdna4_comm_rmsnorm", [&] {
      if (c.weight_fp32)
        rmsnorm_rows<scalar_t, float>(c);
      else
        rmsnorm_rows<scalar_t, scalar_t>(c);
    });
  }

  // dispatch, as the GPU's sender and receiver blocks run it: one header per
  // destination, rows pushed chunk by chunk (ep_chunk_tokens) with one
  // ChunkSlot per (destination, chunk), empty chunks included; this rank's
  // own rows go straight from x to the output; the receiver takes the peers'
  // chunks in chunk-major order. Everything is published before the first
  // wait, so no rank waits for a peer that waits for it. Ids and weights are
  // read and written in the caller's dtypes.
  void dispatch_impl(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                     const c10::optional<at::Tensor>& topk_weights, Dispatched& out) override {
    const float* scales = x_scales ? x_scales->data_ptr<float>() : nullptr;  // nullptr when T = 0
    const bool pair = x_scales.has_value();
    AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "rdna4_comm_dispatch_ids", [&] {
      using IdxT = index_t;
      if (!topk_weights) return dispatch_typed<IdxT, float>(x, pair, scales, topk_idx.data_ptr<IdxT>(), nullptr, out);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, topk_weights->scalar_type(),
                                      "rdna4_comm_dispatch_weights", [&] {
        dispatch_typed<IdxT, scalar_t>(x, pair, scales, topk_idx.data_ptr<IdxT>(), topk_weights->data_ptr<scalar_t>(),
                                       out);
      });
    });
  }

  // combine, as the GPU's blocks run it: every row received from a peer goes
  // back to that peer's inbox, chunk by chunk of the peer's tokens, each
  // (destination, chunk) flagged, empty chunks included; this rank's own
  // contributions are read straight from y. All flags are published before
  // the first wait.
  void combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                    const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round,
                    at::Tensor& out) override {
    const int W = cfg_.world, me = cfg_.rank;
    const int64_t cap = cfg_.cap, H = cfg_.hidden, T = send_mask.size(0);
    const int64_t payload = H * int64_t(c10::elementSize(cfg_.dtype));
    const int32_t* src = recv_src.data_ptr<int32_t>();
    const int32_t* cnt = counts.data_ptr<int32_t>();
    const int32_t* ntok = src_tokens.data_ptr<int32_t>();
    const int32_t* mask = send_mask.data_ptr<int32_t>();
    const char* yp = static_cast<const char*>(y.data_ptr());
    check_handle_values(src, cnt, ntok, mask, T);
    const uint64_t gen =
        begin_round(kOpCombine, combine_call(call_flags(call_) & 1, uint64_t(*dispatch_round.data_ptr<int64_t>())));
    std::vector<int64_t> offset(W + 1, 0);
    for (int s = 0; s < W; ++s) offset[s + 1] = offset[s] + cnt[s];

    // Send: source s's rows lie in token order, so chunk c of its tokens is
    // the next run of rows.
    for (int s = 0; s < W; ++s) {
      if (s == me) continue;
      const int64_t Cs = ep_chunk_tokens(ntok[s]), base = int64_t(s) * cap;
      int64_t j = offset[s];
      for (int64_t c = 0; c < ep_num_chunks(ntok[s]); ++c) {
        for (; j < offset[s + 1] && src[j] - base < (c + 1) * Cs; ++j)
          std::memcpy(layout_.combine_row(data(s), gen, me, src[j] - base), yp + j * payload, size_t(payload));
        store_release(layout_.combine_flag(signals(s), gen, me, c), gen);
      }
    }

    // Receive: the row of y that holds this rank's own contribution to each
    // token (row 0 until mapped, as on the GPU: a handle whose send_mask and
    // recv_src disagree reads a wrong row of y, never memory outside it).
    std::vector<int64_t> own_row(size_t(T), 0);
    for (int64_t j = offset[me]; j < offset[me + 1]; ++j) own_row[size_t(src[j] - int64_t(me) * cap)] = j;
    const int64_t C = ep_chunk_tokens(T);
    char* o = static_cast<char*>(out.data_ptr());
    std::vector<const char*> parts;
    for (int64_t c = 0; c < ep_num_chunks(T); ++c) {
      for (int r = 0; r < W; ++r)
        if (r != me) wait_at_least(layout_.combine_flag(signals(me), gen, r, c), gen, kOpCombine, r);
      for (int64_t t = c * C; t < std::min((c + 1) * C, T); ++t) {
        parts.clear();
        for (int r = 0; r < W; ++r) {
          if (!(uint32_t(mask[t]) >> r & 1u)) continue;
          parts.push_back(r == me ? yp + own_row[size_t(t)] * payload : layout_.combine_row(data(me), gen, r, t));
        }
        if (parts.empty())
          std::memset(o + t * payload, 0, size_t(payload));
        else
          sum_in_order(cfg_.dtype, o + t * payload, parts, H);
      }
    }
    finish_op(kOpCombine, gen);
  }

 private:
  template <typename IdxT, typename WT>
  void dispatch_typed(const at::Tensor& x, bool pair, const float* x_scales, const IdxT* idp, const WT* wp,
                      Dispatched& out) {
    const int W = cfg_.world, me = cfg_.rank;
    const int64_t T = x.size(0), K = cfg_.topk, cap = cfg_.cap, epr = cfg_.experts_per_rank(), H = cfg_.hidden;
    const int64_t S = layout_.fp8_scales;
    // Bytes of an input row and of an output row (FP8: one per channel).
    const int64_t in_row = H * int64_t(x.element_size()), payload = S ? H : H * cfg_.elt;
    const int64_t C = ep_chunk_tokens(T), nch = ep_num_chunks(T);
    const char* xp = static_cast<const char*>(x.data_ptr());
    float* scales_out = S ? out.x_scales.data_ptr<float>() : nullptr;
    // Token t's row, and an FP8 row's scales, as they travel: x's bytes (a
    // pair's with its scales), or FP8 quantised here from x in dtype (the
    // last token's quantised row is kept for its other peers).
    std::vector<char> quantised(S && !pair ? size_t(H) : 0);
    std::vector<float> quantised_scales(quantised.empty() ? 0 : size_t(S));
    int64_t quantised_token = -1;
    auto put_row = [&](int64_t t, char* row, float* scales) {
      const char* src = xp + t * in_row;
      const float* src_scales = x_scales ? x_scales + t * S : nullptr;
      if (!quantised.empty()) {
        if (quantised_token != t)
          cpu::quantize_fp8_row(x.scalar_type(), src, H, quantised.data(), quantised_scales.data());
        quantised_token = t;
        src = quantised.data();
        src_scales = quantised_scales.data();
      }
      std::memcpy(row, src, size_t(payload));
      if (S) std::memcpy(scales, src_scales, size_t(S) * 4);
    };
    int32_t* mask_out = out.send_mask.data_ptr<int32_t>();
    char* rx = static_cast<char*>(out.x.data_ptr());
    IdxT* rid_out = out.topk_idx.data_ptr<IdxT>();
    // With T = 0 the weights may be given yet have no storage: out's shape says.
    WT* rw_out = out.topk_weights.size(0) > 0 ? out.topk_weights.data_ptr<WT>() : nullptr;
    int32_t* src_out = out.recv_src.data_ptr<int32_t>();
    const uint64_t gen = begin_round(kOpDispatch, call_);
    *out.dispatch_round.data_ptr<int64_t>() = int64_t(round_);

    // Destination sets, and start[c * W + d]: rows to d from the tokens before chunk c.
    std::vector<uint32_t> start(size_t(nch + 1) * W, 0);
    for (int64_t t = 0; t < T; ++t) {
      uint32_t mask = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int owner = expert_owner(int64_t(idp[t * K + k]), cfg_.num_experts, epr, W);
        if (owner >= 0) mask |= 1u << owner;
      }
      mask_out[t] = int32_t(mask);
      for (int d = 0; d < W; ++d) start[size_t(t / C + 1) * W + d] += mask >> d & 1u;
    }
    for (int64_t c = 0; c < nch; ++c)
      for (int d = 0; d < W; ++d) start[size_t(c + 1) * W + d] += start[size_t(c) * W + d];
    auto rows_to = [&](int64_t c, int d) { return start[size_t(c) * W + d]; };
    for (int d = 0; d < W; ++d) {
      HeadSlot* head = layout_.dispatch_head(signals(d), gen, me);
      head->ntok = uint32_t(T);
      head->nrows = rows_to(nch, d);
      head->chunk_tokens = uint32_t(C);
      store_release(&head->gen, gen);
    }
    // Token t's routing as destination d sees it: the local id where the
    // slot's expert lives on d, else -1 and weight 0 (the heap row holds
    // int32 ids and fp32 weights; the own rows take the caller's dtypes).
    auto write_routing = [&](int64_t t, int d, auto* rid, auto* rw) {
      using OutId = std::remove_pointer_t<decltype(rid)>;
      using OutW = std::remove_pointer_t<decltype(rw)>;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = int64_t(idp[t * K + k]);
        const bool here = expert_owner(e, cfg_.num_experts, epr, W) == d;
        rid[k] = OutId(here ? e - d * epr : -1);
        if (rw) rw[k] = OutW(here && wp ? float(wp[t * K + k]) : 0.f);
      }
    };

    // Peers' rows, chunk by chunk, each chunk announced to every peer.
    std::vector<uint32_t> next(W);
    for (int64_t c = 0; c < nch; ++c) {
      for (int d = 0; d < W; ++d) next[d] = rows_to(c, d);
      for (int64_t t = c * C; t < std::min((c + 1) * C, T); ++t) {
        for (int d = 0; d < W; ++d) {
          if (d == me || !(uint32_t(mask_out[t]) >> d & 1u)) continue;
          char* row = layout_.dispatch_row(data(d), gen, me, next[d]++);
          put_row(t, row, layout_.row_scales(row));
          write_routing(t, d, layout_.row_ids(row), layout_.row_weights(row));
          *layout_.row_token(row) = int32_t(t);
        }
      }
      for (int d = 0; d < W; ++d) {
        if (d == me) continue;
        ChunkSlot* slot = layout_.dispatch_chunk(signals(d), gen, me, c);
        slot->row_start = rows_to(c, d);
        slot->nrows = rows_to(c + 1, d) - rows_to(c, d);
        store_release(&slot->gen, gen);
      }
    }

    // This rank's own rows skip the heap: straight to the output, after the
    // rows of every lower rank, whose counts come from their headers.
    int64_t own = 0;
    for (int s = 0; s < me; ++s) {
      const HeadSlot* head = layout_.dispatch_head(signals(me), gen, s);
      wait_at_least(&head->gen, gen, kOpDispatch, s);
      own += head->nrows;
    }
    for (int64_t t = 0; t < T; ++t) {
      if (!(uint32_t(mask_out[t]) >> me & 1u)) continue;
      put_row(t, rx + own * payload, scales_out + own * S);
      write_routing(t, me, rid_out + own * K, rw_out ? rw_out + own * K : static_cast<WT*>(nullptr));
      src_out[own++] = int32_t(me * cap + t);
    }

    // Receive: every source's header, then the peers' chunks in chunk-major
    // order, each to its source's rows (sources in rank order).
    int32_t* counts = out.counts.data_ptr<int32_t>();
    int32_t* src_tokens = out.src_tokens.data_ptr<int32_t>();
    std::vector<int64_t> offset(W + 1, 0), nchunks(W, 0);
    for (int s = 0; s < W; ++s) {
      const HeadSlot* head = layout_.dispatch_head(signals(me), gen, s);
      wait_at_least(&head->gen, gen, kOpDispatch, s);
      counts[s] = int32_t(head->nrows);
      src_tokens[s] = int32_t(head->ntok);
      nchunks[s] = s == me ? 0 : ep_chunks(head->ntok, head->chunk_tokens);  // own rows are in place already
      offset[s + 1] = offset[s] + head->nrows;
    }
    const int64_t rounds = *std::max_element(nchunks.begin(), nchunks.end());
    for (int64_t c = 0; c < rounds; ++c) {
      for (int s = 0; s < W; ++s) {
        if (c >= nchunks[s]) continue;
        const ChunkSlot* slot = layout_.dispatch_chunk(signals(me), gen, s, c);
        wait_at_least(&slot->gen, gen, kOpDispatch, s);
        for (uint32_t j = slot->row_start; j < slot->row_start + slot->nrows; ++j) {
          char* row = layout_.dispatch_row(data(me), gen, s, j);
          const int64_t o = offset[s] + j;
          std::memcpy(rx + o * payload, row, size_t(payload));
          if (S) std::memcpy(scales_out + o * S, layout_.row_scales(row), size_t(S) * 4);
          const int32_t* ids = layout_.row_ids(row);
          const float* weights = layout_.row_weights(row);
          for (int64_t k = 0; k < K; ++k) rid_out[o * K + k] = IdxT(ids[k]);
          if (rw_out)
            for (int64_t k = 0; k < K; ++k) rw_out[o * K + k] = WT(weights[k]);
          src_out[o] = int32_t(s * cap + *layout_.row_token(row));
        }
      }
    }
    // Padding rows: x is left unwritten (the contract leaves it unspecified),
    // the routing says "nowhere".
    const int64_t rows = int64_t(W) * cap, pad0 = offset[W];
    std::fill(rid_out + pad0 * K, rid_out + rows * K, IdxT(-1));
    if (rw_out) std::fill(rw_out + pad0 * K, rw_out + rows * K, WT(0));
    std::fill(src_out + pad0, src_out + rows, -1);
    finish_op(kOpDispatch, gen);
  }

  // One round of the all_reduce protocol over a chunk cut into shares `sh`
  // (elements of st), for all_reduce and all_reduce_rmsnorm alike (one
  // generation sequence, flags.h at kAllReduceSequence). For each piece b
  // (piece(o, b, &e0, &e1): elements of owner o's share, each piece its own
  // flag slot): push piece b of every owner's share of `in` into its inbox,
  // sum this rank's piece over the ranks into `sum` (at the share's offset),
  // call finish(first element, count) on it, then, unless one-shot, hand that
  // piece of each of `outputs` to every peer (output k at k * q in the gather
  // slot) and collect theirs.
  template <typename Piece, typename Finish>
  void exchange(int op, at::ScalarType st, const char* in, char* sum, const AllReduceShares& sh, int blocks,
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

  char* signals(int r) const { return bases_[r]; }
  char* data(int r) const { return bases_[r] + layout_.signal_bytes; }

  // Generations, counted as the GPU counts them (with block 0's counter): an
  // op reads counter + 1 at start and stores it back when it finishes. Ops
  // of a communicator run one after another on the calling thread. The
  // counter lives in this rank's own segment and only this rank touches it.
  // An op that raises (a timeout) does not advance it; the communicator is
  // failed then anyway (check() raises), as after a GPU timeout.
  uint64_t op_generation(int op) const { return *layout_.counter(signals(cfg_.rank), op) + 1; }
  void finish_op(int op, uint64_t gen) { *layout_.counter(signals(cfg_.rank), op) = gen; }

  // A round's start: its generation of op sequence `op`, and its call word
  // (calls.h: `fields` and the round's number) published into every peer's
  // slot, and this rank's own, before the round's first wait.
  uint64_t begin_round(int op, uint64_t fields) {
    char* own = signals(cfg_.rank);
    round_ = next_round(*layout_.counter(own, kAllReduceSequence), *layout_.counter(own, kOpDispatch),
                        *layout_.counter(own, kOpCombine));
    word_ = call_word(fields, round_);
    for (int r = 0; r < cfg_.world; ++r) store_release(layout_.call_slot(signals(r), round_, cfg_.rank), word_);
    return op_generation(op);
  }

  // Raises (and fails the communicator) where `peer`'s call word of this
  // round is there and differs from this rank's. A peer publishes its word
  // before its first flag of a round, so after any of those it is there.
  void check_call_of(int peer) {
    const uint64_t theirs = load_acquire(layout_.call_slot(signals(cfg_.rank), round_, peer));
    if (call_of_round(theirs, round_) && theirs != word_) {
      failure_ = mismatch_message(round_, word_, peer, theirs);
      TORCH_CHECK_VALUE(false, failure_);
    }
  }

  // Bounded wait for `*flag >= gen` (why `>=`: flags.h, at HeadSlot) that
  // yields the core (tests run 4 ranks on 2 cores), stops early once a
  // peer's process has exited, and checks the peer's call word of the round
  // while it waits and when the flag has come.
  void wait_at_least(const uint64_t* flag, uint64_t gen, int op, int peer) {
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

  size_t bytes_ = 0;
  std::string name_;
  bool unlinked_ = false;
  std::vector<char*> bases_;
  std::string failure_;
  uint64_t round_ = 0, word_ = 0;  // the round being run and this rank's call word of it
};

}  // namespace

std::shared_ptr<Comm> make_cpu_comm(CommConfig cfg) { return std::make_shared<CpuComm>(std::move(cfg)); }

}  // namespace rdna4_comm
