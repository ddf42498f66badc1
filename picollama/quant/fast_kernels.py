"""Numba kernels of ggml's quantizers, one block at a time, parallel over rows.

Each ``_<type>_block`` is the C function (``quantize_row_<type>_ref``, or
``quantize_row_iq4_nl_impl`` for the IQ4 types) transcribed: float32 arithmetic in the C's
order, never float64 (every constant is a float32 and every integer is converted before it
meets a float), fp16 rounding to nearest even, and ``nearest_int``'s float trick. The numpy
references in :mod:`picollama.quant` are the oracle; the tests compare the two on random rows.

Kernels are module-level ``@njit(cache=True)`` functions that call each other by name (no
closures), so Numba's on-disk cache holds them across runs. :func:`quantize_into` is the
dispatch.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from picollama.gguf.constants import GGMLType

__all__ = ["quantize_into"]

_F = np.float32
_ZERO = _F(0.0)
_ONE = _F(1.0)
_HALF = _F(0.5)
_MAGIC = _F(12582912.0)  # 1.5 * 2**23
_GROUP_MAX_EPS = _F(1e-15)
_FLT_MAX = _F(np.finfo(np.float32).max)
_KVALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)

# ---------------------------------------------------------------------- scalar helpers


@njit(cache=True)
def _nearest_int(f):
    """ggml's ``nearest_int``, bit for bit: (f + 1.5 * 2**23) read as int32, its mantissa
    minus 2**22 (round half to even for |f| < 2**22, the C's garbage beyond)."""
    v = np.float32(f + _MAGIC)
    return (np.int64(v.view(np.int32)) & 0x007FFFFF) - 0x00400000


@njit(cache=True)
def _to_int(v):
    """C's float -> int conversion: truncation, INT_MIN for NaN and out of range (x86)."""
    if v != v or v >= 2147483648.0 or v < -2147483648.0:
        return -2147483648
    return int(v)


@njit(cache=True)
def _fp16_bits(f):
    """float32 -> IEEE half bits, round to nearest even; NaN -> 0x7E00 | sign."""
    sign = 0x8000 if math.copysign(1.0, f) < 0 else 0
    if f != f:
        return sign | 0x7E00
    a = abs(float(f))
    if a >= 65520.0:
        return sign | 0x7C00
    if a < 6.103515625e-05:  # below 2**-14: subnormal (or 0)
        return sign | int(np.rint(a * 16777216.0))
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    return sign | (((e - 1 + 15) << 10) + int(np.rint((m * 2.0 - 1.0) * 1024.0)))


@njit(cache=True)
def _fp16_value(h):
    """IEEE half bits -> float32 (exact)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = math.ldexp(float(m), -24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(1024 + m), e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True)
def _store_fp16(out, offset, f):
    """Write fp16(f) at out[offset:offset + 2]; return the rounded value as float32."""
    h = _fp16_bits(f)
    out[offset] = h & 0xFF
    out[offset + 1] = h >> 8
    return _fp16_value(h)


@njit(cache=True)
def _roundf(v):
    """C roundf (half away from zero) of a float32, as float64."""
    r = math.floor(abs(float(v)) + 0.5)
    return -r if v < 0 else r


# ------------------------------------------------------------------- legacy 32-blocks


@njit(cache=True)
def _absmax(x, start, n):
    amax = _ZERO
    vmax = _ZERO
    for j in range(start, start + n):
        a = abs(x[j])
        if a > amax:
            amax = a
            vmax = x[j]
    return amax, vmax


@njit(cache=True)
def _min_max(x, start, n):
    vmin = _FLT_MAX
    vmax = -_FLT_MAX
    for j in range(start, start + n):
        if x[j] < vmin:
            vmin = x[j]
        if x[j] > vmax:
            vmax = x[j]
    return vmin, vmax


@njit(cache=True)
def _inverse(d):
    return _ONE / d if d != 0 else _ZERO


@njit(cache=True)
def _q4_0_block(x, s, y, o):
    _, vmax = _absmax(x, s, 32)
    d = vmax / _F(-8.0)
    inv = _inverse(d)
    _store_fp16(y, o, d)
    for j in range(16):
        a = min(15, np.int8(_to_int(x[s + j] * inv + _F(8.5))))
        b = min(15, np.int8(_to_int(x[s + 16 + j] * inv + _F(8.5))))
        y[o + 2 + j] = (a | (b << 4)) & 0xFF


@njit(cache=True)
def _q4_1_block(x, s, y, o):
    vmin, vmax = _min_max(x, s, 32)
    d = (vmax - vmin) / _F(15.0)
    inv = _inverse(d)
    _store_fp16(y, o, d)
    _store_fp16(y, o + 2, vmin)
    for j in range(16):
        a = min(15, np.int8(_to_int((x[s + j] - vmin) * inv + _HALF)))
        b = min(15, np.int8(_to_int((x[s + 16 + j] - vmin) * inv + _HALF)))
        y[o + 4 + j] = (a | (b << 4)) & 0xFF


@njit(cache=True)
def _q5_0_block(x, s, y, o):
    _, vmax = _absmax(x, s, 32)
    d = vmax / _F(-16.0)
    inv = _inverse(d)
    _store_fp16(y, o, d)
    qh = 0
    for j in range(16):
        a = min(31, np.int8(_to_int(x[s + j] * inv + _F(16.5)))) & 0xFF
        b = min(31, np.int8(_to_int(x[s + 16 + j] * inv + _F(16.5)))) & 0xFF
        y[o + 6 + j] = (a & 0x0F) | ((b & 0x0F) << 4)
        qh |= ((a & 0x10) >> 4) << j
        qh |= ((b & 0x10) >> 4) << (j + 16)
    for k in range(4):
        y[o + 2 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True)
def _q5_1_block(x, s, y, o):
    vmin, vmax = _min_max(x, s, 32)
    d = (vmax - vmin) / _F(31.0)
    inv = _inverse(d)
    _store_fp16(y, o, d)
    _store_fp16(y, o + 2, vmin)
    qh = 0
    for j in range(16):
        a = _to_int((x[s + j] - vmin) * inv + _HALF) & 0xFF
        b = _to_int((x[s + 16 + j] - vmin) * inv + _HALF) & 0xFF
        y[o + 8 + j] = (a & 0x0F) | ((b & 0x0F) << 4)
        qh |= ((a & 0x10) >> 4) << j
        qh |= ((b & 0x10) >> 4) << (j + 16)
    for k in range(4):
        y[o + 4 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True)
def _q8_0_block(x, s, y, o):
    amax = _ZERO
    for j in range(32):
        a = abs(x[s + j])
        amax = amax if amax > a else a  # C's MAX: a NaN is taken, and then replaced
    d = amax / _F(127.0)
    inv = _inverse(d)
    _store_fp16(y, o, d)
    for j in range(32):
        y[o + 2 + j] = _to_int(_roundf(x[s + j] * inv)) & 0xFF


# ------------------------------------------------------------------- k-quant searches


@njit(cache=True)
def _make_qkx2(x, s, n, w, L, laux, nmax, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants on x[s:s+n] with weights w[0:n]; writes L[s:s+n]; (scale, -min)."""
    vmin = x[s]
    vmax = x[s]
    sum_w = w[0]
    sum_x = sum_w * x[s]
    for i in range(1, n):
        xi = x[s + i]
        if xi < vmin:
            vmin = xi
        if xi > vmax:
            vmax = xi
        sum_w += w[i]
        sum_x += w[i] * xi
    if vmin > 0:
        vmin = _ZERO
    if vmax == vmin:
        for i in range(n):
            L[s + i] = 0
        return _ZERO, -vmin
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = _ONE / iscale
    best_error = _ZERO
    for i in range(n):
        q = max(0, min(nmax, _nearest_int(iscale * (x[s + i] - vmin))))
        L[s + i] = q
        diff = scale * np.float32(q) + vmin - x[s + i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fnmax) / (vmax - vmin)
        sum_l = _ZERO
        sum_l2 = _ZERO
        sum_xl = _ZERO
        for i in range(n):
            q = max(0, min(nmax, _nearest_int(iscale * (x[s + i] - vmin))))
            laux[i] = q
            lf = np.float32(q)
            wl = w[i] * lf
            sum_l += wl
            sum_l2 += wl * lf
            sum_xl += wl * x[s + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = _ZERO
                this_scale = sum_xl / sum_l2
            cur_error = _ZERO
            for i in range(n):
                diff = this_scale * np.float32(laux[i]) + this_min - x[s + i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[s + i] = laux[i]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@njit(cache=True)
def _make_qx(x, s, n, L, nmax):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL); writes L[s:s+n]; returns scale."""
    amax, vmax = _absmax(x, s, n)
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[s + i] = 0
        return _ZERO
    fnmax = np.float32(nmax)
    iscale = -fnmax / vmax
    sumlx = _ZERO
    suml2 = _ZERO
    for i in range(n):
        xi = x[s + i]
        q = max(-nmax, min(nmax - 1, _nearest_int(iscale * xi)))
        L[s + i] = q + nmax
        w = xi * xi
        lf = np.float32(q)
        sumlx += w * xi * lf
        suml2 += w * lf * lf
    scale = sumlx / suml2 if suml2 != 0 else _ZERO
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + _F(0.1) * np.float32(step)) / vmax
        sumlx = _ZERO
        suml2 = _ZERO
        for i in range(n):
            xi = x[s + i]
            lf = np.float32(max(-nmax, min(nmax - 1, _nearest_int(iscale * xi))))
            w = xi * xi
            sumlx += w * xi * lf
            suml2 += w * lf * lf
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[s + i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[s + i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def _make_q3(x, s, n, L, nmax):
    """make_q3_quants(n, nmax, x, L, do_rmse=true); writes L[s:s+n]; returns scale."""
    amax, vmax = _absmax(x, s, n)
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[s + i] = 0
        return _ZERO
    iscale = -np.float32(nmax) / vmax
    sumlx = _ZERO
    suml2 = _ZERO
    for i in range(n):
        xi = x[s + i]
        q = max(-nmax, min(nmax - 1, _nearest_int(iscale * xi)))
        L[s + i] = q
        w = xi * xi
        lf = np.float32(q)
        sumlx += w * xi * lf
        suml2 += w * lf * lf
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            xi = x[s + i]
            w = xi * xi
            li = np.float32(L[s + i])
            slx = sumlx - w * xi * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, _nearest_int(xi * sl2 / slx)))
                if new_l != L[s + i]:
                    nl = np.float32(new_l)
                    slx += w * xi * nl
                    sl2 += w * nl * nl
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[s + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[s + i] += nmax
    return sumlx / suml2 if suml2 > 0 else _ZERO


# ---------------------------------------------------------------------- k-quant blocks


@njit(cache=True)
def _q2_k_block(x, s, y, o, L, w, laux, scales, mins):
    q4scale = _F(15.0)
    max_scale = _ZERO
    max_min = _ZERO
    for j in range(16):
        for i in range(16):
            w[i] = abs(x[s + 16 * j + i])
        sc, mn = _make_qkx2(x, s + 16 * j, 16, w, L, laux, 3, _F(-0.5), _F(0.1), 15, True)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    # L is indexed from s: L[s + k] holds weight k of this block
    if max_scale > 0:
        iscale = q4scale / max_scale
        for j in range(16):
            y[o + j] = _nearest_int(iscale * scales[j]) & 0xFF
        d = _store_fp16(y, o + 80, max_scale / q4scale)
    else:
        for j in range(16):
            y[o + j] = 0
        d = _store_fp16(y, o + 80, _ZERO)
    if max_min > 0:
        iscale = q4scale / max_min
        for j in range(16):
            y[o + j] = (np.int64(y[o + j]) | (_nearest_int(iscale * mins[j]) << 4)) & 0xFF
        dmin = _store_fp16(y, o + 82, max_min / q4scale)
    else:
        dmin = _store_fp16(y, o + 82, _ZERO)
    for j in range(16):
        dl = d * np.float32(np.int64(y[o + j]) & 0x0F)
        if dl == 0:
            continue
        dm = dmin * np.float32(np.int64(y[o + j]) >> 4)
        for i in range(16):
            q = _nearest_int((x[s + 16 * j + i] + dm) / dl)
            L[s + 16 * j + i] = max(0, min(3, q))
    for h in range(2):
        for i in range(32):
            b = s + 128 * h + i
            y[o + 16 + 32 * h + i] = (
                L[b] | (L[b + 32] << 2) | (L[b + 64] << 4) | (L[b + 96] << 6)
            ) & 0xFF


@njit(cache=True)
def _q3_k_block(x, s, y, o, L, scales):
    amax = _ZERO
    max_scale = _ZERO
    for j in range(16):
        sc = _make_q3(x, s + 16 * j, 16, L, 4)
        scales[j] = sc
        a = abs(sc)
        if a > amax:
            amax = a
            max_scale = sc
    for k in range(12):
        y[o + 96 + k] = 0
    if max_scale != 0:
        iscale = _F(-32.0) / max_scale
        for j in range(16):
            q = np.int8(_nearest_int(iscale * scales[j]) & 0xFF)  # C: int8_t l = ...
            q = max(-32, min(31, int(q))) + 32
            if j < 8:
                y[o + 96 + j] = q & 0x0F
            else:
                y[o + 96 + j - 8] = (np.int64(y[o + 96 + j - 8]) | ((q & 0x0F) << 4)) & 0xFF
            y[o + 96 + 8 + j % 4] = (
                np.int64(y[o + 96 + 8 + j % 4]) | ((q >> 4) << (2 * (j // 4)))
            ) & 0xFF
        d = _store_fp16(y, o + 108, _ONE / iscale)
    else:
        d = _store_fp16(y, o + 108, _ZERO)
    for j in range(16):
        if j < 8:
            low = np.int64(y[o + 96 + j]) & 0x0F
        else:
            low = np.int64(y[o + 96 + j - 8]) >> 4
        isc = (low | (((np.int64(y[o + 96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        dl = d * np.float32(isc)
        if dl == 0:
            continue
        for i in range(16):
            q = _nearest_int(x[s + 16 * j + i] / dl)
            L[s + 16 * j + i] = max(-4, min(3, q)) + 4
    for k in range(32):
        y[o + k] = 0
    for j in range(256):
        if L[s + j] > 3:
            y[o + j % 32] = (np.int64(y[o + j % 32]) | (1 << (j // 32))) & 0xFF
            L[s + j] -= 4
    for h in range(2):
        for i in range(32):
            b = s + 128 * h + i
            y[o + 32 + 32 * h + i] = (
                L[b] | (L[b + 32] << 2) | (L[b + 64] << 4) | (L[b + 96] << 6)
            ) & 0xFF


@njit(cache=True)
def _qkx_k_front(x, s, y, o, L, w, laux, scales, mins, nmax, rmin, nstep):
    """The shared part of Q4_K and Q5_K: d, dmin and the 12 scale bytes at y[o:o+16], L."""
    max_scale = _ZERO
    max_min = _ZERO
    for j in range(8):
        sum_x2 = _ZERO
        for i in range(32):
            v = x[s + 32 * j + i]
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / _F(32.0))
        for i in range(32):
            w[i] = av_x + abs(x[s + 32 * j + i])
        sc, mn = _make_qkx2(x, s + 32 * j, 32, w, L, laux, nmax, rmin, _F(0.1), nstep, False)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    inv_scale = _F(63.0) / max_scale if max_scale > 0 else _ZERO
    inv_min = _F(63.0) / max_min if max_min > 0 else _ZERO
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)  # C: uint8_t ls = ...
        lm = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            y[o + 4 + j] = ls
            y[o + 4 + j + 4] = lm
        else:
            y[o + 4 + j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4)
            y[o + 4 + j - 4] = (np.int64(y[o + 4 + j - 4]) | ((ls >> 4) << 6)) & 0xFF
            y[o + 4 + j] = (np.int64(y[o + 4 + j]) | ((lm >> 4) << 6)) & 0xFF
        scales[j] = np.float32(ls)  # from here on: the 6-bit values
        mins[j] = np.float32(lm)
    d = _store_fp16(y, o, max_scale / _F(63.0))
    dmin = _store_fp16(y, o + 2, max_min / _F(63.0))
    for j in range(8):
        dl = d * scales[j]
        if dl == 0:
            continue
        dm = dmin * mins[j]
        for i in range(32):
            q = _nearest_int((x[s + 32 * j + i] + dm) / dl)
            L[s + 32 * j + i] = max(0, min(nmax, q))


@njit(cache=True)
def _q4_k_block(x, s, y, o, L, w, laux, scales, mins):
    _qkx_k_front(x, s, y, o, L, w, laux, scales, mins, 15, _F(-1.0), 20)
    for c in range(4):
        for i in range(32):
            y[o + 16 + 32 * c + i] = L[s + 64 * c + i] | (L[s + 64 * c + 32 + i] << 4)


@njit(cache=True)
def _q5_k_block(x, s, y, o, L, w, laux, scales, mins):
    _qkx_k_front(x, s, y, o, L, w, laux, scales, mins, 31, _F(-0.5), 15)
    for i in range(32):
        y[o + 16 + i] = 0
    for c in range(4):
        for i in range(32):
            l1 = L[s + 64 * c + i]
            l2 = L[s + 64 * c + 32 + i]
            if l1 > 15:
                l1 -= 16
                y[o + 16 + i] = (np.int64(y[o + 16 + i]) | (1 << (2 * c))) & 0xFF
            if l2 > 15:
                l2 -= 16
                y[o + 16 + i] = (np.int64(y[o + 16 + i]) | (2 << (2 * c))) & 0xFF
            y[o + 48 + 32 * c + i] = l1 | (l2 << 4)


@njit(cache=True)
def _q6_k_block(x, s, y, o, L, scales):
    amax = _ZERO
    max_scale = _ZERO
    for j in range(16):
        sc = _make_qx(x, s + 16 * j, 16, L, 32)
        scales[j] = sc
        a = abs(sc)
        if a > amax:
            amax = a
            max_scale = sc
    if amax < _GROUP_MAX_EPS:
        for k in range(210):
            y[o + k] = 0
        return
    iscale = _F(-128.0) / max_scale
    d = _store_fp16(y, o + 208, _ONE / iscale)
    for j in range(16):
        y[o + 192 + j] = min(127, _nearest_int(iscale * scales[j])) & 0xFF
    for j in range(16):
        isc = np.int8(np.int64(y[o + 192 + j]) & 0xFF)
        dl = d * np.float32(isc)
        if dl == 0:
            continue
        for i in range(16):
            q = _nearest_int(x[s + 16 * j + i] / dl)
            L[s + 16 * j + i] = max(-32, min(31, q)) + 32
    for h in range(2):
        for i in range(32):
            b = s + 128 * h + i
            q1 = L[b]
            q2 = L[b + 32]
            q3 = L[b + 64]
            q4 = L[b + 96]
            y[o + 64 * h + i] = (q1 & 0x0F) | ((q3 & 0x0F) << 4)
            y[o + 64 * h + 32 + i] = (q2 & 0x0F) | ((q4 & 0x0F) << 4)
            y[o + 128 + 32 * h + i] = (
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
            ) & 0xFF


# ------------------------------------------------------------------------ IQ4 blocks


@njit(cache=True)
def _best_index(v):
    """best_index_int8(16, kvalues_iq4nl, v)."""
    if v <= _KVALUES[0]:
        return 0
    if v >= _KVALUES[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if v < _KVALUES[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if v - _KVALUES[mu - 1] < _KVALUES[mu] - v else mu


@njit(cache=True)
def _iq4_scale(x, s):
    """The sub-block scale of quantize_row_iq4_nl_impl with ntry = 7 and no importance
    weights (weights x^2), for x[s:s+32]; 0 for an all-zero sub-block."""
    amax, vmax = _absmax(x, s, 32)
    if amax < _GROUP_MAX_EPS:
        return _ZERO
    d = -vmax / _KVALUES[0]
    inv = _ONE / d
    sumqx = _ZERO
    sumq2 = _ZERO
    for j in range(32):
        xj = x[s + j]
        q = _KVALUES[_best_index(inv * xj)]
        w = xj * xj
        sumqx += w * q * xj
        sumq2 += w * q * q
    d = sumqx / sumq2
    best = d * sumqx
    for itry in range(-7, 8):
        inv = (np.float32(itry) + _KVALUES[0]) / vmax
        sumqx = _ZERO
        sumq2 = _ZERO
        for j in range(32):
            xj = x[s + j]
            q = _KVALUES[_best_index(inv * xj)]
            w = xj * xj
            sumqx += w * q * xj
            sumq2 += w * q * q
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(cache=True)
def _iq4_nl_block(x, s, y, o):
    d = _iq4_scale(x, s)
    _store_fp16(y, o, d)
    inv = _ONE / d if d != 0 else _ZERO
    for j in range(16):
        a = _best_index(inv * x[s + j])
        b = _best_index(inv * x[s + 16 + j])
        y[o + 2 + j] = a | (b << 4)


@njit(cache=True)
def _iq4_xs_block(x, s, y, o, scales):
    amax = _ZERO
    max_scale = _ZERO
    for ib in range(8):
        sc = _iq4_scale(x, s + 32 * ib)
        scales[ib] = sc
        a = abs(sc)
        if a > amax:
            amax = a
            max_scale = sc
    d = -max_scale / _F(32.0)
    _store_fp16(y, o, d)
    inv = _ONE / d if d != 0 else _ZERO
    scales_h = 0
    for ib in range(8):
        q = max(-32, min(31, _nearest_int(inv * scales[ib])))
        dl = d * np.float32(q)
        idl = _ONE / dl if dl != 0 else _ZERO
        for j in range(16):
            lo = _best_index(idl * x[s + 32 * ib + j])
            hi = _best_index(idl * x[s + 32 * ib + 16 + j])
            y[o + 8 + 16 * ib + j] = lo | (hi << 4)
        q += 32
        if ib % 2 == 0:
            y[o + 4 + ib // 2] = q & 0x0F
        else:
            y[o + 4 + ib // 2] = (np.int64(y[o + 4 + ib // 2]) | ((q & 0x0F) << 4)) & 0xFF
        scales_h |= (q >> 4) << (2 * ib)
    y[o + 2] = scales_h & 0xFF
    y[o + 3] = (scales_h >> 8) & 0xFF


# ------------------------------------------------------------------------ row kernels
# One small kernel per type over rows [r0, r1), released from the GIL: quantize_into runs
# them on a thread pool. (One prange kernel for all types compiled several times slower, and
# compiled every type on first use.)


@njit(cache=True, nogil=True)
def _rows_q4_0(x, out, r0, r1):
    for r in range(r0, r1):
        for b in range(x.shape[1] // 32):
            _q4_0_block(x[r], 32 * b, out[r], 18 * b)


@njit(cache=True, nogil=True)
def _rows_q4_1(x, out, r0, r1):
    for r in range(r0, r1):
        for b in range(x.shape[1] // 32):
            _q4_1_block(x[r], 32 * b, out[r], 20 * b)


@njit(cache=True, nogil=True)
def _rows_q5_0(x, out, r0, r1):
    for r in range(r0, r1):
        for b in range(x.shape[1] // 32):
            _q5_0_block(x[r], 32 * b, out[r], 22 * b)


@njit(cache=True, nogil=True)
def _rows_q5_1(x, out, r0, r1):
    for r in range(r0, r1):
        for b in range(x.shape[1] // 32):
            _q5_1_block(x[r], 32 * b, out[r], 24 * b)


@njit(cache=True, nogil=True)
def _rows_q8_0(x, out, r0, r1):
    for r in range(r0, r1):
        for b in range(x.shape[1] // 32):
            _q8_0_block(x[r], 32 * b, out[r], 34 * b)


@njit(cache=True, nogil=True)
def _rows_q2_k(x, out, r0, r1):
    L = np.zeros(x.shape[1], dtype=np.int32)
    w = np.empty(32, dtype=np.float32)
    laux = np.empty(32, dtype=np.int32)
    scales = np.empty(16, dtype=np.float32)
    mins = np.empty(16, dtype=np.float32)
    for r in range(r0, r1):
        for b in range(x.shape[1] // 256):
            _q2_k_block(x[r], 256 * b, out[r], 84 * b, L, w, laux, scales, mins)


@njit(cache=True, nogil=True)
def _rows_q3_k(x, out, r0, r1):
    L = np.zeros(x.shape[1], dtype=np.int32)
    scales = np.empty(16, dtype=np.float32)
    for r in range(r0, r1):
        for b in range(x.shape[1] // 256):
            _q3_k_block(x[r], 256 * b, out[r], 110 * b, L, scales)


@njit(cache=True, nogil=True)
def _rows_q4_k(x, out, r0, r1):
    L = np.zeros(x.shape[1], dtype=np.int32)
    w = np.empty(32, dtype=np.float32)
    laux = np.empty(32, dtype=np.int32)
    scales = np.empty(16, dtype=np.float32)
    mins = np.empty(16, dtype=np.float32)
    for r in range(r0, r1):
        for b in range(x.shape[1] // 256):
            _q4_k_block(x[r], 256 * b, out[r], 144 * b, L, w, laux, scales, mins)


@njit(cache=True, nogil=True)
def _rows_q5_k(x, out, r0, r1):
    L = np.zeros(x.shape[1], dtype=np.int32)
    w = np.empty(32, dtype=np.float32)
    laux = np.empty(32, dtype=np.int32)
    scales = np.empty(16, dtype=np.float32)
    mins = np.empty(16, dtype=np.float32)
    for r in range(r0, r1):
        for b in range(x.shape[1] // 256):
            _q5_k_block(x[r], 256 * b, out[r], 176 * b, L, w, laux, scales, mins)


@njit(cache=True, nogil=True)
def _rows_q6_k(x, out, r0, r1):
    L = np.zeros(x.shape[1], dtype=np.int32)
    scales = np.empty(16, dtype=np.float32)
    for r in range(r0, r1):
        for b in range(x.shape[1] // 256):
            _q6_k_block(x[r], 256 * b, out[r], 210 * b, L, scales)


@njit(cache=True, nogil=True)
def _rows_iq4_nl(x, out, r0, r1):
    for r in range(r0, r1):
        for b in range(x.shape[1] // 32):
            _iq4_nl_block(x[r], 32 * b, out[r], 18 * b)


@njit(cache=True, nogil=True)
def _rows_iq4_xs(x, out, r0, r1):
    scales = np.empty(8, dtype=np.float32)
    for r in range(r0, r1):
        for b in range(x.shape[1] // 256):
            _iq4_xs_block(x[r], 256 * b, out[r], 136 * b, scales)


T = GGMLType
KERNELS = {
    T.Q4_0: _rows_q4_0,
    T.Q4_1: _rows_q4_1,
    T.Q5_0: _rows_q5_0,
    T.Q5_1: _rows_q5_1,
    T.Q8_0: _rows_q8_0,
    T.Q2_K: _rows_q2_k,
    T.Q3_K: _rows_q3_k,
    T.Q4_K: _rows_q4_k,
    T.Q5_K: _rows_q5_k,
    T.Q6_K: _rows_q6_k,
    T.IQ4_NL: _rows_iq4_nl,
    T.IQ4_XS: _rows_iq4_xs,
}

# Weights per task handed to a thread: small enough to balance two threads on small
# tensors, big enough that the Python round trip (~20 us) is noise.
_TASK_WEIGHTS = 1 << 16

_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def _get_pool(n_threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    if _pool is None or _pool_threads != n_threads:
        if _pool is not None:
            _pool.shutdown()
        _pool = ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="quantize")
        _pool_threads = n_threads
    return _pool


def quantize_into(x: np.ndarray, out: np.ndarray, qtype: int, n_threads: int = 1) -> None:
    """Quantize float32 rows ``x`` (C-contiguous, (n_rows, n)) into ``out`` (uint8,
    (n_rows, row_bytes)) as ggml type ``qtype`` on ``n_threads`` threads; the caller checks
    the shapes."""
    kernel = KERNELS.get(GGMLType(qtype))
    if kernel is None:
        raise ValueError(f"no Numba kernel for {GGMLType(qtype).name}")
    n_rows, n = x.shape
    step = max(1, _TASK_WEIGHTS // max(n, 1))
    if n_threads <= 1 or n_rows <= step:
        kernel(x, out, 0, n_rows)
        return
    pool = _get_pool(n_threads)
    tasks = [pool.submit(kernel, x, out, r, min(r + step, n_rows)) for r in range(0, n_rows, step)]
    try:
        for task in tasks:
            task.result()
    except BaseException:  # an interrupt: do not leave the rest of the tensor queued
        for task in tasks:
            task.cancel()
        raise
