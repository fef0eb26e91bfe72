"""pagoda's GGUF reader against the `gguf` package's own, on files of every value type,
tensor kinds and alignments, and the shipped model; bad files are refused by name."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from pagoda.model_executor.gguf_file import GGUFFile, string_field
from pagoda.model_executor.gguf_loader import gguf_reader


def _same(path: str) -> GGUFFile:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = {k: v.contents() for k, v in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.fields[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.n_bytes) == (b.tensor_type, tuple(b.shape), b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    return ours


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_tensor_kind(tmp_path, alignment):
    path = str(tmp_path / "x.gguf")
    w = GGUFWriter(path, "llama")
    if alignment != 32:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.yes", True)
    w.add_bool("t.no", False)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.ints", [3, -1, 4])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strings", ["a", "", "ü" * 3])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    q = quantize(rng.standard_normal((4, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = _same(path)
    assert ours.fields["t.str"] == "héllo ▁world" and ours.fields["t.yes"] is True
    assert ours.tensors[3].data.shape == (4, 68)  # two Q8_0 blocks of 34 bytes a row
    assert string_field(path, "t.str") == "héllo ▁world"  # past every kind of value
    assert string_field(path, "t.u8") is None and string_field(path, "nothing") is None


def test_the_shipped_model(gguf_path):
    ours = _same(gguf_path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert string_field(gguf_path, "tokenizer.ggml.model") == "gpt2"


def test_bad_files_are_refused_by_name(tmp_path, gguf_path):
    with open(gguf_path, "rb") as f:
        whole = f.read()
    cases = {
        "not-gguf": b"GGML" + whole[4:],
        "empty": b"",
        "cut": whole[:-4096],  # the last tensor short
        "header-cut": whole[:5000],  # within the vocabulary
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=f"cannot read GGUF file .*{name}"):
            gguf_reader(str(path))
        assert string_field(str(path), "general.architecture") in (None, "llama")
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(str(tmp_path / "cut.gguf"))


def _header(*fields: bytes, tensors: tuple[bytes, ...] = ()) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + b"".join(fields + tensors)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    "case, data",
    [
        # A string whose length runs past the end (a file with no tensors after it).
        (
            "cut-string",
            _header(_string(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 99) + b"ab"),
        ),  # fmt: skip
        ("unknown-type", _header(_string(b"k") + struct.pack("<I", 13) + b"\0" * 8)),
        # An array claiming 2^63 numbers.
        ("huge-array", _header(_string(b"k") + struct.pack("<IIQ", 9, 4, 1 << 63))),
        (
            "nested",
            _header(_string(b"k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 9),
        ),  # fmt: skip
        ("twice", _header(*[_string(b"k") + struct.pack("<IB", 0, 1)] * 2)),
        # A Q8_0 tensor whose rows are not whole 32-weight blocks.
        ("part-block", _header(tensors=(_string(b"t") + struct.pack("<IQIQ", 1, 33, 8, 0),))),
    ],
)
def test_malformed_headers_are_value_errors(tmp_path, case, data):
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data + b"\0" * 64)
    with pytest.raises(ValueError):
        GGUFFile(str(path))
    assert string_field(str(path), "other") is None
