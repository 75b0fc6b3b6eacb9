// Float32 projections on AVX2 CPUs: out[t][n] = sum_k x[t][k] * w[n][k], x and
// out float32, the weight float32 or, where its values are bfloat16 numbers, stored as bf16
// and widened on load (the same values in half the bytes).
//
// Why not a library GEMM: on a Zen 3 (AVX2, 2 cores) oneDNN's packed float32 GEMM runs
// SmolLM2's layer projections (30 layers' worth, streamed from memory) at 39-116 GFLOP/s for
// 4-32 rows and ~168 at 512-2,048, MKL's sgemm lower still at decode sizes; this kernel at
// 59-157 and ~190 with float32 panels, 109-177 and ~190 with bf16 panels
// (benchmarks/panel_linear.py, docs/benchmarks.md).
//
// Layout (llama.pack_panels): the weight's rows (output columns) in panels of 16, each panel
// [K][16], so a panel streams through memory once per call. bf16 panels order each k's 16
// columns so that 32-bit element j holds column j in its high half and column j + 8 in its low
// half: masking the low halves gives columns 0-7 as float32, shifting left by 16 gives columns
// 8-15, two integer ops per 16 weights and no shuffles.
//
// A block of up to 6 rows x one panel keeps 12 accumulators, the two weight vectors and a
// broadcast row value in AVX2's 16 registers: per k one or two 32-byte loads, 6 broadcasts and
// 12 FMAs. Each output is one FMA chain over k in order, so a row's result does not depend on
// the other rows of the call (nor on the thread count: panels are spread over threads).
//
// The code is AVX2's, so it builds on AVX-512 CPUs too (which run it as it is); there it is
// used only when asked for (KVSERVE_PROJECTIONS, docs/kernels.md). On AVX512-BF16 builds this
// file also binds panel_linear_bf16: bf16 rows against bf16 weights in pairs-of-k panels,
// summed by vdpbf16ps (panel_dpbf16.h).

#include "panel_linear.h"
#include "ops.h"

#include "fast_math.h"
#include "panel_amx.h"
#include "panel_dpbf16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_PANEL_LINEAR 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVSERVE_PANEL_DPBF16 1
#endif

namespace {

constexpr int kPanel = 16;  // output columns per panel
constexpr int kRows = 6;    // rows per register block

#if defined(KVSERVE_PANEL_LINEAR)
// One k of a panel as two float32 vectors: columns 0-7 and 8-15.
struct Float32Panel {  // [K][16] float32, columns in order
  using T = float;
  static void load(const float* p, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(p);
    w1 = _mm256_loadu_ps(p + 8);
  }
};
struct Bf16Panel {  // [K][16] bfloat16, 32-bit element j = column j (high), j + 8 (low)
  using T = c10::BFloat16;
  static void load(const c10::BFloat16* p, __m256& w0, __m256& w1) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w0 = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  }
};

// out[r][c] for RN rows of x (ldx apart) and one panel's ncols columns.
template <typename Panel, int RN>
inline void panel_block(const float* x, int64_t ldx, const typename Panel::T* panel,
                        int64_t k_dim, float* out, int64_t ldo, int ncols) {
  // Whole loops over the rows are unrolled (RN is a constant): with any of them left as a
  // loop gcc keeps the accumulators in memory and stores all twelve at every k.
  __m256 acc[RN][2];
#pragma GCC unroll 8
  for (int r = 0; r < RN; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m256 w0, w1;  // columns 0-7 and 8-15
    Panel::load(panel + kPanel * k, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < RN; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  if (ncols == kPanel) {
#pragma GCC unroll 8
    for (int r = 0; r < RN; ++r) {
      _mm256_storeu_ps(out + r * ldo, acc[r][0]);
      _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
    }
    return;
  }
  alignas(32) float lanes[RN][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < RN; ++r) {
    _mm256_store_ps(lanes[r], acc[r][0]);
    _mm256_store_ps(lanes[r] + 8, acc[r][1]);
  }
  for (int r = 0; r < RN; ++r) std::copy(lanes[r], lanes[r] + ncols, out + r * ldo);
}
#endif

// x: [rows, k] float32; panels: [ceil(n / 16), k, 16] float32 or bfloat16 (the layouts
// above) -> [rows, n] float32.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "panel_linear: x must be contiguous float32 [rows, in_features]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel &&
                  panels.size(1) == x.size(1) && n >= 0 &&
                  panels.size(0) == (n + kPanel - 1) / kPanel,
              "panel_linear: panels must be contiguous [ceil(n / 16), in_features, 16]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16,
              "panel_linear: panels must be float32 or bfloat16");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(),
              "panel_linear: tensors must be on the CPU");
  const int64_t rows = x.size(0), k_dim = x.size(1), num_panels = panels.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
#if defined(KVSERVE_PANEL_LINEAR)
  if (rows == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](auto panel_kind, const auto* wp) {
    using Panel = decltype(panel_kind);
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const auto* panel = wp + p * k_dim * kPanel;
        const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          kvserve::with_constant<kRows>(static_cast<int>(std::min<int64_t>(kRows, rows - r0)),
                                        [&](auto rn) {
            panel_block<Panel, decltype(rn)::value>(xp + r0 * k_dim, k_dim, panel, k_dim,
                                                    op + r0 * n + p * kPanel, n, ncols);
          });
        }
      }
    });
  };
  if (panels.scalar_type() == at::kFloat) {
    run(Float32Panel{}, panels.data_ptr<float>());
  } else {
    run(Bf16Panel{}, panels.data_ptr<at::BFloat16>());
  }
  return out;
