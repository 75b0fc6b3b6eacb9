"""The 16-bit LM head's leading logits are recomputed without the output rounding
(kvserve.model.logits)."""

import torch

from kvserve.model.logits import refine_leading_logits_, rounding_step


def test_rounding_step_is_the_bfloat16_spacing():
    values = torch.tensor([25.0, 1.0, -3.0, 0.5])
    assert rounding_step(values, torch.bfloat16).tolist() == [0.125, 2 ** -7, 2 ** -6, 2 ** -8]



def test_a_tie_made_by_rounding_is_broken_by_the_exact_dot_products():
    # token 0: 25.34375 and token 1: 25.40625 exactly; both round to 25.375 in bfloat16
    # (its spacing there is 0.125), and greedy would take token 0
    hidden = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    weight = torch.tensor([[25.0, 0.34375], [25.0, 0.40625], [20.0, 0.0]], dtype=torch.bfloat16)
    rounded = torch.nn.functional.linear(hidden, weight).float()
    assert rounded[0, 0] == rounded[0, 1] == 25.375 and rounded.argmax().item() == 0
    logits = refine_leading_logits_(rounded.clone(), hidden, weight)
    assert logits[0].tolist() == [25.34375, 25.40625, 20.0]
    assert logits.argmax().item() == 1


def test_only_rows_whose_top_two_are_within_one_step_are_recomputed_and_only_near_the_top():
    hidden = torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16)
    weight = torch.tensor([[3.0], [1.0], [2.9375]], dtype=torch.bfloat16)
    # stand-in values, to see which entries are replaced: the step at 3 is 2 ** -6, at 6 2 ** -5
    logits = torch.tensor([[3.0, 1.5, 2.99], [5.5, 2.5, 5.0]])
    refine_leading_logits_(logits, hidden, weight)
    # row 0: 3.0 and 2.99 are within 2 ** -6 of each other; row 1 has a clear maximum
    assert logits.tolist() == [[3.0, 1.5, 2.9375], [5.5, 2.5, 5.0]]
