// Int8 projections (--quantization int8, docs/quantization.md): dynamic W8A8 on AVX2 (and
// AVX512-VNNI where the build has it).
//
//   weight  w[n][k] ~ qw[n][k] * sw[n]        symmetric int8 per output column, at load
//   rows    x[t][k] ~ qx[t][k] * sx[t][k / G]  symmetric int8 per row and group of G = 64 k,
//                                              quantized each call
//   out[t][n] = (sum over groups g of float(sum_{k in g} qx[t][k] * qw[n][k]) * sx[t][g]) * sw[n]
//
// Each group's sum is exact (int32); the groups are added in order with one float32 FMA each,
// so a row's result does not depend on the rows of the call or the thread count, and matches
// a float64 reference (quantization.int8_linear_reference) within float32 rounding. A
// group's scale is sx = amax / 127 and qx = round-half-even(x * (127 / amax)), clamped to
// [-127, 127]; a group of zeros has sx = 0 and qx = 0. Scales per group of 64 rather than per
// row: on the bundled SmolLM2-135M per-row scales cost +3.5% perplexity, groups of 64 about
// +1% (the weights' own share +0.4%; docs/quantization.md).
//
// Layout (llama.pack_pair_panels on the int8 weight): [ceil(n / 16), k / 2, 16, 2], each pair
// of k holding each column's two weights side by side, k padded to even with zeros. One k pair
// of a panel is 32 bytes: sign-extending 16 of them to int16 (vpmovsxbw) gives columns 0-7 (or
// 8-15) as int16 pairs, and vpmaddwd against a row's broadcast int16 pair adds both products
// into each column's int32 lane. That is 16 multiply-adds per instruction where a float32 FMA
// does 8, over weights a quarter of float32's bytes. No vpmaddubsw: its int16 saturation would
// make the sums inexact.
//
// The loops live in int8_blocks.h: on AVX2, blocks of 6 rows x one panel keep 12 int32
// accumulators in registers through a group, then add them into float32 sums; where the build
// has AVX512-VNNI, blocks of 12 rows use one vpdpwssd per row per pair of k on 512-bit
// registers (the same bits). Panels are spread over threads as in panel_linear.cpp.
//
// Where the build has AMX-INT8 and Linux grants this process the tiles (amx_tiles.h), one
// TDPBSSD sums a whole group of 16 rows x 16 columns x 64 k; it reads the weight as "quad
// panels" (quantization.pack_int8 picks them where int8_linear_path() says amx) and the rows
// as int8 padded to whole tiles, and gives the same bits again (int8_linear_quads).

#include "int8_linear.h"

#include "int8_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX2__)
#define KVSERVE_INT8_LINEAR 1
#endif

namespace {

using kvserve::int8::kGroup;
using kvserve::int8::kPanel;

// Why the AMX path cannot run in this process ("" where it can).
std::string amx_unavailable() {
#if defined(KVSERVE_INT8_AMX)
  const std::string status = kvserve::amx_status();
  return status.empty() ? status : status + "; the int8 projections use " + kvserve::int8::path();
#else
  return "this build has no AMX-INT8 (the building CPU has no amx_int8, or the compiler no "
         "-mamx-int8)";
#endif
}

void check_common(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "int8_linear: x must be contiguous float32 [rows, in_features]");
  TORCH_CHECK(panels.dim() == 4, "int8_linear: panels must be 4-D (pairs [ceil(n / 16), "
              "ceil(in_features / 2), 16, 2] or the AMX path's quads [..., 16, 4])");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == panels.size(0) * kPanel,
              "int8_linear: scales must be contiguous float32 [ceil(n / 16) * 16]");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && scales.device().is_cpu(),
              "int8_linear: tensors must be on the CPU");
}

// The AMX path: quad panels [ceil(n / 16), ceil(k / 64) * 16, 16, 4] (int8_blocks.h). Their
// shape gives k only to a whole group of 64 (the pairs' gives it to 2): a weight of another k
// within the same groups is not caught here.
at::Tensor int8_linear_quads(const at::Tensor& x, const at::Tensor& panels,
                             const at::Tensor& scales, int64_t n) {
  const int64_t rows = x.size(0), k_dim = x.size(1);
  const int64_t groups = (k_dim + kGroup - 1) / kGroup;
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == at::kChar &&
                  panels.size(1) == groups * (kGroup / 4) && panels.size(2) == kPanel &&
                  n >= 0 && panels.size(0) == (n + kPanel - 1) / kPanel,
              "int8_linear: quad panels must be contiguous int8 [ceil(n / 16), "
              "ceil(in_features / 64) * 16, 16, 4]");
  const std::string reason = amx_unavailable();
  TORCH_CHECK(reason.empty(), "int8_linear: quad panels are the AMX-INT8 path's, which cannot "
              "run here: ", reason);
  at::Tensor out = at::empty({rows, n}, x.options());
