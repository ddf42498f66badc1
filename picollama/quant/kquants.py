"""The k-quants: super-blocks of 256 weights with quantized sub-block scales.

Q2_K .. Q6_K and Q8_K. Quantizers follow ``quantize_row_*_ref`` in ggml-quants.c and its
helpers ``make_qkx2_quants``, ``make_q3_quants`` and ``make_qx_quants``; those run a search
whose running sums the C accumulates one weight at a time, so the sums here loop over the 16
or 32 weights of a sub-block (each step a vector over all sub-blocks) instead of calling
``np.sum``. Sub-block arrays are laid out weight-major, ``(weights_per_sub_block,
n_sub_blocks)``, so that every step of those loops reads contiguous memory.
"""

from __future__ import annotations

import numpy as np

from picollama.gguf.constants import QK_K, GGMLType
from picollama.quant.base import (
    GROUP_MAX_EPS,
    Quant,
    first_absmax,
    first_min_max,
    fp16_to_fp32,
    fp32_to_fp16_bits,
    nearest_int,
    seq_sum,
)

__all__ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"]

_F32 = np.float32


def _out(out: np.ndarray | None, n_blocks: int) -> np.ndarray:
    return np.empty((n_blocks, QK_K), dtype=np.float32) if out is None else out


def _sub_blocks(x: np.ndarray, size: int) -> np.ndarray:
    """(n, 256) -> (size, n * 256 // size): one column per sub-block, weight-major."""
    return np.ascontiguousarray(x.reshape(-1, size).T)


def _from_sub_blocks(a: np.ndarray, n_blocks: int) -> np.ndarray:
    """The inverse of :func:`_sub_blocks`: (size, n_sub) -> (n_blocks, 256)."""
    return a.T.reshape(n_blocks, QK_K)


