"""A GGUF file's metadata and tensor table, parsed in one pass over its mapped bytes.

Why not the `gguf` package's GGUFReader: it makes a numpy view of the memory map for every
part of every metadata value, so a vocabulary's strings and merges cost several views
each. Opening SmolLM2-135M's file (49k tokens, 48k merges) took about 6 s on these cores,
twice per model load (weights, then tokenizer): more than dequantizing every tensor. Here
metadata values are read with `struct` straight from the bytes (a fraction of a second)
and each tensor is one numpy view of the map, in the layout `gguf.quants.dequantize`
takes (quantized types as bytes [..., row bytes]; plain types as their numpy dtype, shape
reversed), as GGUFReader gives them. `gguf` still supplies the type enums, block sizes
and dequantization.

Format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF", u32
version (2 or 3), u64 tensor count, u64 metadata count; metadata as (string key, u32 type,
value); tensor infos as (string name, u32 n_dims, u64 dims fastest-first, u32 ggml type,
u64 offset into the data section); then the data section, aligned to `general.alignment`
(32 by default). A string is a u64 length and UTF-8 bytes. A file written on a big-endian
machine has its version's bytes swapped; its metadata is read in that order too.

Anything that does not parse (a short file, an unknown type, a tensor past the end) raises
ValueError with what was wrong; the loaders turn that into a WeightFileError naming the file.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: scalar ones -> struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types stored as plain numbers (anything else is block-quantized, viewed as bytes)
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (fastest dimension first), `data` a view of the file."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads little- or big-endian values from `buf` at a moving offset, bounds-checked."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.offset = buf, order, 0

    def take(self, fmt: str, count: int = 1) -> tuple:
        size = struct.calcsize(self.order + fmt) * count  # count comes from the file: check it before unpacking
        if self.offset + size > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf)}, inside a value at byte {self.offset}")
        values = struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, self.offset)
        self.offset += size
        return values

    def one(self, fmt: str):
        return self.take(fmt)[0]

    def string(self) -> str:
        n = self.one("Q")
        if self.offset + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.offset} runs past the end of the file")
        text = bytes(self.buf[self.offset:self.offset + n]).decode("utf-8")
        self.offset += n
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.one(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, n = self.one("I"), self.one("Q")
            if item_kind in _SCALARS:
                return list(self.take(_SCALARS[item_kind], n)) if n else []
            return [self.value(item_kind) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {kind} at byte {self.offset}")


class GGUFFile:
    """`fields`: metadata key -> Python value (str, int, float, bool or a list of them);
    `tensors`: the tensor table in file order. The file stays mapped while this lives."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"a GGUF header needs 24 bytes, the file has {size}")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"no GGUF magic: the file starts with {bytes(buf[:4])!r}")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        cur = _Cursor(buf, order)
        cur.offset = 4
        version = cur.one("I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is unsupported (supported: {SUPPORTED_VERSIONS})")
        tensor_count, kv_count = cur.take("Q", 2)
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = cur.value(cur.one("I"))
        infos = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = cur.take("Q", cur.one("I"))
            infos.append((name, dims, cur.one("I"), cur.one("Q")))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        start = -(-cur.offset // alignment) * alignment
        self.tensors = [self._tensor(buf, order, start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    @staticmethod
    def _tensor(buf, order: str, start: int, name: str, dims: tuple, raw_type: int, offset: int) -> GGUFTensor:
        kind = GGMLQuantizationType(raw_type)  # ValueError for an unknown type
        shape = tuple(reversed([int(d) for d in dims]))  # numpy order
        elements = int(np.prod(shape, dtype=np.int64))
        block, type_bytes = GGML_QUANT_SIZES[kind]
        if elements % block:
            raise ValueError(f"tensor {name!r}: {elements} elements are not whole blocks of {block}")
        nbytes, begin = elements // block * type_bytes, start + offset
        if begin + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} needs bytes up to {begin + nbytes}, the file has {len(buf)}")
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind]).newbyteorder(order)
            data = np.frombuffer(buf, dtype, elements, begin).reshape(shape)
        else:
            data = np.frombuffer(buf, np.uint8, nbytes, begin).reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, tuple(int(d) for d in dims), data)
