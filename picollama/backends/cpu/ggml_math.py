"""ggml-cpu's float arithmetic where it is not IEEE-exact, reproduced bit for bit.

llama.cpp's CPU backend computes exp, SiLU and GELU with approximations of its own, and its
results follow them to the last bit. Our "ggml" arithmetic uses the same ones, so a layer's
output equals llama.cpp's instead of differing in the last bits (which the next 8-bit
activation rounding would amplify):

- ``v_expf``: the AVX2 ``ggml_v_expf`` (after ARM's optimized routines: 1.45 + 0.5 ulp),
  one SIMD lane, with the same FMAs and constants;
- ``silu_mul``: ``ggml_vec_swiglu_f32``: ``x / (1 + v_expf(-x)) * g`` for every full
  group of 8, ``x / (1 + expf(-x)) * g`` for the tail;
- ``gelu_mul``: ``ggml_vec_geglu_f32`` with ``GGML_GELU_FP16``: GELU looked up in a table
  of IEEE halves, indexed by ``x`` rounded to a half (``gelu_table``, built on first use);
  0 below -10, ``x`` above 10.

All are compiled without fast-math, so LLVM keeps every rounding.
"""

from __future__ import annotations

import functools
import math

import numba as nb
import numpy as np

from picollama.backends.cpu.intrinsics import bits_from_f32, f16_bits, f32_from_bits, fma_f32

__all__ = ["v_expf", "silu_mul", "gelu_mul", "gelu_table", "expf", "hsum8_f32"]

_F = np.float32
_JIT = dict(nogil=True, cache=True, fastmath=False)

_R = _F(float.fromhex("0x1.8p23"))
_LOG2E = _F(float.fromhex("0x1.715476p+0"))
_LN2_HI = _F(float.fromhex("0x1.62e4p-1"))
_LN2_LO = _F(float.fromhex("0x1.7f7d1cp-20"))
_C4 = _F(float.fromhex("0x1.0e4020p-7"))
_C3 = _F(float.fromhex("0x1.573e2ep-5"))
_C2 = _F(float.fromhex("0x1.555e66p-3"))
_C1 = _F(float.fromhex("0x1.fffdb6p-2"))
_C0 = _F(float.fromhex("0x1.ffffecp-1"))


@nb.njit(inline="always", **_JIT)
def v_expf(x):
    """One lane of ggml's AVX2 ``ggml_v_expf``: exp(x) for float32 ``x``. Without branches:
    the bits in 32-bit integers, both of ggml's paths computed and the one |n| picks kept (as
    ggml's AVX2 code blends them), so that a loop over it vectorizes (SwiGLU of 8 rows of
    1536: 54 -> 37 us); a test compares it with the branching form, bit for bit."""
    u32 = np.uint32
    x = _F(x)
    z = fma_f32(x, _LOG2E, _R)
    n = z - _R
    b = fma_f32(-n, _LN2_LO, fma_f32(-n, _LN2_HI, x))
    e = u32(bits_from_f32(z) << u32(23))
    k = f32_from_bits(u32(e + u32(0x3F800000)))
    u = b * b
    j = fma_f32(fma_f32(fma_f32(_C4, b, _C3), u, fma_f32(_C2, b, _C1)), u, _C0 * b)
    fast = fma_f32(j, k, k)
    g = u32(0x82000000) if n <= _F(0.0) else u32(0)
    s1 = f32_from_bits(u32(g + u32(0x7F000000)))
    s2 = f32_from_bits(u32(e - g))
    an = abs(n)
    slow = s1 * s1 if an > _F(192.0) else fma_f32(s2, j, s2) * s1
    return fast if not an > _F(126.0) else slow


@nb.njit(**_JIT)
def expf(x):
    """libm's ``expf`` of float32 ``x`` (Numba calls it for a float32 argument), as ggml's
    scalar code does."""
    return math.exp(_F(x))


