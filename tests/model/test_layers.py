"""The model's building blocks against plain torch: packed projections and fused layer ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.llama import Linear, can_pack_weights


@pytest.mark.skipif(not can_pack_weights(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
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
