"""Test helpers for GGUF files: raw byte builders for hostile files, and valid fixtures.

The raw builders write exactly what they are told (any count, length, type id), so that a
test can produce each malformation on its own; ``GGUFWriter`` is used for valid files.
"""

from __future__ import annotations

import struct

import numpy as np

from picollama.gguf import GGML_TYPES, GGMLType, GGUFValueType, GGUFWriter

__all__ = [
    "u32",
    "u64",
    "gstr",
    "header",
    "kv",
    "kv_scalar",
    "kv_array",
    "tensor_info",
    "build",
    "every_value_writer",
    "every_type_writer",
    "small_valid_writer",
    "random_tensor_bytes",
]

VT = GGUFValueType


def u32(v: int) -> bytes:
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; ``length`` overrides the written length (the bytes stay as given)."""
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw) if length is None else length) + raw


def header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + u32(version) + u64(n_tensors) + u64(n_kv)


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One raw KV record: key, u32 value type, payload as given."""
    return gstr(key) + u32(vtype) + payload


_FORMATS = {
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


def _elem(vtype: GGUFValueType, value: object) -> bytes:
    if vtype == VT.STRING:
        return gstr(value)  # type: ignore[arg-type]
    return struct.pack(_FORMATS[vtype], value)


def kv_scalar(key: str, vtype: GGUFValueType, value: object) -> bytes:
    return kv(key, vtype, _elem(vtype, value))


def kv_array(key: str, elem_type: GGUFValueType, values: list, count: int | None = None) -> bytes:
    body = b"".join(_elem(elem_type, v) for v in values)
    return kv(key, VT.ARRAY, u32(elem_type) + u64(len(values) if count is None else count) + body)


def tensor_info(name: str | bytes, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    """One raw tensor info; ``shape`` in GGUF order, any values (masked to u64)."""
    return (
        gstr(name)
        + u32(len(shape))
        + b"".join(u64(d) for d in shape)
        + u32(ggml_type)
        + u64(offset)
    )


def build(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    infos: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    version: int = 3,
    alignment: int = 32,
) -> bytes:
    """Header, KVs, tensor infos, zero padding to ``alignment``, then ``data``."""
    head = header(
        len(infos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
        version,
    )
    body = head + b"".join(kvs) + b"".join(infos)
    return body + b"\0" * (-len(body) % alignment) + data


def random_tensor_bytes(
    rng: np.random.Generator, ggml_type: GGMLType, shape: tuple[int, ...]
) -> np.ndarray:
    """Random raw bytes for a tensor of GGUF ``shape``, as uint8 rows (numpy order)."""
    info = GGML_TYPES[ggml_type]
    row_bytes = shape[0] // info.block_size * info.type_size
    return rng.integers(0, 256, size=(*shape[:0:-1], row_bytes), dtype=np.uint8)


# One value of each scalar type, at the edge of its range where it has one.
SCALARS: dict[GGUFValueType, object] = {
    VT.UINT8: 255,
    VT.INT8: -128,
    VT.UINT16: 65535,
    VT.INT16: -32768,
    VT.UINT32: 2**32 - 1,
    VT.INT32: -(2**31),
    VT.FLOAT32: 0.1,
    VT.BOOL: True,
    VT.STRING: "héllo \x00 \udcff\udcfe",  # NUL and bytes that are not UTF-8
    VT.UINT64: 2**64 - 1,
    VT.INT64: -(2**63),
    VT.FLOAT64: -1.5e300,
}


def every_value_writer(path=None, alignment: int = 32) -> GGUFWriter:
    """A writer holding one scalar and one array of every value type, and nested arrays."""
    w = GGUFWriter(path, arch="llama", alignment=alignment)
    rng = np.random.default_rng(0)
    for vtype, value in SCALARS.items():
        w.add_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
    for vtype in SCALARS:
        key = f"test.array.{vtype.name.lower()}"
        if vtype == VT.STRING:
            w.add_array(key, ["a", "", "\udcff", "日本"], vtype)
        elif vtype == VT.BOOL:
            w.add_array(key, [True, False, True], vtype)
        elif vtype in (VT.FLOAT32, VT.FLOAT64):
            w.add_array(key, rng.standard_normal(5), vtype)
        else:
            w.add_array(key, [0, 1, 2, 3], vtype)
    w.add_array("test.array.empty", [], VT.INT32)
    w.add_array("test.array.nested", [[1, 2], ["x", "y"], [[True]]], VT.ARRAY)
    return w


def every_type_writer(path=None, seed: int = 0, types=None) -> GGUFWriter:
    """A writer holding a tensor of every ggml type (or of ``types``), random bytes."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch="llama")
    for ggml_type, info in GGML_TYPES.items():
        if types is not None and ggml_type not in types:
            continue
        shape = (info.block_size * 2, 3)
        w.add_tensor(
            f"t.{ggml_type.name}",
            random_tensor_bytes(rng, ggml_type, shape),
            ggml_type,
            shape=shape,
        )
    return w


def small_valid_writer(path=None) -> GGUFWriter:
    """A small file (about 1 KiB) with metadata of every type and a few tensors.

    The last tensor's size is a multiple of the alignment, so the file ends exactly where its
    data ends: truncating it anywhere must be an error.
    """
    w = GGUFWriter(path, arch="llama")
    for vtype, value in SCALARS.items():
        w.add_value(f"s.{vtype.name.lower()}", value, vtype)
    w.add_array("a.u8", np.arange(3, dtype=np.uint8))
    w.add_array("a.f32", np.arange(2, dtype=np.float32))
    w.add_array("a.bool", [True, False])
    w.add_array("a.nested", [[1], ["z"]])
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "\udcff"])
    w.add_array("tokenizer.ggml.scores", np.zeros(3, np.float32))
    w.add_array("tokenizer.ggml.token_type", np.ones(3, np.int32))
    rng = np.random.default_rng(1)
    w.add_tensor("tok.weight", rng.standard_normal((3, 4)).astype(np.float32))
    w.add_tensor("q.weight", random_tensor_bytes(rng, GGMLType.Q8_0, (32, 1)), GGMLType.Q8_0)
    w.add_tensor("empty", np.zeros((0, 2), np.float16))
    w.add_tensor("out.weight", rng.standard_normal((2, 4)).astype(np.float32))
    return w
