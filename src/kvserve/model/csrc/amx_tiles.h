// AMX tiles for int8_blocks.h's AMX-INT8 path: the few tile instructions it uses, as macros
// over either the CPU's instructions or a software model of them; and the tile configuration
// the bf16 tile kernels load (attention_amx.h, panel_amx.h; real tiles only).
//
// - A build whose CPU has AMX-TILE and AMX-INT8 (-march=native on a Sapphire Rapids or later
//   Xeon defines __AMX_TILE__ and __AMX_INT8__) uses the instructions. Linux hands a process
//   the tile registers only on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA);
//   docs.kernel.org/arch/x86/xstate.html); without it the first tile instruction kills the
//   process. amx_permitted() asks once and says whether the kernel agreed; int8_linear uses
//   the tiles only then.
// - With KVSERVE_AMX_MODEL defined, the same macros call a software model of the instructions,
//   written from the ISA's description (Intel SDM vol. 2, LDTILECFG, TILELOADD, TILESTORED,
//   TILEZERO, TDPBSSD): eight tiles of at most 16 rows x 64 bytes, a 64-byte configuration
//   checked as the CPU checks it, and a trap (ud2, as the CPU's #UD or #GP) on anything the
//   CPU would refuse. tools/avx512_check.py runs the AMX path this way under an emulated
//   Sapphire Rapids (AVX-512, no AMX), bit for bit against the AVX2 path. The model is one
//   tile file for the whole program: single-threaded code only.
//
// A tile configuration (LDTILECFG's 64 bytes): byte 0 the palette (1; 0 releases the tiles),
// byte 1 the start row (0), bytes 16 + 2 t the bytes per row of tile t (uint16, <= 64),
// byte 48 + t its rows (<= 16), every other byte zero. TDPBSSD c, a, b adds to each int32
// c[m][n] the products of a's row m and b's column n as signed bytes, four at a time: for
// each dword j of a's row, a.row[m].byte[4 j + i] * b.row[j].byte[4 n + i], i = 0..3. So b
// holds a matrix [K, N] as rows of K / 4 quads: row j, column n = k 4 j .. 4 j + 3 of column n.
#pragma once

#include <cstdint>

namespace kvserve {

// LDTILECFG's 64 bytes with every tile 16 rows x 64 bytes (palette 1): the configuration of the
// bf16 tile kernels (attention_amx.h, panel_amx.h).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig full_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  return config;
}

}  // namespace kvserve

#if defined(KVSERVE_AMX_MODEL)

namespace kvserve {
namespace amx_model {

constexpr int kTiles = 8, kMaxRows = 16, kMaxRowBytes = 64;

struct TileFile {
  uint8_t palette;
  uint16_t colsb[kTiles];
  uint8_t rows[kTiles];
  uint8_t data[kTiles][kMaxRows][kMaxRowBytes];
};

inline TileFile& tiles() {
  static TileFile file;  // one for the program: the model is for single-threaded checks
  return file;
}

[[noreturn]] inline void fault() { __builtin_trap(); }

inline void check_configured(int t) {
  const TileFile& f = tiles();
  if (f.palette != 1 || t < 0 || t >= kTiles || f.rows[t] == 0) fault();
}

inline void loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  TileFile& f = tiles();
  for (int i = 2; i < 16; ++i) if (c[i] != 0) fault();
  for (int i = 32; i < 48; ++i) if (c[i] != 0) fault();
  for (int i = 56; i < 64; ++i) if (c[i] != 0) fault();
  if (c[0] > 1 || c[1] != 0) fault();
  for (int t = 0; t < kTiles; ++t) {
    const uint16_t colsb = static_cast<uint16_t>(c[16 + 2 * t] | (c[17 + 2 * t] << 8));
    const uint8_t rows = c[48 + t];
    if (colsb > kMaxRowBytes || rows > kMaxRows || (colsb == 0) != (rows == 0)) fault();
    f.colsb[t] = c[0] == 1 ? colsb : 0;
    f.rows[t] = c[0] == 1 ? rows : 0;
  }
  f.palette = c[0];
  for (auto& tile : f.data) for (auto& row : tile) for (uint8_t& b : row) b = 0;
}

inline void release() {
  alignas(64) const uint8_t zero[64] = {};
  loadconfig(zero);
}

inline void zero(int t) {
  check_configured(t);
  for (auto& row : tiles().data[t]) for (uint8_t& b : row) b = 0;
}

inline void loadd(int t, const void* base, int64_t stride) {
  check_configured(t);
  TileFile& f = tiles();
  const uint8_t* p = static_cast<const uint8_t*>(base);
  for (int r = 0; r < kMaxRows; ++r) {
    for (int b = 0; b < kMaxRowBytes; ++b) {
      f.data[t][r][b] = r < f.rows[t] && b < f.colsb[t] ? p[r * stride + b] : 0;
    }
  }
}

inline void stored(int t, void* base, int64_t stride) {
  check_configured(t);
  const TileFile& f = tiles();
  uint8_t* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < f.rows[t]; ++r) {
    for (int b = 0; b < f.colsb[t]; ++b) p[r * stride + b] = f.data[t][r][b];
  }
}

