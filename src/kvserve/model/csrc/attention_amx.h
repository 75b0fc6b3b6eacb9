// Prefill attention on AMX-BF16 tiles (Sapphire Rapids and later Xeons): one prefill chunk's
// causal attention over its paged context, for head_dim 64 and bfloat16 caches.
//
// Why: on an AMX Xeon the C++ prefill tiles of attention_gemm.h (AVX512-BF16 dot products) run
// at 100-150 GFLOP/s and torch's flash attention, which repacks keys and values for oneDNN's
// brgemm on every call, at a few hundred; the tiles themselves do 2,000+ (docs/kernels.md,
// "Prefill attention on AMX").
//
// How: the scores are computed transposed, keys x queries, so that one AVX-512 vector holds one
// key's scores for 16 queries and the online softmax's maxima and sums are vertical operations
// between vectors (row by row, each row's reductions were most of the first version's time).
// - First a packing pass (in parallel): per kv head, the chunk's keys as contiguous rows [keys]
//   [64] (A tiles: 16 keys x 32 dimensions, read in place) and its values as A tiles of 16
//   dimensions x 32 keys, straight from the paged cache; per query head and 16 queries, the
//   queries as two B tiles of 16 dimension pairs x 16 queries (TDPBF16PS reads B as rows of
//   pairs: C[m][n] += A[m][2p] B[p][n].lo + A[m][2p + 1] B[p][n].hi).
// - Then each work item, 16 queries of one query head, walks the context 32 keys a step up to
//   its last query's position: keys x queries into two score tiles (0, 1); the softmax in
//   AVX-512 (scale, causal mask, float32 running max and sum per query lane; probabilities
//   rounded to bf16 to nearest even, as the other bf16 paths do, and laid out as a B tile of
//   key pairs x queries); values x probabilities added into four output tiles (2-5, dimensions
//   x queries) that stay in the tiles for the whole walk. Tiles 6 and 7 are operand scratch.
// - The running max moves lazily: only where a step's score passes it by kLazyRescale (in
//   log2 units), so most steps never store the output tiles to rescale them; probabilities
//   are then at most 2^8, exact enough in float32 and bf16 alike.
// - Tile loads take no data from pending vector stores, nor vector loads from tile stores:
//   each waits for the other's stores to reach the cache. So the steps are pipelined: in step
//   s the scores of step s + 1 and the value products of step s - 1 are issued before step s's
//   softmax, and the queries' tiles are packed before any item runs.
#pragma once

#include "amx_tiles.h"
#include "fast_math.h"

