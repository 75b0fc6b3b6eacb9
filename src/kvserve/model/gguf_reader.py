"""A GGUF file's metadata and tensor table, read straight from a memory map.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every part of every metadata
field; on the bundled SmolLM2 file (49,152 token strings and 48,900 merges) that took 7 s of a
Zen 3 core, paid by every process that loads the model (``kvserve serve``, its engine
process, each data-parallel replica). This reader walks the same layout with ``struct`` and
takes about a tenth of a second; tensor data stays in the memory map until it is dequantised.
``tests/model/test_gguf_reader.py`` checks it against ``GGUFReader`` field by field.

The layout (GGUF versions 2 and 3, little-endian), as written by llama.cpp's converter:

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata: key (string), value type u32, value
    tensor infos: name (string), n_dims u32, dims u64 x n_dims (innermost first), type u32,
                  offset u64 (from the start of the data section)
    padding to ``general.alignment`` (default 32), then the data section

A string is a u64 byte length and UTF-8 bytes; an array is an element type u32, a u64 count and
the elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.model.weights import UnsupportedModelError

__all__ = ["GGUFFile", "GGUFFormatError", "GGUFTensor", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, struct.Struct] = {  # GGUF value type -> its little-endian layout
    0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"),
    3: struct.Struct("<h"), 4: struct.Struct("<I"), 5: struct.Struct("<i"),
    6: struct.Struct("<f"), 7: struct.Struct("<?"), 10: struct.Struct("<Q"),
    11: struct.Struct("<q"), 12: struct.Struct("<d"),
}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                10: "<u8", 11: "<i8", 12: "<f8"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFormatError(UnsupportedModelError):
    """A file that is not a GGUF this reader understands, or one cut short."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table: ``shape`` in GGUF order (innermost dimension first, as
    ``gguf.ReaderTensor.shape``); ``data`` its raw bytes, a read-only view of the map."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """The shape in numpy order (innermost dimension last)."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its path, version, metadata (plain Python values: str, int,
    float, bool, lists of them) and tensor table in file order."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the file has no such key."""
        return self.metadata.get(key, default)


class _Cursor:
    """Reads GGUF values from a buffer, advancing ``pos``; a short read names the offset."""

    def __init__(self, buffer: Any, path: Path) -> None:
        self.buffer = buffer
        self.pos = 0
        self.path = path

    def unpack(self, layout: struct.Struct) -> Any:
        try:
            (value,) = layout.unpack_from(self.buffer, self.pos)
        except struct.error:
            raise self.error("ends early") from None
        self.pos += layout.size
        return value

    def string(self) -> str:
        length = self.unpack(_U64)
        end = self.pos + length
        if end > len(self.buffer):
            raise self.error(f"ends inside a {length}-byte string")
        try:
            text = self.buffer[self.pos:end].decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("has a string that is not UTF-8") from None
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        layout = _SCALARS.get(kind)
        if layout is None:
            raise self.error(f"has an unknown metadata value type {kind}")
        return self.unpack(layout)

    def array(self) -> list[Any]:
        kind = self.unpack(_U32)
        count = self.unpack(_U64)
        if kind == _STRING:
            return [self.string() for _ in range(count)]
        if kind == _ARRAY:
            return [self.array() for _ in range(count)]
        if kind not in _NUMPY_TYPES:
            raise self.error(f"has an unknown array element type {kind}")
        dtype = np.dtype(_NUMPY_TYPES[kind])
        if self.pos + count * dtype.itemsize > len(self.buffer):
            raise self.error(f"ends inside an array of {count} values")
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return values.tolist()

    def error(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"GGUF file {self.path} {what} (at byte {self.pos})")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header and tensor table; tensor data stays mapped, not read."""
    path = Path(path)
    with open(path, "rb") as handle:
        try:
            buffer: Any = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            buffer = b""
    cursor = _Cursor(buffer, path)
    if buffer[:4] != _MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.pos = 4
    version = cursor.unpack(_U32)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF file {path} has version {version}; supported: 2, 3 "
                              "(little-endian)")
    num_tensors = cursor.unpack(_U64)
    num_fields = cursor.unpack(_U64)
    metadata: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cursor.string()
        if key in metadata:  # QA: the last one read won, without a word
            raise cursor.error(f"gives the key {key!r} twice")
        metadata[key] = cursor.value(cursor.unpack(_U32))
    infos = []
    names: set[str] = set()
    for _ in range(num_tensors):
        name = cursor.string()
        if name in names:  # QA: the last one read won, without a word
            raise cursor.error(f"holds the tensor {name!r} twice")
        names.add(name)
        dims = tuple(cursor.unpack(_U64) for _ in range(cursor.unpack(_U32)))
        infos.append((name, dims, cursor.unpack(_U32), cursor.unpack(_U64)))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [_tensor(cursor, data_start, *info) for info in infos]
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)


def _tensor(cursor: _Cursor, data_start: int, name: str, dims: tuple[int, ...], kind: int,
            offset: int) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(kind)
    except ValueError:
        raise cursor.error(f"gives tensor {name!r} the unknown type {kind}") from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    num_elements = int(np.prod(dims)) if dims else 1
    num_bytes = num_elements // block_size * type_size
    start = data_start + offset
    if start + num_bytes > len(cursor.buffer):
        raise GGUFFormatError(f"GGUF file {cursor.path} ends inside tensor {name!r} "
                              f"({num_bytes} bytes at byte {start})")
    data = np.frombuffer(cursor.buffer, dtype=np.uint8, count=num_bytes, offset=start)
    return GGUFTensor(name=name, shape=dims, tensor_type=tensor_type, data=data)
