"""simd_x8: Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K weights interleaved eight rows at a time.

The x8 dots sum the same exact integer block products as ggml's ``vec_dot`` and differ
from it in the float32 order only (one FMA a block into each row's lane, where ggml keeps 8
lanes a row and sums them at the end), so they are held to test_qdot's bounds: (b) within
``(k / 32 + 8) * 2**-23 * S`` of ggml's frozen result, (c) within the activation rounding
of the exact float64 product. Q4_0's ``-8 * sum(y)`` offset (Q5_0's ``-16 * sum(y)``) is
an exact integer, so their results carry no fp16 rounding of a block sum at all.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_qdot import dequantized_activations, load_case, weight_magnitude

from picollama.backends.cpu import qdot, simd_x8
from picollama.backends.cpu.backend import CPUBackend
from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant import dequantize

X8 = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K]
# weights of a block
BLOCK = {t: GGML_TYPES[t].block_size for t in X8}


def random_rows(qtype: GGMLType, m: int, k: int, seed: int) -> np.ndarray:
    """Random quant bytes with sane fp16 scales (and negative mins for Q4_1)."""
    rng = np.random.default_rng(seed)
    size = GGML_TYPES[qtype].type_size
    nb = k // BLOCK[qtype]
    rows = rng.integers(0, 256, (m, nb, size), dtype=np.uint8)
    d = (rng.random((m, nb)) * 0.02 + 1e-3).astype(np.float16)
    rows[:, :, 0:2] = d.view(np.uint8).reshape(m, nb, 2)
    if qtype == GGMLType.Q4_K:  # dmin
        dmin = (rng.random((m, nb)) * 0.01).astype(np.float16)
        rows[:, :, 2:4] = dmin.view(np.uint8).reshape(m, nb, 2)
    if qtype == GGMLType.Q4_1:
        mins = (-rng.random((m, nb)) * 0.1).astype(np.float16)
        rows[:, :, 2:4] = mins.view(np.uint8).reshape(m, nb, 2)
    return rows.reshape(m, nb * size)


def transposed_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0's high bits of 8 rows (8, 4 bytes) as the x8 layout holds them: byte 4r + j,
    bit c, is bit 4c + j of row r's 32."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")  # (8, 32): bit i of each row
    out = np.zeros((8, 4), np.uint8)
    for j in range(4):
        for c in range(8):
            out[:, j] |= bits[:, 4 * c + j] << c
    return out.reshape(-1)


def scale_min_k4(q: np.ndarray, j: int) -> tuple[int, int]:
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a Q4_K block's 12
    bytes."""
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def numpy_repack_q4_k(rows: np.ndarray) -> np.ndarray:
    m, row_bytes = rows.shape
    nb = row_bytes // 144
    blocks = rows.reshape(m // 8, 8, nb, 144)
    out = []
    for g in range(m // 8):
        for b in range(nb):
            blk = blocks[g, :, b]  # (8 rows, 144)
            out += [blk[:, 0:2].reshape(-1), blk[:, 2:4].reshape(-1)]
            sm = np.array([[scale_min_k4(blk[r, 4:16], j) for r in range(8)] for j in range(8)])
            out.append(sm[:, :, 0].astype(np.uint8).reshape(-1))  # scales [j][r]
            mins = sm[:, :, 1].reshape(4, 2, 8).transpose(0, 2, 1)  # [k][r][j % 2]
            out.append(mins.astype(np.uint8).reshape(-1))
            for c in range(32):  # chunk (p, c): bytes 4c.. of each row's 32-byte run p
                p, cc = divmod(c, 8)
                out.append(blk[:, 16 + 32 * p + 4 * cc : 16 + 32 * p + 4 * cc + 4].reshape(-1))
    return np.concatenate(out).reshape(m, nb * 148)


def numpy_repack(rows: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """The documented layout, written out plainly."""
    if qtype == GGMLType.Q4_K:
        return numpy_repack_q4_k(rows)
    size = GGML_TYPES[qtype].type_size
    qs = {GGMLType.Q4_1: 4, GGMLType.Q5_0: 6}.get(qtype, 2)
    chunks = (size - qs) // 4
    m, row_bytes = rows.shape
    blocks = rows.reshape(m // 8, 8, row_bytes // size, size)
    out = []
    for g in range(m // 8):
        for b in range(row_bytes // size):
            blk = blocks[g, :, b]  # (8 rows, size)
            out.append(blk[:, 0:2].reshape(-1))
            if qs == 4:
                out.append(blk[:, 2:4].reshape(-1))
            if qs == 6:
                out.append(transposed_high_bits(blk[:, 2:6]))
            for c in range(chunks):
                out.append(blk[:, qs + 4 * c : qs + 4 * c + 4].reshape(-1))
    return np.concatenate(out).reshape(m, row_bytes)


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
def test_repack_writes_the_documented_layout(qtype):
    rows = random_rows(qtype, 24, 3 * BLOCK[qtype], seed=1)
    got = simd_x8.repack(rows, qtype)
    assert got.dtype == np.uint8
    assert np.array_equal(got, numpy_repack(rows, qtype))
    if qtype == GGMLType.Q4_K:  # 6-bit scales and mins unpacked: 4 more bytes a block
        assert got.shape == (24, rows.shape[1] // 144 * 148)
    else:
        assert got.shape == rows.shape
        assert not np.array_equal(got, rows)  # a permutation of the same bytes (Q5_0: bits)
    if qtype == GGMLType.Q4_K:
        pass
    elif qtype == GGMLType.Q5_0:
        for g in range(0, len(rows), 8):  # each group's bits, moved within the group
            ones = np.unpackbits(rows[g : g + 8]).sum()
            assert ones == np.unpackbits(got[g : g + 8]).sum()
    else:
        assert np.array_equal(np.sort(got.reshape(-1)), np.sort(rows.reshape(-1)))
    with pytest.raises(ValueError, match="groups of 8"):
        simd_x8.repack(rows[:12], qtype)
    with pytest.raises(ValueError, match="no x8 layout"):
        simd_x8.repack(rows, GGMLType.Q6_K)


def tolerance_b(w, x, qtype):
    k = x.shape[1]
    size = weight_magnitude(w, qtype, k) @ np.abs(dequantized_activations(x, qtype)).T
    return (k / 32 + 8) * 2.0**-23 * size.T + 1e-30


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
def test_x8_products_match_ggml_vec_dot(qtype):
    # the frozen oracle's third case: 70 rows of x (more than a tile of 64), 5 blocks;
    # its first 32 weight rows are 4 groups
    w, x, _, expected = load_case(qtype, 2)
    w, expected = w[:32], expected[:, :32]
    got = simd_x8.matmul_x8(x, [simd_x8.repack(w, qtype)], qtype, x.shape[1])[0]
    err = np.abs(got.astype(np.float64) - expected)
    tol = tolerance_b(w, x, qtype)
    assert np.all(err <= tol), np.max(err / tol)
    # not ggml's bits everywhere: the float order is another (else this test proves little)
    assert not np.array_equal(got, qdot.matmul_q8(x, w, qtype, x.shape[1]))


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
def test_x8_products_near_the_exact_product(qtype):
    m, k, n = 64, 1536, 11
    w = random_rows(qtype, m, k, seed=2)
    x = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    got = simd_x8.matmul_x8(x, [simd_x8.repack(w, qtype)], qtype, k)[0].astype(np.float64)
    exact = x.astype(np.float64) @ dequantize(w, qtype).astype(np.float64).reshape(m, k).T
    xq = dequantized_activations(x, qtype)
    amag = weight_magnitude(w, qtype, k)
    bound = (np.abs(x - xq) + 2.0**-10 * np.abs(xq)) @ amag.T
    bound += (k / 32 + 8) * 2.0**-23 * (np.abs(xq) @ amag.T)
    assert np.all(np.abs(got - exact) <= bound)
    # against ggml's arithmetic on the same inputs: the same bound as the oracle's
    ggml = qdot.matmul_q8(x, w, qtype, k).astype(np.float64)
    assert np.all(np.abs(got - ggml) <= tolerance_b(w, x, qtype))


EXTREMES = [(t, 0x80 if t == GGMLType.Q8_0 else 0xFF) for t in X8] + [(GGMLType.Q5_0, 0x00)]


@pytest.mark.parametrize("qtype,fill", EXTREMES, ids=lambda v: getattr(v, "name", hex(v)))
def test_extreme_blocks_do_not_overflow_the_16_bit_sums(qtype, fill):
    """Every quant at its largest (15; Q5_0: 15, stored 31, and -16, stored 0; Q8_0: -128,
    which a file may hold; Q4_K: 15 with every scale 63) against activations at +-127:
    each 16-bit lane of the 8 summed pmaddubsw reaches 8 * 2 * 15 * 127 = 30480, just
    below 2**15 (Q5_0's four summed: 4 * 2 * 31 * 127 = 31496; Q8_0's one pmaddubsw
    2 * 128 * 127 = 32512); a sum over more products (or a saturating one) would show
    here as a wrong block sum."""
    k, m = 256, 16
    size = GGML_TYPES[qtype].type_size
    rows = np.full((m, k // BLOCK[qtype], size), fill, np.uint8)
    rows[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    if qtype in (GGMLType.Q4_1, GGMLType.Q4_K):  # no min (Q4_K: its 6-bit scales all 63)
        rows[:, :, 2:4] = np.array([0.0], np.float16).view(np.uint8)
    rows = rows.reshape(m, -1)
    x = np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(3, 0)
    x[1] = 1.0
    x[2] = -1.0
    got = simd_x8.matmul_x8(x, [simd_x8.repack(rows, qtype)], qtype, k)[0]
    exact = x.astype(np.float64) @ dequantize(rows, qtype).astype(np.float64).reshape(m, k).T
    # x is +-1 exactly: quantized to +-127 with d = 1/127 (fp16-rounded), so the only error
    # is that scale's rounding, relative 2**-11
    assert np.allclose(got, exact, rtol=2.0**-10, atol=0)
    largest = {GGMLType.Q4_0: 7, GGMLType.Q4_1: 15, GGMLType.Q5_0: 15, GGMLType.Q8_0: -128}
    largest[GGMLType.Q4_K] = 63 * 15
    expected = -16 if fill == 0 else largest[qtype]
    assert got[1, 0] == pytest.approx(k * expected, 2e-3)


@pytest.mark.parametrize("qtype", X8, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(qtype):
    m, k = 48, 512 if qtype == GGMLType.Q4_K else 320
    w8 = simd_x8.repack(random_rows(qtype, m, k, seed=4), qtype)
    x = np.random.default_rng(5).standard_normal((75, k)).astype(np.float32)
    alone = np.concatenate([simd_x8.matmul_x8(x[i : i + 1], [w8], qtype, k)[0] for i in range(75)])
    for n in (2, 7, 8, 9, 16, 23, 64, 70, 75):
        batch = simd_x8.matmul_x8(x[:n], [w8], qtype, k)[0]
        assert np.array_equal(batch, alone[:n]), n
    # two or three weights in one pass: each as if alone
    w8b = simd_x8.repack(random_rows(qtype, 16, k, seed=6), qtype)
    a, b = simd_x8.matmul_x8(x[:9], [w8, w8b], qtype, k)
    assert np.array_equal(a, alone[:9])
    assert np.array_equal(b, simd_x8.matmul_x8(x[:9], [w8b], qtype, k)[0])


def test_the_backend_multiplies_in_x8_and_looks_up_in_the_file_layout():
    qtype, k = GGMLType.Q4_1, 256
    rows = random_rows(qtype, 24, k, seed=7)
    x = np.random.default_rng(8).standard_normal((3, k)).astype(np.float32)
    be = CPUBackend(n_threads=2)
    w = be.weight("blk.0.ffn_up.weight", qtype, (k, 24), rows.reshape(-1))
    table = be.weight("token_embd.weight", qtype, (k, 24), rows.reshape(-1))
    be.get_rows(table, np.array([3, 1]))
    assert table.x8 is None  # a lookup never repacks
    assert be.memory_report()["repacked"] == 0
    got = be.matmul(x, w)
    assert w.x8 is not None and np.array_equal(w.x8, simd_x8.repack(rows, qtype))
    assert be.memory_report()["repacked"] == rows.nbytes
    assert np.array_equal(got, simd_x8.matmul_x8(x, [w.x8], qtype, k)[0])
    gate, up = be.matmul_many(x, (w, w))
    assert np.array_equal(gate, got) and np.array_equal(up, got)
    # --no-repack, and a matrix whose rows are not whole groups of 8: ggml's own bits
    plain = CPUBackend(n_threads=2, repack=False)
    w2 = plain.weight("blk.0.ffn_up.weight", qtype, (k, 24), rows.reshape(-1))
    assert np.array_equal(plain.matmul(x, w2), qdot.matmul_q8(x, rows, qtype, k))
    assert w2.x8 is None
    odd = be.weight("blk.0.attn_k.weight", qtype, (k, 12), rows[:12].reshape(-1))
    assert np.array_equal(be.matmul(x, odd), qdot.matmul_q8(x, rows[:12], qtype, k))
    assert odd.x8 is None
