// int8_linear.cpp's loops (--quantization int8, docs/quantization.md): the rows quantized per
// group of 64 (AVX2), and their sums against one panel of int8 weights, by AVX2 vpmaddwd or,
// where the build has AVX512-VNNI (and BW), by vpdpwssd on 512-bit registers, or, where it
// has AMX-INT8 and Linux grants the tiles, by TDPBSSD on tiles (amx_tiles.h). Only
// intrinsics, inline asm, amx_tiles.h and fast_math.h, so tools/avx512_check.py can run the
// VNNI and AMX paths under an emulator (AMX through amx_tiles.h's software model). All paths
// give the same bits: each group's int32 sums are exact, and each is added into its float32
// sum by one FMA in group order, then multiplied by the column's scale.
#pragma once

#include "amx_tiles.h"
#include "fast_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace int8 {

constexpr int kPanel = 16;  // output columns per panel
constexpr int kGroup = 64;  // k per activation scale (quantization.ACTIVATION_GROUP)
constexpr int kGroupPairs = kGroup / 2;
constexpr int kAvx2Rows = 6;   // rows per AVX2 register block (block_sums is written for 6)
constexpr int kVnniRows = 12;  // rows per AVX512-VNNI register block
constexpr float kTinyAmax = 1e-30f;  // quantization.TINY_AMAX: a group under it is zeros

#if defined(__AVX2__)
// One group of a row (len <= kGroup values of x) as int16 and its scale. cvtps2dq rounds by
// MXCSR, half to even by default, as std::nearbyint does for the tail.
inline float quantize_group(const float* x, int64_t len, int16_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // max_ps drops a NaN
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, magnitude));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(vnan) != 0;
  for (; k < len; ++k) {
    nan = nan || std::isnan(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  // A NaN or an infinity: the group's products are not finite either, so its scale is NaN
  // (QA: a NaN came out finite, an inf with the wrong sign). Below kTinyAmax 127 / amax
  // overflows: the group counts as zeros (it adds under 1e-30 per weight).
  if (nan || std::isinf(amax) || !(amax >= kTinyAmax)) {
    std::fill(q, q + len, int16_t{0});
    return nan || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
  }
  const float inv = 127.f / amax;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (k = 0; k + 16 <= len; k += 16) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
    a = _mm256_min_epi32(_mm256_max_epi32(a, lo), hi);
    b = _mm256_min_epi32(_mm256_max_epi32(b, lo), hi);
    // packs works per 128-bit lane (a0-3 b0-3 a4-7 b4-7): the permute puts them in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), packed);
  }
  for (; k < len; ++k) {
    const float v = std::nearbyint(x[k] * inv);
    q[k] = static_cast<int16_t>(std::min(127.f, std::max(-127.f, v)));
  }
  return amax / 127.f;
}

// Row t of x as int16 (k padded to even with a zero) and its groups' scales.
inline void quantize_row(const float* x, int64_t k_dim, int16_t* q, float* scales) {
  for (int64_t k0 = 0, g = 0; k0 < k_dim; k0 += kGroup, ++g) {
    scales[g] = quantize_group(x + k0, std::min<int64_t>(kGroup, k_dim - k0), q + k0);
  }
  if (k_dim % 2) q[k_dim] = 0;
}

// One row of a block: its broadcast int16 pair against both weight vectors, added into its
// two accumulators. In asm because gcc, given the loop in intrinsics, schedules every row's
// broadcast and product ahead of the adds and runs out of registers: accumulators spilled to
// the stack at every k (about half the speed).
#define KVSERVE_INT8_ROW(R, A0, A1)                                                      \
  {                                                                                      \
    __m256i t, u;                                                                        \
    __asm__("vpbroadcastd %[x], %[t]\n\t"                                                \
            "vpmaddwd %[w0], %[t], %[u]\n\t"                                             \
            "vpaddd %[u], %[a0], %[a0]\n\t"                                              \
            "vpmaddwd %[w1], %[t], %[t]\n\t"                                             \
            "vpaddd %[t], %[a1], %[a1]"                                                  \
            : [a0] "+x"(A0), [a1] "+x"(A1), [t] "=&x"(t), [u] "=&x"(u)                  \
            : [x] "m"(*reinterpret_cast<const int32_t*>(q + (R) * ldq + 2 * p)),         \
              [w0] "x"(w0), [w1] "x"(w1));                                               \
  }

