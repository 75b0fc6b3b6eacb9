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
#include "invariant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

using kvserve::dispatch_dtype;
using kvserve::for_chunks;
using kvserve::from_float;
using kvserve::invariant::block;

constexpr int64_t kColumnsPerTask = 64;  // output columns per work item: its weights stay in L2

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
