// Function qualifiers, defined once for every compiler that reads the
// sources: RC_HD for code that host, device and the CPU transport share
// (the protocol's headers), RC_DEVICE for device-only helpers. Both are
// inline, so a header's functions may appear in every translation unit that
// includes it. The shared headers are plain C++ (no torch, no CUDA runtime),
// so the CPU transport, the host side of the GPU transport and the device
// kernels all read one definition. Also the bit casts, the alignment test
// the rounding and the fused multiply-add that shared code needs.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define RC_HD __host__ __device__ inline
#define RC_DEVICE __device__ __forceinline__
#else
#define RC_HD inline
#endif

// On a lambda (`[&](...) RC_INLINE_LAMBDA {...}`): always inlined. A device
// lambda that a loop calls in several places, a row loop's per-row
// callback, may otherwise be outlined by clang's HIP build into a call
// whose frame lives in scratch memory.
#define RC_INLINE_LAMBDA __attribute__((always_inline))

// (The builtin: device code has no library memcpy.)
RC_HD uint32_t float_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
}
RC_HD float bits_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// a * b + c rounded once. The builtin: GCC, nvcc and clang lower it to
// their FMA instruction (a host without one calls the C library's fmaf,
// which rounds once as well), and device code has no library fmaf on HIP.
RC_HD float fma_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// p on a 16-byte boundary: where the GPU kernels' row loops can use their
// widest vectors (with rows that are whole 16-byte vectors).
RC_HD bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

namespace rdna4_comm {
RC_HD size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
RC_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace rdna4_comm
