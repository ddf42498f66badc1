"""Block dequantizers and fused row dots for the 256-weight super-block types.

    Q2_K:   256 weights in 84 bytes  (scales[16], qs[64], d f16, dmin f16)
    Q3_K:   256 weights in 110 bytes (hmask[32], qs[64], scales[12], d f16)
    Q4_K:   256 weights in 144 bytes (d f16, dmin f16, scales[12], qs[128])
    Q5_K:   256 weights in 176 bytes (d f16, dmin f16, scales[12], qh[32], qs[128])
    Q6_K:   256 weights in 210 bytes (ql[128], qh[64], scales[16] int8, d f16)
    Q8_K:   256 weights in 292 bytes (d f32, qs[256] int8, bsums[16] int16, unused here)
    IQ4_XS: 256 weights in 136 bytes (d f16, scales_h u16, scales_l[4], qs[128])

(ggml-common.h layouts.) ``deq_*(w, r, b, k, dst)`` writes super-block ``b`` of row ``r``
to ``dst[:256]`` and returns 256, with the float32 operations of ggml's dequantize_row_*
(and gguf-py's): Q4_K, for one, is ``(d * sc) * q - dmin * m`` with each product and the
difference rounded to float32, never fused (intrinsics.fmul/fsub). ``vdot_*(x, w, r, k)``
is ``sum_j x[j] * w[r, j]`` over a row, making each weight the same way, summed in float32
per super-block and in float64 across them.

Both walk a super-block the same way: the sub-block scales are decoded first, by scalar
code, into a small stack array (``_*_scales``); then one loop over byte positions (``_n``;
LLVM vectorizes it, 16 lanes a register) makes every weight drawn from the bytes at a
position, the short loops inside it being unrolled. Where sub-blocks are 16 weights long,
the loop runs over 16 positions and handles positions ``jj`` and ``16 + jj`` in turn, so
that all lanes of a vector share one scale (a per-lane choice of scale keeps LLVM from
vectorizing at all). The weight formulas are the ``_*_weight(s)`` helpers, shared by the
two. Signed 3- and 6-bit values come from sign-extending the field with its top bit flipped
(``v ^ 4`` is ``v - 4`` in 3-bit two's complement), which keeps the vector lanes narrow.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from picollama.backends.cpu.intrinsics import (
    FASTMATH,
    fmul,
    fsub,
    load_f16_scale,
    load_f32,
    load_i8,
    load_u8,
    load_u16,
    opaque,
    stack_f32,
)
from picollama.backends.cpu.kernels_legacy import KVALUES_IQ4NL

__all__ = [
    "deq_q2_k",
    "deq_q3_k",
    "deq_q4_k",
    "deq_q5_k",
    "deq_q6_k",
    "deq_q8_k",
    "deq_iq4_xs",
    "vdot_q2_k",
    "vdot_q3_k",
    "vdot_q4_k",
    "vdot_q5_k",
    "vdot_q6_k",
    "vdot_q8_k",
    "vdot_iq4_xs",
]

_F32 = np.float32
_U8 = np.uint8
_I64 = np.int64


@njit(inline="always")
def _n(count):
    """A loop bound equal to the constant ``count`` that LLVM won't unroll (intrinsics.opaque)."""
    return min(opaque(count), count)


@njit(inline="always")
def _f32(v):
    """float32 of a small unsigned integer; through int32 so that LLVM converts in 32-bit
    vector lanes (Numba types ``q & 15`` as 64 bits, and 64-bit lanes are half as many)."""
    return _F32(np.int32(v))


# ---- Q2_K: 16 sub-blocks of 16; 2-bit q, 4-bit scale and min; w = (d sc) q - (dmin m) ----


@njit(inline="always")
def _q2_k_scales(w, r, o, dl, ml):
    d = load_f16_scale(w, r, o + 80)
    dmin = load_f16_scale(w, r, o + 82)
    for i in range(16):
        sc = load_u8(w, r, o + i)
        dl[i] = fmul(d, _f32(sc & _U8(15)))
        ml[i] = fmul(dmin, _f32(sc >> _U8(4)))


@njit(inline="always")
def _q2_k_weight(w, r, o, j, h, s, dl, ml, i):
    """Weight 128 h + 32 s + j: bits 2s of qs[32 h + j], in sub-block i = 8 h + 2 s + j // 16."""
    q = (load_u8(w, r, o + 16 + 32 * h + j) >> _U8(2 * s)) & _U8(3)
    return fsub(fmul(dl[i], _f32(q)), ml[i])


