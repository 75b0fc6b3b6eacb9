// Fused elementwise ops of a decoder layer: each replaces 5-15 small torch ops (and their
// dispatch, allocation and dtype round trips), which dominate a decode step of a small model.
//
// Arithmetic is float32; bfloat16 tensors are widened on load and rounded (to nearest even)
// once on store. Rows are spread over torch's intra-op threads only when a step has enough of
// them to pay for waking the threads; a decode step's few rows run on the calling thread.

#include "layer_ops.h"
#include "ops.h"

#include "fast_math.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using kvserve::dispatch_dtype;
using kvserve::from_float;
using kvserve::to_float;

constexpr int64_t kElementsPerTask = 1 << 15;

template <typename Fn>
void for_rows(int64_t rows, int64_t row_elements, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, row_elements));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) fn(row);
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be contiguous [rows, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              name, ": weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight and x dtypes differ");
  TORCH_CHECK(x.device().is_cpu(), name, ": tensors must be on the CPU");
}

template <typename T>
void norm_row(const T* src, const T* weight, int64_t hidden, float eps, T* dst) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = to_float(src[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    dst[i] = from_float<T>(to_float(src[i]) * inv * to_float(weight[i]));
  }
}

// Per row: with a residual, residual += x (rounded to the dtype, as a separate add would) and
// the sum is normalised; without, x is. out = v / sqrt(mean(v^2) + eps) * weight.
at::Tensor norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                     double eps, const char* name) {
  check_rows(x, weight, name);
  TORCH_CHECK(residual == nullptr ||
                  (residual->sizes() == x.sizes() && residual->is_contiguous() &&
                   residual->scalar_type() == x.scalar_type()),
              name, ": residual must be contiguous and match x");
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = x.size(1);
  dispatch_dtype(x.scalar_type(), name, [&](auto zero) {
    using T = decltype(zero);
    const T* src = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* acc = residual == nullptr ? nullptr : residual->data_ptr<T>();
    T* dst = out.data_ptr<T>();
    for_rows(x.size(0), hidden, [&](int64_t row) {
      const T* s = src + row * hidden;
      if (acc != nullptr) {
        T* r = acc + row * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          r[i] = from_float<T>(to_float(r[i]) + to_float(s[i]));
        }
        s = r;
      }
      norm_row(s, w, hidden, static_cast<float>(eps), dst + row * hidden);
    });
  });
  return out;
}

template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* first = x + h * dim;
    T* second = first + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = to_float(first[i]), b = to_float(second[i]);
      first[i] = from_float<T>(a * cos[i] - b * sin[i]);
      second[i] = from_float<T>(b * cos[i] + a * sin[i]);
    }
  }
}

}  // namespace

namespace kvserve::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_rows(x, nullptr, weight, eps, "rms_norm");
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps) {
  return norm_rows(x, &residual, weight, eps, "add_rms_norm_");
}

// gate_up: [rows, 2 * n] (gate, then up) -> silu(gate) * up: [rows, n].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be contiguous [rows, 2 * n]");
  const int64_t n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  dispatch_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    for_rows(gate_up.size(0), 2 * n, [&](int64_t row) {
      const T* gate = src + row * 2 * n;
      const T* up = gate + n;
      T* o = dst + row * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        // sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below.
        const float g = to_float(gate[i]);
        const float e = kvserve::exp_nonpositive(-std::fabs(g));
        const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[i] = from_float<T>(g * sigmoid * to_float(up[i]));
      }
    });
  });
  return out;
}

// qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], q then k then v per token. Rotates q and
// k in place (rotate-half layout; cos, sin: [max_positions, head_dim / 2] float32 tables) and
// stores k and v at slot_mapping[t] of the caches ([num_blocks, block_size, kv_heads, dim]).
void rope_and_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be contiguous [T, width]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type(),
              "caches and qkv dtypes differ");
  const int64_t dim = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && dim % 2 == 0, "cache geometry mismatch");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim, "qkv width mismatch");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(1) == dim / 2,
              "cos and sin must be contiguous float32 [max_positions, head_dim / 2]");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == tokens,
              "positions must be contiguous long [T]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "slot_mapping must be contiguous long [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t max_position = cos.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " out of range");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  }
  const int64_t width = qkv.size(1);
  const int64_t kv_width = num_kv_heads * dim;
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  dispatch_dtype(qkv.scalar_type(), "rope_and_write_kv", [&](auto zero) {
    using T = decltype(zero);
    T* base = qkv.data_ptr<T>();
    T* k_dst = k_cache.data_ptr<T>();
    T* v_dst = v_cache.data_ptr<T>();
    for_rows(tokens, width, [&](int64_t t) {
      T* q = base + t * width;
      T* k = q + num_heads * dim;
      const float* c = cos_ptr + pos[t] * (dim / 2);
      const float* s = sin_ptr + pos[t] * (dim / 2);
      rotate_heads(q, num_heads, dim, c, s);
      rotate_heads(k, num_kv_heads, dim, c, s);
      std::memcpy(k_dst + slots[t] * kv_width, k, sizeof(T) * kv_width);
      std::memcpy(v_dst + slots[t] * kv_width, k + kv_width, sizeof(T) * kv_width);
    });
  });
}

}  // namespace kvserve::ops

namespace {

// in[0 .. n) as float32 into out; whether the maximum occurs more than once. One pass: each of
// kLanes lanes keeps its maximum and how often it has seen it; the row's count is the sum over
// the lanes that hold the row's maximum.
inline bool widen_row(const c10::BFloat16* in, float* out, int64_t n) {
  constexpr int64_t kLanes = 16;
  float top[kLanes];
  int32_t seen[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    top[j] = -INFINITY;
    seen[j] = 0;
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = to_float(in[i + j]);
      out[i + j] = v;
      seen[j] = v > top[j] ? 1 : seen[j] + (v == top[j] ? 1 : 0);
      top[j] = std::max(top[j], v);
    }
  }
  for (int64_t j = 0; i < n; ++i, ++j) {
    const float v = to_float(in[i]);
    out[i] = v;
    seen[j] = v > top[j] ? 1 : seen[j] + (v == top[j] ? 1 : 0);
    top[j] = std::max(top[j], v);
  }
  float row_top = -INFINITY;
  for (int64_t j = 0; j < kLanes; ++j) row_top = std::max(row_top, top[j]);
  int64_t at_top = 0;
  for (int64_t j = 0; j < kLanes; ++j) at_top += top[j] == row_top ? seen[j] : 0;
  return at_top > 1;
}

// logits: [rows, vocab] bfloat16 (an LM head's output) -> float32 logits, and per row whether
// its maximum occurs more than once. Rounding to bfloat16 is monotonic, so such a tie is the
// only way it can have changed a row's greedy token (kvserve/model/logits.py). The widening
// pass exists anyway; the maximum and its count ride along in the same loop.
std::tuple<at::Tensor, at::Tensor> widen_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kBFloat16 && logits.device().is_cpu(),
              "widen_logits: logits must be contiguous bfloat16 [rows, vocab] on the CPU");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  at::Tensor out = at::empty({rows, vocab}, logits.options().dtype(at::kFloat));
  at::Tensor tied = at::empty({rows}, logits.options().dtype(at::kBool));
  const c10::BFloat16* src = logits.data_ptr<c10::BFloat16>();
  float* dst = out.data_ptr<float>();
  bool* tied_rows = tied.data_ptr<bool>();
  for_rows(rows, vocab, [&](int64_t row) {
    tied_rows[row] = widen_row(src + row * vocab, dst + row * vocab, vocab);
  });
  return {out, tied};
}

// A row's first maximum: its index, a NaN counting as the maximum (torch.argmax's answer), and
// whether the maximum occurs more than once among the other values (widen_row's flag).
struct RowMax {
  int64_t at = 0;
  bool repeats = false;
};