#if defined(KVSERVE_AMX_BF16)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvserve {
namespace amx_attention {

constexpr int64_t kDim = 64;      // head_dim this path computes
constexpr int64_t kRows = 16;     // queries per work item (a tile's columns)
constexpr int64_t kKeys = 32;     // keys per online-softmax step (two score tiles)
constexpr int64_t kTileHalves = 512;  // 16 rows x 64 bytes, as uint16
constexpr float kLazyRescale = 8.0f;  // log2 units: the running max moves past this, not before
constexpr int64_t kQueryWords = kDim / 2 * kRows;  // one item's packed queries (pack_queries)

// Packed keys of one kv head: rows [padded][64] bf16, as the cache holds them but contiguous
// (a score tile's A operand is 16 of these rows, half of each). Packed values: for key block c
// (32 keys) and dimension block e (16), the A tile at (c * 4 + e) * kTileHalves: [16
// dimensions][32 keys]. Keys at or past context_len are zero.
inline int64_t key_words(int64_t padded) { return padded * kDim / 2; }
inline int64_t value_halves(int64_t padded) { return padded * kDim; }

// Packs keys and values [first, last) (multiples of kKeys) of kv head `head`.
inline void pack_block(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                       int64_t block_size, int64_t token_stride, int64_t head,
                       int64_t context_len, int64_t first, int64_t last, uint32_t* keys,
                       uint16_t* values) {
  alignas(64) static thread_local uint16_t zero[kDim] = {};
  for (int64_t j = first; j < last; ++j) {
    const uint16_t* k = zero;
    const uint16_t* v = zero;
    if (j < context_len) {
      const int64_t at = (table[j / block_size] * block_size + j % block_size) * token_stride +
                         head * kDim;
      k = k_cache + at;
      v = v_cache + at;
    }
    std::memcpy(keys + j * kDim / 2, k, kDim * sizeof(uint16_t));
    uint16_t* column = values + (j / kKeys) * 4 * kTileHalves + j % kKeys;
    for (int64_t d = 0; d < kDim; ++d) {
      column[(d / 16) * kTileHalves + (d % 16) * kKeys] = v[d];
    }
  }
}

// The score tiles' B operands for queries [q0, q0 + 16) of one head (rows past n zero):
// packed[h][p][r] = the bf16 pair of dimensions 32 h + 2 p, + 1 of query q0 + r (2 tiles,
// kQueryWords uint32).
inline void pack_queries(const uint16_t* q, int64_t q_stride, int64_t n, int64_t q0,
                         uint32_t* packed) {
  const int64_t rows = std::min(kRows, n - q0);
  for (int h = 0; h < 2; ++h) {
    __m512i lanes[16];
    for (int64_t r = 0; r < 16; ++r) {
      lanes[r] = r < rows ? _mm512_loadu_si512(q + (q0 + r) * q_stride + 32 * h)
                          : _mm512_setzero_si512();
    }
    transpose16x16_epi32(lanes);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(packed + (h * 16 + p) * kRows, lanes[p]);
  }
}

// 2^x on 16 lanes for x <= 8 (lower x underflows to 0): 2^round(x) times a degree-5
// polynomial of the rest (|rest| <= 1/2; relative error under 3e-6, far below bf16's 2^-9).
inline __m512 exp2_approx16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One work item: 16 queries [q0, q0 + 16) of one query head, packed by pack_queries, against
// their kv head's packed keys and values; written to out as bf16 (rows past n are not written).
// Query i sits at position context_len - n + i.
inline void attend_rows(const uint32_t* queries, const uint32_t* keys,
                        const uint16_t* values, int64_t n, int64_t context_len, int64_t q0,
                        float scale, uint16_t* out, int64_t out_stride) {
  alignas(64) float scores[2][kKeys][kRows];          // step s's score tiles in scores[s % 2]
  alignas(64) uint32_t probs[2][kKeys / 2][kRows];    // B tiles: [key pair][query], s in s % 2
  alignas(64) float output[kDim][kRows];
  alignas(64) int32_t position_lanes[kRows];
  const int64_t rows = std::min(kRows, n - q0);
  for (int64_t r = 0; r < kRows; ++r) {
    // padding: a zero query that sees the whole context (its output is dropped)
    position_lanes[r] = static_cast<int32_t>(r < rows ? context_len - n + q0 + r
                                                      : context_len - 1);
  }
  const __m512i position = _mm512_load_si512(position_lanes);
  const int64_t first_position = context_len - n + q0;
  const int64_t steps = (first_position + rows - 1) / kKeys + 1;
  const float log2_scale = scale * 1.44269504088896341f;
  const __m512 c16 = _mm512_set1_ps(log2_scale);
  const __m512 lazy = _mm512_set1_ps(kLazyRescale / log2_scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // per query, in raw score units: the max its probabilities are taken from
  __m512 row_max = _mm512_set1_ps(-std::numeric_limits<float>::max());
  __m512 row_sum = _mm512_setzero_ps();
  auto score_step = [&](int64_t step) {
    const uint16_t* rows16 = reinterpret_cast<const uint16_t*>(keys) + step * kKeys * kDim;
    _tile_zero(0);
    _tile_zero(1);
    KVSERVE_TILE_LOADD(7, queries, 64);
    KVSERVE_TILE_LOADD(6, rows16, kDim * sizeof(uint16_t));
    _tile_dpbf16ps(0, 6, 7);
    KVSERVE_TILE_LOADD(6, rows16 + 16 * kDim, kDim * sizeof(uint16_t));
    _tile_dpbf16ps(1, 6, 7);
    KVSERVE_TILE_LOADD(7, queries + 16 * kRows, 64);
    KVSERVE_TILE_LOADD(6, rows16 + 32, kDim * sizeof(uint16_t));
    _tile_dpbf16ps(0, 6, 7);
    KVSERVE_TILE_LOADD(6, rows16 + 16 * kDim + 32, kDim * sizeof(uint16_t));
    _tile_dpbf16ps(1, 6, 7);
    _tile_stored(0, scores[step % 2][0], 64);
    _tile_stored(1, scores[step % 2][16], 64);
    __asm__ volatile("" ::: "memory");
  };
  auto value_step = [&](int64_t step) {
    const uint16_t* block = values + step * 4 * kTileHalves;
    KVSERVE_TILE_LOADD(7, probs[step % 2], 64);
    KVSERVE_TILE_LOADD(6, block, 64);
    _tile_dpbf16ps(2, 6, 7);
    KVSERVE_TILE_LOADD(6, block + kTileHalves, 64);
    _tile_dpbf16ps(3, 6, 7);
    KVSERVE_TILE_LOADD(6, block + 2 * kTileHalves, 64);
    _tile_dpbf16ps(4, 6, 7);
    KVSERVE_TILE_LOADD(6, block + 3 * kTileHalves, 64);
    _tile_dpbf16ps(5, 6, 7);
  };
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  score_step(0);
  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps) score_step(step + 1);
    if (step > 0) value_step(step - 1);
    const float (*s)[kRows] = scores[step % 2];
    const int64_t first_key = step * kKeys;
    const bool masked = first_key + kKeys - 1 > first_position;
    __m512 top = minus_inf;
    if (masked) {
      for (int64_t j = 0; j < kKeys; ++j) {
        const __mmask16 see = _mm512_cmpge_epi32_mask(
            position, _mm512_set1_epi32(static_cast<int32_t>(first_key + j)));
        top = _mm512_mask_max_ps(top, see, top, _mm512_load_ps(s[j]));
      }
    } else {
      __m512 top2 = minus_inf;
      for (int64_t j = 0; j < kKeys; j += 2) {
        top = _mm512_max_ps(top, _mm512_load_ps(s[j]));
        top2 = _mm512_max_ps(top2, _mm512_load_ps(s[j + 1]));
      }
      top = _mm512_max_ps(top, top2);
    }
    const __mmask16 moves = _mm512_cmp_ps_mask(top, _mm512_add_ps(row_max, lazy), _CMP_GT_OQ);
    if (moves) {
      const __m512 moved = _mm512_mask_mov_ps(row_max, moves, top);
      const __m512 factor = exp2_approx16(_mm512_mul_ps(_mm512_sub_ps(row_max, moved), c16));
      row_sum = _mm512_mul_ps(row_sum, factor);
      row_max = moved;
      if (step > 0) {
        _tile_stored(2, output[0], 64);
        _tile_stored(3, output[16], 64);
        _tile_stored(4, output[32], 64);
        _tile_stored(5, output[48], 64);
        __asm__ volatile("" ::: "memory");  // gcc's tile stores do not say they write memory
        for (int64_t d = 0; d < kDim; ++d) {
          _mm512_store_ps(output[d], _mm512_mul_ps(_mm512_load_ps(output[d]), factor));
        }
        KVSERVE_TILE_LOADD(2, output[0], 64);
        KVSERVE_TILE_LOADD(3, output[16], 64);
        KVSERVE_TILE_LOADD(4, output[32], 64);
        KVSERVE_TILE_LOADD(5, output[48], 64);
      }
    }
    const __m512 offset = _mm512_mul_ps(row_max, c16);
    const char* next_keys = reinterpret_cast<const char*>(
        reinterpret_cast<const uint16_t*>(keys) + std::min(step + 2, steps - 1) * kKeys * kDim);
    const char* next_values = reinterpret_cast<const char*>(values + step * 4 * kTileHalves);
    __m512 total = _mm512_setzero_ps();
    __m512 total2 = _mm512_setzero_ps();
    for (int64_t j = 0; j < kKeys; j += 2) {
      __m512 even = exp2_approx16(_mm512_fmsub_ps(_mm512_load_ps(s[j]), c16, offset));
      __m512 odd = exp2_approx16(_mm512_fmsub_ps(_mm512_load_ps(s[j + 1]), c16, offset));
      if (masked) {
        even = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(
            position, _mm512_set1_epi32(static_cast<int32_t>(first_key + j))), even);
        odd = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(
            position, _mm512_set1_epi32(static_cast<int32_t>(first_key + j + 1))), odd);
      }
      total = _mm512_add_ps(total, even);
      total2 = _mm512_add_ps(total2, odd);
      // the next steps' keys and values into L1: 8 KB, four lines per pair of keys
      _mm_prefetch(next_keys + j * 128, _MM_HINT_T0);
      _mm_prefetch(next_keys + j * 128 + 64, _MM_HINT_T0);
      _mm_prefetch(next_keys + j * 128 + 128, _MM_HINT_T0);
      _mm_prefetch(next_keys + j * 128 + 192, _MM_HINT_T0);
      _mm_prefetch(next_values + j * 128, _MM_HINT_T0);
      _mm_prefetch(next_values + j * 128 + 64, _MM_HINT_T0);
      _mm_prefetch(next_values + j * 128 + 128, _MM_HINT_T0);
      _mm_prefetch(next_values + j * 128 + 192, _MM_HINT_T0);
      const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
      _mm512_store_si512(probs[step % 2][j / 2], _mm512_permutexvar_epi16(interleave, pair));
    }
    row_sum = _mm512_add_ps(row_sum, _mm512_add_ps(total, total2));
  }
  value_step(steps - 1);
  _tile_stored(2, output[0], 64);
  _tile_stored(3, output[16], 64);
  _tile_stored(4, output[32], 64);
  _tile_stored(5, output[48], 64);
  __asm__ volatile("" ::: "memory");
  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), row_sum);
  for (int64_t e = 0; e < 4; ++e) {  // dimensions 16 e .. 16 e + 15
    __m512i lanes[16];
    for (int64_t d = 0; d < 16; ++d) {
      lanes[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(output[16 * e + d]), inverse));
    }
    transpose16x16_epi32(lanes);  // lanes[r]: query r's 16 dimensions
    for (int64_t r = 0; r < rows; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q0 + r) * out_stride + 16 * e),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(lanes[r])));
    }
  }
}

}  // namespace amx_attention
}  // namespace kvserve

#endif
