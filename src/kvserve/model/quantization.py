"""Int8 quantization of the projections (``--quantization int8``, docs/quantization.md).

Dynamic W8A8, as vLLM's and SGLang's int8 CPU paths (torchao's ``int8dq``): each projection's
weight is quantized once at load, symmetric int8 per output column; each call quantizes its
rows, symmetric int8 per token and group of 64 values (finer than their per-token scales: on
the bundled 135M model that cuts the perplexity cost from +3.5% to about +1%); the products
are summed exactly in int32 per group (csrc/int8_linear.cpp: AVX2 ``vpmaddwd``, AVX512-VNNI
``vpdpwssd``, or AMX-INT8 ``tdpbssd`` where Linux grants the tiles) and scaled back to
float. The LM head keeps the model's dtype (as vLLM's W8A8 checkpoints do), as do the
embeddings, norms and the KV cache.
The weights are quantized from whatever the loader produced (the bundled GGUF's Q4_1 blocks
dequantized), so greedy text differs from the float model's; docs/quantization.md has the
measured difference and speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve.model import paged_kernel
from kvserve.model.llama import PANEL, pack_pair_panels

QUANTIZATIONS = ("int8",)
INT8_MAX = 127  # symmetric int8: [-127, 127], so negation never overflows
# k per activation scale (csrc/int8_linear.cpp's kGroup). Per-row scales cost the bundled
# SmolLM2-135M +3.5% perplexity, groups of 64 about +1% (docs/quantization.md).
ACTIVATION_GROUP = 64
# A group whose largest magnitude is under this counts as zeros: 127 / amax overflows float32
# below ~3.7e-37, and what such a group adds is under 1e-30 per weight (csrc/int8_blocks.h)
TINY_AMAX = 1e-30


def quantize_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a float tensor [rows, k]: (q int8 [rows, k], scale float32
    [rows]) with values ~ q * scale, scale = amax / 127 and q = round-half-even(values *
    (127 / amax)); a row of zeros (or of values all under TINY_AMAX) gets scale 0 and q 0,
    one holding a NaN or an infinity scale NaN and q 0 (QA: the kernel made a NaN finite).
    csrc/int8_linear.cpp quantizes each group of activations by exactly these float32
    operations."""
    values = values.float()
    amax = values.abs().amax(1)
    finite = torch.isfinite(values).all(1)
    # a row with a NaN or an infinity: its products are not finite either, so its scale is
    # NaN; one whose amax is under TINY_AMAX (where 127 / amax overflows) counts as zeros
    usable = finite & (amax >= TINY_AMAX)
    # a true division, as the kernel's 127.f / amax (``127 / tensor`` would be reciprocal * 127)
    inverse = torch.where(usable, torch.full_like(amax, INT8_MAX) / amax,
                          torch.zeros_like(amax))
    q = torch.round(values * inverse[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    q = torch.where(usable[:, None], q, torch.zeros_like(q))
    scale = torch.where(usable, amax / INT8_MAX, torch.zeros_like(amax))
    return q.to(torch.int8), torch.where(finite, scale, torch.full_like(amax, math.nan))


def quantize_groups(values: torch.Tensor,
                    group: int = ACTIVATION_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8` per row and group of ``group`` columns (the last group of a row
    may be shorter): (q int8 [rows, k], scales float32 [rows, ceil(k / group)])."""
    values = values.float()
    parts = [quantize_int8(values[:, start:start + group])
             for start in range(0, values.shape[1], group)]
    return (torch.cat([q for q, _ in parts], 1),
            torch.stack([scale for _, scale in parts], 1))


LAYOUTS = ("pairs", "quads")


def int8_layout() -> str:
    """The panel layout int8_linear reads fastest here: ``quads`` where its AMX-INT8 path runs
    (``int8_linear_path() == "amx"``), ``pairs`` (AVX2 / AVX512-VNNI) elsewhere."""
    if paged_kernel.available() and paged_kernel.layer_ops().int8_linear_path() == "amx":
        return "quads"
    return "pairs"


def pack_quad_panels(q: torch.Tensor) -> torch.Tensor:
    """An int8 weight [n, k] as the AMX path's quad panels [ceil(n / 16), ceil(k / 64) * 16,
    16, 4]: per panel of 16 columns, per group of 64 k, TDPBSSD's B tile, whose row j holds
    each column's k = 4 j .. 4 j + 3 of the group (csrc/int8_blocks.h); n and k padded with
    zeros."""
    n, k = q.shape
    padded = F.pad(q, (0, -k % ACTIVATION_GROUP, 0, -n % PANEL))
    quads = padded.shape[1] // 4
    return padded.view(-1, PANEL, quads, 4).transpose(1, 2).contiguous()


def pack_int8(weight: torch.Tensor, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, k] quantized per output column (:func:`quantize_int8`) and packed as
    csrc/int8_linear.cpp reads it, with the columns' scales padded to whole panels. Layout
    ``pairs``: int8 panels [ceil(n / 16), ceil(k / 2), 16, 2] (k padded to even with zeros), for
    the AVX2 and AVX512-VNNI paths; ``quads``: :func:`pack_quad_panels`, for the AMX path; by
    default :func:`int8_layout`."""
    layout = layout or int8_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown int8 layout {layout!r}; choose " + " or ".join(LAYOUTS))
    q, scale = quantize_int8(weight)
    if layout == "quads":
        panels = pack_quad_panels(q)
    else:
        panels = pack_pair_panels(F.pad(q, (0, q.shape[1] % 2)))
    return panels, F.pad(scale, (0, panels.shape[0] * PANEL - scale.shape[0]))


def int8_linear_reference(x: torch.Tensor, q_weight: torch.Tensor,
                          w_scale: torch.Tensor) -> torch.Tensor:
    """What csrc/int8_linear.cpp computes, in float64: the rows quantized per group
    (:func:`quantize_groups`), each group's exact integer sums against ``q_weight`` [n, k]
    times the group's scale, added over the groups, times the column's scale. The kernel adds
    the groups in float32, so it matches this within float32 rounding."""
    rows = x.reshape(-1, x.shape[-1])
    qx, x_scales = quantize_groups(rows)
    out = torch.zeros(rows.shape[0], q_weight.shape[0], dtype=torch.float64)
    for g, start in enumerate(range(0, rows.shape[1], ACTIVATION_GROUP)):
        columns = slice(start, start + ACTIVATION_GROUP)
        sums = qx[:, columns].double() @ q_weight[:, columns].double().T
        out += sums * x_scales[:, g:g + 1].double()
    out *= w_scale[None, :].double()
    return out.view(*x.shape[:-1], q_weight.shape[0])


def int8_linear_available() -> bool:
    """Whether this build has csrc/int8_linear.cpp's kernel (AVX2)."""
    return paged_kernel.available() and bool(paged_kernel.layer_ops().int8_linear_compiled())


def unavailable_reason(quantization: str | None) -> str | None:
    """Why ``quantization`` cannot run here (an unknown name, or no kernel), or None."""
    if quantization is None:
        return None
    if quantization not in QUANTIZATIONS:
        return (f"unknown quantization {quantization!r}; choose "
                + " or ".join(QUANTIZATIONS) + " (or leave it unset)")
    if not paged_kernel.available():
        return (f"--quantization {quantization} needs kvserve's C++ kernels, which are "
                f"unavailable: {paged_kernel.unavailable_reason()}")
    if not int8_linear_available():
        return (f"--quantization {quantization} needs an AVX2 CPU (int8_linear); this build "
                f"has {', '.join(paged_kernel.compiled_isa()) or 'no vector ISA'}")
    return None


def check_quantization(quantization: str | None) -> None:
    """Raise ValueError naming why ``quantization`` cannot run here; None always can."""
    reason = unavailable_reason(quantization)
    if reason is not None:
        raise ValueError(reason)

