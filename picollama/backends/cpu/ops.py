"""Numba kernels for the CPU backend's non-matmul ops: norms, RoPE, attention, activations.

Each follows ggml's CPU arithmetic where that decides the result (float64 sums in the
RMS norm, the float32 running product of RoPE angles), so our logits stay close to
llama.cpp's. Arrays are C-contiguous float32 numpy arrays.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

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
            v = np.float64(x[i, j])
            acc += v * v
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
def _rope(x, positions, n_rot, freq_base, freq_scale, neox, out):
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
            cos_t[i] = np.float32(math.cos(angle))
            sin_t[i] = np.float32(math.sin(angle))
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
) -> np.ndarray:
    """Rotary position embedding of ``x`` (n_tokens, n_heads, head_dim)."""
    out = np.empty_like(x)
    _rope(
        np.ascontiguousarray(x, dtype=np.float32),
        np.ascontiguousarray(positions, dtype=np.int64),
        n_rot,
        np.float32(freq_base),
        np.float32(freq_scale),
        neox,
        out,
    )
    return out


def _attention_impl(q, k_cache, v_cache, start, scale, window, softcap, out):
    n, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[1]
    head_dim_v = v_cache.shape[2]
    group = n_heads // n_kv_heads
    n_kv = start + n
    for job in nb.prange(n * n_heads):
        t = job // n_heads
        h = job % n_heads
        kvh = h // group
        pos = start + t
        lo = 0
        if window > 0 and pos - window + 1 > 0:
            lo = pos - window + 1
        hi = pos + 1  # causal: keys at positions <= pos
        if hi > n_kv:
            hi = n_kv
        scores = np.empty(hi - lo, np.float32)
        best = np.float32(-np.inf)
        for j in range(lo, hi):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q[t, h, d] * k_cache[j, kvh, d]
            s *= scale
            if softcap > 0:
                s = np.float32(softcap * math.tanh(s / softcap))
            scores[j - lo] = s
            if s > best:
                best = s
        total = 0.0
        for j in range(hi - lo):
            e = np.float32(math.exp(scores[j] - best))
            scores[j] = e
            total += e
        inv = np.float32(1.0 / total)
        for d in range(head_dim_v):
            out[t, h * head_dim_v + d] = 0.0
        for j in range(lo, hi):
            p = scores[j - lo] * inv
            for d in range(head_dim_v):
                out[t, h * head_dim_v + d] += p * v_cache[j, kvh, d]


# The same kernel compiled twice: a parallel region costs tens of microseconds to start,
# more than a short decode-time attention takes, so small jobs run on one thread.
_attention = nb.njit(parallel=True, **_JIT)(_attention_impl)
_attention_serial = nb.njit(**_JIT)(_attention_impl)
_PARALLEL_MIN_WORK = 1 << 16  # query-key dot products


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    start: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """Causal GQA attention of ``q`` (n_tokens, n_heads, head_dim) against the cache."""
    n, n_heads, _ = q.shape
    out = np.empty((n, n_heads * v_cache.shape[2]), np.float32)
    work = n * n_heads * (start + n) * q.shape[2]
    kernel = _attention if work >= _PARALLEL_MIN_WORK else _attention_serial
    kernel(
        np.ascontiguousarray(q, dtype=np.float32),
        k_cache,
        v_cache,
        start,
        np.float32(scale),
        window,
        np.float32(softcap),
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


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return (np.tanh(x / np.float32(cap)) * np.float32(cap)).astype(np.float32, copy=False)
