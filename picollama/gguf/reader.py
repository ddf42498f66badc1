"""GGUF reader: a validating, zero-copy view over an mmap of the file.

Opening a file parses and checks the whole header (magic, version, metadata, tensor infos,
alignment, tensor offsets and bounds) and nothing else: tensor data stays in the page cache and
is exposed as read-only numpy views into the mmap.

Every count, length and offset read from the file is checked against the bytes left in the file
before anything is allocated or sliced, so a hostile file costs time and memory proportional to
its own size, never to the numbers written in it. Any malformation raises ``GGUFError`` naming
the field and the absolute byte offset where it was found.

Policy, where the format leaves room (llama.cpp's ``gguf_init_from_file_impl`` is the
reference; where we are stricter it says so):

- Little-endian files, versions 2 and 3 (they share one layout). A byte-swapped version field
  is reported as a big-endian file, which is unsupported.
- Keys are non-empty (llama.cpp accepts an empty key; we reject it) and unique.
- Arrays of arrays parse, nested at most ``MAX_ARRAY_DEPTH`` deep (llama.cpp rejects them all).
- ``BOOL`` values must be 0 or 1 (stricter than llama.cpp).
- ``general.alignment``, when present, is a ``UINT32`` power of two in [1, ``MAX_ALIGNMENT``].
- Tensor names are non-empty (stricter), unique and shorter than ``GGML_MAX_NAME`` (64) bytes.
- ``n_dims`` is 0..4 as in llama.cpp; ``n_dims`` 0 is a scalar (one element, shape ``()``).
- Each dim is in [0, 2^63); the element count and the byte size, counting zero dims as one,
  fit in int64. A zero dim gives an empty tensor (``nbytes`` 0).
- Each tensor's offset equals the running offset: tensors are stored in file order, each padded
  to the alignment, as llama.cpp requires. Data must lie inside the file.
- Tokenizer arrays (``tokenizer.ggml.tokens``/``scores``/``token_type``/``merges``) have their
  llama.cpp types and matching lengths. Consistency of hyper-parameters with tensor shapes is the
  model loader's job.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from picollama.gguf.constants import (
    GGML_MAX_DIMS,
    GGML_TYPES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_SUPPORTED_VERSIONS,
    GGMLType,
    GGUFValueType,
    Keys,
)
from picollama.gguf.errors import GGUFError, GGUFKeyError, quote

__all__ = [
    "GGUFReader",
    "TensorInfo",
    "MAX_ARRAY_DEPTH",
    "MAX_ALIGNMENT",
    "GGML_MAX_NAME",
    "SCALAR_FORMATS",
    "ARRAY_DTYPES",
]

VT = GGUFValueType

# Deepest nesting of arrays: 1 is a plain array, 2 an array of arrays, and so on.
MAX_ARRAY_DEPTH = 8
# Largest accepted general.alignment, in bytes; more than this is padding, not alignment.
MAX_ALIGNMENT = 1 << 24
# ggml's name buffer, NUL included: names are at most 63 bytes.
GGML_MAX_NAME = 64
_INT64_MAX = (1 << 63) - 1

# struct formats of the fixed-size value types, all little-endian.
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<B",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}

_U64 = struct.Struct("<Q")
_SCALAR_SIZES = {vt: struct.calcsize(fmt) for vt, fmt in SCALAR_FORMATS.items()}

# numpy dtypes of arrays of the fixed-size value types.
ARRAY_DTYPES: dict[GGUFValueType, np.dtype] = {
    VT.UINT8: np.dtype("u1"),
    VT.INT8: np.dtype("i1"),
    VT.UINT16: np.dtype("<u2"),
    VT.INT16: np.dtype("<i2"),
    VT.UINT32: np.dtype("<u4"),
    VT.INT32: np.dtype("<i4"),
    VT.FLOAT32: np.dtype("<f4"),
    VT.BOOL: np.dtype("?"),
    VT.UINT64: np.dtype("<u8"),
    VT.INT64: np.dtype("<i8"),
    VT.FLOAT64: np.dtype("<f8"),
}

# Fewest bytes one array element of each type can take: the bound checked against the bytes
# left before an array is read. A string is at least its u64 length; an array its u32 type and
# u64 count.
_MIN_ELEMENT_BYTES: dict[GGUFValueType, int] = {
    **{vt: dtype.itemsize for vt, dtype in ARRAY_DTYPES.items()},
    VT.STRING: 8,
    VT.ARRAY: 4 + 8,
}
# Fewest bytes of one KV: u64 key length, 1-byte key, u32 value type, 1-byte value.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
# Fewest bytes of one tensor info: u64 name length, 1-byte name, u32 n_dims (0), u32 type,
# u64 offset.
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8

_INTEGER_TYPES = frozenset(
    {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}
)
_FLOAT_TYPES = frozenset({VT.FLOAT32, VT.FLOAT64})

# Typed views of the non-quantized tensor types (BF16 as its raw uint16 bits).
_TENSOR_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.BF16: np.dtype("<u2"),
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}

# Well-known tokenizer arrays: key -> the element type llama.cpp reads them as.
_TOKENIZER_ARRAYS: dict[str, GGUFValueType] = {
    Keys.TOKENIZER_TOKENS: VT.STRING,
    Keys.TOKENIZER_SCORES: VT.FLOAT32,
    Keys.TOKENIZER_TOKEN_TYPE: VT.INT32,
    Keys.TOKENIZER_MERGES: VT.STRING,
}

_MISSING: Any = object()


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    ``shape`` is in GGUF order: ``shape[0]`` is ``ne[0]``, the contiguous row length; numpy
    order is ``shape[::-1]``. ``offset`` is the absolute file offset of the data, and ``data``
    a read-only uint8 view of exactly ``nbytes`` bytes of the mmap (no copy). ``index`` is the
    tensor's position in the file and ``info_offset`` where its info record starts, for error
    messages.
    """

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    n_elements: int
    data: np.ndarray = field(repr=False, compare=False)
    index: int = field(default=-1, compare=False)
    info_offset: int = field(default=-1, compare=False)

    @property
    def n_dims(self) -> int:
        return len(self.shape)

    @property
    def is_quantized(self) -> bool:
        return self.type not in _TENSOR_DTYPES

    def array(self) -> np.ndarray:
        """A read-only typed view in numpy order (``shape[::-1]``).

        F32/F16/F64/I8..I64 get their numpy dtype, BF16 its uint16 bits. Quantized types give
        the raw uint8 rows: shape ``(*shape[:0:-1], row_bytes)``.
        """
        np_shape = self.shape[::-1]
        dtype = _TENSOR_DTYPES.get(self.type)
        if dtype is not None:
            return self.data.view(dtype).reshape(np_shape)
        info = GGML_TYPES[self.type]
        row_bytes = self.shape[0] // info.block_size * info.type_size
        return self.data.reshape((*np_shape[:-1], row_bytes))


