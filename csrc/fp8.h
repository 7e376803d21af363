// The FP8 dispatch rule (docs/semantics.md, "FP8 quantisation";
// rdna4_comm/fp8.py is the same rule in torch ops): per token and block of
// kFp8Block channels, scale = max(amax, 1e-12) / 448 in fp32, q = x / scale
// (IEEE division) rounded to nearest even into float8_e4m3fn. Plain C++, so
// the CPU transport and the GPU kernels quantise with one definition.
#pragma once

#include <cstdint>

#include "qualifiers.h"

namespace rdna4_comm {

constexpr int64_t kFp8Block = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-12f;

RC_HD int64_t fp8_num_scales(int64_t hidden) { return (hidden + kFp8Block - 1) / kFp8Block; }

// The block's scale from its amax. A NaN amax stays NaN (a plain max would
// drop it), so a NaN in the block makes every q of the block NaN.
RC_HD float fp8_scale(float amax) { return (amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax) / kFp8Max; }

// |v| folded into a running amax; NaN sticks. |v| clears the sign bit, as
// torch's abs does (a NaN's too).
RC_HD float fp8_amax(float acc, float v) {
  const float a = bits_float(float_bits(v) & 0x7fffffffu);
  return (a > acc || a != a) && acc == acc ? a : acc;
}

// float -> float8_e4m3fn bits, round to nearest even. NaN -> 0x7f with the
// sign; magnitudes that round past 448 (never a quotient of the rule: |x /
// scale| <= 448 up to one rounding) saturate at 448, as torch 2.13 does.
RC_HD uint8_t fp8_e4m3fn_bits(float f) {
  const uint32_t u = float_bits(f), sign = (u >> 24) & 0x80u, mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return uint8_t(sign | 0x7fu);
  // 464 is the tie between 448 and 480 (even: 448); above it RNE gives 480,
  // past the largest finite: both saturate to 448.
  if (mag >= 0x43e80000u) return uint8_t(sign | 0x7eu);
  if (mag < 0x3c800000u) {
    // Below 2^-6 the format is fixed point in steps of 2^-9: |f| * 512,
    // exact in fp32, rounded to an integer (ties to even); 8 is 2^-6 itself,
    // whose bits (exponent 1, mantissa 0) are 8 as well.
    const float steps = bits_float(mag) * 512.0f;
    uint32_t n = uint32_t(steps);
    const float rest = steps - float(n);
    if (rest > 0.5f || (rest == 0.5f && (n & 1u))) ++n;
    return uint8_t(sign | n);
  }
  // Normal: keep 3 of the 23 mantissa bits, ties to even, and rebias the
  // exponent from 127 to 7. A carry out of the mantissa bumps the exponent.
  const uint32_t keep_odd = (mag >> 20) & 1u;
  const uint32_t rounded = (mag + 0x7ffffu + keep_odd) >> 20;
  return uint8_t(sign | (rounded - ((127u - 7u) << 3)));
}

}  // namespace rdna4_comm
