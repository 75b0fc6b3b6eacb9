// The kernels one step's decoder layers call, for C++ callers (layer_stack.cpp) as for the
// Python bindings: each is defined in its own file and bound under the same name.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

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

// One step's rows in the batch's order (input_batch.py): num_decodes decodes (their block
// tables [num_decodes, max_blocks] and context lengths), then each prefill chunk (its first
// row, its rows, its context length after it, its block table).
struct StepLayout {
  int64_t num_decodes = 0;
  at::Tensor block_tables, context_lens;
  std::vector<int64_t> chunk_starts, chunk_rows, chunk_contexts;
  std::vector<at::Tensor> chunk_tables;

  // Raises (naming `name`) unless the chunks follow the decodes and each other and cover
  // exactly `rows` rows.
  void check(int64_t rows, const char* name) const;
};

// One step's attention, as attention.py's paged_attention runs it on the C++ kernels: the
// decodes in one decode_attention call, then each chunk, on the AMX tiles (amx_prefill, a
// chunk of min_tile_rows rows or more) or prefill_attention (with match_decode), into one
// [rows, heads, head_dim] output.
at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const StepLayout& step, bool amx_prefill,
                          int64_t min_tile_rows, double scale, bool match_decode);

}  // namespace kvserve::ops
