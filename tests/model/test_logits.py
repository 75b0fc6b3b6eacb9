"""A 16-bit LM head's ties made by the output rounding are broken by the exact dot products
(kvserve.model.logits)."""

import pytest
import torch

from kvserve.model import logits as logits_module
from kvserve.model import paged_kernel
from kvserve.model.logits import break_rounding_ties_, widen_logits
from kvserve.model.sampler import greedy_tokens


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


@pytest.mark.skipif(not paged_kernel.available(), reason="no C++ extension")
def test_greedy_rows_is_the_argmax_and_the_tie_flag_of_the_widened_logits():
    """The C++ greedy_rows: what argmax_rows gives for widen_logits' float32 rows, and
    widen_logits' tied rows, without the float32 logits."""
    # 1,000 entries: 62 whole vectors of 16 and a tail of 8 (after every lane's index)
    raw = torch.randn(9, 1000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    raw[0, 500] = raw[5, 17] = 9.0  # clear maxima
    raw[1, 10] = raw[1, 20] = 9.0   # a tie at the top: the first index
    raw[2, 5] = 9.0                 # a clear maximum, a tie below it
    raw[2, 6] = raw[2, 7] = 8.0
    raw[3, 7] = float("nan")        # a NaN counts as the maximum (argmax_rows' rule)
    raw[4, :] = -2.0                # every entry equal
    raw[6, 3] = raw[6, 995] = 9.0   # a tie between a lane and the tail
    raw[7, 998] = 9.0               # the maximum in the tail alone
    raw[8, :] = float("-inf")
    for rows in (raw, raw[:, :10]):  # and rows shorter than a vector
        index, tied = paged_kernel.layer_ops().greedy_rows(rows.contiguous())
        wide, want_tied = widen_logits(rows.contiguous())
        assert index.tolist() == greedy_tokens(wide).tolist()
        assert tied.nonzero().squeeze(1).tolist() == want_tied.tolist()
    index, tied = paged_kernel.layer_ops().greedy_rows(raw)
    assert index.tolist() == [500, 10, 5, 7, 0, 17, 3, 998, 0]
    assert tied.nonzero().squeeze(1).tolist() == [1, 4, 6, 8]


@pytest.mark.skipif(not paged_kernel.available(), reason="no C++ extension")
def test_a_models_greedy_tokens_are_its_logits_first_maxima_with_ties_broken():
    """LlamaForCausalLM.greedy_tokens (the runner's path for plain greedy rows) gives
    compute_logits' greedy tokens: a tie made by the bf16 rounding is broken by the exact
    products (token 9 over token 5 here), every other row the same first maximum."""
    from kvserve.model.llama import LlamaForCausalLM
    from tests.model.reference import TINY, random_weights

    weights = {name: w.to(torch.bfloat16) for name, w in random_weights(TINY, seed=4).items()}
    embeddings = weights["model.embed_tokens.weight"]  # the head: tied embeddings
    embeddings[5] = embeddings[9] = 0.0
    embeddings[5, :2] = torch.tensor([25.0, 0.34375])   # 25.34375 -> 25.375 in bf16
    embeddings[9, :2] = torch.tensor([25.0, 0.40625])   # 25.40625 -> 25.375 in bf16
    model = LlamaForCausalLM.from_weights(TINY, weights)
    hidden = torch.randn(64, TINY.hidden_size, generator=torch.Generator().manual_seed(6))
    hidden = (hidden * 3).to(torch.bfloat16)
    hidden[0] = 0.0
    hidden[0, :2] = 1.0
    with torch.inference_mode():
        fast = model.greedy_tokens(hidden)
        slow = greedy_tokens(model.compute_logits(hidden))
        raw = model.lm_head(hidden)
    assert raw[0, 5] == raw[0, 9] == raw[0].max()  # the rounding made the tie
    assert fast[0].item() == 9
    assert torch.equal(fast, slow)
