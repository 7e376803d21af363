// CPU transport: the processes of one host share one POSIX shared-memory
// segment per rank. Each op runs the GPU kernels' protocol on the calling
// thread: the same heap layout and flag slots (per-chunk dispatch slots,
// per-chunk combine flags, per-block all_reduce flags), generation parity and
// counting, single-writer flags published with release and polled with
// acquire, and the same own-row path, so every property of the protocol is
// exercised without a GPU. docs/protocol.md lists what still differs.
//
// cpu_comm.cpp: the segments, all_reduce and all_reduce_rmsnorm, rounds and
// waits; cpu_ep.cpp: dispatch and combine.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "../comm.h"
#include "../policies.h"

namespace rdna4_comm {
namespace cpu {

// Publication and observation between the processes, through the shared
// mapping: the payload and slot metadata are plain stores before a release
// store of the generation; a reader's acquire load that sees it makes them
// visible to the reader's later loads.
inline void store_release(uint64_t* flag, uint64_t v) { __atomic_store_n(flag, v, __ATOMIC_RELEASE); }
inline uint64_t load_acquire(const uint64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

class CpuComm final : public Comm {
 public:
  explicit CpuComm(CommConfig cfg);
  ~CpuComm() override;

  std::string export_handle() override;
  void connect(const std::vector<std::string>& names) override;
  std::string finish() override;
  at::Device device() const override { return at::Device(at::kCPU); }

 protected:
  void all_reduce_chunk(at::ScalarType st, const char* in, char* out, int64_t m, bool one_shot) override;
  void all_reduce_rmsnorm_chunk(const RmsNormRows& c, bool one_stage) override;
  void rmsnorm_local(const RmsNormRows& c) override;
  void dispatch_impl(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
                     const c10::optional<at::Tensor>& topk_weights, Dispatched& out) override;
  void combine_impl(const at::Tensor& y, const at::Tensor& recv_src, const at::Tensor& counts,
                    const at::Tensor& src_tokens, const at::Tensor& send_mask, const at::Tensor& dispatch_round,
                    at::Tensor& out) override;

 private:
  // One dispatch call, phase by phase, with ids of IdxT and weights of WT.
  template <typename IdxT, typename WT>
  class Dispatch;

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
                Piece piece, Finish finish, std::initializer_list<char*> outputs);

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
  uint64_t begin_round(int op, uint64_t fields);
  // Raises (and fails the communicator) where `peer`'s call word of this
  // round is there and differs from this rank's. A peer publishes its word
  // before its first flag of a round, so after any of those it is there.
  void check_call_of(int peer);
  // Bounded wait for `*flag >= gen` (why `>=`: flags.h, at HeadSlot) that
  // yields the core (tests run 4 ranks on 2 cores), stops early once a
  // peer's process has exited, and checks the peer's call word of the round
  // while it waits and when the flag has come.
  void wait_at_least(const uint64_t* flag, uint64_t gen, int op, int peer);

  size_t bytes_ = 0;
  std::string name_;
  bool unlinked_ = false;
  std::vector<char*> bases_;
  uint64_t round_ = 0, word_ = 0;  // the round being run and this rank's call word of it
};

}  // namespace cpu
}  // namespace rdna4_comm
