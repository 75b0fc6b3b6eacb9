"""A decoder layer's elementwise work: RMSNorm (with the residual add), SwiGLU, and RoPE with
the K/V cache write, each one call.

With the C++ extension (:mod:`kvserve.model.paged_kernel`, float32 or bfloat16 tensors) each is
one fused loop; otherwise the same arithmetic in torch ops. The fused versions compute in
float32 and round once, so bfloat16 results may differ from the torch ones in the last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model import paged_kernel
from kvserve.model.attention import write_kv


def _fused(tensor: torch.Tensor) -> bool:
    return paged_kernel.runs(tensor)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden]."""
    if _fused(x) and x.is_contiguous():
        return paged_kernel.layer_ops().rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """``residual += x`` in place, then :func:`rms_norm` of the new residual."""
    if _fused(x) and x.is_contiguous() and residual.is_contiguous():
        return paged_kernel.layer_ops().add_rms_norm_(x, residual, weight, eps)
    residual += x
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * n], gate then up. Returns silu(gate) * up: [T, n]."""
    if _fused(gate_up) and gate_up.is_contiguous():
        return paged_kernel.layer_ops().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of ``qkv`` ([T, (heads + 2 kv_heads) * dim]), store k and v at
    ``slot_mapping``, and return q: [T, heads, dim].

    cos, sin: float32 [max_positions, dim / 2] tables; rotate-half layout.
    """
    head_dim = k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if (_fused(qkv) and qkv.is_contiguous() and k_cache.dtype == qkv.dtype
            and v_cache.dtype == qkv.dtype):
        paged_kernel.layer_ops().rope_and_write_kv(
            qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        return qkv[:, :q_size].view(-1, num_heads, head_dim)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    cos_t = cos[positions][:, None, :].to(qkv.dtype)
    sin_t = sin[positions][:, None, :].to(qkv.dtype)
    q = _rotate(q.view(-1, num_heads, head_dim), cos_t, sin_t)
    k = _rotate(k.view(-1, num_kv_heads, head_dim), cos_t, sin_t)
    write_kv(k_cache, v_cache, k.to(k_cache.dtype),
             v.reshape(-1, num_kv_heads, head_dim).to(v_cache.dtype), slot_mapping)
    return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
