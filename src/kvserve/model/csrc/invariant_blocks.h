// invariant_linear.cpp's register blocks: out[r][c] = x_r . w_c for up to 4 x 4 rows and
// columns, each element one chain of vector multiply-adds over k in steps of one register (32
// bf16 pairs with vdpbf16ps, or 16 float32 with an FMA), a zero-padded masked load for the
// last partial step, then one fixed horizontal sum; without AVX-512, 16 partial sums in a
// fixed order. Only intrinsics and fast_math.h, so tools/avx512_check.py can run it under an
// emulator.
#pragma once

#include "fast_math.h"

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace invariant {

#if defined(__AVX512F__)
// How one register step multiplies: elements per step, the masked load, the multiply-add.
struct F32Step {
  using T = float;
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static Reg load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
  static __m512 madd(__m512 acc, Reg a, Reg b) { return _mm512_fmadd_ps(a, b, acc); }
  static __mmask16 tail_mask(int64_t left) {
    return static_cast<__mmask16>((1u << left) - 1u);
  }
};

#if defined(__AVX512BF16__)
struct Bf16Step {
  using T = c10::BFloat16;
  using Reg = __m512bh;
  static constexpr int kWidth = 32;
  static Reg load(const c10::BFloat16* p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
  }
  static __m512 madd(__m512 acc, Reg a, Reg b) { return _mm512_dpbf16_ps(acc, a, b); }
  static __mmask32 tail_mask(int64_t left) {
    return static_cast<__mmask32>((1ull << left) - 1ull);
  }
};
#endif

// out[r][c] for RN rows of x and CN rows of w (<= 4 each): RN x CN chains over k.
template <typename Step, int RN, int CN>
void block_simd(const typename Step::T* x, const typename Step::T* w, int64_t k_dim,
                float* out, int64_t out_stride) {
  __m512 acc[RN][CN];
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm512_setzero_ps();
  const auto full = Step::tail_mask(Step::kWidth);
  for (int64_t k = 0; k < k_dim; k += Step::kWidth) {
    const auto mask = k + Step::kWidth <= k_dim ? full : Step::tail_mask(k_dim - k);
    typename Step::Reg wv[CN];
    for (int c = 0; c < CN; ++c) wv[c] = Step::load(w + c * k_dim + k, mask);
    for (int r = 0; r < RN; ++r) {
      const typename Step::Reg xv = Step::load(x + r * k_dim + k, mask);
      for (int c = 0; c < CN; ++c) acc[r][c] = Step::madd(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

// The same without intrinsics: 16 partial sums per element, k in steps of 16, then summed
// in a fixed order; the compiler may vectorise it but may not reorder the sums (no
// -ffast-math).
template <typename T, int RN, int CN>
void block_generic(const T* x, const T* w, int64_t k_dim, float* out, int64_t out_stride) {
  for (int r = 0; r < RN; ++r) {
    for (int c = 0; c < CN; ++c) {
      float part[16] = {};
      const T* xr = x + r * k_dim;
      const T* wc = w + c * k_dim;
      for (int64_t k = 0; k < k_dim; ++k) part[k % 16] += to_float(xr[k]) * to_float(wc[k]);
      float sum = 0.0f;
      for (int i = 0; i < 16; ++i) sum += part[i];
      out[r * out_stride + c] = sum;
    }
  }
}

template <typename T, int RN, int CN>
void block(const T* x, const T* w, int64_t k_dim, float* out, int64_t out_stride) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    return block_simd<F32Step, RN, CN>(x, w, k_dim, out, out_stride);
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return block_simd<Bf16Step, RN, CN>(x, w, k_dim, out, out_stride);
  }
#endif
#endif
  block_generic<T, RN, CN>(x, w, k_dim, out, out_stride);
}

}  // namespace invariant
}  // namespace kvserve