def _positive_max(v: np.ndarray) -> np.ndarray:
    """``m = 0; if (v > m) m = v;`` over axis 1: the largest positive value, else +0.0."""
    m = np.fmax.reduce(v, axis=1)  # fmax passes over NaN, as a failed ``>`` does
    return np.where(m > 0, m, _F32(0.0))


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """(n, 256) codes < 4 -> (n, 64) bytes: byte 32*h + l holds weights 128*h + 32*k + l."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    packed = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return packed.reshape(-1, 64)


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 2, 4, 2, 16) codes: [half, shift, group of 16, weight]."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1, 1)
    return (qs.reshape(-1, 2, 1, 2, 16) >> shifts) & 3


def _pack_4bit(q: np.ndarray) -> np.ndarray:
    """(n, 256) codes < 16 -> (n, 128) bytes: byte 32*c + l holds weights 64*c + l (low
    nibble) and 64*c + 32 + l (high nibble)."""
    q = q.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _unpack_4bit(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32) codes, the inverse of :func:`_pack_4bit`."""
    qs = qs.reshape(-1, 4, 32)
    q = np.empty((qs.shape[0], 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    return q.reshape(-1, 8, 32)


# ------------------------------------------------------- scale/min packing of Q4_K and Q5_K


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins per block -> the 12 bytes ``get_scale_min_k4`` reads."""
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _unpack_scale_min_k4(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``get_scale_min_k4`` for j = 0..7 at once: (n, 12) bytes -> (n, 8), (n, 8).

    Works on the 12 bytes as three little-endian uint32 words, four 6-bit fields per mask,
    as ggml's SIMD code does: a quarter of the numpy calls of a byte-wise version.
    """
    u = q.view("<u4")  # (n, 3)
    low6, low4, top2 = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    words = np.empty((q.shape[0], 4), dtype="<u4")
    words[:, 0] = u[:, 0] & low6  # scales 0-3
    words[:, 1] = (u[:, 2] & low4) | (((u[:, 0] >> 6) & top2) << 4)  # scales 4-7
    words[:, 2] = u[:, 1] & low6  # mins 0-3
    words[:, 3] = ((u[:, 2] >> 4) & low4) | (((u[:, 1] >> 6) & top2) << 4)  # mins 4-7
    b = words.view(np.uint8)
    return b[:, 0:8], b[:, 8:16]


# ------------------------------------------------------------ ggml's sub-block searches


def make_qkx2_quants(
    x: np.ndarray,
    weights: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` on columns: ``x ~ scale * L - the_min`` with L in [0, nmax].

    ``x`` and ``weights`` are (n, n_sub) float32; returns ``scale`` (n_sub,), ``the_min``
    (n_sub,) and ``L`` (n, n_sub) int32. Tries ``nstep + 1`` stretched grids and keeps the
    one of least weighted error (absolute if ``use_mad``, else squared).
    """
    n = x.shape[0]
    vmin, vmax = first_min_max(x, axis=0)
    sum_w = weights[0].copy()
    sum_x = sum_w * x[0]
    for i in range(1, n):
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    vmin = np.where(vmin > 0, _F32(0.0), vmin)
    flat = vmax == vmin

    def error(scale, the_l, vmin_):
        diff = scale * the_l + vmin_ - x
        diff = np.abs(diff) if use_mad else diff * diff
        return seq_sum(weights * diff)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = _F32(nmax) / (vmax - vmin)
        scale = _F32(1.0) / iscale
        L = np.clip(nearest_int(iscale * (x - vmin)), 0, nmax)
        best_error = error(scale, L.astype(_F32), vmin)
        for step in range(nstep + 1):
            iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / (vmax - vmin)
            laux = np.clip(nearest_int(iscale * (x - vmin)), 0, nmax)
            lf = laux.astype(_F32)
            wl = weights * lf
            sum_l = seq_sum(wl)
            sum_l2 = seq_sum(wl * lf)
            sum_xl = seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            clamp = this_min > 0
            this_min = np.where(clamp, _F32(0.0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            cur_error = error(this_scale, lf, this_min)
            better = (D > 0) & (cur_error < best_error)
            L = np.where(better, laux, L)
            best_error = np.where(better, cur_error, best_error)
            scale = np.where(better, this_scale, scale)
            vmin = np.where(better, this_min, vmin)
    L = np.where(flat, 0, L)
    scale = np.where(flat, _F32(0.0), scale)
    return scale, -vmin, L


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants`` with ``rmse_type = 1`` and no importance weights, on columns.

    ``x ~ scale * (L - nmax)`` with L in [0, 2 * nmax); ``x`` is (n, n_sub) float32. Tries
    19 grids around ``nmax / max`` and keeps the one of least x^2-weighted squared error.
    Returns ``scale`` (n_sub,) and ``L`` (n, n_sub) int32; an all-zero column gets L = 0.
    """
    amax, vmax = first_absmax(x, axis=0)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def sums(iscale):
        lv = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        lf = lv.astype(_F32)
        return lv, seq_sum(wx * lf), seq_sum(w * lf * lf)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lv, sumlx, suml2 = sums(_F32(-nmax) / vmax)
        L = lv + nmax
        scale = np.where(suml2 != 0, sumlx / suml2, _F32(0.0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            lv, sumlx, suml2 = sums(-(_F32(nmax) + _F32(0.1) * _F32(step)) / vmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, lv + nmax, L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, _F32(0.0), scale), np.where(zero, 0, L)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_q3_quants`` with ``do_rmse``, on columns: ``x ~ scale * (L - nmax)``.

    Starts from the grid ``nmax / max`` and then, for up to 5 passes, moves single weights
    to the level that most lowers the x^2-weighted squared error (the C stops after a pass
    with no move, and a pass without a move leaves everything as it was, so running all 5
    gives the same result). Returns ``scale`` (n_sub,) and ``L`` (n, n_sub) int32.
    """
    n = x.shape[0]
    amax, vmax = first_absmax(x, axis=0)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        L = np.clip(nearest_int((_F32(-nmax) / vmax) * x), -nmax, nmax - 1)
        lf = L.astype(_F32)
        sumlx = seq_sum(wx * lf)
        suml2 = seq_sum(w * lf * lf)
        for _ in range(5):
            for i in range(n):
                li = L[i].astype(_F32)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                new_l = np.clip(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
                nl = new_l.astype(_F32)
                slx_new = slx + wx[i] * nl
                sl2_new = sl2 + w[i] * nl * nl
                move = (
                    (slx > 0)
                    & (new_l != L[i])
                    & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
                )
                L[i] = np.where(move, new_l, L[i])
                sumlx = np.where(move, slx_new, sumlx)
                suml2 = np.where(move, sl2_new, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, _F32(0.0))
    return np.where(zero, _F32(0.0), scale), np.where(zero, 0, L + nmax)


# ------------------------------------------------------------------------------ types


# Q2_K: 256 weights in 84 bytes (scales[16], qs[64], d, dmin); w = d*sc*q - dmin*m
class Q2_K(Quant, qtype=GGMLType.Q2_K):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = _out(out, n)
        sc = blocks[:, 0:16].reshape(n, 2, 4, 2)
        d = fp16_to_fp32(blocks[:, 80:82]).reshape(n, 1, 1, 1)
        dmin = fp16_to_fp32(blocks[:, 82:84]).reshape(n, 1, 1, 1)
        dl = (d * (sc & 0x0F))[..., None]
        ml = (dmin * (sc >> 4))[..., None]
        o = out.reshape(n, 2, 4, 2, 16)
        np.multiply(dl, _unpack_2bit(blocks[:, 16:80]), out=o)
        np.subtract(o, ml, out=o)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        n = x_blocks.shape[0]
        xs = _sub_blocks(x_blocks, 16)
        scales, mins, L = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True)
        scales = scales.reshape(n, 16)
        mins = mins.reshape(n, 16)
        L = _from_sub_blocks(L, n).reshape(n, 16, 16)
        max_scale = _positive_max(scales)
        max_min = _positive_max(mins)
        q4scale = _F32(15)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ls = nearest_int((q4scale / max_scale)[:, None] * scales)
            lm = nearest_int((q4scale / max_min)[:, None] * mins)
        ls = np.where((max_scale > 0)[:, None], ls, 0)
        lm = np.where((max_min > 0)[:, None], lm, 0)
        sc = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)
        d_bits = fp32_to_fp16_bits(np.where(max_scale > 0, max_scale / q4scale, _F32(0)))
        dmin_bits = fp32_to_fp16_bits(np.where(max_min > 0, max_min / q4scale, _F32(0)))

        # Requantize against the rounded scales (fp16 d times the 4-bit sub-block scale).
        d = d_bits.view("<f2").astype(_F32)[:, None] * (sc & 0x0F)
        dm = dmin_bits.view("<f2").astype(_F32)[:, None] * (sc >> 4)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            l_new = nearest_int((x_blocks.reshape(n, 16, 16) + dm[..., None]) / d[..., None])
        L = np.where((d != 0)[..., None], np.clip(l_new, 0, 3), L)

        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        blocks[:, 0:16] = sc
        blocks[:, 16:80] = _pack_2bit(L)
        blocks[:, 80:82] = d_bits.reshape(n, 1).view(np.uint8)
        blocks[:, 82:84] = dmin_bits.reshape(n, 1).view(np.uint8)
        return blocks


def _unpack_q3_scales(s: np.ndarray) -> np.ndarray:
    """(n, 12) bytes -> (n, 16) six-bit scales: low 4 bits in bytes 0-7, high 2 in 8-11."""
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    high = ((s[:, None, 8:12] >> shifts) & 3).reshape(-1, 16)
    return low | (high << 4)


# Q3_K: 256 weights in 110 bytes (hmask[32], qs[64], scales[12], d); w = d*(sc-32)*(q-4)
class Q3_K(Quant, qtype=GGMLType.Q3_K):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = _out(out, n)
        d = fp16_to_fp32(blocks[:, 108:110]).reshape(n, 1, 1, 1)
        sc = _unpack_q3_scales(blocks[:, 96:108]).view(np.int8) - np.int8(32)
        dl = (d * sc.reshape(n, 2, 4, 2))[..., None]
        # The high bit of weight 128*h + 32*k + 16*g + l is bit 4*h + k of hmask[16*g + l];
        # a clear bit subtracts 4.
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)
        hbit = (blocks[:, 0:32].reshape(n, 1, 1, 2, 16) >> shifts) & 1
        q = _unpack_2bit(blocks[:, 32:96]).view(np.int8) - ((hbit ^ 1) << 2).view(np.int8)
        np.multiply(dl, q, out=out.reshape(n, 2, 4, 2, 16))
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        n = x_blocks.shape[0]
        scales, L = make_q3_quants(_sub_blocks(x_blocks, 16), 4)
        scales = scales.reshape(n, 16)
        L = _from_sub_blocks(L, n).reshape(n, 16, 16)
        _, max_scale = first_absmax(scales, axis=1)
        has_scale = max_scale != 0
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = _F32(-32) / max_scale
            ls = nearest_int(iscale[:, None] * scales).astype(np.int8)  # C: int8_t l = ...
            d = np.where(has_scale, _F32(1) / iscale, _F32(0))
        ls = (np.clip(ls, -32, 31) + 32).astype(np.uint8)
        ls = np.where(has_scale[:, None], ls, np.uint8(0))
        packed_scales = np.empty((n, 12), dtype=np.uint8)
        packed_scales[:, 0:8] = (ls[:, 0:8] & 0x0F) | ((ls[:, 8:16] & 0x0F) << 4)
        high = (ls >> 4).reshape(n, 4, 4)  # [j // 4, j % 4]
        packed_scales[:, 8:12] = (
            high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
        )
        d_bits = fp32_to_fp16_bits(d)

        dq = d_bits.view("<f2").astype(_F32)[:, None] * (ls.view(np.int8) - np.int8(32))
        with np.errstate(divide="ignore", invalid="ignore"):
            l_new = nearest_int(x_blocks.reshape(n, 16, 16) / dq[..., None])
        L = np.where((dq != 0)[..., None], np.clip(l_new, -4, 3) + 4, L).reshape(n, 8, 32)

        # hmask[m] bit k is the high bit of weight 32*k + m.
        high_bit = (L > 3).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        blocks[:, 0:32] = np.bitwise_or.reduce(high_bit, axis=1)
        blocks[:, 32:96] = _pack_2bit(L & 3)
        blocks[:, 96:108] = packed_scales
        blocks[:, 108:110] = d_bits.reshape(n, 1).view(np.uint8)
        return blocks


def _quantize_qkx_k(x_blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The shared front of Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.

    Returns d and dmin as fp16 bits, the 12 packed scale bytes, and L (n, 256) in [0, nmax].
    """
    n = x_blocks.shape[0]
    xs = _sub_blocks(x_blocks, 32)
    av_x = np.sqrt(seq_sum(xs * xs) / _F32(32))
    weights = av_x + np.abs(xs)
    scales, mins, L = make_qkx2_quants(xs, weights, nmax, rmin, 0.1, nstep, use_mad=False)
    scales = scales.reshape(n, 8)
    mins = mins.reshape(n, 8)
    L = _from_sub_blocks(L, n).reshape(n, 8, 32)
    max_scale = _positive_max(scales)
    max_min = _positive_max(mins)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    # C: uint8_t ls = nearest_int(...) wraps modulo 256 before MIN(63, ls)
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d_bits = fp32_to_fp16_bits(max_scale / _F32(63))
    dmin_bits = fp32_to_fp16_bits(max_min / _F32(63))

    d = d_bits.view("<f2").astype(_F32)[:, None] * ls
    dm = dmin_bits.view("<f2").astype(_F32)[:, None] * lm
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        l_new = nearest_int((x_blocks.reshape(n, 8, 32) + dm[..., None]) / d[..., None])
    L = np.where((d != 0)[..., None], np.clip(l_new, 0, nmax), L)
    return d_bits, dmin_bits, _pack_scale_min_k4(ls, lm), L.reshape(n, QK_K)


# Q4_K: 256 weights in 144 bytes (d, dmin, scales[12], qs[128]); w = d*sc*q - dmin*m
class Q4_K(Quant, qtype=GGMLType.Q4_K):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = _out(out, n)
        d = fp16_to_fp32(blocks[:, 0:2])[:, None]
        dmin = fp16_to_fp32(blocks[:, 2:4])[:, None]
        sc, m = _unpack_scale_min_k4(blocks[:, 4:16])
        o = out.reshape(n, 8, 32)
        np.multiply((d * sc)[..., None], _unpack_4bit(blocks[:, 16:144]), out=o)
        np.subtract(o, (dmin * m)[..., None], out=o)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        d_bits, dmin_bits, scales, L = _quantize_qkx_k(x_blocks, 15, -1.0, 20)
        blocks = np.empty((x_blocks.shape[0], cls.type_size), dtype=np.uint8)
        blocks[:, 0:2] = d_bits.reshape(-1, 1).view(np.uint8)
        blocks[:, 2:4] = dmin_bits.reshape(-1, 1).view(np.uint8)
        blocks[:, 4:16] = scales
        blocks[:, 16:144] = _pack_4bit(L)
        return blocks


# Q5_K: 256 weights in 176 bytes (d, dmin, scales[12], qh[32], qs[128]); w = d*sc*q - dmin*m
class Q5_K(Quant, qtype=GGMLType.Q5_K):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = _out(out, n)
        d = fp16_to_fp32(blocks[:, 0:2])[:, None]
        dmin = fp16_to_fp32(blocks[:, 2:4])[:, None]
        sc, m = _unpack_scale_min_k4(blocks[:, 4:16])
        # bit s of qh[l] is bit 4 of weight 32*s + l
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _unpack_4bit(blocks[:, 48:176])
        q |= ((blocks[:, None, 16:48] >> shifts) & 1) << 4
        o = out.reshape(n, 8, 32)
        np.multiply((d * sc)[..., None], q, out=o)
        np.subtract(o, (dmin * m)[..., None], out=o)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        n = x_blocks.shape[0]
        d_bits, dmin_bits, scales, L = _quantize_qkx_k(x_blocks, 31, -0.5, 15)
        L = L.astype(np.uint8)
        high = (L.reshape(n, 8, 32) >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        blocks[:, 0:2] = d_bits.reshape(-1, 1).view(np.uint8)
        blocks[:, 2:4] = dmin_bits.reshape(-1, 1).view(np.uint8)
        blocks[:, 4:16] = scales
        blocks[:, 16:48] = np.bitwise_or.reduce(high, axis=1)
        blocks[:, 48:176] = _pack_4bit(L & 0x0F)
        return blocks


# Q6_K: 256 weights in 210 bytes (ql[128], qh[64], scales[16], d); w = d*sc*(q-32)
class Q6_K(Quant, qtype=GGMLType.Q6_K):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = _out(out, n)
        # Weight 128*h + 32*k + l: low 4 bits in ql[64*h + 32*(k%2) + l] (low nibble for
        # k < 2, high for k >= 2), top 2 bits at bit 2*k of qh[32*h + l].
        ql = blocks[:, 0:128].reshape(n, 2, 2, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        q = np.empty((n, 2, 4, 32), dtype=np.uint8)
        np.bitwise_and(ql, 0x0F, out=q[:, :, 0:2])
        np.right_shift(ql, 4, out=q[:, :, 2:4])
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q |= ((qh >> shifts) & 3) << 4
        q = q.view(np.int8) - np.int8(32)
        d = fp16_to_fp32(blocks[:, 208:210]).reshape(n, 1)
        dl = (d * blocks[:, 192:208].view(np.int8)).reshape(n, 2, 4, 2, 1)
        np.multiply(dl, q.reshape(n, 2, 4, 2, 16), out=out.reshape(n, 2, 4, 2, 16))
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        n = x_blocks.shape[0]
        scales, L = make_qx_quants(_sub_blocks(x_blocks, 16), 32)
        scales = scales.reshape(n, 16)
        L = _from_sub_blocks(L, n).reshape(n, 16, 16)
        max_abs_scale, max_scale = first_absmax(scales, axis=1)
        zero = max_abs_scale < GROUP_MAX_EPS
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = _F32(-128) / max_scale
            d_bits = fp32_to_fp16_bits(np.where(zero, _F32(0), _F32(1) / iscale))
            ls = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        dq = d_bits.view("<f2").astype(_F32)[:, None] * ls
        with np.errstate(divide="ignore", invalid="ignore"):
            l_new = nearest_int(x_blocks.reshape(n, 16, 16) / dq[..., None])
        L = np.where((dq != 0)[..., None], np.clip(l_new, -32, 31) + 32, L)
        L = L.reshape(n, 2, 4, 32).astype(np.uint8)  # [half, k, l]: weight 128*h + 32*k + l

        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        ql = (L[:, :, 0:2] & 0x0F) | ((L[:, :, 2:4] & 0x0F) << 4)
        blocks[:, 0:128] = ql.reshape(n, 128)
        high = (L >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        blocks[:, 128:192] = np.bitwise_or.reduce(high, axis=2).reshape(n, 64)
        blocks[:, 192:208] = ls.view(np.uint8)
        blocks[:, 208:210] = d_bits.reshape(n, 1).view(np.uint8)
        blocks[zero] = 0  # the C memsets a block whose sub-blocks are all ~zero
        return blocks


# Q8_K: 256 weights in 292 bytes (d (f32), qs[256], bsums[16] (i16)); w = d*q
class Q8_K(Quant, qtype=GGMLType.Q8_K):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        d = blocks[:, 0:4].view("<f4")
        np.multiply(d, blocks[:, 4:260].view(np.int8), out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        n = x_blocks.shape[0]
        amax, vmax = first_absmax(x_blocks, axis=1)
        zero = amax == 0
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = _F32(-127) / vmax  # -127, not -128: IQ2_XXS's AVX code needs the room
            q = np.minimum(nearest_int(iscale[:, None] * x_blocks), 127).astype(np.int8)
            d = (_F32(1) / iscale).astype("<f4")
        bsums = q.reshape(n, 16, 16).sum(axis=2, dtype=np.int32).astype("<i2")
        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        blocks[:, 0:4] = d.reshape(n, 1).view(np.uint8)
        blocks[:, 4:260] = q.view(np.uint8)
        blocks[:, 260:292] = bsums.view(np.uint8)
        # The C writes d = 0 and qs = 0 for an all-zero block and leaves bsums as they were;
        # a fresh buffer is zero, so all-zero is what we write.
        blocks[zero] = 0
        return blocks