// The float32 sums of kAvx2Rows (6) quantized rows (ldq int16 apart; their groups' scales ldg
// apart) against one panel: acc[2 r] columns 0-7 of row r, acc[2 r + 1] columns 8-15.
inline void block_sums(const int16_t* q, int64_t ldq, const float* sx, int64_t ldg,
                       const int8_t* panel, int64_t k_pairs, __m256* acc) {
  for (int i = 0; i < 2 * kAvx2Rows; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p0 = 0, g = 0; p0 < k_pairs; p0 += kGroupPairs, ++g) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,
            a21 = a00, a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const int64_t p1 = std::min<int64_t>(k_pairs, p0 + kGroupPairs);
    for (int64_t p = p0; p < p1; ++p) {
      const __m128i* w = reinterpret_cast<const __m128i*>(panel + 2 * kPanel * p);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w));      // columns 0-7
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w + 1));  // columns 8-15
      KVSERVE_INT8_ROW(0, a00, a01) KVSERVE_INT8_ROW(1, a10, a11) KVSERVE_INT8_ROW(2, a20, a21)
      KVSERVE_INT8_ROW(3, a30, a31) KVSERVE_INT8_ROW(4, a40, a41) KVSERVE_INT8_ROW(5, a50, a51)
    }
    const __m256i sums[2 * kAvx2Rows] = {a00, a01, a10, a11, a20, a21,
                                         a30, a31, a40, a41, a50, a51};
    for (int i = 0; i < 2 * kAvx2Rows; ++i) {
      const __m256 scale = _mm256_set1_ps(sx[(i / 2) * ldg + g]);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), scale, acc[i]);
    }
  }
}
#undef KVSERVE_INT8_ROW

// The same sums for RN < kAvx2Rows rows (a block's last rows), in intrinsics: with at most
// three rows gcc keeps them in registers.
template <int RN>
inline void tail_sums(const int16_t* q, int64_t ldq, const float* sx, int64_t ldg,
                      const int8_t* panel, int64_t k_pairs, __m256* acc) {
  for (int i = 0; i < 2 * RN; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p0 = 0, g = 0; p0 < k_pairs; p0 += kGroupPairs, ++g) {
    __m256i a[RN][2];
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
    const int64_t p1 = std::min<int64_t>(k_pairs, p0 + kGroupPairs);
    for (int64_t p = p0; p < p1; ++p) {
      const __m128i* w = reinterpret_cast<const __m128i*>(panel + 2 * kPanel * p);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w + 1));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        int32_t pair;
        std::memcpy(&pair, q + r * ldq + 2 * p, sizeof pair);
        const __m256i xr = _mm256_set1_epi32(pair);
        a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(xr, w0));
        a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(xr, w1));
      }
    }
    for (int r = 0; r < RN; ++r) {
      const __m256 scale = _mm256_set1_ps(sx[r * ldg + g]);
      acc[2 * r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), scale, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), scale, acc[2 * r + 1]);
    }
  }
}

// out[r][c] = sum * sw[c] for the block's first `rows` rows and ncols columns.
inline void store_block(const __m256* acc, int rows, const float* sw, float* out, int64_t ldo,
                        int ncols) {
  alignas(32) float lanes[kPanel];
  const __m256 sw0 = _mm256_loadu_ps(sw), sw1 = _mm256_loadu_ps(sw + 8);
  for (int r = 0; r < rows; ++r) {
    const __m256 v0 = _mm256_mul_ps(acc[2 * r], sw0), v1 = _mm256_mul_ps(acc[2 * r + 1], sw1);
    if (ncols == kPanel) {
      _mm256_storeu_ps(out + r * ldo, v0);
      _mm256_storeu_ps(out + r * ldo + 8, v1);
    } else {
      _mm256_store_ps(lanes, v0);
      _mm256_store_ps(lanes + 8, v1);
      std::copy(lanes, lanes + ncols, out + r * ldo);
    }
  }
}

