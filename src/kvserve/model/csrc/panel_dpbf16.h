// bf16 projections on AVX512-BF16 CPUs (a Zen 4, say): out[t][n] = sum_k x[t][k] * w[n][k] with
// x and w bfloat16 and the sums in float32, by vdpbf16ps on weights packed at load in panels of
// 16 output columns (llama.pack_pair_panels). panel_linear.cpp binds it; this header is
// freestanding (intrinsics only, no library calls) so that tools/avx512_check.py can
// compile the same loops into a flat binary and run them under an x86 emulator on a CPU
// without AVX-512.
//
// Layout: panel p is [k / 2][16][2] bfloat16: for each pair of k (2q, 2q + 1), column j's two
// weights side by side, 2q in the low half of 32-bit element j. A row's pair x[2q], x[2q + 1]
// read as one 32-bit value and broadcast has the same shape, so one vdpbf16ps adds both
// products of 16 columns: per pair of k one 64-byte load of the panel and, per row, one
// broadcast and one vdpbf16ps. A block of up to 12 rows keeps 12 accumulators, the weights and
// a broadcast in AVX-512's 32 registers. Each output is one chain over k in order, so a row's
// result does not depend on the other rows of the call.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace kvserve {
namespace dpbf16 {

constexpr int kPanel = 16;  // output columns per panel
constexpr int kRows = 12;   // rows per register block

#if defined(__AVX512BF16__)
// vdpbf16ps: per float32 lane, acc + x.hi * w.hi + x.lo * w.lo.
struct NativeDot {
  static __m512 dot(__m512 acc, __m512i x_pair, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x_pair, (__m512bh)w);
  }
};
#endif

#if defined(__AVX512F__)
// The same sum with AVX-512F alone: the high halves' product, then the low halves', each a
// float32 FMA (the order of the instruction's pseudo-code). Not used by the extension:
// tools/avx512_check.py runs it beside NativeDot, so the loops are checked even where an
// emulator lacks AVX512-BF16; a real CPU's vdpbf16ps may round differently.
struct WidenDot {
  static __m512 dot(__m512 acc, __m512i x_pair, __m512i w) {
    const __m512i high = _mm512_set1_epi32(-65536);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x_pair, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(w, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x_pair, 16)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
  }
};

inline __m512i broadcast_pair(const uint16_t* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// out[r][c] for RN rows of x (ldx apart) and one panel's ncols columns.
template <typename Dot, int RN>
inline void block(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t k_pairs,
                  float* out, int64_t ldo, int ncols) {
  __m512 acc[RN];
#pragma GCC unroll 16
  for (int r = 0; r < RN; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t q = 0; q < k_pairs; ++q) {
    const __m512i w = _mm512_loadu_si512(panel + 2 * kPanel * q);
#pragma GCC unroll 16
    for (int r = 0; r < RN; ++r) acc[r] = Dot::dot(acc[r], broadcast_pair(x + r * ldx + 2 * q), w);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << ncols) - 1u);
#pragma GCC unroll 16
  for (int r = 0; r < RN; ++r) _mm512_mask_storeu_ps(out + r * ldo, keep, acc[r]);
}

// block<Dot, n> for a run-time n in 1..kRows.
template <typename Dot, int N = kRows>
inline void block_of(int n, const uint16_t* x, int64_t ldx, const uint16_t* panel,
                     int64_t k_pairs, float* out, int64_t ldo, int ncols) {
  if constexpr (N == 1) {
    block<Dot, 1>(x, ldx, panel, k_pairs, out, ldo, ncols);
  } else if (n == N) {
    block<Dot, N>(x, ldx, panel, k_pairs, out, ldo, ncols);
  } else {
    block_of<Dot, N - 1>(n, x, ldx, panel, k_pairs, out, ldo, ncols);
  }
}

// All rows of x [rows][2 * k_pairs] against one panel: out[r][0..ncols), ldo apart.
template <typename Dot>
inline void panel_rows(const uint16_t* x, int64_t rows, const uint16_t* panel, int64_t k_pairs,
                       float* out, int64_t ldo, int ncols) {
  const int64_t ldx = 2 * k_pairs;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int n = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
    block_of<Dot>(n, x + r0 * ldx, ldx, panel, k_pairs, out + r0 * ldo, ldo, ncols);
  }
}
#endif

}  // namespace dpbf16
}  // namespace kvserve
