// The norm's arithmetic of all_reduce_rmsnorm, one definition for every
// transport and the kernels (qualifiers.h), so that all of them give the
// same value.
#pragma once

#include <cmath>
#include <cstdint>

#include "qualifiers.h"

namespace rdna4_comm {

// The sum of squares comes in fp64 and the mean is rounded once to fp32, so
// it differs from the exact mean by that rounding alone (torch's fp32 mean
// is a few ulps off for long rows); then 1 / sqrt(mean + eps) with IEEE
// division and square root, the value torch's rsqrt gives on the CPU.
RC_HD float rmsnorm_inv_rms(double sum_squares, int64_t hidden, float eps) {
  const float mean = float(sum_squares / double(hidden));
#if defined(__HIP__)
  return 1.0f / __builtin_sqrtf(mean + eps);
#else
  return 1.0f / sqrtf(mean + eps);
#endif
}

}  // namespace rdna4_comm