#if defined(KVSERVE_INT8_AMX)
  using kvserve::int8::kAmxRows;
  if (rows == 0 || n == 0) return out;
  const int64_t ldqa = groups * kGroup;
  const int64_t padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  // the rows as int8 and, per block of 16 rows, their scales as [groups][16]; padding zero
  std::vector<int8_t> qa(static_cast<size_t>(padded * ldqa));
  std::vector<float> sx(static_cast<size_t>(padded * groups));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / kAmxRows * kAmxRows;
      kvserve::int8::quantize_row_int8(xp + t * k_dim, k_dim, &qa[t * ldqa], ldqa,
                                       &sx[block * groups + t - block], kAmxRows);
    }
  });
  const int8_t* wp = panels.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    KVSERVE_TILE_LOADCONFIG(kvserve::int8::kAmxConfig.bytes);  // this thread's tiles
    for (int64_t p = begin; p < end; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      kvserve::int8::amx_panel_rows(qa.data(), rows, ldqa, sx.data(),
                                    wp + p * groups * kvserve::int8::kTileBytes,
                                    sp + p * kPanel, op + p * kPanel, n, ncols);
    }
    KVSERVE_TILE_RELEASE();
  });
#endif
  return out;
}

// x: [rows, k] float32; panels: [ceil(n / 16), ceil(k / 2), 16, 2] int8 (or the AMX path's
// quad panels, int8_linear_quads); scales: [ceil(n / 16) * 16] float32 (the columns' sw,
// padded) -> [rows, n] float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                       int64_t n) {
  check_common(x, panels, scales);
  if (panels.size(3) == 4) return int8_linear_quads(x, panels, scales, n);
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == at::kChar &&
                  panels.size(2) == kPanel && panels.size(3) == 2 &&
                  panels.size(1) == (x.size(1) + 1) / 2 && n >= 0 &&
                  panels.size(0) == (n + kPanel - 1) / kPanel,
              "int8_linear: panels must be contiguous int8 [ceil(n / 16), ceil(in_features / 2), "
              "16, 2] (or the AMX path's [ceil(n / 16), ceil(in_features / 64) * 16, 16, 4])");
  const int64_t rows = x.size(0), k_dim = x.size(1), k_pairs = panels.size(1);
  const int64_t num_panels = panels.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
#if defined(KVSERVE_INT8_LINEAR)
  if (rows == 0 || n == 0) return out;
  // the rows quantized, with their groups' scales
  const int64_t ldq = 2 * k_pairs, ldg = (k_dim + kGroup - 1) / kGroup;
  std::vector<int16_t> q(static_cast<size_t>(rows * ldq));
  std::vector<float> sx(static_cast<size_t>(rows * ldg));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      kvserve::int8::quantize_row(xp + t * k_dim, k_dim, &q[t * ldq], &sx[t * ldg]);
    }
  });
  const int8_t* wp = panels.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      kvserve::int8::panel_rows(q.data(), rows, ldq, sx.data(), ldg,
                                wp + p * k_pairs * 2 * kPanel, k_pairs, sp + p * kPanel,
                                op + p * kPanel, n, ncols);
    }
  });
  return out;
#else
  (void)num_panels, (void)rows, (void)k_dim, (void)k_pairs;
  TORCH_CHECK(false, "int8_linear: this build has no AVX2 tier (see compiled_isa)");
  return out;
#endif
}

}  // namespace

bool int8_linear_compiled() {
#if defined(KVSERVE_INT8_LINEAR)
  return true;
#else
  return false;
#endif
}

std::string int8_linear_path() {
#if defined(KVSERVE_INT8_LINEAR)
  return amx_unavailable().empty() ? "amx" : kvserve::int8::path();
#else
  return "none";
#endif
}

void register_int8_linear(pybind11::module& m) {
  m.def("int8_linear_path", &int8_linear_path,
        "The instructions int8_linear sums with here: amx (over quad panels), avx512_vnni, avx2 "
        "or none");
  m.def("int8_amx_unavailable", &amx_unavailable,
        "Why int8_linear's AMX-INT8 path cannot run in this process, or '' where it can");
  m.def("int8_linear", &int8_linear,
        "x @ weight.T with x quantized to int8 per row and group of 64 k and an int8 weight "
        "(per-column scales) in pairs-of-k panels of 16 columns; int32 sums per group, float32 "
        "out (AVX2 builds)",
        py::arg("x"), py::arg("panels"), py::arg("scales"), py::arg("n"));
  m.def("int8_linear_compiled", &int8_linear_compiled,
        "Whether this build has int8_linear (a build with AVX2)");
}
