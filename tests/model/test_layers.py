"""The model's building blocks against plain torch: packed projections and fused layer ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import layer_ops, paged_kernel
from kvserve.model.kernel_info import onednn_runs_bf16
from kvserve.model.llama import Linear, can_pack_weights, panel_linear_available


@pytest.mark.skipif(not onednn_runs_bf16(), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("num_tokens", [1, 11, 64, 300])
def test_a_packed_bf16_projection_equals_f_linear(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 960)
    linear.weight.data = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    expected = F.linear(x, linear.weight)
    linear.pack()
    assert linear.packed is not None
    with torch.inference_mode():
        assert torch.equal(linear(x), expected)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("bf16_values", [False, True])
def test_a_packed_float32_projection_matches_f_linear(num_tokens, bf16_values):
    """Packed float32 (panel_linear's panels where built, else oneDNN's layout) sums in another
    order than MKL's: equal within rounding. 970 outputs: a last panel of 10 columns. A weight
    of bf16 numbers is stored as bf16 in its panels, the same values."""
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 970)
    weight = torch.randn(970, 576, generator=gen)
    linear.weight.data = weight.to(torch.bfloat16).float() if bf16_values else weight
    x = torch.randn(num_tokens, 576, generator=gen)
    expected = F.linear(x, linear.weight)
    linear.pack()
    if panel_linear_available():
        assert linear.panels is not None and linear.panels.shape == (61, 576, 16)
        assert linear.panels.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)
        assert linear(x.view(1, num_tokens, 576)).shape == (1, num_tokens, 970)


@pytest.mark.skipif(not panel_linear_available(), reason="panel_linear: an AVX2 build only")
@pytest.mark.parametrize("bf16_values", [False, True])
def test_panel_linear_rows_do_not_depend_on_the_batch(bf16_values):
    """Each output is one FMA chain over k: a row alone, in a block of 6 or a remainder gives
    the same bits."""
    gen = torch.Generator().manual_seed(3)
    linear = Linear(1536, 100)
    weight = torch.randn(100, 1536, generator=gen)
    linear.weight.data = weight.to(torch.bfloat16).float() if bf16_values else weight
    linear.pack()
    x = torch.randn(23, 1536, generator=gen)
    with torch.inference_mode():
        batch = linear(x)
        assert torch.equal(torch.cat([linear(x[i:i + 1]) for i in range(23)]), batch)
        assert torch.equal(torch.cat([linear(x[:4]), linear(x[4:])]), batch)


@pytest.mark.skipif(not panel_linear_available(), reason="panel_linear: an AVX2 build only")
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_a_bf16_projection_runs_on_bf16_panels(num_tokens):
    """Where oneDNN has no bf16 (an AVX2 build), a bf16 weight goes into bf16 panels: the
    activations widen to float32, the sums are float32, the output is rounded to bf16 once,
    so it is the float32 product of the same numbers rounded (within one bf16 step where the
    two sum orders straddle a rounding boundary)."""
    gen = torch.Generator().manual_seed(num_tokens)
    linear = Linear(576, 970)
    linear.weight.data = torch.randn(970, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, generator=gen).to(torch.bfloat16)
    assert can_pack_weights(torch.bfloat16)
    linear.pack()
    assert linear.panels is not None and linear.panels.dtype == torch.bfloat16
    with torch.inference_mode():
        out = linear(x)
    expected = F.linear(x.float(), linear.weight.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 970)
    torch.testing.assert_close(out, expected, rtol=1 / 128, atol=1e-3)
    assert (out == expected).float().mean() > 0.95


@pytest.mark.skipif(not panel_linear_available(), reason="panel_linear: an AVX2 build only")
def test_panel_linear_refuses_mismatched_panels():
    kernel = paged_kernel.layer_ops().panel_linear
    panels = torch.zeros(4, 64, 16)
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        kernel(torch.zeros(3, 32), panels, 64)  # in_features differ
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        kernel(torch.zeros(3, 64), panels, 80)  # 80 outputs need 5 panels
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        kernel(torch.zeros(3, 64, dtype=torch.bfloat16), panels, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(torch.zeros(3, 64), panels.half(), 64)


def test_float32_is_packed_where_avx2_is_the_best_vector_tier():
    zen3 = frozenset({"avx", "avx2", "fma"})
    assert can_pack_weights(torch.float32, zen3) == torch.backends.mkldnn.is_available()
    assert not can_pack_weights(torch.float32, zen3 | {"avx512f", "avx512_bf16"})
    assert not can_pack_weights(torch.float32, frozenset({"sse4_2"}))
    assert not can_pack_weights(torch.float16, zen3)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(params=["fused", "torch"], autouse=False)
def path(request, monkeypatch) -> str:
    """Run a layer_ops test through the C++ ops and again through the torch fallback."""
    if request.param == "fused" and not paged_kernel.available():
        pytest.skip("no C++ extension")
    if request.param == "torch":
        monkeypatch.setattr(layer_ops, "_fused", lambda dtype: False)
    return request.param


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
def test_norms_with_and_without_residual(path, dtype, num_tokens):
    x = _randn(num_tokens, 96, dtype=dtype, seed=1)
    residual = _randn(num_tokens, 96, dtype=dtype, seed=2)
    weight = _randn(96, dtype=dtype, seed=3)
    tol = TOLERANCE[dtype]
    expected = F.rms_norm(x.float(), (96,), weight.float(), 1e-5)
    torch.testing.assert_close(layer_ops.rms_norm(x, weight, 1e-5).float(), expected,
                               atol=tol, rtol=tol)
    summed = residual + x  # rounded to dtype, as the fused op rounds its residual
    expected = F.rms_norm(summed.float(), (96,), weight.float(), 1e-5)
    out = layer_ops.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(residual, summed)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(path, dtype):
    gate_up = _randn(33, 2 * 40, dtype=dtype) * 30  # reaches silu's saturated tails
    gate, up = gate_up.float().chunk(2, dim=-1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(layer_ops.silu_and_mul(gate_up).float(), F.silu(gate) * up,
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_and_stores_k_and_v_at_their_slots(path, dtype):
    heads, kv_heads, dim, block_size = 4, 2, 8, 4
    positions = torch.tensor([0, 5, 6, 17])
    slots = torch.tensor([3, 9, 0, 14])  # any distinct slots of the 4 x 4 cache
    angles = torch.outer(torch.arange(32, dtype=torch.float32),
                          torch.rand(dim // 2, generator=torch.Generator().manual_seed(4)) + 0.1)
    cos, sin = angles.cos(), angles.sin()
    qkv = _randn(4, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.float().clone().split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)

    def rotate(x: torch.Tensor, num_heads: int) -> torch.Tensor:
        x = x.view(4, num_heads, dim)
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * c - second * s, second * c + first * s), dim=-1)

    k_cache = torch.zeros(4, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    out = layer_ops.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots,
                                      heads, kv_heads)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), rotate(q, heads), atol=tol, rtol=tol)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    torch.testing.assert_close(flat_k[slots].float(), rotate(k, kv_heads), atol=tol, rtol=tol)
    assert torch.equal(flat_v[slots].float(), v.view(4, kv_heads, dim))
    untouched = [i for i in range(16) if i not in slots.tolist()]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
