"""The tensors a Llama-family model has: Hugging Face names and shapes, the check every loader
runs, random ("dummy") weights, and the loaders' errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig


class ModelNotFoundError(FileNotFoundError):
    """The requested (or bundled) model file is not there."""


class UnsupportedModelError(ValueError):
    """An architecture, tensor or setting this loader does not implement."""


@contextlib.contextmanager
def file_named(path: str | Path) -> Iterator[None]:
    """Whatever reading ``path`` raises that is not already a model error becomes one line
    naming the file (QA: a GGUF's odd metadata, alignment 0, a count that is an array, a
    tokenizer without tokens, was a ZeroDivisionError's, TypeError's or IndexError's
    traceback). A model error not naming the file gets its name in front (the model pass:
    a GGUF's refused rope scaling or tensor did not say which file); MemoryError passes as
    it is."""
    try:
        yield
    except ModelNotFoundError:
        raise
    except UnsupportedModelError as error:
        if str(path) in str(error):
            raise
        raise UnsupportedModelError(f"{path}: {error}") from None
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, StopIteration,
            RuntimeError, OverflowError, AttributeError) as error:
        if isinstance(error, RuntimeError) and "memory" in str(error).lower():
            raise  # torch out of memory: no file's fault (review)
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UnsupportedModelError(f"{path}: not a model kvserve reads: {detail}") from None


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


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], source: str
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


# torch draws normal values on one thread (~1 s for SmolLM2's 135M, most of a dummy load):
# the tensors are cut in turn from one stream that repeats a block of this many draws, a prime
# so that no row length lines its repeats up
DUMMY_BLOCK = 1_048_573


def dummy_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0
                  ) -> dict[str, torch.Tensor]:
    """Random weights for any Llama-family config (normal, std 0.02; norms all ones), under
    the same names and shapes as a loaded model. Deterministic for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    # drawn in the target dtype: no float32 copy of a large model's tensors
    block = torch.empty(DUMMY_BLOCK, dtype=dtype).normal_(0.0, 0.02, generator=generator)
    weights: dict[str, torch.Tensor] = {}
    at = 0  # where the next tensor starts in the repeating stream
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
            continue
        flat = torch.empty(shape, dtype=dtype).view(-1)
        filled = 0
        while filled < flat.numel():
            take = min(flat.numel() - filled, DUMMY_BLOCK - at)
            flat[filled:filled + take] = block[at:at + take]
            filled, at = filled + take, (at + take) % DUMMY_BLOCK
        weights[name] = flat.view(shape)
    return weights
