"""Chunk dequantizers and fused row dots for the float weight types F32, F16 and BF16.

Float types have no blocks in ggml (block size 1); the kernels still walk their rows in
chunks of ``FLOAT_CHUNK`` weights, so that a dot product is summed in float32 per chunk,
like a quantized block, and in float64 across chunks. A row's last chunk may be shorter:
``k`` need not be a multiple of the chunk.

``deq_*(w, r, b, k, dst)`` writes chunk ``b`` of row ``r`` (of ``k`` weights) to
``dst[:count]`` and returns ``count``; ``vdot_*(x, w, r, k)`` is ``sum_j x[j] * w[r, j]``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from picollama.backends.cpu.intrinsics import (
    FASTMATH,
    bits_from_f32,
    f32_from_bits,
    fmul,
    load_f16,
    load_f32,
    load_u16,
    opaque,
)

__all__ = [
    "FLOAT_CHUNK",
    "f16_to_f32",
    "deq_f32",
    "deq_f16",
    "deq_bf16",
    "vdot_f32",
    "vdot_f16",
    "vdot_bf16",
]

FLOAT_CHUNK = 32

_F32 = np.float32
_TWO_POW_M24 = _F32(2.0**-24)  # the smallest f16 subnormal


@njit(inline="always")
def f16_to_f32(h):
    """IEEE half bits ``h`` (uint16) to float32, bit-exact with numpy's float16 -> float32.

    Written without branches so a loop over an F16 row vectorizes. Normal numbers and
    inf/NaN (payload kept, a signalling NaN stays signalling, as numpy does) are a re-bias of
    the exponent; subnormals are ``mantissa * 2**-24``, exact in float32.
    """
    h32 = np.uint32(h)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    em = h32 & np.uint32(0x7FFF)  # exponent and mantissa
    # exponent bias 15 -> 127 is +112 in the exponent field; inf/NaN (31) go to 255 (+224)
    bias = np.uint32(224 << 23) if em >= np.uint32(0x7C00) else np.uint32(112 << 23)
    value = f32_from_bits((em << np.uint32(13)) + bias)
    if em < np.uint32(0x400):
        value = fmul(_F32(em), _TWO_POW_M24)
    return f32_from_bits(bits_from_f32(value) | sign)


@njit(inline="always")
def _chunk_len(b, k):
    return min(FLOAT_CHUNK, k - b * FLOAT_CHUNK)


@njit(cache=True)
def deq_f32(w, r, b, k, dst):
    count = _chunk_len(b, k)
    base = 4 * FLOAT_CHUNK * b
    for j in range(min(opaque(count), FLOAT_CHUNK)):
        dst[j] = load_f32(w, r, base + 4 * j)
    return count


@njit(cache=True)
def deq_f16(w, r, b, k, dst):
    count = _chunk_len(b, k)
    base = 2 * FLOAT_CHUNK * b
    for j in range(min(opaque(count), FLOAT_CHUNK)):
        dst[j] = f16_to_f32(load_u16(w, r, base + 2 * j))
    return count


@njit(cache=True)
def deq_bf16(w, r, b, k, dst):
    count = _chunk_len(b, k)
    base = 2 * FLOAT_CHUNK * b
    for j in range(min(opaque(count), FLOAT_CHUNK)):
        # a bfloat16 is the top half of a float32
        dst[j] = f32_from_bits(np.uint32(load_u16(w, r, base + 2 * j)) << np.uint32(16))
    return count


# The F16 dot converts with F16C (load_f16), which differs from numpy only in the quiet bit
# of a signalling NaN; a NaN weight makes the sum NaN either way.


@njit(cache=True, fastmath=FASTMATH)
def vdot_f32(x, w, r, k):
    acc = 0.0
    for b in range((k + FLOAT_CHUNK - 1) // FLOAT_CHUNK):
        x0 = FLOAT_CHUNK * b
        s = _F32(0.0)
        for j in range(min(opaque(_chunk_len(b, k)), FLOAT_CHUNK)):
            s += x[x0 + j] * load_f32(w, r, 4 * (x0 + j))
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_f16(x, w, r, k):
    acc = 0.0
    for b in range((k + FLOAT_CHUNK - 1) // FLOAT_CHUNK):
        x0 = FLOAT_CHUNK * b
        s = _F32(0.0)
        for j in range(min(opaque(_chunk_len(b, k)), FLOAT_CHUNK)):
            s += x[x0 + j] * load_f16(w, r, 2 * (x0 + j))
        acc += s
    return acc


@njit(cache=True, fastmath=FASTMATH)
def vdot_bf16(x, w, r, k):
    acc = 0.0
    for b in range((k + FLOAT_CHUNK - 1) // FLOAT_CHUNK):
        x0 = FLOAT_CHUNK * b
        s = _F32(0.0)
        for j in range(min(opaque(_chunk_len(b, k)), FLOAT_CHUNK)):
            bits = np.uint32(load_u16(w, r, 2 * (x0 + j))) << np.uint32(16)
            s += x[x0 + j] * f32_from_bits(bits)
        acc += s
    return acc
