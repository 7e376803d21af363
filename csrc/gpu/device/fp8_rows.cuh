// FP8 quantisation in the row loops of rows.cuh (a row that is already FP8
// moves as its bytes, with copy_row): a row of H channels is
// fp8_num_scales(H) blocks of kFp8Block channels (fp8.h), and a block is one
// warp width of units, so a warp's piece (a whole number of warp widths,
// for_row_pieces) takes whole blocks: lane l holds channels [block *
// kFp8Block + l * c, + c), c = kFp8Block / warp size, and the warp reduces
// the block's amax with shuffles before any lane stores. Any H: channels
// past it are zeros to the amax and are not stored.
#pragma once

#include <type_traits>

#include "../../fp8.h"
#include "rows.cuh"

namespace rdna4_comm {
namespace gpu {

static_assert(kFp8Block % kMinWarpSize == 0 && kFp8Block / kMinWarpSize <= 4, "a lane holds at most 4 channels");
constexpr int kFp8LaneChannels = kFp8Block / kMinWarpSize;

RC_DEVICE uint32_t fp8_row_units(int64_t hidden) { return uint32_t(fp8_num_scales(hidden)) * uint32_t(warp_size()); }

// Input bytes each lane has in flight in the FP8 row loops: 4 blocks of
// 16-bit channels at a time, 2 of fp32 ones (the same registers).
constexpr int kFp8LaneLoadBytes = 32;
template <DType kT>
constexpr int kFp8Unroll = kFp8LaneLoadBytes / (kFp8LaneChannels * (kT == DType::kF32 ? 4 : 2));

// Rows of whole blocks whose starts are 16-byte aligned (`vector`, from the
// host) move a lane's 4 channels as one vector (wave32: 128 / 32 channels).
RC_DEVICE bool fp8_lane_vectors(bool vector) { return vector && kFp8Block / warp_size() == 4; }

// The warp's U blocks in flight from unit v0 of span s. A span's stride is
// the warp's width (for_row_pieces), so they are consecutive blocks at the
// same lane: block0 is the first, the lane's first channel of block u
// first(u) (a row's channels fit 32 bits: its bytes do, rows.cuh), the
// lane's channels of it below H count(u), and the lead lane stores the
// blocks' scales. Each is worked out from v0 where it is used: a few
// instructions, where keeping them across the loop's body took registers
// that the sender's routing then spilled. kWhole (fp8_lane_vectors): every
// block of the span is whole, so a count is all of the lane's channels or
// none, the same on every lane.
template <bool kWhole>
struct Fp8Blocks {
  uint32_t v0, end;
  int64_t hidden;
  RC_DEVICE uint32_t block0() const { return v0 / uint32_t(warp_size()); }
  RC_DEVICE bool lead() const { return v0 % uint32_t(warp_size()) == 0; }
  RC_DEVICE uint32_t first(int u) const {
    const uint32_t ws = uint32_t(warp_size());
    return (block0() + uint32_t(u)) * uint32_t(kFp8Block) + v0 % ws * (uint32_t(kFp8Block) / ws);
  }
  RC_DEVICE int count(int u) const {
    const bool in_span = v0 + uint32_t(u) * uint32_t(warp_size()) < end;
    if constexpr (kWhole) return in_span ? kFp8LaneChannels : 0;
    const int64_t per_lane = kFp8Block / warp_size(), left = in_span ? hidden - int64_t(first(u)) : 0;
    return int(left < 0 ? 0 : (left < per_lane ? left : per_lane));
  }
};

// A lane's channels of a block as loaded (kT: 2-byte channels two to a
// word, fp32 ones a word each), zeros past H. The conversion to fp32
// (lane_floats) is apart, so that the loads of the next blocks stay in
// flight while the warp quantises the current ones.
template <DType kT>
struct Fp8LaneBits {
  static constexpr int kBytes = kT == DType::kF32 ? 4 : 2;
  uint32_t w[kFp8LaneChannels * kBytes / 4];
};
template <DType kT, bool kWhole>
RC_DEVICE Fp8LaneBits<kT> load_lane(const void* x, uint32_t first, int count) {
  constexpr int kBytes = Fp8LaneBits<kT>::kBytes;
  Fp8LaneBits<kT> b{};
  if constexpr (kWhole) {
    static_assert(kFp8LaneChannels == 4, "a lane's vector is 4 channels");
    if (count == 0) return b;  // past the span
    if constexpr (kBytes == 4) {
      const uint4 r = load_input(reinterpret_cast<const uint4*>(x) + first / 4);
      b.w[0] = r.x, b.w[1] = r.y, b.w[2] = r.z, b.w[3] = r.w;
    } else {
      const uint2 r = load_input(reinterpret_cast<const uint2*>(x) + first / 4);
      b.w[0] = r.x, b.w[1] = r.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kFp8LaneChannels; ++i)
      if (i < count) b.w[i * kBytes / 4] |= element_bits(x, first + i, kT) << (8 * (i * kBytes % 4));
  }
  return b;
}
template <DType kT>
RC_DEVICE void lane_floats(const Fp8LaneBits<kT>& b, float (&v)[kFp8LaneChannels]) {
#pragma unroll
  for (int i = 0; i < kFp8LaneChannels; ++i) {
    if constexpr (kT == DType::kF32) {
      v[i] = __uint_as_float(b.w[i]);
    } else {
      const uint16_t h = uint16_t(i % 2 ? b.w[i / 2] >> 16 : b.w[i / 2]);
      v[i] = kT == DType::kBF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    }
  }
}

// This lane's FP8 bytes of block u to memory.
template <bool kWhole>
RC_DEVICE void store_lane_bytes(uint8_t* q, const Fp8Blocks<kWhole>& blocks, int u, uint32_t bytes) {
  const uint32_t first = blocks.first(u);
  if constexpr (kWhole) {
    *reinterpret_cast<uint32_t*>(q + first) = bytes;
  } else {
#pragma unroll
    for (int i = 0; i < kFp8LaneChannels; ++i)
      if (i < blocks.count(u)) q[first + i] = uint8_t(bytes >> (8 * i));
  }
}

// The blocks of span `s` of token row x (H channels of dtype kT), quantised
// by the FP8 rule; the bytes go to q_of(d) and the scales to scales_of(d)
// for every rank d in `mask` (the same on every lane). U blocks at a time
// (kFp8Unroll), and the next U blocks' loads are issued before these are
// quantised: a warp's loads would otherwise wait for its arithmetic and its
// arithmetic for its loads (the sender's registers allow one block per
// multiprocessor). The amaxes reduce together, then each destination's row
// and scales addresses (about 20 instructions each, from shared-memory
// positions) serve all of the blocks' stores.
template <DType kT, bool kWhole, typename QOf, typename ScalesOf>
RC_DEVICE void quantize_fp8_span(const void* x, int64_t hidden, QOf q_of, ScalesOf scales_of, uint32_t mask,
                                 const RowSpan& s) {
  constexpr int U = kFp8Unroll<kT>;
  using Blocks = Fp8Blocks<kWhole>;
  const uint32_t step = s.stride * U;
  Fp8LaneBits<kT> bits[U];
  auto load = [&](uint32_t v0) {
    const Blocks blocks{v0, s.end, hidden};
#pragma unroll
    for (int u = 0; u < U; ++u) bits[u] = load_lane<kT, kWhole>(x, blocks.first(u), blocks.count(u));
  };
  load(s.first);
  for (uint32_t v0 = s.first; v0 < s.end; v0 += step) {
    const Blocks blocks{v0, s.end, hidden};
    float val[U][kFp8LaneChannels];
#pragma unroll
    for (int u = 0; u < U; ++u) lane_floats<kT>(bits[u], val[u]);
    if (v0 + step < s.end) load(v0 + step);
    uint32_t amax[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      amax[u] = 0;
#pragma unroll
      for (int i = 0; i < kFp8LaneChannels; ++i) amax[u] = fp8_amax_bits(amax[u], val[u][i]);
    }
    // Every lane of the warp runs the shuffles: a span ends on a block boundary.
    for (int o = warp_size() / 2; o > 0; o /= 2)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t other = uint32_t(warp_shfl_xor(int(amax[u]), o));
        amax[u] = other > amax[u] ? other : amax[u];
      }
    float scale[U];
    uint32_t q[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
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
      for (int u = 0; u < U; ++u)
        if (blocks.count(u) > 0) store_lane_bytes(qd, blocks, u, q[u]);
      if (blocks.lead()) {
        float* sd = scales_of(d);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (blocks.count(u) > 0) sd[blocks.block0() + u] = scale[u];
      }
    }
  }
}

// quantize_fp8_span for x of dtype t, with whole-block vectors where
// `vector` (from the host) allows them.
template <typename QOf, typename ScalesOf>
RC_DEVICE void quantize_fp8_row(const void* x, DType t, int64_t hidden, bool vector, QOf q_of, ScalesOf scales_of,
                                uint32_t mask, const RowSpan& s) {
  auto go = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value;
    switch (t) {
      case DType::kF32: return quantize_fp8_span<DType::kF32, kWhole>(x, hidden, q_of, scales_of, mask, s);
      case DType::kBF16: return quantize_fp8_span<DType::kBF16, kWhole>(x, hidden, q_of, scales_of, mask, s);
      default: return quantize_fp8_span<DType::kF16, kWhole>(x, hidden, q_of, scales_of, mask, s);
    }
  };
  if (fp8_lane_vectors(vector)) go(std::true_type{});
  else go(std::false_type{});
}

}  // namespace gpu
}  // namespace rdna4_comm
