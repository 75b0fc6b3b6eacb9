"""Dequantisation of GGML tensor data to float32 torch tensors.

Block layouts (little-endian; ``d`` and ``m`` are float16; 32 weights per block):

    Q4_0  [d][16 B nibbles]            w = (q - 8) * d
    Q4_1  [d][m][16 B nibbles]         w = q * d + m
    Q5_0  [d][4 B high bits][16 B]     w = (q - 16) * d
    Q5_1  [d][m][4 B high bits][16 B]  w = q * d + m
    Q8_0  [d][32 x int8]               w = q * d

In a nibble block, byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its
high nibble; in the 5-bit formats bit ``k`` of the 32-bit high-bit word is weight ``k``'s fifth
bit. Work is done on whole tensors with torch ops, so a 135M model dequantises in well under a
second of CPU time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["NATIVE_TYPES", "UnsupportedTensorTypeError", "dequantize"]


class UnsupportedTensorTypeError(ValueError):
    """A GGML tensor type this loader cannot turn into floats."""


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as a float32 column."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _fifth_bits(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The 32 high bits at ``offset`` as [n, 32] values 0 or 16, weight k from bit k."""
    high = blocks[:, offset:offset + 4]
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (high.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(high.shape[0], 32) << 4


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[:, 2:]).to(torch.float32) - 8.0) * _half(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 4:]).to(torch.float32) * _half(blocks, 0) + _half(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:]) | _fifth_bits(blocks, 2)
    return (q.to(torch.float32) - 16.0) * _half(blocks, 0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 8:]) | _fifth_bits(blocks, 4)
    return q.to(torch.float32) * _half(blocks, 0) + _half(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * _half(blocks, 0)


_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
}

_FLOAT_DTYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

NATIVE_TYPES: tuple[GGMLQuantizationType, ...] = (*_FLOAT_DTYPES, *_BLOCK_DEQUANTIZERS)
"""Types dequantised here; any other type the ``gguf`` package can read goes through its
(slower, numpy) reference implementation."""


def dequantize(raw: np.ndarray | bytes, qtype: GGMLQuantizationType | int,
               shape: tuple[int, ...]) -> torch.Tensor:
    """Turn a tensor's raw GGML bytes into a float32 tensor of ``shape`` (numpy order:
    the innermost, contiguous dimension last)."""
    qtype = GGMLQuantizationType(qtype)
    data = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, bytes) else raw
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    num_elements = int(np.prod(shape)) if shape else 1
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    expected_bytes = num_elements // block_size * type_size
    if shape and shape[-1] % block_size:  # ggml's rule: QA, read with blocks across rows
        raise ValueError(f"{qtype.name} tensor of shape {shape}: its rows of {shape[-1]} are "
                         f"not a whole number of {block_size}-value blocks")
    if num_elements % block_size or data.size != expected_bytes:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected_bytes} bytes, "
                         f"got {data.size}")
    buffer = torch.from_numpy(data.copy())
    if qtype in _FLOAT_DTYPES:
        values = buffer.view(_FLOAT_DTYPES[qtype]).to(torch.float32)
    elif qtype in _BLOCK_DEQUANTIZERS:
        values = _BLOCK_DEQUANTIZERS[qtype](buffer.view(-1, type_size))
    else:
        values = _reference_dequantize(data, qtype)
    return values.reshape(shape)


def _reference_dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    from gguf import quants

    try:
        values = quants.dequantize(data, qtype)
    except NotImplementedError as error:
        raise UnsupportedTensorTypeError(
            f"GGML tensor type {qtype.name} is not supported; supported: "
            f"{', '.join(t.name for t in NATIVE_TYPES)}, and the K- and I-quants that "
            "gguf.quants can dequantize") from error
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
