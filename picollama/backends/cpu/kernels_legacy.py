"""Block dequantizers and fused row dots for the 32-weight types (ggml-common.h layouts).

    Q4_0:   32 weights in 18 bytes (d f16, qs[16])           w = d * (q - 8)
    Q4_1:   32 weights in 20 bytes (d f16, m f16, qs[16])    w = d * q + m
    Q5_0:   32 weights in 22 bytes (d f16, qh[4], qs[16])    w = d * (q - 16)
    Q5_1:   32 weights in 24 bytes (d, m, qh[4], qs[16])     w = d * q + m
    Q8_0:   32 weights in 34 bytes (d f16, qs[32] int8)      w = d * q
    Q8_1:   32 weights in 36 bytes (d f16, s f16, qs[32])    w = d * q   (s = d * sum(q), unused)
    IQ4_NL: 32 weights in 18 bytes (d f16, qs[16])           w = d * KVALUES_IQ4NL[q]

In the 4-bit types byte j holds weight j in its low nibble and weight j + 16 in its high
nibble; Q5_* take bit j of the little-endian uint32 qh as bit 4 of weight j.

``deq_*(w, r, b, k, dst)`` writes block ``b`` of row ``r`` of the uint8 weight array ``w``
to ``dst[:32]`` and returns 32, with ggml's (and gguf-py's) float32 arithmetic: the same
operations in the same order, never fused (intrinsics.fmul/fadd). ``vdot_*(x, w, r, k)``
is ``sum_j x[j] * w[r, j]`` over a row of ``k`` weights, each block's weights made the same
way inline, summed in float32 per block and in float64 across blocks.

The signed ``q - 8`` and ``q - 16`` are made by sign-extending ``q ^ 8`` and ``q ^ 16``
(flipping the top bit of an n-bit field, then sign-extending it, subtracts 2**(n-1)): a
plain ``q - 8`` would be a 64-bit subtraction after Numba's integer promotion, and LLVM
would then vectorize it in 64-bit lanes, four times fewer per register.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from picollama.backends.cpu.intrinsics import (
    FASTMATH,
    fadd,
    fmul,
    load_f16_scale,
    load_i8,
    load_u8,
    load_u32,
    opaque,
    shr_u32,
)

__all__ = [
    "KVALUES_IQ4NL",
    "deq_q4_0",
    "deq_q4_1",
    "deq_q5_0",
    "deq_q5_1",
    "deq_q8_0",
    "deq_q8_1",
    "deq_iq4_nl",
    "vdot_q4_0",
    "vdot_q4_1",
    "vdot_q5_0",
    "vdot_q5_1",
    "vdot_q8_0",
    "vdot_q8_1",
    "vdot_iq4_nl",
]

_F32 = np.float32
_U8 = np.uint8
_U32 = np.uint32

# The non-linear 4-bit grid of IQ4_NL and IQ4_XS (kvalues_iq4nl in ggml-common.h).
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


@njit(inline="always")
def _n(count):
    """A loop bound equal to the constant ``count`` that LLVM won't unroll (intrinsics.opaque)."""
    return min(opaque(count), count)


@njit(inline="always")
def _f32(v):
    """float32 of a small unsigned integer; through int32 so that LLVM converts in 32-bit
    vector lanes (Numba types ``q & 15`` as 64 bits, and 64-bit lanes are half as many)."""
    return _F32(np.int32(v))


@njit(inline="always")
def _lo_minus_8(q):
    """(q & 15) - 8 as int8, for q already xor-ed with 0x88."""
    return np.int8(_U8(q << _U8(4))) >> np.int8(4)


@njit(inline="always")
def _hi_minus_8(q):
    """(q >> 4) - 8 as int8, for q already xor-ed with 0x88."""
    return np.int8(q) >> np.int8(4)


@njit(inline="always")
def _minus_16(v):
    """v - 16 as int8 for a 5-bit v already xor-ed with 16 (sign-extends bit 4)."""
    return np.int8(_U8(v << _U32(3))) >> np.int8(3)


@njit(inline="always")
def _q5(qs, qh, j):
    """The 5-bit values of weights j (< 16) and j + 16: the nibbles of qs plus bits of qh."""
    lo = _U32(qs & _U8(15)) | ((shr_u32(qh, j) & _U32(1)) << _U32(4))
    hi = _U32(qs >> _U8(4)) | ((shr_u32(qh, j + 16) & _U32(1)) << _U32(4))
    return lo, hi


# ---- dequantize one block into dst[:32] ----


@njit(cache=True)
def deq_q4_0(w, r, b, k, dst):
    o = 18 * b
    d = load_f16_scale(w, r, o)
    for j in range(_n(16)):
        q = load_u8(w, r, o + 2 + j) ^ _U8(0x88)
        dst[j] = fmul(d, _F32(_lo_minus_8(q)))
        dst[j + 16] = fmul(d, _F32(_hi_minus_8(q)))
    return 32


