"""Logits of a 16-bit model, with ties made by the output rounding broken exactly.

A bfloat16 LM head rounds every logit to 8 significant bits: at a logit of 25 the spacing is
0.125, so two tokens whose exact logits differ by less than that can round to the same value,
and greedy decoding then takes the lower token id. The bundled SmolLM2 hits this on the
README's first prompt: "The" (25.33 in float32) and "L" (25.24) both round to 25.375, and the
answer became "L'Étoile, ..." instead of "The capital of France is Paris.".

Rounding to nearest is monotonic: it can merge two values into a tie but never swap their
order. So the only rows whose top token the rounding may have changed are the rows whose
largest rounded logit occurs more than once. :func:`widen_logits` turns the head's bfloat16
output into float32 logits and finds those rows in the same pass (the C++ ``widen_logits``;
torch ops without the extension); :func:`break_rounding_ties_` recomputes, in float32 from
the same 16-bit hidden state and weight rows, just the logits equal to such a row's maximum.
Rows without a tie, and every other logit, keep their rounded values, so sampling at a
temperature sees what it saw before.
"""

from __future__ import annotations

import torch

from kvserve.model import paged_kernel


def widen_logits(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits from a 16-bit head's output [S, vocab], and the indices of the rows
    whose maximum occurs more than once."""
    if raw.dtype == torch.bfloat16 and raw.is_contiguous() and paged_kernel.runs(raw):
        logits, tied = paged_kernel.layer_ops().widen_logits(raw)
        return logits, tied.nonzero().squeeze(1)
    logits = raw.float()
    return logits, rows_with_repeated_maximum(logits)


def rows_with_repeated_maximum(logits: torch.Tensor) -> torch.Tensor:
    """The indices of the rows of ``logits`` [S, vocab] whose maximum occurs more than once."""
    return ((logits == logits.amax(dim=-1, keepdim=True)).sum(dim=-1) > 1).nonzero().squeeze(1)


def break_rounding_ties_(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                         tied: torch.Tensor | None = None) -> torch.Tensor:
    """Replace, in place, the logits equal to their row's maximum, in the rows ``tied`` (by
    default :func:`rows_with_repeated_maximum`), by their float32 dot products. logits:
    float32 [S, vocab], rounded from ``hidden`` ([S, hidden], 16-bit) times ``weight``
    ([vocab, hidden], 16-bit). Returns ``logits``."""
    if tied is None:
        tied = rows_with_repeated_maximum(logits)
    if tied.numel() == 0:
        return logits
    candidates = logits[tied]
    rows, cols = (candidates == candidates.amax(dim=-1, keepdim=True)).nonzero(as_tuple=True)
    rows = tied[rows]
    logits[rows, cols] = torch.einsum("nh,nh->n", hidden[rows].float(), weight[cols].float())
    return logits
