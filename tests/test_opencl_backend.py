"""OpenCL backend: every op and every quant type against the references, on an OpenCL device.

In CI the device is PoCL's CPU device (``pip install '.[test]'`` brings PyOpenCL and PoCL).
Without PyOpenCL or without any OpenCL platform the device tests skip with the reason; the
array, layout and error-message tests run everywhere.

Two backends run every device test (fixture ``be``):
- "cpu-shape": what PoCL gets by default: one work-item per matvec row, the matvec over
  groups of 16 tokens for longer batches, double precision for the sums of squares and the
  transcendentals (PoCL reports cl_khr_fp64);
- "gpu-shape-fp32": the shape GPUs get (16 work-items per matvec row, their partial sums
  added in local memory; the tiled gemm kernel above 8 tokens) with the float32 fallback a
  device without cl_khr_fp64 gets, so both code paths are checked on PoCL.

Error bounds, and why:
- Dequantization (get_rows) is bit-exact for every type: the kernels repeat ggml's float32
  operations in order (FP_CONTRACT off), so they must equal ``picollama.quant.dequantize``.
- matmul, for every type: the weights are dequantized exactly, so the only error is float32
  summation (fma chains in 8 lanes and a fixed tree for the matvec; one fma chain per output
  for the gemm). The classical bound for a float32 sum of k products is
  ``|err| <= gamma_k * sum_j |x_j w_j|`` with ``gamma_k ~ k * 2**-24``; we allow
  ``(k + 32) * 2**-24 * (|x| @ |W|^T)`` per output. The tolerance is the same for every
  type because the type only changes the weights, not the arithmetic: a type whose decoder
  is wrong by one code moves outputs by ~|x| * d, thousands of times the bound, and fp16
  arithmetic (11-bit mantissas) would break it by ~2**13. The worst err/bound per type is
  printed (pytest -s).
- Non-matmul ops follow the CPU backend's float32 operation order; see each test. Without
  double precision, OpenCL's float32 functions are allowed a few ulps (exp 3, tanh 5, cos
  and sin 4, division 2.5, sqrt 3), so those tolerances are wider for "gpu-shape-fp32".
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from picollama.backends.base import BackendError, KVCache, get_backend
from picollama.backends.cuda import layout
from picollama.backends.opencl.array import CLArray
from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant import dequantize, quantize

CONFIGS = {
    "cpu-shape": {"mv_lanes": 1},
    "gpu-shape-fp32": {"mv_lanes": 16, "fp64": False},
}


def _opencl(**options):
    try:
        return get_backend("opencl", **options)
    except BackendError as err:
        pytest.skip(f"OpenCL backend unavailable here: {err}")


@pytest.fixture(scope="module", params=list(CONFIGS))
def be(request):
    return _opencl(**CONFIGS[request.param])


@pytest.fixture(scope="module")
def be_default():
    return _opencl()


# -- no device needed ---------------------------------------------------------------------


def test_missing_pyopencl_is_a_backend_error(monkeypatch):
    """Without PyOpenCL, asking for the backend is a BackendError that says how to get it."""
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # import pyopencl raises ImportError
    monkeypatch.setitem(sys.modules, "pyopencl.tools", None)
    with pytest.raises(BackendError, match=r"PyOpenCL.*picollama\[opencl\]"):
        get_backend("opencl")


def test_no_platform_is_a_backend_error(monkeypatch):
    """An ICD loader that finds no platform raises; the backend says so in its own words."""
    cl = pytest.importorskip("pyopencl")

    def no_platforms():
        raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(cl, "get_platforms", no_platforms)
    with pytest.raises(BackendError, match="no OpenCL platform"):
        get_backend("opencl")
    monkeypatch.setattr(cl, "get_platforms", lambda: [])
    with pytest.raises(BackendError, match="no OpenCL device"):
        get_backend("opencl")


def test_clarray_views():
    a = CLArray(object(), (6, 4, 8))
    assert a.size == 192 and a.nbytes == 768 and a.ndim == 3 and len(a) == 6
    b = a.reshape(6, -1)
    assert b.shape == (6, 32) and b.buf is a.buf
    c = a[2:5]
    assert c.shape == (3, 4, 8) and c.offset == 64
    assert c.reshape(3, 32)[1:].offset == 96
    assert a[4:99].shape[0] == 2 and a[5:2].shape[0] == 0
    with pytest.raises(ValueError):
        a.reshape(5, -1)
    with pytest.raises(TypeError):
        a[::2]


def test_sources_name_every_supported_type():
    """Each type's program defines its decoder's macro and the layout's field sizes, which
    quant.cl checks with #error against the sizes its decoder reads."""
    from picollama.backends.opencl import programs

    shape = programs.KernelShape()
    for qtype in layout.SUPPORTED_TYPES:
        src = programs.quant_source(qtype, shape)
        assert f"#define QTYPE_{qtype.name} 1" in src
        assert f"defined(QTYPE_{qtype.name})" in programs._read("quant.cl")


