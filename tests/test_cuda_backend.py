"""CUDA backend: every op and every quant type against the references, on the GPU.

Without CuPy or without a GPU the GPU tests skip with the reason (CI has no GPU); the
layout and error-message tests run everywhere.

Error bounds, and why:
- Dequantization (get_rows) is bit-exact: the kernels repeat ggml's float32 operations in
  order (``__fmul_rn``/``__fadd_rn``, no FMA contraction), so every type must equal
  ``picollama.quant.dequantize`` exactly.
- matmul with float activations (arithmetic "exact", every type, and its prefill through
  SGEMM; arithmetic "ggml" for the types without an int8 kernel): the weights are
  dequantized exactly, so the only error is float32 summation, in any order. The classical
  bound for a float32 sum of k products is ``|err| <= gamma_k * sum_j |x_j w_j|`` with
  ``gamma_k ~ k * 2**-24``; we allow ``(k + 32) * 2**-24 * (|x| @ |W|^T)`` per output. TF32
  or fp16 arithmetic (10-bit mantissas) would break it by a factor of 2**13, and a wrong
  weight by far more.
- prefill with arithmetic "ggml" (more than ``MV_MAX_TOKENS`` rows: fp16 tiles and fp16 x on
  the tensor cores, float32 sums): rounding v to fp16 moves it by at most
  ``2**-11 |v| + 2**-25`` (relative in the normal range, half the subnormal spacing below
  it); x is first divided by a power of two s (exact; s = 1 unless max|x| >= 2**15), so its
  error is ``2**-11 |x| + 2**-25 s``. The products of the rounded values are exact in
  float32 and their sum is off by at most ``(k + 64) * 2**-23`` of ``|x| @ |W|^T`` (2**-23:
  the tensor cores' float32 adds are not all round-to-nearest). In all,
  ``(2**-10 + (k + 64) * 2**-23) * (|x| @ |W|^T) + 2**-24 * (s * sum|W| + sum|x|)``, the
  second-order terms inside the margins. The rounding shows: ~1e-4 of |y| against ~1e-7
  for SGEMM.
- matmul with int8 activations (arithmetic "ggml", ``layout.Q8DOT_TYPES``, up to
  ``MV_MAX_TOKENS`` rows, mmvq.cu): each run of 32 values of x becomes d * q with
  d = max|x| / 127 and q = rint(x * (127 / max|x|)), so ``|x_j - xq_j| <= d / 2`` (we
  allow ``0.5001 d + 2**-22 |x_j|``: x * id carries two float32 roundings of 2**-24 and
  id * d is 1 within 2**-23; the same holds for MVQ_QRCP=0's x / d), and the integer
  block dots are exact: the kernel computes ``xq @ W^T`` up to float32 rounding of
  O(k / 16) scaled block terms. So ``|y - x @ W^T| <= (0.5001 d + 2**-22 |x|) @ |W|^T
  + (k / 16 + 64) * 2**-24 * ((|x| + d) @ A^T)``, A the weight magnitude with the min term
  of Q4_K counted positive (as tests/test_qdot.py does). The first term is the activation
  rounding (relative ~1/254 per value, ~1e-2 of |y| at most, in practice ~1e-3 as the
  roundings' signs are random); a wrong code or scale breaks it at once.
- Non-matmul ops follow the CPU backend's float32 operation order; see each test.
"""

from __future__ import annotations

import numpy as np
import pytest

from picollama.backends.base import BackendError, KVCache, get_backend
from picollama.backends.cuda import layout
from picollama.backends.cuda.backend import MV_MAX_TOKENS
from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant import dequantize, quantize


def _cuda(**options):
    try:
        return get_backend("cuda", **options)
    except BackendError as err:
        pytest.skip(f"CUDA backend unavailable here: {err}")


@pytest.fixture(scope="module")
def be():
    """An eager backend (no decode graphs), shared by the op tests."""
    return _cuda(graphs=False)


@pytest.fixture(scope="module")
def be_exact():
    """An eager backend with float activations in every matvec."""
    return _cuda(graphs=False, arithmetic="exact")


# -- no GPU needed ------------------------------------------------------------------------


def test_layout_fields_fit_the_ggml_blocks():
    """Every field lies inside the ggml block, fields don't overlap, and the kernel block is
    a whole number of ggml blocks (quant.cu's static_assert checks the kernels' side)."""
    for qtype, (block, fields) in layout.FIELDS.items():
        info = GGML_TYPES[qtype]
        assert block % info.block_size == 0 and block % 32 == 0
        block_bytes = layout.ggml_block_bytes(qtype)
        covered = np.zeros(block_bytes, int)
        for src, size in fields:
            assert 0 <= src and src + size <= block_bytes, (qtype.name, src, size)
            covered[src : src + size] += 1
        assert covered.max() == 1, qtype.name
        # only Q8_K leaves bytes behind (its bsums, which no kernel reads)
        assert covered.min() == 1 or qtype == GGMLType.Q8_K, qtype.name
        assert f"#define LAYOUT_BLOCK {block}" in layout.quant_source(qtype)