@nb.njit(**_JIT)
def hsum8_f32(v, i0):
    """ggml's ``hsum_float_8`` of ``v[i0 : i0 + 8]``: (hi + lo), upper pair onto lower, 0 + 1."""
    a0 = v[i0 + 4] + v[i0]
    a1 = v[i0 + 5] + v[i0 + 1]
    a2 = v[i0 + 6] + v[i0 + 2]
    a3 = v[i0 + 7] + v[i0 + 3]
    return (a0 + a2) + (a1 + a3)


@nb.njit(error_model="numpy", **_JIT)  # IEEE division, as ggml: no check in the loop
def _silu_mul_cols(gate, up, out, lo, hi):
    """``_silu_mul`` of columns ``lo..hi`` only, each element as the whole row's pass
    computes it (``v_expf`` in the row's full groups of 8, ``expf`` in its tail), so that
    tasks that each take a range of columns give the one pass's bits."""
    n_rows, n = gate.shape
    mid = min(max(n - n % 8, lo), hi)
    for r in range(n_rows):
        # slices first, then loops from 0: an index that starts at a run-time ``lo`` may
        # be negative as far as LLVM knows (Numba wraps those), and the loop then stays
        # scalar (8 rows of 1536: 102 us against 23 us from index 0)
        g, u, o = gate[r, lo:mid], up[r, lo:mid], out[r, lo:mid]
        for i in range(g.shape[0]):
            x = g[i]
            o[i] = (x / (_F(1.0) + v_expf(_F(0.0) - x))) * u[i]
        g, u, o = gate[r, mid:hi], up[r, mid:hi], out[r, mid:hi]
        for i in range(g.shape[0]):
            x = g[i]
            o[i] = (x / (_F(1.0) + expf(-x))) * u[i]  # ggml_silu_f32


@nb.njit(**_JIT)
def _silu_mul(gate, up, out):
    _silu_mul_cols(gate, up, out, 0, gate.shape[1])


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` as ggml_vec_swiglu_f32 computes it, over the last axis."""
    shape = gate.shape
    g = np.ascontiguousarray(gate, np.float32).reshape(-1, shape[-1])
    out = np.empty_like(g)
    _silu_mul(g, np.ascontiguousarray(up, np.float32).reshape(g.shape), out)
    return out.reshape(shape)


@nb.njit(**_JIT)
def _gelu_f32(x):
    """ggml_gelu_f32 as compiled: 1 + a*x*x contracted to one FMA; tanhf from libm."""
    inner = _F(0.79788456080286535587989211986876) * x * fma_f32(_F(0.044715) * x, x, _F(1.0))
    return _F(0.5) * x * (_F(1.0) + math.tanh(inner))


@nb.njit(**_JIT)
def _gelu_of_halves(halves):
    out = np.empty_like(halves)
    for i in range(halves.size):
        out[i] = _gelu_f32(halves[i])
    return out


@functools.cache
def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 as float32: fp16(gelu(h)) for every half ``h``."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        return _gelu_of_halves(h).astype(np.float16).astype(np.float32)


@nb.njit(**_JIT)
def _gelu_mul_cols(gate, up, out, table, lo, hi):
    """``_gelu_mul`` of columns ``lo..hi`` only (an element's value is its own alone)."""
    for r in range(gate.shape[0]):
        g, u, o = gate[r, lo:hi], up[r, lo:hi], out[r, lo:hi]  # from 0: see _silu_mul_cols
        for i in range(g.shape[0]):
            x = g[i]
            if x <= _F(-10.0):
                o[i] = 0.0
            elif x >= _F(10.0):
                o[i] = x * u[i]
            else:
                o[i] = table[np.int64(f16_bits(x))] * u[i]


@nb.njit(**_JIT)
def _gelu_mul(gate, up, out, table):
    _gelu_mul_cols(gate, up, out, table, 0, gate.shape[1])


def gelu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gelu(gate) * up`` as ggml_vec_geglu_f32 computes it (the F16 table), last axis."""
    shape = gate.shape
    g = np.ascontiguousarray(gate, np.float32).reshape(-1, shape[-1])
    out = np.empty_like(g)
    _gelu_mul(g, np.ascontiguousarray(up, np.float32).reshape(g.shape), out, gelu_table())
    return out.reshape(shape)
