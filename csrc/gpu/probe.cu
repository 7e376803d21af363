// The init-time P2P probe: every rank writes a pattern and a flag into every
// peer through the real mapping; each rank counts the words that arrived wrong.
#include "../bounds.h"
#include "../flags.h"
#include "device/sync.cuh"

namespace rdna4_comm {
namespace gpu {
namespace {

RC_DEVICE uint32_t probe_word(int src, int dst, int i, uint64_t gen) {
  return (uint32_t(src) * 0x9E3779B1u) ^ (uint32_t(dst) * 0x85EBCA77u) ^ (uint32_t(i) * 0xC2B2AE3Du) ^
         uint32_t(gen * 0x27D4EB2Fu);
}

__global__ void __launch_bounds__(kThreads) probe_kernel(Env env, int32_t* result) {
  const Layout& L = env.layout;
  const int me = env.rank, W = env.world, tid = threadIdx.x;
  const Round round = begin_round(env, kOpProbe, 0);  // no call: the probe checks none
  const uint64_t gen = round.gen;
  constexpr int kWords = kProbeBytes / 4;
  __shared__ int32_t bad[kMaxGpuWorld];
  if (tid < W) bad[tid] = 0;
  for (int p = 0; p < W; ++p) {
    if (p == me) continue;
    uint32_t* buf = reinterpret_cast<uint32_t*>(L.probe_buf(env.data[p], me));
    for (int i = tid; i < kWords; i += blockDim.x) buf[i] = probe_word(me, p, i, gen);
  }
  block_sync();
  block_signal_ranks(env, gen, peer_ranks(env), [&](int r) { return L.probe_flag(env.sig[r], me); });
  bool arrived = true;
  if (tid < W && tid != me) arrived = wait_flag(env, round, L.probe_flag(env.sig[me], tid), tid);
  if (tid < W && !arrived) bad[tid] = -1;
  block_sync();
  for (int s = 0; s < W; ++s) {
    if (s == me || bad[s] < 0) continue;
    const uint32_t* buf = reinterpret_cast<const uint32_t*>(L.probe_buf(env.data[me], s));
    int32_t wrong = 0;
    for (int i = tid; i < kWords; i += blockDim.x) wrong += buf[i] != probe_word(s, me, i, gen);
    if (wrong) atomicAdd(&bad[s], wrong);
  }
  block_sync();
  if (tid < W) result[tid] = bad[tid];
  finish_op(env, kOpProbe, gen);
}

}  // namespace

void launch_probe(const Env& env, int32_t* result, Stream s) {
  launch("probe", probe_kernel, 1, s, env, result);
}

}  // namespace gpu
}  // namespace rdna4_comm