# -- device selection -----------------------------------------------------------------------


def test_device_selection(be_default, monkeypatch):
    from picollama.backends.opencl.device import list_devices, select_device

    cl = be_default.cl
    found = list_devices(cl)
    assert found
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    p, d, info = found[0]
    assert select_device(cl, 0).label == info.label
    assert select_device(cl, f"{p}:{d}").label == info.label
    assert select_device(cl, str(p)).platform_name == info.platform_name
    assert select_device(cl, info.name[:6].upper()).label == info.label  # a name, any case
    if "pocl" in info.search_text:
        assert select_device(cl, "PoCL").label == info.label  # PoCL's platform version
    monkeypatch.setenv("PYOPENCL_CTX", f"{p}:{d}")
    assert select_device(cl, None).label == info.label
    for bad in (len(found), "99:0", "no such device"):
        with pytest.raises(BackendError, match="not found; the devices here are: 0 = "):
            select_device(cl, bad)


def test_device_option_reaches_the_backend(be_default):
    from picollama.backends.base import backend_on_device

    name = be_default.info.name
    backend = backend_on_device("opencl", name, None)
    assert backend.info.name == name
    assert backend_on_device("opencl", "0", None).info.label  # a digit string: an index
    with pytest.raises(BackendError, match="no devices to pick"):
        backend_on_device("cpu", "0", None)


# -- quantized weights ----------------------------------------------------------------------

TYPES = sorted(layout.SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_get_rows_and_matmul_every_type(be, qtype):
    rng = np.random.default_rng(1000 + int(qtype))
    block = layout.chunk_block(qtype)
    k = 3 * block if block == 256 else 7 * block  # several blocks, not a power of two
    m = 131  # not a multiple of any tile or work-group
    w = rng.standard_normal((m, k)).astype(np.float32)
    raw = quantize(w, qtype).reshape(m, -1)
    W = dequantize(raw, qtype).reshape(m, k)
    wt = be.weight("w", qtype, (k, m), raw)
    assert be.supports("matmul", qtype)

    ids = np.array([0, m - 1, 7, 7, 64])
    rows = be.to_host(be.get_rows(wt, ids))
    assert np.array_equal(rows, W[ids]), "dequantization must be bit-exact"

    W64 = W.astype(np.float64)
    worst = 0.0
    # cpu-shape: the matvec over groups of 16 tokens (37 = 16 + 16 + 5); gpu-shape: the
    # matvec up to 8 tokens, the tiled gemm (64 rows x 32 tokens per tile) above
    for n in (1, 3, 8, 9, 37):
        x = rng.standard_normal((n + 2, k)).astype(np.float32)
        dx = be.from_host(x)[2:]  # a view at an offset, as the model's row slices are
        x = x[2:]
        y = be.to_host(be.matmul(dx, wt))
        ref = x.astype(np.float64) @ W64.T
        bound = (k + 32) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(W64).T)
        err = np.abs(y - ref)
        assert y.shape == (n, m)
        assert np.all(err <= bound), (n, float((err / (bound + 1e-30)).max()))
        worst = max(worst, float((err / (bound + 1e-30)).max()))
        rel = float(err.max() / np.abs(ref).max())
        print(f"{qtype.name} n={n}: err/bound {worst:.3f}, max err {err.max():.2e}, rel {rel:.2e}")


