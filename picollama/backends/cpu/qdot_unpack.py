"""Unpack one weight row of each ggml type into integer quants and per-block scales.

Each ``unpack_<type>(w, r, n_blocks, wq, wd, wm, wmin)`` reads row ``r`` of the raw weights
``w`` (uint8 (m, row_bytes), never written) and fills:

- ``wq``: int16 (k,), the weight quants as the type's ``ggml_vec_dot_*`` multiplies them with
  the activation quants; for the k-quants and IQ4_XS already multiplied by their integer
  sub-block scale (|sc * q| <= 4096, so a whole super-block sums exactly in int32);
- ``wd``: float32 (n_blocks,), the block scale ``d`` (fp16 widened);
- ``wm``: float32 (n_blocks,), the block min ``m`` (Q4_1, Q5_1) or ``dmin`` (Q2_K, Q4_K,
  Q5_K); 0 for the other types;
- ``wmin``: int32 (k // 16,), the integer min of each 16 weights, multiplied by Q8_K's bsums
  (Q2_K, Q4_K, Q5_K); 0 for the others.

Layouts (one line each, as the C structs):
``# Q4_0: d, qs[16]``; ``# Q4_1: d, m, qs[16]``; ``# Q5_0: d, qh[4], qs[16]``;
``# Q5_1: d, m, qh[4], qs[16]``; ``# Q8_0: d, qs[32]``; ``# IQ4_NL: d, qs[16]``;
``# Q2_K: scales[16], qs[64], d, dmin``; ``# Q3_K: hmask[32], qs[64], scales[12], d``;
``# Q4_K: d, dmin, scales[12], qs[128]``; ``# Q5_K: d, dmin, scales[12], qh[32], qs[128]``;
``# Q6_K: ql[128], qh[64], scales[16] (int8), d``;
``# IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from picollama.backends.cpu.intrinsics import (
    load_f16,
    load_i8,
    load_u8,
    load_u16,
    load_u32,
    opaque,
)

__all__ = [
    "KVALUES_IQ4NL",
    "unpack_q4_0",
    "unpack_q4_1",
    "unpack_q5_0",
    "unpack_q5_1",
    "unpack_q8_0",
    "unpack_iq4_nl",
    "unpack_q2_k",
    "unpack_q3_k",
    "unpack_q4_k",
    "unpack_q5_k",
    "unpack_q6_k",
    "unpack_iq4_xs",
]


@njit(inline="always")
def _u8(w, r, o):
    """Byte ``w[r, o]`` as int64 (Numba makes mixed unsigned/signed integer ops float)."""
    return np.int64(load_u8(w, r, o))


@njit(inline="always")
def _u32(w, r, o):
    return np.int64(load_u32(w, r, o))


# ggml-common.h kvalues_iq4nl
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16
)

# ---- blocks of 32, dotted with Q8_0 / Q8_1 ----


@njit(inline="always")
def unpack_q4_0(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 18
        wd[b] = load_f16(w, r, o)
        for j in range(min(opaque(16), 16)):
            byte = np.int16(_u8(w, r, o + 2 + j))
            wq[b * 32 + j] = (byte & 15) - 8
            wq[b * 32 + 16 + j] = (byte >> 4) - 8


@njit(inline="always")
def unpack_q4_1(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 20
        wd[b] = load_f16(w, r, o)
        wm[b] = load_f16(w, r, o + 2)
        for j in range(min(opaque(16), 16)):
            byte = np.int16(_u8(w, r, o + 4 + j))
            wq[b * 32 + j] = byte & 15
            wq[b * 32 + 16 + j] = byte >> 4


@njit(inline="always")
def unpack_q5_0(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 22
        wd[b] = load_f16(w, r, o)
        qh = np.uint32(_u32(w, r, o + 2))
        for j in range(min(opaque(16), 16)):
            byte = np.int16(_u8(w, r, o + 6 + j))
            h0 = np.int16((qh >> j) & 1) << 4
            h1 = np.int16((qh >> (j + 16)) & 1) << 4
            wq[b * 32 + j] = ((byte & 15) | h0) - 16
            wq[b * 32 + 16 + j] = ((byte >> 4) | h1) - 16


@njit(inline="always")
def unpack_q5_1(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 24
        wd[b] = load_f16(w, r, o)
        wm[b] = load_f16(w, r, o + 2)
        qh = np.uint32(_u32(w, r, o + 4))
        for j in range(min(opaque(16), 16)):
            byte = np.int16(_u8(w, r, o + 8 + j))
            h0 = np.int16((qh >> j) & 1) << 4
            h1 = np.int16((qh >> (j + 16)) & 1) << 4
            wq[b * 32 + j] = (byte & 15) | h0
            wq[b * 32 + 16 + j] = (byte >> 4) | h1


@njit(inline="always")
def unpack_q8_0(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 34
        wd[b] = load_f16(w, r, o)
        for j in range(min(opaque(32), 32)):
            wq[b * 32 + j] = load_i8(w, r, o + 2 + j)


@njit(inline="always")
def unpack_iq4_nl(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 18
        wd[b] = load_f16(w, r, o)
        for j in range(min(opaque(16), 16)):
            byte = _u8(w, r, o + 2 + j)
            wq[b * 32 + j] = KVALUES_IQ4NL[byte & 15]
            wq[b * 32 + 16 + j] = KVALUES_IQ4NL[byte >> 4]


# ---- super-blocks of 256, dotted with Q8_K ----


@njit(inline="always")
def unpack_q2_k(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 84
        e0 = b * 256
        wd[b] = load_f16(w, r, o + 80)
        wm[b] = load_f16(w, r, o + 82)
        for g in range(16):
            wmin[b * 16 + g] = np.int32(_u8(w, r, o + g) >> 4)
        for half in range(2):
            for j in range(4):
                sc0 = np.int16(_u8(w, r, o + 8 * half + 2 * j) & 15)
                sc1 = np.int16(_u8(w, r, o + 8 * half + 2 * j + 1) & 15)
                for li in range(min(opaque(32), 32)):
                    q = np.int16((_u8(w, r, o + 16 + 32 * half + li) >> (2 * j)) & 3)
                    sc = sc0 if li < 16 else sc1
                    wq[e0 + 128 * half + 32 * j + li] = sc * q


@njit(inline="always")
def _scale_q3_k(w, r, o, j):
    """6-bit scale j (0..15) of a Q3_K block at byte offset o, minus 32."""
    lo_byte = _u8(w, r, o + 96 + (j % 8))
    lo = (lo_byte & 15) if j < 8 else (lo_byte >> 4)
    hi = (_u8(w, r, o + 104 + (j % 4)) >> (2 * (j // 4))) & 3
    return np.int16(lo | (hi << 4)) - 32


@njit(inline="always")
def unpack_q3_k(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 110
        e0 = b * 256
        wd[b] = load_f16(w, r, o + 108)
        wm[b] = 0.0
        for g in range(16):
            wmin[b * 16 + g] = 0
        for half in range(2):
            for j in range(4):
                sc0 = _scale_q3_k(w, r, o, 8 * half + 2 * j)
                sc1 = _scale_q3_k(w, r, o, 8 * half + 2 * j + 1)
                mask = 1 << (4 * half + j)
                for li in range(min(opaque(32), 32)):
                    q = np.int16((_u8(w, r, o + 32 + 32 * half + li) >> (2 * j)) & 3)
                    if (_u8(w, r, o + li) & mask) == 0:
                        q -= 4
                    sc = sc0 if li < 16 else sc1
                    wq[e0 + 128 * half + 32 * j + li] = sc * q


@njit(inline="always")
def _scale_min_k4(w, r, o, j):
    """get_scale_min_k4: (scale, min) j (0..7) of the 12 bytes at offset o."""
    if j < 4:
        sc = _u8(w, r, o + j) & 63
        mn = _u8(w, r, o + j + 4) & 63
    else:
        sc = (_u8(w, r, o + j + 4) & 15) | ((_u8(w, r, o + j - 4) >> 6) << 4)
        mn = (_u8(w, r, o + j + 4) >> 4) | ((_u8(w, r, o + j) >> 6) << 4)
    return np.int16(sc), np.int32(mn)


@njit(inline="always")
def unpack_q4_k(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 144
        e0 = b * 256
        wd[b] = load_f16(w, r, o)
        wm[b] = load_f16(w, r, o + 2)
        for j in range(4):
            sc0, mn0 = _scale_min_k4(w, r, o + 4, 2 * j)
            sc1, mn1 = _scale_min_k4(w, r, o + 4, 2 * j + 1)
            wmin[b * 16 + 4 * j] = mn0
            wmin[b * 16 + 4 * j + 1] = mn0
            wmin[b * 16 + 4 * j + 2] = mn1
            wmin[b * 16 + 4 * j + 3] = mn1
            for li in range(min(opaque(32), 32)):
                byte = np.int16(_u8(w, r, o + 16 + 32 * j + li))
                wq[e0 + 64 * j + li] = sc0 * (byte & 15)
                wq[e0 + 64 * j + 32 + li] = sc1 * (byte >> 4)


@njit(inline="always")
def unpack_q5_k(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 176
        e0 = b * 256
        wd[b] = load_f16(w, r, o)
        wm[b] = load_f16(w, r, o + 2)
        for j in range(4):
            sc0, mn0 = _scale_min_k4(w, r, o + 4, 2 * j)
            sc1, mn1 = _scale_min_k4(w, r, o + 4, 2 * j + 1)
            wmin[b * 16 + 4 * j] = mn0
            wmin[b * 16 + 4 * j + 1] = mn0
            wmin[b * 16 + 4 * j + 2] = mn1
            wmin[b * 16 + 4 * j + 3] = mn1
            for li in range(min(opaque(32), 32)):
                byte = np.int16(_u8(w, r, o + 48 + 32 * j + li))
                hb = np.int16(_u8(w, r, o + 16 + li))
                q0 = (byte & 15) | (((hb >> (2 * j)) & 1) << 4)
                q1 = (byte >> 4) | (((hb >> (2 * j + 1)) & 1) << 4)
                wq[e0 + 64 * j + li] = sc0 * q0
                wq[e0 + 64 * j + 32 + li] = sc1 * q1


@njit(inline="always")
def unpack_q6_k(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 210
        e0 = b * 256
        wd[b] = load_f16(w, r, o + 208)
        wm[b] = 0.0
        for g in range(16):
            wmin[b * 16 + g] = 0
        for half in range(2):
            ql = o + 64 * half
            qh = o + 128 + 32 * half
            sc = o + 192 + 8 * half
            for s in range(2):  # two groups of 16 with their own four scales
                sc0 = np.int16(load_i8(w, r, sc + s))
                sc1 = np.int16(load_i8(w, r, sc + 2 + s))
                sc2 = np.int16(load_i8(w, r, sc + 4 + s))
                sc3 = np.int16(load_i8(w, r, sc + 6 + s))
                for j in range(min(opaque(16), 16)):
                    li = 16 * s + j
                    h = np.int16(_u8(w, r, qh + li))
                    a = np.int16(_u8(w, r, ql + li))
                    c = np.int16(_u8(w, r, ql + 32 + li))
                    base = e0 + 128 * half + li
                    wq[base] = sc0 * (((a & 15) | ((h & 3) << 4)) - 32)
                    wq[base + 32] = sc1 * (((c & 15) | (((h >> 2) & 3) << 4)) - 32)
                    wq[base + 64] = sc2 * (((a >> 4) | (((h >> 4) & 3) << 4)) - 32)
                    wq[base + 96] = sc3 * (((c >> 4) | (((h >> 6) & 3) << 4)) - 32)


@njit(inline="always")
def unpack_iq4_xs(w, r, n_blocks, wq, wd, wm, wmin):
    for b in range(n_blocks):
        o = b * 136
        e0 = b * 256
        wd[b] = load_f16(w, r, o)
        wm[b] = 0.0
        for g in range(16):
            wmin[b * 16 + g] = 0
        sh = np.int32(load_u16(w, r, o + 2))
        for ib in range(8):
            lo = (_u8(w, r, o + 4 + ib // 2) >> (4 * (ib % 2))) & 15
            ls = np.int16(lo | (((sh >> (2 * ib)) & 3) << 4)) - 32
            for j in range(min(opaque(16), 16)):
                byte = _u8(w, r, o + 8 + 16 * ib + j)
                wq[e0 + 32 * ib + j] = ls * KVALUES_IQ4NL[byte & 15]
                wq[e0 + 32 * ib + 16 + j] = ls * KVALUES_IQ4NL[byte >> 4]
