"""Quantized matrix products and row lookup on the CPU, in Numba.

A weight matrix stays in its ggml form: ``w`` is uint8 of shape ``(m, row_bytes)``, a
zero-copy (often read-only) view into the model file, row ``r`` holding the ``k`` weights of
output feature ``r`` (ggml's ``ne[0] = k``, ``ne[1] = m``). Nothing here copies or writes it,
and no float copy of it is ever made: a kernel dequantizes one block (at most 256 weights)
at a time, into registers or a small stack buffer, and uses it at once.

- ``matmul(x, w, qtype, k)``: ``x @ dequant(w).T`` for x float32 ``(n, k)``. Decode
  (``n == 1``) runs the type's fused row dot (``vdot_*``), which unpacks the quants inside
  the dot product; so do a few rows (``n < TILED_MIN_ROWS``), one row of x after another
  while the weight row is in L1. Prefill dequantizes each block of GROUP weight rows once
  per tile of TILE_ROWS rows of x and multiplies it into GROUP * TILE_ROWS accumulators
  held in SIMD registers.
- ``get_rows(w, ids, qtype, k)``: dequantized rows ``ids`` (an embedding lookup).

Numerics. The dequantized weights are bit-identical to ggml's and gguf-py's: the same
float32 operations in the same order, never fused or re-associated (intrinsics.fmul). Each
block's dot product is summed in float32 in any order (the kernels are compiled with
``reassoc``, which lets LLVM spread the sum over SIMD lanes, and ``contract``, which lets
it use FMAs) and the block sums are added in float64. For one output the error is
therefore at most about ``(block + 1) * 2**-24 * sum_j |x_j * w_j|`` (block: 32 weights,
or 256 for the k-quants; the +1 is the final rounding to float32).

Threads: one Numba parallel region per call, over ranges of output rows, on the thread
count the caller set with ``numba.set_num_threads`` (on one thread below SERIAL_WORK). Each
type has its own kernels, compiled on first use and cached on disk (``cache=True``), so a
model compiles only the types it holds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from picollama.backends.cpu import intrinsics, kernels_float, kernels_k, kernels_legacy
from picollama.backends.cpu.intrinsics import FASTMATH, stack_f32, stack_f64
from picollama.backends.cpu.kernels_float import (
    FLOAT_CHUNK,
    deq_bf16,
    deq_f16,
    deq_f32,
    vdot_bf16,
    vdot_f16,
    vdot_f32,
)
from picollama.backends.cpu.kernels_k import (
    deq_iq4_xs,
    deq_q2_k,
    deq_q3_k,
    deq_q4_k,
    deq_q5_k,
    deq_q6_k,
    deq_q8_k,
    vdot_iq4_xs,
    vdot_q2_k,
    vdot_q3_k,
    vdot_q4_k,
    vdot_q5_k,
    vdot_q6_k,
    vdot_q8_k,
)
from picollama.backends.cpu.kernels_legacy import (
    deq_iq4_nl,
    deq_q4_0,
    deq_q4_1,
    deq_q5_0,
    deq_q5_1,
    deq_q8_0,
    deq_q8_1,
    vdot_iq4_nl,
    vdot_q4_0,
    vdot_q4_1,
    vdot_q5_0,
    vdot_q5_1,
    vdot_q8_0,
    vdot_q8_1,
)
from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = [
    "SUPPORTED_TYPES",
    "TILE_ROWS",
    "GROUP",
    "TILED_MIN_ROWS",
    "SERIAL_WORK",
    "supports",
    "block_len",
    "matmul",
    "get_rows",
]

# Block dequantizer and fused matrix-vector row dot of each type.
_DEQ = {
    GGMLType.F32: deq_f32,
    GGMLType.F16: deq_f16,
    GGMLType.BF16: deq_bf16,
    GGMLType.Q4_0: deq_q4_0,
    GGMLType.Q4_1: deq_q4_1,
    GGMLType.Q5_0: deq_q5_0,
    GGMLType.Q5_1: deq_q5_1,
    GGMLType.Q8_0: deq_q8_0,
    GGMLType.Q8_1: deq_q8_1,
    GGMLType.Q2_K: deq_q2_k,
    GGMLType.Q3_K: deq_q3_k,
    GGMLType.Q4_K: deq_q4_k,
    GGMLType.Q5_K: deq_q5_k,
    GGMLType.Q6_K: deq_q6_k,
    GGMLType.Q8_K: deq_q8_k,
    GGMLType.IQ4_NL: deq_iq4_nl,
    GGMLType.IQ4_XS: deq_iq4_xs,
}
_VDOT = {
    GGMLType.F32: vdot_f32,
    GGMLType.F16: vdot_f16,
    GGMLType.BF16: vdot_bf16,
    GGMLType.Q4_0: vdot_q4_0,
    GGMLType.Q4_1: vdot_q4_1,
    GGMLType.Q5_0: vdot_q5_0,
    GGMLType.Q5_1: vdot_q5_1,
    GGMLType.Q8_0: vdot_q8_0,
    GGMLType.Q8_1: vdot_q8_1,
    GGMLType.Q2_K: vdot_q2_k,
    GGMLType.Q3_K: vdot_q3_k,
    GGMLType.Q4_K: vdot_q4_k,
    GGMLType.Q5_K: vdot_q5_k,
    GGMLType.Q6_K: vdot_q6_k,
    GGMLType.Q8_K: vdot_q8_k,
    GGMLType.IQ4_NL: vdot_iq4_nl,
    GGMLType.IQ4_XS: vdot_iq4_xs,
}

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(_DEQ)

# Prefill: x is cut into tiles of TILE_ROWS rows, stored transposed (k, TILE_ROWS), so one
# weight meets a tile's rows in two SIMD registers; GROUP weight rows are dequantized
# together, so each value of x loaded serves GROUP multiply-adds. A tile of 32 rows of
# k = 4096 floats is 512 KiB, half a core's L2.
TILE_ROWS = 32
GROUP = 4
# Fewer rows of x than this (decode, or speculative decoding's few draft tokens) take the
# fused row dot of each row of x in turn: the weight row stays in L1 meanwhile, and the
# fused dot is fast enough that below about 8 rows this beats padding a tile to 32 rows.
TILED_MIN_ROWS = 8

# Below this much work (weight bytes times rows of x) a call runs on one thread: a parallel
# region costs a couple of microseconds when the other threads are spinning, and tens when
# they sleep or the machine is busy, while 64 KiB take about 13 us on one core.
SERIAL_WORK = 1 << 16

_MAX_BLOCK = 256  # no type's block is longer
_BUF_LEN = GROUP * _MAX_BLOCK  # scratch lengths (named: stack_f32 wants a literal)
_PART_LEN = GROUP * TILE_ROWS


def supports(qtype: int) -> bool:
    """Whether ``matmul`` and ``get_rows`` take weights of ggml type ``qtype``."""
    try:
        return GGMLType(qtype) in SUPPORTED_TYPES
    except ValueError:
        return False


def block_len(qtype: int) -> int:
    """Weights summed together in float32 by the kernels: the block, or 32 for float types."""
    info = GGML_TYPES[GGMLType(qtype)]
    return FLOAT_CHUNK if info.block_size == 1 else info.block_size


# ---- per-type dispatch, resolved while a kernel is compiled ----


def deq_block(qtype, w, r, b, k, dst):
    """Dequantize block ``b`` of row ``r`` into ``dst``; returns its number of weights.

    Only callable from compiled code, with ``qtype`` a compile-time constant: the overload
    below substitutes the type's ``deq_*`` while the caller is compiled.
    """
    raise NotImplementedError("deq_block is only callable from Numba-compiled code")


@overload(deq_block)
def _deq_block_overload(qtype, w, r, b, k, dst):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    deq = _DEQ[qtype.literal_value]

    def impl(qtype, w, r, b, k, dst):
        return deq(w, r, b, k, dst)

    return impl


def row_dot(qtype, x, w, r, k):
    """sum_j x[j] * dequant(w[r])[j] by the type's fused ``vdot_*`` (compiled code only)."""
    raise NotImplementedError("row_dot is only callable from Numba-compiled code")