// All rows of a call against one panel: blocks of kAvx2Rows, the last 1-5 rows by tail_sums.
inline void panel_rows_avx2(const int16_t* q, int64_t rows, int64_t ldq, const float* sx,
                            int64_t ldg, const int8_t* panel, int64_t k_pairs, const float* sw,
                            float* out, int64_t ldo, int ncols) {
  __m256 acc[2 * kAvx2Rows];
  for (int64_t r0 = 0; r0 < rows;) {
    const int left = static_cast<int>(std::min<int64_t>(kAvx2Rows, rows - r0));
    const int done = left == kAvx2Rows ? kAvx2Rows : std::min(left, 3);
    if (done == kAvx2Rows) {
      block_sums(q + r0 * ldq, ldq, sx + r0 * ldg, ldg, panel, k_pairs, acc);
    } else {
      with_constant<3>(done, [&](auto tn) {
        tail_sums<decltype(tn)::value>(q + r0 * ldq, ldq, sx + r0 * ldg, ldg, panel, k_pairs,
                                       acc);
      });
    }
    store_block(acc, done, sw, out + r0 * ldo, ldo, ncols);
    r0 += done;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVSERVE_INT8_VNNI 1
// RN rows against one panel: per pair of k the panel's 32 bytes widen to one register of 16
// columns x 2 k (vpmovsxbw), and each row adds both products into its 16 int32 lanes with one
// vpdpwssd: one instruction per row per pair where AVX2 needs four (two vpmaddwd, two vpaddd).
// KVSERVE_VNNI_ROW: row R's pair p broadcast and added into its 16 int32 lanes, in asm as the
// AVX2 rows are: given intrinsics, gcc copied every accumulator to another register and back
// at each k.
#define KVSERVE_VNNI_ROW(R, A)                                                           \
  if constexpr (RN > (R)) {                                                              \
    __m512i t;                                                                           \
    __asm__("vpbroadcastd %[x], %[t]\n\t"                                                \
            "vpdpwssd %[w], %[t], %[a]"                                                  \
            : [a] "+v"(A), [t] "=&v"(t)                                                  \
            : [x] "m"(*reinterpret_cast<const int32_t*>(q + (R) * ldq + 2 * p)),         \
              [w] "v"(w));                                                               \
  }

template <int RN>
inline void vnni_block(const int16_t* q, int64_t ldq, const float* sx, int64_t ldg,
                       const int8_t* panel, int64_t k_pairs, const float* sw, float* out,
                       int64_t ldo, int ncols) {
  static_assert(RN >= 1 && RN <= kVnniRows, "vnni_block is written for 1-12 rows");
  __m512 acc[RN];
  for (int r = 0; r < RN; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p0 = 0, g = 0; p0 < k_pairs; p0 += kGroupPairs, ++g) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    const int64_t p1 = std::min<int64_t>(k_pairs, p0 + kGroupPairs);
    for (int64_t p = p0; p < p1; ++p) {
      const __m512i w = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 2 * kPanel * p)));
      KVSERVE_VNNI_ROW(0, a0) KVSERVE_VNNI_ROW(1, a1) KVSERVE_VNNI_ROW(2, a2)
      KVSERVE_VNNI_ROW(3, a3) KVSERVE_VNNI_ROW(4, a4) KVSERVE_VNNI_ROW(5, a5)
      KVSERVE_VNNI_ROW(6, a6) KVSERVE_VNNI_ROW(7, a7) KVSERVE_VNNI_ROW(8, a8)
      KVSERVE_VNNI_ROW(9, a9) KVSERVE_VNNI_ROW(10, a10) KVSERVE_VNNI_ROW(11, a11)
    }
    const __m512i sums[kVnniRows] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    for (int r = 0; r < RN; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(sx[r * ldg + g]),
                               acc[r]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(sw);
  const __mmask16 mask = static_cast<__mmask16>((1u << ncols) - 1u);
  for (int r = 0; r < RN; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, mask, _mm512_mul_ps(acc[r], scale));
  }
}
#undef KVSERVE_VNNI_ROW

inline void panel_rows_vnni(const int16_t* q, int64_t rows, int64_t ldq, const float* sx,
                            int64_t ldg, const int8_t* panel, int64_t k_pairs, const float* sw,
                            float* out, int64_t ldo, int ncols) {
  for (int64_t r0 = 0; r0 < rows; r0 += kVnniRows) {
    with_constant<kVnniRows>(static_cast<int>(std::min<int64_t>(kVnniRows, rows - r0)),
                             [&](auto rn) {
      vnni_block<decltype(rn)::value>(q + r0 * ldq, ldq, sx + r0 * ldg, ldg, panel, k_pairs,
                                      sw, out + r0 * ldo, ldo, ncols);
    });
  }
}
#endif