@njit(cache=True)
def deq_q4_1(w, r, b, k, dst):
    o = 20 * b
    d = load_f16_scale(w, r, o)
    m = load_f16_scale(w, r, o + 2)
    for j in range(_n(16)):
        q = load_u8(w, r, o + 4 + j)
        dst[j] = fadd(fmul(d, _f32(q & _U8(15))), m)
        dst[j + 16] = fadd(fmul(d, _f32(q >> _U8(4))), m)
    return 32


@njit(cache=True)
def deq_q5_0(w, r, b, k, dst):
    o = 22 * b
    d = load_f16_scale(w, r, o)
    qh = load_u32(w, r, o + 2)
    for j in range(_n(16)):
        lo, hi = _q5(load_u8(w, r, o + 6 + j), qh, j)
        dst[j] = fmul(d, _F32(_minus_16(lo ^ _U32(16))))
        dst[j + 16] = fmul(d, _F32(_minus_16(hi ^ _U32(16))))
    return 32


@njit(cache=True)
def deq_q5_1(w, r, b, k, dst):
    o = 24 * b
    d = load_f16_scale(w, r, o)
    m = load_f16_scale(w, r, o + 2)
    qh = load_u32(w, r, o + 4)
    for j in range(_n(16)):
        lo, hi = _q5(load_u8(w, r, o + 8 + j), qh, j)
        dst[j] = fadd(fmul(d, _f32(lo)), m)
        dst[j + 16] = fadd(fmul(d, _f32(hi)), m)
    return 32


@njit(cache=True)
def deq_q8_0(w, r, b, k, dst):
    o = 34 * b
    d = load_f16_scale(w, r, o)
    for j in range(_n(32)):
        dst[j] = fmul(d, _F32(load_i8(w, r, o + 2 + j)))
    return 32


@njit(cache=True)
def deq_q8_1(w, r, b, k, dst):
    o = 36 * b
    d = load_f16_scale(w, r, o)
    for j in range(_n(32)):
        dst[j] = fmul(d, _F32(load_i8(w, r, o + 4 + j)))
    return 32


@njit(cache=True)
def deq_iq4_nl(w, r, b, k, dst):
    o = 18 * b
    d = load_f16_scale(w, r, o)
    for j in range(_n(16)):
        q = load_u8(w, r, o + 2 + j)
        dst[j] = fmul(d, KVALUES_IQ4NL[q & _U8(15)])
        dst[j + 16] = fmul(d, KVALUES_IQ4NL[q >> _U8(4)])
    return 32


# ---- fused row dots (matrix-vector) ----


@njit(cache=True, fastmath=FASTMATH)
def vdot_q4_0(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 18 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        s = _F32(0.0)
        for j in range(_n(16)):
            q = load_u8(w, r, o + 2 + j) ^ _U8(0x88)
            s += x[x0 + j] * fmul(d, _F32(_lo_minus_8(q)))
            s += x[x0 + j + 16] * fmul(d, _F32(_hi_minus_8(q)))
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_q4_1(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 20 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        m = load_f16_scale(w, r, o + 2)
        s = _F32(0.0)
        for j in range(_n(16)):
            q = load_u8(w, r, o + 4 + j)
            s += x[x0 + j] * fadd(fmul(d, _f32(q & _U8(15))), m)
            s += x[x0 + j + 16] * fadd(fmul(d, _f32(q >> _U8(4))), m)
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_q5_0(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 22 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        qh = load_u32(w, r, o + 2)
        s = _F32(0.0)
        for j in range(_n(16)):
            lo, hi = _q5(load_u8(w, r, o + 6 + j), qh, j)
            s += x[x0 + j] * fmul(d, _F32(_minus_16(lo ^ _U32(16))))
            s += x[x0 + j + 16] * fmul(d, _F32(_minus_16(hi ^ _U32(16))))
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_q5_1(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 24 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        m = load_f16_scale(w, r, o + 2)
        qh = load_u32(w, r, o + 4)
        s = _F32(0.0)
        for j in range(_n(16)):
            lo, hi = _q5(load_u8(w, r, o + 8 + j), qh, j)
            s += x[x0 + j] * fadd(fmul(d, _f32(lo)), m)
            s += x[x0 + j + 16] * fadd(fmul(d, _f32(hi)), m)
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_q8_0(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 34 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        s = _F32(0.0)
        for j in range(_n(32)):
            s += x[x0 + j] * fmul(d, _F32(load_i8(w, r, o + 2 + j)))
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_q8_1(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 36 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        s = _F32(0.0)
        for j in range(_n(32)):
            s += x[x0 + j] * fmul(d, _F32(load_i8(w, r, o + 4 + j)))
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_iq4_nl(x, w, r, k):
    acc = 0.0
    for b in range(k // 32):
        o = 18 * b
        x0 = 32 * b
        d = load_f16_scale(w, r, o)
        s = _F32(0.0)
        for j in range(_n(16)):
            q = load_u8(w, r, o + 2 + j)
            s += x[x0 + j] * fmul(d, KVALUES_IQ4NL[q & _U8(15)])
            s += x[x0 + j + 16] * fmul(d, KVALUES_IQ4NL[q >> _U8(4)])
        acc += s
    return acc
