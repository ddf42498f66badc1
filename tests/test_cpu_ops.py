"""CPU backend ops (norms, RoPE, attention, activations) against plain numpy in float64.

Tolerances: the kernels compute in float32 like ggml, so each result carries a few float32
roundings per term: relative 1e-5 of the magnitude involved is far above that (float32 eps
is 1.2e-7) and far below any real error (a wrong index or a missing term shows as O(1)).
"""

from __future__ import annotations

import numpy as np
import pytest

from picollama.backends.cpu import ops

RNG = np.random.default_rng(1234)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _rope_ref(x, positions, n_rot, base, scale, neox):
    x = x.astype(np.float64)
    out = x.copy()
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    for t, pos in enumerate(positions):
        ang = pos * scale * inv
        c, s = np.cos(ang), np.sin(ang)
        if neox:
            a, b = x[t, :, :half], x[t, :, half:n_rot]
            out[t, :, :half] = a * c - b * s
            out[t, :, half:n_rot] = a * s + b * c
        else:
            a, b = x[t, :, 0:n_rot:2], x[t, :, 1:n_rot:2]
            out[t, :, 0:n_rot:2] = a * c - b * s
            out[t, :, 1:n_rot:2] = a * s + b * c
    return out


def _attention_ref(q, k, v, start, scale, window, softcap):
    n, n_heads, _ = q.shape
    n_kv_heads, dv = k.shape[1], v.shape[2]
    group = n_heads // n_kv_heads
    out = np.zeros((n, n_heads, dv))
    for t in range(n):
        pos = start + t
        for h in range(n_heads):
            keys = np.arange(pos + 1)
            if window:
                keys = keys[pos - keys < window]
            s = k[keys, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ v[keys, h // group].astype(np.float64)
    return out.reshape(n, -1)


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("shape", [(1, 576), (7, 640), (3, 4, 256)])
def test_rms_norm(shape, with_weight):
    x = _rand(*shape)
    w = _rand(shape[-1]) if with_weight else None
    eps = 1e-6
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + eps)
    if with_weight:
        ref = ref * w
    got = ops.rms_norm(x, w, eps)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot,head_dim", [(64, 64), (32, 64), (256, 256)])
def test_rope(neox, n_rot, head_dim):
    x = _rand(5, 3, head_dim)
    positions = np.array([0, 1, 17, 511, 4000])
    got = ops.rope(x, positions, n_rot, 10000.0, 0.5, neox)
    ref = _rope_ref(x, positions, n_rot, 10000.0, 0.5, neox)
    # the float32 running product of angles drifts by ~n_rot/2 ulps; at position 4000 the
    # angle is ~2000 rad, so sin/cos move by ~2000 * 32 * 6e-8 ~ 4e-3 relative at worst
    tol = 2e-3 * positions.max() / 1000
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(x).max())
    # position 0 is the identity
    np.testing.assert_array_equal(got[0], x[0])


@pytest.mark.parametrize(
    "n,start,n_heads,n_kv,window,softcap",
    [
        (1, 0, 4, 1, 0, 0.0),
        (1, 37, 9, 3, 0, 0.0),
        (6, 0, 4, 2, 0, 0.0),
        (5, 20, 4, 4, 8, 0.0),
        (3, 10, 2, 1, 0, 50.0),
    ],
)
def test_attention(n, start, n_heads, n_kv, window, softcap):
    head_dim, n_ctx = 32, 64
    q = _rand(n, n_heads, head_dim)
    k = np.zeros((n_ctx, n_kv, head_dim), np.float32)
    v = np.zeros((n_ctx, n_kv, head_dim), np.float32)
    k[: start + n] = _rand(start + n, n_kv, head_dim)
    v[: start + n] = _rand(start + n, n_kv, head_dim)
    scale = 1 / np.sqrt(head_dim)
    got = ops.attention(q, k, v, start, scale, window, softcap)
    ref = _attention_ref(q, k, v, start, scale, window, softcap)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "n,start,n_heads,n_kv,head_dim,window",
    [
        (150, 0, 4, 1, 256, 0),  # Gemma 3's heads; 3 tiles of query rows
        (200, 30, 6, 2, 72, 0),  # 64 lanes in registers, then a tail of 8 one by one
        (130, 5, 4, 2, 96, 100),  # 64 + 16 + 16 lanes; a window across tiles
    ],
)
def test_tiled_attention_lanes_and_tiles(n, start, n_heads, n_kv, head_dim, window):
    """The tiled path (64 query rows or more) scores a tile's 64 keys and sums its values
    lane by lane in registers, 64 or 16 lanes at a time and the rest one by one; tiles of
    query rows go to the threads out of order. Against float64, F16 cache and float32."""
    n_ctx = start + n + 3
    q = _rand(n, n_heads, head_dim)
    k = _rand(n_ctx, n_kv, head_dim).astype(np.float16)
    v = _rand(n_ctx, n_kv, head_dim).astype(np.float16)
    scale = 1 / np.sqrt(head_dim)
    ref = _attention_ref(q, k.astype(np.float64), v.astype(np.float64), start, scale, window, 0)
    for kc, vc in (
        (k.view(np.uint16), v.view(np.uint16)),
        (k.astype(np.float32), v.astype(np.float32)),
    ):
        got = ops.attention(q, kc, vc, start, scale, window)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_silu_and_gelu_mul():
    g, u = _rand(3, 100) * 4, _rand(3, 100)
    g64 = g.astype(np.float64)
    silu = g64 / (1 + np.exp(-g64)) * u
    gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3))) * u
    np.testing.assert_allclose(ops.silu_mul(g, u), silu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.gelu_mul(g, u), gelu, rtol=1e-5, atol=1e-6)