@overload(row_dot)
def _row_dot_overload(qtype, x, w, r, k):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    vdot = _VDOT[qtype.literal_value]

    def impl(qtype, x, w, r, k):
        return vdot(x, w, r, k)

    return impl


# ---- the ways through a range of weight rows (inlined into each type's kernel) ----


@njit(inline="always")
def _rows_tiled(qtype, block, xt, w, out, k, r_lo, r_hi, buf, part, acc):
    """Prefill, with x as transposed tiles: ``xt[tile, j, i] = x[TILE_ROWS * tile + i, j]``.

    For each tile and each group of GROUP weight rows, a block of each of the rows is
    dequantized into ``buf`` (row g at ``g * block``); then each of its weights times the
    tile's TILE_ROWS values of x goes into GROUP * TILE_ROWS float32 partial sums, which
    LLVM keeps in registers (the ``i`` loop is exactly two SIMD vectors long), and the
    partial sums are added to float64 accumulators after each block. A group running past
    ``r_hi`` repeats its last row and drops the copies.
    """
    n = out.shape[0]
    n_blocks = (k + block - 1) // block
    # One view per weight row of the group, and below one per block of the tile, so that
    # the hot loop indexes with plain loop counters: Numba guards an index like
    # ``block + j`` against negative values, and the guard costs more than the FMAs.
    buf0, buf1, buf2, buf3 = buf[:block], buf[block:], buf[2 * block :], buf[3 * block :]
    for tile in range(xt.shape[0]):
        i0 = tile * TILE_ROWS
        for r0 in range(r_lo, r_hi, GROUP):
            for q in range(GROUP * TILE_ROWS):
                acc[q] = 0.0
            for b in range(n_blocks):
                count = 0
                for g in range(GROUP):
                    count = deq_block(qtype, w, min(r0 + g, r_hi - 1), b, k, buf[g * block :])
                for q in range(GROUP * TILE_ROWS):
                    part[q] = 0.0
                x_block = xt[tile, b * block : b * block + count]  # (count, TILE_ROWS)
                for j in range(count):
                    w0, w1, w2, w3 = buf0[j], buf1[j], buf2[j], buf3[j]
                    for i in range(TILE_ROWS):
                        xv = x_block[j, i]
                        part[i] += xv * w0
                        part[TILE_ROWS + i] += xv * w1
                        part[2 * TILE_ROWS + i] += xv * w2
                        part[3 * TILE_ROWS + i] += xv * w3
                for q in range(GROUP * TILE_ROWS):
                    acc[q] += part[q]
            for g in range(min(GROUP, r_hi - r0)):
                for i in range(min(TILE_ROWS, n - i0)):
                    out[i0 + i, r0 + g] = acc[g * TILE_ROWS + i]


