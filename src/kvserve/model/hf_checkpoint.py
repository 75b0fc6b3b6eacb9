"""Hugging Face checkpoints: a directory with ``config.json`` and ``*.safetensors``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvserve.core.checks import is_finite, is_int
from kvserve.model.config import ModelConfig, trained_context
from kvserve.model.weights import ModelNotFoundError, UnsupportedModelError, check_weights

logger = logging.getLogger("kvserve.model")

SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
# A float checkpoint's tensors: another dtype is a quantized checkpoint whose scales go
# unread, or no weight at all (QA: int8, int64, bool and fp8 tensors were cast and run)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def read_hf_config(config_path: Path, name: str | None = None) -> ModelConfig:
    """A Hugging Face ``config.json`` read into a ModelConfig; a file that is not valid
    JSON, or lacks a key the Llama family needs, is an UnsupportedModelError naming the file
    (QA: "Expecting value: line 2 column 1" or a KeyError traceback, no file named)."""
    try:
        config_dict = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UnsupportedModelError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config_dict, dict):
        raise UnsupportedModelError(f"{config_path}: not a JSON object")
    try:
        return model_config_from_hf(config_dict, name=name)
    except UnsupportedModelError as error:  # the file named too (the model pass: in a
        raise UnsupportedModelError(f"{config_path}: {error}") from None  # boot log, which?)
    except KeyError as error:
        raise UnsupportedModelError(f"{config_path}: no {error} (a Llama model's config "
                                    "names it)") from None
    except (TypeError, ValueError) as error:  # a count that is not a number
        raise UnsupportedModelError(f"{config_path}: {error}") from None


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
    # what the model computes that kvserve's layers would compute otherwise, silently (QA:
    # a gelu model ran as silu; a sliding window attended to every token)
    act = config_dict.get("hidden_act", config_dict.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"Hugging Face config hidden_act {act!r} is not supported "
                                    "(the MLP computes SiLU: silu)")
    hidden_size = _count(config_dict, "hidden_size")
    num_heads = _count(config_dict, "num_attention_heads")
    max_positions = _count(config_dict, "max_position_embeddings", 2048)
    rope = _rope(config_dict)
    max_positions = trained_context(max_positions, rope["rope_scaling"])
    window = _count(config_dict, "sliding_window", None) \
        if config_dict.get("use_sliding_window", True) else None
    if window is not None and window < max_positions:  # attention within the window
        logger.warning("the model attends within a sliding window of %d tokens, which "
                       "kvserve's attention does not keep: its context is capped there (of "
                       "%d), where every token attends as trained", window, max_positions)
        max_positions = window
    eos = config_dict.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        name=name or str(config_dict.get("_name_or_path") or "hf-model"),
        vocab_size=_count(config_dict, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_count(config_dict, "intermediate_size"),
        num_layers=_count(config_dict, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_count(config_dict, "num_key_value_heads", num_heads),
        head_dim=_count(config_dict, "head_dim", hidden_size // num_heads),
        max_position_embeddings=max_positions,
        rms_norm_eps=_positive(config_dict, "rms_norm_eps", 1e-6),
        **rope,
        tie_word_embeddings=_flag(config_dict, "tie_word_embeddings"),
        bos_token_id=config_dict.get("bos_token_id"),
        eos_token_id=eos,
    )


def _count(config_dict: Mapping[str, Any], name: str, default: Any = ...) -> Any:
    """A size or count, a whole number >= 1; ``default`` where the key is absent or null
    (a KeyError where there is none). QA (model files pass): 64.7 was read as 64, "64" and
    true as numbers, 0 heads was a ZeroDivisionError's traceback."""
    value = config_dict.get(name)
    if value is None:
        if default is ...:
            raise KeyError(name)
        return default
    if not is_int(value) or value < 1:
        raise UnsupportedModelError(f"Hugging Face config {name} must be a whole number "
                                    f">= 1, got {value!r}")
    return value


def _flag(config_dict: Mapping[str, Any], name: str) -> bool:
    """A true/false setting, false where absent or null (QA: "false", a string, tied the
    head)."""
    value = config_dict.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UnsupportedModelError(f"Hugging Face config {name} must be true or false, got "
                                    f"{value!r}")
    return value


def _positive(config_dict: Mapping[str, Any], name: str, default: float) -> float:
    """A number the model divides or takes a power by: > 0 and finite (QA: a negative or
    NaN rms_norm_eps, a rope_theta of 0, loaded, and every answer was empty)."""
    value = config_dict.get(name, default)
    if not is_finite(value) or value <= 0:
        raise UnsupportedModelError(f"Hugging Face config {name} must be a number > 0, got "
                                    f"{value!r}")
    return float(value)


