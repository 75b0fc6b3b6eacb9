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

// What to prefetch while a tile computes: the window's rows (the next keys of the thread's
// stream, in address order), each cut into `pieces` head-sized pieces of `dim` elements from
// rows[r] + offset, fetched one piece per key the tile's calls visit, `lines` cache lines each.
// A cursor: fetch() takes the next piece, and from(i) starts a call's share at piece i. Spread
// over the keys this way, the fetch of the next tile runs under this tile's arithmetic instead
// of before it. size 0: nothing to prefetch.
template <typename T>
struct Ahead {
  const T* const* rows = nullptr;
  int size = 0;              // rows in the window
  std::ptrdiff_t offset = 0;  // elements from a row pointer to its first piece (K 0, V to_v)
  int pieces = 1;            // per row
  int dim = 0;               // elements per piece
  int lines = 0;             // cache lines per piece
  int row = 0, piece = 0;    // the cursor: the next piece to fetch

  Ahead from(int first) const {
    Ahead at = *this;
    at.row = first / pieces;
    at.piece = first % pieces;
    return at;
  }

  // Inlined: out of line, each call went through the PLT (2-3% of decode's time).
  __attribute__((always_inline)) void fetch() {
    if (row >= size) return;
    const char* p = reinterpret_cast<const char*>(rows[row] + offset + piece * dim);
    for (int i = 0; i < lines; ++i) prefetch_l2(p + 64 * i);  // prefetch.h
    if (++piece == pieces) {
      piece = 0;
      ++row;
    }
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

// The transpose-and-add of 16 vectors (lane t of the result: the sum of the lanes of vector t)
// as a binary tree over the vectors in order: fold16<L> joins two neighbouring subtrees of
// 2^L vectors each, halving their partial sums' width; finish16 puts the lanes in order.
template <int L>
inline __m512 fold16(__m512 a, __m512 b) {
  if constexpr (L == 0) {  // 512 -> 256 bits per vector: lo of a with lo of b, hi with hi
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  } else if constexpr (L == 1) {  // 128-bit lanes: 4 vectors' partials
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  } else if constexpr (L == 2) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  } else {
    static_assert(L == 3, "16 vectors: four levels");
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  }
}
inline __m512 finish16(__m512 r) {
  // Element 4j + k of r now holds vector j + 4k; gather them back into order.
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
  static constexpr int kLevels = 4;  // of the transpose-and-add (KeySums)
  template <int L>
  static F fold(F a, F b) { return fold16<L>(a, b); }
  static F finish(F r) { return finish16(r); }
  static void store_first(float* p, F v, int n) {  // lanes 0..n-1
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
  }
};
#endif

// ---------------------------------------------------------------------------------------------
// The same vectors on AVX2 + FMA: 8 float32 lanes.

#if defined(KVSERVE_AVX2_TILES)
// The transpose-and-add of 8 vectors as Vec16's, on 8 lanes: two rounds of vhaddps within the
// 128-bit halves, then the halves of the two 4-vector subtrees added across.
template <int L>
inline __m256 fold8(__m256 a, __m256 b) {
  if constexpr (L < 2) {
    return _mm256_hadd_ps(a, b);
  } else {
    static_assert(L == 2, "8 vectors: three levels");
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
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
  static constexpr int kLevels = 3;
  template <int L>
  static F fold(F a, F b) { return fold8<L>(a, b); }
  static F finish(F r) { return r; }
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

// The lane sums of V::kLanes keys' partial vectors per row (lane t of sums[g]: the sum of key
// t's vector for row g), the transpose-and-add's tree folded as its leaves arrive in key
// order: at most one vector per level waits, per row. (Holding all the keys' vectors for the
// transpose at the end, GN x 16 of them, spilled them to the stack.)
template <typename V, int GN>
struct KeySums {
  using F = typename V::F;
  F waiting[V::kLevels][GN];
  F sums[GN];

  // Key T's vectors (p is consumed).
  template <int T, int L = 0>
  void add(F (&p)[GN]) {
    if constexpr (L == V::kLevels) {
      for (int g = 0; g < GN; ++g) sums[g] = V::finish(p[g]);
    } else if constexpr (((T >> L) & 1) != 0) {
      for (int g = 0; g < GN; ++g) p[g] = V::template fold<L>(waiting[L][g], p[g]);
      add<T, L + 1>(p);
    } else {
      for (int g = 0; g < GN; ++g) waiting[L][g] = p[g];
    }
  }
};

// scores[g * stride + t] = q_g . k_t for GN query rows (GN <= 4) and the tile's keys
// k_t = rows[t] + off; head_dim is NV registers of Dot::kWidth (NV = 0: known at run time).
// As many keys at a time as a vector has lanes: per key and row a vector of partial sums, whose
// lane sums (KeySums) are their scores.
template <typename Dot, int GN, int NV>
void dots_simd(const typename Dot::Query* q, int head_dim, const typename Dot::Key* const* rows,
               std::ptrdiff_t off, int count, float* scores, int stride,
               Ahead<typename Dot::Key> ahead) {
  using V = typename Dot::Vec;
  constexpr int kKeys = V::kLanes;
  const int nv = NV > 0 ? NV : head_dim / Dot::kWidth;
  const typename Dot::template Rows<GN, NV> query(q, head_dim);
  for (int t0 = 0; t0 < count; t0 += kKeys) {
    const int tn = std::min(kKeys, count - t0);
    KeySums<V, GN> sums;
    unrolled<kKeys>([&](auto key) {
      constexpr int t = decltype(key)::value;
      typename V::F acc[GN];
      for (int g = 0; g < GN; ++g) acc[g] = V::zero();
      if (t < tn) {
        ahead.fetch();
        const typename Dot::Key* k = rows[t0 + t] + off;
        for (int v = 0; v < nv; ++v) {
          const auto key_part = Dot::load_key(k + Dot::kWidth * v);
          for (int g = 0; g < GN; ++g) acc[g] = Dot::madd(acc[g], query(g, v), key_part);
        }
      }
      sums.template add<t>(acc);
    });
    for (int g = 0; g < GN; ++g) V::store_first(scores + g * stride + t0, sums.sums[g], tn);
  }
}

// dots_simd over a GQA group's query rows, four at a time.
template <typename Dot, int NV>
void dots_groups(const typename Dot::Query* q, int group, int head_dim,
                 const typename Dot::Key* const* rows, std::ptrdiff_t off, int count,
                 float* scores, int stride, const Ahead<typename Dot::Key>& ahead) {
  for_chunks<4>(group, [&](int g0, auto gn) {
    dots_simd<Dot, decltype(gn)::value, NV>(q + g0 * head_dim, head_dim, rows, off, count,
                                            scores + g0 * stride, stride,
                                            g0 == 0 ? ahead : Ahead<typename Dot::Key>{});
  });
}

// acc[g] += sum_t p[g][t] * v_t for GN rows x VN vectors of the accumulator, held in
// registers over the whole tile.
template <typename V, typename T, int GN, int VN>
void accumulate_simd(float* acc, int head_dim, const T* const* rows, std::ptrdiff_t off,
                     int count, const float* probs, int stride, Ahead<T> ahead) {
  constexpr int kLanes = V::kLanes;
  typename V::F a[GN][VN];
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < VN; ++v) a[g][v] = V::load(acc + g * head_dim + kLanes * v);
  for (int t = 0; t < count; ++t) {
    ahead.fetch();
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
                       const Ahead<T>& ahead) {
  for_chunks<4>(group, [&](int g0, auto gn) {
    for_chunks<V::kMaxVectors>(head_dim / V::kLanes, [&](int v0, auto vn) {
      accumulate_simd<V, T, decltype(gn)::value, decltype(vn)::value>(
          acc + g0 * head_dim + V::kLanes * v0, head_dim, rows, off + V::kLanes * v0, count,
          probs + g0 * stride, stride, g0 == 0 && v0 == 0 ? ahead : Ahead<T>{});
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
                  Ahead<T> ahead) {
  const int dim = D > 0 ? D : head_dim;
  for (int t = 0; t < count; ++t) {
    ahead.fetch();
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
                        Ahead<T> ahead) {
  const int dim = D > 0 ? D : head_dim;
  for (int t = 0; t < count; ++t) {
    ahead.fetch();
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
                 int stride, const Ahead<T>& ahead = {}) {
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
                              const Ahead<T>& ahead = {}) {
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
