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
// products of 16 columns: per pair of k one 64-byte load per panel and, per row, one broadcast
// and one vdpbf16ps per panel. A register block is up to 12 rows times up to 8 panels (fewer
// panels the more rows: panels_for), so that even one row has several independent chains to
// hide vdpbf16ps's latency and each broadcast serves several panels. Each output is one chain
// over k in order, so a row's result does not depend on the other rows of the call.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "prefetch.h"  // prefetch_l2

namespace kvserve {
namespace dpbf16 {

constexpr int kPanel = 16;     // output columns per panel
constexpr int kRows = 12;      // rows per register block
constexpr int kMaxPanels = 8;  // panels per register block

// Panels per register block of n rows: n x panels accumulators, the panels' vectors and a
// broadcast within AVX-512's 32 registers, at most kMaxPanels.
constexpr int panels_for(int n) { return 31 / (n + 1) < kMaxPanels ? 31 / (n + 1) : kMaxPanels; }

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

// A panel's 16 outputs of one row (the last panel's first columns only, under keep): float32,
// or bf16 rounded to nearest even (vcvtneps2bf16; torch's float-to-bf16 rounds so too).
inline void store_panel(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store_panel(float* out, __mmask16 keep, __m512 v) {
  _mm512_mask_storeu_ps(out, keep, v);
}
#if defined(__AVX512BF16__)
inline void store_panel(uint16_t* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_panel(uint16_t* out, __mmask16 keep, __m512 v) {
  _mm256_mask_storeu_epi16(out, keep, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// out[r][16 * p + c] for RN rows of x (ldx apart) and PN consecutive panels (each 32 * k_pairs
// elements on from the one before), all 16 columns of each but the last's first last_cols.
// ahead (or null): the next group of panels, prefetched line for line as this one is read,
// so that its weights come from L2 when its turn comes. A decode step's rows are few, so a
// group is read from memory once and briefly; left to the hardware the stream ran at 21 GB/s
// where a Zen 4 reads 28.
template <typename Dot, int RN, int PN, typename Out>
inline void block(const uint16_t* x, int64_t ldx, const uint16_t* panels, int64_t k_pairs,
                  Out* out, int64_t ldo, int last_cols, const uint16_t* ahead = nullptr) {
  const int64_t stride = 2 * kPanel * k_pairs;
  __m512 acc[RN][PN];
#pragma GCC unroll 16
  for (int r = 0; r < RN; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < PN; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t q = 0; q < k_pairs; ++q) {
    __m512i w[PN];
#pragma GCC unroll 8
    for (int p = 0; p < PN; ++p) w[p] = _mm512_loadu_si512(panels + p * stride + 2 * kPanel * q);
    if (ahead != nullptr) {
#pragma GCC unroll 8
      for (int p = 0; p < PN; ++p) prefetch_l2(ahead + p * stride + 2 * kPanel * q);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RN; ++r) {
      const __m512i pair = broadcast_pair(x + r * ldx + 2 * q);
#pragma GCC unroll 8
      for (int p = 0; p < PN; ++p) acc[r][p] = Dot::dot(acc[r][p], pair, w[p]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << last_cols) - 1u);
#pragma GCC unroll 16
  for (int r = 0; r < RN; ++r) {
#pragma GCC unroll 8
    for (int p = 0; p + 1 < PN; ++p) store_panel(out + r * ldo + kPanel * p, acc[r][p]);
    store_panel(out + r * ldo + kPanel * (PN - 1), keep, acc[r][PN - 1]);
  }
}

// block<Dot, RN, m> for a run-time m in 1..panels_for(RN).
template <typename Dot, int RN, int PN = panels_for(RN), typename Out>
inline void block_panels(int m, const uint16_t* x, int64_t ldx, const uint16_t* panels,
                         int64_t k_pairs, Out* out, int64_t ldo, int last_cols,
                         const uint16_t* ahead) {
  if constexpr (PN == 1) {
    block<Dot, RN, 1>(x, ldx, panels, k_pairs, out, ldo, last_cols, ahead);
  } else if (m == PN) {
    block<Dot, RN, PN>(x, ldx, panels, k_pairs, out, ldo, last_cols, ahead);
  } else {
    block_panels<Dot, RN, PN - 1>(m, x, ldx, panels, k_pairs, out, ldo, last_cols, ahead);
  }
}

// block<Dot, n, m> for a run-time n in 1..kRows (and m in 1..panels_for(n)).
template <typename Dot, int RN = kRows, typename Out>
inline void block_rows(int n, int m, const uint16_t* x, int64_t ldx, const uint16_t* panels,
                       int64_t k_pairs, Out* out, int64_t ldo, int last_cols,
                       const uint16_t* ahead) {
  if constexpr (RN == 1) {
    block_panels<Dot, 1>(m, x, ldx, panels, k_pairs, out, ldo, last_cols, ahead);
  } else if (n == RN) {
    block_panels<Dot, RN>(m, x, ldx, panels, k_pairs, out, ldo, last_cols, ahead);
  } else {
    block_rows<Dot, RN - 1>(n, m, x, ldx, panels, k_pairs, out, ldo, last_cols, ahead);
  }
}

// All rows of x [rows][2 * k_pairs] against the ceil(ncols / 16) consecutive panels from
// `panels`: out[r][0..ncols) (float32, or uint16_t for bf16), ldo apart. A group of panels at
// a time (panels_for the row block's size), all the rows through it, so the group's weights
// stay in cache for them; the first row block prefetches the next group (block's ahead).
template <typename Dot, typename Out>
inline void panel_rows(const uint16_t* x, int64_t rows, const uint16_t* panels, int64_t k_pairs,
                       Out* out, int64_t ldo, int64_t ncols) {
  const int64_t ldx = 2 * k_pairs;
  const int64_t count = (ncols + kPanel - 1) / kPanel;
  // Row blocks of equal size, at most kRows: 16 rows as 8 + 8 (3 panels each), not 12 + 4,
  // whose block of 4 rows has too few chains for 2 panels.
  const int64_t row_blocks = (rows + kRows - 1) / kRows;
  const int per_block = static_cast<int>((rows + row_blocks - 1) / row_blocks);
  const int group = panels_for(per_block);
  const int64_t stride = 2 * kPanel * k_pairs;
  for (int64_t p0 = 0; p0 < count; p0 += group) {
    const int m = static_cast<int>(count - p0 < group ? count - p0 : group);
    const int64_t rest = ncols - (p0 + m - 1) * kPanel;  // the group's last panel's columns
    const int last_cols = static_cast<int>(rest < kPanel ? rest : kPanel);
    // a whole next group only: block prefetches as many panels as it reads, never past
    // the range
    const uint16_t* next = p0 + m + group <= count ? panels + (p0 + m) * stride : nullptr;
    for (int64_t r0 = 0; r0 < rows; r0 += per_block) {
      const int n = static_cast<int>(rows - r0 < per_block ? rows - r0 : per_block);
      block_rows<Dot>(n, m, x + r0 * ldx, ldx, panels + p0 * stride, k_pairs,
                      out + r0 * ldo + p0 * kPanel, ldo, last_cols, r0 == 0 ? next : nullptr);
    }
  }
}
#endif

}  // namespace dpbf16
}  // namespace kvserve
