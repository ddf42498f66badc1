"""Where a weight's bytes live on the device, and the CUDA sources that read them.

A ggml weight is a sequence of blocks (``Q6_K``: 210 bytes per 256 weights). On the device
the same bytes are regrouped field by field ("field-major"): field f of every block is
stored contiguously, starting on a 256-byte boundary, so that the kernels read each field
with aligned 16-byte loads (a 210-byte block allows only 2-byte ones). Q4_K's and Q5_K's
first 16 bytes (d, dmin and the 12 bytes of 6-bit scales and mins) stay one field: a
kernel takes a block's scales with one 16-byte load. Nothing is
dequantized or re-rounded: the device copy holds the file's bytes, and as many of them
(Q8_K's ``bsums``, which no kernel reads, are left out).

The field tables below mirror the ``SZ0..SZ3`` constants of each type's struct in
``quant.cu``: ``quant_source`` passes them in as macros and a ``static_assert`` there
refuses to compile if the two disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from picollama.backends.base import BackendError
from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = [
    "FIELDS",
    "SUPPORTED_TYPES",
    "Q8DOT_TYPES",
    "REGION_ALIGN",
    "DeviceLayout",
    "define_value",
    "device_layout",
    "chunk_block",
    "ops_source",
    "quant_source",
    "RING_TYPES",
    "ring_source",
]

REGION_ALIGN = 256

# type -> (weights per block as the kernels see it, [(byte offset in the ggml block, size)])
# Float types are handled as "blocks" of 32 values.
FIELDS: dict[GGMLType, tuple[int, tuple[tuple[int, int], ...]]] = {
    GGMLType.F32: (32, ((0, 128),)),
    GGMLType.F16: (32, ((0, 64),)),
    GGMLType.BF16: (32, ((0, 64),)),
    GGMLType.Q4_0: (32, ((0, 2), (2, 16))),  # d | qs
    GGMLType.Q4_1: (32, ((0, 4), (4, 16))),  # d, m | qs
    GGMLType.Q5_0: (32, ((0, 2), (2, 4), (6, 16))),  # d | qh | qs
    GGMLType.Q5_1: (32, ((0, 4), (4, 4), (8, 16))),  # d, m | qh | qs
    GGMLType.Q8_0: (32, ((0, 2), (2, 32))),  # d | qs
    GGMLType.Q8_1: (32, ((0, 4), (4, 32))),  # d, s | qs
    GGMLType.Q2_K: (256, ((0, 16), (16, 64), (80, 4))),  # scales | qs | d, dmin
    GGMLType.Q3_K: (256, ((0, 32), (32, 64), (96, 12), (108, 2))),  # hmask | qs | scales | d
    GGMLType.Q4_K: (256, ((0, 16), (16, 128))),  # d, dmin, scales | qs
    GGMLType.Q5_K: (256, ((0, 16), (16, 32), (48, 128))),  # d, dmin, scales | qh | qs
    GGMLType.Q6_K: (256, ((0, 128), (128, 64), (192, 16), (208, 2))),  # ql | qh | scales | d
    GGMLType.Q8_K: (256, ((0, 4), (4, 256))),  # d | qs (bsums not uploaded)
    GGMLType.IQ4_NL: (32, ((0, 2), (2, 16))),  # d | qs
    GGMLType.IQ4_XS: (256, ((0, 2), (2, 2), (4, 4), (8, 128))),  # d | scales_h | scales_l | qs
}

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(FIELDS)

# types with an int8-activation (dp4a) matvec kernel, mmvq.cu; the others use quant.cu's
Q8DOT_TYPES: frozenset[GGMLType] = frozenset(
    {GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K}
)


def _align(n: int) -> int:
    return (n + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN


@dataclass(frozen=True)
class DeviceLayout:
    """The device copy of a weight of ``n_blocks`` blocks: its regions and total size."""

    qtype: GGMLType
    n_blocks: int
    regions: tuple[tuple[int, int, int], ...]  # (device offset, offset in block, size)
    nbytes: int


def chunk_block(qtype: GGMLType) -> int:
    """Weights per block as the kernels count them (32 for the float types)."""
    return FIELDS[GGMLType(qtype)][0]


def device_layout(qtype: GGMLType, k: int, m: int) -> DeviceLayout:
    """The field-major layout of an ``m`` x ``k`` weight of ``qtype``."""
    qtype = GGMLType(qtype)
    block, fields = FIELDS[qtype]
    n_blocks = m * (k // block)
    regions, offset = [], 0
    for src, size in fields:
        regions.append((offset, src, size))
        offset += _align(size * n_blocks)
    return DeviceLayout(qtype, n_blocks, tuple(regions), offset)


def ggml_block_bytes(qtype: GGMLType) -> int:
    """Bytes of one kernel block in the file (32 values for the float types)."""
    info = GGML_TYPES[GGMLType(qtype)]
    return info.type_size * (chunk_block(qtype) // info.block_size)


_HERE = Path(__file__).parent


def check_weight(name: str, ggml_type, shape, data, backend: str):
    """Validate a weight for a GPU backend (CUDA and OpenCL share this layout).

    Returns ``(qtype, k, m, layout, raw bytes)``; a ``BackendError`` names the tensor when
    its type is unknown or unsupported, its rows do not fit the kernels' block, or its
    data has the wrong size."""
    try:
        qtype = GGMLType(ggml_type)
    except ValueError:
        raise BackendError(f"tensor '{name}': unknown ggml type {ggml_type}") from None
    if qtype not in SUPPORTED_TYPES:
        raise BackendError(
            f"tensor '{name}': type {qtype.name} is not supported by the {backend} backend"
        )
    k = int(shape[0])
    m = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    block = chunk_block(qtype)
    if k % block:
        raise BackendError(
            f"tensor '{name}': rows of {k} weights are not a multiple of {block}, "
            f"which the {backend} kernels need"
        )
    lay = device_layout(qtype, k, m)
    block_bytes = ggml_block_bytes(qtype)
    raw = np.asarray(data).reshape(-1)
    if raw.nbytes != lay.n_blocks * block_bytes:
        raise BackendError(
            f"tensor '{name}': {raw.nbytes} bytes of data for a {qtype.name} weight of "
            f"{k} x {m} (expected {lay.n_blocks * block_bytes})"
        )
    return qtype, k, m, lay, raw


@cache
def _read(name: str) -> str:
    return (_HERE / name).read_text()


# build variants for experiments and their tests: "NAME=VALUE,NAME=VALUE" in this variable
# puts a ``#define`` of each ahead of every kernel source (the kernels' options, such as
# ops.cu's ATT_VPRE, are ``#ifndef`` defaults); ``bench_synthetic --define`` sets it
DEFINES_ENV = "PICOLLAMA_CUDA_DEFINES"


def build_defines() -> str:
    """The ``#define`` lines of ``PICOLLAMA_CUDA_DEFINES`` (empty when unset)."""
    lines = []
    for item in os.environ.get(DEFINES_ENV, "").split(","):
        name, _, value = item.strip().partition("=")
        if not name:
            continue
        if not name.isidentifier():
            raise BackendError(f"{DEFINES_ENV}: {name!r} is not a macro name")
        lines.append(f"#define {name} {value or 1}\n")
    return "".join(lines)


