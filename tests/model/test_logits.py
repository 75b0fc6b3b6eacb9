"""A 16-bit LM head's ties made by the output rounding are broken by the exact dot products
(kvserve.model.logits)."""

import pytest
import torch

from kvserve.model import logits as logits_module
from kvserve.model import paged_kernel
from kvserve.model.logits import break_rounding_ties_, widen_logits


def test_a_tie_made_by_rounding_is_broken_by_the_exact_dot_products():
    # token 0: 25.34375 and token 1: 25.40625 exactly; both round to 25.375 in bfloat16
    # (its spacing there is 0.125), and greedy would take token 0
    hidden = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    weight = torch.tensor([[25.0, 0.34375], [25.0, 0.40625], [20.0, 0.0]], dtype=torch.bfloat16)
    rounded = torch.nn.functional.linear(hidden, weight).float()
    assert rounded[0, 0] == rounded[0, 1] == 25.375 and rounded.argmax().item() == 0
    logits = break_rounding_ties_(rounded.clone(), hidden, weight)
    assert logits[0].tolist() == [25.34375, 25.40625, 20.0]
    assert logits.argmax().item() == 1


def test_only_the_tied_maxima_of_tied_rows_are_recomputed():
    hidden = torch.tensor([[1.0], [2.0], [1.0]], dtype=torch.bfloat16)
    weight = torch.tensor([[3.0], [1.0], [2.9375]], dtype=torch.bfloat16)
    # stand-in values, to see which entries are replaced: row 0 has its maximum twice (tokens
    # 0 and 2); row 1 a clear maximum; row 2 two values one step apart, which rounding cannot
    # have reordered, and a tie below its maximum, which does not matter to greedy
    logits = torch.tensor([[3.0, 1.5, 3.0], [5.5, 2.5, 5.0], [3.0, 2.0, 2.0]])
    break_rounding_ties_(logits, hidden, weight)
    assert logits.tolist() == [[3.0, 1.5, 2.9375], [5.5, 2.5, 5.0], [3.0, 2.0, 2.0]]


def test_the_rows_given_are_the_only_rows_recomputed():
    hidden = torch.tensor([[1.0], [1.0]], dtype=torch.bfloat16)
    weight = torch.tensor([[3.0], [2.9375]], dtype=torch.bfloat16)
    logits = torch.tensor([[3.0, 3.0], [3.0, 3.0]])
    break_rounding_ties_(logits, hidden, weight, torch.tensor([1]))
    assert logits.tolist() == [[3.0, 3.0], [3.0, 2.9375]]


@pytest.fixture(params=["fused", "torch"])
def path(request, monkeypatch) -> str:
    """widen_logits through the C++ op and again through the torch ops."""
    if request.param == "fused" and not paged_kernel.available():
        pytest.skip("no C++ extension")
    if request.param == "torch":
        monkeypatch.setattr(logits_module.paged_kernel, "handles", lambda dtype: False)
    return request.param


def test_widen_logits_is_the_float_cast_and_names_the_rows_whose_maximum_repeats(path):
    raw = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    raw[1, 10] = raw[1, 20] = 9.0   # a tie at the top
    raw[2, 5] = 9.0                 # a clear maximum, and a tie below it
    raw[2, 6] = raw[2, 7] = 8.0
    raw[4, :] = -2.0                # every entry equal
    logits, tied = widen_logits(raw)
    assert logits.dtype == torch.float32 and torch.equal(logits, raw.float())
    assert tied.tolist() == [1, 4]


def test_no_rows_and_a_single_row(path):
    logits, tied = widen_logits(torch.empty(0, 8, dtype=torch.bfloat16))
    assert logits.shape == (0, 8) and tied.numel() == 0
    logits, tied = widen_logits(torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.bfloat16))
    assert logits.tolist() == [[1.0, 3.0, 2.0]] and tied.numel() == 0
