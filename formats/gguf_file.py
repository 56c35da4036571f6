"""A GGUF file's header (metadata and tensor table), read without trusting it.

Every count, length, type, dimension and offset is checked against the file's size and llama.cpp's
own rules (``gguf_init_from_file`` in ggml/src/gguf.cpp, and its model loader's check that each
tensor's data lies inside the file) before anything is allocated, so a damaged or hostile file is
refused in time and memory bounded by its size, with one line naming the file and the field or
tensor. A file llama.cpp refuses is refused here too. Tensor data is never read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from core.errors import InputError

# llama.cpp's limits (gguf.cpp, ggml.h).
MAX_STRING_LENGTH = 1 << 30
MAX_ARRAY_ELEMENTS = 1 << 30
MAX_NAME = 64  # GGML_MAX_NAME, the terminating NUL included
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
VERSIONS = (2, 3)
MAGIC = b"GGUF"

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<b",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<i1",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
# The smallest a key-value pair (8-byte length, 1-byte key, type, 1-byte value) and a tensor entry
# (8-byte length, 1-byte name, dims count, one dim, type, offset) can be: bounds for the counts.
_LENGTH = struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost dimension first, as numpy and Hugging Face write it
    type: GGMLQuantizationType
    offset: int  # where its data starts in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata values are Python scalars and strings; arrays are lists of strings or numpy arrays."""

    path: Path
    version: int
    fields: dict[str, object]
    types: dict[str, tuple[GGUFValueType, ...]]  # (type,) or (ARRAY, element type)
    tensors: list[GGUFTensorInfo]
    alignment: int


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and check the header of the GGUF file at ``path``; raise InputError if llama.cpp would refuse it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise InputError(f"{path}: not a GGUF file (only {size} bytes)")
            f.seek(0)
            return _Parser(path, f, size).header()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None


