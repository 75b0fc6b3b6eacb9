// A step's decoder layers in one call: the same kernels, in the same order, on the same
// tensors as llama.py's DecoderLayer.forward and attention.py's _paged_attention, so the
// result is the same bits; only the Python between them is gone.
//
// Why: a decode step of a small model is ~270 kernel calls (9 per layer), each reached
// through nn.Module calls, argument checks in Python and a pybind call. At the few rows of a
// memory-bound decode step that glue is a sixth of the forward, and the OpenMP workers wait
// through it (SmolLM2-135M bf16, 16 rows, on the AMX Xeon: 15.2 ms through the modules,
// 14.5 ms calling the same kernels from one flat Python loop, 12.6 ms here; docs/kernels.md,
// "The layers in one C++ call"). A step with a prefill chunk gains the same few ms (18
// decodes and a 290-token prompt: 75.0 -> 68.7 ms).
//
// What it covers: steps of a bfloat16 model whose every projection runs on the pair panels
// at this row count (panel_linear_bf16, or panel_linear_amx where the panel is marked for the
// tiles), attention through step_attention (decodes, and prefill chunks on the C++ prefill
// kernel or the AMX tiles, as paged_attention runs them). llama.py decides when (its
// _layer_stack); anything else (oneDNN projections, a chunk for torch's flash attention,
// int8, float32, --batch-invariant, a GPU) runs the modules as before.

#include "layer_stack.h"

#include "ops.h"

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

struct Projection {
  at::Tensor panels;  // [ceil(n / 16), in / 2, 16, 2] bfloat16 (llama.pack_pair_panels)
  int64_t n = 0;      // out_features
  bool amx = false;   // on panel_linear_amx's tiles, else panel_linear_bf16

  at::Tensor operator()(const at::Tensor& x) const {
    return amx ? kvserve::ops::panel_linear_amx(x, panels, n, true)
               : kvserve::ops::panel_linear_bf16(x, panels, n, true);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden]
  Projection qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
};

class LayerStack {
 public:
  // Per layer, in order: norms (input, post-attention), panels and projections' n and amx
  // flags (qkv, o, gate_up, down), caches (k, v).
  LayerStack(const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& panels,
             const std::vector<int64_t>& widths, const std::vector<bool>& amx,
             const std::vector<at::Tensor>& caches, at::Tensor cos, at::Tensor sin,
             double eps, int64_t num_heads, int64_t num_kv_heads, double scale)
      : cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), scale_(scale) {
    const size_t count = caches.size() / 2;
    TORCH_CHECK(count > 0 && caches.size() == 2 * count && norms.size() == 2 * count &&
                    panels.size() == 4 * count && widths.size() == 4 * count &&
                    amx.size() == 4 * count,
                "LayerStack: per layer 2 norms, 4 panels, 4 widths, 4 amx flags, 2 caches");
    for (size_t i = 0; i < count; ++i) {
      auto projection = [&](size_t j) {
        return Projection{panels[4 * i + j], widths[4 * i + j], amx[4 * i + j]};
      };
      layers_.push_back(Layer{norms[2 * i], norms[2 * i + 1], projection(0), projection(1),
                              projection(2), projection(3), caches[2 * i], caches[2 * i + 1]});
    }
    TORCH_CHECK(layers_[0].k_cache.dim() == 4, "LayerStack: caches must be 4-D");
    head_dim_ = layers_[0].k_cache.size(3);
  }

  // embeddings: the step's [rows, hidden] bfloat16. Returns (x, residual) after the last
  // layer, as LlamaForCausalLM's loop leaves them: the model's output is
  // rms_norm(x + residual).
  std::tuple<at::Tensor, at::Tensor> run(
      const at::Tensor& embeddings, const at::Tensor& positions, const at::Tensor& slot_mapping,
      int64_t num_decodes, const at::Tensor& block_tables, const at::Tensor& context_lens,
      std::vector<int64_t> chunk_starts, std::vector<int64_t> chunk_rows,
      std::vector<int64_t> chunk_contexts, std::vector<at::Tensor> chunk_tables,
      bool amx_prefill, int64_t min_tile_rows) const {
    TORCH_CHECK(embeddings.dim() == 2 && embeddings.is_contiguous() &&
                    embeddings.scalar_type() == at::kBFloat16,
                "LayerStack.run: embeddings must be contiguous bfloat16 [rows, hidden]");
    const kvserve::ops::StepLayout step{num_decodes, block_tables, context_lens,
                                        std::move(chunk_starts), std::move(chunk_rows),
                                        std::move(chunk_contexts), std::move(chunk_tables)};
    step.check(embeddings.size(0), "LayerStack.run");  // before any layer writes K/V
    at::Tensor x = embeddings;
    at::Tensor residual;
    const int64_t q_width = num_heads_ * head_dim_;
    for (const Layer& layer : layers_) {
      at::Tensor h;
      if (!residual.defined()) {
        residual = x;
        h = kvserve::ops::rms_norm(x, layer.input_norm, eps_);
      } else {
        h = kvserve::ops::add_rms_norm_(x, residual, layer.input_norm, eps_);
      }
      at::Tensor qkv = layer.qkv(h);
      at::Tensor k_cache = layer.k_cache, v_cache = layer.v_cache;
      kvserve::ops::rope_and_write_kv(qkv, positions, cos_, sin_, k_cache, v_cache,
                                      slot_mapping, num_heads_, num_kv_heads_);
      const at::Tensor q = qkv.narrow(1, 0, q_width).view({-1, num_heads_, head_dim_});
      const at::Tensor attended = kvserve::ops::step_attention(
          q, layer.k_cache, layer.v_cache, step, amx_prefill, min_tile_rows, scale_, false);
      h = layer.o(attended.flatten(1));
      h = kvserve::ops::add_rms_norm_(h, residual, layer.post_norm, eps_);
      x = layer.down(kvserve::ops::silu_and_mul(layer.gate_up(h)));
    }
    return {x, residual};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
  at::Tensor cos_, sin_;  // float32 [max_positions, head_dim / 2]
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_ = 0;
  double scale_;
};

}  // namespace

void register_layer_stack(pybind11::module& m) {
  pybind11::class_<LayerStack>(m, "LayerStack",
                               "A step's decoder layers in one call (layer_stack.cpp)")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<int64_t>&, const std::vector<bool>&,
                          const std::vector<at::Tensor>&, at::Tensor, at::Tensor, double,
                          int64_t, int64_t, double>(),
           pybind11::arg("norms"), pybind11::arg("panels"), pybind11::arg("widths"),
           pybind11::arg("amx"), pybind11::arg("caches"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("eps"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("scale"))
      .def("run", &LayerStack::run, pybind11::arg("embeddings"), pybind11::arg("positions"),
           pybind11::arg("slot_mapping"), pybind11::arg("num_decodes"),
           pybind11::arg("block_tables"), pybind11::arg("context_lens"),
           pybind11::arg("chunk_starts"), pybind11::arg("chunk_rows"),
           pybind11::arg("chunk_contexts"), pybind11::arg("chunk_tables"),
           pybind11::arg("amx_prefill"), pybind11::arg("min_tile_rows"))
      .def_property_readonly("num_layers", &LayerStack::num_layers);
}
