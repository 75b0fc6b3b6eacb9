// bf16 projections on AMX-BF16 tiles (Sapphire Rapids and later Xeons), over the very panels
// panel_dpbf16.h reads: out[t][n] = sum_k x[t][k] * w[n][k], x and w bfloat16, the sums in
// float32.
//
// Why: a decode step's projections have few rows (one per running request), so each layer's
// weights stream from memory once per step and the step waits on that stream. oneDNN's AMX
// GEMM read them at about 18 GB/s at 20 rows with the weights cold (as they are in a step,
// after the KV cache went through the caches), where this machine reads 25; the AVX512-BF16
// panels lose to it from 16 rows, their arithmetic being too slow (docs/kernels.md).
//
// Layout: a panel of 16 output columns is [k / 2][16][2] bfloat16 (llama.pack_pair_panels):
// 16 consecutive pairs of k are 16 rows of 64 bytes, exactly a B operand of TDPBF16PS
// (B[p][n] holds column n's weights 2p and 2p + 1). So the panels are read in place, one
// 1 KiB tile per 32 k per panel, and this path needs no packing of its own: on an AMX build
// the panels are packed beside oneDNN's copy already (hybrid-dpbf16).
//
// How: the rows are A operands of 16 rows x 32 k loaded in place (row stride 2 k bytes; where
// their count is not a multiple of 16, from a copy padded with zero rows). Each thread takes a
// contiguous run of panels and walks it a group at a time: for two row tiles or more, two
// panels (C tiles 0-3, A tiles 4-5, B tiles 6-7; each k step loads the group's B tiles once
// for a pair of row tiles, again from cache for the next pair), for one row tile three panels
// (C 0-2, A 3, B 4-6). A group's first row tiles prefetch the next
// group's weights into L2 (a line per 64 bytes of B read), so the stream runs ahead of the
// tiles. The C tiles are stored to a float32 scratch and written out (float32, or bf16
// rounded to nearest even) for the real rows and columns only.
#pragma once

#include "amx_tiles.h"
#include "prefetch.h"

#if defined(KVSERVE_AMX_BF16)

#include <immintrin.h>

#include <cstdint>

namespace kvserve {
namespace panel_amx {

constexpr int64_t kPanel = 16;     // output columns per panel (a B tile's 16 columns)
constexpr int64_t kRows = 16;      // rows per A tile
constexpr int64_t kStepK = 32;     // k per tile step (16 pairs)
constexpr int64_t kTileBytes = 1024;

// Writes a C tile's 16 x 16 float32 (scratch) to out rows [0, rows) and columns [0, cols).
inline void write_tile(const float* scratch, int rows, int cols, float* out, int64_t ldo) {
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
  for (int r = 0; r < rows; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_loadu_ps(scratch + r * kPanel));
  }
}
inline void write_tile(const float* scratch, int rows, int cols, uint16_t* out, int64_t ldo) {
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
  for (int r = 0; r < rows; ++r) {
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scratch + r * kPanel));
    _mm256_mask_storeu_epi16(out + r * ldo, keep, v);
  }
}

// Prefetches the 64-byte lines [0, bytes) from p into L2.
inline void prefetch_span(const uint16_t* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(c + off);
}