class _Parser:
    """Reads the header through a buffer that grows as the parse advances (by plain reads, not a
    memory map: a map of a 40 GB file counts against an address-space limit, and a file truncated
    while mapped kills the process with SIGBUS)."""

    def __init__(self, path: Path, file, size: int):
        self.path, self.file, self.size, self.pos = path, file, size, 0
        self.data = bytearray()

    def need(self, n: int) -> None:
        """Have the bytes up to ``pos + n`` in the buffer (the caller has checked they are in the file)."""
        short = self.pos + n - len(self.data)
        if short > 0:
            self.data += self.file.read(max(short, len(self.data), 1 << 16))
            if len(self.data) < self.pos + n:
                raise self.fail("the file shrank while it was being read")

    def fail(self, what: str) -> InputError:
        return InputError(f"{self.path}: damaged GGUF file: {what}")

    def left(self) -> int:
        return self.size - self.pos

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if n > self.left():
            raise self.fail(f"the file ends inside {what}")
        self.need(n)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return value

    def raw_string(self, what: str) -> bytes:
        n = self.unpack("<Q", what)
        if n > MAX_STRING_LENGTH or n > self.left():
            raise self.fail(f"{what} claims {n:,} bytes, more than the {self.left():,} left in the file")
        self.need(n)
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return raw

    def strings(self, n: int, key: str) -> list[str]:
        """The ``n`` strings of an array: ``string`` unrolled, as vocabularies hold 10^5 of them."""
        data, size, out, length = self.data, self.size, [], _LENGTH.unpack_from
        for i in range(n):
            start = self.pos + 8
            if start > size:
                raise self.fail(f"the file ends inside element {i} of '{key}'")
            if start > len(data):
                self.need(8)
            (m,) = length(data, self.pos)
            if m > MAX_STRING_LENGTH or start + m > size:
                raise self.fail(f"element {i} of '{key}' claims {m:,} bytes, more than the {size - start:,} left in the file")
            if start + m > len(data):
                self.pos = start
                self.need(m)
            out.append(data[start : start + m].decode("utf-8", "backslashreplace"))
            self.pos = start + m
        return out

    def string(self, what: str) -> str:
        return self.raw_string(what).decode("utf-8", "backslashreplace")

    def value_type(self, what: str) -> GGUFValueType:
        code = self.unpack("<i", what)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.fail(f"{what} is {code}, not a GGUF value type") from None

    def header(self) -> GGUFHeader:
        self.need(4)
        if bytes(self.data[:4]) != MAGIC:
            raise InputError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        self.pos = 4
        version = self.unpack("<I", "the version")
        if version not in VERSIONS:
            hint = " (GGUF v1 is no longer read by llama.cpp)" if version == 1 else ""
            raise self.fail(f"version {version}; llama.cpp reads versions 2 and 3{hint}")
        n_tensors = self.unpack("<q", "the tensor count")
        n_kv = self.unpack("<q", "the metadata count")
        if not 0 <= n_kv <= self.left() // _MIN_KV_BYTES:
            raise self.fail(f"{n_kv:,} metadata entries cannot fit in the {self.left():,} bytes left")
        fields: dict[str, object] = {}
        types: dict[str, tuple[GGUFValueType, ...]] = {}
        for i in range(n_kv):
            key = self.string(f"the name of metadata entry {i}")
            if not key:
                raise self.fail(f"metadata entry {i} has an empty name")
            if key in fields:
                raise self.fail(f"metadata key '{key}' appears twice")
            fields[key], types[key] = self.value(key)
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in fields and types["general.alignment"] != (GGUFValueType.UINT32,):
            raise self.fail("general.alignment is not a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment} is not a power of 2")
        if not 0 <= n_tensors <= self.left() // _MIN_TENSOR_BYTES:
            raise self.fail(f"{n_tensors:,} tensors cannot fit in the {self.left():,} bytes left")
        entries = [self.tensor_entry(i) for i in range(n_tensors)]
        names = [e[0] for e in entries]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise self.fail(f"tensor '{twice}' appears twice")
        data_start = -(-self.pos // alignment) * alignment
        if entries and data_start > self.size:
            raise self.fail("the file ends before its tensor data starts")
        tensors, expected = [], 0
        for name, shape, qtype, offset, n_bytes in entries:
            if offset != expected:
                raise self.fail(f"tensor '{name}' has data offset {offset:,}, but the tensors before it end at {expected:,}")
            if data_start + offset + n_bytes > self.size:
                raise self.fail(f"tensor '{name}' ends at byte {data_start + offset + n_bytes:,}, past the end of the "
                                f"file ({self.size:,} bytes): truncated or damaged")
            tensors.append(GGUFTensorInfo(name, shape, qtype, data_start + offset, n_bytes))
            expected += -(-n_bytes // alignment) * alignment
        return GGUFHeader(self.path, version, fields, types, tensors, alignment)

    def value(self, key: str) -> tuple[object, tuple[GGUFValueType, ...]]:
        vtype = self.value_type(f"the type of '{key}'")
        if vtype == GGUFValueType.STRING:
            return self.string(f"the value of '{key}'"), (vtype,)
        if vtype != GGUFValueType.ARRAY:
            value = self.unpack(_SCALAR_FORMATS[vtype], f"the value of '{key}'")
            return (value != 0 if vtype == GGUFValueType.BOOL else value), (vtype,)
        etype = self.value_type(f"the element type of '{key}'")
        if etype == GGUFValueType.ARRAY:
            raise self.fail(f"'{key}' is an array of arrays, which GGUF does not allow")
        n = self.unpack("<Q", f"the length of '{key}'")
        least = 8 if etype == GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS[etype])
        if n > MAX_ARRAY_ELEMENTS or n * least > self.left():
            raise self.fail(f"'{key}' claims {n:,} elements, more than the {self.left():,} bytes left in the file hold")
        if etype == GGUFValueType.STRING:
            return self.strings(n, key), (vtype, etype)
        dtype = np.dtype(_ARRAY_DTYPES[etype])
        self.need(n * dtype.itemsize)
        values = np.frombuffer(self.data, dtype, count=n, offset=self.pos).copy()
        self.pos += n * dtype.itemsize
        return (values != 0 if etype == GGUFValueType.BOOL else values), (vtype, etype)

    def tensor_entry(self, i: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
        raw = self.raw_string(f"the name of tensor {i}")
        name = raw.decode("utf-8", "backslashreplace")
        if len(raw) >= MAX_NAME:
            raise self.fail(f"tensor {i}'s name is {len(raw)} bytes long; llama.cpp allows at most {MAX_NAME - 1}")
        if b"\0" in raw:
            raise self.fail(f"tensor {i}'s name '{name}' holds a NUL byte")
        n_dims = self.unpack("<I", f"the dimension count of tensor '{name}'")
        if n_dims > MAX_DIMS:
            raise self.fail(f"tensor '{name}' has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
        dims = [self.unpack("<q", f"the dimensions of tensor '{name}'") for _ in range(n_dims)]
        if any(d < 0 for d in dims):
            raise self.fail(f"tensor '{name}' has a negative dimension {dims}")
        elements = 1
        for d in dims:
            elements *= d
        if elements >= 1 << 63:
            raise self.fail(f"tensor '{name}' has {elements:,} elements, more than llama.cpp can count")
        code = self.unpack("<i", f"the type of tensor '{name}'")
        try:
            qtype = GGMLQuantizationType(code)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self.fail(f"tensor '{name}' has type id {code}, not a ggml type") from None
        row = dims[0] if dims else 1
        if row % block:
            raise self.fail(f"tensor '{name}' is {qtype.name} with rows of {row} values, not a multiple of its block of {block}")
        offset = self.unpack("<Q", f"the data offset of tensor '{name}'")
        return name, tuple(reversed(dims)), qtype, offset, elements // block * block_bytes


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does: the one check of the magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False