# ---- the kernels of one type ----


def _helper_stamps() -> tuple[tuple[int, int], ...]:
    """(mtime in ns, size) of each module whose compiled code the kernels embed."""
    stamps = []
    for module in (intrinsics, kernels_float, kernels_legacy, kernels_k):
        stat = os.stat(module.__file__)
        stamps.append((stat.st_mtime_ns, stat.st_size))
    return tuple(stamps)


class _Kernels(NamedTuple):
    matmul: Callable
    get_rows: Callable


@functools.cache
def _kernels(qtype: int) -> _Kernels:
    """The kernels of one ggml type: built on first use, compiled on their first call.

    The closures capture the type and its block length as constants, so Numba prunes
    every other type's code and each type compiles only its own. Numba caches a closure on
    disk keyed by the values it captures, so a later run loads instead of compiling; as it
    checks the time stamp of this file only, not of the helper modules whose code is linked
    into the kernels, the closures capture those stamps too (an edited helper recompiles).
    """
    consts = (block_len(qtype), _helper_stamps())

    @njit(cache=True, parallel=True, fastmath=FASTMATH)
    def matmul(x, xt, w, out, k, n_tasks):
        """out = x @ dequant(w).T; task t owns a contiguous range of weight rows.

        ``xt`` holds x as transposed tiles when n >= TILED_MIN_ROWS, else it is empty.
        """
        block = consts[0]
        n = x.shape[0]
        m = w.shape[0]
        for t in prange(n_tasks):
            r_lo = t * m // n_tasks
            r_hi = (t + 1) * m // n_tasks
            buf = stack_f32(_BUF_LEN)
            part = stack_f32(_PART_LEN)
            acc = stack_f64(_PART_LEN)
            if n == 1:
                x0 = x[0]
                for r in range(r_lo, r_hi):
                    out[0, r] = row_dot(qtype, x0, w, r, k)
            elif n < TILED_MIN_ROWS:
                for r in range(r_lo, r_hi):
                    for i in range(n):
                        out[i, r] = row_dot(qtype, x[i], w, r, k)
            else:
                _rows_tiled(qtype, block, xt, w, out, k, r_lo, r_hi, buf, part, acc)

    @njit(cache=True)
    def get_rows(w, ids, out, k):
        """out[i] = dequant(w[ids[i]]); the caller has checked the ids."""
        block = consts[0]
        n_blocks = (k + block - 1) // block
        for i in range(ids.shape[0]):
            for b in range(n_blocks):
                deq_block(qtype, w, ids[i], b, k, out[i, b * block :])

    return _Kernels(matmul, get_rows)


# ---- public API ----


