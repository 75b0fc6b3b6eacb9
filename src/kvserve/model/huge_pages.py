"""Memory on transparent huge pages (2 MiB) for what the kernels stream through: the KV cache
and the packed projection weights.

A decode step reads about 1 GB of KV cache on scattered blocks and streams every layer's
weights; on 4 KiB pages that is a TLB miss and a page walk every few KiB, and the hardware
prefetchers stop at each page's end. Where the kernel offers transparent huge pages only on
request (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, the default of many
distributions), torch's allocations never get them. Here a tensor is backed by an anonymous
``mmap`` advised ``MADV_HUGEPAGE`` instead. Measured on the Zen 4 (docs/kernels.md): a W1-like
decode step over a 2 GiB pool 1.12-1.15x, the bf16 panels' 30 layers at 12 rows 1.11-1.15x.

``KVSERVE_HUGE_PAGES=0`` turns it off (plain torch allocations); so does a system without
transparent huge pages (``never``, or not Linux).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.model.kernel_info import OFF_WORDS

ENV = "KVSERVE_HUGE_PAGES"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64  # bytes between the tensors of one arena: a cache line


def available() -> bool:
    """Whether tensors here go on huge pages: Linux with transparent huge pages not
    ``never``, and KVSERVE_HUGE_PAGES not 0."""
    if os.environ.get(ENV, "1").strip().lower() in OFF_WORDS:
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uint8 tensor of ``nbytes`` on memory advised MADV_HUGEPAGE (zero-filled by the OS,
    committed when first written); a plain ``torch.zeros`` where :func:`available` is False.
    The mapping lives as long as a tensor viewing it."""
    if not available() or nbytes <= 0:
        return torch.zeros(max(nbytes, 0), dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages, every page committed now."""
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    out = empty_bytes(nbytes).view(dtype).view(*shape)
    out.zero_()  # the OS's pages are zero already: this commits them, as torch.zeros does
    return out


def gather(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous ``tensors`` in one huge-page arena, each at a cache-line boundary
    (a layer's projections are each under 2 MiB: only together do they fill huge pages). The
    tensors themselves where :func:`available` is False."""
    if not available() or not tensors:
        return list(tensors)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    arena = empty_bytes(total)
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        copy = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
