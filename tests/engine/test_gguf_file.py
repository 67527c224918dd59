"""Our GGUF header reader gives what the `gguf` package's reader gives: every metadata value and every
tensor's name, type, shape and mapped data."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from inference_engine.model_loader import default_model_path, gguf_file


def test_bundled_file_reads_as_gguf_reads_it():
    path = default_model_path()
    ours, reference = gguf_file.read(path), gguf.GGUFReader(str(path))
    expected = {name: f.contents() for name, f in reference.fields.items() if not name.startswith("GGUF.")}
    assert ours.fields == expected
    assert [(t.name, t.tensor_type, tuple(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in reference.tensors
    ]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_written_file_with_every_value_kind_reads_back(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -5)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "héllo")
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.words", ["a", "ß", ""])
    dense = np.arange(12, dtype=np.float32).reshape(3, 4)
    half = np.arange(8, dtype=np.float16).reshape(2, 4)
    writer.add_tensor("dense", dense)
    writer.add_tensor("half", half)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = gguf_file.read(path)
    assert {k: v for k, v in read.fields.items() if k.startswith("test.")} == {
        "test.u32": 7,
        "test.i64": -5,
        "test.f32": 0.5,
        "test.flag": True,
        "test.text": "héllo",
        "test.ints": [1, -2, 3],
        "test.words": ["a", "ß", ""],
    }
    tensors = {t.name: t for t in read.tensors}
    assert np.array_equal(tensors["dense"].data, dense) and tensors["dense"].shape == (4, 3)
    assert np.array_equal(tensors["half"].data, half) and tensors["half"].data.dtype == np.float16


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a little-endian GGUF file"):
        gguf_file.read(path)
