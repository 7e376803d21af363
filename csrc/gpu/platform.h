// Every difference between CUDA and HIP in the kernels and their launches
// lives here: runtime type and launch names, system-scope release/acquire,
// the spin-loop pause and timer, warp width, ballots and half-precision bit
// conversions. Kernels and launchers use only the names below; the host's
// other runtime calls are runtime.cpp's.
//
// HIP is selected when compiling device code with clang/hipcc (__HIP__) or
// host code inside a ROCm build of torch (__HIP_PLATFORM_AMD__ / USE_ROCM).
#pragma once

#include <cstdint>

#include "../fp8.h"
#include "../qualifiers.h"

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) || defined(USE_ROCM)
#define RC_HIP 1
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>
#endif

namespace rdna4_comm {
namespace gpu {

// ------------------------------------------------------------ launches
// RC_RT(Name): the runtime's spelling of Name, hipName or cudaName, for the
// many entry points that differ only by that prefix.
#ifdef RC_HIP
#define RC_RT(name) hip##name
#define RC_LAUNCH(kernel, grid, block, smem, stream, ...) \
  hipLaunchKernelGGL(kernel, dim3(grid), dim3(block), smem, stream, __VA_ARGS__)
#else
#define RC_RT(name) cuda##name
#define RC_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif
using Stream = RC_RT(Stream_t);

// Before a host-device function template that kernels and launchers both
// call with functors of their own side (with_dtype): nvcc checks such a
// template's calls of a host functor even where only host code instantiates
// it, and warns; clang checks only the code it emits.
#ifdef RC_HIP
#define RC_NO_EXEC_SPACE_CHECK
#else
#define RC_NO_EXEC_SPACE_CHECK _Pragma("nv_exec_check_disable")
#endif

// --------------------------------------------------------------- device
#ifdef RC_DEVICE  // compiled as device code (qualifiers.h)

// Publish: every store this thread (and, after a block barrier, its block)
// made becomes visible to all agents of the system before `v` does.
RC_DEVICE void store_release_sys(uint64_t* p, uint64_t v) {
#ifdef RC_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Publish to this GPU's blocks alone (a flag no other agent reads): the
// same order as store_release_sys, without waiting for the stores to reach
// the rest of the system.
RC_DEVICE void store_release_device(uint64_t* p, uint64_t v) {
#ifdef RC_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
#else
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Observe a flag; loads after it see everything published before it.
RC_DEVICE uint64_t load_acquire_sys(const uint64_t* p) {
#ifdef RC_HIP
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Relaxed system-scope store for a word that carries its whole message to
// other agents and orders nothing before it (a round's call word: calls.h).
RC_DEVICE void store_relaxed_sys(uint64_t* p, uint64_t v) {
#ifdef RC_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Relaxed system-scope load for words other agents write (the abort word, a
// peer's call word).
RC_DEVICE uint64_t load_relaxed_sys(const uint64_t* p) {
#ifdef RC_HIP
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Relaxed device-scope store and load, for words that only this GPU's blocks
// read and that carry their whole message (the dispatch tally: a count and
// its generation in one word), so no release or acquire is needed.
RC_DEVICE void store_relaxed_device(uint64_t* p, uint64_t v) {
#ifdef RC_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}
RC_DEVICE uint64_t load_relaxed_device(const uint64_t* p) {
#ifdef RC_HIP
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Block barrier, and a barrier that also tells whether `pred` held on every
// thread. On HIP these are spelled with compiler builtins so the kernels need
// no device library beyond HIP's work-item ids (CI compiles them against
// Debian's HIP headers, without the library: tests/hip_work_item_ids.h).
RC_DEVICE void block_sync() {
#ifdef RC_HIP
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
  __syncthreads();
#endif
}
RC_DEVICE bool block_all(bool pred) {
#ifdef RC_HIP
  __shared__ int all;
  if (threadIdx.x == 0) all = 1;
  block_sync();
  if (!pred) all = 0;
  block_sync();
  const bool result = all != 0;
  block_sync();  // everyone has read `all` before a later call resets it
  return result;
#else
  return __syncthreads_and(pred);
#endif
}

// Device-scope fence (CUDA's __threadfence): this thread's memory
// operations before it are seen by the GPU's other threads before those
// after it. Debian's HIP headers (CI's) make __threadfence a call into the
// device library; ROCm 6's inline this same builtin.
RC_DEVICE void device_fence() {
#ifdef RC_HIP
  __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent");
#else
  __threadfence();
#endif
}

// Warp barrier: the warp's shared-memory stores and loads before it happen
// before those after it, on every lane. Lanes of a warp are not in lockstep
// (NVIDIA since Volta), and a shuffle orders its operands, not memory.
RC_DEVICE void warp_sync() {
#ifdef RC_HIP
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// Timer for bounded spins; ticks per ms from timer_ticks_per_ms().
RC_DEVICE uint64_t timer_ticks() {
#ifdef RC_HIP
  return __builtin_readsteadycounter();
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// Back off inside a spin: frees issue slots for the copies still running.
RC_DEVICE void spin_pause() {
#ifdef RC_HIP
  __builtin_amdgcn_s_sleep(2);
#else
  __nanosleep(64);
#endif
}

// Lanes per warp/wavefront: 32 on NVIDIA and RDNA, 64 on CDNA; a constant
// on NVIDIA, so lane and warp indices cost a shift, not a division. Ballots
// are 64-bit everywhere so one type serves both.
#ifdef RC_HIP
RC_DEVICE int warp_size() { return warpSize; }
#else
RC_DEVICE constexpr int warp_size() { return 32; }
#endif
// The lane within the warp (the kernels' blocks are one-dimensional). On
// HIP the wave's own lane count (mbcnt): with it the rank layout's dispatch
// kernels take about 10 fewer VGPRs on gfx1201 than with threadIdx's low
// bits.
RC_DEVICE int lane_id() {
#ifdef RC_HIP
  return int(__lane_id());
#else
  return int(threadIdx.x) & (warp_size() - 1);
#endif
}
RC_DEVICE uint64_t warp_ballot(bool pred) {
#ifdef RC_HIP
  return uint64_t(__ballot(pred));
#else
  return uint64_t(__ballot_sync(0xffffffffu, pred));
#endif
}
RC_DEVICE int popcount64(uint64_t v) { return __popcll(v); }
// Index of the lowest set bit of a non-zero word (32 or 64 bits).
RC_DEVICE int lowest_bit(uint32_t v) {
#ifdef RC_HIP
  return __builtin_ctz(v);
#else
  return __ffs(int(v)) - 1;
#endif
}
RC_DEVICE int lowest_bit(uint64_t v) {
#ifdef RC_HIP
  return __builtin_ctzll(v);
#else
  return __ffsll(static_cast<long long>(v)) - 1;
#endif
}
// Value of `v` on lane `src` of the warp.
RC_DEVICE int32_t warp_shfl(int32_t v, int src) {
#ifdef RC_HIP
  return __shfl(v, src);
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}
// Value of `v` on lane (this lane ^ mask) of the warp.
RC_DEVICE int32_t warp_shfl_xor(int32_t v, int mask) {
#ifdef RC_HIP
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}
// Value of `v` on lane (this lane - delta) of the warp; this lane's own below delta.
RC_DEVICE int32_t warp_shfl_up(int32_t v, int delta) {
#ifdef RC_HIP
  return __shfl_up(v, static_cast<unsigned int>(delta));
#else
  return __shfl_up_sync(0xffffffffu, v, delta);
#endif
}

// The larger of each 16-bit half of a and b, unsigned: one instruction on
// both (sm_90's max.u16x2; gfx1201's v_pk_max_u16).
RC_DEVICE uint32_t max_u16x2(uint32_t a, uint32_t b) {
#ifdef RC_HIP
  typedef uint16_t u16x2 __attribute__((ext_vector_type(2)));
  return __builtin_bit_cast(uint32_t, __builtin_elementwise_max(__builtin_bit_cast(u16x2, a), __builtin_bit_cast(u16x2, b)));
#else
  return __vmaxu2(a, b);
#endif
}

// Loads of memory that nothing writes while the kernel runs (an op's input
// tensors, or a finished dispatch's heap rows; never the heap of the op in
// flight, which peers write during the op): on NVIDIA
// through the read-only path, which leaves L1 to the rest. 16, 8, 4, 2 or 1
// bytes.
template <typename V>
RC_DEVICE V load_input(const V* p) {
#ifdef RC_HIP
  return *p;
#else
  return __ldg(p);
#endif
}

// A hint: fetch the 128-byte line at p into this multiprocessor's L1, where
// a later load of it (load_input's too) hits. No-op on HIP (gfx1201's
// vector memory has no such prefetch).
RC_DEVICE void prefetch_l1(const void* p) {
#ifdef RC_HIP
  (void)p;
#else
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#endif
}

// Bit-exact IEEE conversions, matching torch's CPU rounding (round to
// nearest even; bf16 NaN -> 0x7FC0).
RC_DEVICE float bf16_bits_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
RC_DEVICE uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // the hardware's NaN is 0x7FFF
#if !defined(RC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
// Two values that are not NaN, rounded as float_to_bf16_bits rounds them
// and packed (lo in the low half): one instruction for both where there is one.
RC_DEVICE uint32_t float2_to_bf16x2_bits_not_nan(float lo, float hi) {
#if !defined(RC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t b;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(hi), "f"(lo));
  return b;
#else
  return uint32_t(float_to_bf16_bits(lo)) | uint32_t(float_to_bf16_bits(hi)) << 16;
#endif
}
RC_DEVICE float f16_bits_to_float(uint16_t b) {
#ifdef RC_HIP
  return float(__builtin_bit_cast(_Float16, b));
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
  return f;
#endif
}
RC_DEVICE uint16_t float_to_f16_bits(float f) {
#ifdef RC_HIP
  return __builtin_bit_cast(uint16_t, _Float16(f));
#else
  uint16_t b;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#endif
}
RC_DEVICE uint32_t float2_to_f16x2_bits_not_nan(float lo, float hi) {
#ifdef RC_HIP
  return uint32_t(float_to_f16_bits(lo)) | uint32_t(float_to_f16_bits(hi)) << 16;
#else
  uint32_t b;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(hi), "f"(lo));
  return b;
#endif
}

// Four quotients of the FP8 rule as float8_e4m3fn bytes, v[0] in the low
// byte: fp8_e4m3fn_bits of each, or on NVIDIA sm_89+ one instruction per
// two (round to nearest even; past 448 saturating to 448, as fp8.h does).
// The rule leaves a NaN's sign open: the instruction writes every NaN as
// 0x7f, fp8.h keeps the NaN's sign, and the quantising loop ORs x's sign
// onto either (fp8x4_signs).
// The testing extension's fp8_conversion_mismatches (csrc/testing/) checks
// every fp32 pattern.
RC_DEVICE uint32_t fp8x4_bits(const float (&v)[4]) {
#if !defined(RC_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[1]), "f"(v[0]));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[3]), "f"(v[2]));
  return uint32_t(lo) | uint32_t(hi) << 16;
#else
  return uint32_t(fp8_e4m3fn_bits(v[0])) | uint32_t(fp8_e4m3fn_bits(v[1])) << 8 |
         uint32_t(fp8_e4m3fn_bits(v[2])) << 16 | uint32_t(fp8_e4m3fn_bits(v[3])) << 24;
#endif
}
#endif  // device code

}  // namespace gpu
}  // namespace rdna4_comm