def test_build_variant_defines_reach_every_kernel_source(monkeypatch):
    """PICOLLAMA_CUDA_DEFINES puts its macros ahead of both kinds of kernel source (so the
    tests can run a build variant before it becomes the default); a bad name is refused."""
    monkeypatch.delenv(layout.DEFINES_ENV, raising=False)
    assert layout.build_defines() == ""
    monkeypatch.setenv(layout.DEFINES_ENV, "ATT_VPRE=1, MVQ_PRELOAD=0,PDL_OFF")
    head = "#define ATT_VPRE 1\n#define MVQ_PRELOAD 0\n#define PDL_OFF 1\n"
    assert layout.build_defines() == head
    assert layout.ops_source().startswith(head)
    assert layout.quant_source(GGMLType.Q4_K).startswith(head)
    monkeypatch.setenv(layout.DEFINES_ENV, "ATT VPRE=1")
    with pytest.raises(BackendError, match="not a macro name"):
        layout.ops_source()


def test_device_layout_regions_are_aligned():
    lay = layout.device_layout(GGMLType.Q6_K, 512, 7)
    assert lay.n_blocks == 14
    assert [r[0] % layout.REGION_ALIGN for r in lay.regions] == [0, 0, 0, 0]
    assert lay.nbytes >= 14 * 210


def test_unavailable_backend_says_why():
    """Without CuPy or a GPU, asking for the backend is a BackendError naming the cause."""
    try:
        import cupy  # noqa: F401

        have_cupy = True
    except ImportError:
        have_cupy = False
    if have_cupy:
        try:
            get_backend("cuda")
        except BackendError as err:
            assert "GPU" in str(err) or "CUDA" in str(err)
            return
        pytest.skip("a GPU is present: nothing to refuse")
    with pytest.raises(BackendError, match="CuPy"):
        get_backend("cuda")


# -- quantized weights ----------------------------------------------------------------------

TYPES = sorted(layout.SUPPORTED_TYPES)


# fp16 byte of each int8-kernel type's min term (Q4_K's dmin) that holds the sign bit
_MIN_SIGN_BYTE = {GGMLType.Q4_K: 3}


def _weight_magnitude(raw: np.ndarray, qtype: GGMLType, m: int, k: int) -> np.ndarray:
    """|w| with the min term counted positive (float64): bounds every block term."""
    a = np.abs(dequantize(raw, qtype).astype(np.float64)).reshape(m, k)
    if qtype in _MIN_SIGN_BYTE:
        blocks = raw.reshape(m, -1, GGML_TYPES[qtype].type_size).copy()
        blocks[:, :, _MIN_SIGN_BYTE[qtype]] ^= 0x80
        flipped = np.abs(dequantize(blocks.reshape(raw.shape), qtype).astype(np.float64))
        a = np.maximum(a, flipped.reshape(m, k))
    return a


