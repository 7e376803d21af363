// FP8 quantisation in the row loops of rows.cuh (a row that is already FP8
// moves as its bytes, with copy_row): a row of H channels is
// fp8_num_scales(H) blocks of kFp8Block channels (fp8.h), and a lane takes
// 16 bytes of x's channels, kFp8LaneChannels<T> of dtype T (8 of a 16-bit
// dtype, 4 of fp32), so a block is kFp8BlockLanes<T> units, a lane each:
// unit v of a row holds channels [v / L * kFp8Block + v % L * c, + c), L
// the block's lanes and c the lane's channels. A warp's piece (a whole
// number of warp widths, for_row_pieces) starts on a block, since a row's
// units are whole blocks and a warp width is whole blocks (kMinWarpSize is
// a multiple of L), so each group of L lanes takes one block and reduces
// its amax with shuffles within the group before any lane stores. A 32-lane
// warp quantises two blocks of a 16-bit row at a time, and each load,
// shuffle, scale and store instruction serves both: the quantising
// dispatch issues fewer instructions per byte (fp32 x keeps 4 channels a
// lane, whose 8 took gfx1201's build to scratch). Any H: channels past it
// are zeros to the amax and are not stored.
#pragma once

#include <type_traits>

#include "../../fp8.h"
#include "rows.cuh"