#if defined(KVSERVE_AMX_TILES) && defined(__AVX512F__)
#define KVSERVE_INT8_AMX 1
// AMX-INT8 (Sapphire Rapids and later Xeons; amx_tiles.h): a group of 64 k is exactly one
// tile row of int8, so each group of a block of 16 rows x one panel of 16 columns is one
// TDPBSSD (16 x 16 x 64 exact int32 sums), stored and added into 16 float32 sums of 16 lanes
// by one FMA per row with the rows' group scales, as the AVX2 path adds them: the same bits.
// It reads its own layouts, which int8_linear.cpp prepares when this path runs:
//   rows    int8 [rows padded to 16, groups * 64] (padding zero), and their scales per block
//           of 16 rows as [groups][16] (zero past the rows);
//   panels  "quad panels" [ceil(n / 16), groups * 16, 16, 4] (quantization.pack_int8 with
//           layout="quads"): group g of a panel is the 1 KiB B tile of TDPBSSD, row j holding
//           each column's k = 64 g + 4 j .. 64 g + 4 j + 3 (k padded with zeros).
constexpr int kAmxRows = 16;                  // rows per A and C tile
constexpr int kTileBytes = kGroup * kPanel;   // one group of one quad panel
constexpr int kQuad = 4;

// Tiles 0 and 3 (C: 16 rows x 16 int32), 1 and 4 (A: 16 rows x 64 int8), 2 and 5 (B: 16
// quads x 16 columns x 4 int8), each 16 rows of 64 bytes; a constant, so all 64 bytes are in
// memory.
struct AmxConfig {
  alignas(64) uint8_t bytes[64];
};
constexpr AmxConfig amx_config() {
  AmxConfig c{};
  c.bytes[0] = 1;  // palette 1
  for (int t = 0; t < 6; ++t) {
    c.bytes[16 + 2 * t] = 64;
    c.bytes[48 + t] = kAmxRows;
  }
  return c;
}
inline constexpr AmxConfig kAmxConfig = amx_config();

// Row t of x quantized per group as quantize_row does (quantize_group), narrowed to int8 and
// padded with zeros to ldqa bytes; its groups' scales scale_stride apart.
inline void quantize_row_int8(const float* x, int64_t k_dim, int8_t* qa, int64_t ldqa,
                              float* scales, int64_t scale_stride) {
  int16_t q[kGroup];
  for (int64_t k0 = 0, g = 0; k0 < k_dim; k0 += kGroup, ++g) {
    const int64_t len = std::min<int64_t>(kGroup, k_dim - k0);
    scales[g * scale_stride] = quantize_group(x + k0, len, q);
    for (int64_t k = 0; k < len; ++k) qa[k0 + k] = static_cast<int8_t>(q[k]);
  }
  for (int64_t k = k_dim; k < ldqa; ++k) qa[k] = 0;
}

// Row R's group sums (tile row R of SUMS as 16 int32) added into its float32 sums A with the
// row's scale for the group (SX[R]), by one FMA.
#define KVSERVE_AMX_ROW(SUMS, SX, R, A)                                                       \
  A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(SUMS[R])),                         \
                      _mm512_set1_ps(SX[R]), A);
#define KVSERVE_AMX_ROWS(SUMS, SX)                                                            \
  KVSERVE_AMX_ROW(SUMS, SX, 0, a0) KVSERVE_AMX_ROW(SUMS, SX, 1, a1)                           \
  KVSERVE_AMX_ROW(SUMS, SX, 2, a2) KVSERVE_AMX_ROW(SUMS, SX, 3, a3)                           \
  KVSERVE_AMX_ROW(SUMS, SX, 4, a4) KVSERVE_AMX_ROW(SUMS, SX, 5, a5)                           \
  KVSERVE_AMX_ROW(SUMS, SX, 6, a6) KVSERVE_AMX_ROW(SUMS, SX, 7, a7)                           \
  KVSERVE_AMX_ROW(SUMS, SX, 8, a8) KVSERVE_AMX_ROW(SUMS, SX, 9, a9)                           \
  KVSERVE_AMX_ROW(SUMS, SX, 10, a10) KVSERVE_AMX_ROW(SUMS, SX, 11, a11)                       \
  KVSERVE_AMX_ROW(SUMS, SX, 12, a12) KVSERVE_AMX_ROW(SUMS, SX, 13, a13)                       \
  KVSERVE_AMX_ROW(SUMS, SX, 14, a14) KVSERVE_AMX_ROW(SUMS, SX, 15, a15)

