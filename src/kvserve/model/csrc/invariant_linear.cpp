// A projection whose every output element is reduced in one fixed order, whatever the batch:
// out[t][n] = sum_k x[t][k] * w[n][k], for --batch-invariant (docs/tenants.md).
//
// A library GEMM (oneDNN, MKL) picks its blocking of k, and so the order of the sums, by the
// shape of the whole call: a row's result changes with how many rows came with it. Here each
// element is one chain of vector multiply-adds over k in steps of one register (32 bf16 pairs
// with vdpbf16ps, or 16 float32 with an FMA), a zero-padded masked load for the last partial
// step, then one fixed horizontal sum; rows and columns are register-blocked 4 x 4 (any
// remainder 1-3) and columns spread over threads, neither of which changes that chain. So
// row t's output is bit-identical alone, in a batch of 32, in a prefill chunk of any size or
// in a decode step. Accumulation is float32; a bfloat16 output is rounded once.

#include "invariant_linear.h"

#include "fast_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kvserve::dispatch_dtype;
using kvserve::for_chunks;
using kvserve::from_float;
using kvserve::to_float;

constexpr int64_t kColumnsPerTask = 64;  // output columns per work item: its weights stay in L2

#if defined(__AVX512F__)
// How one register step multiplies: elements per step, the masked load, the multiply-add.
struct F32Step {
  using T = float;
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static Reg load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
  static __m512 madd(__m512 acc, Reg a, Reg b) { return _mm512_fmadd_ps(a, b, acc); }
  static __mmask16 tail_mask(int64_t left) {
    return static_cast<__mmask16>((1u << left) - 1u);
  }
};

#if defined(__AVX512BF16__)
struct Bf16Step {
  using T = c10::BFloat16;
  using Reg = __m512bh;
  static constexpr int kWidth = 32;
  static Reg load(const c10::BFloat16* p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
  }
  static __m512 madd(__m512 acc, Reg a, Reg b) { return _mm512_dpbf16_ps(acc, a, b); }
  static __mmask32 tail_mask(int64_t left) {
    return static_cast<__mmask32>((1ull << left) - 1ull);
  }
};
#endif

// out[r][c] for RN rows of x and CN rows of w (<= 4 each): RN x CN chains over k.
template <typename Step, int RN, int CN>
void block_simd(const typename Step::T* x, const typename Step::T* w, int64_t k_dim,
                float* out, int64_t out_stride) {
  __m512 acc[RN][CN];
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm512_setzero_ps();
  const auto full = Step::tail_mask(Step::kWidth);
  for (int64_t k = 0; k < k_dim; k += Step::kWidth) {
    const auto mask = k + Step::kWidth <= k_dim ? full : Step::tail_mask(k_dim - k);
    typename Step::Reg wv[CN];
    for (int c = 0; c < CN; ++c) wv[c] = Step::load(w + c * k_dim + k, mask);
    for (int r = 0; r < RN; ++r) {
      const typename Step::Reg xv = Step::load(x + r * k_dim + k, mask);
      for (int c = 0; c < CN; ++c) acc[r][c] = Step::madd(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < CN; ++c) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

// The same without intrinsics: 16 partial sums per element, k in steps of 16, then summed
// in a fixed order; the compiler may vectorise it but may not reorder the sums (no
// -ffast-math).
template <typename T, int RN, int CN>
void block_generic(const T* x, const T* w, int64_t k_dim, float* out, int64_t out_stride) {
  for (int r = 0; r < RN; ++r) {
    for (int c = 0; c < CN; ++c) {
      float part[16] = {};
      const T* xr = x + r * k_dim;
      const T* wc = w + c * k_dim;
      for (int64_t k = 0; k < k_dim; ++k) part[k % 16] += to_float(xr[k]) * to_float(wc[k]);
      float sum = 0.0f;
      for (int i = 0; i < 16; ++i) sum += part[i];
      out[r * out_stride + c] = sum;
    }
  }
}

template <typename T, int RN, int CN>
void block(const T* x, const T* w, int64_t k_dim, float* out, int64_t out_stride) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    return block_simd<F32Step, RN, CN>(x, w, k_dim, out, out_stride);
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return block_simd<Bf16Step, RN, CN>(x, w, k_dim, out, out_stride);
  }
#endif
#endif
  block_generic<T, RN, CN>(x, w, k_dim, out, out_stride);
}

// x: [rows, k], weight: [n, k] -> [rows, n] in x's dtype.
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "invariant_linear: x must be contiguous "
              "[rows, in_features]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "invariant_linear: weight must be contiguous [out_features, in_features]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(),
              "invariant_linear: weight and x dtypes differ");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
              "invariant_linear: tensors must be on the CPU");
  const int64_t rows = x.size(0), k_dim = x.size(1), n = weight.size(0);
  at::Tensor acc = at::empty({rows, n}, x.options().dtype(at::kFloat));
  at::Tensor out = x.scalar_type() == at::kFloat ? acc : at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  dispatch_dtype(x.scalar_type(), "invariant_linear", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    float* ap = acc.data_ptr<float>();
    T* op = out.data_ptr<T>();
    const int64_t tasks = (n + kColumnsPerTask - 1) / kColumnsPerTask;
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c0 = task * kColumnsPerTask;
        const int ncols = static_cast<int>(std::min(kColumnsPerTask, n - c0));
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
          const int nrows = static_cast<int>(std::min<int64_t>(4, rows - r0));
          kvserve::with_constant<4>(nrows, [&](auto rn) {
            for_chunks<4>(ncols, [&](int c, auto cn) {
              block<T, decltype(rn)::value, decltype(cn)::value>(
                  xp + r0 * k_dim, wp + (c0 + c) * k_dim, k_dim, ap + r0 * n + c0 + c, n);
            });
          });
          if constexpr (!std::is_same_v<T, float>) {
            for (int r = 0; r < nrows; ++r)
              for (int c = 0; c < ncols; ++c) {
                const int64_t i = (r0 + r) * n + c0 + c;
                op[i] = from_float<T>(ap[i]);
              }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

void register_invariant_linear(pybind11::module& m) {
  m.def("invariant_linear", &invariant_linear,
        "x @ weight.T with one fixed reduction order per element, whatever the number of rows",
        py::arg("x"), py::arg("weight"));
}
