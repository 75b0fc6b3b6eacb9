// A prefill tile as two small matrix products: many query rows (a tile of queries times its
// GQA group) against one tile of keys. Two versions: bf16 dot products for a bf16 model on
// AVX512-BF16, and float32 on AVX2 + FMA (a Zen 3, say).
//
// attention_tile.h multiplies one key row by a few query rows and sums each 16-lane product
// across its lanes (a transpose per 16 keys and row): the right shape for decode, whose three
// or four query rows per kv head leave nothing to share. A prefill tile has tens of rows, so
// here the cost that does not depend on the rows is paid once per tile instead:
// - AVX512-BF16: the keys are repacked once into pairs-of-dimensions order ("VNNI": 32-bit
//   element j of key t is its dimensions 2j and 2j + 1), so a query row's scores for 16 keys
//   are D / 2 vdpbf16ps with the query's pair broadcast, and no lanes need summing. The value
//   pass likewise: the values repacked into pairs-of-keys order, each row's probabilities
//   rounded to bf16 (as torch's own CPU flash attention does for a bf16 model), and a block
//   of rows accumulates D / 16 vdpbf16ps per pair of keys in registers, half the
//   instructions of float32 multiply-adds per key (1.23x the whole bf16 tile on a Zen 4).
// - AVX2: the keys are transposed once to float32 [dimension][key], so a block of 6 query rows
//   and 16 keys is D steps of two key loads, six broadcasts and twelve FMAs, every score one
//   chain of FMAs over the dimensions with no lanes to sum. The values go through
//   accumulate_values per query as before (that pass was already FMA-bound).
// Used by paged_attention.cpp's prefill (head_dim 64 or 128), except under --batch-invariant:
// a row's scores here are summed in another order than decode's, so a token computed in a
// prefill (after a preemption, say) would not be bit-identical to the same token decoded.
#pragma once

#include "attention_tile.h"  // load16
#include "fast_math.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace kvserve {

// packed[j * stride + t] = dimensions (2j, 2j + 1) of key t = rows[t] + off, for j < D / 2
// and t < count rounded up to 16 (keys past count are zero). stride >= that rounded count.
template <int D>
void pack_keys(const c10::BFloat16* const* rows, std::ptrdiff_t off, int count,
               uint32_t* packed, int stride) {
  static_assert(D % 32 == 0, "whole registers of 32 bf16 per key");
  for (int t0 = 0; t0 < count; t0 += 16) {
    const int tn = std::min(16, count - t0);
    for (int h = 0; h < D / 32; ++h) {  // 16 pairs (one register of a key) at a time
      __m512i m[16];
      for (int t = 0; t < 16; ++t) {
        m[t] = t < tn ? _mm512_loadu_si512(rows[t0 + t] + off + 32 * h) : _mm512_setzero_si512();
      }
      transpose16x16_epi32(m);
      for (int c = 0; c < 16; ++c) {
        _mm512_storeu_si512(packed + static_cast<std::ptrdiff_t>(16 * h + c) * stride + t0,
                            m[c]);
      }
    }
  }
}

// scores[r * stride + t] = q_r . k_t for RN bf16 query rows (row r at q + r * D) and CN chunks
// of 16 packed keys starting at chunk c0.
template <int D, int RN, int CN>
inline void scores_block(const c10::BFloat16* q, const uint32_t* packed, int packed_stride,
                         int c0, float* scores, int stride) {
  __m512 acc[RN][CN];
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);  // row r's pair j: r * D/2 + j
  for (int j = 0; j < D / 2; ++j) {
    __m512bh keys[CN];
    for (int c = 0; c < CN; ++c) {
      keys[c] = (__m512bh)_mm512_loadu_si512(packed + j * packed_stride + 16 * (c0 + c));
    }
    for (int r = 0; r < RN; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * D / 2 + j]));
      for (int c = 0; c < CN; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, keys[c]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) _mm512_storeu_ps(scores + r * stride + 16 * (c0 + c), acc[r][c]);
}