def _f16_round(a):
    return a.astype(np.float16).astype(np.float64)


@pytest.mark.parametrize("n,start,window", [(3, 40, 0), (5, 90, 16), (70, 0, 0), (80, 30, 50)])
def test_attention_f16_cache(n, start, window):
    """The F16 cache (uint16 bits) takes ggml's two flash-attention paths: under 64 query
    rows, Q rounded to F16 and V summed in F16 (each of the <= 111 steps rounds to 2**-11
    relative); from 64 rows, float32 throughout. Against float64 on the same halves."""
    n_heads, n_kv, head_dim, n_ctx = 6, 2, 64, 128
    q = _rand(n, n_heads, head_dim)
    k = np.zeros((n_ctx, n_kv, head_dim), np.float16)
    v = np.zeros((n_ctx, n_kv, head_dim), np.float16)
    k[: start + n] = _rand(start + n, n_kv, head_dim)
    v[: start + n] = _rand(start + n, n_kv, head_dim)
    scale = 1 / np.sqrt(head_dim)
    got = ops.attention(q, k.view(np.uint16), v.view(np.uint16), start, scale, window)
    chunk = n < 64
    qr = _f16_round(q) if chunk else q.astype(np.float64)
    ref = _attention_ref(qr, k.astype(np.float64), v.astype(np.float64), start, scale, window, 0)
    vmax = np.abs(v.astype(np.float64)).max()
    atol = (start + n + 1) * 2.0**-11 * vmax if chunk else 1e-5
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=atol)
    if chunk:  # and the F16 sum really is rounded: not the float32 result
        exact = ops.attention(q, k.astype(np.float32), v.astype(np.float32), start, scale, window)
        assert not np.array_equal(got, exact)


def test_ggml_expf_silu_gelu():
    from picollama.backends.cpu.ggml_math import gelu_mul, silu_mul, v_expf

    xs = np.linspace(-87, 88, 20001).astype(np.float32)
    got = np.array([v_expf(x) for x in xs], np.float64)
    ref = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(got / ref - 1)) < 2.5 * 2.0**-23  # ggml: 1.45 + 0.5 ulp
    assert v_expf(np.float32(-np.inf)) == 0.0 and v_expf(np.float32(0.0)) == 1.0
    assert v_expf(np.float32(200.0)) == np.inf
    g, u = _rand(3, 100) * 4, _rand(3, 100)
    g64 = g.astype(np.float64)
    silu = g64 / (1 + np.exp(-g64)) * u
    gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3))) * u
    np.testing.assert_allclose(silu_mul(g, u), silu, rtol=2e-6, atol=1e-7)
    # GELU from a table of halves, indexed by x rounded to a half: 2**-11 relative in x
    # and in the value, so a few 1e-3 of |x| at most
    np.testing.assert_allclose(gelu_mul(g, u), gelu, rtol=0, atol=4e-3 * np.abs(g * u).max())
    assert gelu_mul(np.float32([[-11.0, 12.0]]), np.float32([[2.0, 2.0]])).tolist() == [[0, 24]]