class _Parser:
    """Cursor over the mmap; every read is bounds-checked and errors carry ``self.field``."""

    def __init__(self, buf: mmap.mmap, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.field = "header"

    def fail(self, detail: str, offset: int | None = None) -> GGUFError:
        return GGUFError(detail, field=self.field, offset=self.pos if offset is None else offset)

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated at offset {self.pos}: {what} needs {n} bytes, "
                f"the file has {self.size - self.pos} left (file size {self.size})"
            )

    def unpack(self, fmt: str, n: int, what: str) -> int | float:
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)  # type: ignore[return-value]

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)  # type: ignore[return-value]

    def string(self, what: str, max_len: int | None = None) -> str:
        """A u64 length then that many bytes, decoded as UTF-8 (surrogateescape)."""
        start = self.pos
        n = self.u64(f"{what} length")
        if n > self.left:
            raise self.fail(
                f"{what} length {n} exceeds the {self.left} bytes left in the file", offset=start
            )
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} length {n} exceeds the limit of {max_len} bytes", start)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", "surrogateescape")

    def string_array(self, count: int) -> list[str]:
        """``count`` strings: ``string()`` inlined, as vocabularies hold 10^5..10^6 of them."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack_u64 = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                break
            n = unpack_u64(buf, pos)[0]
            if n > size - pos - 8:
                break
            pos += 8
            append(buf[pos : pos + n].decode("utf-8", "surrogateescape"))
            pos += n
        else:
            self.pos = pos
            return out
        self.pos = pos
        self.string("string array element")  # out of bounds: raises the error
        raise AssertionError("unreachable")

    def value_type(self, what: str, key: str) -> GGUFValueType:
        start = self.pos
        raw = self.u32(what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(
                f"invalid type {raw} for key {quote(key)} "
                f"(valid: {min(GGUFValueType)}..{max(GGUFValueType)})",
                offset=start,
            ) from None

    def scalar(self, vtype: GGUFValueType) -> Any:
        if vtype == VT.STRING:
            return self.string("string value")
        start = self.pos
        value = self.unpack(SCALAR_FORMATS[vtype], _SCALAR_SIZES[vtype], f"{vtype.name} value")
        if vtype == VT.BOOL:
            if value > 1:
                raise self.fail(f"BOOL value {value} is neither 0 nor 1", offset=start)
            return bool(value)
        return value

    def array(self, key: str, depth: int) -> tuple[Any, GGUFValueType]:
        """An array (element type, count, elements); returns (value, element type)."""
        elem_type = self.value_type("array element type", key)
        if elem_type == VT.ARRAY and depth >= MAX_ARRAY_DEPTH:
            raise self.fail(
                f"arrays nested more than {MAX_ARRAY_DEPTH} deep in key {quote(key)}",
                offset=self.pos - 4,
            )
        count_at = self.pos
        count = self.u64("array count")
        min_bytes = _MIN_ELEMENT_BYTES[elem_type]
        if count > self.left // min_bytes:
            raise self.fail(
                f"array count {count} of {elem_type.name} needs at least {count} x {min_bytes} "
                f"bytes, the file has {self.left} left",
                offset=count_at,
            )
        dtype = ARRAY_DTYPES.get(elem_type)
        if dtype is not None:
            start = self.pos
            if count == 0:
                arr = np.empty(0, dtype)
                arr.flags.writeable = False
                return arr, elem_type
            if elem_type == VT.BOOL:
                raw = np.frombuffer(self.buf, np.uint8, count, start)
                bad = np.flatnonzero(raw > 1)
                if bad.size:
                    raise self.fail(
                        f"BOOL array element {int(bad[0])} is {int(raw[bad[0]])}, not 0 or 1",
                        offset=start + int(bad[0]),
                    )
            arr = np.frombuffer(self.buf, dtype, count, start)
            self.pos = start + count * dtype.itemsize
            return arr, elem_type
        if elem_type == VT.STRING:
            return self.string_array(count), elem_type
        # Arrays of arrays: recursion is bounded by MAX_ARRAY_DEPTH, not by the input.
        return [self.array(key, depth + 1)[0] for _ in range(count)], elem_type


class GGUFReader:
    """A parsed, validated GGUF file; tensor data are zero-copy views into an mmap.

    Attributes: ``path``, ``version`` (2 or 3), ``alignment``, ``data_offset`` (absolute
    start of the data section; past the end of the file when there is no data),
    ``file_size``, ``metadata`` and ``tensors`` (``TensorInfo``, in file order).

    ``metadata`` maps keys, in file order, to Python values (int, float, bool, str), numpy
    arrays (numeric arrays: little-endian, read-only views into the mmap), ``list[str]``
    (string arrays) or lists (arrays of arrays). Strings are UTF-8 decoded with
    ``errors="surrogateescape"``: ``s.encode("utf-8", "surrogateescape")`` gives back the
    exact bytes. ``name in reader`` tests for a tensor.

    Usable as a context manager; raises ``GGUFError`` for any malformed file and ``OSError``
    when the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.version = 0
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        self._types: dict[str, GGUFValueType] = {}
        self._array_types: dict[str, GGUFValueType] = {}
        self._key_offsets: dict[str, int] = {}
        self._by_name: dict[str, TensorInfo] = {}
        self._mmap: mmap.mmap | None = None

        st = os.stat(self.path)
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError(f"{self.path!r} is not a regular file", field="file", offset=0)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError("truncated at offset 0: the file is empty", field="magic", offset=0)
            # The mmap holds its own duplicate of the descriptor; the file closes here.
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        try:
            self._parse(_Parser(self._mmap, size))
        except BaseException:
            self.close()
            raise

    # -- parsing -------------------------------------------------------------------------

    def _parse(self, p: _Parser) -> None:
        self._parse_header(p)
        n_tensors, n_kv = self._parse_counts(p)
        self._parse_kv(p, n_kv)
        self._check_alignment()
        self._check_tokenizer()
        raw_infos = self._parse_tensor_infos(p, n_tensors)
        self.data_offset = _align_up(p.pos, self.alignment)
        self._place_tensors(p, raw_infos)

    def _parse_header(self, p: _Parser) -> None:
        p.field = "magic"
        p.need(4, "magic")
        magic = p.buf[0:4]
        if magic != GGUF_MAGIC:
            raise p.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
        p.pos = 4
        p.field = "version"
        version = p.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise p.fail(
                f"version {version:#010x} is byte-swapped (version {swapped}): the file is "
                "big-endian, which is unsupported",
                offset=4,
            )
        if version not in GGUF_SUPPORTED_VERSIONS:
            hint = " (GGUFv1 is obsolete)" if version == 1 else ""
            raise p.fail(
                f"unsupported GGUF version {version}{hint}, supported: "
                f"{', '.join(map(str, GGUF_SUPPORTED_VERSIONS))}",
                offset=4,
            )
        self.version = version

    def _parse_counts(self, p: _Parser) -> tuple[int, int]:
        p.field = "n_tensors"
        n_tensors_at = p.pos
        n_tensors = p.u64("n_tensors")
        p.field = "n_kv"
        n_kv_at = p.pos
        n_kv = p.u64("n_kv")
        for name, count, at, min_bytes in (
            ("n_tensors", n_tensors, n_tensors_at, _MIN_TENSOR_INFO_BYTES),
            ("n_kv", n_kv, n_kv_at, _MIN_KV_BYTES),
        ):
            p.field = name
            if count > _INT64_MAX:
                raise p.fail(f"{name} {count - (1 << 64)} is negative", offset=at)
            if count > p.left // min_bytes:
                raise p.fail(
                    f"{name} {count} needs at least {count} x {min_bytes} bytes, only {p.left} "
                    "are left after the header (truncated or corrupt file)",
                    offset=at,
                )
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > p.left:
            p.field = "n_tensors and n_kv"
            raise p.fail(
                f"{n_tensors} tensor infos and {n_kv} KVs cannot fit in the {p.left} bytes "
                "left after the header",
                offset=n_tensors_at,
            )
        return n_tensors, n_kv

    def _parse_kv(self, p: _Parser, n_kv: int) -> None:
        for i in range(n_kv):
            kv_at = p.pos
            p.field = f"key #{i}"
            key = p.string("key")
            if not key:
                raise p.fail("empty key", offset=kv_at)
            p.field = f"key {quote(key)} (#{i})"
            if key in self._types:
                raise p.fail(
                    f"duplicate key {quote(key)} (first at offset {self._key_offsets[key]})",
                    offset=kv_at,
                )
            vtype = p.value_type("value type", key)
            if vtype == VT.ARRAY:
                value, elem_type = p.array(key, depth=1)
                self._array_types[key] = elem_type
            else:
                value = p.scalar(vtype)
            self.metadata[key] = value
            self._types[key] = vtype
            self._key_offsets[key] = kv_at

    def _check_alignment(self) -> None:
        key = Keys.GENERAL_ALIGNMENT
        if key not in self.metadata:
            return
        vtype = self._types[key]
        value = self.metadata[key]
        field_name = f"key {quote(key)}"
        at = self._key_offsets[key]
        if vtype != VT.UINT32:
            raise GGUFError(f"must be UINT32, found {vtype.name}", field=field_name, offset=at)
        if value == 0 or value & (value - 1):
            raise GGUFError(f"alignment {value} is not a power of two", field=field_name, offset=at)
        if value > MAX_ALIGNMENT:
            raise GGUFError(
                f"alignment {value} exceeds the limit of {MAX_ALIGNMENT}",
                field=field_name,
                offset=at,
            )
        self.alignment = value

    def _check_tokenizer(self) -> None:
        first: tuple[str, int] | None = None  # (key, length) of the first per-token array
        for key, elem_type in _TOKENIZER_ARRAYS.items():
            if key not in self.metadata:
                continue
            field_name = f"key {quote(key)}"
            at = self._key_offsets[key]
            vtype = self._types[key]
            if vtype != VT.ARRAY or self._array_types[key] != elem_type:
                found = vtype.name
                if vtype == VT.ARRAY:
                    found = f"ARRAY of {self._array_types[key].name}"
                raise GGUFError(
                    f"must be an ARRAY of {elem_type.name}, found {found}",
                    field=field_name,
                    offset=at,
                )
            if key == Keys.TOKENIZER_MERGES:
                continue  # one entry per merge, not per token
            n = len(self.metadata[key])
            if first is None:
                first = (key, n)
            elif n != first[1]:
                raise GGUFError(
                    f"has {n} entries but {first[0]} has {first[1]}",
                    field=field_name,
                    offset=at,
                )

    def _parse_tensor_infos(self, p: _Parser, n_tensors: int) -> list[tuple]:
        raw_infos = []
        seen: dict[str, int] = {}
        for i in range(n_tensors):
            info_at = p.pos
            p.field = f"tensor #{i}"
            name = p.string("tensor name", max_len=GGML_MAX_NAME - 1)
            if not name:
                raise p.fail("empty tensor name", offset=info_at)
            p.field = f"tensor {quote(name)} (#{i})"
            if name in seen:
                raise p.fail(
                    f"duplicate tensor name {quote(name)} (also tensor #{seen[name]})",
                    offset=info_at,
                )
            seen[name] = i

            n_dims_at = p.pos
            n_dims = p.u32("n_dims")
            if n_dims > GGML_MAX_DIMS:
                raise p.fail(f"n_dims {n_dims} exceeds {GGML_MAX_DIMS}", offset=n_dims_at)
            shape = []
            for j in range(n_dims):
                dim_at = p.pos
                ne = p.u64(f"dimension {j}")
                if ne > _INT64_MAX:
                    raise p.fail(f"dimension {j} is negative ({ne - (1 << 64)})", offset=dim_at)
                shape.append(ne)
            # Zero dims count as one here so that the strides of an empty tensor fit too.
            n_bound = 1
            for ne in shape:
                n_bound *= max(ne, 1)
            if n_bound > _INT64_MAX:
                raise p.fail(
                    f"shape {tuple(shape)} has more than 2^63-1 elements", offset=n_dims_at
                )

            type_at = p.pos
            type_id = p.u32("tensor type")
            try:
                ggml_type = GGMLType(type_id)
            except ValueError:
                signed = type_id - (1 << 32) if type_id >= 1 << 31 else type_id
                raise p.fail(f"invalid ggml type {signed}", offset=type_at) from None
            info = GGML_TYPES[ggml_type]
            ne0 = shape[0] if shape else 1
            if ne0 % info.block_size:
                raise p.fail(
                    f"row length ne[0] = {ne0} of a {ggml_type.name} tensor is not a multiple "
                    f"of the block size {info.block_size}",
                    offset=type_at,
                )
            if -(-n_bound // info.block_size) * info.type_size > _INT64_MAX:
                raise p.fail(
                    f"shape {tuple(shape)} of {ggml_type.name} takes more than 2^63-1 bytes",
                    offset=n_dims_at,
                )
            n_elements = 1
            for ne in shape:
                n_elements *= ne
            nbytes = n_elements // info.block_size * info.type_size

            offset_at = p.pos
            rel_offset = p.u64("tensor data offset")
            raw_infos.append(
                (name, ggml_type, tuple(shape), rel_offset, nbytes, n_elements, info_at, offset_at)
            )
        return raw_infos

    def _place_tensors(self, p: _Parser, raw_infos: list[tuple]) -> None:
        expected = 0  # running offset inside the data section, always aligned
        for i, raw in enumerate(raw_infos):
            name, ggml_type, shape, rel, nbytes, n_elements, info_at, offset_at = raw
            p.field = f"tensor {quote(name)} (#{i})"
            if rel % self.alignment:
                raise p.fail(
                    f"data offset {rel} is not a multiple of the alignment {self.alignment}",
                    offset=offset_at,
                )
            if rel != expected:
                raise p.fail(
                    f"data offset {rel}, expected {expected}: tensors must be stored in order, "
                    f"each padded to the alignment {self.alignment}",
                    offset=offset_at,
                )
            start = self.data_offset + rel
            end = start + nbytes
            if end > self.file_size:
                raise p.fail(
                    f"truncated: data [{start}, {end}) ({nbytes} bytes) extends past the end of "
                    f"the file at offset {self.file_size}",
                    offset=offset_at,
                )
            expected = rel + _align_up(nbytes, self.alignment)
            data = np.frombuffer(self._mmap, np.uint8, nbytes, start)  # type: ignore[arg-type]
            tensor = TensorInfo(
                name=name,
                type=ggml_type,
                shape=shape,
                offset=start,
                nbytes=nbytes,
                n_elements=n_elements,
                data=data,
                index=i,
                info_offset=info_at,
            )
            self.tensors.append(tensor)
            self._by_name[name] = tensor

    # -- metadata access -----------------------------------------------------------------

    def _missing(self, key: str) -> GGUFKeyError:
        return GGUFKeyError("missing key (not in the file's metadata)", field=f"key {quote(key)}")

    def key_offset(self, key: str) -> int:
        """Absolute offset of the KV record of ``key``, for error messages."""
        if key not in self._key_offsets:
            raise self._missing(key)
        return self._key_offsets[key]

    def value_type(self, key: str) -> GGUFValueType:
        if key not in self._types:
            raise self._missing(key)
        return self._types[key]

    def array_type(self, key: str) -> GGUFValueType | None:
        """The element type of the array at ``key``; ``None`` if the value is not an array."""
        if key not in self._types:
            raise self._missing(key)
        return self._array_types.get(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _typed(self, key: str, default: Any, allowed: Iterable[GGUFValueType], what: str) -> Any:
        if key not in self.metadata:
            if default is _MISSING:
                raise self._missing(key)
            return default
        vtype = self._types[key]
        if vtype not in allowed:
            found = vtype.name
            if vtype == VT.ARRAY:
                found = f"ARRAY of {self._array_types[key].name}"
            raise GGUFError(
                f"expected {what}, found {found}",
                field=f"key {quote(key)}",
                offset=self._key_offsets[key],
            )
        return self.metadata[key]

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        """An integer value (any of the 8 integer types; BOOL is not an integer here)."""
        return self._typed(key, default, _INTEGER_TYPES, "an integer")

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        """A FLOAT32/FLOAT64 value; integer values are accepted and converted."""
        value = self._typed(key, default, _FLOAT_TYPES | _INTEGER_TYPES, "a float")
        return float(value) if key in self.metadata else value

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        return self._typed(key, default, (VT.STRING,), "a STRING")

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        return self._typed(key, default, (VT.BOOL,), "a BOOL")

    def get_array(
        self,
        key: str,
        default: Any = _MISSING,
        elem_type: GGUFValueType | Iterable[GGUFValueType] | None = None,
    ) -> Any:
        """An array value; with ``elem_type``, its element type must be (one of) those."""
        value = self._typed(key, default, (VT.ARRAY,), "an ARRAY")
        if elem_type is not None and key in self.metadata:
            allowed = {elem_type} if isinstance(elem_type, GGUFValueType) else set(elem_type)
            found = self._array_types[key]
            if found not in allowed:
                names = " or ".join(sorted(t.name for t in allowed))
                raise GGUFError(
                    f"expected an ARRAY of {names}, found ARRAY of {found.name}",
                    field=f"key {quote(key)}",
                    offset=self._key_offsets[key],
                )
        return value

    # -- tensors -------------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise GGUFKeyError(
                "no such tensor in the file", field=f"tensor {quote(name)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Release the mmap. Views still held elsewhere keep the mapping alive until freed."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            # Exported numpy views still point into the mapping: it is unmapped when the
            # last of them is garbage-collected, never under their feet.
            pass

    def __enter__(self) -> GGUFReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFReader({self.path!r}, version={self.version}, "
            f"{len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )
