// What the kernels share, said once: float32/bfloat16 loads and stores, the dtype dispatch,
// compile-time unrolling of register-blocked loops, a vectorisable exp and a 16 x 16 transpose.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {

// ---------------------------------------------------------------------------------------------
// Element types: float32 as is; bfloat16 is the high 16 bits of a float32.

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// float32 -> T: bfloat16 rounded to nearest even (as torch's .to(bfloat16)), NaN stays NaN.
// Written on the bits so that loops over it vectorise.
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  c10::BFloat16 result;
  std::memcpy(&result, &out, sizeof(out));
  return result;
}

// Calls fn(T{}) with T the element type of `type`: float (float32) or c10::BFloat16. Any other
// dtype is refused with "<what>: only float32 and bfloat16 are supported".
template <typename Fn>
inline void dispatch_dtype(c10::ScalarType type, const char* what, Fn&& fn) {
  if (type == c10::ScalarType::Float) {
    fn(float{});
  } else if (type == c10::ScalarType::BFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, what, ": only float32 and bfloat16 are supported");
  }
}

// ---------------------------------------------------------------------------------------------
// Compile-time unrolling. A register-blocked loop is compiled once per block size; these turn a
// runtime size into the matching instantiation.

template <int N>
using Int = std::integral_constant<int, N>;

// fn(Int<n>{}) for a runtime n in [1, Max].
template <int Max, typename Fn>
inline void with_constant(int n, Fn&& fn) {
  if constexpr (Max == 1) {
    fn(Int<1>{});
  } else if (n >= Max) {
    fn(Int<Max>{});
  } else {
    with_constant<Max - 1>(n, fn);
  }
}

// fn(Int<0>{}), fn(Int<1>{}) ... fn(Int<N - 1>{}), in that order: a loop unrolled with its index
// known at compile time.
template <typename Fn, int... I>
inline void unrolled_each(Fn&& fn, std::integer_sequence<int, I...>) {
  (fn(Int<I>{}), ...);
}
template <int N, typename Fn>
inline void unrolled(Fn&& fn) {
  unrolled_each(fn, std::make_integer_sequence<int, N>{});
}

// fn(begin, Int<n>{}) for [0, total) in consecutive chunks of n = Max (the last one shorter).
template <int Max, typename Fn>
inline void for_chunks(int total, Fn&& fn) {
  for (int begin = 0; begin < total; begin += Max) {
    with_constant<Max>(total - begin, [&](auto n) { fn(begin, n); });
  }
}

// ---------------------------------------------------------------------------------------------
// exp for x <= 0 (scores minus their running max), vectorisable: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by a degree-6 polynomial, 2^n by building the exponent bits. Relative error ~2e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, x));
  float p = 1.3981999507e-3f;
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// In place: afterwards m[c] lane r is what m[r] lane c was (16 x 16 32-bit elements).
// Always inlined: called out of line (through the PLT, the rows in memory) it cost the AMX
// prefill attention, which transposes each item's queries and outputs, 5-7%.
__attribute__((always_inline)) inline void transpose16x16_epi32(__m512i m[16]) {
  __m512i u[16];
  for (int i = 0; i < 8; ++i) {  // within 128-bit lanes: rows 2i, 2i+1 interleaved
    u[2 * i] = _mm512_unpacklo_epi32(m[2 * i], m[2 * i + 1]);
    u[2 * i + 1] = _mm512_unpackhi_epi32(m[2 * i], m[2 * i + 1]);
  }
  __m512i v[16];  // v[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = _mm512_unpacklo_epi64(u[4 * i], u[4 * i + 2]);
    v[4 * i + 1] = _mm512_unpackhi_epi64(u[4 * i], u[4 * i + 2]);
    v[4 * i + 2] = _mm512_unpacklo_epi64(u[4 * i + 1], u[4 * i + 3]);
    v[4 * i + 3] = _mm512_unpackhi_epi64(u[4 * i + 1], u[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i w0 = _mm512_shuffle_i32x4(v[k], v[4 + k], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(v[k], v[4 + k], 0xEE);
    const __m512i w2 = _mm512_shuffle_i32x4(v[8 + k], v[12 + k], 0x44);
    const __m512i w3 = _mm512_shuffle_i32x4(v[8 + k], v[12 + k], 0xEE);
    m[k] = _mm512_shuffle_i32x4(w0, w2, 0x88);
    m[4 + k] = _mm512_shuffle_i32x4(w0, w2, 0xDD);
    m[8 + k] = _mm512_shuffle_i32x4(w1, w3, 0x88);
    m[12 + k] = _mm512_shuffle_i32x4(w1, w3, 0xDD);
  }
}

// exp_nonpositive on 16 lanes, the same operations in the same order (so the same results).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(
      n, _mm512_set1_ps(-0.693145751953125f),
      _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), x));
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace kvserve