// One block of 16 rows (their group scales in sx as [groups][16]) against one quad panel;
// stores the first `rows` rows' ncols columns. Groups go in pairs on two sets of tiles (C, A,
// B = 0, 1, 2 and 3, 4, 5) so that one group's TDPBSSD need not wait for the other's sums to
// be stored and read; the FMAs still add the groups in order. The 16 float32 sums are named
// registers: as an array, gcc kept them on the stack.
inline void amx_block(const int8_t* qa, int64_t ldqa, const float* sx, int64_t groups,
                      const int8_t* panel, const float* sw, float* out, int64_t ldo, int rows,
                      int ncols) {
  alignas(64) int32_t even[kAmxRows][kPanel], odd[kAmxRows][kPanel];
  constexpr int64_t kSumStride = kPanel * sizeof(int32_t), kPanelStride = kPanel * kQuad;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    KVSERVE_TILE_ZERO(0);
    KVSERVE_TILE_LOADD(1, qa + g * kGroup, ldqa);
    KVSERVE_TILE_LOADD(2, panel + g * kTileBytes, kPanelStride);
    KVSERVE_TILE_DPBSSD(0, 1, 2);
    if (pair) {
      KVSERVE_TILE_ZERO(3);
      KVSERVE_TILE_LOADD(4, qa + (g + 1) * kGroup, ldqa);
      KVSERVE_TILE_LOADD(5, panel + (g + 1) * kTileBytes, kPanelStride);
      KVSERVE_TILE_DPBSSD(3, 4, 5);
    }
    KVSERVE_TILE_STORED(0, even, kSumStride);
    const float* sx_even = sx + g * kAmxRows;
    KVSERVE_AMX_ROWS(even, sx_even)
    if (pair) {
      KVSERVE_TILE_STORED(3, odd, kSumStride);
      const float* sx_odd = sx_even + kAmxRows;
      KVSERVE_AMX_ROWS(odd, sx_odd)
    }
  }
  const __m512 acc[kAmxRows] = {a0, a1, a2, a3, a4, a5, a6, a7,
                                a8, a9, a10, a11, a12, a13, a14, a15};
  const __m512 scale = _mm512_loadu_ps(sw);
  const __mmask16 mask = static_cast<__mmask16>((1u << ncols) - 1u);
  for (int r = 0; r < rows; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, mask, _mm512_mul_ps(acc[r], scale));
  }
}
#undef KVSERVE_AMX_ROWS
#undef KVSERVE_AMX_ROW

// All rows of a call (padded to whole blocks of 16; block b's scales at sx + b * groups * 16)
// against one quad panel. The calling thread's tiles must be configured (kAmxConfig).
inline void amx_panel_rows(const int8_t* qa, int64_t rows, int64_t ldqa, const float* sx,
                           const int8_t* panel, const float* sw, float* out, int64_t ldo,
                           int ncols) {
  const int64_t groups = ldqa / kGroup;
  for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
    amx_block(qa + r0 * ldqa, ldqa, sx + r0 * groups, groups, panel, sw, out + r0 * ldo, ldo,
              static_cast<int>(std::min<int64_t>(kAmxRows, rows - r0)), ncols);
  }
}
#endif

// out[t][c] for all `rows` quantized rows and one panel's ncols columns, by the build's best
// path over pairs-of-k panels (the AMX path reads its own layout: amx_panel_rows).
inline void panel_rows(const int16_t* q, int64_t rows, int64_t ldq, const float* sx,
                       int64_t ldg, const int8_t* panel, int64_t k_pairs, const float* sw,
                       float* out, int64_t ldo, int ncols) {
#if defined(KVSERVE_INT8_VNNI)
  panel_rows_vnni(q, rows, ldq, sx, ldg, panel, k_pairs, sw, out, ldo, ncols);
#else
  panel_rows_avx2(q, rows, ldq, sx, ldg, panel, k_pairs, sw, out, ldo, ncols);
#endif
}

// The path panel_rows takes in this build.
inline const char* path() {
#if defined(KVSERVE_INT8_VNNI)
  return "avx512_vnni";
#else
  return "avx2";
#endif
}
#endif  // __AVX2__

}  // namespace int8
}  // namespace kvserve
