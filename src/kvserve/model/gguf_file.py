"""GGUF files (llama.cpp's format, the bundled model's): metadata -> ModelConfig, tensor names
-> Hugging Face names, quantised blocks -> floats, and llama.cpp's Q/K row order -> HF's."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.model.config import ModelConfig, trained_context
from kvserve.model.dequant import dequantize
from kvserve.model.gguf_reader import GGUFFile, read_gguf
from kvserve.model.weights import ModelNotFoundError, UnsupportedModelError, check_weights

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name_from_gguf(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_LAYER_PATTERN.fullmatch(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} is not part of a supported Llama model")


def open_gguf(file_or_path: GGUFFile | str | Path) -> GGUFFile:
    """The parsed GGUF file at a path (or the file itself), cached per file: the loader, the
    tokenizer and the dtype check all read it, and a cached file keeps its memory map."""
    if isinstance(file_or_path, GGUFFile):
        return file_or_path
    path = Path(file_or_path).resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _cached_file(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_file(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return read_gguf(path)


def clear_gguf_cache() -> None:
    """Drop cached files (and their memory maps)."""
    _cached_file.cache_clear()


def _metadata(file: GGUFFile, key: str, default: Any = None) -> Any:
    value = file.get(key, default)
    if isinstance(value, float):
        # GGUF stores float32: take the shortest decimal that round-trips (1e-05, not
        # 9.999999747378752e-06), which is the value the converter was given.
        value = float(str(np.float32(value)))
    return value


def _gguf_model_name(file: GGUFFile) -> str:
    return file.path.name.split(".")[0]


def model_config_from_gguf(reader_or_path: GGUFFile | str | Path) -> ModelConfig:
    """Llama hyperparameters from GGUF metadata (a parsed file or a path). Tied
    embeddings when the file has no ``output.weight``."""
    reader = open_gguf(reader_or_path)
    arch = _metadata(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = _metadata(reader, f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata {arch}.{name} is missing")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(_metadata(reader, f"{arch}.attention.key_length", 0)
                   or _metadata(reader, f"{arch}.rope.dimension_count", 0)
                   or hidden_size // num_heads)
    rotated = _metadata(reader, f"{arch}.rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:  # the model pass: rotated whole
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count {int(rotated)} is not "
                                    f"the head size {head_dim}: a rotation of part of each "
                                    "head is not supported")
    tokens = reader.get("tokenizer.ggml.tokens")
    vocab_size = _metadata(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else 0)
    tensor_names = {tensor.name for tensor in reader.tensors}
    if not vocab_size:
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab_size = int(embedding.shape[1])
    bos = _metadata(reader, "tokenizer.ggml.bos_token_id")
    eos = _metadata(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = _gguf_rope_scaling(reader, arch)
    if ROPE_FREQS in tensor_names:
        rope_scaling = _freq_factors(reader, rope_scaling, head_dim)
    return ModelConfig(
        name=_gguf_model_name(reader),
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=trained_context(int(key("context_length")), rope_scaling),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


def _gguf_rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    """The file's rope scaling; its factor from the older key ``rope.scale_linear`` where
    the newer one is absent, as llama.cpp reads it (QA: such a file ran unscaled)."""
    kind = _metadata(reader, f"{arch}.rope.scaling.type")
    factor = _metadata(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = _metadata(reader, f"{arch}.rope.scale_linear")
    if kind == "none" or (kind is None and factor in (None, 1.0)):
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported "
                                "(supported: none, linear)")


# Llama 3.1's RoPE scaling as llama.cpp's converter writes it: a factor per rotary frequency,
# each frequency divided by its factor (a tensor, not a weight: read into the config)
ROPE_FREQS = "rope_freqs.weight"


def _freq_factors(reader: GGUFFile, rope_scaling: dict[str, Any] | None,
                  head_dim: int) -> dict[str, Any]:
    """The rope scaling of a file with ROPE_FREQS: ``freq_factors`` (the model pass: Llama
    3.1 and 3.2 GGUFs, which carry it, were refused)."""
    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    factors = dequantize(tensor.data, tensor.tensor_type, tensor.numpy_shape).flatten()
    if rope_scaling is not None:
        raise UnsupportedModelError(f"GGUF tensor {ROPE_FREQS!r} with rope scaling "
                                    f"{rope_scaling['rope_type']!r} too is not supported")
    if factors.numel() != head_dim // 2 or not bool(torch.isfinite(factors).all()) or \
            not bool((factors > 0).all()):
        raise UnsupportedModelError(f"GGUF tensor {ROPE_FREQS!r} holds {factors.numel()} "
                                    f"factors; the rotary embedding takes {head_dim // 2} "
                                    "finite positive ones (head_dim / 2)")
    return {"rope_type": "freq_factors", "factors": tuple(factors.double().tolist())}


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    config = model_config_from_gguf(reader)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:  # read into config.rope_scaling
            continue
        name = hf_name_from_gguf(tensor.name)
        weight = dequantize(tensor.data, tensor.tensor_type, tensor.numpy_shape)
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, config.num_kv_heads)
        weights[name] = weight.to(dtype).contiguous()
    check_weights(config, weights, source=str(path))
    return config, weights




# --- Q/K row order ----------------------------------------------------------------------------

def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp interleaved rows (what its converter writes).

    Within each head of ``head_dim`` rows, HF row ``half * head_dim/2 + j`` (half 0 or 1)
    becomes GGUF row ``2 * j + half``, so RoPE pairs (j, j + head_dim/2) become adjacent
    rows (2j, 2j + 1). ``num_heads`` is the heads of that projection (KV heads for K).
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaved rows -> HF rotate-half rows; the inverse of ``permute_qk``."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
