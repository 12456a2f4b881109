"""A read-only GGUF parser: the metadata as Python values, each tensor as a view of the mapped file.

Why not gguf-py's ``GGUFReader``: it builds a numpy view for every metadata value, which takes
4-5 s for SmolLM2's 49,152-token vocabulary and 48,900 merges, a third of the default model's
start-up (llama.cpp's pull request 13378, which would fix it, is still open). Here the header is
decoded from megabyte-sized reads with :mod:`struct` (numeric arrays with ``np.frombuffer``) in
a fraction of a second. gguf-py still supplies the type constants, the block sizes and the dequantization.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value type -> struct code
_STRING, _ARRAY = 8, 9
_PLAIN = {  # tensor types stored as plain numbers, not blocks
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class NotAGGUFFile(ValueError):
    """The file does not start with the GGUF magic."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: ``shape`` in GGUF order (innermost first, as gguf-py gives it),
    ``data`` the mapped bytes shaped as gguf-py's ``ReaderTensor.data`` (plain types as their
    numbers in row-major order, block types as ``uint8`` rows), ready for ``gguf.quants.dequantize``."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    data: np.ndarray


class GGUFFile:
    """``metadata``: every key-value pair, decoded (strings as ``str``, arrays as lists);
    ``tensors``: in file order. Raises ``ValueError`` for anything malformed."""

    def __init__(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            head = file.read(min(size, 1 << 20))
            if head[:4] != b"GGUF":  # an empty or 3-byte file too
                raise NotAGGUFFile("no GGUF magic")
            cursor = _Cursor(head, file, size)
            cursor.at = 4
            raw_version = cursor.take(4)
            little = struct.unpack("<I", raw_version)[0] & 0xFFFF != 0  # a byte-swapped file reads 0 in its low half
            cursor.order = "<" if little else ">"
            version = struct.unpack(cursor.order + "I", raw_version)[0]
            if version not in SUPPORTED_VERSIONS:
                raise ValueError(f"GGUF version {version} is not supported (only {', '.join(map(str, SUPPORTED_VERSIONS))})")
            tensor_count, kv_count = cursor.unpack("QQ")
            self.metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                value = cursor.value(cursor.unpack("I")[0])
                if key in self.metadata:
                    raise ValueError(f"metadata key {key!r} appears twice")
                self.metadata[key] = value
            infos = [cursor.tensor_info() for _ in range(tensor_count)]
            end_of_header = cursor.position
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-end_of_header // alignment) * alignment
        mapped = np.memmap(path, mode="r") if infos else np.empty(0, np.uint8)
        self.tensors: list[GGUFTensorInfo] = []
        names: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(_tensor(mapped, name, dims, raw_type, data_start + offset, size, cursor.order))


def _tensor(mapped: np.ndarray, name: str, dims: tuple[int, ...], raw_type: int, start: int, size: int, order: str) -> GGUFTensorInfo:
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"tensor {name!r} has an unknown type {raw_type}") from None
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if n_elements % block:
        raise ValueError(f"tensor {name!r}: {n_elements} values are not whole blocks of {block}")
    n_bytes = n_elements // block * block_bytes
    if start + n_bytes > size:
        raise ValueError(f"tensor {name!r} runs past the end of the file ({start + n_bytes} > {size} bytes)")
    shape = tuple(reversed(dims))
    raw = mapped[start:start + n_bytes]
    if kind in _PLAIN:
        data = raw.view(np.dtype(_PLAIN[kind]).newbyteorder(order)).reshape(shape)
    else:
        data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
    return GGUFTensorInfo(name, kind, dims, n_elements, data)


@functools.cache
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


class _Cursor:
    """Reads the header front to back from a buffer, topping it up from ``file`` as needed."""

    def __init__(self, buffer: bytes, file, size: int) -> None:
        self.buffer, self.file, self.size, self.start, self.at, self.order = buffer, file, size, 0, 0, "<"

    @property
    def position(self) -> int:
        return self.start + self.at

    def _need(self, n: int) -> None:
        if self.at + n > len(self.buffer):
            if self.position + n > self.size:  # before reading: a corrupt length may be anything up to 2**64
                raise ValueError(f"the file ends inside its header (at byte {self.size})")
            more = self.file.read(max(n, 1 << 20))
            self.buffer, self.start, self.at = self.buffer[self.at:] + more, self.start + self.at, 0
            if n > len(self.buffer):
                raise ValueError(f"the file ends inside its header (at byte {self.position + len(self.buffer)})")

    def take(self, n: int) -> bytes:
        self._need(n)
        out = self.buffer[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, codes: str) -> tuple:
        fmt = _struct(self.order + codes)
        self._need(fmt.size)
        out = fmt.unpack_from(self.buffer, self.at)
        self.at += fmt.size
        return out

    def string(self) -> str:
        (length,) = self.unpack("Q")
        try:
            return self.take(length).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"a string at byte {self.position - length} is not UTF-8: {e}") from None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("IQ")
            if item_kind in _SCALARS:  # one read for the whole array
                dtype = np.dtype(self.order + _SCALARS[item_kind])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind} at byte {self.position - 4}")

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        (n_dims,) = self.unpack("I")
        dims = self.unpack("Q" * n_dims)
        raw_type, offset = self.unpack("IQ")
        return name, tuple(int(d) for d in dims), raw_type, offset