inline int32_t dword(const uint8_t* bytes) {
  return static_cast<int32_t>(static_cast<uint32_t>(bytes[0]) | (uint32_t(bytes[1]) << 8) |
                              (uint32_t(bytes[2]) << 16) | (uint32_t(bytes[3]) << 24));
}

// TDPBSSD c, a, b: the three distinct, c.rows == a.rows, c.colsb == b.colsb,
// a.colsb / 4 == b.rows, every colsb a multiple of 4 (else #UD).
inline void dpbssd(int c, int a, int b) {
  check_configured(c), check_configured(a), check_configured(b);
  TileFile& f = tiles();
  if (c == a || c == b || a == b || f.rows[c] != f.rows[a] || f.colsb[c] != f.colsb[b] ||
      f.colsb[a] / 4 != f.rows[b] || f.colsb[a] % 4 || f.colsb[b] % 4) {
    fault();
  }
  for (int m = 0; m < f.rows[c]; ++m) {
    for (int n = 0; n < f.colsb[c] / 4; ++n) {
      int32_t sum = dword(&f.data[c][m][4 * n]);
      for (int j = 0; j < f.colsb[a] / 4; ++j) {
        for (int i = 0; i < 4; ++i) {
          sum += int32_t(static_cast<int8_t>(f.data[a][m][4 * j + i])) *
                 int32_t(static_cast<int8_t>(f.data[b][j][4 * n + i]));
        }
      }
      for (int i = 0; i < 4; ++i) {
        f.data[c][m][4 * n + i] = static_cast<uint8_t>(static_cast<uint32_t>(sum) >> (8 * i));
      }
    }
  }
}

}  // namespace amx_model
}  // namespace kvserve

#define KVSERVE_AMX_TILES 1
#define KVSERVE_TILE_LOADCONFIG(config) kvserve::amx_model::loadconfig(config)
#define KVSERVE_TILE_RELEASE() kvserve::amx_model::release()
#define KVSERVE_TILE_ZERO(t) kvserve::amx_model::zero(t)
#define KVSERVE_TILE_LOADD(t, base, stride) kvserve::amx_model::loadd(t, base, stride)
#define KVSERVE_TILE_STORED(t, base, stride) kvserve::amx_model::stored(t, base, stride)
#define KVSERVE_TILE_DPBSSD(c, a, b) kvserve::amx_model::dpbssd(c, a, b)

namespace kvserve {
inline const char* amx_status() { return ""; }  // the model needs no permission
}  // namespace kvserve

#elif defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#define KVSERVE_AMX_TILES 1
// gcc 12's _tile_loadconfig tells the compiler it reads 8 of the 64 bytes, and _tile_loadd
// that it reads no memory at all: a compiler barrier before each keeps every store to what
// they read ahead of them.
#define KVSERVE_TILE_LOADCONFIG(config) \
  do {                                    \
    __asm__ volatile("" ::: "memory");    \
    _tile_loadconfig(config);             \
  } while (0)
#define KVSERVE_TILE_RELEASE() _tile_release()
#define KVSERVE_TILE_ZERO(t) _tile_zero(t)
#define KVSERVE_TILE_LOADD(t, base, stride)  \
  do {                                       \
    __asm__ volatile("" ::: "memory");       \
    _tile_loadd(t, base, stride);            \
  } while (0)
#define KVSERVE_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define KVSERVE_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)

namespace kvserve {

// Why this process cannot use the tiles ("" where it can): asks Linux once for the tile data
// state (XSTATE component 18, XTILEDATA), as oneDNN does before its AMX kernels.
inline const char* amx_status() {
  static const std::string status = [] {
    constexpr long kGetPermission = 0x1022, kRequestPermission = 0x1023, kTileData = 18;
    if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) {
      return std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
             std::strerror(errno) + ")";
    }
    unsigned long permitted = 0;
    if (syscall(SYS_arch_prctl, kGetPermission, &permitted) != 0 ||
        !(permitted & (1ul << kTileData))) {
      return std::string("Linux did not grant the AMX tile state (ARCH_GET_XCOMP_PERM)");
    }
    return std::string();
  }();
  return status.c_str();
}

}  // namespace kvserve

#endif

// The bf16 tile kernels (attention_amx.h, panel_amx.h): real AMX-BF16 tiles and AVX512-BF16
// for what runs beside them, never the software model (it has no TDPBF16PS).
#if defined(KVSERVE_AMX_TILES) && !defined(KVSERVE_AMX_MODEL) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define KVSERVE_AMX_BF16 1
#endif

namespace kvserve {

// Why this process cannot run the bf16 tile kernels ("" where it can): a build without them,
// or Linux refusing the tile state.
inline const char* amx_bf16_status() {
#if defined(KVSERVE_AMX_BF16)
  return amx_status();
#else
  return "this build has no AMX-BF16 path (-march=native on a CPU without amx_bf16)";
#endif
}

}  // namespace kvserve