@njit(cache=True)
def deq_q2_k(w, r, b, k, dst):
    o = 84 * b
    dl = stack_f32(16)
    ml = stack_f32(16)
    _q2_k_scales(w, r, o, dl, ml)
    for jj in range(_n(16)):
        for half in range(2):
            j = 16 * half + jj
            for h in range(2):
                for s in range(4):
                    i = 8 * h + 2 * s + half
                    dst[128 * h + 32 * s + j] = _q2_k_weight(w, r, o, j, h, s, dl, ml, i)
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_q2_k(x, w, r, k):
    dl = stack_f32(16)
    ml = stack_f32(16)
    acc = 0.0
    for b in range(k // 256):
        o = 84 * b
        x0 = 256 * b
        _q2_k_scales(w, r, o, dl, ml)
        sum_b = _F32(0.0)
        for jj in range(_n(16)):
            for half in range(2):
                j = 16 * half + jj
                for h in range(2):
                    for s in range(4):
                        i = 8 * h + 2 * s + half
                        xv = x[x0 + 128 * h + 32 * s + j]
                        sum_b += xv * _q2_k_weight(w, r, o, j, h, s, dl, ml, i)
        acc += sum_b
    return acc


# ---- Q3_K: 16 sub-blocks of 16; 2 low bits in qs, the third in hmask; 6-bit scales ----


@njit(inline="always")
def _q3_k_scales(w, r, o, dl):
    """dl[i] = d * (scale_i - 32): 4 low bits in nibble i // 8 of byte i % 8 of scales,
    2 high bits at bit 2 (i // 4) of byte 8 + i % 4."""
    d = load_f16_scale(w, r, o + 108)
    for i in range(16):
        lo = (load_u8(w, r, o + 96 + i % 8) >> _U8(4 * (i // 8))) & _U8(15)
        hi = (load_u8(w, r, o + 104 + i % 4) >> _U8(2 * (i // 4))) & _U8(3)
        dl[i] = fmul(d, _F32(_I64(lo | (hi << _U8(4))) - 32))


@njit(inline="always")
def _minus_4(v):
    """v - 4 as int8 for a 3-bit v already xor-ed with 4 (sign-extends bit 2)."""
    return np.int8(_U8(v << _U8(5))) >> np.int8(5)


@njit(inline="always")
def _q3_k_weight(w, r, o, j, h, s, dl, i):
    """Weight 128 h + 32 s + j: bits 2s of qs[32 h + j] minus 4 unless bit 4 h + s of
    hmask[j] is set, times the scale of its sub-block i = 8 h + 2 s + j // 16."""
    lo = (load_u8(w, r, o + 32 + 32 * h + j) >> _U8(2 * s)) & _U8(3)
    hi = (load_u8(w, r, o + j) >> _U8(4 * h + s)) & _U8(1)
    q = _minus_4((lo | (hi << _U8(2))) ^ _U8(4))  # (lo | hi << 2) - 4
    return fmul(dl[i], _F32(q))


@njit(cache=True)
def deq_q3_k(w, r, b, k, dst):
    o = 110 * b
    dl = stack_f32(16)
    _q3_k_scales(w, r, o, dl)
    for jj in range(_n(16)):
        for half in range(2):
            j = 16 * half + jj
            for h in range(2):
                for s in range(4):
                    i = 8 * h + 2 * s + half
                    dst[128 * h + 32 * s + j] = _q3_k_weight(w, r, o, j, h, s, dl, i)
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_q3_k(x, w, r, k):
    dl = stack_f32(16)
    acc = 0.0
    for b in range(k // 256):
        o = 110 * b
        x0 = 256 * b
        _q3_k_scales(w, r, o, dl)
        sum_b = _F32(0.0)
        for jj in range(_n(16)):
            for half in range(2):
                j = 16 * half + jj
                for h in range(2):
                    for s in range(4):
                        i = 8 * h + 2 * s + half
                        xv = x[x0 + 128 * h + 32 * s + j]
                        sum_b += xv * _q3_k_weight(w, r, o, j, h, s, dl, i)
        acc += sum_b
    return acc


# ---- Q4_K and Q5_K: 8 sub-blocks of 32; 6-bit scales and mins; w = (d sc) q - (dmin m) ----


@njit(inline="always")
def _k4_scales(w, r, o, dl, ml):
    """dl[i] = d * scale_i, ml[i] = dmin * min_i of the 8 sub-blocks.

    ``d`` and ``dmin`` are the f16s at ``w[r, o:o + 4]``; the 6-bit scales and mins are
    packed in ``w[r, o + 4:o + 16]``: bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7
    mins 0-3; scales and mins 4-7 keep their low 4 bits in bytes 8-11 and their top 2 bits
    in the spare top bits of bytes 0-7.
    """
    d = load_f16_scale(w, r, o)
    dmin = load_f16_scale(w, r, o + 2)
    s = o + 4
    for i in range(8):
        if i < 4:
            sc = load_u8(w, r, s + i) & _U8(63)
            m = load_u8(w, r, s + i + 4) & _U8(63)
        else:
            low = load_u8(w, r, s + i + 4)  # low 4 bits: of the scale, then of the min
            sc = (low & _U8(15)) | ((load_u8(w, r, s + i - 4) >> _U8(6)) << _U8(4))
            m = (low >> _U8(4)) | ((load_u8(w, r, s + i) >> _U8(6)) << _U8(4))
        dl[i] = fmul(d, _f32(sc))
        ml[i] = fmul(dmin, _f32(m))


@njit(inline="always")
def _q4_k_weights(w, r, o, j, p, dl, ml):
    """Weights 64 p + j and 64 p + 32 + j: the nibbles of qs[32 p + j]."""
    q = load_u8(w, r, o + 16 + 32 * p + j)
    lo = fsub(fmul(dl[2 * p], _f32(q & _U8(15))), ml[2 * p])
    hi = fsub(fmul(dl[2 * p + 1], _f32(q >> _U8(4))), ml[2 * p + 1])
    return lo, hi


@njit(cache=True)
def deq_q4_k(w, r, b, k, dst):
    o = 144 * b
    dl = stack_f32(8)
    ml = stack_f32(8)
    _k4_scales(w, r, o, dl, ml)
    for j in range(_n(32)):
        for p in range(4):
            dst[64 * p + j], dst[64 * p + 32 + j] = _q4_k_weights(w, r, o, j, p, dl, ml)
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_q4_k(x, w, r, k):
    dl = stack_f32(8)
    ml = stack_f32(8)
    acc = 0.0
    for b in range(k // 256):
        o = 144 * b
        x0 = 256 * b
        _k4_scales(w, r, o, dl, ml)
        sum_b = _F32(0.0)
        for j in range(_n(32)):
            for p in range(4):
                lo, hi = _q4_k_weights(w, r, o, j, p, dl, ml)
                sum_b += x[x0 + 64 * p + j] * lo + x[x0 + 64 * p + 32 + j] * hi
        acc += sum_b
    return acc


@njit(inline="always")
def _q5_k_weights(w, r, o, j, p, dl, ml):
    """As Q4_K, from qs[32 p + j], plus bits 2p and 2p + 1 of qh[j] as bit 4."""
    q = load_u8(w, r, o + 48 + 32 * p + j)
    h = load_u8(w, r, o + 16 + j)
    q_lo = (q & _U8(15)) | (((h >> _U8(2 * p)) & _U8(1)) << _U8(4))
    q_hi = (q >> _U8(4)) | (((h >> _U8(2 * p + 1)) & _U8(1)) << _U8(4))
    lo = fsub(fmul(dl[2 * p], _f32(q_lo)), ml[2 * p])
    hi = fsub(fmul(dl[2 * p + 1], _f32(q_hi)), ml[2 * p + 1])
    return lo, hi


@njit(cache=True)
def deq_q5_k(w, r, b, k, dst):
    o = 176 * b
    dl = stack_f32(8)
    ml = stack_f32(8)
    _k4_scales(w, r, o, dl, ml)
    for j in range(_n(32)):
        for p in range(4):
            dst[64 * p + j], dst[64 * p + 32 + j] = _q5_k_weights(w, r, o, j, p, dl, ml)
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_q5_k(x, w, r, k):
    dl = stack_f32(8)
    ml = stack_f32(8)
    acc = 0.0
    for b in range(k // 256):
        o = 176 * b
        x0 = 256 * b
        _k4_scales(w, r, o, dl, ml)
        sum_b = _F32(0.0)
        for j in range(_n(32)):
            for p in range(4):
                lo, hi = _q5_k_weights(w, r, o, j, p, dl, ml)
                sum_b += x[x0 + 64 * p + j] * lo + x[x0 + 64 * p + 32 + j] * hi
        acc += sum_b
    return acc


# ---- Q6_K: 16 sub-blocks of 16; 4 low bits in ql, 2 high in qh; int8 scales ----


@njit(inline="always")
def _q6_k_scales(w, r, o, dl):
    d = load_f16_scale(w, r, o + 208)
    for i in range(16):
        dl[i] = fmul(d, _F32(load_i8(w, r, o + 192 + i)))


@njit(inline="always")
def _minus_32(v):
    """v - 32 as int8 for a 6-bit v already xor-ed with 32 (sign-extends bit 5)."""
    return np.int8(_U8(v << _U8(2))) >> np.int8(2)


@njit(inline="always")
def _q6_k_weight(w, r, o, j, h, t, dl, i):
    """Weight 128 h + 32 t + j: nibble t >> 1 of ql[64 h + 32 (t & 1) + j] and bits 2t of
    qh[32 h + j], minus 32, times the scale of its sub-block i = 8 h + 2 t + j // 16."""
    lo = (load_u8(w, r, o + 64 * h + 32 * (t & 1) + j) >> _U8(4 * (t >> 1))) & _U8(15)
    hi = (load_u8(w, r, o + 128 + 32 * h + j) >> _U8(2 * t)) & _U8(3)
    q = _minus_32((lo | (hi << _U8(4))) ^ _U8(32))
    return fmul(dl[i], _F32(q))


@njit(cache=True)
def deq_q6_k(w, r, b, k, dst):
    o = 210 * b
    dl = stack_f32(16)
    _q6_k_scales(w, r, o, dl)
    for jj in range(_n(16)):
        for half in range(2):
            j = 16 * half + jj
            for h in range(2):
                for t in range(4):
                    i = 8 * h + 2 * t + half
                    dst[128 * h + 32 * t + j] = _q6_k_weight(w, r, o, j, h, t, dl, i)
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_q6_k(x, w, r, k):
    dl = stack_f32(16)
    acc = 0.0
    for b in range(k // 256):
        o = 210 * b
        x0 = 256 * b
        _q6_k_scales(w, r, o, dl)
        sum_b = _F32(0.0)
        for jj in range(_n(16)):
            for half in range(2):
                j = 16 * half + jj
                for h in range(2):
                    for t in range(4):
                        i = 8 * h + 2 * t + half
                        xv = x[x0 + 128 * h + 32 * t + j]
                        sum_b += xv * _q6_k_weight(w, r, o, j, h, t, dl, i)
        acc += sum_b
    return acc


# ---- Q8_K: w = d * q with a float32 d ----


@njit(cache=True)
def deq_q8_k(w, r, b, k, dst):
    o = 292 * b
    d = load_f32(w, r, o)
    for j in range(_n(256)):
        dst[j] = fmul(d, _F32(load_i8(w, r, o + 4 + j)))
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_q8_k(x, w, r, k):
    acc = 0.0
    for b in range(k // 256):
        o = 292 * b
        x0 = 256 * b
        d = load_f32(w, r, o)
        sum_b = _F32(0.0)
        for j in range(_n(256)):
            sum_b += x[x0 + j] * fmul(d, _F32(load_i8(w, r, o + 4 + j)))
        acc += sum_b
    return acc


# ---- IQ4_XS: 8 sub-blocks of 32 laid out like IQ4_NL blocks, 6-bit scales ----


@njit(inline="always")
def _iq4_xs_scales(w, r, o, dl):
    """dl[ib] = d * (scale_ib - 32): 4 low bits in nibble ib % 2 of scales_l[ib // 2],
    2 high bits at bit 2 ib of scales_h."""
    d = load_f16_scale(w, r, o)
    scales_h = load_u16(w, r, o + 2)
    for ib in range(8):
        lo = (load_u8(w, r, o + 4 + ib // 2) >> _U8(4 * (ib % 2))) & _U8(15)
        hi = (scales_h >> np.uint16(2 * ib)) & np.uint16(3)
        dl[ib] = fmul(d, _F32(_I64(lo) + (_I64(hi) << 4) - 32))


@njit(inline="always")
def _iq4_xs_weights(w, r, o, j, ib, dl):
    """Weights 32 ib + j and 32 ib + 16 + j: the nibbles of qs[16 ib + j] on the grid."""
    q = load_u8(w, r, o + 8 + 16 * ib + j)
    lo = fmul(dl[ib], KVALUES_IQ4NL[q & _U8(15)])
    hi = fmul(dl[ib], KVALUES_IQ4NL[q >> _U8(4)])
    return lo, hi


@njit(cache=True)
def deq_iq4_xs(w, r, b, k, dst):
    o = 136 * b
    dl = stack_f32(8)
    _iq4_xs_scales(w, r, o, dl)
    for j in range(_n(16)):
        for ib in range(8):
            dst[32 * ib + j], dst[32 * ib + 16 + j] = _iq4_xs_weights(w, r, o, j, ib, dl)
    return 256


@njit(cache=True, fastmath=FASTMATH)
def vdot_iq4_xs(x, w, r, k):
    dl = stack_f32(8)
    acc = 0.0
    for b in range(k // 256):
        o = 136 * b
        x0 = 256 * b
        _iq4_xs_scales(w, r, o, dl)
        sum_b = _F32(0.0)
        for j in range(_n(16)):
            for ib in range(8):
                lo, hi = _iq4_xs_weights(w, r, o, j, ib, dl)
                sum_b += x[x0 + 32 * ib + j] * lo + x[x0 + 32 * ib + 16 + j] * hi
        acc += sum_b
    return acc
