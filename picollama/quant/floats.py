"""Plain float types: F32, F16, BF16 (a block of one weight)."""

from __future__ import annotations

import numpy as np

from picollama.gguf.constants import GGMLType
from picollama.quant.base import Quant, fp32_to_fp16_bits

__all__ = ["F32", "F16", "BF16"]


def _out(out: np.ndarray | None, n_blocks: int) -> np.ndarray:
    return np.empty((n_blocks, 1), dtype=np.float32) if out is None else out


# F32: 1 weight in 4 bytes (IEEE binary32, little-endian)
class F32(Quant, qtype=GGMLType.F32):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        out[...] = blocks.view("<f4")
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        return np.ascontiguousarray(x_blocks, dtype="<f4").view(np.uint8)


# F16: 1 weight in 2 bytes (IEEE binary16, little-endian)
class F16(Quant, qtype=GGMLType.F16):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        out[...] = blocks.view("<f2")  # fp16 -> fp32 is exact
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        return np.ascontiguousarray(fp32_to_fp16_bits(x_blocks)).view(np.uint8)


# BF16: 1 weight in 2 bytes (the high half of a binary32)
class BF16(Quant, qtype=GGMLType.BF16):
    @classmethod
    def dequantize_blocks(cls, blocks, out=None):
        out = _out(out, blocks.shape[0])
        out.view(np.uint32)[...] = blocks.view("<u2").astype(np.uint32) << 16
        return out

    @classmethod
    def quantize_blocks(cls, x_blocks):
        # ggml_compute_fp32_to_bf16: NaN keeps its top bits and is forced quiet; everything
        # else rounds to nearest even by adding 0x7fff plus the lowest kept bit.
        u = np.ascontiguousarray(x_blocks, dtype=np.float32).view(np.uint32)
        rounded = ((u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint32)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        bits = np.where(nan, (u >> 16) | 64, rounded).astype("<u2")
        return bits.view(np.uint8)