def _mixed_runs(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """float32 activations (n, k) whose runs of 32 have different sizes, so that their
    int8 scales differ."""
    x = rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, size=(n, k // 32)).repeat(32, 1)
    return x.astype(np.float32)


def _int8_bound(x: np.ndarray, W64: np.ndarray, A: np.ndarray) -> np.ndarray:
    """The int8-activation error bound of the module doc, per output (n, m)."""
    n, k = x.shape
    ax = np.abs(x).astype(np.float64)
    d = np.repeat(ax.reshape(n, k // 32, 32).max(axis=2) / 127.0, 32, axis=1)
    rounding = (0.5001 * d + 2.0**-22 * ax) @ np.abs(W64).T
    return rounding + (k / 16 + 64) * 2.0**-24 * ((ax + d) @ A.T)


@pytest.mark.parametrize("arithmetic", ["ggml", "exact"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_get_rows_and_matmul_every_type(be, be_exact, qtype, arithmetic):
    backend = be if arithmetic == "ggml" else be_exact
    rng = np.random.default_rng(1000 + int(qtype))
    block = layout.chunk_block(qtype)
    k = 3 * block if block == 256 else 7 * block  # several blocks, not a power of two
    m = 131  # not a multiple of any tile
    w = rng.standard_normal((m, k)).astype(np.float32)
    raw = quantize(w, qtype).reshape(m, -1)
    W = dequantize(raw, qtype).reshape(m, k)
    wt = backend.weight("w", qtype, (k, m), raw)
    assert backend.supports("matmul", qtype)

    ids = np.array([0, m - 1, 7, 7, 64])
    rows = backend.to_host(backend.get_rows(wt, ids))
    assert np.array_equal(rows, W[ids]), "dequantization must be bit-exact"

    W64 = W.astype(np.float64)
    A = _weight_magnitude(raw, qtype, m, k)
    for n in (1, 2, 3, 4, 8, 9, 37):  # matvec up to 8 rows, tiles + cuBLAS above
        x = _mixed_runs(rng, n, k)
        y = backend.to_host(backend.matmul(backend.from_host(x), wt))
        ref = x.astype(np.float64) @ W64.T
        int8 = arithmetic == "ggml" and qtype in layout.Q8DOT_TYPES and n <= MV_MAX_TOKENS
        fp16 = arithmetic == "ggml" and n > MV_MAX_TOKENS
        if int8:
            bound = _int8_bound(x, W64, A)
        elif fp16:
            bound = _fp16_bound(x, W64)
        else:
            bound = (k + 32) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(W64).T)
        err = np.abs(y - ref)
        assert y.shape == (n, m)
        assert np.all(err <= bound), (n, float((err / (bound + 1e-30)).max()))
        # shown with -s: the worst error as a share of the bound, and relative to |ref|max
        rel = float(err.max() / np.abs(ref).max())
        ratio = float((err / (bound + 1e-30)).max())
        print(f"{qtype.name} {arithmetic} n={n}: err/bound {ratio:.3f}, rel {rel:.2e}")
        if int8:
            # not the float path by accident: int8 rounding shows (exact would be ~1e-7)
            assert rel > 1e-5
        if fp16:
            assert rel > 1e-6  # fp16 rounding shows: not SGEMM by accident


def _fp16_bound(x: np.ndarray, W64: np.ndarray) -> np.ndarray:
    """The fp16 GEMM's error bound of the module doc, per output (n, m)."""
    k = x.shape[1]
    ax = np.abs(x).astype(np.float64)
    aw = np.abs(W64)
    amax = float(ax.max())
    s = 2.0 ** (int(np.floor(np.log2(amax))) - 14) if amax >= 2.0**15 else 1.0
    rel = 2.0**-10 + (k + 64) * 2.0**-23
    return rel * (ax @ aw.T) + 2.0**-24 * (s * aw.sum(axis=1)[None, :] + ax.sum(axis=1)[:, None])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q8_0], ids=["Q4_K", "Q8_0"])
def test_prefill_fp16_scales_activations_beyond_its_range(be, qtype):
    """Prefill rows whose values pass fp16's largest (65504): x is scaled down by a power
    of two before the fp16 GEMM and the product scaled back, so the outputs are finite and
    within the fp16 bound; rows of ordinary size in the same batch keep theirs."""
    rng = np.random.default_rng(77)
    m, k = 200, 512
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
    W64 = dequantize(raw, qtype).reshape(m, k).astype(np.float64)
    wt = be.weight("w", qtype, (k, m), raw)
    n = MV_MAX_TOKENS + 4
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[3] *= 3e5  # max|x| ~ 1e6: s = 2**5
    y = be.to_host(be.matmul(be.from_host(x), wt))
    assert np.all(np.isfinite(y))
    err = np.abs(y - x.astype(np.float64) @ W64.T)
    bound = _fp16_bound(x, W64)
    assert np.all(err <= bound), float((err / bound).max())


@pytest.mark.parametrize("k", [512, 4096])
def test_int8_matvec_fusions(be, k):
    """The launches the decode graphs fuse (backend._fuse), run directly: Q, K and V in one
    launch, and gate and up with SiLU / GELU in one launch, equal their separate int8
    matvecs and activation bit for bit (the same integer dots and float32 steps per row);
    a folded RMS norm normalizes as rms_norm does (its float64 sum in another order can
    move the scale by an ulp, and with it an int8 code: compared within the int8 bound);
    a folded residual add is one float32 addition: exact. k = 4096: the loops without
    range tests (every row pair has both rows there)."""
    from picollama.backends.cuda.backend import _Matvec

    rng = np.random.default_rng(9)
    n_tok = 1
    weights = []
    for qtype, m in ((GGMLType.Q4_K, 96), (GGMLType.Q4_K, 40), (GGMLType.Q4_K, 40)):
        raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
        weights.append(be.weight("w", qtype, (k, m), raw))
    x = be.from_host(rng.standard_normal((n_tok, k)).astype(np.float32))
    singles = [be.to_host(be.matmul(x, w)) for w in weights]

    def run(mv):
        with be._stream:
            mv.run()
        return mv

    ys = [be._empty((n_tok, w.m)) for w in weights]
    mv = _Matvec(be, True, weights[0].data, ys[0], x, n_tok)
    mv.weights += [weights[1].data, weights[2].data]
    mv.ys += ys[1:]
    run(mv)
    for y, ref in zip(ys, singles, strict=True):
        np.testing.assert_array_equal(be.to_host(y), ref)

    gate, up = weights[1], weights[2]
    g, u = be.matmul(x, gate), be.matmul(x, up)
    for act, op in ((1, be.silu_mul), (2, be.gelu_mul)):
        out = be._empty((n_tok, gate.m))
        mv = _Matvec(be, True, gate.data, out, x, n_tok)
        mv.weights.append(up.data)
        mv.act = act
        run(mv)
        np.testing.assert_array_equal(be.to_host(out), be.to_host(op(g, u)))

    norm_w = be.from_host(rng.uniform(0.5, 1.5, k).astype(np.float32))
    resid = be.from_host(rng.standard_normal((n_tok, weights[0].m)).astype(np.float32))
    h = be.rms_norm(x, norm_w, 1e-5)
    ref = be.to_host(be.add(resid, be.matmul(h, weights[0])))
    out = be._empty((n_tok, weights[0].m))
    mv = _Matvec(be, True, weights[0].data, out, x, n_tok)
    mv.norm_w, mv.eps, mv.resid = norm_w, 1e-5, resid
    run(mv)
    # the same int8 codes unless a normalized value sits within an ulp of a rounding tie
    # (odds ~1e-4 here); then one code moves by 1, ~1e-3 of the scale
    got = be.to_host(out)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("k", [512, 2048, 4096])
@pytest.mark.parametrize("neox,n_rot,hdv", [(False, 64, 64), (True, 64, 64), (False, 32, 32)])
def test_int8_qkv_rope_store(be, neox, n_rot, hdv, k):
    """The decode graphs' Q/K/V launch with RoPE and the KV cache write folded in (the
    kernel takes rows in RoPE's pairs and turns them with rope's float32 operations) equals
    matmul, rope, rope and store_kv run one by one, bit for bit: q, k and every cache row
    (the one written and the ones it must leave alone). GQA 4:2, head_dim 64, partial
    rotation (n_rot 32, v heads of 32) and both pair orders, at a position past 0; rows of
    k = 512, 2048 and 4096 (two iterations of Q4_K's pairs)."""
    from picollama.backends.cuda.backend import _Matvec, _RopeStore

    rng = np.random.default_rng(31 + n_rot + int(neox) + k)
    hd, n_heads, n_kv, n_ctx, pos = 64, 4, 2, 8, 5
    shapes = (
        (GGMLType.Q4_K, n_heads * hd),
        (GGMLType.Q4_K, n_kv * hd),
        (GGMLType.Q4_K, n_kv * hdv),
    )
    weights = []
    x_host = rng.standard_normal((1, k)).astype(np.float32)
    for qtype, m in shapes:
        raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
        weights.append(be.weight("w", qtype, (k, m), raw))
    x = be.from_host(x_host)
    positions = np.array([pos])
    base, scale = 10000.0, 0.5
    fill = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32)
    fill_v = rng.standard_normal((n_ctx, n_kv, hdv)).astype(np.float32)
    caches = []
    for _ in range(2):
        cache = be.new_kv_cache(1, n_ctx, n_kv, hd, hdv)
        be.store_kv(cache, 0, be.from_host(fill), be.from_host(fill_v), 0)
        caches.append(cache)

    q, kk, v = (be.matmul(x, w) for w in weights)
    q_ref = be.rope(q.reshape(1, n_heads, hd), positions, n_rot, base, scale, neox)
    k_ref = be.rope(kk.reshape(1, n_kv, hd), positions, n_rot, base, scale, neox)
    be.store_kv(caches[0], 0, k_ref, v.reshape(1, n_kv, hdv), pos)

    theta_scale = np.float32(np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot)))
    ys = [be._empty((1, w.m)) for w in weights]
    mv = _Matvec(be, True, weights[0].data, ys[0], x, 1)
    mv.weights += [weights[1].data, weights[2].data]
    mv.ys += ys[1:]
    dev_pos = be._upload_i32(positions)
    table = be._cache_table([caches[1]])[1][0]  # the layer's (2, 1) cache pointers
    mv.rope = _RopeStore(
        dev_pos, dev_pos, table[0], table[1], hd, hdv, n_rot, neox, n_ctx,
        theta_scale, np.float32(scale),
    )  # fmt: skip
    with be._stream:
        mv.run()
    got = [be.to_host(y) for y in ys]
    want = [be.to_host(q_ref).reshape(1, -1), be.to_host(k_ref).reshape(1, -1), be.to_host(v)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(caches[1].k[0].get(), caches[0].k[0].get())
    np.testing.assert_array_equal(caches[1].v[0].get(), caches[0].v[0].get())
    assert not np.array_equal(caches[1].k[0].get()[pos], fill[pos].astype(np.float16))


Q8DOT = sorted(layout.Q8DOT_TYPES)


@pytest.mark.parametrize("qtype", Q8DOT, ids=[t.name for t in Q8DOT])
def test_int8_matvec_whole_iterations(be, qtype):
    """Rows of k = 4096 are whole iterations for every int8 type (the chunks of a row a
    multiple of 32 lanes x the unroll), so the matvecs take their loops without per-chunk
    range tests (mmvq.cu, ALL); with m odd the last row pair has one row and takes the
    tested loop. Both within the int8 bound of the float64 product, for 1 and 3 tokens."""
    rng = np.random.default_rng(47 + int(qtype))
    k, m = 4096, 75
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
    W64 = dequantize(raw, qtype).reshape(m, k).astype(np.float64)
    A = _weight_magnitude(raw, qtype, m, k)
    wt = be.weight("w", qtype, (k, m), raw)
    for n in (1, 3):
        x = _mixed_runs(rng, n, k)
        y = be.to_host(be.matmul(be.from_host(x), wt))
        err = np.abs(y - x.astype(np.float64) @ W64.T)
        bound = _int8_bound(x, W64, A)
        assert np.all(err <= bound), (n, float((err / bound).max()))


@pytest.mark.parametrize("qtype", Q8DOT, ids=[t.name for t in Q8DOT])
def test_int8_matvec_rows_are_their_own(be, qtype):
    """Each row of x gets the same bits whether it is multiplied alone (matvec_q8_n1) or
    among 2, 3, 4, 5 or 8 rows (matvec_q8_2, _4 and matvec_q8): a sequence's decode step
    in the server's batches is what it is alone, so its tokens are too."""
    rng = np.random.default_rng(31 + int(qtype))
    k, m = 2048, 77
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
    wt = be.weight("w", qtype, (k, m), raw)
    x = rng.standard_normal((8, k)).astype(np.float32)
    alone = np.concatenate(
        [be.to_host(be.matmul(be.from_host(x[i : i + 1]), wt)) for i in range(8)]
    )
    for n in (2, 3, 4, 5, 8):
        y = be.to_host(be.matmul(be.from_host(x[:n]), wt))
        np.testing.assert_array_equal(y, alone[:n], err_msg=f"{n} rows")


@pytest.mark.parametrize("qtype", Q8DOT, ids=[t.name for t in Q8DOT])
def test_int8_matvec_wide_x(be, qtype, monkeypatch):
    """One token of an x at least _MVQ_WIDE_K wide takes matvec_q8_n1_wide, which issues
    x's loads four rounds at a time: the same codes, sums and rows as matvec_q8_n1, so the
    same outputs bit for bit, with and without a folded RMS norm; and within the int8
    bound of the float product. k = 8448: a last round of x that is not full."""
    from picollama.backends.cuda import backend as cuda_backend
    from picollama.backends.cuda.backend import _Matvec

    rng = np.random.default_rng(77 + int(qtype))
    k, m = 33 * 256, 67
    assert k >= cuda_backend._MVQ_WIDE_K
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
    W64 = dequantize(raw, qtype).reshape(m, k).astype(np.float64)
    wt = be.weight("w", qtype, (k, m), raw)
    x = _mixed_runs(rng, 1, k)
    xd = be.from_host(x)
    norm_w = be.from_host(rng.uniform(0.5, 1.5, k).astype(np.float32))

    def outputs():
        plain = be.to_host(be.matmul(xd, wt))
        out = be._empty((1, m))
        mv = _Matvec(be, True, wt.data, out, xd, 1)
        mv.norm_w, mv.eps = norm_w, 1e-5
        with be._stream:
            mv.run()
        return plain, be.to_host(out)

    wide = outputs()
    monkeypatch.setattr(cuda_backend, "_MVQ_WIDE_K", 1 << 30)
    narrow = outputs()
    np.testing.assert_array_equal(wide[0], narrow[0])
    np.testing.assert_array_equal(wide[1], narrow[1])
    err = np.abs(wide[0] - x.astype(np.float64) @ W64.T)
    assert np.all(err <= _int8_bound(x, W64, _weight_magnitude(raw, qtype, m, k)))


class _Counted:
    """A kernel that counts its (eager) launches."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.kernel(*args, **kwargs)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K], ids=["Q4_K", "Q6_K"])
def test_int8_matvec_small_grid(be, qtype, monkeypatch):
    """One token of a weight with few rows (a grid of 8-warp blocks that leaves half the SMs
    idle) takes matvec_q8_n1_small, not 16-warp blocks: every row is the same warp's dot,
    so the outputs equal the 16-warp kernel's bit for bit, plain, with a residual and with a
    folded RMS norm (k / 4 <= 256 values a block: each thread squares the same one in both
    block sizes and the sums meet the same zeros). m = 75: an odd last row pair."""
    from picollama.backends.cuda.backend import _Matvec

    rng = np.random.default_rng(55 + int(qtype))
    k, m = 3 * 256, 75
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
    wt = be.weight("w", qtype, (k, m), raw)
    kernels = be._quant_kernels(qtype)
    assert kernels.matvec_q8_small is not None
    assert kernels.mvq_small_warps < kernels.mvq_warps
    x = be.from_host(rng.standard_normal((1, k)).astype(np.float32))
    norm_w = be.from_host(rng.uniform(0.5, 1.5, k).astype(np.float32))
    resid = be.from_host(rng.standard_normal((1, m)).astype(np.float32))

    def outputs():
        out = [be.to_host(be.matmul(x, wt))]
        for norm, add in ((True, False), (False, True), (True, True)):
            y = be._empty((1, m))
            mv = _Matvec(be, True, wt.data, y, x, 1)
            if norm:
                mv.norm_w, mv.eps = norm_w, 1e-5
            if add:
                mv.resid = resid
            with be._stream:
                mv.run()
            out.append(be.to_host(y))
        return out

    counted = _Counted(kernels.matvec_q8_small)
    monkeypatch.setattr(kernels, "matvec_q8_small", counted)
    small = outputs()
    assert counted.calls == 4
    monkeypatch.setattr(kernels, "matvec_q8_small", None)
    big = outputs()
    for a, b in zip(small, big, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "qtype,k,m",
    [
        (GGMLType.Q5_0, 576, 1200),
        (GGMLType.Q4_K, 2560, 1200),
        (GGMLType.Q4_K, 4096, 1200),
        (GGMLType.Q6_K, 4096, 1200),
        (GGMLType.Q4_K, 4096, 5000),
        (GGMLType.Q6_K, 2560, 5000),
    ],
    ids=["Q5_0-576", "Q4_K-2560", "Q4_K-4096", "Q6_K-4096", "Q4_K-4096-m5000", "Q6_K-2560-m5000"],
)
def test_int8_norm_one_token_equals_batch(be, qtype, k, m):
    """A folded RMS norm: one token (matvec_q8_n1) against the same token as both rows of
    a two-token launch (matvec_q8), in blocks of as many warps: the same sum of squares in
    the same order, the same codes and the same dots, so the same bits (a way to change the
    one-token prologue and check it, as runs 13 and 30 did). k = 2560 leaves the second
    round of 16-warp blocks part empty; m = 1200 rows keep the one-token launch off the
    small grids' 8-warp blocks, and m = 5000 gives some warps a second job (of one row)."""
    _assert_one_token_equals_batch(be, qtype, k, m, normed=True)


@pytest.mark.parametrize(
    "qtype,k,m",
    [
        (GGMLType.Q4_0, 2048, 1200),
        (GGMLType.Q8_0, 2560, 1200),
        (GGMLType.Q4_K, 14336, 1200),
        (GGMLType.Q6_K, 8448, 1200),
        (GGMLType.Q6_K, 14336, 5000),
    ],
    ids=["Q4_0-2048", "Q8_0-2560", "Q4_K-14336", "Q6_K-8448", "Q6_K-14336-m5000"],
)
def test_int8_one_token_equals_batch(be, qtype, k, m):
    """The same without a norm, and x wide enough (k >= 8192) for the one-token launch to
    take the wide-x kernel (matvec_q8_n1_wide, ffn_down's): x's codes, scales and half
    sums made one way in the one-token prologue and another in the batch's give the same
    bits only if they are the same."""
    _assert_one_token_equals_batch(be, qtype, k, m, normed=False)


def _assert_one_token_equals_batch(be, qtype, k, m, normed):
    from picollama.backends.cuda.backend import _Matvec

    rng = np.random.default_rng(77 + k)
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), qtype).reshape(m, -1)
    wt = be.weight("w", qtype, (k, m), raw)
    row = (3.0 * rng.standard_normal((1, k))).astype(np.float32)
    norm_w = be.from_host(rng.uniform(0.5, 1.5, k).astype(np.float32))
    outs = []
    for n in (1, 2):
        x = be.from_host(np.repeat(row, n, axis=0))
        y = be._empty((n, m))
        mv = _Matvec(be, True, wt.data, y, x, n)
        if normed:
            mv.norm_w, mv.eps = norm_w, 1e-5
        with be._stream:
            mv.run()
        outs.append(be.to_host(y))
    assert np.abs(outs[0][0]).max() > 0
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][0], outs[1][1])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K], ids=["Q4_K", "Q6_K"])
def test_int8_norm_takes_the_writers_sum_of_squares(be, qtype):
    """A decode graph's residual matvec leaves its blocks' sums of x's squares for the normed
    matvec after it (_SumSquares): the sums add up to x's (float64, to rounding), the reader
    normalizes x by them within the int8 bound (the sum in another order moves the scale by
    an ulp at most), and it does read them: four times the sums halve its output exactly
    (eps 0: the scale halves, x's codes stay, their scales halve)."""
    from picollama.backends.cuda.backend import _MVQ_SSQ_MAX, _Matvec, _SumSquares

    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(91 + int(qtype))
    k_in, d, m = 2048, 4096, 300  # writer: d rows of k_in; reader: m rows of d
    raws = [quantize(rng.standard_normal((r, c)).astype(np.float32), qtype).reshape(r, -1)
            for r, c in ((d, k_in), (m, d))]  # fmt: skip
    w_write = be.weight("w", qtype, (k_in, d), raws[0])
    w_read = be.weight("w", qtype, (d, m), raws[1])
    h = be.from_host(rng.standard_normal((1, k_in)).astype(np.float32))
    resid = be.from_host(rng.standard_normal((1, d)).astype(np.float32))
    norm_w = be.from_host(rng.uniform(0.5, 1.5, d).astype(np.float32))

    def run(link, eps=1e-5, factor=1.0):
        x = be._empty((1, d))
        writer = _Matvec(be, True, w_write.data, x, h, 1)
        writer.resid = resid
        reader = _Matvec(be, True, w_read.data, be._empty((1, m)), x, 1)
        reader.norm_w, reader.eps = norm_w, eps
        writer.ssq_out = reader.ssq_in = link
        with be._stream:
            writer.run()
            if factor != 1.0:
                link.buf *= factor
            reader.run()
        return be.to_host(x), be.to_host(reader.ys[0])

    x_ref, y_ref = run(None)
    link = _SumSquares(cp.zeros((_MVQ_SSQ_MAX,), dtype=cp.float64))
    x_got, y_got = run(link)
    np.testing.assert_array_equal(x_got, x_ref)
    assert 0 < link.n <= _MVQ_SSQ_MAX
    sums = link.buf.get()
    want = np.sum(x_ref.astype(np.float64) ** 2)
    assert abs(sums[: link.n].sum() - want) <= 1e-12 * want and not sums[link.n :].any()
    assert np.abs(y_got - y_ref).max() <= 1e-5 * np.abs(y_ref).max()
    _, y_linked = run(_SumSquares(cp.zeros((_MVQ_SSQ_MAX,), dtype=cp.float64)), eps=0.0)
    _, y_quarter = run(
        _SumSquares(cp.zeros((_MVQ_SSQ_MAX,), dtype=cp.float64)), eps=0.0, factor=4.0
    )
    assert np.abs(y_linked).max() > 0
    np.testing.assert_array_equal(y_quarter, 0.5 * y_linked)


