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

// The block's scale from its amax: max(amax, floor) / 448, the IEEE
// quotient, taken as the product by 1/448 and one FMA correction by the
// remainder (exact), which is the quotient on every finite amax
// (tests/fp8_quotient_check.cpp tries each); an infinite or NaN amax makes
// the remainder NaN and keeps the product, inf or NaN, as the division
// does. A NaN amax stays NaN (a plain max would drop it), so a NaN in the
// block makes every q of the block NaN.
constexpr float kFp8InverseMax = 1.0f / kFp8Max;
RC_HD float fp8_scale(float amax) {
  const float a = amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax;
  const float product = a * kFp8InverseMax, remainder = fma_rn(-product, kFp8Max, a);
  return remainder == remainder ? fma_rn(remainder, kFp8InverseMax, product) : product;
}

// |v| folded into a running amax held as its bits (start at 0; the amax
// is bits_float of the result): |v| clears the sign bit, as torch's abs
// does (a NaN's too), and floats without a sign order as their bits do,
// with every NaN above infinity, so one integer max keeps the largest and
// a NaN sticks (which of the block's NaNs is left open, as the rule leaves
// a NaN's bits).
RC_HD uint32_t fp8_amax_bits(uint32_t acc, float v) {
  const uint32_t a = float_bits(v) & 0x7fffffffu;
  return a > acc ? a : acc;
}

// The rule's FP8 byte of x / scale without a division per channel: with
// inverse = 1 / scale (once per block, Fp8Divisor), q0 = x * inverse and
// one correction by the remainder x - q0 * scale, which an FMA computes
// exactly, give the correctly rounded x / scale (Markstein's correction
// step) wherever the remainder does not underflow, which covers every
// quotient FP8 can tell from 0. Rounding to nearest is symmetric, so x
// keeps its sign throughout; x's sign bit is ORed in last because the
// correction of x = -0 sums to +0 (and -0 must stay -0). An
// infinite scale (an infinite amax) takes FLT_MAX in the remainder, where
// inf * 0 would make a NaN of x / inf = 0. The bytes equal those of the
// IEEE quotient wherever the rule divides (|x| <= amax), a NaN's sign
// aside: tests/test_fp8.py checks every bf16 and fp16 x against the scale
// of every bf16 and fp16 amax, and fp32 x at random and next to every FP8
// rounding boundary.
struct Fp8Divisor {
  float scale;    // finite: FLT_MAX for an infinite scale
  float inverse;  // 1 / scale (0 for an infinite one)
};
RC_HD Fp8Divisor fp8_divisor(float scale) {
  const float most = 3.40282347e38f;
  return {scale < most ? scale : most, 1.0f / scale};
}
// fp8_quotient but +0 for x = -0 (and a NaN of whichever sign the
// arithmetic gives), for a caller that puts x's sign on the FP8 bytes
// (the GPU's quantising loop: one byte permute for four).
RC_HD float fp8_quotient_unsigned_zero(float x, const Fp8Divisor& d) {
  const float q0 = x * d.inverse;
  return fma_rn(fma_rn(-q0, d.scale, x), d.inverse, q0);
}
RC_HD float fp8_quotient(float x, const Fp8Divisor& d) {
  return bits_float(float_bits(fp8_quotient_unsigned_zero(x, d)) | (float_bits(x) & 0x80000000u));
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
