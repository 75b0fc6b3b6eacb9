// The arithmetic of one attention tile: the scores of a GQA group's query rows against the
// tile's keys, and the probability-weighted sum of its values. AVX-512 intrinsics where the
// build has them and head_dim is a multiple of 16 (with AVX512-BF16 dot products for a bf16
// model); AVX2 + FMA intrinsics where that is the best the build has and head_dim is a
// multiple of 8; else loops the compiler vectorises. Used by paged_attention.cpp.
//
// The two intrinsic tiers share one code: dots_simd and accumulate_simd are written against
// a vector type (Vec16: AVX-512's 16 float32 lanes; Vec8: AVX2's 8), which is all that
// differs between them.
#pragma once

#include "fast_math.h"
#include "prefetch.h"

#include <algorithm>
#include <cstddef>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The AVX2 tier: a build for a CPU with AVX2 and FMA but no AVX-512 (a Zen 3, say).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KVSERVE_AVX2_TILES 1
#endif

namespace kvserve {

// Addresses to prefetch while a tile computes (the next tile's rows, in address order): the
// call visiting the tile's key t prefetches `lines` cache lines from at[t] into L2. Spread over
// the keys this way, the fetch of the next tile runs under this tile's arithmetic instead of
// before it. at == nullptr: nothing to prefetch.
struct Ahead {
  const char* const* at = nullptr;
  int lines = 0;

  void fetch(int t) const {
    const char* p = at[t];
    for (int i = 0; i < lines; ++i) prefetch_l2(p + 64 * i);  // prefetch.h
  }
};

// ---------------------------------------------------------------------------------------------
// AVX-512's float32 vectors: 16 lanes.

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Sums each of 16 vectors: lane t of the result is the sum of the lanes of v[t].
inline __m512 transpose_sum16(__m512 v[16]) {
  // Step 1: pairs (0,1) ... fold 512 -> 256 bits: lo of a with lo of b, hi with hi.
  __m512 s8[8];
  for (int i = 0; i < 8; ++i) {
    __m512 a = v[2 * i], b = v[2 * i + 1];
    __m512 lo = _mm512_shuffle_f32x4(a, b, 0x44);  // a0 a1 b0 b1 (128-bit lanes)
    __m512 hi = _mm512_shuffle_f32x4(a, b, 0xEE);  // a2 a3 b2 b3
    s8[i] = _mm512_add_ps(lo, hi);                 // [a01+a23 | b01+b23] as 2x256
  }
  __m512 s4[4];
  for (int i = 0; i < 4; ++i) {
    __m512 a = s8[2 * i], b = s8[2 * i + 1];
    __m512 lo = _mm512_shuffle_f32x4(a, b, 0x88);  // a0 a2 b0 b2
    __m512 hi = _mm512_shuffle_f32x4(a, b, 0xDD);  // a1 a3 b1 b3
    s4[i] = _mm512_add_ps(lo, hi);  // 128-bit lanes: token 4i, 4i+1, 4i+2, 4i+3 partials
  }
  __m512 s2[2];
  for (int i = 0; i < 2; ++i) {
    __m512 a = s4[2 * i], b = s4[2 * i + 1];
    __m512 lo = _mm512_shuffle_ps(a, b, 0x44);  // per 128: a0 a1 b0 b1
    __m512 hi = _mm512_shuffle_ps(a, b, 0xEE);  // a2 a3 b2 b3
    s2[i] = _mm512_add_ps(lo, hi);
  }
  __m512 lo = _mm512_shuffle_ps(s2[0], s2[1], 0x88);  // a0 a2 b0 b2
  __m512 hi = _mm512_shuffle_ps(s2[0], s2[1], 0xDD);  // a1 a3 b1 b3
  __m512 r = _mm512_add_ps(lo, hi);
  // Element 4j + k of r now holds token j + 4k; gather them back into token order.
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, r);
}

// AVX-512's float32 vectors, as dots_simd and accumulate_simd use them.
struct Vec16 {
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxVectors = 4;  // of one row per accumulate_simd call (32 registers)
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const c10::BFloat16* p) { return load16(p); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F sum_each(F v[16]) { return transpose_sum16(v); }
  static void store_first(float* p, F v, int n) {  // lanes 0..n-1
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
  }
};
#endif