// C tiles for RT row tiles (1 or 2) x PN panels of one group, over all k: tile numbers are
// compile-time constants, so each (RT, PN) is its own loop. x: the first row tile's rows
// (ldx bytes apart); panel: the group's first panel (panel_bytes apart); ahead: the next
// group's first panel, prefetched (null: none).
template <int RT, int PN>
inline void group_tiles(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                        int64_t panel_bytes, int64_t k_steps, const uint16_t* ahead) {
  static_assert((RT == 2 && PN == 2) || (RT == 1 && PN <= 3), "tiles 0-7 only");
  const char* a = reinterpret_cast<const char*>(x);
  const char* b = reinterpret_cast<const char*>(panel);
  const char* next = reinterpret_cast<const char*>(ahead);
  _tile_zero(0);
  if constexpr (RT * PN > 1) _tile_zero(1);
  if constexpr (RT * PN > 2) _tile_zero(2);
  if constexpr (RT * PN > 3) _tile_zero(3);
  for (int64_t s = 0; s < k_steps; ++s) {
    const int64_t off = s * kTileBytes;
    if (next != nullptr) {
      for (int p = 0; p < PN; ++p) {
        for (int64_t line = 0; line < kTileBytes; line += 64) {
          prefetch_l2(next + p * panel_bytes + off + line);
        }
      }
    }
    if constexpr (RT == 2) {
      __asm__ volatile("" ::: "memory");
      // each product as soon as its operands are in: 1.04-1.07x at 64-256 rows over four
      // loads then four products (the tiles are not renamed, so a load waits for the products
      // still reading its tile)
      _tile_loadd(4, a + s * 64, ldx);
      _tile_loadd(6, b + off, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + panel_bytes + off, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + kRows * ldx + s * 64, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      __asm__ volatile("" ::: "memory");
      _tile_loadd(3, a + s * 64, ldx);
      _tile_loadd(4, b + off, 64);
      _tile_dpbf16ps(0, 3, 4);
      if constexpr (PN > 1) {
        _tile_loadd(5, b + panel_bytes + off, 64);
        _tile_dpbf16ps(1, 3, 5);
      }
      if constexpr (PN > 2) {
        _tile_loadd(6, b + 2 * panel_bytes + off, 64);
        _tile_dpbf16ps(2, 3, 6);
      }
    }
  }
}

// Stores C tile T to scratch and writes its real rows and columns to out. (_tile_stored
// pastes its tile number into the instruction's text: a literal in each branch.)
template <int T, typename Out>
inline void store_tile(float* scratch, int rows, int cols, Out* out, int64_t ldo) {
  static_assert(T >= 0 && T <= 3, "C tiles are 0-3");
  constexpr int64_t stride = kPanel * sizeof(float);
  if constexpr (T == 0) _tile_stored(0, scratch, stride);
  if constexpr (T == 1) _tile_stored(1, scratch, stride);
  if constexpr (T == 2) _tile_stored(2, scratch, stride);
  if constexpr (T == 3) _tile_stored(3, scratch, stride);
  __asm__ volatile("" ::: "memory");
  write_tile(scratch, rows, cols, out, ldo);
}

// out[r][c] for rows [0, rows) of x (padded_rows of them readable, a multiple of 16; k_steps *
// 32 values each) against panels [0, count) (the last one's first last_cols columns real);
// out's row r at out + r * ldo. Runs on the calling thread, whose tiles must be configured
// (full_tile_config).
template <typename Out>
inline void panel_rows(const uint16_t* x, int64_t rows, int64_t padded_rows,
                       const uint16_t* panels, int64_t k_steps, int64_t count, int last_cols,
                       Out* out, int64_t ldo) {
  alignas(64) float scratch[kRows * kPanel];
  const int64_t ldx = k_steps * kStepK * sizeof(uint16_t);
  const int64_t x_elems = k_steps * kStepK;
  const int64_t panel_elems = k_steps * kStepK * kPanel;
  const int64_t panel_bytes = panel_elems * sizeof(uint16_t);
  const int64_t row_tiles = padded_rows / kRows;
  const int group = row_tiles >= 2 ? 2 : 3;
  auto cols_of = [&](int64_t p) { return p + 1 == count ? last_cols : static_cast<int>(kPanel); };
  auto rows_of = [&](int64_t r0) {
    return static_cast<int>(rows - r0 < kRows ? (rows - r0 > 0 ? rows - r0 : 0) : kRows);
  };
  for (int64_t p0 = 0; p0 < count; p0 += group) {
    const int64_t m = count - p0 < group ? count - p0 : group;
    const uint16_t* panel = panels + p0 * panel_elems;
    const uint16_t* ahead = p0 + m + group <= count ? panel + m * panel_elems : nullptr;
    Out* o = out + p0 * kPanel;
    int64_t rt = 0;
    if (group == 2 && m == 2) {
      for (; rt + 2 <= row_tiles; rt += 2) {
        group_tiles<2, 2>(x + rt * kRows * x_elems, ldx, panel, panel_bytes, k_steps,
                          rt == 0 ? ahead : nullptr);
        const int64_t r0 = rt * kRows, r1 = r0 + kRows;
        store_tile<0>(scratch, rows_of(r0), cols_of(p0), o + r0 * ldo, ldo);
        store_tile<1>(scratch, rows_of(r0), cols_of(p0 + 1), o + r0 * ldo + kPanel, ldo);
        store_tile<2>(scratch, rows_of(r1), cols_of(p0), o + r1 * ldo, ldo);
        store_tile<3>(scratch, rows_of(r1), cols_of(p0 + 1), o + r1 * ldo + kPanel, ldo);
      }
    }
    for (; rt < row_tiles; ++rt) {  // one row tile at a time: the group's panels in threes
      const int64_t r0 = rt * kRows;
      const uint16_t* xr = x + r0 * x_elems;
      for (int64_t p = 0; p < m; p += 3) {
        const int64_t left = m - p;
        const uint16_t* first = panel + p * panel_elems;
        const uint16_t* pre = rt == 0 && p == 0 ? ahead : nullptr;
        if (left >= 3) {
          group_tiles<1, 3>(xr, ldx, first, panel_bytes, k_steps, pre);
        } else if (left == 2) {
          group_tiles<1, 2>(xr, ldx, first, panel_bytes, k_steps, pre);
        } else {
          group_tiles<1, 1>(xr, ldx, first, panel_bytes, k_steps, pre);
        }
        Out* op = o + r0 * ldo + p * kPanel;
        store_tile<0>(scratch, rows_of(r0), cols_of(p0 + p), op, ldo);
        if (left > 1) store_tile<1>(scratch, rows_of(r0), cols_of(p0 + p + 1), op + kPanel, ldo);
        if (left > 2) {
          store_tile<2>(scratch, rows_of(r0), cols_of(p0 + p + 2), op + 2 * kPanel, ldo);
        }
      }
    }
  }
}

}  // namespace panel_amx
}  // namespace kvserve

#endif