#else
  (void)num_panels, (void)rows, (void)k_dim;
  TORCH_CHECK(false, "panel_linear: this build has no AVX2 tier (see compiled_isa)");
  return out;
#endif
}

// bf16 rows x [rows, k] and pairs-of-k panels [ceil(n / 16), k / 2, 16, 2] (panel_dpbf16.h's
// layout, which panel_amx.h reads too) that fit each other and n, on the CPU.
void check_pair_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                       const char* name) {
  constexpr int64_t width = 16;  // output columns per panel
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be contiguous bfloat16 [rows, in_features]");
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16 && panels.size(2) == width &&
                  panels.size(3) == 2 && 2 * panels.size(1) == x.size(1) && n >= 0 &&
                  panels.size(0) == (n + width - 1) / width,
              name, ": panels must be contiguous bfloat16 [ceil(n / 16), in_features / 2, 16, 2]");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), name,
              ": tensors must be on the CPU");
}

}  // namespace

namespace kvserve::ops {

// x: [rows, k] bfloat16; panels: [ceil(n / 16), k / 2, 16, 2] bfloat16 (panel_dpbf16.h's
// layout) -> [rows, n] float32, or bfloat16 with bf16_out (rounded once, in the kernel: no
// float32 output to allocate and convert).
at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                             bool bf16_out) {
  using kvserve::dpbf16::kPanel;  // the header's panel width, not panel_linear's
  check_pair_panels(x, panels, n, "panel_linear_bf16");
  const int64_t rows = x.size(0), k_pairs = panels.size(1), num_panels = panels.size(0);
  at::Tensor out =
      at::empty({rows, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
#if defined(KVSERVE_PANEL_DPBF16)
  if (rows == 0 || n == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  auto run = [&](auto* op) {
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      const int64_t ncols = std::min(n, end * kPanel) - begin * kPanel;
      kvserve::dpbf16::panel_rows<kvserve::dpbf16::NativeDot>(
          xp, rows, wp + begin * k_pairs * 2 * kPanel, k_pairs, op + begin * kPanel, n, ncols);
    });
  };
  if (bf16_out) {
    run(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  } else {
    run(out.data_ptr<float>());
  }
  return out;
#else
  (void)num_panels, (void)rows, (void)k_pairs;
  TORCH_CHECK(false, "panel_linear_bf16: this build has no AVX512-BF16 (see compiled_isa)");
  return out;
#endif
}

// panel_linear_bf16 on AMX tiles (panel_amx.h): the same panels, in_features a multiple of 32.
at::Tensor panel_linear_amx(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                            bool bf16_out) {
  const std::string status = kvserve::amx_bf16_status();
  TORCH_CHECK(status.empty(), "panel_linear_amx: ", status);
  check_pair_panels(x, panels, n, "panel_linear_amx");
  TORCH_CHECK(x.size(1) % 32 == 0, "panel_linear_amx: in_features must be a multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1), num_panels = panels.size(0);
  at::Tensor out =
      at::empty({rows, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
#if defined(KVSERVE_AMX_BF16)
  namespace amx = kvserve::panel_amx;
  if (rows == 0 || n == 0) return out;
  const int64_t padded_rows = (rows + amx::kRows - 1) / amx::kRows * amx::kRows;
  at::Tensor rows_in = x;
  if (padded_rows != rows) {  // whole A tiles: zero rows after the real ones
    rows_in = at::zeros({padded_rows, k}, x.options());
    rows_in.narrow(0, 0, rows).copy_(x);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(rows_in.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  const int64_t k_steps = k / amx::kStepK;
  auto run = [&](auto* op) {
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      const kvserve::TileConfig config = kvserve::full_tile_config();
      KVSERVE_TILE_LOADCONFIG(&config);
      const int last_cols = end == num_panels ? static_cast<int>(n - (end - 1) * 16) : 16;
      amx::panel_rows(xp, rows, padded_rows, wp + begin * k * 16, k_steps, end - begin,
                      last_cols, op + begin * 16, n);
      KVSERVE_TILE_RELEASE();
    });
  };
  if (bf16_out) {
    run(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  } else {
    run(out.data_ptr<float>());
  }
#endif
  return out;
}

}  // namespace kvserve::ops

bool panel_linear_compiled() {
#if defined(KVSERVE_PANEL_LINEAR)
  return true;
#else
  return false;
#endif
}

bool panel_linear_bf16_compiled() {
#if defined(KVSERVE_PANEL_DPBF16)
  return true;
#else
  return false;
#endif
}

void register_panel_linear(pybind11::module& m) {
  m.def("panel_linear", &panel_linear,
        "x @ weight.T for float32 x and a float32 or bfloat16 weight packed in panels of 16 "
        "columns (AVX2 builds)",
        py::arg("x"), py::arg("panels"), py::arg("n"));
  m.def("panel_linear_compiled", &panel_linear_compiled,
        "Whether this build has panel_linear (a build with AVX2 and FMA)");
  m.def("panel_linear_bf16", &kvserve::ops::panel_linear_bf16,
        "x @ weight.T for bfloat16 x and a bfloat16 weight packed in pairs-of-k panels of 16 "
        "columns, float32 out, or bfloat16 with bf16_out (AVX512-BF16 builds)",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bf16_out") = false);
  m.def("panel_linear_amx", &kvserve::ops::panel_linear_amx,
        "panel_linear_bf16 on AMX-BF16 tiles, in_features a multiple of 32 (AMX builds, "
        "where Linux grants the tiles: amx_bf16_status)",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bf16_out") = false);
  m.def("panel_linear_bf16_compiled", &panel_linear_bf16_compiled,
        "Whether this build has panel_linear_bf16 (a build with AVX512-BF16)");
}