def define_value(name: str, default: int) -> int:
    """The value ``PICOLLAMA_CUDA_DEFINES`` gives macro ``name`` (1 if named without one),
    or ``default``: for the host's side of a build variant (e.g. MVQ_SSQ's links)."""
    for item in os.environ.get(DEFINES_ENV, "").split(","):
        key, eq, value = item.strip().partition("=")
        if key == name:
            try:
                return int(value) if eq else 1
            except ValueError:
                raise BackendError(f"{DEFINES_ENV}: {name}={value!r} is not an integer") from None
    return default


def ops_source() -> str:
    """CUDA C of the non-matmul ops (common helpers prepended)."""
    return build_defines() + _read("common.cuh") + "\n" + _read("ops.cu")


def _type_defines(qtype: GGMLType) -> list[str]:
    """The macros quant.cu is built with for ``qtype``: its name and field sizes."""
    block, fields = FIELDS[qtype]
    sizes = [size for _, size in fields] + [0] * (4 - len(fields))
    defines = [f"#define QTYPE_{qtype.name} 1", f"#define LAYOUT_BLOCK {block}"]
    return defines + [f"#define LAYOUT_SZ{i} {size}" for i, size in enumerate(sizes)]


def quant_source(qtype: GGMLType) -> str:
    """CUDA C of the matmul, dequantize and get_rows kernels of ``qtype`` (and, for the
    ``Q8DOT_TYPES``, the int8-activation matvec of ``mmvq.cu``)."""
    qtype = GGMLType(qtype)
    parts = [
        build_defines() + "\n".join(_type_defines(qtype)),
        _read("common.cuh"),
        _read("quant.cu"),
    ]
    if qtype in Q8DOT_TYPES:
        parts.append(_read("mmvq.cu"))
    return "\n".join(parts)


# the weight types of ring.cu, in the order of its RingWeight.qtype codes (ring.py), and
# the namespace each one's int8 matvec code is built in
RING_TYPES: dict[GGMLType, str] = {GGMLType.Q4_K: "q4k", GGMLType.Q6_K: "q6k"}

# ring.cu's weight loads: from a tile in shared memory, in place of common.cuh's __ldg
# ones. Said outright (ld.shared): through a plain pointer the compiler loses the address
# space on the way (the slot's field pointers are kept in local memory) and emits generic
# loads
_SHARED_LOADS = """
__device__ __forceinline__ u32 ld_u32(const u8* p) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ u16 ld_u16(const u8* p) {
    u16 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ uint2 ld_u64(const u8* p) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ uint4 ld_u128(const u8* p) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_u32(p)));
    return v;
}
"""


def ring_source() -> str:
    """CUDA C of ``ring.cu``'s persistent matvec kernel: quant.cu and mmvq.cu built once for
    each of the ``RING_TYPES`` in a namespace of its own (without their kernels, and with
    weight loads that read shared memory), then ring.cu, which multiplies tiles of both."""
    parts = [build_defines() + "#define RING_BUILD 1", _read("common.cuh"), _read("bulk.cuh")]
    for qtype, ns in RING_TYPES.items():
        defines = _type_defines(qtype)
        undefs = [f"#undef {line.split()[1]}" for line in defines]
        parts += [f"namespace {ns} {{", _SHARED_LOADS, "\n".join(defines), _read("quant.cu"),
                  _read("mmvq.cu"), "\n".join(undefs), f"}}  // namespace {ns}"]  # fmt: skip
    parts.append(_read("ring.cu"))
    return "\n".join(parts)