namespace rdna4_comm {
namespace gpu {

constexpr int kFp8LaneBytes = 16;
RC_HD constexpr int fp8_lane_channels(DType t) { return kFp8LaneBytes / dtype_bytes(t); }
RC_HD constexpr int fp8_block_lanes(DType t) { return int(kFp8Block) / fp8_lane_channels(t); }
template <DType kT>
constexpr int kFp8LaneChannels = fp8_lane_channels(kT);
template <DType kT>
constexpr int kFp8BlockLanes = fp8_block_lanes(kT);
static_assert(kFp8Block % kFp8LaneChannels<DType::kBF16> == 0 && kFp8Block % kFp8LaneChannels<DType::kF32> == 0,
              "a block is whole lanes");
static_assert(kMinWarpSize % kFp8BlockLanes<DType::kBF16> == 0 && kMinWarpSize % kFp8BlockLanes<DType::kF32> == 0,
              "a warp width is whole blocks");

// A row's units in the row loops: its blocks' lanes for x of dtype t.
RC_DEVICE uint32_t fp8_row_units(int64_t hidden, DType t) {
  return uint32_t(fp8_num_scales(hidden) * fp8_block_lanes(t));
}

// Blocks a lane takes in a pass of the FP8 row loops, 32 bytes of x, and
// the passes whose loads are in flight at once (quantize_fp8_span).
constexpr int kFp8Unroll = 2;
constexpr int kFp8PassesInFlight = 2;

// The lane's U blocks of a pass from its unit v0 of span s. A span's stride
// is the warp's width (for_row_pieces), so block u is warp width / L blocks
// past block u - 1, at the same place: block(u) is its index in the row,
// the lane's first channel of it first(u) (a row's channels fit 32 bits:
// its bytes do, rows.cuh), whether it is in the span in_span(u) (the same
// on each lane of the block: a span ends after whole blocks), and the
// lane's channels of it below H count(u). Each is worked out from
// v0 where it is used: a few instructions, where keeping them across the
// loop's body took registers that the sender's routing then spilled.
// kWhole (the host's fp8_vectors): every block of the span is whole, so a
// count is all of the lane's channels or none, the same on every lane of a
// block.
template <DType kT, bool kWhole>
struct Fp8Blocks {
  static constexpr uint32_t kLanes = kFp8BlockLanes<kT>, kChannels = kFp8LaneChannels<kT>;
  uint32_t v0, end;
  int64_t hidden;
  RC_DEVICE uint32_t block(int u) const { return (v0 + uint32_t(u) * uint32_t(warp_size())) / kLanes; }
  RC_DEVICE uint32_t first(int u) const { return block(u) * uint32_t(kFp8Block) + v0 % kLanes * kChannels; }
  RC_DEVICE bool in_span(int u) const { return v0 + uint32_t(u) * uint32_t(warp_size()) < end; }
  RC_DEVICE int count(int u) const {
    if constexpr (kWhole) return in_span(u) ? int(kChannels) : 0;
    const int64_t left = in_span(u) ? hidden - int64_t(first(u)) : 0;
    return int(left < 0 ? 0 : (left < int64_t(kChannels) ? left : int64_t(kChannels)));
  }
};

// A lane's channels of a block as loaded, its 16 bytes (kT: 2-byte
// channels two to a word, fp32 ones a word each), zeros past H. The
// conversion to fp32 (lane_floats) is apart, so that the loads of the next
// blocks stay in flight while the warp quantises the current ones.
template <DType kT>
struct Fp8LaneBits {
  static constexpr int kBytes = dtype_bytes(kT);
  uint32_t w[kFp8LaneBytes / 4];
};
template <DType kT, bool kWhole>
RC_DEVICE Fp8LaneBits<kT> load_lane(const void* x, uint32_t first, int count) {
  constexpr int kBytes = Fp8LaneBits<kT>::kBytes;
  Fp8LaneBits<kT> b{};
  if constexpr (kWhole) {
    if (count == 0) return b;  // past the span
    const uint4 r = load_input(reinterpret_cast<const uint4*>(x) + first / kFp8LaneChannels<kT>);
    b.w[0] = r.x, b.w[1] = r.y, b.w[2] = r.z, b.w[3] = r.w;
  } else {
#pragma unroll
    for (int i = 0; i < kFp8LaneChannels<kT>; ++i)
      if (i < count) b.w[i * kBytes / 4] |= element_bits(x, first + i, kT) << (8 * (i * kBytes % 4));
  }
  return b;
}
template <DType kT>
RC_DEVICE void lane_floats(const Fp8LaneBits<kT>& b, float (&v)[kFp8LaneChannels<kT>]) {
#pragma unroll
  for (int i = 0; i < kFp8LaneChannels<kT>; ++i) {
    if constexpr (kT == DType::kF32) {
      v[i] = __uint_as_float(b.w[i]);
    } else {
      const uint16_t h = uint16_t(i % 2 ? b.w[i / 2] >> 16 : b.w[i / 2]);
      v[i] = kT == DType::kBF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    }
  }
}

// The sign bits of a lane's channels 4w .. 4w + 3 as loaded, where FP8
// bytes have them (bits 7, 15, 23 and 31): x's sign, which the quotients
// of fp8_quotient_unsigned_zero lose for x = -0 (and a NaN quotient's,
// which the rule leaves open).
template <DType kT>
RC_DEVICE uint32_t fp8x4_signs(const Fp8LaneBits<kT>& b, int w) {
  if constexpr (kT == DType::kF32) {  // a channel a word: byte 3 of each
    static_assert(kFp8LaneChannels<kT> == 4, "one set of four channels a lane (w = 0)");
    return __byte_perm(__byte_perm(b.w[0], b.w[1], 0x73), __byte_perm(b.w[2], b.w[3], 0x73), 0x5410) & 0x80808080u;
  } else {  // two channels a word: bytes 1 and 3 of words 2w and 2w + 1
    return __byte_perm(b.w[2 * w], b.w[2 * w + 1], 0x7531) & 0x80808080u;
  }
}

// A lane's FP8 bytes of a block, channel i in byte i % 4 of word i / 4.
template <DType kT>
struct Fp8LaneBytes {
  uint32_t w[kFp8LaneChannels<kT> / 4];
};

// This lane's FP8 bytes of block u to memory (whole blocks: aligned to
// their size, the row's start being 16-byte aligned).
template <DType kT, bool kWhole>
RC_DEVICE void store_lane_bytes(uint8_t* q, const Fp8Blocks<kT, kWhole>& blocks, int u, const Fp8LaneBytes<kT>& bytes) {
  const uint32_t first = blocks.first(u);
  if constexpr (kWhole && kFp8LaneChannels<kT> == 8) {
    *reinterpret_cast<uint2*>(q + first) = make_uint2(bytes.w[0], bytes.w[1]);
  } else if constexpr (kWhole) {
    static_assert(kFp8LaneChannels<kT> == 4, "a lane's bytes are one 4- or 8-byte store");
    *reinterpret_cast<uint32_t*>(q + first) = bytes.w[0];
  } else {
#pragma unroll
    for (int i = 0; i < kFp8LaneChannels<kT>; ++i)
      if (i < blocks.count(u)) q[first + i] = uint8_t(bytes.w[i / 4] >> (8 * (i % 4)));
  }
}

// Where a row's FP8 bytes and scales go at one destination.
struct Fp8Dest {
  uint8_t* q;
  float* scales;
};

// One warp pass of quantize_fp8_span: the lane's U blocks of `blocks`,
// loaded into `bits`, quantised by the FP8 rule and stored to `first`
// and to q_of(d) and scales_of(d) for every rank d in `rest`. The amaxes
// reduce together, then each destination's addresses serve all of the
// blocks' stores.
template <DType kT, bool kWhole, typename QOf, typename ScalesOf>
RC_DEVICE void quantize_fp8_pass(const Fp8LaneBits<kT> (&bits)[kFp8Unroll], const Fp8Blocks<kT, kWhole>& blocks,
                                 const Fp8Dest& first, QOf& q_of, ScalesOf& scales_of, uint32_t rest) {
  constexpr int U = kFp8Unroll, C = kFp8LaneChannels<kT>, kLanes = Fp8Blocks<kT, kWhole>::kLanes;
  float val[U][C];
#pragma unroll
  for (int u = 0; u < U; ++u) lane_floats<kT>(bits[u], val[u]);
  // Lane l works out block l % U's scale and reciprocal, and the U lanes
  // of its group (within one block's lanes) take them by shuffles: a pass
  // pays for one scale's instructions, not U. The block's lane u stores
  // block u's scale (a block's lanes start at a multiple of U).
  static_assert(kLanes % U == 0, "a group's lanes lie in one block");
  const int mine = lane_id() % U, group = lane_id() - mine;
  // The amax of block `mine` (fp8_amax_bits), reduced over the block's
  // lanes. Every lane of the warp runs the shuffles (a span ends on a block
  // boundary), each within its block's lanes.
  uint32_t my_amax;
  if constexpr (kT == DType::kBF16 && U == 2) {
    // A bf16 magnitude's 16 bits order as fp8_amax_bits orders its fp32
    // bits (the same bits, shifted), so the two blocks' amaxes reduce as
    // the halves of one word: a shuffle and a max a step for both. (fp16's
    // would too, but for NaN payloads, which its hardware conversion may
    // quiet: a block's scale would be another NaN than lane_floats' gives.)
    uint32_t m[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      m[u] = bits[u].w[0] & 0x7fff7fffu;
#pragma unroll
      for (int i = 1; i < kFp8LaneBytes / 4; ++i) m[u] = max_u16x2(m[u], bits[u].w[i] & 0x7fff7fffu);
    }
    uint32_t both = max_u16x2(__byte_perm(m[0], m[1], 0x5410), __byte_perm(m[0], m[1], 0x7632));
#pragma unroll
    for (int o = kLanes / 2; o > 0; o /= 2) both = max_u16x2(both, uint32_t(warp_shfl_xor(int(both), o)));
    my_amax = mine ? both & 0xffff0000u : both << 16;
  } else {
    uint32_t amax[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      amax[u] = 0;
#pragma unroll
      for (int i = 0; i < C; ++i) amax[u] = fp8_amax_bits(amax[u], val[u][i]);
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o /= 2)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t other = uint32_t(warp_shfl_xor(int(amax[u]), o));
        amax[u] = other > amax[u] ? other : amax[u];
      }
    my_amax = amax[0];
#pragma unroll
    for (int u = 1; u < U; ++u) my_amax = mine == u ? amax[u] : my_amax;
  }
  const float my_scale = fp8_scale(bits_float(my_amax));
  const Fp8Divisor my_divisor = fp8_divisor(my_scale);
  // Block `mine` is in the span on every lane of it; its lane `mine` may
  // still have no channels of it (a last block whose channels fill fewer
  // than U lanes).
  const bool stores_scale = blocks.v0 % kLanes < uint32_t(U) && blocks.in_span(mine);
  Fp8LaneBytes<kT> q[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const Fp8Divisor divisor{__int_as_float(warp_shfl(__float_as_int(my_divisor.scale), group + u)),
                             __int_as_float(warp_shfl(__float_as_int(my_divisor.inverse), group + u))};
#pragma unroll
    for (int w = 0; w < C / 4; ++w) {
      float quot[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) quot[i] = fp8_quotient_unsigned_zero(val[u][4 * w + i], divisor);
      q[u].w[w] = fp8x4_bits(quot) | fp8x4_signs<kT>(bits[u], w);
    }
  }
  auto store = [&](uint8_t* qd, float* sd) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (blocks.count(u) > 0) store_lane_bytes(qd, blocks, u, q[u]);
    if (stores_scale) sd[blocks.block(mine)] = my_scale;
  };
  store(first.q, first.scales);
#pragma unroll 1
  for (uint32_t m = rest; m != 0; m &= m - 1) {
    const int d = lowest_bit(m);
    store(reinterpret_cast<uint8_t*>(q_of(d)), stores_scale ? scales_of(d) : nullptr);
  }
}

