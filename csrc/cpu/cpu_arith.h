// The CPU transport's arithmetic: the rank-ordered sum of all_reduce and the
// residual add and norm of all_reduce_rmsnorm, in the roundings every
// transport shares (docs/semantics.md).
#pragma once

#include <ATen/Dispatch.h>

#include <algorithm>
#include <vector>

#include "../comm.h"
#include "../rmsnorm_arith.h"

namespace rdna4_comm {
namespace cpu {

// One token's row of H channels of dtype st, quantised by the FP8 rule
// (fp8.h): the FP8 bytes into q, one fp32 scale per kFp8Block channels.
inline void quantize_fp8_row(at::ScalarType st, const char* x, int64_t H, char* q, float* scales) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "rdna4_comm_quantize_fp8", [&] {
    const scalar_t* row = reinterpret_cast<const scalar_t*>(x);
    for (int64_t b0 = 0, blk = 0; b0 < H; b0 += kFp8Block, ++blk) {
      const int64_t b1 = std::min(b0 + kFp8Block, H);
      uint32_t amax = 0;
      for (int64_t i = b0; i < b1; ++i) amax = fp8_amax_bits(amax, float(row[i]));
      const float scale = fp8_scale(bits_float(amax));
      const Fp8Divisor divisor = fp8_divisor(scale);
      scales[blk] = scale;
      for (int64_t i = b0; i < b1; ++i) q[i] = char(fp8_e4m3fn_bits(fp8_quotient(float(row[i]), divisor)));
    }
  });
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

inline void sum_in_order(at::ScalarType st, char* out, const std::vector<const char*>& srcs, int64_t n) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "rdna4_comm_sum", [&] {
    sum_rows<scalar_t>(reinterpret_cast<scalar_t*>(out), srcs, n);
  });
}

// The residual add and the norm of rows whose all_reduce sum is c.x, in the
// op's roundings (docs/semantics.md): r = round(s + residual); out =
// round(w * round(r * inv_rms)). The sum of squares accumulates in fp64
// (rmsnorm_inv_rms says why) over kLanes strided partial sums combined
// pairwise, a fixed order: bitwise equal results on every rank and run.
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
    double lanes[kLanes] = {};
    for (int64_t i = 0; i < H; ++i) {
      const T v = res ? T(float(s[i]) + float(res[i])) : s[i];
      r[i] = v;
      lanes[i % kLanes] += double(float(v)) * double(float(v));
    }
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    const float inv = rmsnorm_inv_rms(lanes[0], H, c.eps);
    for (int64_t i = 0; i < H; ++i) out[i] = T(float(w[i]) * float(T(float(r[i]) * inv)));
  }
}

}  // namespace cpu
}  // namespace rdna4_comm
