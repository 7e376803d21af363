// FP8 quantisation in the row loops of rows.cuh (a row that is already FP8
// moves as its bytes, with copy_row): a row of H channels is
// fp8_num_scales(H) blocks of kFp8Block channels (fp8.h), and a block is one
// warp width of units, so a warp's piece (a whole number of warp widths,
// for_row_pieces) takes whole blocks: lane l holds channels [block *
// kFp8Block + l * c, + c), c = kFp8Block / warp size, and the warp reduces
// the block's amax with shuffles before any lane stores. Any H: channels
// past it are zeros to the amax and are not stored.
#pragma once

#include "../../fp8.h"
#include "rows.cuh"

namespace rdna4_comm {
namespace gpu {

static_assert(kFp8Block % kMinWarpSize == 0 && kFp8Block / kMinWarpSize <= 4, "a lane holds at most 4 channels");
constexpr int kFp8LaneChannels = kFp8Block / kMinWarpSize;

RC_DEVICE uint32_t fp8_row_units(int64_t hidden) { return uint32_t(fp8_num_scales(hidden)) * uint32_t(warp_size()); }

// Blocks in flight per warp in the FP8 row loops.
constexpr int kFp8Unroll = 4;

// A lane's channels of one block: its first channel and how many of them
// lie below H (none for a lane past the span: the span ends on a block
// boundary, so that is the whole warp).
struct Fp8Lane {
  int64_t first;
  int count;
};

// The warp's kFp8Unroll blocks in flight from unit v0 of span s. A span's
// stride is the warp's width (for_row_pieces), so they are consecutive
// blocks at the same lane: one first block (its index fits 32 bits: a
// row's units do), first channel and lead (the lane that stores the
// blocks' scales) for all of them, a count each (fewer registers than an
// Fp8Lane each, which the destinations' stores keep across their address
// arithmetic).
struct Fp8Blocks {
  uint32_t block0;
  int64_t first0;
  bool lead;
  int count[kFp8Unroll];
  RC_DEVICE Fp8Lane lane(int u) const { return {first0 + int64_t(u) * kFp8Block, count[u]}; }
};
RC_DEVICE Fp8Blocks fp8_blocks(uint32_t v0, const RowSpan& s, int64_t hidden) {
  const int ws = warp_size(), per_lane = kFp8Block / ws;
  Fp8Blocks b;
  b.block0 = v0 / uint32_t(ws);
  b.first0 = int64_t(b.block0) * kFp8Block + int64_t(v0 % uint32_t(ws)) * per_lane;
  b.lead = v0 % uint32_t(ws) == 0;
#pragma unroll
  for (int u = 0; u < kFp8Unroll; ++u) {
    const int64_t left = v0 + uint32_t(u * ws) < s.end ? hidden - (b.first0 + int64_t(u) * kFp8Block) : 0;
    b.count[u] = int(left < 0 ? 0 : (left < per_lane ? left : per_lane));
  }
  return b;
}

// Rows of whole blocks whose starts are 16-byte aligned (`vector`, from the
// host) move a lane's 4 channels as one vector (wave32: 128 / 32 channels).
RC_DEVICE bool fp8_lane_vectors(bool vector) { return vector && kFp8Block / warp_size() == 4; }

// This lane's channels of row x (dtype t) as fp32; zeros past H.
RC_DEVICE void load_lane(const void* x, DType t, const Fp8Lane& l, bool vec, float (&v)[kFp8LaneChannels]) {
  if (vec && l.count == 4) {
    if (t == DType::kF32) {
      const uint4 r = load_input(reinterpret_cast<const uint4*>(x) + l.first / 4);
      v[0] = __uint_as_float(r.x), v[1] = __uint_as_float(r.y), v[2] = __uint_as_float(r.z), v[3] = __uint_as_float(r.w);
    } else {
      const uint2 r = load_input(reinterpret_cast<const uint2*>(x) + l.first / 4);
      const uint16_t h[4] = {uint16_t(r.x), uint16_t(r.x >> 16), uint16_t(r.y), uint16_t(r.y >> 16)};
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = t == DType::kBF16 ? bf16_bits_to_float(h[i]) : f16_bits_to_float(h[i]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kFp8LaneChannels; ++i) v[i] = i < l.count ? load_as_float(x, l.first + i, t) : 0.f;
}

// This lane's FP8 bytes of a row to memory.
RC_DEVICE void store_lane_bytes(uint8_t* q, const Fp8Lane& l, bool vec, uint32_t b) {
  if (vec && l.count == 4) {
    *reinterpret_cast<uint32_t*>(q + l.first) = b;
    return;
  }
#pragma unroll
  for (int i = 0; i < kFp8LaneChannels; ++i)
    if (i < l.count) q[l.first + i] = uint8_t(b >> (8 * i));
}

// The blocks of span `s` of token row x (H channels of dtype t), quantised
// by the FP8 rule; the bytes go to q_of(d) and the scales to scales_of(d)
// for every rank d in `mask` (the same on every lane). kFp8Unroll blocks at
// a time: their loads are in flight together, then their amaxes reduce,
// then each destination's row and scales addresses (about 20 instructions
// each, from shared-memory positions) serve all of their stores.
template <typename QOf, typename ScalesOf>
RC_DEVICE void quantize_fp8_row(const void* x, DType t, int64_t hidden, bool vector, QOf q_of, ScalesOf scales_of,
                                uint32_t mask, const RowSpan& s) {
  const bool vec = fp8_lane_vectors(vector);
  for (uint32_t v0 = s.first; v0 < s.end; v0 += s.stride * kFp8Unroll) {
    const Fp8Blocks blocks = fp8_blocks(v0, s, hidden);
    float val[kFp8Unroll][kFp8LaneChannels];
    uint32_t amax[kFp8Unroll];
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) load_lane(x, t, blocks.lane(u), vec, val[u]);
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) {
      amax[u] = 0;
#pragma unroll
      for (int i = 0; i < kFp8LaneChannels; ++i) amax[u] = fp8_amax_bits(amax[u], val[u][i]);
    }
    // Every lane of the warp runs the shuffles: a span ends on a block boundary.
    for (int o = warp_size() / 2; o > 0; o /= 2)
#pragma unroll
      for (int u = 0; u < kFp8Unroll; ++u) {
        const uint32_t other = uint32_t(warp_shfl_xor(int(amax[u]), o));
        amax[u] = other > amax[u] ? other : amax[u];
      }
    float scale[kFp8Unroll];
    uint32_t q[kFp8Unroll];
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) {
      scale[u] = fp8_scale(bits_float(amax[u]));
      const Fp8Divisor divisor = fp8_divisor(scale[u]);
      float quot[kFp8LaneChannels];
#pragma unroll
      for (int i = 0; i < kFp8LaneChannels; ++i) quot[i] = fp8_quotient(val[u][i], divisor);
      q[u] = fp8x4_bits(quot);
    }
#pragma unroll 1
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      const int d = lowest_bit(m);
      uint8_t* qd = reinterpret_cast<uint8_t*>(q_of(d));
#pragma unroll
      for (int u = 0; u < kFp8Unroll; ++u)
        if (blocks.count[u] > 0) store_lane_bytes(qd, blocks.lane(u), vec, q[u]);
      if (blocks.lead) {
        float* sd = scales_of(d);
#pragma unroll
        for (int u = 0; u < kFp8Unroll; ++u)
          if (blocks.count[u] > 0) sd[blocks.block0 + u] = scale[u];
      }
    }
  }
}

}  // namespace gpu
}  // namespace rdna4_comm
