"""The LoRA term of a projection, fused: ``out = y + s * (x @ A.T) @ B.T``.

A LoRA adapter adds ``s * B (A x)`` to a base projection ``W x``, with ``A`` of ``r`` rows
of ``k`` inputs and ``B`` of ``m`` rows of ``r`` inputs, ``r`` small (8 to 64). Both are
F32 or F16 rows, as llama.cpp's ``convert_lora_to_gguf`` writes them. Two matmuls, a scale
and an add op by op would cost four short ops per projection; here it is one pass over the
adapter's rows, called by ``CPUBackend.lora_add`` and by the compiled decode step (``step``),
so both give the same floats.

Each dot is the float row dot the CPU backend's matmul uses (``kernels_float``: float32
sums per chunk of 32, float64 across chunks), so a F32/F16 LoRA term is what
``matmul(matmul(x, A), B)`` would give row by row.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from picollama.backends.cpu.kernels_float import vdot_f16, vdot_f32
from picollama.gguf.constants import GGMLType

__all__ = ["LORA_TYPES", "lora_add", "lora_rows"]

LORA_TYPES = (GGMLType.F32, GGMLType.F16)

# below this many adapter weights per row of x, one thread does it all (a parallel region
# costs more than it saves on a rank-16 adapter of a small model)
_PARALLEL_MIN_WORK = 1 << 20


@nb.njit(inline="always")
def _dot(x, w, row, k, f16):
    if f16:
        return vdot_f16(x, w, row, k)
    return vdot_f32(x, w, row, k)


@nb.njit(cache=True)
def _rows_serial(x, a, a_f16, b, b_f16, s, y, out):
    k, r, m = x.shape[1], a.shape[0], b.shape[0]
    t = np.empty(r, np.float32)
    for i in range(x.shape[0]):
        xi = x[i]
        for j in range(r):
            t[j] = np.float32(_dot(xi, a, j, k, a_f16))
        for o in range(m):
            out[i, o] = y[i, o] + s * np.float32(_dot(t, b, o, r, b_f16))


@nb.njit(cache=True, parallel=True)
def _rows_parallel(x, a, a_f16, b, b_f16, s, y, out):
    k, r, m = x.shape[1], a.shape[0], b.shape[0]
    t = np.empty((x.shape[0], r), np.float32)
    for i in prange(x.shape[0]):
        for j in range(r):
            t[i, j] = np.float32(_dot(x[i], a, j, k, a_f16))
    for i in range(x.shape[0]):
        ti = t[i]
        for o in prange(m):
            out[i, o] = y[i, o] + s * np.float32(_dot(ti, b, o, r, b_f16))


@nb.njit(cache=True)
def lora_rows(x, a, a_f16, b, b_f16, s, y, out):
    """``out = y + s * (x @ A.T) @ B.T``; x (n, k) and y, out (n, m) float32, ``a`` and ``b``
    the adapter's raw rows (uint8, (r, k * size) and (m, r * size)), ``*_f16`` their type."""
    work = x.shape[0] * (a.shape[0] * x.shape[1] + b.shape[0] * a.shape[0])
    if work >= _PARALLEL_MIN_WORK:
        _rows_parallel(x, a, a_f16, b, b_f16, s, y, out)
    else:
        _rows_serial(x, a, a_f16, b, b_f16, s, y, out)


def lora_add(y: np.ndarray, x: np.ndarray, a, a_type, b, b_type, s: float) -> np.ndarray:
    """The LoRA term added to ``y``, in a new array (``y`` is not written)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.ascontiguousarray(y, dtype=np.float32)
    out = np.empty_like(y)
    f16 = GGMLType.F16
    lora_rows(x, a, a_type == f16, b, b_type == f16, np.float32(s), y, out)
    return out
