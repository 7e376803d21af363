// Where dispatch routes a token: to the owners of its expert ids. One
// definition for every transport and the kernels (qualifiers.h).
#pragma once

#include <cstdint>

#include "qualifiers.h"

namespace rdna4_comm {

// Rank that owns global expert `e`, or -1 when the id is dropped. Rank r
// owns experts [r * epr, (r + 1) * epr), so the owner is the number of those
// run starts above 0 that e reaches: world - 1 compares and no division (on
// the GPU a division by a run-time value is a long instruction sequence, and
// every dispatch sender block runs this for each of its T * K ids).
RC_HD int expert_owner(int64_t e, int64_t num_experts, int64_t experts_per_rank, int world) {
  if (e < 0 || e >= num_experts) return -1;
  int owner = 0;
  for (int r = 1; r < world; ++r) owner += e >= r * experts_per_rank;
  return owner;
}

}  // namespace rdna4_comm
