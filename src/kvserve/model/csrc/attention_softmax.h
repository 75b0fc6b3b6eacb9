// One step of the online softmax that paged_attention.cpp runs per tile of keys: each query
// row's running max m and sum l updated with the tile's scores, which become probabilities,
// and its accumulator rescaled by exp(m_old - m_new). AVX-512 where the build has it (the
// row maximum on 16 lanes, exp_nonpositive16 on whole registers with a mask for the last),
// AVX2 for the maximum, else loops the compiler vectorises. Only intrinsics and fast_math.h,
// so tools/avx512_check.py can run it under an emulator.
#pragma once

#include "fast_math.h"

#include <algorithm>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve {

// The largest of s[0 .. n), n > 0.
inline float row_max(const float* s, int n) {
  float best = -std::numeric_limits<float>::infinity();
  int t = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_set1_ps(best);
  for (; t + 16 <= n; t += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(s + t));
  best = _mm512_reduce_max_ps(lanes);
#elif defined(__AVX2__)
  __m256 lanes = _mm256_set1_ps(best);
  for (; t + 8 <= n; t += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + t));
  alignas(32) float each[8];
  _mm256_store_ps(each, lanes);
  for (const float x : each) best = std::max(best, x);
#endif
  for (; t < n; ++t) best = std::max(best, s[t]);
  return best;
}

// s[t] = exp(s[t] - max) for t < n and 0 for n <= t < stride; returns the sum of the first.
inline float exponentiate_row(float* s, int n, int stride, float max) {
  int t = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  if (stride % 16 == 0) {
    __m512 sums = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(max);
    for (; t < n; t += 16) {
      const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1u);
      const __m512 p = _mm512_maskz_mov_ps(
          live, kvserve::exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift)));
      _mm512_storeu_ps(s + t, p);
      sums = _mm512_add_ps(sums, p);
    }
    for (; t < stride; t += 16) _mm512_storeu_ps(s + t, _mm512_setzero_ps());
    return _mm512_reduce_add_ps(sums);
  }
#endif
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) {
    const float p = exp_nonpositive(s[i] - max);
    s[i] = p;
    sum += p;
  }
  for (t = n; t < stride; ++t) s[t] = 0.0f;
  return sum;
}

// One step for the rows of a tile. scores/probs: [rows][stride]; visible[r] is how many of the
// tile's keys row r sees (a prefix). Updates m, l, acc in place; afterwards row r's
// probabilities are zero from visible[r] on.
template <int D>
inline void softmax_step(float* scores, int rows, int stride, const int* visible, float* m,
                         float* l, float* acc, int head_dim) {
  const int dim = D > 0 ? D : head_dim;
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    const int n = visible[r];
    float* a = acc + r * dim;
    if (n == 0) {  // a query that sees none of this tile's keys: it adds nothing
      std::fill(s, s + stride, 0.0f);
      continue;
    }
    const float m_new = std::max(m[r], row_max(s, n));
    const float alpha = exp_nonpositive(m[r] - m_new);  // m = -inf at first: exp -> 0
    const float sum = exponentiate_row(s, n, stride, m_new);
    if (alpha != 1.0f) {
#pragma omp simd
      for (int d = 0; d < dim; ++d) a[d] *= alpha;
    }
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
  }
}

}  // namespace kvserve