// scores for nrows query rows against count packed keys (chunks of 16; the scores of padding
// keys past count are written too, as zeros' products).
template <int D>
void scores_packed(const c10::BFloat16* q, int nrows, const uint32_t* packed, int packed_stride,
                   int count, float* scores, int stride) {
  const int chunks = (count + 15) / 16;
  for_chunks<4>(chunks, [&](int c0, auto cn) {
    for_chunks<4>(nrows, [&](int r0, auto rn) {
      scores_block<D, decltype(rn)::value, decltype(cn)::value>(
          q + static_cast<std::ptrdiff_t>(r0) * D, packed, packed_stride, c0,
          scores + static_cast<std::ptrdiff_t>(r0) * stride, stride);
    });
  });
}

// packed[(t / 2) * D + d] = dimension d of value rows t and t + 1 (rows[t] + off) side by
// side, row t's in the low half, for even t < count (a missing last odd row is zero): the
// values in pairs-of-keys order, so that vdpbf16ps adds two keys' products per lane.
template <int D>
void pack_value_pairs(const c10::BFloat16* const* rows, std::ptrdiff_t off, int count,
                      uint32_t* packed) {
  static_assert(D % 32 == 0, "whole registers of 32 bf16 per value row");
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5,
                                                    37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);  // lanes 2i, 2i + 1: a[i], b[i]
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));  // a[16 + i], b[16 + i]
  for (int t = 0; t < count; t += 2) {
    const c10::BFloat16* a = rows[t] + off;
    const c10::BFloat16* b = t + 1 < count ? rows[t + 1] + off : nullptr;
    uint32_t* dst = packed + static_cast<std::ptrdiff_t>(t / 2) * D;
    for (int h = 0; h < D / 32; ++h) {
      const __m512i va = _mm512_loadu_si512(a + 32 * h);
      const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + 32 * h) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 32 * h, _mm512_permutex2var_epi16(va, low, vb));
      _mm512_storeu_si512(dst + 32 * h + 16, _mm512_permutex2var_epi16(va, high, vb));
    }
  }
}

// pairs[r * pair_stride + j] = row r's probabilities 2j and 2j + 1 rounded to bf16 (2j in the
// low half), for j < (count + 1) / 2; probs: [nrows][stride], stride a multiple of 16.
inline void probability_pairs(const float* probs, int nrows, int stride, int count,
                              uint32_t* pairs, int pair_stride) {
  const int n16 = (count + 15) / 16 * 16;
  for (int r = 0; r < nrows; ++r) {
    for (int t = 0; t < n16; t += 16) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(probs + r * stride + t));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + r * pair_stride + t / 2),
                          (__m256i)rounded);
    }
  }
}

// acc[r] += sum_j pairs[r][j] . packed[j] (both keys of pair j) for RN rows in registers.
template <int D, int RN>
inline void accumulate_pair_block(float* acc, const uint32_t* packed, int npairs,
                                  const uint32_t* pairs, int pair_stride) {
  constexpr int NV = D / 16;
  __m512 a[RN][NV];
  for (int r = 0; r < RN; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc + r * D + 16 * v);
  for (int j = 0; j < npairs; ++j) {
    __m512bh x[NV];
    for (int v = 0; v < NV; ++v) x[v] = (__m512bh)_mm512_loadu_si512(packed + j * D + 16 * v);
    for (int r = 0; r < RN; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * pair_stride + j]));
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], p, x[v]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * D + 16 * v, a[r][v]);
}

