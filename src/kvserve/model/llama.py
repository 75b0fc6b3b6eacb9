"""A Llama-family decoder (Llama, SmolLM2, Qwen2-style without biases, Mistral) over a paged
KV cache.

The forward pass runs every scheduled token of a step in one flattened batch
(:class:`~kvserve.model.input_batch.ForwardBatch`): prefill chunks and decodes together.
Q/K/V and gate/up projections are fused into one matmul each when weights are loaded (and
packed once for the kernel :func:`projection_kernel` picks: oneDNN's bf16 on AMX /
AVX512-BF16, kvserve's panel GEMMs elsewhere; :class:`Linear`); each layer's elementwise work
runs as three fused ops (:mod:`kvserve.model.layer_ops`), with the residual adds folded into
the next RMSNorm. A step whose projections all run on the pair panels (few enough rows) loops
over the layers in C++ instead (:func:`build_layer_stack`, csrc/layer_stack.cpp): the same
kernels in the same order, without the Python between them.
Weights are named as in Hugging Face checkpoints (``model.layers.0.self_attn.q_proj.weight``)
and Q/K use the rotate-half RoPE layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import huge_pages, kernel_info, paged_kernel
from kvserve.model.attention import kernel_prefill_route, paged_attention
from kvserve.model.config import ModelConfig
from kvserve.model.input_batch import ForwardBatch
from kvserve.model.kernel_info import (
    AMX_PREFILL_ROWS,
    AMX_TILE_K,
    cpu_info,
    hybrid_panel_rows,
    layer_stack_enabled,
    onednn_runs_bf16,
    packs_float32,
)
from kvserve.model.layer_ops import add_rms_norm_, rms_norm, rope_and_write_kv, silu_and_mul
from kvserve.model.logits import break_rounding_ties_, widen_logits
from kvserve.model.sampler import greedy_tokens

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]
LayerStack = Any  # the C++ class of csrc/layer_stack.cpp: run(...) -> (x, residual)


def projection_kernel(dtype: torch.dtype, flags: frozenset[str] | None = None) -> str:
    """The kernel :class:`Linear` projects ``dtype`` with on this machine (or on a CPU with
    ``flags``, for this build): ``panels-avx2``, ``panels-dpbf16``, ``onednn`` or ``torch``
    (:func:`~kvserve.model.kernel_info.projection_kernel` has the rules; KVSERVE_PROJECTIONS
    overrides them). ValueError where KVSERVE_PROJECTIONS asks for what cannot run here."""
    built = paged_kernel.available()
    return kernel_info.projection_kernel(
        dtype, built, tuple(paged_kernel.compiled_isa()) if built else (), onednn_runs_bf16(),
        packs_float32(cpu_info().flags if flags is None else flags),
        kernel_info.projection_choice())


def can_pack_weights(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether :meth:`Linear.pack` has a packed kernel for ``dtype`` here (on a CPU with
    ``flags``): anything but F.linear (:func:`projection_kernel`)."""
    return projection_kernel(dtype, flags) != "torch"


# oneDNN builds a kernel for each row count it meets (~10 ms a projection shape on the AMX
# Xeon, ~46 ms a step over the 30 layers), and prefill steps' row counts rarely repeat
# (53 of a W3 run's 59 steps over 512 rows were new), and each one built stays cached
# (~0.6 MiB): so the projections, the LM head's too, run at one of 2 ** ONEDNN_ROWS_LOG2 row
# counts an octave (docs/kernels.md, "oneDNN's row counts").
ONEDNN_ROWS_LOG2 = 4


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN projection of ``rows`` rows runs at: ``rows`` rounded up to one
    of 16 values an octave (at most a sixteenth more); below 32 rows, ``rows`` itself."""
    step = 1 << max(0, rows.bit_length() - 1 - ONEDNN_ROWS_LOG2)
    return -(-rows // step) * step


PANEL = 16  # output columns per panel of csrc/panel_linear.cpp
# bf16 panels: 32-bit element j of each k holds column j in its high half, j + 8 in its low
_BF16_PAIR_ORDER = [j + 8 * high for j in range(8) for high in (1, 0)]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [n, k] as csrc/panel_linear.cpp reads it: [ceil(n / 16), k, 16],
    columns padded with zeros. Stored as bfloat16 when every value is a bf16 number (a bf16
    checkpoint run in float32: the same values in half the bytes), else as float32."""
    n, k = weight.shape
    as_bf16 = weight.to(torch.bfloat16)
    exact = torch.equal(as_bf16.float(), weight)
    source = as_bf16 if exact else weight
    padded = source.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = source
    panels = padded.view(-1, PANEL, k).transpose(1, 2)
    return (panels[:, :, _BF16_PAIR_ORDER] if exact else panels).contiguous()


