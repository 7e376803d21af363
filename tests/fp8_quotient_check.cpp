// The FP8 byte of fp8.h's fp8_quotient against that of the IEEE quotient x /
// scale of the FP8 rule (a NaN's sign aside), and bit for bit against the byte
// of fp8_quotient_unsigned_zero with x's sign bit ORed in (the GPU's
// quantising loop), wherever the rule divides (|x| <= amax of the block, scale
// = fp8_scale(amax)): exhaustively for bf16 and fp16 x and amax, and for fp32
// x at random and next to every FP8 rounding boundary; and fp8_scale against
// the IEEE quotient max(amax, floor) / 448 on every non-negative fp32 amax
// (case "scale": x is 0). Prints one line per case, "<case> <pairs>
// <mismatches> <first x bits> <first amax bits> <quotients that differ>", and
// exits 1 on any mismatch. Built and run by tests/test_fp8.py.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "fp8.h"

using namespace rdna4_comm;

namespace {

float from_bf16(uint32_t b) { return bits_float(b << 16); }

float from_fp16(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return bits_float(sign | ((e + 112) << 23) | (m << 13));
  return bits_float(sign) + (sign ? -1.0f : 1.0f) * float(m) * 5.9604644775390625e-8f;  // m * 2^-24
}

// The FP8 bytes of two quotients are the same, two NaNs of either sign alike.
bool same_byte(float a, float b) {
  const uint8_t x = fp8_e4m3fn_bits(a), y = fp8_e4m3fn_bits(b);
  return x == y || ((x & 0x7f) == 0x7f && (y & 0x7f) == 0x7f);
}

struct Tally {
  uint64_t pairs = 0, mismatches = 0, other_quotients = 0;
  uint32_t first_x = 0, first_amax = 0;
  void check(float x, float amax, uint32_t xb, uint32_t ab) {
    const float scale = fp8_scale(amax), ieee = x / scale;
    const Fp8Divisor divisor = fp8_divisor(scale);
    const float mine = fp8_quotient(x, divisor);
    // The GPU's loop: x's sign bit put on the byte of the quotient whose -0 is +0.
    const uint8_t signed_after = uint8_t(fp8_e4m3fn_bits(fp8_quotient_unsigned_zero(x, divisor)) | ((float_bits(x) >> 24) & 0x80u));
    ++pairs;
    if (float_bits(mine) != float_bits(ieee) && !(mine != mine && ieee != ieee)) ++other_quotients;
    if ((!same_byte(mine, ieee) || signed_after != fp8_e4m3fn_bits(mine)) && mismatches++ == 0) {
      first_x = xb;
      first_amax = ab;
    }
  }
  void add(const Tally& t) {
    if (mismatches == 0 && t.mismatches) first_x = t.first_x, first_amax = t.first_amax;
    pairs += t.pairs;
    mismatches += t.mismatches;
    other_quotients += t.other_quotients;
  }
};

// amax patterns [0, end) over `threads` threads, thread t taking t, t +
// threads, ...: body(amax bits, that thread's tally); the tallies added up.
template <typename Body>
Tally over_amaxes(uint64_t end, int threads, Body body) {
  std::vector<Tally> part(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (uint64_t a = uint64_t(t); a < end; a += uint64_t(threads)) body(uint32_t(a), part[size_t(t)]);
    });
  for (auto& th : pool) th.join();
  Tally all;
  for (const Tally& p : part) all.add(p);
  return all;
}

// Every amax pattern of a 16-bit format (non-negative, NaN included) against
// every x pattern with |x| <= amax, on `threads` threads.
template <typename Of>
Tally exhaustive(Of of, int threads) {
  return over_amaxes(0x8000u, threads, [&](uint32_t a, Tally& tally) {
    const float amax = of(a);
    for (uint32_t xb = 0; xb < 0x10000u; ++xb) {
      const float x = of(xb);
      if (amax == amax && !(bits_float(float_bits(x) & 0x7fffffffu) <= amax)) continue;
      tally.check(x, amax, xb, a);
    }
  });
}

// fp32 x and amax: random pairs, and x next to scale * b for every FP8
// rounding boundary b (the midpoints between neighbouring FP8 values).
Tally fp32_cases() {
  std::mt19937_64 rng(20261205);
  Tally t;
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7fffffu);
  for (int i = 0; i < 20000000; ++i) {
    const float a = bits_float(bits(rng)), x = bits_float(bits(rng) % (float_bits(a) + 1));
    const float sx = (i & 1) ? -x : x;
    t.check(sx, a, float_bits(sx), float_bits(a));
  }
  // Every value of 4 mantissa bits from 2^-10 to 480: each FP8 value
  // (3 bits) and each midpoint between two, subnormal ones included.
  std::vector<float> edges;
  for (int e = -10; e <= 8; ++e)
    for (int m = 0; m < 16; ++m) edges.push_back(std::ldexp(1.0f + float(m) / 16.0f, e));
  for (int i = 0; i < 2000000; ++i) {
    const float a = bits_float(bits(rng)), scale = fp8_scale(a);
    const float b = edges[size_t(i) % edges.size()];
    const float x0 = b * scale;
    for (int d = -2; d <= 2; ++d) {
      const float x = bits_float(uint32_t(int64_t(float_bits(x0)) + d));
      if (x <= a) t.check(x, a, float_bits(x), float_bits(a));
    }
  }
  return t;
}

// fp8_scale on every non-negative fp32 pattern (infinity and the NaNs
// included) against the division it stands for; two NaNs match.
Tally scale_cases(int threads) {
  return over_amaxes(uint64_t(1) << 31, threads, [](uint32_t ab, Tally& tally) {
    const float a = bits_float(ab), mine = fp8_scale(a), ieee = (a < kFp8AmaxFloor ? kFp8AmaxFloor : a) / kFp8Max;
    ++tally.pairs;
    if (float_bits(mine) != float_bits(ieee) && !(mine != mine && ieee != ieee) && tally.mismatches++ == 0)
      tally.first_amax = ab;
  });
}

void report(const char* name, const Tally& t, int* failed) {
  std::printf("%s %llu %llu 0x%08x 0x%08x %llu\n", name, (unsigned long long)t.pairs,
              (unsigned long long)t.mismatches, t.first_x, t.first_amax, (unsigned long long)t.other_quotients);
  if (t.mismatches) *failed = 1;
}

}  // namespace

int main() {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  int failed = 0;
  report("bf16", exhaustive([](uint32_t b) { return from_bf16(b); }, threads), &failed);
  report("fp16", exhaustive([](uint32_t h) { return from_fp16(h); }, threads), &failed);
  report("fp32", fp32_cases(), &failed);
  report("scale", scale_cases(threads), &failed);
  return failed;
}