@functools.cache
def _layout(qtype: int, k: int) -> tuple[int, int, int]:
    """(type id, bytes a row, block_len) for rows of ``k`` weights of ``qtype``; validates."""
    if not supports(qtype):
        raise ValueError(f"CPU kernels do not support ggml type {qtype!r}")
    info = GGML_TYPES[GGMLType(qtype)]
    if k <= 0 or k % info.block_size:
        raise ValueError(f"k={k} is not a positive multiple of the {info.name} block")
    return int(info.type), k // info.block_size * info.type_size, block_len(qtype)


def _check_weights(w: np.ndarray, qtype: int, k: int) -> tuple[int, np.ndarray]:
    """Validate ``w`` against ``qtype`` and ``k``; return the type id and a read-only view.

    Read-only so that every caller hits the same compiled kernel (Numba compiles writable
    and read-only arrays separately), and so that nothing can write into the map.
    """
    type_id, row_bytes, _ = _layout(int(qtype), int(k))
    if w.dtype != np.uint8 or w.ndim != 2 or w.shape[1] != row_bytes:
        name = GGMLType(type_id).name
        raise ValueError(
            f"{name} weights with k={k} must be uint8 (m, {row_bytes}); got {w.dtype} {w.shape}"
        )
    if not w.flags.c_contiguous:
        raise ValueError("weights must be C-contiguous (a row-major view of the tensor data)")
    if w.flags.writeable:
        w = w.view()
        w.flags.writeable = False
    return type_id, w


def _transposed_tiles(x: np.ndarray, k_padded: int) -> np.ndarray:
    """x (n, k) as zero-padded transposed tiles: (ceil(n / TILE_ROWS), k_padded, TILE_ROWS)."""
    n, k = x.shape
    n_tiles = -(-n // TILE_ROWS)
    xt = np.zeros((n_tiles, k_padded, TILE_ROWS), dtype=np.float32)
    for tile in range(n_tiles):
        rows = x[tile * TILE_ROWS : (tile + 1) * TILE_ROWS]
        xt[tile, :k, : rows.shape[0]] = rows.T
    return xt


_NO_TILES = np.zeros((0, 0, 0), dtype=np.float32)


def matmul(
    x: np.ndarray, w: np.ndarray, qtype: int, k: int, out: np.ndarray | None = None
) -> np.ndarray:
    """``x @ dequant(w).T``: x float32 ``(n, k)``, w uint8 ``(m, row_bytes)`` -> ``(n, m)``.

    ``out`` (optional, default: a new array) is a C-contiguous float32 ``(n, m)`` array to
    write the result to.
    """
    type_id, w = _check_weights(w, qtype, k)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (n, {k}); got {x.shape}")
    n, m = x.shape[0], w.shape[0]
    if out is None:
        out = np.empty((n, m), dtype=np.float32)
    elif out.shape != (n, m) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {(n, m)}; got {out.dtype} {out.shape}")
    if n == 0 or m == 0:
        return out
    threads = numba.get_num_threads()
    serial = threads > 1 and w.nbytes * n < SERIAL_WORK
    workers = 1 if serial else threads
    if n >= TILED_MIN_ROWS:
        block = _layout(type_id, k)[2]
        xt = _transposed_tiles(x, -(-k // block) * block)
        # at most a task per group of weight rows; a few per thread even out the load
        n_tasks = max(1, min(-(-m // GROUP), 4 * workers))
    else:
        xt = _NO_TILES
        n_tasks = max(1, min(m, 4 * workers))
    kernel = _kernels(type_id).matmul
    if not serial:
        kernel(x, xt, w, out, k, n_tasks)
        return out
    # a tiny product, on one thread (Numba won't cache a kernel that sets its thread count)
    numba.set_num_threads(1)
    try:
        kernel(x, xt, w, out, k, n_tasks)
    finally:
        numba.set_num_threads(threads)
    return out


def get_rows(w: np.ndarray, ids: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """Rows ``ids`` of the quantized matrix ``w`` (uint8 ``(m, row_bytes)``), dequantized.

    Returns float32 ``(len(ids), k)``, bit-identical to dequantizing those rows with the
    numpy reference. Raises ``IndexError`` for an id outside ``[0, m)``.
    """
    type_id, w = _check_weights(w, qtype, k)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    m = w.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= m):
        bad = ids[(ids < 0) | (ids >= m)][0]
        raise IndexError(f"row id {bad} out of range for a matrix of {m} rows")
    out = np.empty((ids.size, k), dtype=np.float32)
    if ids.size:
        _kernels(type_id).get_rows(w, ids, out, k)
    return out