def test_weight_rejects_bad_rows(be):
    raw = np.zeros((2, GGML_TYPES[GGMLType.Q4_0].type_size), np.uint8)
    with pytest.raises(BackendError, match="multiple of"):
        be.weight("odd", GGMLType.F32, (20, 3), np.zeros(240, np.uint8))
    with pytest.raises(BackendError, match="bytes of data"):
        be.weight("short", GGMLType.Q4_0, (64, 2), raw)
    with pytest.raises(BackendError, match="not supported"):
        be.weight("iq2", GGMLType.IQ2_XXS, (256, 1), np.zeros(66, np.uint8))


def test_model_that_does_not_fit_is_a_backend_error(be):
    with pytest.raises(BackendError, match="does not fit"):
        be.new_kv_cache(1, 1 << 30, 8, 128, 128)  # 4 TiB of fp16


def test_memory_report(be):
    rep = be.memory_report()
    assert rep["weights"] > 0  # the type tests above loaded weights
    assert rep["device_total"] >= rep["device_free"] > 0
    assert set(rep) >= {"weights", "kv_cache", "workspace"}


# -- ops against the CPU backend ------------------------------------------------------------


def _rand(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def test_rms_norm(be):
    """Same float32 steps as the CPU; only the float64 sum's order differs, which can move
    the scale by one float32 ulp: 2 ulps per output (rtol 3e-7) with margin -> 1e-6."""
    from picollama.backends.cpu import ops

    rng = np.random.default_rng(1)
    for shape, with_w in (((5, 333), True), ((3, 4, 64), True), ((2, 1000), False)):
        x = _rand(rng, *shape, scale=3.0)
        w = _rand(rng, shape[-1]) if with_w else None
        got = be.to_host(be.rms_norm(be.from_host(x), None if w is None else be.from_host(w), 1e-5))
        ref = ops.rms_norm(x, w, 1e-5)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("neox", [False, True])
def test_rope(be, neox):
    """Same running float32 product of angles and double-precision cos/sin as the CPU:
    outputs agree to a couple of float32 ulps of the inputs (atol 1e-6 for |x| < 5)."""
    from picollama.backends.cpu import ops

    rng = np.random.default_rng(2)
    n, n_heads, head_dim, n_rot = 6, 3, 48, 32  # n_rot < head_dim: the tail is copied
    x = _rand(rng, n, n_heads, head_dim)
    pos = np.array([0, 1, 17, 255, 1000, 4095])
    got = be.to_host(be.rope(be.from_host(x), pos, n_rot, 10000.0, 0.5, neox))
    ref = ops.rope(x, pos, n_rot, 10000.0, 0.5, neox)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


ATT_CASES = [
    # n, start, n_ctx, n_heads, n_kv_heads, hd, window, softcap
    (1, 0, 64, 4, 4, 64, 0, 0.0),
    (1, 500, 700, 8, 2, 64, 0, 0.0),  # decode over 2 splits, GQA
    (1, 1500, 2000, 8, 1, 128, 0, 0.0),  # decode over 4 splits (one empty), MQA
    (7, 20, 64, 8, 2, 128, 0, 0.0),  # prefill after a prefix
    (40, 0, 96, 4, 1, 256, 16, 30.0),  # sliding window, softcap, MQA, head_dim 256
    (3, 9, 33, 2, 1, 36, 5, 0.0),  # head_dim not a multiple of 8: scalar loads
    (1, 300, 333, 4, 2, 128, 64, 50.0),  # decode, window inside a split
    (1, 77, 128, 9, 3, 64, 0, 0.0),  # decode, groups of 3 (SmolLM2-135M's shape)
    (1, 200, 256, 9, 3, 64, 0, 0.0),  # decode, one split of two tiles of keys
    (1, 100, 512, 9, 3, 64, 0, 0.0),  # decode, one split in a grid of 4 (ATT_HEADS: by head)
    (1, 150, 256, 12, 2, 128, 0, 0.0),  # decode, groups of 6
    (1, 40, 64, 5, 1, 64, 0, 0.0),  # decode, a group of 5 in the kernel for 6
    (1, 900, 1024, 8, 2, 256, 100, 30.0),  # decode, head_dim 256, window and softcap
    (1, 5, 1024, 16, 2, 128, 0, 0.0),  # decode, groups of 8, fewer keys than splits
    (1, 20, 40, 4, 2, 36, 0, 0.0),  # decode, head_dim the GQA kernel doesn't take
    # prompt batches of 32 rows or more: tiles of 32 queries x 32 keys (attention_tiles_*)
    (100, 37, 160, 8, 2, 128, 0, 0.0),  # after a prefix, GQA, a partial last tile
    (64, 0, 64, 6, 3, 64, 20, 0.0),  # sliding window shorter than a tile
    (45, 3, 64, 2, 1, 36, 0, 0.0),  # head_dim not a multiple of 8
    (33, 0, 40, 4, 4, 256, 0, 50.0),  # head_dim 256, softcap, one row in the last tile
]


@pytest.mark.parametrize("case", ATT_CASES, ids=[str(c) for c in ATT_CASES])
def test_store_kv_and_attention(be, case):
    """Keys and values are rounded to fp16 for both backends (the CUDA cache is fp16), so
    only float32 rounding of scores, exp and the weighted sums differs: outputs are convex
    combinations of values of size ~1; atol 2e-5 is ~100 ulps, a wrong mask moves O(0.1)."""
    from picollama.backends.cpu import ops

    n, start, n_ctx, n_heads, n_kv, hd, window, softcap = case
    rng = np.random.default_rng(hash(case) % 2**32)
    k_all = _rand(rng, start + n, n_kv, hd).astype(np.float16).astype(np.float32)
    v_all = _rand(rng, start + n, n_kv, hd).astype(np.float16).astype(np.float32)
    q = _rand(rng, n, n_heads, hd)
    cache = be.new_kv_cache(1, n_ctx, n_kv, hd, hd)
    if start:
        be.store_kv(cache, 0, be.from_host(k_all[:start]), be.from_host(v_all[:start]), 0)
    be.store_kv(cache, 0, be.from_host(k_all[start:]), be.from_host(v_all[start:]), start)
    stored = cache.k[0][: start + n].get().astype(np.float32)
    np.testing.assert_array_equal(stored, k_all)
    scale = 1.0 / np.sqrt(hd)
    got = be.to_host(be.attention(be.from_host(q), cache, 0, start, scale, window, softcap))
    kc = np.zeros((n_ctx, n_kv, hd), np.float32)
    vc = np.zeros((n_ctx, n_kv, hd), np.float32)
    kc[: start + n], vc[: start + n] = k_all, v_all
    ref = ops.attention(q, kc, vc, start, scale, window, softcap)
    assert got.shape == (n, n_heads * hd)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
    with pytest.raises(BackendError, match="overflows"):
        be.store_kv(cache, 0, be.from_host(k_all[:1]), be.from_host(v_all[:1]), n_ctx)


def test_activations_and_elementwise(be):
    """silu/gelu follow the CPU's float32 steps: silu agrees to 1 ulp (we allow rtol 5e-7).
    gelu's tanh may be evaluated in float32 on the CPU and in double here; where x < 0,
    1 + tanh(.) cancels and a 1-ulp difference in tanh grows relative to the result (seen:
    9e-7), so gelu gets rtol 2e-6 plus atol 1e-7. add/mul/scale are single float32
    operations: exact."""
    from picollama.backends.cpu import ops

    rng = np.random.default_rng(3)
    g, u = _rand(rng, 5, 77, scale=4.0), _rand(rng, 5, 77)
    dg, du = be.from_host(g), be.from_host(u)
    np.testing.assert_allclose(be.to_host(be.silu_mul(dg, du)), ops.silu_mul(g, u), rtol=5e-7)
    np.testing.assert_allclose(
        be.to_host(be.gelu_mul(dg, du)), ops.gelu_mul(g, u), rtol=2e-6, atol=1e-7
    )
    np.testing.assert_array_equal(be.to_host(be.add(dg, du)), g + u)
    np.testing.assert_array_equal(be.to_host(be.mul(dg, du)), g * u)
    row = _rand(rng, 77)
    np.testing.assert_array_equal(be.to_host(be.add(dg, be.from_host(row))), g + row)
    np.testing.assert_array_equal(be.to_host(be.mul(dg, be.from_host(row))), g * row)
    np.testing.assert_array_equal(be.to_host(be.scale(dg, 0.37)), g * np.float32(0.37))
    np.testing.assert_allclose(
        be.to_host(be.softcap(dg, 3.0)), ops.softcap(g, 3.0), rtol=5e-7, atol=1e-7
    )


def test_concat_take_rows_and_copies(be):
    rng = np.random.default_rng(4)
    a, b = _rand(rng, 3, 10), _rand(rng, 4, 10)
    da, db = be.from_host(a), be.from_host(b)
    np.testing.assert_array_equal(be.to_host(be.concat([da, db])), np.concatenate([a, b]))
    np.testing.assert_array_equal(be.to_host(be.take_rows(db, np.array([3, 0]))), b[[3, 0]])
    assert be.take_rows(db, np.arange(4)) is db  # all rows: no copy
    with pytest.raises(BackendError):
        be.take_rows(db, np.array([4]))
    with pytest.raises(BackendError, match="outside"):
        w = be.weight("e", GGMLType.F32, (32, 2), np.zeros(256, np.uint8))
        be.get_rows(w, np.array([2]))


def test_kv_cache_is_fp16_on_device(be):
    cache = be.new_kv_cache(2, 16, 2, 64, 32)
    assert isinstance(cache, KVCache)
    assert cache.k[1].shape == (16, 2, 64) and cache.v[0].shape == (16, 2, 32)
    assert str(cache.k[0].dtype) == "float16"


@pytest.mark.parametrize(
    "rows,n,kind",
    [
        (1, 49152, "normal"),
        (8, 49152, "grid"),  # many equal logits: ties at the k-th
        (3, 262144, "normal"),
        (2, 1000, "flat"),  # every logit equal: the lowest ids
        (2, 100, "special"),  # fewer than _TOPK: the whole row, ordered
        (5, 3001, "special"),  # NaN, infinities, -0.0 and 0.0
    ],
)
def test_to_host_top_equals_the_host_order(be, rows, n, kind):
    """top_k_logits / top_k_keys (a row's largest logits read back for the sampler) against
    the host's ``top_logits``: the same ids and the same logit bits, in the same order, at
    awkward sizes (one level of chunks, two, three), with ties (the lowest ids taken, as the
    sampler's top-k takes them), NaN last."""
    from picollama.backends.base import TOP_LOGITS, top_logits
    from picollama.backends.cuda.backend import _TOPK

    rng = np.random.default_rng(rows * n)
    x = (rng.standard_normal((rows, n)) * 4).astype(np.float32)
    if kind == "grid":
        x = np.round(x * 2) / 2
    elif kind == "flat":
        x[:] = 1.5
    elif kind == "special":
        for r in range(rows):
            at = rng.choice(n, 12, replace=False)
            x[r, at[:3]] = np.nan
            x[r, at[3:5]] = np.inf
            x[r, at[5:7]] = -np.inf
            x[r, at[7:9]] = -0.0
            x[r, at[9:]] = 0.0
    from picollama.backends.cuda.backend import _TOPK_MIN_ROWS, _as_top

    dev = be.from_host(x)
    got = _as_top(be.to_host(be._top_k(dev)))
    want = top_logits(x, min(_TOPK, n))
    assert got.dtype == TOP_LOGITS and got.shape == want.shape
    np.testing.assert_array_equal(got["id"], want["id"])
    np.testing.assert_array_equal(got["logit"].view(np.uint32), want["logit"].view(np.uint32))
    # to_host_top: these from _TOPK_MIN_ROWS rows on, whole rows for fewer or more than _TOPK
    top = be.to_host_top(dev, 40)
    if rows >= _TOPK_MIN_ROWS:
        assert top.dtype == TOP_LOGITS
        np.testing.assert_array_equal(top.view(np.uint64), got.view(np.uint64))
    else:
        np.testing.assert_array_equal(top, x)
    np.testing.assert_array_equal(be.to_host_top(dev, _TOPK + 1), x)