// ---------------------------------------------------------------------------------------------
// The same vectors on AVX2 + FMA: 8 float32 lanes.

#if defined(KVSERVE_AVX2_TILES)
// Lane t of the result is the sum of the eight lanes of v[t].
inline __m256 transpose_sum8(const __m256 v[8]) {
  // Per 128-bit half: a holds the sums of v[0..3] over that half's four lanes, b of v[4..7].
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

struct Vec8 {
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxVectors = 2;  // GN x 2 accumulators, 2 values, a probability: 16
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::BFloat16* p) {  // widened: bf16 is float32's upper half
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F sum_each(F v[8]) { return transpose_sum8(v); }
  static void store_first(float* p, F v, int n) {  // lanes 0..n-1
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::copy(lanes, lanes + n, p);
  }
};
#endif

// ---------------------------------------------------------------------------------------------
// Dot products of a group's query rows with the tile's keys, and the V accumulation, in either
// tier's vectors V.

#if defined(__AVX512F__) || defined(KVSERVE_AVX2_TILES)
// How dots_simd multiplies query rows by a key row, one register of the key at a time.
//
// FloatDot: float32 queries, float32 or bfloat16 keys widened to float32 lanes, an FMA. The
// query registers are re-read (from L1) at each use: GN x NV of them would not stay in registers.
template <typename V, typename T>
struct FloatDot {
  using Vec = V;
  using Query = float;
  using Key = T;
  static constexpr int kWidth = V::kLanes;  // key elements per register
  template <int GN, int NV>
  struct Rows {
    const float* q;
    int head_dim;
    Rows(const float* q_rows, int dim) : q(q_rows), head_dim(dim) {}
    typename V::F operator()(int g, int v) const { return V::load(q + g * head_dim + kWidth * v); }
  };
  static typename V::F load_key(const T* k) { return V::load(k); }
  static typename V::F madd(typename V::F acc, typename V::F q, typename V::F k) {
    return V::fmadd(q, k, acc);
  }
};

#if defined(__AVX512BF16__)
// Bf16Dot: bfloat16 queries and keys. vdpbf16ps multiplies 32 bf16 pairs (exact products in
// float32) and adds them into 16 float32 lanes, with no widening of the keys. A bf16 model's q
// scaled by 1/sqrt(64) or 1/sqrt(128) is exact in bf16, so only the summation order changes.
// The GN x NV query registers (NV = head_dim / 32 <= 4) stay loaded for the whole tile.
struct Bf16Dot {
  using Vec = Vec16;
  using Query = c10::BFloat16;
  using Key = c10::BFloat16;
  static constexpr int kWidth = 32;
  template <int GN, int NV>
  struct Rows {
    static_assert(NV > 0, "the bf16 dot products need head_dim known at compile time");
    __m512bh reg[GN][NV];
    Rows(const c10::BFloat16* q, int head_dim) {
      for (int g = 0; g < GN; ++g)
        for (int v = 0; v < NV; ++v)
          reg[g][v] = (__m512bh)_mm512_loadu_si512(q + g * head_dim + 32 * v);
    }
    __m512bh operator()(int g, int v) const { return reg[g][v]; }
  };
  static __m512bh load_key(const c10::BFloat16* k) {
    return (__m512bh)_mm512_loadu_si512(k);
  }
  static __m512 madd(__m512 acc, __m512bh q, __m512bh k) { return _mm512_dpbf16_ps(acc, q, k); }
};
#endif

// scores[g * stride + t] = q_g . k_t for GN query rows (GN <= 4) and the tile's keys
// k_t = rows[t] + off; head_dim is NV registers of Dot::kWidth (NV = 0: known at run time).
// As many keys at a time as a vector has lanes: per key and row a vector of partial sums, then
// one transpose-and-add gives their scores.
template <typename Dot, int GN, int NV>
void dots_simd(const typename Dot::Query* q, int head_dim, const typename Dot::Key* const* rows,
               std::ptrdiff_t off, int count, float* scores, int stride,
               const Ahead& ahead) {
  using V = typename Dot::Vec;
  constexpr int kKeys = V::kLanes;
  const int nv = NV > 0 ? NV : head_dim / Dot::kWidth;
  const typename Dot::template Rows<GN, NV> query(q, head_dim);
  for (int t0 = 0; t0 < count; t0 += kKeys) {
    const int tn = std::min(kKeys, count - t0);
    typename V::F part[GN][kKeys];
    for (int t = 0; t < kKeys; ++t) {
      typename V::F acc[GN];
      for (int g = 0; g < GN; ++g) acc[g] = V::zero();
      if (t < tn) {
        if (ahead.at) ahead.fetch(t0 + t);
        const typename Dot::Key* k = rows[t0 + t] + off;
        for (int v = 0; v < nv; ++v) {
          const auto key = Dot::load_key(k + Dot::kWidth * v);
          for (int g = 0; g < GN; ++g) acc[g] = Dot::madd(acc[g], query(g, v), key);
        }
      }
      for (int g = 0; g < GN; ++g) part[g][t] = acc[g];
    }
    for (int g = 0; g < GN; ++g)
      V::store_first(scores + g * stride + t0, V::sum_each(part[g]), tn);
  }
}

// dots_simd over a GQA group's query rows, four at a time.
template <typename Dot, int NV>
void dots_groups(const typename Dot::Query* q, int group, int head_dim,
                 const typename Dot::Key* const* rows, std::ptrdiff_t off, int count,
                 float* scores, int stride, const Ahead& ahead) {
  for_chunks<4>(group, [&](int g0, auto gn) {
    dots_simd<Dot, decltype(gn)::value, NV>(q + g0 * head_dim, head_dim, rows, off, count,
                                            scores + g0 * stride, stride,
                                            g0 == 0 ? ahead : Ahead{});
  });
}

// acc[g] += sum_t p[g][t] * v_t for GN rows x VN vectors of the accumulator, held in
// registers over the whole tile.
template <typename V, typename T, int GN, int VN>
void accumulate_simd(float* acc, int head_dim, const T* const* rows, std::ptrdiff_t off,
                     int count, const float* probs, int stride, const Ahead& ahead) {
  constexpr int kLanes = V::kLanes;
  typename V::F a[GN][VN];
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < VN; ++v) a[g][v] = V::load(acc + g * head_dim + kLanes * v);
  for (int t = 0; t < count; ++t) {
    if (ahead.at) ahead.fetch(t);
    const T* row = rows[t] + off;
    typename V::F x[VN];
    for (int v = 0; v < VN; ++v) x[v] = V::load(row + kLanes * v);
    for (int g = 0; g < GN; ++g) {
      const typename V::F p = V::set1(probs[g * stride + t]);
      for (int v = 0; v < VN; ++v) a[g][v] = V::fmadd(p, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < VN; ++v) V::store(acc + g * head_dim + kLanes * v, a[g][v]);
}

// accumulate_simd over a group's rows, four at a time, and each row's vectors, V::kMaxVectors
// at a time.
template <typename V, typename T>
void accumulate_groups(float* acc, int group, int head_dim, const T* const* rows,
                       std::ptrdiff_t off, int count, const float* probs, int stride,
                       const Ahead& ahead) {
  for_chunks<4>(group, [&](int g0, auto gn) {
    for_chunks<V::kMaxVectors>(head_dim / V::kLanes, [&](int v0, auto vn) {
      accumulate_simd<V, T, decltype(gn)::value, decltype(vn)::value>(
          acc + g0 * head_dim + V::kLanes * v0, head_dim, rows, off + V::kLanes * v0, count,
          probs + g0 * stride, stride, g0 == 0 && v0 == 0 ? ahead : Ahead{});
    });
  });
}
#endif

// ---------------------------------------------------------------------------------------------
// The same without intrinsics (any head_dim): loops the compiler vectorises.

// scores[g * stride + t] = q_g . k_t for the tile's keys, k_t = rows[t] + off; q is scaled.
template <typename T, int D>
void dots_generic(const float* q, int group, int head_dim, const T* const* rows,
                  std::ptrdiff_t off, int count, float* scores, int stride,
                  const Ahead& ahead) {
  const int dim = D > 0 ? D : head_dim;
  for (int t = 0; t < count; ++t) {
    if (ahead.at) ahead.fetch(t);
    const T* k = rows[t] + off;
    for (int g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int d = 0; d < dim; ++d) s += qg[d] * to_float(k[d]);
      scores[g * stride + t] = s;
    }
  }
}

// acc[g] += sum_t p[g][t] * v_t, v_t = rows[t] + off.
template <typename T, int D>
void accumulate_generic(float* acc, int group, int head_dim, const T* const* rows,
                        std::ptrdiff_t off, int count, const float* probs, int stride,
                        const Ahead& ahead) {
  const int dim = D > 0 ? D : head_dim;
  for (int t = 0; t < count; ++t) {
    if (ahead.at) ahead.fetch(t);
    const T* v = rows[t] + off;
    for (int g = 0; g < group; ++g) {
      const float p = probs[g * stride + t];
      float* a = acc + g * dim;
#pragma omp simd
      for (int d = 0; d < dim; ++d) a[d] += p * to_float(v[d]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The choice of path, per call. D is head_dim when it is compiled in (64, 128), else 0.

// Whether the bf16 dot products apply: bfloat16 keys, bf16 queries scaled by a power of two (so
// rounding them back to bf16 loses nothing), a head_dim compiled in.
template <typename T, int D>
constexpr bool bf16_dots_compiled() {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> && D > 0;
#else
  return false;
#endif
}

// Scores of a group's query rows against the tile's keys: q (scaled float32 rows), or q_bf16,
// the same rows rounded to bf16, when the bf16 dot products apply (else null). ahead: the next
// tile's key rows to prefetch meanwhile (if any).
template <typename T, int D>
inline void dots(const float* q, const c10::BFloat16* q_bf16, int group, int head_dim,
                 const T* const* rows, std::ptrdiff_t off, int count, float* scores,
                 int stride, const Ahead& ahead = {}) {
#if defined(__AVX512BF16__)
  if constexpr (bf16_dots_compiled<T, D>()) {
    if (q_bf16 != nullptr) {
      return dots_groups<Bf16Dot, D / 32>(q_bf16, group, head_dim, rows, off, count, scores,
                                          stride, ahead);
    }
  }
#endif
  (void)q_bf16;
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {
    return dots_groups<FloatDot<Vec16, T>, D / 16>(q, group, head_dim, rows, off, count,
                                                   scores, stride, ahead);
  }
#endif
#if defined(KVSERVE_AVX2_TILES)
  if (head_dim % 8 == 0) {
    return dots_groups<FloatDot<Vec8, T>, D / 8>(q, group, head_dim, rows, off, count, scores,
                                                 stride, ahead);
  }
#endif
  dots_generic<T, D>(q, group, head_dim, rows, off, count, scores, stride, ahead);
}

// acc[g] += sum_t p[g][t] * v_t over the tile's value rows; ahead: the next tile's value rows to
// prefetch meanwhile (if any).
template <typename T, int D>
inline void accumulate_values(float* acc, int group, int head_dim, const T* const* rows,
                              std::ptrdiff_t off, int count, const float* probs, int stride,
                              const Ahead& ahead = {}) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {
    return accumulate_groups<Vec16, T>(acc, group, head_dim, rows, off, count, probs, stride,
                                      ahead);
  }
#endif
#if defined(KVSERVE_AVX2_TILES)
  if (head_dim % 8 == 0) {
    return accumulate_groups<Vec8, T>(acc, group, head_dim, rows, off, count, probs, stride,
                                      ahead);
  }
#endif
  accumulate_generic<T, D>(acc, group, head_dim, rows, off, count, probs, stride, ahead);
}

// fn(Int<D>{}) with D = head_dim for the sizes compiled in, else D = 0 (any head_dim).
template <typename Fn>
inline void with_head_dim(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 64: return fn(Int<64>{});
    case 128: return fn(Int<128>{});
    default: return fn(Int<0>{});
  }
}

}  // namespace kvserve
