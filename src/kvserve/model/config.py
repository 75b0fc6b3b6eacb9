"""Llama-family hyperparameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """What the network's shapes and numerics depend on.

    ``rope_scaling`` follows Hugging Face's dict: ``{"rope_type": "llama3", "factor": ...,
    "low_freq_factor": ..., "high_freq_factor": ..., "original_max_position_embeddings": ...}``
    or ``{"rope_type": "linear", "factor": ...}``; a GGUF's ``rope_freqs.weight`` is
    ``{"rope_type": "freq_factors", "factors": (one per frequency, head_dim / 2)}``; None
    for plain RoPE.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        """Parameters in the matmuls, norms and embeddings (tied embeddings counted once)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads
                                                        + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


SMOLLM2_135M = ModelConfig(
    name="SmolLM2-135M-Instruct", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2)


def trained_context(positions: int, rope_scaling: dict[str, Any] | None) -> int:
    """The context a checkpoint was trained for, from the positions its file lists: a
    linear-scaled one divides positions by the factor, so that many times them, as vLLM
    derives it (the model pass: a vicuna-16k's 4096 positions x 4 were served at 4096)."""
    if rope_scaling is not None and rope_scaling.get("rope_type") == "linear":
        return int(positions * rope_scaling["factor"])
    return positions
