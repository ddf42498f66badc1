"""The non-linear 4-bit types IQ4_NL and IQ4_XS: codes index a fixed 16-entry table.

Both quantizers are ggml's ``quantize_row_iq4_nl_impl`` (ggml-quants.c): IQ4_NL as
``quantize_row_iq4_nl_ref`` calls it (one block of 32, no scale search), IQ4_XS as
``quantize_row_iq4_xs_ref`` does (8 sub-blocks of 32 under one fp16 scale, searching 15
scales per sub-block).
"""

from __future__ import annotations

import numpy as np

from picollama.gguf.constants import QK_K, GGMLType
from picollama.quant.base import (
    GROUP_MAX_EPS,
    Quant,
    first_absmax,
    fp16_to_fp32,
    fp32_to_fp16_bits,
    nearest_int,
    seq_sum,
)

__all__ = ["IQ4_NL", "IQ4_XS", "KVALUES_IQ4NL", "best_index_int8"]

_F32 = np.float32

# ggml-common.h kvalues_iq4nl: the levels a 4-bit code stands for, in units of the scale
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
_KV = KVALUES_IQ4NL.astype(_F32)


def _tie_thresholds() -> np.ndarray:
    """For each gap between neighbouring levels, the least float32 x that picks the upper one.

    ``best_index_int8`` takes the lower level when ``x - lo < hi - x`` in float32; both sides
    are monotone in x, so within a gap that test holds below one threshold and fails above.
    """
    thresholds = []
    for lo, hi in zip(_KV[:-1], _KV[1:], strict=True):
        x = _F32((lo + hi) / 2)
        while not ((x - lo) < (hi - x)):  # walk down while the upper level still wins
            x = np.nextafter(x, lo)
        while (x - lo) < (hi - x):  # then up to the first float where it wins
            x = np.nextafter(x, hi)
        thresholds.append(x)
    return np.array(thresholds, dtype=_F32)


_THRESHOLDS = _tie_thresholds()


def best_index_int8(x: np.ndarray) -> np.ndarray:
    """ggml's ``best_index_int8(16, kvalues_iq4nl, x)``: the index of the nearest level, uint8.

    The C bisects to the two levels around ``x`` and keeps the lower one only if it is
    strictly nearer, distances in float32; counting the thresholds at or below ``x`` gives the
    same index with 15 vector compares instead of a search. A NaN ends the C's bisection at
    the top level.
    """
    index = np.zeros(x.shape, dtype=np.uint8)
    for t in _THRESHOLDS:
        index += x >= t
    return np.where(np.isnan(x), np.uint8(15), index)


