"""GGUF writer: the mirror of the reader, and the factory for test fixtures.

Metadata and tensors are added, checked at once (misuse raises ``ValueError``/``TypeError``),
then ``write()`` emits the header, the KVs, the tensor infos and the aligned data, in that
order, to a temporary file in the destination directory, fsyncs it and renames it over the
destination: a crash never leaves a half-written file at the final path.

Tensor arrays are kept by reference until ``write()``: do not modify them in between.
``add_tensor_lazy`` takes a loader instead, called once during ``write()``, so a converter holds
one tensor in memory at a time.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from picollama.gguf.constants import (
    GGML_MAX_DIMS,
    GGML_TYPES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLType,
    GGUFValueType,
    Keys,
    tensor_nbytes,
)
from picollama.gguf.reader import (
    ARRAY_DTYPES,
    GGML_MAX_NAME,
    MAX_ALIGNMENT,
    MAX_ARRAY_DEPTH,
    SCALAR_FORMATS,
)

__all__ = ["GGUFWriter", "GGUF_WRITE_VERSION"]

VT = GGUFValueType

GGUF_WRITE_VERSION = 3

_INT_RANGES: dict[GGUFValueType, tuple[int, int]] = {
    VT.UINT8: (0, (1 << 8) - 1),
    VT.INT8: (-(1 << 7), (1 << 7) - 1),
    VT.UINT16: (0, (1 << 16) - 1),
    VT.INT16: (-(1 << 15), (1 << 15) - 1),
    VT.UINT32: (0, (1 << 32) - 1),
    VT.INT32: (-(1 << 31), (1 << 31) - 1),
    VT.UINT64: (0, (1 << 64) - 1),
    VT.INT64: (-(1 << 63), (1 << 63) - 1),
}

# dtype -> GGUF value type, for numpy arrays given to add_array without an element type.
_DTYPE_TO_VT: dict[np.dtype, GGUFValueType] = {
    np.dtype(dt).newbyteorder("="): vt for vt, dt in ARRAY_DTYPES.items()
}

# dtype -> ggml type, for tensors given without a ggml type (uint8/uint16 are ambiguous).
_DTYPE_TO_GGML: dict[np.dtype, GGMLType] = {
    np.dtype(np.float32): GGMLType.F32,
    np.dtype(np.float16): GGMLType.F16,
    np.dtype(np.float64): GGMLType.F64,
    np.dtype(np.int8): GGMLType.I8,
    np.dtype(np.int16): GGMLType.I16,
    np.dtype(np.int32): GGMLType.I32,
    np.dtype(np.int64): GGMLType.I64,
}

# ggml type -> (numpy kind(s), itemsize) that its data must have; BF16 is raw uint16 bits.
_GGML_DTYPE_KINDS: dict[GGMLType, tuple[str, int]] = {
    GGMLType.F32: ("f", 4),
    GGMLType.F16: ("f", 2),
    GGMLType.F64: ("f", 8),
    GGMLType.BF16: ("uV", 2),
    GGMLType.I8: ("i", 1),
    GGMLType.I16: ("i", 2),
    GGMLType.I32: ("i", 4),
    GGMLType.I64: ("i", 8),
}


def _pack_string(value: str | bytes) -> bytes:
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
    return struct.pack("<Q", len(raw)) + raw


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


def _check_int(value: Any, vtype: GGUFValueType, where: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{where}: {vtype.name} needs an int, got {type(value).__name__}")
    lo, hi = _INT_RANGES[vtype]
    if not lo <= int(value) <= hi:
        raise ValueError(f"{where}: {int(value)} is out of range for {vtype.name} [{lo}, {hi}]")
    return int(value)


def _pack_scalar(value: Any, vtype: GGUFValueType, where: str) -> bytes:
    if vtype == VT.STRING:
        if not isinstance(value, (str, bytes, bytearray)):
            raise TypeError(f"{where}: STRING needs str or bytes, got {type(value).__name__}")
        return _pack_string(value)
    if vtype == VT.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{where}: BOOL needs a bool, got {type(value).__name__}")
        return b"\x01" if value else b"\x00"
    if vtype in _INT_RANGES:
        return struct.pack(SCALAR_FORMATS[vtype], _check_int(value, vtype, where))
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        if not _is_number(value):
            raise TypeError(f"{where}: {vtype.name} needs a number, got {type(value).__name__}")
        try:
            return struct.pack(SCALAR_FORMATS[vtype], float(value))
        except OverflowError:
            raise ValueError(f"{where}: {value} is out of range for {vtype.name}") from None
    raise ValueError(f"{where}: {vtype.name} is not a scalar type")


def _infer_elem_type(values: Any, where: str) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        vtype = _DTYPE_TO_VT.get(values.dtype.newbyteorder("="))
        if vtype is None:
            raise TypeError(f"{where}: no GGUF array type for dtype {values.dtype}")
        return vtype
    if len(values) == 0:
        raise ValueError(f"{where}: cannot infer the element type of an empty array")
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return VT.BOOL
    if all(isinstance(v, (str, bytes, bytearray)) for v in values):
        return VT.STRING
    if all(_is_int(v) for v in values):
        lo, hi = min(values), max(values)
        for vtype in (VT.INT32, VT.INT64, VT.UINT64):
            if _INT_RANGES[vtype][0] <= lo and hi <= _INT_RANGES[vtype][1]:
                return vtype
        raise ValueError(f"{where}: integers out of the range of any GGUF type")
    if all(_is_number(v) for v in values):
        return VT.FLOAT32
    if all(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        return VT.ARRAY
    raise TypeError(f"{where}: cannot infer one GGUF type for the array elements")


def _pack_array(values: Any, elem_type: GGUFValueType | None, where: str, depth: int = 1) -> bytes:
    """Array payload: u32 element type, u64 count, elements."""
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(
        values, (Sequence, np.ndarray)
    ):
        raise TypeError(f"{where}: an array needs a sequence, got {type(values).__name__}")
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise ValueError(f"{where}: array values must be 1-D, got shape {values.shape}")
    elem_type = _infer_elem_type(values, where) if elem_type is None else VT(elem_type)
    head = struct.pack("<IQ", elem_type, len(values))
    dtype = ARRAY_DTYPES.get(elem_type)
    if dtype is not None:
        return head + _numeric_array_bytes(values, elem_type, dtype, where)
    if elem_type == VT.STRING:
        return head + b"".join(_pack_scalar(v, VT.STRING, where) for v in values)
    if depth >= MAX_ARRAY_DEPTH:
        raise ValueError(f"{where}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
    return head + b"".join(_pack_array(v, None, where, depth + 1) for v in values)


def _numeric_array_bytes(
    values: Any, elem_type: GGUFValueType, dtype: np.dtype, where: str
) -> bytes:
    if not isinstance(values, np.ndarray):
        # Python sequences: check each element like a scalar (exact ranges, no silent casts).
        for v in values:
            _pack_scalar(v, elem_type, where)
        return np.array(values, dtype=dtype).tobytes()
    kind = values.dtype.kind
    if elem_type == VT.BOOL:
        if kind != "b":
            raise TypeError(f"{where}: a BOOL array needs dtype bool, got {values.dtype}")
    elif elem_type in _INT_RANGES:
        if kind not in "iu":
            raise TypeError(f"{where}: {elem_type.name} array needs integers, got {values.dtype}")
        if values.size:
            lo, hi = _INT_RANGES[elem_type]
            if int(values.min()) < lo or int(values.max()) > hi:
                raise ValueError(f"{where}: values out of range for {elem_type.name}")
    elif kind not in "iuf":
        raise TypeError(f"{where}: {elem_type.name} array needs numbers, got {values.dtype}")
    return values.astype(dtype, copy=False).tobytes()


@dataclass
class _PendingTensor:
    name: str
    type: GGMLType
    shape: tuple[int, ...]  # GGUF order
    data: np.ndarray | Callable[[], np.ndarray]  # a loader for lazy tensors
    nbytes: int


class GGUFWriter:
    """Builds a GGUF v3 file: typed metadata, tensors, then one ``write()``.

    ``arch`` (optional) becomes ``general.architecture``; an ``alignment`` other than the
    default 32 is written as ``general.alignment``. ``path`` may be ``None`` when only
    ``to_bytes()`` is used (test fixtures).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        arch: str | None = None,
        alignment: int = GGUF_DEFAULT_ALIGNMENT,
    ):
        self.path = os.fspath(path) if path is not None else None
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        self._kv: dict[str, bytes] = {}  # key -> u32 value type + payload
        self._tensors: dict[str, _PendingTensor] = {}
        self._written = False
        if arch is not None:
            self.add_string(Keys.GENERAL_ARCHITECTURE, arch)
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            self.add_uint32(Keys.GENERAL_ALIGNMENT, alignment)

    # -- metadata ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._written:
            raise RuntimeError("GGUFWriter: the file was already written")

    def _check_key(self, key: str) -> None:
        self._check_open()
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if not key:
            raise ValueError("empty key")
        if key in self._kv:
            raise ValueError(f"duplicate key {key!r}")

    def add_value(
        self,
        key: str,
        value: Any,
        vtype: GGUFValueType,
        elem_type: GGUFValueType | None = None,
    ) -> None:
        """Add ``key`` with ``value`` of type ``vtype`` (``elem_type`` for arrays, optional)."""
        self._check_key(key)
        vtype = VT(vtype)
        where = f"key {key!r}"
        if vtype == VT.ARRAY:
            payload = _pack_array(value, elem_type, where)
        else:
            if elem_type is not None:
                raise ValueError(f"{where}: elem_type is only for arrays")
            payload = _pack_scalar(value, vtype, where)
        if key == Keys.GENERAL_ALIGNMENT:
            if vtype != VT.UINT32:
                raise ValueError(f"{where}: must be UINT32, got {vtype.name}")
            if value == 0 or value & (value - 1) or value > MAX_ALIGNMENT:
                raise ValueError(f"{where}: {value} is not a power of two <= {MAX_ALIGNMENT}")
            self.alignment = int(value)
        self._kv[key] = struct.pack("<I", vtype) + payload

    def add_uint8(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.UINT8)

    def add_int8(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.INT8)

    def add_uint16(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.UINT16)

    def add_int16(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.INT16)

    def add_uint32(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.UINT32)

    def add_int32(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.INT32)

    def add_uint64(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.UINT64)

    def add_int64(self, key: str, value: int) -> None:
        self.add_value(key, value, VT.INT64)

    def add_float32(self, key: str, value: float) -> None:
        self.add_value(key, value, VT.FLOAT32)

    def add_float64(self, key: str, value: float) -> None:
        self.add_value(key, value, VT.FLOAT64)

    def add_bool(self, key: str, value: bool) -> None:
        self.add_value(key, value, VT.BOOL)

    def add_string(self, key: str, value: str | bytes) -> None:
        """A string; ``str`` is encoded UTF-8 (surrogateescape), ``bytes`` written as is."""
        self.add_value(key, value, VT.STRING)

    def add_array(
        self, key: str, values: Sequence[Any] | np.ndarray, elem_type: GGUFValueType | None = None
    ) -> None:
        """An array. Without ``elem_type`` it is inferred: numpy dtype, bool, str, int (INT32,
        else INT64, else UINT64), float (FLOAT32), nested sequences (ARRAY)."""
        self.add_value(key, values, VT.ARRAY, elem_type)

    # -- tensors -------------------------------------------------------------------------

    def _check_tensor_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty str, got {name!r}")
        if len(name.encode("utf-8", "surrogateescape")) >= GGML_MAX_NAME:
            raise ValueError(f"tensor name {name!r} is {GGML_MAX_NAME} bytes or longer")
        if name in self._tensors:
            raise ValueError(f"duplicate tensor name {name!r}")

    @staticmethod
    def _check_shape(name: str, ggml_type: GGMLType, shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(int(d) for d in shape)
        if len(shape) > GGML_MAX_DIMS or any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: invalid shape {shape}")
        ne0 = shape[0] if shape else 1
        block_size = GGML_TYPES[ggml_type].block_size
        if ne0 % block_size:
            raise ValueError(
                f"tensor {name!r}: ne[0] = {ne0} is not a multiple of the {ggml_type.name} "
                f"block size {block_size}"
            )
        return shape

    def add_tensor(
        self,
        name: str,
        data: np.ndarray,
        ggml_type: GGMLType | int | None = None,
        shape: Sequence[int] | None = None,
    ) -> None:
        """Add a tensor.

        Without ``ggml_type`` the type follows the dtype (float32/16/64, int8/16/32/64).
        ``shape`` is the GGUF shape (``shape[0]`` = row length); without it, it is
        ``data.shape[::-1]``; uint8 data (required for quantized types, allowed for any) is
        raw bytes whose last axis is one row. BF16 takes uint16 bits. The byte size must match
        shape and type.
        """
        self._check_open()
        self._check_tensor_name(name)
        if not isinstance(data, np.ndarray):
            raise TypeError(f"tensor {name!r}: data must be a numpy array")
        if ggml_type is None:
            ggml_type = _DTYPE_TO_GGML.get(data.dtype.newbyteorder("="))
            if ggml_type is None:
                raise TypeError(f"tensor {name!r}: pass ggml_type for dtype {data.dtype}")
        ggml_type = GGMLType(ggml_type)
        info = GGML_TYPES[ggml_type]
        kinds = _GGML_DTYPE_KINDS.get(ggml_type)
        if kinds is not None and data.dtype != np.uint8:
            kind, itemsize = kinds
            if data.dtype.kind not in kind or data.dtype.itemsize != itemsize:
                raise TypeError(f"tensor {name!r}: {ggml_type.name} data cannot be {data.dtype}")
            if shape is None:
                shape = data.shape[::-1]
        elif shape is None:
            # Raw bytes (uint8 data, any type): the last axis holds the bytes of one row.
            if data.dtype.itemsize != 1 or data.ndim == 0:
                raise ValueError(f"tensor {name!r}: pass shape for {ggml_type.name} data")
            if data.shape[-1] % info.type_size:
                raise ValueError(
                    f"tensor {name!r}: row of {data.shape[-1]} bytes is not a whole number "
                    f"of {ggml_type.name} blocks of {info.type_size} bytes"
                )
            ne0 = data.shape[-1] // info.type_size * info.block_size
            shape = (ne0, *data.shape[-2::-1])
        shape = self._check_shape(name, ggml_type, shape)
        nbytes = tensor_nbytes(ggml_type, shape)
        if data.nbytes != nbytes:
            raise ValueError(
                f"tensor {name!r}: {ggml_type.name} shape {shape} takes {nbytes} bytes, "
                f"data has {data.nbytes}"
            )
        self._tensors[name] = _PendingTensor(name, ggml_type, shape, data, nbytes)

    def add_tensor_lazy(
        self,
        name: str,
        ggml_type: GGMLType | int,
        shape: Sequence[int],
        load: Callable[[], np.ndarray],
    ) -> None:
        """Add a tensor whose data ``load()`` returns during ``write()`` (called once).

        ``shape`` is the GGUF shape; the loaded array must hold exactly the bytes that shape
        and type take (uint8 raw bytes, or the dtype of ``ggml_type`` for float/int types).
        """
        self._check_open()
        self._check_tensor_name(name)
        if not callable(load):
            raise TypeError(f"tensor {name!r}: load must be callable")
        ggml_type = GGMLType(ggml_type)
        shape = self._check_shape(name, ggml_type, shape)
        nbytes = tensor_nbytes(ggml_type, shape)
        self._tensors[name] = _PendingTensor(name, ggml_type, shape, load, nbytes)

    # -- output --------------------------------------------------------------------------

    def _pad(self, out: IO[bytes], pos: int) -> int:
        pad = -pos % self.alignment
        out.write(b"\0" * pad)
        return pos + pad

    def _write_to(self, out: IO[bytes]) -> None:
        head = GGUF_MAGIC + struct.pack(
            "<IQQ", GGUF_WRITE_VERSION, len(self._tensors), len(self._kv)
        )
        out.write(head)
        pos = len(head)
        for key, payload in self._kv.items():
            chunk = _pack_string(key) + payload
            out.write(chunk)
            pos += len(chunk)
        rel = 0
        for t in self._tensors.values():
            chunk = _pack_string(t.name) + struct.pack("<I", len(t.shape))
            chunk += struct.pack(f"<{len(t.shape)}Q", *t.shape)
            chunk += struct.pack("<IQ", t.type, rel)
            out.write(chunk)
            pos += len(chunk)
            rel += -(-t.nbytes // self.alignment) * self.alignment
        pos = self._pad(out, pos)
        for t in self._tensors.values():
            arr = t.data() if callable(t.data) else t.data
            if arr.nbytes != t.nbytes:
                raise ValueError(
                    f"tensor {t.name!r}: loaded {arr.nbytes} bytes, its header says {t.nbytes}"
                )
            # Little-endian, contiguous; no copy when the data already is.
            arr = np.ascontiguousarray(arr)
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            out.write(arr.reshape(-1).view(np.uint8).data)
            pos = self._pad(out, pos + t.nbytes)

    def to_bytes(self) -> bytes:
        """The whole file in memory (for tests and small fixtures)."""
        buf = io.BytesIO()
        self._write_to(buf)
        return buf.getvalue()

    def write(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the file atomically: temp file in the same directory, fsync, rename."""
        self._check_open()
        if path is not None:
            self.path = os.fspath(path)
        if self.path is None:
            raise ValueError("GGUFWriter.write: no path given")
        final = os.path.abspath(self.path)
        directory, base = os.path.split(final)
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as out:
                self._write_to(out)
                out.flush()
                os.fsync(out.fileno())
            # Keep the mode of the file being replaced (mkstemp's is 0600).
            try:
                mode = os.stat(final).st_mode & 0o7777
            except FileNotFoundError:
                mode = 0o644
            os.chmod(tmp, mode)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(directory)
        self._written = True


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (best effort: not every platform can fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
