"""The GGUF parser (``core/models/gguf_file.py``) against gguf-py's own reader: the same metadata
values and types, the same tensor views, on files gguf-py's writer made in either byte order;
and a clear error, naming the file, for each way a file can be broken."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFEndian
from gguf.quants import quantize

from modserve.core.models.gguf_file import GGUFFile
from modserve.core.models.gguf_reader import _open


def _write(path, endian: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)  # not exact in float32: read back as the float32 value
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ü" * 40])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((4, 64)).astype(np.float16))
    q = rng.standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q, T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_reads_what_gguf_py_reads(tmp_path, endian, alignment):
    path = tmp_path / "m.gguf"
    _write(path, endian, alignment)
    theirs = gguf.GGUFReader(str(path))
    ours = GGUFFile(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == want
    assert [type(v) for v in ours.metadata.values()] == [type(v) for v in want.values()]
    assert ours.metadata["t.f32"] == float(np.float32(0.1)) and ours.metadata["t.str"] == "héllo ✓"
    assert [t.name for t in ours.tensors] == ["plain", "half", "q8"]
    for a, b in zip(theirs.tensors, ours.tensors):
        assert (b.tensor_type, b.shape, b.n_elements) == (a.tensor_type, tuple(a.shape.tolist()), a.n_elements)
        assert b.data.shape == a.data.shape and b.data.dtype == a.data.dtype and np.array_equal(b.data, a.data)
    assert np.array_equal(np.asarray(ours.tensors[0].data, np.float32).reshape(3, 5), np.asarray(theirs.tensors[0].data))


def _header(kvs: bytes, n_kv: int, tensors: bytes = b"", n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs + tensors


def _kv_u32(key: str, value: int) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<II", 4, value)


def _tensor_info(name: str, dims: tuple[int, ...], kind: int, offset: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)


@pytest.mark.parametrize("content, message", [
    (_header(b"", 0, version=7), "GGUF version 7 is not supported"),
    (_header(_kv_u32("a", 1), 2), "the file ends inside its header"),
    (_header(struct.pack("<Q", 2**62) + b"k", 1), "the file ends inside its header"),  # a corrupt key length
    (_header(_kv_u32("a", 1) + _kv_u32("a", 2), 2), "metadata key 'a' appears twice"),
    (_header(_kv_u32("general.alignment", 48), 1), "general.alignment 48 is not a power of two"),
    (_header(struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), 1), "unknown metadata value type 99"),
    (_header(struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 1) + b"\xff", 1), "is not UTF-8"),
    (_header(b"", 0, _tensor_info("w", (4, 4), 0, 0), 1), "tensor 'w' runs past the end of the file"),
    (_header(b"", 0, _tensor_info("w", (4,), 0, 0) + _tensor_info("w", (4,), 0, 32), 2) + bytes(64), "tensor 'w' appears twice"),
    (_header(b"", 0, _tensor_info("w", (4,), 77, 0), 1) + bytes(64), "tensor 'w' has an unknown type 77"),
    (_header(b"", 0, _tensor_info("w", (48,), int(T.Q8_0), 0), 1) + bytes(128), "48 values are not whole blocks of 32"),
], ids=lambda v: v.replace(" ", "_")[:40] if isinstance(v, str) else "")
def test_a_broken_file_is_a_clear_error_naming_it(tmp_path, content, message):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        _open(str(path))
    assert str(err.value).startswith(f"{path}: unreadable GGUF file: ") and message in str(err.value)


def test_a_long_header_is_read_past_the_first_megabyte(tmp_path):
    """The parser reads the header a megabyte at a time: a vocabulary longer than that reads whole."""
    path = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    words = [f"token-{i:06d}-" + "x" * 20 for i in range(60_000)]  # about 2.3 MB of strings
    w.add_array("tokenizer.ggml.tokens", words)
    w.add_tensor("w", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(str(path))
    assert f.metadata["tokenizer.ggml.tokens"] == words
    assert np.array_equal(f.tensors[0].data, np.arange(8, dtype=np.float32))
