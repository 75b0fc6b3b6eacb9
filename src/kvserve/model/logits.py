"""Logits of a 16-bit model, with the leading candidates computed without the output rounding.

A bfloat16 LM head rounds every logit to 8 significant bits: at a logit of 25 the spacing is
0.125, so two tokens whose exact logits differ by less than that can round to the same value
and greedy decoding then takes the lower token id. The bundled SmolLM2 hits this on the
README's first prompt: "The" (25.42 before rounding) and "L" (25.31) both round to 25.375 and
the answer became "L'Étoile, ..." instead of "The capital of France is Paris.".

:func:`refine_leading_logits_` recomputes, in float32 from the same bfloat16 hidden state and
weight rows, every logit that rounds to within one spacing of its row's maximum: exactly the
candidates whose order the rounding could have changed. Those few dot products cost nothing
beside the head's matmul; the other logits keep their rounded values.
"""

from __future__ import annotations

import torch

# bfloat16 keeps 8 significant bits (7 stored): the spacing at x is 2 ** (floor(log2 |x|) - 7).
_BF16_MANTISSA_BITS = 7


def rounding_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing between neighbouring ``dtype`` numbers at ``values`` (float32 tensor)."""
    bits = _BF16_MANTISSA_BITS if dtype == torch.bfloat16 else torch.finfo(dtype).nmant
    exponent = torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - bits)


def refine_leading_logits_(logits: torch.Tensor, hidden: torch.Tensor,
                           weight: torch.Tensor) -> torch.Tensor:
    """Replace, in place, the logits within one rounding step of their row's maximum by their
    float32 dot products, in the rows where the top two are that close (the others' order at
    the top is already exact). logits: float32 [S, vocab], rounded from ``hidden`` ([S,
    hidden], 16-bit) times ``weight`` ([vocab, hidden], 16-bit). Returns ``logits``."""
    top = logits.max(dim=-1, keepdim=True).values
    threshold = top - rounding_step(top, hidden.dtype)
    near = logits >= threshold
    close = (near.sum(dim=-1) > 1).nonzero().squeeze(1)
    if close.numel() == 0:
        return logits
    rows, cols = near[close].nonzero(as_tuple=True)
    rows = close[rows]
    logits[rows, cols] = torch.einsum("nh,nh->n", hidden[rows].float(), weight[cols].float())
    return logits
