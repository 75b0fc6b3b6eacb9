// Int8 projections (--quantization int8, docs/quantization.md): dynamic W8A8 on AVX2.
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
// row: on the bundled SmolLM2-135M per-row scales cost +3.5% perplexity, groups of 64 +0.7%
// (the weights' own share +0.4%; docs/quantization.md).
//
// Layout (llama.pack_pair_panels on the int8 weight): [ceil(n / 16), k / 2, 16, 2], each pair
// of k holding each column's two weights side by side, k padded to even with zeros. One k pair
// of a panel is 32 bytes: sign-extending 16 of them to int16 (vpmovsxbw) gives columns 0-7 (or
// 8-15) as int16 pairs, and vpmaddwd against a row's broadcast int16 pair adds both products
// into each column's int32 lane. That is 16 multiply-adds per instruction where a float32 FMA
// does 8, over weights a quarter of float32's bytes. No vpmaddubsw: its int16 saturation would
// make the sums inexact.
//
// A block of kRows (6) rows x one panel keeps 12 int32 accumulators in registers through a
// group, then adds them into float32 sums; panels are spread over threads as in
// panel_linear.cpp.

#include "int8_linear.h"

#include "fast_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#define KVSERVE_INT8_LINEAR 1
#endif

namespace {

constexpr int kPanel = 16;  // output columns per panel
constexpr int kRows = 6;    // rows per register block (block_sums is written for 6)
constexpr int kGroup = 64;  // k per activation scale (quantization.ACTIVATION_GROUP)
constexpr int kGroupPairs = kGroup / 2;

#if defined(KVSERVE_INT8_LINEAR)
// One group of a row (len <= kGroup values of x) as int16 and its scale. cvtps2dq rounds by
// MXCSR, half to even by default, as std::nearbyint does for the tail.
float quantize_group(const float* x, int64_t len, int16_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = *std::max_element(lanes, lanes + 8);
  for (; k < len; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
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
void quantize_row(const float* x, int64_t k_dim, int16_t* q, float* scales) {
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

// The float32 sums of kRows (6) quantized rows (ldq int16 apart; their groups' scales ldg
// apart) against one panel: acc[2 r] columns 0-7 of row r, acc[2 r + 1] columns 8-15.
void block_sums(const int16_t* q, int64_t ldq, const float* sx, int64_t ldg,
                const int8_t* panel, int64_t k_pairs, __m256* acc) {
  for (int i = 0; i < 2 * kRows; ++i) acc[i] = _mm256_setzero_ps();
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
    const __m256i sums[2 * kRows] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};
    for (int i = 0; i < 2 * kRows; ++i) {
      const __m256 scale = _mm256_set1_ps(sx[(i / 2) * ldg + g]);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), scale, acc[i]);
    }
  }
}
#undef KVSERVE_INT8_ROW

// The same sums for RN < kRows rows (a block's last rows), in intrinsics: with at most three
// rows gcc keeps them in registers.
template <int RN>
void tail_sums(const int16_t* q, int64_t ldq, const float* sx, int64_t ldg,
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
void store_block(const __m256* acc, int rows, const float* sw, float* out, int64_t ldo,
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
#endif

// x: [rows, k] float32; panels: [ceil(n / 16), ceil(k / 2), 16, 2] int8; scales: [ceil(n / 16)
// * 16] float32 (the columns' sw, padded) -> [rows, n] float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                       int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "int8_linear: x must be contiguous float32 [rows, in_features]");
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() && panels.scalar_type() == at::kChar &&
                  panels.size(2) == kPanel && panels.size(3) == 2 &&
                  panels.size(1) == (x.size(1) + 1) / 2 && n >= 0 &&
                  panels.size(0) == (n + kPanel - 1) / kPanel,
              "int8_linear: panels must be contiguous int8 [ceil(n / 16), ceil(in_features / 2), "
              "16, 2]");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == panels.size(0) * kPanel,
              "int8_linear: scales must be contiguous float32 [ceil(n / 16) * 16]");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && scales.device().is_cpu(),
              "int8_linear: tensors must be on the CPU");
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
      quantize_row(xp + t * k_dim, k_dim, &q[t * ldq], &sx[t * ldg]);
    }
  });
  const int8_t* wp = panels.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    __m256 acc[2 * kRows];
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = wp + p * k_pairs * 2 * kPanel;
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      for (int64_t r0 = 0; r0 < rows;) {
        const int left = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
        const int done = left == kRows ? kRows : std::min(left, 3);
        if (done == kRows) {
          block_sums(&q[r0 * ldq], ldq, &sx[r0 * ldg], ldg, panel, k_pairs, acc);
        } else {
          kvserve::with_constant<3>(done, [&](auto tn) {
            tail_sums<decltype(tn)::value>(&q[r0 * ldq], ldq, &sx[r0 * ldg], ldg, panel,
                                           k_pairs, acc);
          });
        }
        store_block(acc, done, sp + p * kPanel, op + r0 * n + p * kPanel, n, ncols);
        r0 += done;
      }
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

void register_int8_linear(pybind11::module& m) {
  m.def("int8_linear", &int8_linear,
        "x @ weight.T with x quantized to int8 per row and group of 64 k and an int8 weight "
        "(per-column scales) in pairs-of-k panels of 16 columns; int32 sums per group, float32 "
        "out (AVX2 builds)",
        py::arg("x"), py::arg("panels"), py::arg("scales"), py::arg("n"));
  m.def("int8_linear_compiled", &int8_linear_compiled,
        "Whether this build has int8_linear (a build with AVX2)");
}
