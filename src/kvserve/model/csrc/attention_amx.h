// Prefill attention on AMX-BF16 tiles (Sapphire Rapids and later Xeons): one prefill chunk's
// causal attention over its paged context, for head_dim 64 and bfloat16 caches.
//
// Why: on an AMX Xeon the C++ prefill tiles of attention_gemm.h (AVX512-BF16 dot products) run
// at 100-150 GFLOP/s and torch's flash attention, which repacks keys and values for oneDNN's
// brgemm on every call, at a few hundred; the tiles themselves do 2,000+ (docs/kernels.md,
// "Prefill attention on AMX").
//
// How: the chunk's keys and values are first packed, once per kv head, straight from the paged
// cache into the tiles' operand layouts (a pass over the context, in parallel over kv heads
// and blocks of 32 keys):
// - keys: per 16 keys and per 32 dimensions, a B tile of 16 rows (dimension pairs) x 16 keys,
//   each element the key's two bf16 dimensions 2p, 2p + 1 (TDPBF16PS reads B as rows of
//   pairs: C[m][n] += A[m][2p] B[p][n].lo + A[m][2p + 1] B[p][n].hi);
// - values: per 32 keys and per 16 dimensions, a B tile of 16 rows (key pairs) x 16
//   dimensions, each element the two keys' values of that dimension.
// Then each work item, 16 queries of one query head (the chunk's last queries padded with zero
// rows), keeps its queries in two A tiles and walks the context 32 keys at a time up to its
// last query's position: scores into two C tiles (16 x 16 float32 each), the online softmax in
// AVX-512 (scale, causal mask, running max and sum in float32, probabilities rounded to bf16
// to nearest even as the other bf16 paths do), probabilities x values into four C tiles, added
// to the float32 accumulators after their rescaling. Tiles: 0-3 the C tiles, 4 and 5 operand
// scratch, 6 and 7 the queries.
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
constexpr int64_t kRows = 16;     // queries per work item (a tile's rows)
constexpr int64_t kKeys = 64;     // keys per online-softmax step (four score tiles)
constexpr int64_t kTileWords = 256;  // 16 rows x 64 bytes, as uint32 (keys) or 512 uint16

// Packed keys of one kv head: for key block b (16 keys) and half h (32 dimensions), the tile at
// (b * 2 + h) * kTileWords: [16 dimension pairs][16 keys] uint32. Packed values: for key block
// c (32 keys) and dimension block e (16), the tile at (c * 4 + e) * 2 * kTileWords uint16:
// [16 key pairs][16 dimensions][2 keys]. Keys at or past context_len are zero.
inline int64_t key_words(int64_t padded) { return padded / 16 * 2 * kTileWords; }
inline int64_t value_halves(int64_t padded) { return padded / 32 * 4 * 2 * kTileWords; }

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
    uint32_t pairs[kDim / 2];
    std::memcpy(pairs, k, sizeof(pairs));
    uint32_t* key_tile = keys + (j / 16) * 2 * kTileWords + j % 16;
    for (int64_t p = 0; p < kDim / 2; ++p) {  // half p / 16, row p % 16
      key_tile[(p / 16) * kTileWords + (p % 16) * 16] = pairs[p];
    }
    uint16_t* value_tile = values + (j / 32) * 4 * 2 * kTileWords + ((j % 32) / 2) * 32 +
                           (j % 2);
    for (int64_t d = 0; d < kDim; ++d) {
      value_tile[(d / 16) * 2 * kTileWords + (d % 16) * 2] = v[d];
    }
  }
}