def test_branch_free_exp_is_ggml_exp_bit_for_bit():
    """v_expf (branch-free, so that SwiGLU's loop vectorizes) gives the bits of ggml's lane
    as written with its branch, everywhere: both range paths (|n| past 126, past 192),
    infinities, NaN, zeros, subnormals."""
    import numba as nb

    from picollama.backends.cpu import ggml_math as gm
    from picollama.backends.cpu.intrinsics import bits_from_f32, f32_from_bits, fma_f32

    f = np.float32

    @nb.njit
    def branching(x):  # ggml_v_expf's lane, with its range test as a branch
        z = fma_f32(x, gm._LOG2E, gm._R)
        n = z - gm._R
        b = fma_f32(-n, gm._LN2_LO, fma_f32(-n, gm._LN2_HI, x))
        e = (np.int64(bits_from_f32(z)) << 23) & 0xFFFFFFFF
        k = f32_from_bits(np.uint32((e + 0x3F800000) & 0xFFFFFFFF))
        u = b * b
        j = fma_f32(
            fma_f32(fma_f32(gm._C4, b, gm._C3), u, fma_f32(gm._C2, b, gm._C1)), u, gm._C0 * b
        )
        if not abs(n) > f(126.0):
            return fma_f32(j, k, k)
        g = np.int64(0x82000000) if n <= f(0.0) else np.int64(0)
        s1 = f32_from_bits(np.uint32((g + 0x7F000000) & 0xFFFFFFFF))
        s2 = f32_from_bits(np.uint32((e - g) & 0xFFFFFFFF))
        if abs(n) > f(192.0):
            return s1 * s1
        return fma_f32(s2, j, s2) * s1

    @nb.njit
    def both(xs):
        a, b = np.empty_like(xs), np.empty_like(xs)
        for i in range(xs.size):
            a[i], b[i] = branching(xs[i]), gm.v_expf(xs[i])
        return a, b

    rng = np.random.default_rng(7)
    edges = [0.0, -0.0, 1e-45, -1e-45, 87.3, -87.3, 88.8, -103.9, 126.0, -126.0, 127.0]
    edges += [-127.0, 150.0, -150.0, 192.0, -192.0, 193.0, -193.0, 1e30, -1e30]
    xs = np.concatenate(
        [
            np.linspace(-200, 200, 400001),
            rng.standard_normal(200000) * 60,
            edges,
            [np.inf, -np.inf, np.nan],
        ]
    ).astype(np.float32)
    a, b = both(xs)
    assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()


def test_activations_by_column_ranges_are_the_whole_rows_bits():
    """The compiled step's tasks each apply SiLU / GELU to their own columns of a gated
    product: the pieces must be the one pass's bits, the rows' tails (past their last full
    group of 8, where ggml's SiLU takes libm's expf instead of its vector exp) included."""
    from picollama.backends.cpu.ggml_math import (
        _gelu_mul_cols,
        _silu_mul_cols,
        expf,
        gelu_mul,
        gelu_table,
        silu_mul,
        v_expf,
    )

    g, u = _rand(3, 37) * 6, _rand(3, 37)  # 37 columns: a tail of 5
    # values whose two exps differ, in the full groups and in the tail
    pool = (_rand(1, 4000) * 6).reshape(-1)
    differ = [x for x in pool if v_expf(-x) != expf(-x)][:6]
    assert len(differ) == 6
    g[0, [3, 20, 33, 34, 35, 36]] = differ
    one = np.float32(1.0)
    want = np.array(
        [
            [
                x / (one + (v_expf(-x) if i < 32 else expf(-x))) * y
                for i, (x, y) in enumerate(zip(gr, ur, strict=True))
            ]
            for gr, ur in zip(g, u, strict=True)
        ],
        np.float32,
    )
    assert silu_mul(g, u).tobytes() == want.tobytes()
    for cuts in ((0, 37), (0, 30, 37), (0, 10, 31, 33, 37), (0, 1, 2, 36, 37)):
        silu, gelu = np.zeros_like(g), np.zeros_like(g)
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            _silu_mul_cols(g, u, silu, lo, hi)
            _gelu_mul_cols(g, u, gelu, gelu_table(), lo, hi)
        assert silu.tobytes() == want.tobytes(), cuts
        assert gelu.tobytes() == gelu_mul(g, u).tobytes(), cuts
