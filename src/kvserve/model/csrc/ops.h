// The kernels one step's decoder layers call, for C++ callers (layer_stack.cpp) as for the
// Python bindings: each is defined in its own file and bound under the same name.
#pragma once

#include <torch/extension.h>

namespace kvserve::ops {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rope_and_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);

// panel_linear.cpp
at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                             bool bf16_out);
at::Tensor panel_linear_amx(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                            bool bf16_out);

// paged_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t context_len, double scale, bool match_decode);
at::Tensor amx_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale);

}  // namespace kvserve::ops