def test_weight_rejects_bad_rows(be_default):
    be = be_default
    raw = np.zeros((2, GGML_TYPES[GGMLType.Q4_0].type_size), np.uint8)
    with pytest.raises(BackendError, match="multiple of"):
        be.weight("odd", GGMLType.F32, (20, 3), np.zeros(240, np.uint8))
    with pytest.raises(BackendError, match="bytes of data"):
        be.weight("short", GGMLType.Q4_0, (64, 2), raw)
    with pytest.raises(BackendError, match="not supported"):
        be.weight("iq2", GGMLType.IQ2_XXS, (256, 1), np.zeros(66, np.uint8))
    assert not be.supports("matmul", GGMLType.IQ2_XXS)


def test_model_that_does_not_fit_is_a_backend_error(be_default, monkeypatch):
    from dataclasses import replace

    be = be_default
    with pytest.raises(BackendError, match="does not fit"):
        be.new_kv_cache(1, 1 << 30, 8, 128, 128)  # 4 TiB of F16
    # a device whose largest buffer is 1 KiB: a 2 KiB weight is refused before allocating
    monkeypatch.setattr(be, "info", replace(be.info, max_alloc=1024))
    raw = np.zeros((64, 34), np.uint8)
    with pytest.raises(BackendError, match="does not fit.*'big'.*largest"):
        be.weight("big", GGMLType.Q8_0, (32, 64), raw)


def test_memory_report(be_default):
    be = be_default
    before = be.memory_report()
    raw = quantize(np.ones((4, 256), np.float32), GGMLType.Q4_K)
    be.weight("w", GGMLType.Q4_K, (256, 4), raw)
    be.new_kv_cache(2, 16, 2, 64, 32)
    rep = be.memory_report()
    assert rep["weights"] - before["weights"] >= raw.nbytes
    assert rep["kv_cache"] - before["kv_cache"] == 2 * 16 * 2 * (64 + 32) * 2
    assert rep["device_total"] >= rep["device_max_alloc"] > 0
    assert set(rep) >= {"weights", "kv_cache", "workspace"}


def test_measure_bandwidth(be_default):
    """The bench's decode ceiling: a device copy timed by profiling events, bytes per second."""
    bw = be_default.measure_bandwidth(n_bytes=1 << 20, repeats=1)
    assert np.isfinite(bw) and bw > 1e6


# -- ops against the CPU backend ------------------------------------------------------------