// One work item: queries [q0, q0 + 16) of query head `head` (their kv head's packed keys and
// values given), written to out as bf16. Query i sits at position context_len - n + i.
inline void attend_rows(const uint16_t* q, int64_t q_stride, const uint32_t* keys,
                        const uint16_t* values, int64_t n, int64_t context_len, int64_t q0,
                        float scale, uint16_t* out, int64_t out_stride) {
  alignas(64) uint16_t queries[kRows * kDim];
  alignas(64) float scores[kRows * kKeys];
  alignas(64) uint16_t probs[2][kRows * kKeys];  // step s's in probs[s % 2]
  alignas(64) float acc[kRows * kDim];
  alignas(64) float update[kRows * kDim];
  float row_max[kRows], row_sum[kRows], rescale[2][kRows];
  int64_t position[kRows];
  const int64_t rows = std::min(kRows, n - q0);
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < rows) {
      std::memcpy(queries + r * kDim, q + (q0 + r) * q_stride, kDim * sizeof(uint16_t));
      position[r] = context_len - n + q0 + r;
    } else {  // padding: a zero query that sees the whole context (its output is dropped)
      std::memset(queries + r * kDim, 0, kDim * sizeof(uint16_t));
      position[r] = context_len - 1;
    }
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
  }
  std::memset(acc, 0, sizeof(acc));
  const int64_t steps = (context_len - n + q0 + rows - 1) / kKeys + 1;
  KVSERVE_TILE_LOADD(6, queries, kDim * sizeof(uint16_t));
  KVSERVE_TILE_LOADD(7, queries + 32, kDim * sizeof(uint16_t));
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Step s's value pass runs in step s + 1, after its scores: tile loads do not take data
  // from pending vector stores (nor vector loads from tile stores), so each waits for the
  // other's stores to reach the cache; one step of other work in between hides that wait
  // (perf put a fifth of the time on the first value-pass tile load when they followed).
  for (int64_t step = 0; step <= steps; ++step) {
    const int64_t prior = step - 1;
    if (step < steps) {
      // scores: keys 64 step + 16 b .. + 15 into tile b, over the first 32 dimensions for
      // all four tiles, then the last 32: two products into one tile back to back wait for
      // each other (perf put a fifth of the time on the second), four tiles in turn do not.
      // Tile numbers are immediates, so each product is written out.
      const uint32_t* tile = keys + step * 8 * kTileWords;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
#define KVSERVE_AMX_SCORES(B, HALF, Q, K)                        \
  KVSERVE_TILE_LOADD(K, tile + (2 * B + HALF) * kTileWords, 64); \
  _tile_dpbf16ps(B, Q, K);
      KVSERVE_AMX_SCORES(0, 0, 6, 4)
      KVSERVE_AMX_SCORES(1, 0, 6, 5)
      KVSERVE_AMX_SCORES(2, 0, 6, 4)
      KVSERVE_AMX_SCORES(3, 0, 6, 5)
      KVSERVE_AMX_SCORES(0, 1, 7, 4)
      KVSERVE_AMX_SCORES(1, 1, 7, 5)
      KVSERVE_AMX_SCORES(2, 1, 7, 4)
      KVSERVE_AMX_SCORES(3, 1, 7, 5)
#undef KVSERVE_AMX_SCORES
      _tile_stored(0, scores, kKeys * sizeof(float));
      _tile_stored(1, scores + 16, kKeys * sizeof(float));
      _tile_stored(2, scores + 32, kKeys * sizeof(float));
      _tile_stored(3, scores + 48, kKeys * sizeof(float));
    }
    if (prior >= 0) {
      // probabilities x values: dimensions 16 e .. 16 e + 15 into tile e, 32 keys at a time
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int half = 0; half < 2; ++half) {
        KVSERVE_TILE_LOADD(4, probs[prior % 2] + 32 * half, kKeys * sizeof(uint16_t));
        const uint16_t* block = values + (2 * prior + half) * 4 * 2 * kTileWords;
        KVSERVE_TILE_LOADD(5, block, 64);
        _tile_dpbf16ps(0, 4, 5);
        KVSERVE_TILE_LOADD(5, block + 2 * kTileWords, 64);
        _tile_dpbf16ps(1, 4, 5);
        KVSERVE_TILE_LOADD(5, block + 4 * kTileWords, 64);
        _tile_dpbf16ps(2, 4, 5);
        KVSERVE_TILE_LOADD(5, block + 6 * kTileWords, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, update, kDim * sizeof(float));
      _tile_stored(1, update + 16, kDim * sizeof(float));
      _tile_stored(2, update + 32, kDim * sizeof(float));
      _tile_stored(3, update + 48, kDim * sizeof(float));
    }
    if (step < steps) {
      // the online softmax, row by row
      const int64_t first_key = step * kKeys;
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(position[r] - first_key));
        __mmask16 see[4];
        __m512 s[4];
        __m512 top16 = _mm512_set1_ps(row_max[r]);
        for (int b = 0; b < 4; ++b) {
          see[b] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * b)),
                                           limit);
          s[b] = _mm512_mask_mul_ps(minus_inf, see[b],
                                    _mm512_load_ps(scores + r * kKeys + 16 * b), scale16);
          top16 = _mm512_max_ps(top16, s[b]);
        }
        const float top = _mm512_reduce_max_ps(top16);
        top16 = _mm512_set1_ps(top);
        __m512 p[4];
        __m512 total = _mm512_setzero_ps();
        for (int b = 0; b < 4; ++b) {
          p[b] = _mm512_maskz_mov_ps(see[b], exp_nonpositive16(_mm512_sub_ps(s[b], top16)));
          total = _mm512_add_ps(total, p[b]);
        }
        rescale[step % 2][r] = row_max[r] == -std::numeric_limits<float>::infinity()
                                   ? 0.0f
                                   : exp_nonpositive(row_max[r] - top);
        row_max[r] = top;
        row_sum[r] = row_sum[r] * rescale[step % 2][r] + _mm512_reduce_add_ps(total);
        uint16_t* row_probs = probs[step % 2] + r * kKeys;
        _mm512_store_si512(row_probs, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        _mm512_store_si512(row_probs + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
      }
    }
    if (prior >= 0) {
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 factor = _mm512_set1_ps(rescale[prior % 2][r]);
        for (int64_t d = 0; d < kDim; d += 16) {
          float* a = acc + r * kDim + d;
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), factor,
                                             _mm512_load_ps(update + r * kDim + d)));
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / row_sum[r]);
    uint16_t* o = out + (q0 + r) * out_stride;
    for (int64_t d = 0; d < kDim; d += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_load_ps(acc + r * kDim + d), inverse);
      const __m512 hi = _mm512_mul_ps(_mm512_load_ps(acc + r * kDim + d + 16), inverse);
      _mm512_storeu_si512(o + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

}  // namespace amx_attention
}  // namespace kvserve

#endif
