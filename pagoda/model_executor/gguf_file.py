"""A GGUF file's metadata and tensors, read from its header with `struct` and mapped, not
copied. The `gguf` package's reader makes a numpy view of every value, so a 49k-token
vocabulary (its tokens, scores, types and merges) takes it about 3.4 s and 150 MiB; read
here it takes well under a second, which is most of a GGUF model's start. Torch-free (the
router reads files too). Little-endian files of versions 2 and 3, as llama.cpp writes."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 4  # arrays of arrays (llama.cpp writes none deeper than 2)
_MAX_DIMS = 4  # GGML_MAX_DIMS
# gguf.GGUFValueType -> struct format (BOOL is one byte)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # fmt: skip
# GGML types whose data is an array of plain numbers, and their numpy types.
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file writes it: the fastest-varying dimension first
    n_bytes: int
    data: np.ndarray  # plain types in their own dtype, block formats as uint8 rows of blocks


class _Header:
    """A cursor over the header's bytes; every read checked against the file's end."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def preamble(self) -> tuple[int, int]:
        """Past the magic and the version: (tensors, metadata keys). ValueError for a file
        that is not GGUF or of a version not read (1, of 2023, counted in 32 bits)."""
        if bytes(self.buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not read (2 and 3 are, little-endian)")
        return self.scalar("Q"), self.scalar("Q")

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ValueError("the header runs past the end of the file")

    def scalar(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        self.need(size)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, skip: bool = False) -> str | None:
        n = self.scalar("Q")
        self.need(n)
        self.pos += n
        return None if skip else bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def value(self, kind: int, skip: bool = False, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string(skip)
        if kind != _ARRAY:
            if kind not in _SCALARS:
                raise ValueError(f"unknown GGUF value type {kind}")
            return self.scalar(_SCALARS[kind])
        if depth >= _MAX_NESTING:
            raise ValueError(f"arrays nested more than {_MAX_NESTING} deep")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS:  # numbers: one read of the whole run
            dtype = np.dtype("<" + _SCALARS[item].replace("?", "b1"))
            self.need(dtype.itemsize * count)
            start, self.pos = self.pos, self.pos + dtype.itemsize * count
            return None if skip else np.frombuffer(self.buf, dtype, count, start).tolist()
        self.need(8 * count)  # (a string or an array takes at least 8 bytes)
        return [self.value(item, skip, depth + 1) for _ in range(count)]


class GGUFFile:
    """`fields`: every metadata key with its value (numbers, strings, lists of them);
    `tensors`: in the file's order, each viewing the mapped file."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header = _Header(self._map)  # (its reads are checked: bad bytes are ValueErrors)
        n_tensors, n_fields = header.preamble()
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = header.string()
            if key in self.fields:
                raise ValueError(f"metadata key {key} is written twice")
            self.fields[key] = header.value(header.scalar("I"))
        infos = {}
        for _ in range(n_tensors):
            name = header.string()
            n_dims = header.scalar("I")
            if n_dims > _MAX_DIMS or name in infos:
                raise ValueError(f"tensor {name}: {n_dims} dimensions, or written twice")
            dims = [header.scalar("Q") for _ in range(n_dims)]
            infos[name] = (dims, header.scalar("I"), header.scalar("Q"))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-header.pos // alignment) * alignment
        whole = np.frombuffer(self._map, np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, (dims, raw_type, offset) in infos.items():
            kind = GGMLQuantizationType(raw_type)
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if kind.name not in _PLAIN and (not dims or dims[0] % block):
                raise ValueError(f"tensor {name}: rows of {dims[:1]} are not whole {kind.name} blocks")  # fmt: skip
            n_elements = int(np.prod(dims, dtype=np.int64))
            n_bytes = n_elements // block * block_bytes
            first = start + offset
            if first + n_bytes > len(whole):
                raise ValueError(f"tensor {name} runs past the end of the file")
            raw = whole[first : first + n_bytes]
            shape = tuple(reversed(dims))
            if kind.name in _PLAIN:
                data = raw.view(_PLAIN[kind.name]).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            self.tensors.append(GGUFTensor(name, kind, tuple(dims), n_bytes, data))


def string_field(path: str, key: str) -> str | None:
    """One string of a file's metadata, read from its header alone (arrays before it
    skipped, nothing after it read), or None where the key is absent or not a string."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            header = _Header(m)
            _, n_fields = header.preamble()
            for _ in range(n_fields):
                name, kind = header.string(), header.scalar("I")
                if name == key:
                    return header.string() if kind == _STRING else None
                header.value(kind, skip=True)
    except (OSError, ValueError):
        return None
    return None