def _rand(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def test_rms_norm(be):
    """Same float32 steps as the CPU; with double sums only the sum's order differs, which
    can move the scale by one float32 ulp: 2 ulps per output (rtol 3e-7) with margin -> 1e-6.
    The float32 fallback sums 64 partial float32 sums in a tree (relative error ~1e-7 on
    the mean) and takes sqrt and 1/x within 3 ulps: ~5 ulps per output -> 2e-6."""
    from picollama.backends.cpu import ops

    rtol = 1e-6 if be.fp64 else 2e-6
    rng = np.random.default_rng(1)
    for shape, with_w in (((5, 333), True), ((3, 4, 64), True), ((2, 1000), False)):
        x = _rand(rng, *shape, scale=3.0)
        w = _rand(rng, shape[-1]) if with_w else None
        got = be.to_host(be.rms_norm(be.from_host(x), None if w is None else be.from_host(w), 1e-5))
        ref = ops.rms_norm(x, w, 1e-5)
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("neox", [False, True])
def test_rope(be, neox):
    """Same running float32 product of angles as the CPU, and cos/sin through double:
    outputs agree to a couple of float32 ulps of the inputs (atol 1e-6 for |x| < 5). The
    float32 fallback's cos and sin are within 4 ulps: 4 * 2**-24 * 5 * 2 -> atol 4e-6."""
    from picollama.backends.cpu import ops

    atol = 1e-6 if be.fp64 else 4e-6
    rng = np.random.default_rng(2)
    n, n_heads, head_dim, n_rot = 6, 3, 48, 32  # n_rot < head_dim: the tail is copied
    x = _rand(rng, n, n_heads, head_dim)
    for pos in (np.array([0, 1, 17, 255, 1000, 4095]), np.arange(37, 43)):  # uploaded; first
        got = be.to_host(be.rope(be.from_host(x), pos, n_rot, 10000.0, 0.5, neox))
        ref = ops.rope(x, pos, n_rot, 10000.0, 0.5, neox)
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
        np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


ATT_CASES = [
    # n, start, n_ctx, n_heads, n_kv_heads, hd, window, softcap
    (1, 0, 64, 4, 4, 64, 0, 0.0),
    (1, 500, 700, 8, 2, 64, 0, 0.0),  # decode over 2 splits, GQA
    (1, 1500, 2000, 8, 1, 128, 0, 0.0),  # decode over 3 splits, MQA
    (7, 20, 64, 8, 2, 128, 0, 0.0),  # prefill after a prefix
    (40, 0, 96, 4, 1, 256, 16, 30.0),  # sliding window, softcap, MQA, head_dim 256
    (3, 9, 33, 2, 1, 36, 5, 0.0),  # head_dim not a multiple of 8: scalar loads
    (1, 300, 333, 4, 2, 128, 64, 50.0),  # decode, window inside a split
    (70, 0, 80, 2, 2, 64, 0, 0.0),  # more queries than a tile of keys
]


@pytest.mark.parametrize("case", ATT_CASES, ids=[str(c) for c in ATT_CASES])
def test_store_kv_and_attention(be, case):
    """Keys and values are rounded to F16 for both backends (the OpenCL cache is F16), so
    only float32 rounding of scores, exp and the weighted sums differs: outputs are convex
    combinations of values of size ~1; atol 2e-5 is ~100 ulps, a wrong mask moves O(0.1).
    The float32 fallback's tanh (softcap) is within 5 ulps of a score of ~softcap: 30 *
    5 * 2**-24 ~ 1e-5 on a score moves a weight by ~1e-5 relative; atol 5e-5."""
    from picollama.backends.cpu import ops

    atol = 2e-5 if be.fp64 else 5e-5
    n, start, n_ctx, n_heads, n_kv, hd, window, softcap = case
    rng = np.random.default_rng(sum(int(c) for c in case[:6]))
    k_all = _rand(rng, start + n, n_kv, hd).astype(np.float16).astype(np.float32)
    v_all = _rand(rng, start + n, n_kv, hd).astype(np.float16).astype(np.float32)
    q = _rand(rng, n, n_heads, hd)
    cache = be.new_kv_cache(1, n_ctx, n_kv, hd, hd)
    if start:
        be.store_kv(cache, 0, be.from_host(k_all[:start]), be.from_host(v_all[:start]), 0)
    # the new rows as views at an offset, as Batch.attend passes them
    k_dev = be.from_host(k_all)[start:]
    v_dev = be.from_host(v_all)[start:]
    be.store_kv(cache, 0, k_dev, v_dev, start)
    stored = be.to_host(cache.k[0])[: start + n].astype(np.float32)
    np.testing.assert_array_equal(stored, k_all)
    scale = 1.0 / np.sqrt(hd)
    q_dev = be.from_host(np.concatenate([q, q]))[n:]
    got = be.to_host(be.attention(q_dev, cache, 0, start, scale, window, softcap))
    kc = np.zeros((n_ctx, n_kv, hd), np.float32)
    vc = np.zeros((n_ctx, n_kv, hd), np.float32)
    kc[: start + n], vc[: start + n] = k_all, v_all
    ref = ops.attention(q, kc, vc, start, scale, window, softcap)
    assert got.shape == (n, n_heads * hd)
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    with pytest.raises(BackendError, match="overflows"):
        be.store_kv(cache, 0, be.from_host(k_all[:1]), be.from_host(v_all[:1]), n_ctx)


def test_store_kv_rounds_to_nearest_even(be_default):
    """vstore_half_rte: the F16 cache holds what numpy's float16 cast gives, ties included."""
    be = be_default
    half_ulp = np.float32(2.0**-11)
    k = np.array([1 + half_ulp, 1 + 3 * half_ulp, -(1 + half_ulp), 65519.0, 1e-8, 7e-6], np.float32)
    k = k.reshape(6, 1, 1)
    cache = be.new_kv_cache(1, 8, 1, 1, 1)
    be.store_kv(cache, 0, be.from_host(k), be.from_host(k), 0)
    got = be.to_host(cache.k[0])[:6]
    np.testing.assert_array_equal(got.view(np.uint16), k.astype(np.float16).view(np.uint16))


def test_activations_and_elementwise(be):
    """silu/gelu follow the CPU's float32 steps with exp/tanh and the division through
    double: silu agrees to 1 ulp (rtol 5e-7). gelu: where x < 0, 1 + tanh(.) cancels and a
    1-ulp difference in tanh grows relative to the result, so rtol 2e-6 plus atol 1e-7.
    The float32 fallback's exp (3 ulps), tanh (5) and division (2.5) widen these by ~5x.
    add/mul/scale are single float32 operations: exact."""
    from picollama.backends.cpu import ops

    wide = 1 if be.fp64 else 5
    rng = np.random.default_rng(3)
    g, u = _rand(rng, 5, 77, scale=4.0), _rand(rng, 5, 77)
    dg, du = be.from_host(g), be.from_host(u)
    silu = be.to_host(be.silu_mul(dg, du))
    np.testing.assert_allclose(silu, ops.silu_mul(g, u), rtol=5e-7 * wide)
    np.testing.assert_allclose(
        be.to_host(be.gelu_mul(dg, du)), ops.gelu_mul(g, u), rtol=2e-6 * wide, atol=1e-7 * wide
    )
    np.testing.assert_array_equal(be.to_host(be.add(dg, du)), g + u)
    np.testing.assert_array_equal(be.to_host(be.mul(dg, du)), g * u)
    row = _rand(rng, 77)
    np.testing.assert_array_equal(be.to_host(be.add(dg, be.from_host(row))), g + row)
    np.testing.assert_array_equal(be.to_host(be.mul(dg, be.from_host(row))), g * row)
    np.testing.assert_array_equal(be.to_host(be.scale(dg, 0.37)), g * np.float32(0.37))
    np.testing.assert_allclose(
        be.to_host(be.softcap(dg, 3.0)), ops.softcap(g, 3.0), rtol=5e-7 * wide, atol=1e-7
    )
    # offsets: views of rows 2.. of every input
    np.testing.assert_array_equal(be.to_host(be.add(dg[2:], du[2:])), g[2:] + u[2:])
    np.testing.assert_array_equal(
        be.to_host(be.silu_mul(dg[2:], du[2:])), silu[2:]
    )  # the same kernel on the same values
    with pytest.raises(BackendError):
        be.add(dg, be.from_host(_rand(rng, 5)))


def test_concat_take_rows_and_copies(be_default):
    be = be_default
    rng = np.random.default_rng(4)
    a, b = _rand(rng, 3, 10), _rand(rng, 4, 10)
    da, db = be.from_host(a), be.from_host(b)
    np.testing.assert_array_equal(be.to_host(be.concat([da, db])), np.concatenate([a, b]))
    np.testing.assert_array_equal(be.to_host(be.concat([db[1:3], da])), np.concatenate([b[1:3], a]))
    np.testing.assert_array_equal(be.to_host(be.take_rows(db, np.array([3, 0]))), b[[3, 0]])
    np.testing.assert_array_equal(be.to_host(be.take_rows(db[1:], np.array([2]))), b[[3]])
    assert be.take_rows(db, np.arange(4)) is db  # all rows: no copy
    with pytest.raises(BackendError):
        be.take_rows(db, np.array([4]))
    with pytest.raises(BackendError, match="outside"):
        w = be.weight("e", GGMLType.F32, (32, 2), np.zeros(256, np.uint8))
        be.get_rows(w, np.array([2]))
    ids = be.from_host(np.array([1, 2, 3]))
    assert ids.dtype == np.int32 and be.to_host(ids).tolist() == [1, 2, 3]
    empty = be.matmul(be.from_host(np.zeros((0, 32), np.float32)), w)
    assert be.to_host(empty).shape == (0, 2)


def test_kv_cache_is_f16_on_device(be_default):
    cache = be_default.new_kv_cache(2, 16, 2, 64, 32)
    assert isinstance(cache, KVCache)
    assert cache.k[1].shape == (16, 2, 64) and cache.v[0].shape == (16, 2, 32)
    assert cache.k[0].dtype == np.float16
    with pytest.raises(BackendError, match="limit"):
        be_default.new_kv_cache(1, 16, 1, 512, 512)