def pack_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [n, k] (k even) as csrc/panel_dpbf16.h reads it:
    [ceil(n / 16), k / 2, 16, 2], for each pair of k each column's two weights side by side,
    columns padded with zeros."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = weight
    return padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_linear_available() -> bool:
    """Whether this build has csrc/panel_linear.cpp's kernel (AVX2 and FMA)."""
    return paged_kernel.available() and bool(paged_kernel.layer_ops().panel_linear_compiled())


def invariant_projections(dtype: torch.dtype) -> str:
    """The kernel --batch-invariant projects with in ``dtype``: the panel GEMM
    (``panel_linear``, or ``panel_linear_bf16``) where :meth:`Linear.pack` would use it (each
    output is one chain over k in order, whatever the rows of the call), else
    ``invariant_linear``."""
    kernel = projection_kernel(dtype)
    return {"panels-avx2": "panel_linear", "panels-dpbf16": "panel_linear_bf16"}.get(
        kernel, "invariant_linear")


def uses_panels(dtype: torch.dtype) -> bool:
    """Whether :meth:`Linear.pack` packs a ``dtype`` weight in panels for one of the panel
    GEMMs (:func:`projection_kernel`)."""
    return projection_kernel(dtype).startswith("panels")


class Linear(nn.Module):
    """``x @ weight.T`` without bias, optionally through a copy of the weight packed at load.

    F.linear on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every call;
    the packed copy does that once. Measured on the 2-core benchmark machine over SmolLM2-135M's
    30 layers: 24 -> 12 ms at 12 tokens, 56 -> 40 ms at 64, ~8% at 2,048, bit-identical results.
    In float32 F.linear calls MKL, slow at decode batches on an AVX2-only CPU
    (``can_pack_weights``), and a bf16 F.linear there is emulated, far slower still; there the
    weight is packed in panels for kvserve's own kernel (a bf16 weight in bf16 panels, its
    activations widened to float32 for the call and the output rounded back once)
    (:func:`pack_panels`, csrc/panel_linear.cpp: on a Zen 3, 1.11-1.59x oneDNN's packed float32
    GEMM at 1-2,048 rows with float32 panels, 1.12-2.6x with bf16 ones;
    benchmarks/panel_linear.py), or for oneDNN's where the extension is not built. Either sums in
    another order than MKL (results within float32 rounding, not bit-identical). On an
    AVX512-BF16 build a bf16 weight is also packed in pairs-of-k panels for panel_linear_bf16
    (:func:`pack_pair_panels`, csrc/panel_dpbf16.h: bf16 rows, vdpbf16ps): by ``auto``
    (``hybrid-dpbf16``) beside oneDNN's copy, calls of up to :func:`hybrid_panel_rows` rows
    running on the panels (128, 32 for an LM head; with AMX 8, and no LM head); with
    KVSERVE_PROJECTIONS=panels alone. On an AMX-BF16 build (``hybrid-amx``) the same panels
    are read by kvserve's own AMX tiles instead (csrc/panel_amx.h: a panel of 16 columns is a
    column of B tiles as it lies), up to 512 rows, where Linux grants the tiles and
    in_features is a multiple of 32.
    :func:`projection_kernel` decides which (docs/kernels.md).

    With ``--quantization int8`` (:meth:`quantize_int8`) it runs csrc/int8_linear.cpp over an
    int8 copy of the weight instead (:mod:`kvserve.model.quantization`).

    With ``invariant`` (``--batch-invariant``) it runs the C++ ``invariant_linear`` instead,
    whose reduction order per output element does not depend on the number of rows
    (csrc/invariant_linear.cpp); a library GEMM's does.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.packed: torch.Tensor | None = None  # oneDNN's layout
        self.panels: torch.Tensor | None = None  # panel_linear's
        self.pair_panels: torch.Tensor | None = None  # panel_linear_bf16's
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None  # int8_linear's, and scales
        self.panel_rows = 0  # with packed too (hybrid-*): calls up to this on pair_panels
        self.panel_amx = False  # hybrid-amx: pair_panels read by AMX tiles (panel_linear_amx)
        self.invariant = False

    def pack(self, release_weight: bool = False) -> None:
        """Make the packed copy for :func:`projection_kernel`'s pick: panels for panel_linear
        or, for a bf16 weight with an even k, for panel_linear_bf16; else oneDNN's; for
        ``hybrid-dpbf16`` both of the last two. With
        ``release_weight`` the plain weight becomes a shape-only (meta) tensor, so the
        projection's memory is not held twice; keep it when the tensor is shared (a tied LM
        head is the embedding table)."""
        weight = self.weight.detach()
        kernel = projection_kernel(weight.dtype)
        if kernel in ("hybrid-dpbf16", "hybrid-amx"):  # smaller calls on the panels
            tiles = kernel == "hybrid-amx" and weight.shape[1] % AMX_TILE_K == 0 \
                and paged_kernel.panel_amx_runs()
            rows = hybrid_panel_rows(weight.shape[0], "amx_bf16" in paged_kernel.compiled_isa(),
                                     tiles=tiles)
            if weight.shape[1] % 2 == 0 and rows:
                self.pair_panels = pack_pair_panels(weight)
                self.panel_rows = rows
                self.panel_amx = tiles
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        elif kernel == "panels-dpbf16" and weight.shape[1] % 2 == 0:
            self.pair_panels = pack_pair_panels(weight)
        elif kernel.startswith("panels"):
            self.panels = pack_panels(weight.float())  # bf16 values: bf16 panels
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        if release_weight:
            self._release_weight()

    def _release_weight(self) -> None:
        """Keep only the weight's shape (a meta tensor): a packed copy now holds its values."""
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"),
                                   requires_grad=False)

    def quantize_int8(self) -> None:
        """Run through csrc/int8_linear.cpp from now on: the weight quantized per output column
        and packed (:func:`kvserve.model.quantization.pack_int8`); the plain weight becomes a
        shape-only (meta) tensor."""
        from kvserve.model.quantization import pack_int8

        self.int8 = pack_int8(self.weight.detach())
        self._release_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = paged_kernel.layer_ops
        n = self.weight.shape[0]
        if self.int8 is not None:
            return _flat_rows(x, torch.float32, lambda rows: ops().int8_linear(rows, *self.int8, n))
        if self.invariant:
            return ops().invariant_linear(x.contiguous(), self.weight)
        if self.pair_panels is not None and (
                self.packed is None or x.numel() <= self.panel_rows * x.shape[-1]):
            bf16_out = x.dtype == torch.bfloat16  # rounded in the kernel
            kernel = ops().panel_linear_amx if self.panel_amx else ops().panel_linear_bf16
            return _flat_rows(x, torch.bfloat16,
                              lambda rows: kernel(rows, self.pair_panels, n, bf16_out))
        if self.panels is not None:
            return _flat_rows(x, torch.float32,
                              lambda rows: ops().panel_linear(rows, self.panels, n))
        if self.packed is None:
            return F.linear(x, self.weight)
        return _onednn_padded(x, self.packed)


