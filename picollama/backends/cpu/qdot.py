"""Quantized matmul with llama.cpp's CPU arithmetic: int8 activations, integer block dots.

``matmul_q8(x, w, qtype, k)`` returns ``x @ W.T`` for float32 ``x`` (n, k) and the raw
ggml weight bytes ``w`` (m, row_bytes) of type ``qtype``, computed as ggml-cpu's
``ggml_compute_forward_mul_mat`` computes it:

1. each row of x is converted once to the weight type's ``vec_dot_type`` (``qdot_act``:
   Q8_0, Q8_1, Q8_K, F16, BF16 or F32, bit for bit as the peer's AVX2 build);
2. each output is the type's ``ggml_vec_dot_<wtype>_<vtype>``: per block (32 weights) or
   super-block (256), an exact integer dot of weight quants and activation quants, then
   float32 scaling and accumulation: Q8_0 family ``sum += (dw * dx) * isum``; Q8_1 family
   ``sum += (dw * dx) * isum + mw * sx``; Q8_K family
   ``sum += (dw * dx) * isum - (dminw * dx) * sum_g(min_g * bsum_g)``; float types
   ``sum += w_j * x_j``.

Numerics. The integer parts are exact, as in ggml. The float accumulation inside a row
runs in float32 in another order than the peer's SIMD lanes (LLVM may split and fuse it;
the kernels are compiled with fast-math), so an output differs from ggml's by float32
rounding only: at most a few ``2**-24 * n_blocks * sum |terms|``, about 1e-7 relative.
Three spots differ in the order of float32 products rather than sums (same bound): Q4_0
generic writes ``isum * dx * dy`` where AVX2 and we use ``(dx * dy) * isum``; IQ4_XS folds
its sub-block scale ``ls - 32`` into the integer sum instead of into a float scale; F16 and
BF16 dots sum in float32 lanes where ggml adds the tail in double.

Layout of the work: each Numba task owns a range of weight rows; a row is unpacked once
(``qdot_unpack``) into int16 quants and block scales that stay in L1, and then dotted with
every row of x in tiles of ``TILE_ROWS`` (so a tile of quantized x stays in L2 while all the
task's weight rows pass over it). Threads: the caller sets ``numba.set_num_threads``.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from picollama.backends.cpu import qdot_unpack as U
from picollama.backends.cpu.intrinsics import opaque
from picollama.backends.cpu.qdot_act import (
    VEC_DOT_TYPE,
    _quantize_q8_0,
    _quantize_q8_k,
    _round_bf16,
    _round_f16,
    quantize_packed,
    quantize_rows,
)
from picollama.backends.cpu.simd import (
    LEGACY_TYPES,
    PACKED_OFFSET,
    SIMD_TYPES,
    vec_dot_packed,
    vec_dot_rows,
)
from picollama.backends.cpu.simd_float import FLOAT_GROUP, FLOAT_WROWS, float_dot_rows
from picollama.gguf.constants import GGML_TYPES, QK_K, GGMLType

__all__ = ["SUPPORTED_TYPES", "supports", "matmul_q8", "matmul_many_q8", "vec_dot_type"]

# Rows of x dotted with one unpacked weight row before the next weight row is unpacked.
TILE_ROWS = 64
# how many weight tiles ahead of the one it works on a float batch prefetches (1 and 4
# measured alike)
PREFETCH_TILES = 2

_FAM_Q8_0, _FAM_Q8_1, _FAM_Q8_K = 0, 1, 2

# A batch's activations are quantized by all threads from this many blocks of 32 on (rows
# times blocks a row): below it a parallel region's start (~1.4 us on 2 threads) costs more
# than it saves (a block takes ~16 ns; 8 rows of 576 are 144 blocks, of 1536 384).
_PARALLEL_BLOCKS = 256

# weight type: (row unpacker, family, block length)
_QUANT = {
    GGMLType.Q4_0: (U.unpack_q4_0, _FAM_Q8_0, 32),
    GGMLType.Q5_0: (U.unpack_q5_0, _FAM_Q8_0, 32),
    GGMLType.Q8_0: (U.unpack_q8_0, _FAM_Q8_0, 32),
    GGMLType.IQ4_NL: (U.unpack_iq4_nl, _FAM_Q8_0, 32),
    GGMLType.Q4_1: (U.unpack_q4_1, _FAM_Q8_1, 32),
    GGMLType.Q5_1: (U.unpack_q5_1, _FAM_Q8_1, 32),
    GGMLType.Q2_K: (U.unpack_q2_k, _FAM_Q8_K, QK_K),
    GGMLType.Q3_K: (U.unpack_q3_k, _FAM_Q8_K, QK_K),
    GGMLType.Q4_K: (U.unpack_q4_k, _FAM_Q8_K, QK_K),
    GGMLType.Q5_K: (U.unpack_q5_k, _FAM_Q8_K, QK_K),
    GGMLType.Q6_K: (U.unpack_q6_k, _FAM_Q8_K, QK_K),
    GGMLType.IQ4_XS: (U.unpack_iq4_xs, _FAM_Q8_K, QK_K),
}
_FLOAT = (GGMLType.F16, GGMLType.BF16, GGMLType.F32)

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(_QUANT) | frozenset(_FLOAT)


def supports(qtype) -> bool:
    """Whether ``matmul_q8`` takes weights of ggml type ``qtype``."""
    try:
        return GGMLType(qtype) in SUPPORTED_TYPES
    except ValueError:
        return False


def vec_dot_type(qtype) -> GGMLType:
    """The type ggml-cpu converts activations to before multiplying weights of ``qtype``."""
    return VEC_DOT_TYPE[GGMLType(qtype)]


# ---- kernels ----


@njit(inline="always")
def _isum(wq, xq, e0, length):
    """Exact sum of wq[e0 + j] * xq[i, e0 + j] over ``length`` (32 or 256) elements."""
    s = 0
    for j in range(min(opaque(length), length)):
        s += wq[e0 + j] * xq[e0 + j]
    return s


def unpack_row(qtype, w, r, n_blocks, wq, wd, wm, wmin):
    """The type's ``qdot_unpack.unpack_*`` (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("unpack_row is only callable from Numba-compiled code")


