"""kvserve's GGUF reader against the gguf package's GGUFReader (the reference), on a file with
every metadata type and several tensor types, and its one-line errors on broken files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from kvserve.model.gguf_reader import GGUFFormatError, read_gguf
from kvserve.model.loader import UnsupportedModelError

T = GGMLQuantizationType


def write_every_type(path: Path) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, 2, 3, 40000])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "Ġthe", "中文"])
    writer.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32.weight", matrix)
    writer.add_tensor("f16.weight", matrix.astype(np.float16))
    writer.add_tensor("vector", matrix[0])
    for qtype in (T.Q8_0, T.Q4_1):
        writer.add_tensor(f"{qtype.name}.weight", quants.quantize(matrix, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def every_type(tmp_path: Path) -> Path:
    path = tmp_path / "every-type.gguf"
    write_every_type(path)
    return path


def test_metadata_and_tensors_equal_the_gguf_packages_reader(every_type):
    reference = GGUFReader(str(every_type))
    ours = read_gguf(every_type)
    expected = {key: field.contents() for key, field in reference.fields.items()
                if not key.startswith("GGUF.")}  # the reference's own header pseudo-fields
    assert ours.metadata == expected
    assert ours.metadata["t.strs"] == ["a", "", "Ġthe", "中文"]
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.bool"] is True
    assert ours.version == reference.fields["GGUF.version"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.shape == tuple(int(n) for n in theirs.shape), mine.name
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.tobytes() == np.ascontiguousarray(theirs.data).tobytes(), mine.name
    assert ours.tensors[0].numpy_shape == (8, 64)
    assert ours.get("missing", "default") == "default"


def test_broken_files_are_refused_with_the_reason(tmp_path, every_type):
    data = every_type.read_bytes()
    cases = {
        "not-gguf": (b"PK\x03\x04" + data[4:], "not a GGUF file"),
        "empty": (b"", "not a GGUF file"),
        "version-1": (data[:4] + (1).to_bytes(4, "little") + data[8:], "has version 1"),
        "in-metadata": (data[:200], "ends"),
        "in-tensor-data": (data[:-40], "ends inside tensor"),
    }
    for name, (content, reason) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(GGUFFormatError, match=reason) as error:
            read_gguf(path)
        assert str(path) in str(error.value) and "\n" not in str(error.value), name
        assert isinstance(error.value, UnsupportedModelError), name