def _rope(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's ``rope_theta`` and ``rope_scaling``. transformers v5 writes both in
    ``rope_parameters`` (as vLLM reads it); older configs beside each other. QA (numerics
    pass): a v5 Llama 3 config was read as theta 10000 with no scaling, and served garbage
    without a word."""
    parameters = config_dict.get("rope_parameters")
    # a rotation of only part of each head (vLLM's partial_rotary_factor): kvserve rotates
    # it whole, another network (the model pass: served without a word)
    partial = (parameters if isinstance(parameters, Mapping) else {}).get(
        "partial_rotary_factor", config_dict.get("partial_rotary_factor", 1))
    if partial not in (1, None):  # null: the default (the review)
        raise UnsupportedModelError(f"Hugging Face config partial_rotary_factor {partial!r} "
                                    "is not supported (the rotation covers each whole head)")
    if parameters is None:
        return {"rope_theta": _positive(config_dict, "rope_theta", 10000.0),
                "rope_scaling": _hf_rope_scaling(config_dict.get("rope_scaling"))}
    if not isinstance(parameters, Mapping) or \
            any(isinstance(value, Mapping) for value in parameters.values()):
        raise UnsupportedModelError("Hugging Face config rope_parameters must be one object "
                                    "of numbers (per-layer-type parameters are not supported)"
                                    f", got {parameters!r}")
    theta_from = parameters if "rope_theta" in parameters else config_dict
    return {"rope_theta": _positive(theta_from, "rope_theta", 10000.0),
            "rope_scaling": _hf_rope_scaling({key: value for key, value in parameters.items()
                                              if key != "rope_theta"})}


def _hf_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    if not isinstance(scaling, Mapping):  # QA: "dictionary update sequence element #0"
        raise UnsupportedModelError(f"Hugging Face config rope_scaling must be an object, got "
                                    f"{scaling!r:.60}")
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported "
                                    "(supported: linear, llama3)")
    # what each kind reads, as positive numbers (QA: a KeyError's traceback, after every
    # weight had loaded; a factor of 0 made every answer NaN)
    needs = ("factor",) if kind == "linear" else (
        "factor", "original_max_position_embeddings")
    optional = () if kind == "linear" else ("low_freq_factor", "high_freq_factor")
    for name in (*needs, *(n for n in optional if n in scaling)):
        value = scaling.get(name)
        if not is_finite(value) or value <= 0:
            raise UnsupportedModelError(f"rope_scaling ({kind}) {name} must be a number > 0, "
                                        f"got {value!r}")
    scaling.pop("type", None)
    scaling["rope_type"] = kind
    return scaling


def load_hf_directory(directory: Path, dtype: torch.dtype
                       ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = directory / "config.json"
    files = _weight_files(directory)
    if not config_path.is_file() or not files:
        raise ModelNotFoundError(f"{directory} is not a Hugging Face model directory: it needs "
                                 "config.json and at least one *.safetensors file")
    config = read_hf_config(config_path, name=directory.name)
    weights: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except MemoryError:  # no file's fault: the message would blame the file
            raise
        except Exception as error:  # safetensors' own SafetensorError, and OSError
            raise UnsupportedModelError(f"{file}: cannot read its tensors ({error})") from None
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if tensor.dtype not in FLOAT_DTYPES:
                raise UnsupportedModelError(
                    f"{file}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}: "
                    "a float checkpoint's are float32, float16, bfloat16 or float64 (a "
                    "quantized checkpoint is not read; --quantization int8 quantizes a float "
                    "one)")
            if name in source:  # QA: the last one read won, without a word
                raise UnsupportedModelError(f"{file}: tensor {name} is in {source[name].name} "
                                            "too: which one is the model's?")
            source[name] = file
            weights[name] = tensor.to(dtype).contiguous()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(config, weights, source=str(directory))
    return config, weights


INDEX_FILE = "model.safetensors.index.json"


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the model: those its index names, where it has one
    (``model.safetensors.index.json``; a missing shard is named; a Mistral repository's
    ``consolidated.safetensors`` beside the shards is not the model's), else every one
    (QA: the index was not read; a missing shard was told as missing tensors)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        names = None
    if not names or not all(isinstance(name, str) and "/" not in name for name in names):
        raise UnsupportedModelError(f"{index}: not a safetensors index (a JSON object whose "
                                    "weight_map names each tensor's file)")
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise ModelNotFoundError(f"{index} names {', '.join(missing)}, which "
                                 f"{'is' if len(missing) == 1 else 'are'} not in {directory}")
    return [directory / name for name in names]