@overload(unpack_row)
def _unpack_row_overload(qtype, w, r, n_blocks, wq, wd, wm, wmin):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    unpack = _QUANT[GGMLType(qtype.literal_value)][0]

    def impl(qtype, w, r, n_blocks, wq, wd, wm, wmin):
        unpack(w, r, n_blocks, wq, wd, wm, wmin)

    return impl


@functools.cache
def _quant_rows(qtype: int):
    """One type's serial row kernel.

    The closure captures only integers (its type, family and block), so Numba's disk cache
    finds it again in a later process."""
    _, fam, block = _QUANT[GGMLType(qtype)]
    qtype = int(qtype)

    @njit(cache=True, fastmath=True)
    def rows(xq, xd, xs, bsums, w, out, k, r_lo, r_hi):
        """Rows r_lo..r_hi of out: serial code (LLVM vectorizes it better outside a parfor)."""
        n = xq.shape[0]
        n_blocks = k // block
        wq = np.empty(k, np.int16)
        wd = np.empty(n_blocks, np.float32)
        wm = np.zeros(n_blocks, np.float32)
        wmin = np.zeros(k // 16, np.int32)
        isums = np.empty(n_blocks, np.int32)
        for i0 in range(0, n, TILE_ROWS):
            i1 = min(n, i0 + TILE_ROWS)
            for r in range(r_lo, r_hi):
                unpack_row(qtype, w, r, n_blocks, wq, wd, wm, wmin)
                for i in range(i0, i1):
                    xrow = xq[i]
                    # integer block dots first, then one vectorizable float loop over blocks
                    for b in range(n_blocks):
                        isums[b] = _isum(wq, xrow, b * block, block)
                    dx = xd[i]
                    acc = np.float32(0.0)
                    if fam == _FAM_Q8_0:
                        for b in range(n_blocks):
                            acc += (wd[b] * dx[b]) * np.float32(isums[b])
                    elif fam == _FAM_Q8_1:
                        sx = xs[i]
                        for b in range(n_blocks):
                            acc += (wd[b] * dx[b]) * np.float32(isums[b]) + wm[b] * sx[b]
                    else:
                        for b in range(n_blocks):
                            summs = 0
                            for g in range(16):
                                summs += wmin[b * 16 + g] * bsums[i, b * 16 + g]
                            dmin = wm[b] * dx[b]
                            acc += (wd[b] * dx[b]) * np.float32(isums[b]) - dmin * np.float32(summs)
                    out[i, r] = acc

    return rows


def quant_rows(qtype, xq, xd, xs, bsums, w, out, k, r_lo, r_hi):
    """The type's serial row kernel (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("quant_rows is only callable from Numba-compiled code")


@overload(quant_rows)
def _quant_rows_overload(qtype, xq, xd, xs, bsums, w, out, k, r_lo, r_hi):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    rows = _quant_rows(qtype.literal_value)

    def impl(qtype, xq, xd, xs, bsums, w, out, k, r_lo, r_hi):
        rows(xq, xd, xs, bsums, w, out, k, r_lo, r_hi)

    return impl


@functools.cache
def _quant_kernel(qtype: int):
    """The parallel kernel of one type (captures only the type id, so it is disk-cached)."""
    qtype = int(qtype)

    @njit(cache=True, parallel=True)
    def kernel(xq, xd, xs, bsums, w, out, k, n_tasks):
        m = w.shape[0]
        for t in prange(n_tasks):
            r_lo = t * m // n_tasks
            r_hi = (t + 1) * m // n_tasks
            quant_rows(qtype, xq, xd, xs, bsums, w, out, k, r_lo, r_hi)

    return kernel


# Rows of x a packed vec_dot pass takes at most: 8 accumulators (two rows share a 512-bit
# one on AVX-512; with AVX2 8 of the 16 registers, the rows' scales broadcast from memory)
PACKED_GROUP = 8


def _vec_dot_packed_few(qtype, count, w, r, xqp, xdp, xsp, xcp, t, out, i):
    """``vec_dot_packed`` of ``count`` rows, 0..PACKED_GROUP - 1 known at run time only
    (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("_vec_dot_packed_few is only callable from Numba-compiled code")


@overload(_vec_dot_packed_few, inline="always")
def _vec_dot_packed_few_overload(qtype, count, w, r, xqp, xdp, xsp, xcp, t, out, i):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    q = qtype.literal_value
    assert PACKED_GROUP <= 8

    def impl(qtype, count, w, r, xqp, xdp, xsp, xcp, t, out, i):
        if count == 1:
            vec_dot_packed(q, 1, w, r, xqp, xdp, xsp, xcp, t, out, i)
        elif count == 2:
            vec_dot_packed(q, 2, w, r, xqp, xdp, xsp, xcp, t, out, i)
        elif count == 3:
            vec_dot_packed(q, 3, w, r, xqp, xdp, xsp, xcp, t, out, i)
        elif count == 4:
            vec_dot_packed(q, 4, w, r, xqp, xdp, xsp, xcp, t, out, i)
        elif count == 5:
            vec_dot_packed(q, 5, w, r, xqp, xdp, xsp, xcp, t, out, i)
        elif count == 6:
            vec_dot_packed(q, 6, w, r, xqp, xdp, xsp, xcp, t, out, i)
        elif count == 7:
            vec_dot_packed(q, 7, w, r, xqp, xdp, xsp, xcp, t, out, i)

    return impl


@functools.cache
def _simd_parts(qtype: int):
    """(quantize, rows) for a type with a SIMD block dot (``simd.vec_dot_rows``).

    ``quantize(x)`` converts the activation rows to the type's dot type (in parallel over
    rows or blocks for a batch) and returns ``(xq, xd, xs, bsums)``, ``xs`` for Q8_1 each block's
    scale and sum side by side (n, 2 * blocks); for a batch of a 32-weight type, the four
    are block-major instead (``qdot_act.quantize_packed``: quants, scales, Q8_1 sums and
    VNNI offsets), which every task reads. ``rows(w,
    xq, xd, xs, bsums, out, r_lo, r_hi)`` fills ``out[:, r_lo:r_hi]`` (``out``'s rows say
    which layout it got): for decode row by row, for a batch each weight row once per tile
    of x rows, dotted with several x rows at a time."""
    qtype = int(qtype)
    vtype = VEC_DOT_TYPE[GGMLType(qtype)]
    k_quant = vtype == GGMLType.Q8_K
    with_sum = vtype == GGMLType.Q8_1
    with_offset = GGMLType(qtype) in PACKED_OFFSET

    @njit(cache=True, parallel=True)
    def quantize(x):
        n, k = x.shape
        nb = k // 32
        if k_quant:
            xq = np.empty((n, k), np.int8)
            xd = np.empty((n, k // QK_K), np.float32)
            bsums = np.empty((n, k // 16), np.int32)
            xs = np.empty((n, 0), np.float32)
            if n < 8:  # a parallel region costs more than a few rows take
                _quantize_q8_k(x, xq, xd, bsums)
            else:
                for i in prange(n):
                    _quantize_q8_k(x[i : i + 1], xq[i : i + 1], xd[i : i + 1], bsums[i : i + 1])
        elif n > 1:
            # a batch: straight into the block-major layout every task reads, the blocks
            # split among the threads when there are enough of them to pay for a region
            xqp = np.empty((nb, n * 32), np.int8)
            xdp = np.empty((nb, n), np.float32)
            xsp = np.empty((nb, n if with_sum else 0), np.float32)
            xcp = np.empty((nb, n * 8 if with_offset else 0), np.int32)
            if n * nb >= _PARALLEL_BLOCKS:
                for b in prange(nb):
                    quantize_packed(x, xqp, xdp, xsp, xcp, b, b + 1)
            else:
                quantize_packed(x, xqp, xdp, xsp, xcp, 0, nb)
            return xqp, xdp, xsp, xcp
        else:
            xq = np.empty((n, k), np.int8)
            xd = np.empty((n, nb), np.float32)
            xs = np.empty((n, nb if with_sum else 0), np.float32)
            bsums = np.empty((n, 0), np.int32)
            dbits = np.empty((n, nb), np.uint16)
            sbits = np.empty((n, nb if with_sum else 0), np.uint16)
            _quantize_q8_0(x, xq, xd, dbits, xs, sbits, with_sum)
            if with_sum:
                # the SIMD dots read a block's scale and sum as one pair
                pairs = np.empty((n, 2 * nb), np.float32)
                pairs[:, 0::2] = xd
                pairs[:, 1::2] = xs
                return xq, xd, pairs, bsums
        return xq, xd, xs, bsums

    # decode: one weight row at a time. Two rows' independent accumulator chains looked
    # like a gain for Q6_K's long block, but their live registers spill: measured 4-7 GB/s
    # a core two rows at a time, 20-24 GB/s one (Q8_0: 16 against 39).

    @njit(inline="always")
    def rows_k(w, xq, xd, xs, bsums, out, r_lo, r_hi):
        n = xq.shape[0]
        if n == 1:
            for r in range(r_lo, r_hi):
                vec_dot_rows(qtype, 1, 1, w, r, xq, xd, xs, bsums, 0, out)
            return
        # a batch: each weight row read from memory once per tile, its super-blocks
        # loaded once per pass over up to 4 rows of x
        for i0 in range(0, n, TILE_ROWS):
            i1 = min(n, i0 + TILE_ROWS)
            for r in range(r_lo, r_hi):
                i = i0
                while i + 4 <= i1:
                    vec_dot_rows(qtype, 4, 1, w, r, xq, xd, xs, bsums, i, out)
                    i += 4
                if i1 - i == 3:
                    vec_dot_rows(qtype, 3, 1, w, r, xq, xd, xs, bsums, i, out)
                elif i1 - i == 2:
                    vec_dot_rows(qtype, 2, 1, w, r, xq, xd, xs, bsums, i, out)
                elif i1 - i == 1:
                    vec_dot_rows(qtype, 1, 1, w, r, xq, xd, xs, bsums, i, out)

    @njit(inline="always")
    def rows_legacy(w, xq, xd, xs, bsums, out, r_lo, r_hi):
        n = out.shape[0]
        if n == 1:
            for r in range(r_lo, r_hi):
                vec_dot_rows(qtype, 1, 1, w, r, xq, xd, xs, bsums, 0, out)
            return
        # a batch: quantize packed x block-major (``quantize_packed``: xq, xd, xs, bsums are
        # then the packed quants, scales, sums and offsets); each weight row is read from
        # memory once per tile of x rows and its blocks unpacked once per pass over up to
        # PACKED_GROUP rows
        for i0 in range(0, n, TILE_ROWS):
            c = min(n, i0 + TILE_ROWS) - i0
            for r in range(r_lo, r_hi):
                t = 0
                while t + PACKED_GROUP <= c:
                    vec_dot_packed(
                        qtype, PACKED_GROUP, w, r, xq, xd, xs, bsums, i0 + t, out, i0 + t
                    )
                    t += PACKED_GROUP
                _vec_dot_packed_few(qtype, c - t, w, r, xq, xd, xs, bsums, i0 + t, out, i0 + t)

    rows = rows_legacy if GGMLType(qtype) in LEGACY_TYPES else rows_k
    return quantize, rows


def simd_quantize(qtype, x):
    """The type's ``_simd_parts`` quantize (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("simd_quantize is only callable from Numba-compiled code")


@overload(simd_quantize)
def _simd_quantize_overload(qtype, x):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    quantize = _simd_parts(qtype.literal_value)[0]

    def impl(qtype, x):
        return quantize(x)

    return impl


def simd_rows(qtype, w, xq, xd, xs, bsums, out, r_lo, r_hi):
    """The type's ``_simd_parts`` rows (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("simd_rows is only callable from Numba-compiled code")


@overload(simd_rows)
def _simd_rows_overload(qtype, w, xq, xd, xs, bsums, out, r_lo, r_hi):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    rows = _simd_parts(qtype.literal_value)[1]

    def impl(qtype, w, xq, xd, xs, bsums, out, r_lo, r_hi):
        rows(w, xq, xd, xs, bsums, out, r_lo, r_hi)

    return impl


# The kernels below capture only the type id (an integer), never a function: Numba's disk
# cache keys a closure by its captured values, and two captured functions of different
# types would look alike to it, so one type's cached code could be loaded for another.


@functools.cache
def _simd_kernel(qtype: int):
    """``x @ W.T`` in one call: quantize x, then the weight rows split among tasks."""
    qtype = int(qtype)

    @njit(cache=True, parallel=True)
    def kernel(x, w, out, n_tasks):
        xq, xd, xs, bsums = simd_quantize(qtype, x)
        m = w.shape[0]
        for t in prange(n_tasks):
            simd_rows(qtype, w, xq, xd, xs, bsums, out, t * m // n_tasks, (t + 1) * m // n_tasks)

    return kernel


@functools.cache
def _simd_kernel3(qtype: int):
    """Up to three matmuls of one x (weights of one type) in one call: x is quantized once,
    and each task takes its share of every weight's rows (an absent weight has 0 rows)."""
    qtype = int(qtype)

    @njit(cache=True, parallel=True)
    def kernel(x, w0, w1, w2, o0, o1, o2, n_tasks):
        xq, xd, xs, bsums = simd_quantize(qtype, x)
        m0, m1, m2 = w0.shape[0], w1.shape[0], w2.shape[0]
        for t in prange(n_tasks):
            lo, hi = t * m0 // n_tasks, (t + 1) * m0 // n_tasks
            simd_rows(qtype, w0, xq, xd, xs, bsums, o0, lo, hi)
            lo, hi = t * m1 // n_tasks, (t + 1) * m1 // n_tasks
            simd_rows(qtype, w1, xq, xd, xs, bsums, o1, lo, hi)
            lo, hi = t * m2 // n_tasks, (t + 1) * m2 // n_tasks
            simd_rows(qtype, w2, xq, xd, xs, bsums, o2, lo, hi)

    return kernel


def matmul_many_q8(x: np.ndarray, ws: list[np.ndarray], qtype, k: int) -> list[np.ndarray]:
    """``[matmul_q8(x, w, qtype, k) for w in ws]`` for two or three weights of one SIMD type,
    in one parallel pass that converts x once (the weights are trusted: ``CPUBackend``
    checked their shapes at load)."""
    n = x.shape[0]
    outs = [np.empty((n, w.shape[0]), np.float32) for w in ws]
    empty_w = ws[0][:0]
    w3 = list(ws) + [empty_w] * (3 - len(ws))
    o3 = outs + [np.empty((n, 0), np.float32)] * (3 - len(ws))
    m = sum(w.shape[0] for w in ws)
    _simd_kernel3(int(qtype))(np.ascontiguousarray(x, np.float32), *w3, *o3, _n_tasks(m))
    return outs


def _c_contiguous(a):
    """``a`` itself if Numba knows it C-contiguous, else a C-contiguous copy (compiled code)."""
    raise NotImplementedError("_c_contiguous is only callable from Numba-compiled code")


@overload(_c_contiguous, inline="always")
def _c_contiguous_overload(a):
    if isinstance(a, types.Array) and a.layout == "C":
        return lambda a: a
    return lambda a: np.ascontiguousarray(a)


def _float_dot_few(qtype, count, n_wrows, w, r, xc, i, out, k, pf_off, pf_step):
    """``float_dot_rows`` of ``count`` rows of x, 1..FLOAT_GROUP known at run time
    only, by ``n_wrows`` weight rows, FLOAT_WROWS or 1 (compiled code only, ``qtype`` and
    ``n_wrows`` literals)."""
    raise NotImplementedError("_float_dot_few is only callable from Numba-compiled code")


@overload(_float_dot_few, inline="always")
def _float_dot_few_overload(qtype, count, n_wrows, w, r, xc, i, out, k, pf_off, pf_step):
    if not all(isinstance(v, types.IntegerLiteral) for v in (qtype, n_wrows)):
        return None
    q, nw = qtype.literal_value, n_wrows.literal_value
    assert 4 <= FLOAT_GROUP <= 6
    # only the counts a pass can have (1..FLOAT_GROUP): each call inlines a whole tile,
    # and every branch is compiled into the step program, reached or not

    if FLOAT_GROUP == 4:

        def impl(qtype, count, n_wrows, w, r, xc, i, out, k, pf_off, pf_step):
            if count == 1:
                float_dot_rows(q, 1, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 2:
                float_dot_rows(q, 2, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 3:
                float_dot_rows(q, 3, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 4:
                float_dot_rows(q, 4, nw, w, r, xc, i, out, k, pf_off, pf_step)

    else:

        def impl(qtype, count, n_wrows, w, r, xc, i, out, k, pf_off, pf_step):
            if count == 1:
                float_dot_rows(q, 1, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 2:
                float_dot_rows(q, 2, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 3:
                float_dot_rows(q, 3, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 4:
                float_dot_rows(q, 4, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 5:
                float_dot_rows(q, 5, nw, w, r, xc, i, out, k, pf_off, pf_step)
            elif count == 6:
                float_dot_rows(q, 6, nw, w, r, xc, i, out, k, pf_off, pf_step)

    return impl


@functools.cache
def _float_parts(qtype: int):
    """(convert, rows) for float weights (F32, F16, BF16).

    ``convert(x)`` rounds the activation rows to the weight's dot type (F16, BF16; F32 as
    is) and returns them as float32; ``rows(xf, w, w32, out, k, r_lo, r_hi)`` fills
    ``out[:, r_lo:r_hi]``. Each output is the same dot whatever the number of rows of x
    and however they are grouped, so a batch's rows are each row's alone, bit for bit."""
    qtype = int(qtype)
    is_f32 = qtype == GGMLType.F32
    is_f16 = qtype == GGMLType.F16

    @njit(cache=True)
    def convert(x):
        if is_f32:
            return x
        out = np.empty(x.shape, np.float32)
        if is_f16:
            _round_f16(x, out, np.empty(x.shape, np.uint16))
        else:
            _round_bf16(x, out)
        return out

    @njit(cache=True)
    def rows(xf, w, w32, out, k, r_lo, r_hi):
        """Each weight row is read from memory once per tile of x rows, in tiles of
        ``FLOAT_WROWS`` weight rows by up to ``FLOAT_GROUP`` rows of x (``simd_float``:
        every product the same bits in any tile). ``w32`` (F32's float32 view) goes
        unused: the kernel reads the bytes of ``w``."""
        xc = _c_contiguous(xf)
        n = xc.shape[0]
        if n == 1:
            # decode: one weight row at a time, the task's rows one sequential stream
            # (three rows at a time, 8-lane chains side by side, measured slower: 34.8
            # against 28.0 ms a SmolLM2 F32 step's matrices, the hardware prefetcher
            # following one stream better than three)
            for r in range(r_lo, r_hi):
                float_dot_rows(qtype, 1, 1, w, r, xc, 0, out, k, 0, 0)
            return
        row_bytes = w.shape[1]
        n_chunks = max(k // 8, 1)
        ahead = PREFETCH_TILES * FLOAT_WROWS * row_bytes
        for i0 in range(0, n, TILE_ROWS):
            i1 = min(n, i0 + TILE_ROWS)
            # the tile's rows of x in passes of near-equal size (9: 5 + 4 where 4 + 4 + 1
            # would make three), each prefetching its share of the weights that come next
            passes = -(-(i1 - i0) // FLOAT_GROUP)
            r = r_lo
            while r < r_hi:
                nw = FLOAT_WROWS if r + FLOAT_WROWS <= r_hi else 1
                share = -(-nw * row_bytes // passes)
                step = -(-share // n_chunks)
                i = i0
                for p in range(passes):
                    count = (i1 - i0) // passes + (1 if p < (i1 - i0) % passes else 0)
                    at = ahead + p * share
                    if nw == FLOAT_WROWS:
                        _float_dot_few(qtype, count, FLOAT_WROWS, w, r, xc, i, out, k, at, step)
                    else:
                        _float_dot_few(qtype, count, 1, w, r, xc, i, out, k, at, step)
                    i += count
                r += nw

    return convert, rows


def float_convert(qtype, x):
    """The type's ``_float_parts`` convert (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("float_convert is only callable from Numba-compiled code")


@overload(float_convert)
def _float_convert_overload(qtype, x):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    convert = _float_parts(qtype.literal_value)[0]

    def impl(qtype, x):
        return convert(x)

    return impl


def float_rows(qtype, xf, w, w32, out, k, r_lo, r_hi):
    """The type's ``_float_parts`` rows (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("float_rows is only callable from Numba-compiled code")


@overload(float_rows)
def _float_rows_overload(qtype, xf, w, w32, out, k, r_lo, r_hi):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    rows = _float_parts(qtype.literal_value)[1]

    def impl(qtype, xf, w, w32, out, k, r_lo, r_hi):
        rows(xf, w, w32, out, k, r_lo, r_hi)

    return impl


@functools.cache
def _float_kernel(qtype: int):
    """The parallel kernel of one float type (captures only the type id)."""
    qtype = int(qtype)

    @njit(cache=True, parallel=True)
    def kernel(x, w, w32, out, k, n_tasks):
        xf = float_convert(qtype, x)
        m = w.shape[0]
        for t in prange(n_tasks):
            float_rows(qtype, xf, w, w32, out, k, t * m // n_tasks, (t + 1) * m // n_tasks)

    return kernel


# the unused float32 view passed for F16 and BF16 weights (read-only, as F32 views are)
_NO_F32_ROWS = np.zeros((0, 0), np.float32)
_NO_F32_ROWS.flags.writeable = False


# ---- public API ----


def _n_tasks(m: int) -> int:
    threads = numba.get_num_threads()
    return max(1, min(m, 4 * threads))


def matmul_q8(x: np.ndarray, w: np.ndarray, qtype, k: int) -> np.ndarray:
    """``x @ W.T`` as llama.cpp's CPU backend computes it; float32 (n, m).

    ``x``: float32 (n, k); ``w``: raw weight bytes uint8 (m, row_bytes) of ggml type
    ``qtype`` (read, never written or copied).
    """
    if not supports(qtype):
        raise ValueError(f"matmul_q8 does not support ggml type {qtype!r}")
    qtype = GGMLType(qtype)
    info = GGML_TYPES[qtype]
    if k <= 0 or k % info.block_size:
        raise ValueError(f"k={k} is not a positive multiple of the {info.name} block")
    row_bytes = k // info.block_size * info.type_size
    if w.dtype != np.uint8 or w.ndim != 2 or w.shape[1] != row_bytes:
        raise ValueError(
            f"{info.name} weights with k={k} must be uint8 (m, {row_bytes}); "
            f"got {w.dtype} {w.shape}"
        )
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (n, {k}); got {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    wv = w.view()
    wv.flags.writeable = False  # one compiled kernel for every caller; nothing writes the map
    n, m = x.shape[0], w.shape[0]
    out = np.empty((n, m), np.float32)
    if n == 0 or m == 0:
        return out
    if qtype in SIMD_TYPES:
        _simd_kernel(int(qtype))(x, wv, out, _n_tasks(m))
        return out
    if qtype in _FLOAT:
        w32 = wv.view(np.float32) if qtype == GGMLType.F32 else _NO_F32_ROWS
        _float_kernel(int(qtype))(x, wv, w32, out, k, _n_tasks(m))
        return out
    q = quantize_rows(x, VEC_DOT_TYPE[qtype])
    _quant_kernel(int(qtype))(q.qs, q.d, q.s, q.bsums, wv, out, k, _n_tasks(m))
    return out