// The value pass for nrows rows in bf16: row r adds its first visible[r] keys (its
// probabilities after those are zero, so a block of rows runs to its longest, in pairs).
template <int D>
void accumulate_pairs(float* acc, int nrows, const uint32_t* packed, const int* visible,
                      const uint32_t* pairs, int pair_stride) {
  constexpr int kRows = D == 64 ? 6 : 2;  // accumulators + one pair's values fit 32 registers
  for_chunks<kRows>(nrows, [&](int r0, auto rn) {
    constexpr int RN = decltype(rn)::value;
    const int count = *std::max_element(visible + r0, visible + r0 + RN);
    accumulate_pair_block<D, RN>(acc + static_cast<std::ptrdiff_t>(r0) * D, packed,
                                 (count + 1) / 2,
                                 pairs + static_cast<std::ptrdiff_t>(r0) * pair_stride,
                                 pair_stride);
  });
}

}  // namespace kvserve

#endif  // __AVX512BF16__

#if defined(KVSERVE_AVX2_TILES)
namespace kvserve {

// In place: afterwards m[c] lane r is what m[r] lane c was (8 x 8 float32).
inline void transpose8x8_ps(__m256 m[8]) {
  __m256 u[8], v[8];
  for (int i = 0; i < 4; ++i) {  // within 128-bit lanes: rows 2i, 2i+1 interleaved
    u[2 * i] = _mm256_unpacklo_ps(m[2 * i], m[2 * i + 1]);
    u[2 * i + 1] = _mm256_unpackhi_ps(m[2 * i], m[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // v[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
    v[4 * i] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
    v[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0xEE);
    v[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
    v[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {  // rows 0-3 and 4-7 of one column, 128-bit lanes joined
    m[k] = _mm256_permute2f128_ps(v[k], v[4 + k], 0x20);
    m[4 + k] = _mm256_permute2f128_ps(v[k], v[4 + k], 0x31);
  }
}

// packed[d * stride + t] = dimension d of key t (rows[t]) as float32, for d < D and t < count
// rounded up to 8 (keys past count are zero). stride >= that rounded count.
template <int D, typename T>
void transpose_keys(const T* const* rows, int count, float* packed, int stride) {
  static_assert(D % 8 == 0, "whole registers of 8 float32 per key");
  for (int t0 = 0; t0 < count; t0 += 8) {
    const int tn = std::min(8, count - t0);
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 m[8];
      for (int t = 0; t < 8; ++t) m[t] = t < tn ? Vec8::load(rows[t0 + t] + d0) : Vec8::zero();
      transpose8x8_ps(m);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(packed + (d0 + d) * stride + t0, m[d]);
    }
  }
}

// scores[r * stride + t] = q_r . k_t for RN float32 query rows (row r at q + r * D) and CN
// groups of 8 transposed keys starting at group c0: one FMA chain per score, dimension order.
// The transposed keys' rows and the scores' rows are both stride floats apart.
template <int D, int RN, int CN>
inline void scores_block_f32(const float* q, const float* packed, int c0, float* scores,
                             int stride) {
  __m256 acc[RN][CN];
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 keys[CN];
    for (int c = 0; c < CN; ++c) keys[c] = _mm256_loadu_ps(packed + d * stride + 8 * (c0 + c));
    for (int r = 0; r < RN; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * D + d);
      for (int c = 0; c < CN; ++c) acc[r][c] = _mm256_fmadd_ps(x, keys[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) _mm256_storeu_ps(scores + r * stride + 8 * (c0 + c), acc[r][c]);
}

// scores for nrows query rows against count transposed keys (groups of 8; the scores of
// padding keys past count are written too, as zeros' products). 6 rows x 16 keys per block:
// twelve accumulators, two keys and a broadcast fill AVX2's sixteen registers.
template <int D>
void scores_transposed(const float* q, int nrows, const float* packed, int count,
                       float* scores, int stride) {
  const int groups = (count + 7) / 8;
  for_chunks<2>(groups, [&](int c0, auto cn) {
    for_chunks<6>(nrows, [&](int r0, auto rn) {
      scores_block_f32<D, decltype(rn)::value, decltype(cn)::value>(
          q + static_cast<std::ptrdiff_t>(r0) * D, packed, c0,
          scores + static_cast<std::ptrdiff_t>(r0) * stride, stride);
    });
  });
}

}  // namespace kvserve
#endif  // KVSERVE_AVX2_TILES