def _iq4_sub_blocks(x: np.ndarray, ntry: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sub-block of 32 (columns of ``x``, (32, n_sub)): scale, first codes, all-zero mask.

    The first pass quantizes with ``d = max / -127`` (or its negation when ``ntry > 0``),
    then refits d by weighted least squares with weights x^2; the ``2 * ntry + 1`` further
    grids only move d. An all-zero sub-block gets scale 0 and (meaningless) codes.
    """
    weight = x * x
    amax, vmax = first_absmax(x, axis=0)
    zero = amax < GROUP_MAX_EPS

    def fit(inv_d):
        codes = best_index_int8(inv_d * x)
        q = _KV[codes]
        wq = weight * q
        return codes, seq_sum(wq * x), seq_sum(wq * q)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = (-vmax if ntry > 0 else vmax) / _KV[0]
        codes, sumqx, sumq2 = fit(_F32(1) / d)
        d = np.where(sumq2 > 0, sumqx / sumq2, _F32(0))
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            _, sumqx, sumq2 = fit(_F32(itry + int(KVALUES_IQ4NL[0])) / vmax)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
    return np.where(zero, _F32(0), d), codes, zero


def _pack_codes(codes: np.ndarray) -> np.ndarray:
    """(n, 32 * k) codes -> (n, 16 * k) bytes: in each 32, weight j low nibble, j + 16 high."""
    c = codes.reshape(codes.shape[0], -1, 2, 16).astype(np.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _unpack_codes(qs: np.ndarray) -> np.ndarray:
    """(n, 16 * k) bytes -> (n, k, 32) codes, the inverse of :func:`_pack_codes`."""
    qs = qs.reshape(qs.shape[0], -1, 1, 16)
    c = np.empty((qs.shape[0], qs.shape[1], 2, 16), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=c[:, :, 0:1])
    np.right_shift(qs, 4, out=c[:, :, 1:2])
    return c.reshape(qs.shape[0], -1, 32)


# IQ4_NL: 32 weights in 18 bytes (d, qs[16]); w = d * kvalues[q]
class IQ4_NL(Quant, qtype=GGMLType.IQ4_NL):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = np.empty((n, 32), dtype=np.float32) if out is None else out
        d = fp16_to_fp32(blocks[:, 0:2])[:, None]
        np.multiply(d, _KV[_unpack_codes(blocks[:, 2:18]).reshape(n, 32)], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        # quantize_row_iq4_nl_ref passes ntry = -1: the least-squares d of the first pass,
        # no search. (llama-quantize calls quantize_iq4_nl, which searches with ntry = 7.)
        n = x_blocks.shape[0]
        d, codes, zero = _iq4_sub_blocks(np.ascontiguousarray(x_blocks.T), ntry=-1)
        # For an all-zero block the C leaves its code buffer as the previous block left it;
        # we write code 8 (level +1, the nearest to 0), as its ntry > 0 path does.
        codes = np.where(zero, 8, codes).T
        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        blocks[:, 0:2] = fp32_to_fp16_bits(d).reshape(n, 1).view(np.uint8)
        blocks[:, 2:18] = _pack_codes(codes)
        return blocks


# IQ4_XS: 256 weights in 136 bytes (d, scales_h, scales_l[4], qs[128]); w = d*(sc-32)*kvalues[q]
class IQ4_XS(Quant, qtype=GGMLType.IQ4_XS):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        n = blocks.shape[0]
        out = np.empty((n, QK_K), dtype=np.float32) if out is None else out
        d = fp16_to_fp32(blocks[:, 0:2])[:, None]
        scales_h = blocks[:, 2:4].view("<u2")  # (n, 1)
        scales_l = blocks[:, 4:8]
        low = np.stack([scales_l & 0x0F, scales_l >> 4], axis=2).reshape(n, 8)
        high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = (low | (high << 4)).astype(np.int8) - np.int8(32)
        dl = (d * ls)[..., None]
        o = out.reshape(n, 8, 32)
        np.multiply(dl, _KV[_unpack_codes(blocks[:, 8:136])], out=o)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        n = x_blocks.shape[0]
        xs = np.ascontiguousarray(x_blocks.reshape(n * 8, 32).T)
        scales, _, _ = _iq4_sub_blocks(xs, ntry=7)
        scales = scales.reshape(n, 8)
        _, max_scale = first_absmax(scales, axis=1)
        d = -max_scale / _F32(32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            inv_d = np.where(d != 0, _F32(1) / d, _F32(0))
            ls = np.clip(nearest_int(inv_d[:, None] * scales), -32, 31)
            dl = d[:, None] * ls.astype(_F32)
            inv_dl = np.where(dl != 0, _F32(1) / dl, _F32(0))
        codes = best_index_int8(x_blocks.reshape(n, 8, 32) * inv_dl[..., None])
        ls = (ls + 32).astype(np.uint16)
        blocks = np.empty((n, cls.type_size), dtype=np.uint8)
        blocks[:, 0:2] = fp32_to_fp16_bits(d).reshape(n, 1).view(np.uint8)
        scales_h = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
        blocks[:, 2:4] = scales_h.astype("<u2").reshape(n, 1).view(np.uint8)
        low = (ls & 0x0F).astype(np.uint8).reshape(n, 4, 2)
        blocks[:, 4:8] = low[:, :, 0] | (low[:, :, 1] << 4)
        blocks[:, 8:136] = _pack_codes(codes.reshape(n, QK_K))
        return blocks