#if defined(__AVX512F__)
inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const c10::BFloat16* p) {  // widened in the register
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// RowMax of in[0 .. n), n > 0, float32 or bfloat16 (read as float32), in one pass (AVX-512:
// each lane keeps its maximum, where it first saw it, how often, and whether it saw a NaN; the
// lanes holding the row's maximum then give the first index and the count); only a row with a
// NaN is read again, for the first NaN.
template <typename T>
inline RowMax first_max(const T* in, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  int64_t at = 0, count = 0;
  bool nan = false;
#if defined(__AVX512F__)
  if (n >= 16 && n < (int64_t{1} << 31)) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __m512i where = _mm512_setzero_si512();
    __m512i seen = _mm512_setzero_si512();
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    const __m512i one = _mm512_set1_epi32(1);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load_lanes(in + i);
      const __mmask16 above = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      const __mmask16 equal = _mm512_cmp_ps_mask(v, top, _CMP_EQ_OQ);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      top = _mm512_mask_mov_ps(top, above, v);
      where = _mm512_mask_mov_epi32(where, above, lane);
      seen = _mm512_mask_mov_epi32(_mm512_mask_add_epi32(seen, equal, seen, one), above, one);
      lane = _mm512_add_epi32(lane, step);
    }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(top);
    const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    at = _mm512_mask_reduce_min_epi32(holders, where);  // (a row of -inf: every lane, so 0)
    count = _mm512_mask_reduce_add_epi32(holders, seen);
  }
#endif
  for (; i < n; ++i) {  // what no lane took (all of it without AVX-512), after their indices
    const float v = to_float(in[i]);
    if (v > best) {
      best = v, at = i, count = 1;
    } else if (v == best) {
      ++count;
    }
    nan = nan || v != v;
  }
  if (nan) {
    at = 0;
    while (to_float(in[at]) == to_float(in[at])) ++at;
  }
  return {at, count > 1};
}

// Per row of float32 logits [rows, vocab], the index of its maximum, the first where it
// repeats, a NaN counting as the maximum (torch.argmax's answer); rows in parallel. At 128 rows
// of a 49,152 vocabulary (a W1 decode step's greedy tokens) 0.43 ms where torch.argmax took
// 2.8 ms (Zen 4, 2 threads, 200 calls each).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.size(1) > 0,
              "argmax_rows: logits must be contiguous float32 [rows, vocab > 0] on the CPU");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  for_rows(rows, vocab, [&](int64_t row) { index[row] = first_max(src + row * vocab, vocab).at; });
  return out;
}

// Per row of bfloat16 logits [rows, vocab]: what argmax_rows gives for widen_logits' float32
// rows, and widen_logits' tied flag, without the float32 logits: first_max over the bf16
// values, nothing written. A greedy step of W1 (128 rows of a 49,152 vocabulary) wrote and read
// back 25 MB of float32 logits for its argmax.
std::tuple<at::Tensor, at::Tensor> greedy_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kBFloat16 && logits.device().is_cpu() &&
                  logits.size(1) > 0,
              "greedy_rows: logits must be contiguous bfloat16 [rows, vocab > 0] on the CPU");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor tied = at::empty({rows}, logits.options().dtype(at::kBool));
  const c10::BFloat16* src = logits.data_ptr<c10::BFloat16>();
  int64_t* index_rows = index.data_ptr<int64_t>();
  bool* tied_rows = tied.data_ptr<bool>();
  for_rows(rows, vocab, [&](int64_t row) {
    const RowMax found = first_max(src + row * vocab, vocab);
    index_rows[row] = found.at;
    tied_rows[row] = found.repeats;
  });
  return {index, tied};
}

}  // namespace

void register_layer_ops(pybind11::module& m) {
  m.def("rms_norm", &kvserve::ops::rms_norm, "x / sqrt(mean(x^2) + eps) * weight per row",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm_", &kvserve::ops::add_rms_norm_,
        "residual += x; return rms_norm(residual)", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &kvserve::ops::silu_and_mul,
        "silu(gate) * up for gate_up = [gate, up]", py::arg("gate_up"));
  m.def("rope_and_write_kv", &kvserve::ops::rope_and_write_kv,
        "Rotate q and k of a fused qkv in place and store k and v at their cache slots",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("num_heads"),
        py::arg("num_kv_heads"));
  m.def("widen_logits", &widen_logits,
        "bfloat16 logits to float32, and per row whether its maximum occurs more than once",
        py::arg("logits"));
  m.def("argmax_rows", &argmax_rows,
        "per row of float32 logits, the first index of its maximum (NaN counts as the maximum)",
        py::arg("logits"));
  m.def("greedy_rows", &greedy_rows,
        "per row of bfloat16 logits, argmax_rows and widen_logits' tied flag, without the "
        "float32 logits",
        py::arg("logits"));
}
