"""Numba kernels for the CPU backend's non-matmul ops: norms, RoPE, attention, activations.

Each follows ggml's CPU arithmetic where that decides the result (float64 sums in the
RMS norm, the float32 running product of RoPE angles), so our logits stay close to
llama.cpp's. Arrays are C-contiguous float32 numpy arrays.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from picollama.backends.cpu.attention import attention
from picollama.backends.cpu.intrinsics import fma_f32

__all__ = [
    "rms_norm",
    "rope",
    "attention",
    "silu_mul",
    "gelu_mul",
    "softcap",
]

_JIT = dict(nogil=True, cache=True, fastmath=False)

# ggml's GELU constants (ggml-cpu/vec.h): tanh approximation
_GELU_COEF_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)


@nb.njit(**_JIT)
def _rms_norm(x, w, eps, has_w, out):
    n, d = x.shape
    for i in range(n):
        acc = 0.0  # float64, as ggml_float
        for j in range(d):
            acc += np.float64(x[i, j] * x[i, j])  # the square in float32, as ggml
        mean = np.float32(acc / d)
        scale = np.float32(1.0) / np.float32(math.sqrt(mean + eps))
        if has_w:
            for j in range(d):
                out[i, j] = (x[i, j] * scale) * w[j]
        else:
            for j in range(d):
                out[i, j] = x[i, j] * scale


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMS norm over the last axis of ``x`` (any leading shape), times ``w`` if given."""
    shape = x.shape
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, shape[-1])
    out = np.empty_like(x2)
    has_w = w is not None
    w_arr = w if has_w else np.empty(0, np.float32)
    _rms_norm(x2, w_arr, np.float32(eps), has_w, out)
    return out.reshape(shape)


@nb.njit(**_JIT)
def _rope(x, positions, n_rot, freq_base, freq_scale, neox, fused, out):
    n, n_heads, head_dim = x.shape
    theta_scale = np.float32(freq_base ** (np.float32(-2.0) / np.float32(n_rot)))
    half = n_rot // 2
    cos_t = np.empty(half, np.float32)
    sin_t = np.empty(half, np.float32)
    for t in range(n):
        # ggml_rope_cache_init: the angle is a float32 running product over the pairs
        theta = np.float32(positions[t])
        for i in range(half):
            angle = freq_scale * theta
            cos_t[i] = math.cos(angle)  # cosf, sinf: float32 in, float32 out
            sin_t[i] = math.sin(angle)
            theta = np.float32(theta * theta_scale)
        for h in range(n_heads):
            for i in range(half):
                if neox:
                    a = i
                    b = i + half
                else:
                    a = 2 * i
                    b = 2 * i + 1
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                if fused:
                    # ggml's rotate_pairs as compiled: the first product fused into the sum
                    out[t, h, a] = fma_f32(x0, cos_t[i], -(x1 * sin_t[i]))
                    out[t, h, b] = fma_f32(x0, sin_t[i], x1 * cos_t[i])
                else:
                    out[t, h, a] = x0 * cos_t[i] - x1 * sin_t[i]
                    out[t, h, b] = x0 * sin_t[i] + x1 * cos_t[i]
            for j in range(n_rot, head_dim):
                out[t, h, j] = x[t, h, j]


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    n_rot: int,
    freq_base: float,
    freq_scale: float = 1.0,
    neox: bool = False,
    fused: bool = False,
) -> np.ndarray:
    """Rotary position embedding of ``x`` (n_tokens, n_heads, head_dim); ``fused``: round
    as ggml's compiled rotation does (one product fused into each sum)."""
    out = np.empty_like(x)
    _rope(
        np.ascontiguousarray(x, dtype=np.float32),
        np.ascontiguousarray(positions, dtype=np.int64),
        n_rot,
        np.float32(freq_base),
        np.float32(freq_scale),
        neox,
        fused,
        out,
    )
    return out


@nb.njit(**_JIT)
def _silu_mul(gate, up, out):
    g = gate.ravel()
    u = up.ravel()
    o = out.ravel()
    for i in range(g.size):
        x = g[i]
        o[i] = x / (np.float32(1.0) + np.float32(math.exp(-x))) * u[i]


@nb.njit(**_JIT)
def _gelu_mul(gate, up, out):
    g = gate.ravel()
    u = up.ravel()
    o = out.ravel()
    for i in range(g.size):
        x = g[i]
        inner = _SQRT_2_OVER_PI * x * (np.float32(1.0) + _GELU_COEF_A * x * x)
        o[i] = np.float32(0.5) * x * (np.float32(1.0) + np.float32(math.tanh(inner))) * u[i]


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.empty_like(gate)
    _silu_mul(np.ascontiguousarray(gate), np.ascontiguousarray(up), out)
    return out


def gelu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.empty_like(gate)
    _gelu_mul(np.ascontiguousarray(gate), np.ascontiguousarray(up), out)
    return out


@nb.njit(**_JIT)
def _softcap(x, inv_cap, cap, out):
    """``tanh(x * (1 / cap)) * cap`` in float32, as llama.cpp's graph (scale, tanh, scale)."""
    xs, o = x.reshape(-1), out.reshape(-1)
    for i in range(xs.shape[0]):
        o[i] = np.float32(math.tanh(xs[i] * inv_cap)) * cap


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _softcap(x, np.float32(1.0 / cap), np.float32(cap), out)
    return out
