// Sums over ranks: in ascending rank order, in fp32, rounded once, so every
// rank and the reference round alike (bitwise equal results).
#pragma once

#include "../../bounds.h"
#include "copy.cuh"

namespace rdna4_comm {
namespace gpu {

// A pointer per rank, indexed only with unrolled loops so it stays in registers.
struct ConstRankPtrs {
  const char* p[kMaxGpuWorld];
};

template <DType D> struct Elem;
template <> struct Elem<DType::kF32> {
  using Raw = float;
  static RC_DEVICE float load(Raw v) { return v; }
  static RC_DEVICE Raw store(float v) { return v; }
};
template <> struct Elem<DType::kBF16> {
  using Raw = uint16_t;
  static RC_DEVICE float load(Raw v) { return bf16_bits_to_float(v); }
  static RC_DEVICE Raw store(float v) { return float_to_bf16_bits(v); }
  static RC_DEVICE uint32_t store2_not_nan(float lo, float hi) { return float2_to_bf16x2_bits_not_nan(lo, hi); }
};
template <> struct Elem<DType::kF16> {
  using Raw = uint16_t;
  static RC_DEVICE float load(Raw v) { return f16_bits_to_float(v); }
  static RC_DEVICE Raw store(float v) { return float_to_f16_bits(v); }
  static RC_DEVICE uint32_t store2_not_nan(float lo, float hi) { return float2_to_f16x2_bits_not_nan(lo, hi); }
};

// Element i of p, of a dtype known only at run time, as fp32 (exact), and
// an fp32 value stored as one (rounded to nearest even). The load and the
// conversion are apart (element_bits, bits_as_float) so that a loop can
// issue its loads before the branch on the dtype waits for the first of them.
RC_DEVICE uint32_t element_bits(const void* p, int64_t i, DType t) {
  return t == DType::kF32 ? static_cast<const uint32_t*>(p)[i] : uint32_t(static_cast<const uint16_t*>(p)[i]);
}
RC_DEVICE float bits_as_float(uint32_t bits, DType t) {
  switch (t) {
    case DType::kF32: return __uint_as_float(bits);
    case DType::kBF16: return bf16_bits_to_float(uint16_t(bits));
    default: return f16_bits_to_float(uint16_t(bits));
  }
}
RC_DEVICE float load_as_float(const void* p, int64_t i, DType t) { return bits_as_float(element_bits(p, i, t), t); }
RC_DEVICE void store_from_float(void* p, int64_t i, DType t, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(v); break;
  }
}

// A vector V seen as its N elements of D.
template <DType D, typename V>
union ElemPack {
  static constexpr int N = int(sizeof(V) / sizeof(typename Elem<D>::Raw));
  V v;
  typename Elem<D>::Raw e[N];
};

// acc rounded to D into p's elements, as E::store rounds each. Elements of
// 16 bits go two at a time unless a value is NaN (rare: one test and branch
// per vector, not a NaN fix per element).
template <DType D, typename V>
RC_DEVICE void round_into(ElemPack<D, V>& p, const float (&acc)[ElemPack<D, V>::N]) {
  using E = Elem<D>;
  constexpr int N = ElemPack<D, V>::N;
  bool pairs = sizeof(typename E::Raw) == 2 && N % 2 == 0;
  if constexpr (sizeof(typename E::Raw) == 2 && N % 2 == 0) {
    bool nan = false;
#pragma unroll
    for (int k = 0; k < N; ++k) nan = nan || acc[k] != acc[k];
    pairs = !__builtin_expect(nan, false);
    if (pairs) {
      uint32_t w[N / 2];
#pragma unroll
      for (int k = 0; k < N; k += 2) w[k / 2] = E::store2_not_nan(acc[k], acc[k + 1]);
      static_assert(sizeof(w) == sizeof(V), "pairs fill the vector");
      __builtin_memcpy(&p.v, w, sizeof(V));
    }
  }
  if (!pairs) {
#pragma unroll
    for (int k = 0; k < N; ++k) p.e[k] = E::store(acc[k]);
  }
}

// Vector v of the sum over the sources selected by `mask`, in ascending rank
// order, in fp32, rounded once; zeros when the mask is empty.
template <DType D, typename V>
RC_DEVICE V sum_one(const ConstRankPtrs& src, uint32_t mask, uint32_t v) {
  using E = Elem<D>;
  using Pack = ElemPack<D, V>;
  constexpr int N = Pack::N;
  float acc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = 0.f;
  bool first = true;
#pragma unroll
  for (int r = 0; r < kMaxGpuWorld; ++r) {
    if (!(mask >> r & 1u)) continue;
    Pack p;
    p.v = reinterpret_cast<const V*>(src.p[r])[v];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = first ? E::load(p.e[k]) : acc[k] + E::load(p.e[k]);
    first = false;
  }
  Pack o;
  if (first) o.v = V{};
  else round_into<D, V>(o, acc);
  return o.v;
}

// Vectors [0, total) of a block's sums, thread by thread, kUnroll vectors in
// flight per thread. row_of(i, src, out) selects vector i's sources (mask
// returned) and points `out` at its output vector.
template <DType D, typename V, typename RowOf>
RC_DEVICE void block_sum(uint32_t total, RowOf row_of) {
  const uint32_t nt = kThreads;
  for (uint32_t i0 = threadIdx.x; i0 < total; i0 += nt * kUnroll) {
    V res[kUnroll];
    V* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * nt;
      if (i >= total) continue;
      ConstRankPtrs src;
      uint32_t v;
      const uint32_t mask = row_of(i, src, dst[u], v);
      res[u] = sum_one<D, V>(src, mask, v);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * nt < total) *dst[u] = res[u];
  }
}

template <DType D, typename V>
RC_DEVICE void sum_vectors(char* out, const ConstRankPtrs& src, uint32_t mask, int64_t begin, int64_t end) {
  if (end <= begin) return;
  block_sum<D, V>(uint32_t(end - begin), [&](uint32_t i, ConstRankPtrs& s, V*& dst, uint32_t& v) {
    s = src;
    v = uint32_t(begin + i);
    dst = reinterpret_cast<V*>(out) + v;
    return mask;
  });
}

// Element range [e0, e1) of a sum: 16-byte vectors where everything is
// aligned, single elements for the rest.
template <DType D>
RC_DEVICE void sum_elements(char* out, const ConstRankPtrs& src, uint32_t mask, int64_t e0, int64_t e1,
                            bool aligned) {
  using Raw = typename Elem<D>::Raw;
  constexpr int kPerVec = 16 / sizeof(Raw);
  int64_t scalar_from = e0;
  if (aligned && e0 % kPerVec == 0) {
    const int64_t v1 = e1 / kPerVec;
    sum_vectors<D, uint4>(out, src, mask, e0 / kPerVec, v1);
    scalar_from = v1 * kPerVec > e0 ? v1 * kPerVec : e0;
  }
  sum_vectors<D, Raw>(out, src, mask, scalar_from, e1);
}

}  // namespace gpu
}  // namespace rdna4_comm