// The blocks of span `s` of token row x (H channels of dtype kT), quantised
// by the FP8 rule (quantize_fp8_pass) for every rank d in `mask` (the same
// on every lane, not empty), U blocks a pass (kFp8Unroll). The first
// destination's addresses (about 20 instructions each, from shared-memory
// positions) are worked out once for the span; any other's in each pass,
// as keeping every destination's would take up to 4 registers a rank.
// P sets of registers (kFp8PassesInFlight) take the passes in turn, and a
// set's next loads are issued as soon as its pass is quantised: while the
// warp quantises one pass, the next P - 1 passes' loads are in flight (the
// sender's registers allow one block per multiprocessor, so a warp's own
// loads are what hides their latency). A pass's bits are never moved
// between the sets: a move would wait for the loads. A load past the
// span's end reads nothing (count 0).
template <DType kT, bool kWhole, typename QOf, typename ScalesOf>
RC_DEVICE void quantize_fp8_span(const void* x, int64_t hidden, QOf q_of, ScalesOf scales_of, uint32_t mask,
                                 const RowSpan& s) {
  constexpr int U = kFp8Unroll, P = kFp8PassesInFlight;
  using Blocks = Fp8Blocks<kT, kWhole>;
  const uint32_t step = s.stride * U;
  auto load = [&](Fp8LaneBits<kT> (&bits)[U], uint32_t v0) {
    const Blocks blocks{v0, s.end, hidden};
#pragma unroll
    for (int u = 0; u < U; ++u) bits[u] = load_lane<kT, kWhole>(x, blocks.first(u), blocks.count(u));
  };
  // The loop runs from the warp's first unit (lane 0's), so that every lane
  // takes every pass and its shuffles: a span may end after any whole
  // number of blocks, and the lanes past its end then hold none (count 0).
  const uint32_t warp_first = uint32_t(warp_shfl(int(s.first), 0)), lane = s.first - warp_first;
  const int d0 = lowest_bit(mask);
  const Fp8Dest first{reinterpret_cast<uint8_t*>(q_of(d0)), scales_of(d0)};
  const uint32_t rest = mask & (mask - 1);
  Fp8LaneBits<kT> sets[P][U];
#pragma unroll
  for (int k = 0; k < P; ++k) load(sets[k], s.first + k * step);
  for (uint32_t w0 = warp_first; w0 < s.end; w0 += P * step) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const uint32_t v0 = w0 + k * step;  // the same on every lane
      if (v0 >= s.end) break;
      quantize_fp8_pass<kT, kWhole>(sets[k], Blocks{v0 + lane, s.end, hidden}, first, q_of, scales_of, rest);
      load(sets[k], v0 + P * step + lane);
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
  if (vector) go(std::true_type{});
  else go(std::false_type{});
}

}  // namespace gpu
}  // namespace rdna4_comm
