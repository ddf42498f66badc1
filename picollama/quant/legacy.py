"""The legacy 32-weight block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.

Quantizers follow ``quantize_row_*_ref`` in ggml-quants.c; a weight ``i`` of a block sits in
the low nibble of byte ``i`` for ``i < 16`` and in the high nibble of byte ``i - 16`` after.
"""

from __future__ import annotations

import numpy as np

from picollama.gguf.constants import GGMLType
from picollama.quant.base import Quant, first_absmax, fp16_to_fp32, fp32_to_fp16_bits, roundf

__all__ = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1"]


def _out(out: np.ndarray | None, n_blocks: int) -> np.ndarray:
    return np.empty((n_blocks, 32), dtype=np.float32) if out is None else out


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) uint8 codes in weight order (low nibbles first)."""
    q = np.empty((qs.shape[0], 2, 16), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, 0])
    np.right_shift(qs, 4, out=q[:, 1])
    return q.reshape(-1, 32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) codes < 16 -> (n, 16) bytes, the inverse of :func:`_nibbles`."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits as 0 or 16, bit i for weight i."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit codes -> (n, 4) bytes holding bit 4 of weight i in bit i."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _to_int(v: np.ndarray) -> np.ndarray:
    """C's float -> integer conversion (truncation; x86 gives INT_MIN for NaN and overflow)."""
    with np.errstate(invalid="ignore"):
        return v.astype(np.int32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``"""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)


_FLT_MAX = np.float32(np.finfo(np.float32).max)


def _min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the C scan from ``min = FLT_MAX, max = -FLT_MAX`` with ``v < min``, ``v > max``.

    x[argmin] rather than min(): the first of a -0.0/+0.0 tie wins; NaNs never do.
    """
    vmin = x[np.arange(x.shape[0]), np.argmin(np.where(np.isnan(x), np.inf, x), axis=1)]
    vmax = x[np.arange(x.shape[0]), np.argmax(np.where(np.isnan(x), -np.inf, x), axis=1)]
    return np.fmin(vmin, _FLT_MAX), np.fmax(vmax, -_FLT_MAX)


def _store_fp16(blocks: np.ndarray, offset: int, value: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = fp32_to_fp16_bits(value).reshape(-1, 1).view(np.uint8)


# Q4_0: 32 weights in 18 bytes (d, qs[16]); w = d * (q - 8)
class Q4_0(Quant, qtype=GGMLType.Q4_0):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        d = fp16_to_fp32(blocks[:, 0:2])
        q = _nibbles(blocks[:, 2:18]).view(np.int8) - np.int8(8)
        np.multiply(q, d[:, None], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        x = x_blocks
        _, vmax = first_absmax(x, axis=1)
        d = vmax / np.float32(-8)
        xi = _to_int(x * _inverse(d)[:, None] + np.float32(8.5)).astype(np.int8)
        blocks = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        _store_fp16(blocks, 0, d)
        blocks[:, 2:] = _pack_nibbles(np.minimum(xi, 15).view(np.uint8))
        return blocks


# Q4_1: 32 weights in 20 bytes (d, m, qs[16]); w = d * q + m
class Q4_1(Quant, qtype=GGMLType.Q4_1):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        d = fp16_to_fp32(blocks[:, 0:2])
        m = fp16_to_fp32(blocks[:, 2:4])
        np.multiply(_nibbles(blocks[:, 4:20]), d[:, None], out=out)
        np.add(out, m[:, None], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        x = x_blocks
        vmin, vmax = _min_max(x)
        d = (vmax - vmin) / np.float32(15)
        x0 = (x - vmin[:, None]) * _inverse(d)[:, None]
        xi = _to_int(x0 + np.float32(0.5)).astype(np.int8)
        blocks = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        _store_fp16(blocks, 0, d)
        _store_fp16(blocks, 2, vmin)
        blocks[:, 4:] = _pack_nibbles(np.minimum(xi, 15).view(np.uint8))
        return blocks


# Q5_0: 32 weights in 22 bytes (d, qh[4], qs[16]); w = d * (q - 16), bit 4 of q in qh
class Q5_0(Quant, qtype=GGMLType.Q5_0):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        d = fp16_to_fp32(blocks[:, 0:2])
        q = _nibbles(blocks[:, 6:22])
        q |= _high_bits(blocks[:, 2:6])
        np.multiply(q.view(np.int8) - np.int8(16), d[:, None], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        x = x_blocks
        _, vmax = first_absmax(x, axis=1)
        d = vmax / np.float32(-16)
        xi = _to_int(x * _inverse(d)[:, None] + np.float32(16.5)).astype(np.int8)
        q = np.minimum(xi, 31).view(np.uint8)
        blocks = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        _store_fp16(blocks, 0, d)
        blocks[:, 2:6] = _pack_high_bits(q)
        blocks[:, 6:] = _pack_nibbles(q & 0x0F)
        return blocks


# Q5_1: 32 weights in 24 bytes (d, m, qh[4], qs[16]); w = d * q + m, bit 4 of q in qh
class Q5_1(Quant, qtype=GGMLType.Q5_1):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        d = fp16_to_fp32(blocks[:, 0:2])
        m = fp16_to_fp32(blocks[:, 2:4])
        q = _nibbles(blocks[:, 8:24])
        q |= _high_bits(blocks[:, 4:8])
        np.multiply(q, d[:, None], out=out)
        np.add(out, m[:, None], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        x = x_blocks
        vmin, vmax = _min_max(x)
        d = (vmax - vmin) / np.float32(31)
        x0 = (x - vmin[:, None]) * _inverse(d)[:, None]
        q = _to_int(x0 + np.float32(0.5)).astype(np.uint8)  # no MIN(31, ...) in the C
        blocks = np.empty((x.shape[0], cls.type_size), dtype=np.uint8)
        _store_fp16(blocks, 0, d)
        _store_fp16(blocks, 2, vmin)
        blocks[:, 4:8] = _pack_high_bits(q)
        blocks[:, 8:] = _pack_nibbles(q & 0x0F)
        return blocks


def _quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shared part of Q8_0 and Q8_1: ``d = amax / 127`` and ``q = roundf(x / d)``."""
    ax = np.abs(x)
    amax = np.max(ax, axis=1)
    nan = np.isnan(amax)
    if nan.any():
        # C: amax = MAX(amax, fabsf(v)) is (amax > a ? amax : a): a NaN replaces the running
        # value and the next weight replaces the NaN, so only weights after the last NaN
        # count, and a NaN in the last place survives.
        pos = np.arange(x.shape[1])
        last_nan = np.max(np.where(np.isnan(ax[nan]), pos, -1), axis=1, keepdims=True)
        tail = np.where(pos > last_nan, ax[nan], np.float32(0)).max(axis=1)
        amax[nan] = np.where(last_nan[:, 0] == x.shape[1] - 1, np.float32(np.nan), tail)
    d = amax / np.float32(127)
    q = _to_int(roundf(x * _inverse(d)[:, None])).astype(np.int8)
    return d, q


# Q8_0: 32 weights in 34 bytes (d, qs[32]); w = d * q
class Q8_0(Quant, qtype=GGMLType.Q8_0):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        d = fp16_to_fp32(blocks[:, 0:2])
        np.multiply(blocks[:, 2:34].view(np.int8), d[:, None], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        d, q = _quantize_q8(x_blocks)
        blocks = np.empty((x_blocks.shape[0], cls.type_size), dtype=np.uint8)
        _store_fp16(blocks, 0, d)
        blocks[:, 2:] = q.view(np.uint8)
        return blocks


# Q8_1: 32 weights in 36 bytes (d, s, qs[32]); w = d * q, s = d * sum(q) for dot products
class Q8_1(Quant, qtype=GGMLType.Q8_1):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        # ggml has no dequantize_row_q8_1; this is its Q8_0 rule applied to (d, qs).
        out = _out(out, blocks.shape[0])
        d = fp16_to_fp32(blocks[:, 0:2])
        np.multiply(blocks[:, 4:36].view(np.int8), d[:, None], out=out)
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        d, q = _quantize_q8(x_blocks)
        total = q.sum(axis=1, dtype=np.int32)  # integer sum: order does not matter
        blocks = np.empty((x_blocks.shape[0], cls.type_size), dtype=np.uint8)
        _store_fp16(blocks, 0, d)
        _store_fp16(blocks, 2, total.astype(np.float32) * d)
        blocks[:, 4:] = q.view(np.uint8)
        return blocks
