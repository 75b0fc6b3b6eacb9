"""A dense reference forward written plainly from the Hugging Face-named weights: no paging,
no batching, no fused projections. The engine must match it token for token."""

from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.llama import rope_inv_freq

TINY = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    weights = {"model.embed_tokens.weight": normal(config.vocab_size, h),
               "model.norm.weight": 1 + 0.1 * normal(h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight":
            normal(kv, h), p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(config.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(config.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, config.intermediate_size),
            p + "input_layernorm.weight": 1 + 0.1 * normal(h),
            p + "post_attention_layernorm.weight": 1 + 0.1 * normal(h),
        })
    return weights


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """x: [n, heads, dim]; rotate-half layout."""
    positions = torch.arange(x.shape[0], dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(config))
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def dense_logits(weights: dict[str, torch.Tensor], config: ModelConfig,
                 token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``token_ids``: [n, vocab]."""
    w = {k: v.float() for k, v in weights.items()}
    n = len(token_ids)
    group = config.num_heads // config.num_kv_heads
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], config.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, config.num_heads, -1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, config.num_kv_heads, -1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, config.num_kv_heads, -1)
        q, k = _rope(q, config), _rope(k, config)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / config.head_dim ** 0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        x = x + attended @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], config.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def dense_greedy(weights: dict[str, torch.Tensor], config: ModelConfig, prompt: list[int],
                 max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(dense_logits(weights, config, tokens)[-1].argmax()))
    return tokens[len(prompt):]
