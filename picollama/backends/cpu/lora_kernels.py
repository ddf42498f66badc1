"""The LoRA term of a projection, fused: ``out = y + s * (x @ A.T) @ B.T``.

A LoRA adapter adds ``s * B (A x)`` to a base projection ``W x``, with ``A`` of ``r`` rows
of ``k`` inputs and ``B`` of ``m`` rows of ``r`` inputs, ``r`` small (8 to 64). Both are
F32, F16 or BF16, as llama.cpp's ``convert_lora_to_gguf`` writes them. Two matmuls, a scale and an
add op by op would cost four short ops per projection; here it is one pass over the
adapter's rows, called by ``CPUBackend.lora_add`` and by the compiled decode step (``step``),
so both give the same floats.

``t = s * A x`` is ``r`` row dots of ``k`` terms, four rows per pass over x. ``B t`` would
be ``m`` dots of only ``r`` terms each, where the per-row overhead costs more than the
arithmetic (3-4x a streaming pass on a rank-16 SmolLM2 adapter); so ``B`` is kept
transposed, ``r`` rows of ``m`` (``transpose_b``, a copy of the adapter made once at load),
and ``B t`` is vector updates of ``m`` floats, four rows of B's transpose per pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np
from numba import prange

from picollama.backends.base import Weight
from picollama.backends.cpu.intrinsics import (
    FASTMATH,
    f32_from_bits,
    load_f16,
    load_f32,
    load_u16,
)
from picollama.gguf.constants import GGMLType

__all__ = ["LORA_TYPES", "LoraB", "transpose_b", "lora_add", "lora_rows"]

LORA_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_F16 = int(GGMLType.F16)
_BF16 = int(GGMLType.BF16)

# from this many adapter weights times rows of x on, the rows run in parallel (a parallel
# region costs more than it saves on one token of a rank-16 adapter of a small model)
_PARALLEL_MIN_WORK = 1 << 20
_F32 = np.float32


@dataclass
class LoraB(Weight):
    """A lora_b weight (m rows of r) with its entries also as ``r`` rows of ``m``:
    ``t_data``, uint8 (r, m * 4) for F32 or (r, m * 2) for F16 and BF16."""

    t_data: Any = None


def transpose_b(b: Weight) -> LoraB:
    """``b`` with its transposed copy (F32, F16 or BF16)."""
    dtype = np.float32 if b.type == GGMLType.F32 else np.uint16  # BF16: its bits
    r, m = b.k, b.m
    t = np.ascontiguousarray(np.asarray(b.data).view(dtype).reshape(m, r).T)
    return LoraB(b.name, b.type, b.shape, b.data, t.view(np.uint8).reshape(r, -1))


def _make_parts(load, size):
    """``t = s * A x`` and ``out = y + B t`` (B transposed) for entries read by ``load``
    (``load_f16`` or ``load_f32``, ``size`` bytes each). Four rows of A (or of B's
    transpose) per pass over x (or out): the loads of x and out are shared, and each
    pass is long enough to run in SIMD lanes (a float32 sum per lane, ``FASTMATH``)."""

    @nb.njit(inline="always", fastmath=FASTMATH)
    def a_part(x, a, s, t):
        k, r = x.shape[0], a.shape[0]
        j = 0
        while j + 4 <= r:
            s0, s1, s2, s3 = _F32(0.0), _F32(0.0), _F32(0.0), _F32(0.0)
            for i in range(k):
                xi = x[i]
                s0 += xi * load(a, j, size * i)
                s1 += xi * load(a, j + 1, size * i)
                s2 += xi * load(a, j + 2, size * i)
                s3 += xi * load(a, j + 3, size * i)
            t[j], t[j + 1], t[j + 2], t[j + 3] = s0 * s, s1 * s, s2 * s, s3 * s
            j += 4
        while j < r:
            s0 = _F32(0.0)
            for i in range(k):
                s0 += x[i] * load(a, j, size * i)
            t[j] = s0 * s
            j += 1

    @nb.njit(inline="always", fastmath=FASTMATH)
    def b_part(t, bt, y, out):
        r, m = t.shape[0], out.shape[0]
        for o in range(m):
            out[o] = y[o]
        j = 0
        while j + 4 <= r:
            t0, t1, t2, t3 = t[j], t[j + 1], t[j + 2], t[j + 3]
            for o in range(m):
                p01 = t0 * load(bt, j, size * o) + t1 * load(bt, j + 1, size * o)
                p23 = t2 * load(bt, j + 2, size * o) + t3 * load(bt, j + 3, size * o)
                out[o] += p01 + p23
            j += 4
        while j < r:
            tj = t[j]
            for o in range(m):
                out[o] += tj * load(bt, j, size * o)
            j += 1

    return a_part, b_part


@nb.njit(inline="always")
def _load_bf16(w, row, offset):
    # a bfloat16 is the top half of a float32
    return f32_from_bits(np.uint32(load_u16(w, row, offset)) << np.uint32(16))


_a_f16, _b_f16 = _make_parts(load_f16, 2)
_a_bf16, _b_bf16 = _make_parts(_load_bf16, 2)
_a_f32, _b_f32 = _make_parts(load_f32, 4)


@nb.njit(cache=True, fastmath=FASTMATH)
def _row(x, a, a_type, bt, b_type, s, y, out, t):
    """One row: ``out = y + (s * A x) @ B.T`` with ``bt`` holding B transposed; ``*_type``
    the ggml type ids (F32, F16 or BF16)."""
    if a_type == _F16:
        _a_f16(x, a, s, t)
    elif a_type == _BF16:
        _a_bf16(x, a, s, t)
    else:
        _a_f32(x, a, s, t)
    if b_type == _F16:
        _b_f16(t, bt, y, out)
    elif b_type == _BF16:
        _b_bf16(t, bt, y, out)
    else:
        _b_f32(t, bt, y, out)


@nb.njit(cache=True)
def _rows_serial(x, a, a_type, bt, b_type, s, y, out):
    t = np.empty(a.shape[0], np.float32)
    for i in range(x.shape[0]):
        _row(x[i], a, a_type, bt, b_type, s, y[i], out[i], t)


@nb.njit(cache=True, parallel=True)
def _rows_parallel(x, a, a_type, bt, b_type, s, y, out):
    for i in prange(x.shape[0]):
        t = np.empty(a.shape[0], np.float32)
        _row(x[i], a, a_type, bt, b_type, s, y[i], out[i], t)


@nb.njit(cache=True)
def lora_rows(x, a, a_type, bt, b_type, s, y, out):
    """``out = y + s * (x @ A.T) @ B.T``; x (n, k) and y, out (n, m) float32 (``out`` not
    ``y``), ``a`` A's raw rows (uint8 (r, k * size)), ``bt`` B's transposed raw rows (uint8
    (r, m * size)), ``*_type`` their ggml type ids (F32, F16 or BF16)."""
    work = x.shape[0] * a.shape[0] * (x.shape[1] + out.shape[1])
    if work >= _PARALLEL_MIN_WORK and x.shape[0] > 1:
        _rows_parallel(x, a, a_type, bt, b_type, s, y, out)
    else:
        _rows_serial(x, a, a_type, bt, b_type, s, y, out)


def lora_add(y: np.ndarray, x: np.ndarray, a: Weight, b: LoraB, s: float) -> np.ndarray:
    """The LoRA term added to ``y``, in a new array (``y`` is not written)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.ascontiguousarray(y, dtype=np.float32)
    out = np.empty_like(y)
    lora_rows(x, a.data, int(a.type), b.t_data, int(b.type), np.float32(s), y, out)
    return out
