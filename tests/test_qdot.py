"""qdot: llama.cpp's quantized matmul arithmetic, checked against frozen ggml-cpu output.

The oracle files (tests/data/qdot/<TYPE>.npz, made by tests/data/gen_qdot_oracle.py from
the peer's libggml-cpu) hold random weights and activations, ggml's quantized activation
rows and ggml's vec_dot result for every (row of x, row of w). We check:

(a) our activation quantization writes ggml's bytes exactly;
(b) our matmul equals ggml's up to float32 accumulation order: the integer block dots are
    exact on both sides, and each side adds its O(k / 32) scaled block terms in float32 in
    its own order, so each is within about ``(k / 32 + 8) * 2**-24 * S`` of the exact sum
    of the same terms, where ``S = sum_j A_j * |xq_j|`` bounds the sum of |terms| (A_j: the
    weight's magnitude with its min term counted positive, see ``weight_magnitude``);
(c) the result is the exact float64 product ``x @ W.T`` up to the activation rounding:
    ``|ours - exact| <= sum_j A_j * (|x_j - xq_j| + 2**-10 |xq_j|) + tol(b)`` (2**-10 covers
    Q8_1's fp16 block sums), with ``|x_j - xq_j| <= 0.57 * d_block`` for the Q8 types.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from picollama.backends.cpu.qdot import SUPPORTED_TYPES, matmul_q8, supports, vec_dot_type
from picollama.backends.cpu.qdot_act import (
    f16_bits_to_f32,
    f32_to_f16_bits,
    pack_rows,
    quantize_rows,
)
from picollama.backends.cpu.simd import SIMD_TYPES
from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant import dequantize

DATA = Path(__file__).parent / "data" / "qdot"
N_CASES = 3

# fp16 field of each type's min term (m or dmin): flipping its sign turns d*q - m into
# d*q + m, so max(|w|, |w flipped|) = |d*q| + |m| bounds both terms of a weight.
MIN_FIELD = {
    GGMLType.Q4_1: 2,
    GGMLType.Q5_1: 2,
    GGMLType.Q2_K: 82,
    GGMLType.Q4_K: 2,
    GGMLType.Q5_K: 2,
}

TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.name)


def load_case(qtype: GGMLType, c: int):
    with np.load(DATA / f"{qtype.name}.npz") as f:
        return f[f"w{c}"], f[f"x{c}"], f[f"xq{c}"], f[f"out{c}"]


def weight_magnitude(w: np.ndarray, qtype: GGMLType, k: int) -> np.ndarray:
    """|weight| with the min term counted positive: float64 (m, k)."""
    a = np.abs(dequantize(w, qtype).astype(np.float64))
    if qtype in MIN_FIELD:
        info = GGML_TYPES[qtype]
        blocks = w.reshape(w.shape[0], -1, info.type_size).copy()
        blocks[:, :, MIN_FIELD[qtype] + 1] ^= 0x80
        flipped = np.abs(dequantize(blocks.reshape(w.shape), qtype).astype(np.float64))
        a = np.maximum(a, flipped)
    return a.reshape(w.shape[0], k)


def dequantized_activations(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """Our activation rows as the values they stand for: float64 (n, k)."""
    q = quantize_rows(x, vec_dot_type(qtype))
    if q.qs.dtype == np.float32:
        return q.qs.astype(np.float64)
    block = x.shape[1] // q.d.shape[1]
    return q.qs.astype(np.float64) * np.repeat(q.d.astype(np.float64), block, axis=1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_activation_quantization_matches_ggml_bytes(qtype):
    for c in range(N_CASES):
        _, x, xq, _ = load_case(qtype, c)
        ours = pack_rows(quantize_rows(x, vec_dot_type(qtype)))
        assert ours.shape == xq.shape
        bad = np.argwhere(ours != xq)
        assert bad.size == 0, f"case {c}: first differing (row, byte) {bad[:5].tolist()}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_ggml_vec_dot(qtype):
    for c in range(N_CASES):
        w, x, _, expected = load_case(qtype, c)
        k = x.shape[1]
        w = w.view()
        w.flags.writeable = False  # as the mmap views the backend passes
        got = matmul_q8(x, w, qtype, k)
        assert got.dtype == np.float32 and got.shape == expected.shape
        size = weight_magnitude(w, qtype, k) @ np.abs(dequantized_activations(x, qtype)).T
        tol = (k / 32 + 8) * 2.0**-23 * size.T + 1e-30
        err = np.abs(got.astype(np.float64) - expected)
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert np.all(err <= tol), (
            f"case {c} (n, m, k = {x.shape[0]}, {w.shape[0]}, {k}): at {worst} "
            f"got {got[worst]!r}, ggml {expected[worst]!r}, tol {tol[worst]:.3g}"
        )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_near_exact_product(qtype):
    for c in range(N_CASES):
        w, x, _, _ = load_case(qtype, c)
        k = x.shape[1]
        got = matmul_q8(x, w, qtype, k).astype(np.float64)
        wf = dequantize(w, qtype).astype(np.float64).reshape(w.shape[0], k)
        exact = x.astype(np.float64) @ wf.T
        xq = dequantized_activations(x, qtype)
        dx = np.abs(x - xq)
        q = quantize_rows(x, vec_dot_type(qtype))
        if q.qs.dtype == np.int8:  # round to nearest: half a step, plus fp16 rounding of d
            block = k // q.d.shape[1]
            step = np.repeat(np.abs(q.d.astype(np.float64)), block, axis=1)
            assert np.all(dx <= 0.57 * step + 1e-30), f"case {c}: activation rounding"
        amag = weight_magnitude(w, qtype, k)
        bound = (dx + 2.0**-10 * np.abs(xq)) @ amag.T
        bound += (k / 32 + 8) * 2.0**-23 * (np.abs(xq) @ amag.T) + 1e-30
        assert np.all(np.abs(got - exact) <= bound), f"case {c}"


def _q8_reference(x: np.ndarray, with_sum: bool) -> np.ndarray:
    """ggml's AVX2 quantize_row_q8_0 / q8_1 in numpy, block by block: ggml's bytes."""
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint((blocks * inv[:, :, None]).astype(np.float32)), -128, 127).astype(np.int8)
    # scales past float16's range become inf there, as in ggml's conversion
    with np.errstate(over="ignore"):
        head = [d.astype(np.float16).view(np.uint8).reshape(n, -1, 2)]
        if with_sum:
            s = (d * q.astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
            head.append(s.astype(np.float16).view(np.uint8).reshape(n, -1, 2))
    return np.concatenate(head + [q.view(np.uint8)], axis=2).reshape(n, -1)


@pytest.mark.parametrize("vtype", [GGMLType.Q8_0, GGMLType.Q8_1], ids=lambda t: t.name)
def test_q8_quantization_of_awkward_blocks_is_ggml(vtype):
    """The vector block quantizer (``q8_block``) on the blocks random rows rarely hold: all
    zeros, one huge value among tiny ones, halves that round to even, negative zeros, values
    whose fp16 scale is subnormal or overflows to infinity, and magnitudes from 1e-30 to 3e38."""
    rng = np.random.default_rng(5)
    rows = []
    for scale in 10.0 ** np.arange(-30, 39, 3):
        rows.append(rng.standard_normal(32 * 6) * scale)
    special = np.zeros((6, 32))
    special[1, 7] = 3e38
    special[1, :7] = 1e-20
    special[2] = np.arange(32) - 15.5  # x * id lands on many .5 ties
    special[3] = -0.0
    special[3, 5] = -1e-3
    special[4] = rng.standard_normal(32) * 1e-6  # d below fp16's smallest normal
    special[5] = rng.standard_normal(32) * 1e7  # d past fp16's largest finite
    rows.append(special.reshape(-1))
    x = np.concatenate(rows).astype(np.float32).reshape(-1, 96)
    got = pack_rows(quantize_rows(x, vtype))
    np.testing.assert_array_equal(got, _q8_reference(x, vtype == GGMLType.Q8_1))


def test_fp16_conversion_matches_numpy():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [
            0,
            0x80000000,
            0x477FEFFF,
            0x477FF000,
            0x33000000,
            0x33000001,
            0x387FFFFF,
            0x38800000,
            0x7F800000,
            0xFF800000,
        ],
        np.uint32,
    )
    values = np.concatenate([bits, special]).view(np.float32)
    values = values[~np.isnan(values)]
    with np.errstate(over="ignore"):  # values past float16's range: inf, numpy's and ours
        expected = values.astype(np.float16).view(np.uint16)
    got = np.array([f32_to_f16_bits(v) for v in values[:20000]], np.uint16)
    np.testing.assert_array_equal(got, expected[:20000])
    small = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-9, 5, 5000)).astype(np.float32)
    got = np.array([f32_to_f16_bits(v) for v in small], np.uint16)
    with np.errstate(over="ignore"):
        expected_small = small.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, expected_small)
    halves = np.arange(0, 2**16, dtype=np.uint32)
    halves = halves[(halves & 0x7C00) != 0x7C00]
    back = np.array([f16_bits_to_f32(h) for h in halves], np.float32)
    np.testing.assert_array_equal(
        back, halves.astype(np.uint16).view(np.float16).astype(np.float32)
    )


def test_supports_and_errors():
    assert supports(GGMLType.Q4_K) and supports(int(GGMLType.Q8_0))
    assert not supports(GGMLType.IQ2_XXS) and not supports(999)
    w = np.zeros((2, 18), np.uint8)
    with pytest.raises(ValueError, match="multiple"):
        matmul_q8(np.zeros((1, 33), np.float32), w, GGMLType.Q4_0, 33)
    with pytest.raises(ValueError, match="does not support"):
        matmul_q8(np.zeros((1, 256), np.float32), w, GGMLType.IQ2_XXS, 256)
    with pytest.raises(ValueError, match="uint8"):
        matmul_q8(np.zeros((1, 32), np.float32), np.zeros((2, 17), np.uint8), GGMLType.Q4_0, 32)


# Types whose SIMD kernel (simd.py) mirrors ggml-cpu's AVX2 vec_dot operation for operation:
# the result must be ggml's to the last bit, not merely within rounding. (Q6_K takes its -32
# offset through the group sums: the same integers, float32 sums in another order, bounded by
# (b) above.) Bits matter here: activations are re-quantized to 8 bits before every matmul,
# so a last-bit difference can move a rounding step and grow, layer by layer, into logits
# that differ by tenths, enough to change greedy tokens against llama.cpp's.
BIT_EXACT = [
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q8_0,
    GGMLType.Q4_K,
]


@pytest.mark.parametrize("qtype", sorted(SIMD_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(qtype):
    """Batch invariance: each row of x is dotted by the same instruction sequence whatever
    rows surround it, so a server slot batched with others, or a speculative verification
    of several tokens, gets exactly the logits a lone decode step gets."""
    from picollama.backends.cpu.bench_qdot import random_weights

    rng = np.random.default_rng(11)
    k = 256 * 3 if qtype in (GGMLType.Q4_K, GGMLType.Q6_K) else 32 * 9
    w = random_weights(rng, qtype, 70, k)
    x = rng.standard_normal((21, k)).astype(np.float32)
    whole = matmul_q8(x, w, qtype, k)
    for n in (1, 2, 3, 4, 5, 8, 9):
        for start in (0, 21 - n):
            part = matmul_q8(x[start : start + n], w, qtype, k)
            assert np.array_equal(part, whole[start : start + n]), (n, start)


# Types whose kernels dot one weight row with several rows of x at once (prefill, a
# speculative verification, a server batch): their grouping of rows must not show in the bits.
ROW_GROUPED = [
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q8_0,
    GGMLType.Q4_K,
    GGMLType.Q6_K,
]


def batch_mismatches(qtype: GGMLType) -> list[tuple[int, int, int]]:
    """(k, n, start) of every n-row matmul (n = 1..17) of rows ``start..start+n-1`` of x whose
    result is not, bit for bit, those rows' results computed one at a time. Sizes are
    awkward: 37 weight rows (tasks of uneven length), k off the larger multiples (and, for
    float weights, off the 32-wide chunk, so the zero-padded tail runs; for the 32-weight
    types, 71 blocks: a whole chunk of ``vec_dot_packed``'s scale buffer and a part)."""
    from picollama.backends.cpu.bench_qdot import random_weights

    rng = np.random.default_rng(int(qtype))
    block = GGML_TYPES[qtype].block_size
    ks = {1: (33, 577), 32: (32 * 7, 32 * 71), 256: (256 * 3,)}[block]
    bad = []
    for k in ks:
        w = random_weights(rng, qtype, 37, k)
        x = rng.standard_normal((20, k)).astype(np.float32)
        alone = np.concatenate([matmul_q8(x[i : i + 1], w, qtype, k) for i in range(20)])
        for n in range(1, 18):
            for start in (0, 20 - n):
                got = matmul_q8(x[start : start + n], w, qtype, k)
                if not np.array_equal(got, alone[start : start + n]):
                    bad.append((k, n, start))
    return bad


@pytest.mark.parametrize("qtype", ROW_GROUPED, ids=lambda t: t.name)
def test_every_batch_size_gives_each_row_its_own_bits(qtype):
    """Batch invariance for every batch size up to 17: whatever group of rows a kernel pass
    takes (1, 2, 3, 8 ... and the leftover ones), each row gets its lone result's bits."""
    assert batch_mismatches(qtype) == []


@pytest.mark.parametrize("qtype", BIT_EXACT, ids=lambda t: t.name)
def test_simd_matmul_is_ggml_bit_for_bit(qtype):
    for c in range(N_CASES):
        w, x, _, expected = load_case(qtype, c)
        got = matmul_q8(x, w, qtype, x.shape[1])
        differ = np.argwhere(got.astype(np.float64) != expected)
        assert differ.size == 0, f"case {c}: first differing (row, col) {differ[:5].tolist()}"


_MANY_SCRIPT = """
import sys, numpy as np
from picollama.backends.cpu.bench_qdot import random_weights
from picollama.backends.cpu.qdot import matmul_many_q8, matmul_q8
from picollama.gguf.constants import GGMLType
t = GGMLType[sys.argv[1]]
rng = np.random.default_rng(7)
ws = [random_weights(rng, t, m, 256) for m in (96, 32, 32)]
for n in (1, 6):
    x = rng.standard_normal((n, 256)).astype(np.float32)
    for count in (2, 3):
        got = matmul_many_q8(x, ws[:count], t, 256)
        for w, g in zip(ws, got):
            assert np.array_equal(g, matmul_q8(x, w, t, 256)), (t.name, n, count)
print("ok")
"""


def test_matmul_many_equals_separate_calls_across_processes():
    """Q, K and V (or gate and up) in one pass give what separate calls give, for types
    whose kernels share a signature, each in a fresh process: the second loads the first's
    compiled kernels from Numba's disk cache, which must not hand one type another's code."""
    import subprocess
    import sys

    for name in ("Q4_1", "Q5_0", "Q4_K", "Q6_K"):
        proc = subprocess.run(
            [sys.executable, "-c", _MANY_SCRIPT, name], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


_ISA_SCRIPT = """
import sys
import numpy as np
from picollama.backends.cpu import simd
from picollama.backends.cpu.attention import attention
from picollama.backends.cpu.qdot import matmul_q8
from picollama.gguf.constants import GGMLType
for name in __TYPES__:
    t = GGMLType[name]
    with np.load("__DATA__/" + name + ".npz") as f:
        for c in range(3):
            w, x, out = f[f"w{c}"], f[f"x{c}"], f[f"out{c}"]
            got = matmul_q8(x, w, t, x.shape[1])
            np.save("__OUT__/mm_%s_%d.npy" % (name, c), got)
from picollama.backends.cpu import simd_x8
for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K"):
    with np.load("__DATA__/" + name + ".npz") as f:
        w, x = f["w2"][:32], f["x2"]
    t = GGMLType[name]
    got = simd_x8.matmul_x8(x, [simd_x8.repack(w, t)], t, x.shape[1])[0]
    np.save("__OUT__/x8_%s.npy" % name, got)
rng = np.random.default_rng(3)
k = rng.standard_normal((80, 2, 64)).astype(np.float16)
v = rng.standard_normal((80, 2, 64)).astype(np.float16)
for n, start in ((3, 60), (70, 0)):
    q = rng.standard_normal((n, 6, 64)).astype(np.float32)
    out = attention(q, k.view(np.uint16), v.view(np.uint16), start, 0.125)
    np.save("__OUT__/attn_%d.npy" % n, out)
sys.path.insert(0, "__TESTS__")
from test_qdot import ROW_GROUPED, batch_mismatches
for t in ROW_GROUPED:
    assert batch_mismatches(t) == [], (t.name, batch_mismatches(t))
print(simd.HAS_AVX2, simd.HAS_VNNI)
"""


# the SIMD types, and the float types (their dots are plain LLVM vector code, the same
# operations on every target, F16's widening apart)
ISA_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "F32", "F16", "BF16")


_ISAS = ("generic", "avx2")


@pytest.fixture(scope="module")
def isa_runs(tmp_path_factory):
    """``_ISA_SCRIPT`` under each fallback ISA, started together: each process compiles
    on one core (most of its time), so the two take the time of the longer one, not of
    both. ``{isa: (output folder, process)}``; each test below waits for its own."""
    import os
    import subprocess
    import sys

    runs = {}
    for isa in _ISAS:
        out = tmp_path_factory.mktemp(f"isa_{isa}")
        script = (
            _ISA_SCRIPT.replace("__TYPES__", repr(ISA_TYPES))
            .replace("__DATA__", str(DATA))
            .replace("__OUT__", str(out))
            .replace("__TESTS__", str(Path(__file__).parent))
        )
        env = dict(os.environ, PICOLLAMA_CPU_ISA=isa, NUMBA_CACHE_DIR=str(out / "cache"))
        # output to files: a pipe nobody reads yet could fill and stall the process
        with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
            proc = subprocess.Popen([sys.executable, "-c", script], stdout=so, stderr=se, env=env)
        runs[isa] = (out, proc)
    yield runs
    for _, proc in runs.values():
        if proc.poll() is None:  # a test that failed before waiting for its process
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("isa", _ISAS)
def test_fallback_isa_paths_give_the_same_bits(isa, isa_runs):
    """The SIMD dots and attention compiled without AVX-512 (avx2) and without any x86
    instruction asked for by name (generic: what a CPU without AVX2/F16C, or ARM, runs)
    give the native build's bits, on the frozen oracle's inputs, and batch invariance
    holds there too (other groupings of rows: fewer rows fit the registers). Each in a
    fresh process with its own Numba cache (the cache does not know the ISA setting)."""
    import subprocess

    from picollama.backends.cpu import simd_x8
    from picollama.backends.cpu.attention import attention

    tmp_path, proc = isa_runs[isa]
    try:
        proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, f"the {isa} build failed or ran 20 minutes: {stderr[-3000:]}"
    has_avx2, has_vnni = (tmp_path / "stdout").read_text().split()
    assert has_vnni == "False" and (has_avx2 == "False") == (isa == "generic")
    for name in ISA_TYPES:
        for c in range(N_CASES):
            w, x, _, _ = load_case(GGMLType[name], c)
            native = matmul_q8(x, w, GGMLType[name], x.shape[1])
            assert np.array_equal(np.load(tmp_path / f"mm_{name}_{c}.npy"), native), (name, c)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K"):  # the x8 dots (simd_x8)
        w, x, _, _ = load_case(GGMLType[name], 2)
        t = GGMLType[name]
        native = simd_x8.matmul_x8(x, [simd_x8.repack(w[:32], t)], t, x.shape[1])[0]
        assert np.array_equal(np.load(tmp_path / f"x8_{name}.npy"), native), name
    rng = np.random.default_rng(3)
    k = rng.standard_normal((80, 2, 64)).astype(np.float16)
    v = rng.standard_normal((80, 2, 64)).astype(np.float16)
    for n, start in ((3, 60), (70, 0)):
        q = rng.standard_normal((n, 6, 64)).astype(np.float32)
        native = attention(q, k.view(np.uint16), v.view(np.uint16), start, 0.125)
        assert np.array_equal(np.load(tmp_path / f"attn_{n}.npy"), native)