def _onednn_padded(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """oneDNN's projection of ``x``'s rows run at :func:`onednn_rows` rows, zero rows added
    and their outputs dropped (a row's output depends on that row alone: the same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    padded = onednn_rows(rows.shape[0])
    if padded == rows.shape[0]:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(F.pad(rows, (0, 0, 0, padded - rows.shape[0])),
                                             packed, None, "none", [], "")
    return out[:rows.shape[0]].view(*x.shape[:-1], out.shape[-1])


def _panels_on_huge_pages(linears: list[Linear]) -> None:
    """Move the projections' panel copies (the GEMMs that stream their weights at decode's
    few rows) into one huge-page arena each kind (:func:`huge_pages.gather`): 1.11-1.15x the
    bf16 panels at 12 rows on the Zen 4. One kind at a time, so at most one extra copy."""
    for attribute in ("pair_panels", "panels"):
        owners = [module for module in linears if getattr(module, attribute) is not None]
        copies = huge_pages.gather([getattr(module, attribute) for module in owners])
        for module, copy in zip(owners, copies, strict=True):
            setattr(module, attribute, copy)


def _flat_rows(x: torch.Tensor, dtype: torch.dtype,
               kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``kernel`` (a C++ projection taking contiguous 2-D rows) on ``x``'s rows in ``dtype``,
    its output back in ``x``'s shape and dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != dtype:  # (a no-op .to is still a dispatch: ~2 us, 120 calls a step)
        rows = rows.to(dtype)
    out = kernel(rows.contiguous())
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1]) if x.dim() != 2 else out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x), or with a residual stream: ``residual += x`` (in place), then
        rms_norm(residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm_(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for the rotary embedding, with Llama 3, linear or a GGUF's
    per-frequency scaling (``freq_factors``: each frequency divided by its factor)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        between = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(between, blended, scaled)
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """float32 cos and sin tables, [max_positions, head_dim / 2], for the rotate-half layout.
    ``max_positions``: the longest sequence served (max_model_len), at most the model's
    context; a 4M-context model served at 8k needs 8k rows, not 2 GiB of them."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        rows = config.max_position_embeddings if max_positions is None \
            else min(max_positions, config.max_position_embeddings)
        positions = torch.arange(rows, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(config))  # [max_pos, dim / 2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size)
        self.o_proj = Linear(q_size, config.hidden_size)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: tuple[torch.Tensor,
                torch.Tensor], attention: AttentionFn) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        q = rope_and_write_kv(self.qkv_proj(x), batch.positions, self.rotary.cos,
                              self.rotary.sin, k_cache, v_cache, batch.slot_mapping,
                              self.num_heads, self.num_kv_heads)
        out = attention(q.to(k_cache.dtype), k_cache, v_cache, batch).to(x.dtype)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                attention: AttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output is ``residual + x`` of the returned pair: the residual adds are
        deferred into the next norm (one fused op). The first layer gets residual None."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, batch, kv_cache, attention)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        # given an empty table: nn.Embedding's own normal_ init would be overwritten anyway,
        # and on the meta device it imports torch._dynamo (2 s of every model load)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        with torch.device("cpu"):  # real tables even when the weights start on "meta"
            rotary = RotaryEmbedding(config, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_word_embeddings = config.tie_word_embeddings
        self._stack: LayerStack | None = None  # _layer_stack's, for the caches at _stack_key
        self._stack_rows = 0
        self._stack_key: int | None = None

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attention: AttentionFn = paged_attention) -> torch.Tensor:
        """Hidden states of the tokens whose logits are needed: [S, hidden]."""
        x, residual = self.embed_tokens(batch.input_ids), None
        stack, route = self._layer_stack(batch, kv_caches, attention)
        if stack is not None:  # the same kernels in the same order, looped in C++
            x, residual = stack.run(x, batch.positions, batch.slot_mapping,
                                    *paged_kernel.step_layout(batch), route == "amx",
                                    AMX_PREFILL_ROWS)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, batch, kv_cache, attention)
        if residual is None:
            return self.norm(x[batch.logits_indices])
        return self.norm(x[batch.logits_indices], residual[batch.logits_indices])

    def _layer_stack(self, batch: ForwardBatch,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     attention: AttentionFn) -> tuple[LayerStack | None, str | None]:
        """The C++ loop over the layers (csrc/layer_stack.cpp) for this step where it runs
        what the modules would, and its prefill chunks' route
        (:func:`attention.kernel_prefill_route`): attention by paged_attention, few enough
        rows that every projection takes its pair panels, and no chunk for torch's flash
        attention; else (None, None). Built at the first step for these caches (the layers'
        kernels are fixed by then: packing happens at load)."""
        rows = batch.num_tokens
        if rows == 0 or attention is not paged_attention:
            return None, None
        key = kv_caches[0][0].data_ptr() if kv_caches else None
        if self._stack_key != key:
            self._stack, self._stack_rows = build_layer_stack(self, kv_caches)
            self._stack_key = key
        if self._stack is None or rows > self._stack_rows:
            return None, None
        k_cache = kv_caches[0][0]
        route = kernel_prefill_route(batch, k_cache.dtype, k_cache.shape[-1])
        return (self._stack, route) if route is not None else (None, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, vocab]. With a 16-bit head, a row's maximum tied by the output
        rounding is recomputed exactly (:mod:`kvserve.model.logits`) from the head's plain
        weight, which :meth:`from_weights` keeps beside the packed copy."""
        return self._logits_of(self.lm_head(hidden), hidden)

    def _logits_of(self, raw: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if raw.dtype == torch.float32:
            return raw
        logits, tied = widen_logits(raw)
        return break_rounding_ties_(logits, hidden, self.lm_head.weight, tied)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: the first maximum of :meth:`compute_logits`, as the
        sampler takes it, without the float32 logits [S, vocab] where the head is bfloat16 on
        the C++ kernels (``greedy_rows``: per row the argmax and whether the maximum repeats;
        for the rows where it does, compute_logits' own tie-break on those rows alone, the
        same products in the same order)."""
        raw = self.lm_head(hidden)
        if raw.dtype != torch.bfloat16 or not paged_kernel.runs(raw):
            return greedy_tokens(self._logits_of(raw, hidden))
        raw = raw.contiguous()
        index, tied = paged_kernel.layer_ops().greedy_rows(raw)
        rows = tied.nonzero().squeeze(1)
        if rows.numel():
            wide = break_rounding_ties_(raw[rows].float(), hidden[rows], self.lm_head.weight,
                                        torch.arange(rows.numel()))
            index[rows] = greedy_tokens(wide)
        return index

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor],
                     batch_invariant: bool = False, quantization: str | None = None,
                     device: torch.device | None = None, max_positions: int | None = None
                     ) -> LlamaForCausalLM:
        """Build the network around Hugging Face-named weights, consuming ``weights``.

        Parameters are created on the meta device and then bound to the given tensors (q/k/v
        and gate/up concatenated), so no memory is spent on an initialisation that would be
        overwritten, and each source tensor is released as soon as it is used.
        ``batch_invariant``: every projection runs a kernel whose sums per output do not
        depend on the rows (:func:`invariant_projections`): the panels where this build has
        them (:func:`uses_panels`), else :class:`Linear`'s invariant kernel on the unpacked
        weights.
        ``quantization="int8"``: every projection but the LM head runs int8
        (:meth:`Linear.quantize_int8`); those sums are exact, so row-independent too.
        ``device`` other than the CPU (docs/device.md): the plain weights are moved there and
        run through torch's own ops; nothing is packed (both options above need the CPU
        kernels, :func:`kvserve.model.device.check_device_options`).
        ``max_positions``: :class:`RotaryEmbedding`'s.
        """
        with torch.device("meta"):
            model = cls(config, max_positions)
        model.load_weights(weights)
        if device is not None and device.type != "cpu":
            model.to(device)  # moves each module's parameters apart: a tied head is re-tied
            if model.tie_word_embeddings:
                model.lm_head.weight = model.embed_tokens.weight
            return model.eval()
        dtype = model.embed_tokens.weight.dtype
        linears = [module for module in model.modules() if isinstance(module, Linear)]
        if quantization == "int8":
            for module in linears:
                if module is not model.lm_head:
                    module.quantize_int8()
            linears = [model.lm_head]
        if batch_invariant and not uses_panels(dtype):
            for module in linears:
                module.invariant = True
        elif batch_invariant or can_pack_weights(dtype):
            for module in linears:
                # a 16-bit LM head keeps its plain weight: compute_logits recomputes rows of
                # it to break rounding ties (a tied head's is the embedding table anyway)
                keep = (module is model.lm_head and dtype != torch.float32) or \
                    module.weight is model.embed_tokens.weight
                module.pack(release_weight=not keep)
            _panels_on_huge_pages(linears)
        return model.eval()

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Bind Hugging Face-named weights (consumed: popped from ``weights``), fusing q/k/v
        and gate/up; every parameter must be covered and every weight used."""

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name} is missing from the checkpoint")
            return weights.pop(name)

        def bind(module: nn.Module, value: torch.Tensor, name: str) -> None:
            expected = module.weight.shape
            if value.shape != expected:
                raise ValueError(f"weight {name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(expected)}")
            module.weight = nn.Parameter(value.contiguous(), requires_grad=False)

        bind(self.embed_tokens, take("model.embed_tokens.weight"), "embed_tokens")
        bind(self.norm, take("model.norm.weight"), "model.norm.weight")
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            bind(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn = prefix + "self_attn."
            qkv = torch.cat([take(f"{attn}{p}_proj.weight") for p in "qkv"])
            bind(layer.self_attn.qkv_proj, qkv, attn + "q/k/v_proj")
            bind(layer.self_attn.o_proj, take(attn + "o_proj.weight"), attn + "o_proj")
            mlp = prefix + "mlp."
            gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
            bind(layer.mlp.gate_up_proj, gate_up, mlp + "gate/up_proj")
            bind(layer.mlp.down_proj, take(mlp + "down_proj.weight"), mlp + "down_proj")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                bind(getattr(layer, norm), take(f"{prefix}{norm}.weight"), prefix + norm)
        weights.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
        if weights:
            raise ValueError(f"unused weights in the checkpoint: {sorted(weights)[:5]}")


def build_layer_stack(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor,
                       torch.Tensor]]) -> tuple[LayerStack | None, int]:
    """The C++ loop over ``model``'s layers with these caches, and the most rows a step may
    have for it (each projection's pair-panel limit); (None, 0) where a layer would run
    something the loop does not: a float32 model or cache, int8, --batch-invariant, a
    projection without pair panels, a GPU, no C++ kernels, or KVSERVE_LAYER_STACK=0
    (:func:`kernel_info.describe_layer_loop` says which steps it takes)."""
    if not kv_caches or not layer_stack_enabled() or not paged_kernel.runs(kv_caches[0][0]):
        return None, 0
    if any(k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 for k, v in kv_caches):
        return None, 0
    norms, panels, widths, amx, caches = [], [], [], [], []
    eps = {model.layers[0].input_layernorm.eps}
    rows = math.inf
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.bfloat16:
                return None, 0
            norms.append(norm.weight)
            eps.add(norm.eps)
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if linear.pair_panels is None or linear.int8 is not None or linear.invariant:
                return None, 0
            if linear.packed is not None:  # hybrid: the panels up to panel_rows only
                rows = min(rows, linear.panel_rows)
            panels.append(linear.pair_panels)
            widths.append(linear.weight.shape[0])
            amx.append(linear.panel_amx)
        caches += [k_cache, v_cache]
    if len(eps) != 1:
        return None, 0
    attention = model.layers[0].self_attn
    stack = paged_kernel.layer_ops().LayerStack(
        norms, panels, widths, amx, caches, attention.rotary.cos, attention.rotary.sin,
        eps.pop(), attention.num_heads, attention.num_kv_heads, 1.0 / math.sqrt(attention.head_dim))
    return stack, int(min(rows, 1 << 30))
