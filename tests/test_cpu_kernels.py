"""CPU quantized kernels (picollama.backends.cpu.kernels) against the numpy reference.

Every type is checked on fresh random blocks of awkward sizes: get_rows must be
bit-identical to ``picollama.quant.dequantize``; matmul must be within the rounding bound
of float32 block sums (see ``_tolerance``) of the float64 product with the reference's
weights, for decode (n = 1), the few-rows path and the prefill tiles (with a partial tile).

The first call of each type compiles its kernels (a few seconds a type; cached on disk).
"""

from __future__ import annotations

import numpy as np
import pytest

from picollama.backends.cpu import kernels
from picollama.backends.cpu.kernels import (
    GROUP,
    SUPPORTED_TYPES,
    TILE_ROWS,
    TILED_MIN_ROWS,
    block_len,
    get_rows,
    matmul,
    supports,
)
from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant import dequantize

TYPES = sorted(SUPPORTED_TYPES)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

# Byte offsets, inside a block, of the f16 scale fields (d, m, dmin) of each quantized type.
F16_SCALES = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q8_1: (0, 2),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}

U = 2.0**-24  # unit roundoff of float32


def random_weights(rng: np.random.Generator, qtype: GGMLType, m: int, k: int) -> np.ndarray:
    """uint8 (m, row_bytes): random bytes, with finite scales uniform in +-0.01."""
    if qtype == GGMLType.F32:
        return rng.standard_normal((m, k)).astype(np.float32).view(np.uint8)
    if qtype == GGMLType.F16:
        return rng.standard_normal((m, k)).astype(np.float16).view(np.uint8)
    if qtype == GGMLType.BF16:
        bits = rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    info = GGML_TYPES[qtype]
    n_blocks = k // info.block_size
    w = rng.integers(0, 256, (m, n_blocks, info.type_size), dtype=np.uint8)
    if qtype == GGMLType.Q8_K:  # its d is a float32
        d = rng.uniform(-0.01, 0.01, (m, n_blocks, 1)).astype(np.float32)
        w[:, :, 0:4] = d.view(np.uint8)
    for offset in F16_SCALES.get(qtype, ()):
        d = rng.uniform(-0.01, 0.01, (m, n_blocks, 1)).astype(np.float16)
        w[:, :, offset : offset + 2] = d.view(np.uint8)
    return w.reshape(m, -1)


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view, as a weight from a memory-mapped file is."""
    view = a.view()
    view.flags.writeable = False
    return view


def _tolerance(x: np.ndarray, w: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """Bound on |matmul - exact| per output, for exact weights ``w`` (n, m).

    The kernels multiply x_j by the exact float32 weight w_j (one rounding, or none with an
    FMA), sum a block of B products in float32 in some order (at most B - 1 roundings on
    the way, each of relative size u = 2**-24 of a partial sum, itself at most sum |x w|),
    add the block sums in float64 (error ~1e-16 relative, negligible) and round the result
    to float32 (one more u). To first order the error is below (B + 1) u sum_j |x_j w_j|;
    (B + 2) leaves room for second-order terms. The tiny absolute term covers outputs
    whose terms are all zero.
    """
    block = block_len(qtype)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return (block + 2) * U * magnitude + 1e-30


def check_matmul(rng, qtype: GGMLType, m: int, k: int, n: int) -> None:
    w = random_weights(rng, qtype, m, k)
    before = w.copy()
    x = rng.standard_normal((n, k)).astype(np.float32)
    ref_w = dequantize(w, qtype)
    exact = x.astype(np.float64) @ ref_w.astype(np.float64).T
    got = matmul(x, read_only(w), qtype, k)
    assert got.shape == (n, m) and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - exact)
    tol = _tolerance(x, ref_w, qtype)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert np.all(err <= tol), (
        f"{qtype.name} m={m} k={k} n={n}: error {err[worst]:.3g} > bound {tol[worst]:.3g} "
        f"at {worst}"
    )
    np.testing.assert_array_equal(w, before)  # the weights are never written


def shapes(qtype: GGMLType) -> list[tuple[int, int, int]]:
    """(m, k, n): k of 1, 3 and 11 blocks; m of 1, 7, 33 and 130; n through every path."""
    block = GGML_TYPES[qtype].block_size
    if block == 1:  # float types: k need not be a multiple of the 32-weight chunk
        k1, k3, k11 = 7, 3 * 32 + 5, 11 * 32
    else:
        k1, k3, k11 = block, 3 * block, 11 * block
    return [
        (1, k3, 1),
        (7, k1, 1),
        (33, k11, 1),
        (130, k3, 1),
        (7, k3, 2),
        (33, k1, 5),
        (1, k11, TILED_MIN_ROWS - 1),
        (7, k1, TILED_MIN_ROWS),  # the smallest tiled case: one tile, mostly padding
        (33, k3, 2 * TILE_ROWS + 6),  # two full tiles and a partial one
        (130, k11, 70),
    ]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    for m, k, n in shapes(qtype):
        check_matmul(rng, qtype, m, k, n)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_get_rows_is_bit_exact(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    m, k = 13, shapes(qtype)[1][1] * 2
    w = random_weights(rng, qtype, m, k)
    ids = np.array([0, 12, 5, 5, 12, 3])  # the last row, and repeats
    got = get_rows(read_only(w), ids, qtype, k)
    ref = dequantize(w, qtype)[ids]
    assert got.shape == (len(ids), k) and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_get_rows_int32_ids_and_empty():
    rng = np.random.default_rng(1)
    w = random_weights(rng, GGMLType.Q8_0, 4, 64)
    ref = dequantize(w, GGMLType.Q8_0)
    got = get_rows(w, np.array([3, 0], dtype=np.int32), GGMLType.Q8_0, 64)
    np.testing.assert_array_equal(got, ref[[3, 0]])
    assert get_rows(w, np.array([], dtype=np.int64), GGMLType.Q8_0, 64).shape == (0, 64)


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern_converts_like_numpy(qtype):
    # all 65536 patterns: zeros, subnormals, normals, infinities, quiet and signalling NaNs
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    got = get_rows(bits.view(np.uint8), np.arange(256), qtype, 256)
    if qtype == GGMLType.F16:
        ref = bits.view(np.float16).astype(np.float32)
    else:
        ref = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_matmul_writes_into_out():
    rng = np.random.default_rng(2)
    w = random_weights(rng, GGMLType.Q4_0, 9, 64)
    for n in (1, 3, 40):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        out = np.full((n, 9), np.nan, dtype=np.float32)
        assert matmul(x, w, GGMLType.Q4_0, 64, out=out) is out
        np.testing.assert_array_equal(out, matmul(x, w, GGMLType.Q4_0, 64))


def test_matmul_gives_the_same_result_on_any_thread_count():
    numba = pytest.importorskip("numba")
    rng = np.random.default_rng(3)
    w = random_weights(rng, GGMLType.Q6_K, 301, 512)  # enough work to go parallel
    assert w.nbytes >= kernels.SERIAL_WORK
    x = rng.standard_normal((40, 512)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = (matmul(x[:1], w, GGMLType.Q6_K, 512), matmul(x, w, GGMLType.Q6_K, 512))
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = (matmul(x[:1], w, GGMLType.Q6_K, 512), matmul(x, w, GGMLType.Q6_K, 512))
    finally:
        numba.set_num_threads(before)
    # each output is computed by one thread, in an order that does not depend on the others
    np.testing.assert_array_equal(one[0], many[0])
    np.testing.assert_array_equal(one[1], many[1])


def test_nan_and_inf_weights_propagate():
    w = np.zeros((2, 34), dtype=np.uint8)  # two Q8_0 rows of one block
    w[0, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    w[1, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    w[:, 2:] = 1
    y = matmul(np.ones((1, 32), dtype=np.float32), w, GGMLType.Q8_0, 32)
    assert np.isnan(y[0, 0]) and y[0, 1] == np.inf


def test_supports():
    for qtype in TYPES:
        assert supports(qtype) and supports(int(qtype))
    assert not supports(GGMLType.IQ2_XXS)
    assert not supports(999)
    assert kernels.SUPPORTED_TYPES == frozenset(TYPES)


def test_bad_arguments_raise():
    w = np.zeros((4, 18), dtype=np.uint8)  # Q4_0, k = 32
    x = np.zeros((1, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="do not support"):
        matmul(x, w, GGMLType.IQ2_XXS, 32)
    with pytest.raises(ValueError, match="multiple"):
        matmul(x, w, GGMLType.Q4_0, 33)
    with pytest.raises(ValueError, match="must be uint8"):
        matmul(x, w[:, :16], GGMLType.Q4_0, 32)
    with pytest.raises(ValueError, match="x must be"):
        matmul(np.zeros((1, 64), np.float32), w, GGMLType.Q4_0, 32)
    with pytest.raises(ValueError, match="out must be"):
        matmul(x, w, GGMLType.Q4_0, 32, out=np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        matmul(x, np.zeros((4, 36), np.uint8)[:, ::2], GGMLType.Q4_0, 32)
    with pytest.raises(IndexError, match="out of range"):
        get_rows(w, np.array([0, 4]), GGMLType.Q4_0, 32)
    with pytest.raises(IndexError, match="-1"):
        get_rows(w, np.array([-1]), GGMLType.Q4_0, 32)


def test_tile_constants_fit_the_kernels():
    # the tiled kernel's inner loop is written for GROUP = 4 weight rows
    assert GROUP == 4 and TILED_MIN_ROWS <= TILE_ROWS
    assert all(block_len(t) <= 256 for t in TYPES)
