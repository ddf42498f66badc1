"""Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K weights eight rows at a time: llama.cpp's CPU "repack".

A quantized weight row dotted with an activation row costs, per block of 32 and on AVX2,
an unpack, a ``pmaddubsw``, a ``pmaddwd``, an int-to-float conversion and an FMA (the
``simd`` kernels, ggml's ``vec_dot``): four vector operations for 32 products, and the
products of one block end in 8 float lanes that are summed only at the end of the row.
With the quants of 8 rows interleaved four bytes at a time, one 32-byte register holds four
consecutive quants of each of 8 rows, and an activation's four matching bytes broadcast to
all lanes multiply them all at once. The block's 8 ``pmaddubsw`` of 8 rows by one
activation row are summed in 16 bits (no overflow: each of their lanes is at most
2 * 15 * 128 = 3840 in magnitude, 8 of them 30720 < 32767), then one ``pmaddwd`` by ones
gives each row's exact block sum in its own 32-bit lane: one conversion and one FMA now
serve 8 rows, and the weights' unpacking serves every activation row of a batch. This is
the layout llama.cpp's CPU backend repacks Q4_0 into at load (``block_q4_0x8``), here with
4-byte chunks so that lane r of every result is row r. Q8_0's signed bytes go through
ggml's sign trick (``|w|`` by ``y`` with ``w``'s sign), and as a pair of its products
reaches 2 * 128 * 127 each ``pmaddubsw`` is widened alone: the gain is the conversion and
FMA shared by 8 rows (SmolLM2's 49152 x 576 output matrix, 2 threads: 1 row 678 -> 392
us, 8 rows 3376 -> 2696 us, ~2100 us since its block is a loop over pairs of chunks that
keeps LLVM from spilling them; from DRAM one row is bound by memory either way).

Layout (``repack``: the file's bytes, rows permuted in groups of 8, Q5_0's high bits and
Q4_K's scales rearranged as below): group g
holds rows 8g..8g+7, its block b at byte ``b * 8 * size`` of the group (``size`` the
type's block bytes): the 8 rows' scales ``d`` (f16), for Q4_1 their mins ``m`` (f16), then
chunks of 32 bytes, chunk c holding bytes 4c..4c+3 of each row's quant bytes, row by row
(Q4: four chunks of the 16 bytes, low nibbles weights 4c..4c+3, high nibbles weights
16 + 4c..16 + 4c + 3; Q8_0: eight chunks of the 32, weights 4c..4c+3). Q5_0 is Q4_0's
layout with the 8 rows' 32 bytes of high bits between scales and chunks, transposed so
that one register serves all 8 unpacked chunks: bit c of byte 4r + j is the high bit of
weight 4c + j of row r (the weight in byte j of row r's lane of unpacked chunk c: low
nibbles for c < 4, high for c >= 4), which a 16-bit shift by 4 - c and a mask put at bit 4
(``x8_quantize`` a Q5_0 quant + 16, 0..31). Q4_K (super-blocks of 256, 148 bytes a row
instead of 144): the 8 rows' d, their dmin, their 6-bit scales unpacked to bytes
(``[j][r]`` for sub-block j), their mins likewise as ``[k][r][2]`` (sub-blocks 2k and
2k + 1 side by side, one 32-bit lane a row), then 32 chunks of 32 bytes, chunk 8p + c
holding bytes 4c..4c+3 of each row's 32-byte run p (low nibbles: sub-block 2p, high:
2p + 1).

Arithmetic, for output (row j, activation row i), block by block in one float32 lane:
``acc = fma(dw_j * dy_i, float(isum), acc)`` then, for Q4_1, ``acc = fma(mw_j, sy_i, acc)``
(``sy`` the Q8_1 block sum as ggml rounds it), or for Q4_0, whose quants are taken unsigned
(0..15), ``isum`` is the exact ``sum(u * y) - 8 * sum(y)`` (the offset comes with the
activations; Q5_0: 0..31 and ``- 16 * sum(y)``, its 16-bit sums over 4 products of a lane
instead of 8: 4 * 2 * 31 * 127 = 31496); Q8_0 has the FMA alone. Q4_K against Q8_K
activations: ``acc = fma(d_j * dy_i, float(sum_s sc_s * isum_s), acc)`` then ``acc =
fma(-dmin_j * dy_i, float(sum_s m_s * ysum_s), acc)``, both integer sums exact (each
``sc_s * isum_s`` two pmaddwd, of a sub-block's halves' 16-bit sums, by the scales). Integer parts
are exact as in ggml; the float order differs from ggml's ``vec_dot`` (one FMA per block
instead of eight lanes summed at the end), so a result differs from llama.cpp's plain path
by float32 rounding only, as llama.cpp's own repacked Q4_0 differs from its plain one.
Each output's operations are the same whatever the number of activation rows and however a
batch is split, so a row's result is the same bits alone or in any batch (what the
server's slots rely on).

With AVX512-VNNI (and VL), ``vpdpbusd`` adds each lane's four u8 * s8 products straight
into 32 bits: one instruction a chunk and activation row where the 4- and 5-bit blocks
took a ``pmaddubsw``, a 16-bit add and their share of a ``pmaddwd``, and Q8_0 a sign, both
of those and an add (its weights go in as the unsigned bytes w + 128, and -128 times the
activation block's sum of quants, exact in float32, is added to the block's sum). The
integer sums are the same (no pair of products here reaches 16-bit saturation), so are
the bits (the ISA tests compare them with the AVX2 build's): 8 activation rows by
SmolLM2's 1536 x 576 Q4_1 on one thread 77-86 -> 98-107 GMAC/s, its 49152 x 576 Q8_0
output matrix 46-57 -> 78-108. (With one or two activation rows, Q8_0's products of a
block start from zero and are added, rather than chained through eight dependent
``vpdpbusd``.)
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from picollama.backends.cpu.qdot import _n_tasks
from picollama.backends.cpu.qdot_act import q8_block, q8k_block, round_f16
from picollama.backends.cpu.simd import (
    F16,
    F32,
    HAS_VNNI,
    I8,
    I16,
    I32,
    I64,
    PREFETCH_AHEAD,
    _array_parts,
    _mask,
    _Ops,
    _splat,
    _vec,
    inline_function,
    prefetch,
)
from picollama.gguf.constants import GGMLType

__all__ = [
    "X8_TYPES",
    "X8_ROWS",
    "repack",
    "x8_quantize",
    "x8_rows",
    "x8_span",
    "vec_dot_x8",
    "matmul_x8",
]

X8_TYPES: frozenset[GGMLType] = frozenset(
    (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K)
)
X8_ROWS = 8  # weight rows of a group

# bytes of one block of one row, and where the quants start in it (Q5_0: its 4 bytes of
# high bits before the 16 of nibbles)
_SIZE = {
    GGMLType.Q4_0: 18,
    GGMLType.Q4_1: 20,
    GGMLType.Q5_0: 22,
    GGMLType.Q8_0: 34,
    GGMLType.Q4_K: 144,
}
_QS = {GGMLType.Q4_0: 2, GGMLType.Q4_1: 4, GGMLType.Q5_0: 6, GGMLType.Q8_0: 2}
# a row's bytes per block in the x8 layout: the file's, but for Q4_K, whose 6-bit scales
# and mins are unpacked to bytes (d, dmin 4 + scales 8 + mins 8 + quants 128)
_X8_SIZE = {**_SIZE, GGMLType.Q4_K: 148}
# activation quants of a block
_QBLOCK = {t: 256 if t == GGMLType.Q4_K else 32 for t in _SIZE}
# what ``x8_quantize`` writes beside a block's quants and scale, per weight type (Q8_0
# with VNNI: -128 times the sum of the block's quants, the offset of its weights taken as
# unsigned bytes w + 128)
SUMS, OFFSETS, NOTHING, OFFSETS16, KSUMS, OFFSETS128 = 0, 1, 2, 3, 4, 5
ACTIVATION = {
    GGMLType.Q4_1: SUMS,
    GGMLType.Q4_0: OFFSETS,
    GGMLType.Q5_0: OFFSETS16,
    GGMLType.Q8_0: OFFSETS128 if HAS_VNNI else NOTHING,
    GGMLType.Q4_K: KSUMS,
}

# activation rows one pass over a group's blocks takes at most: 8 (their accumulators and the
# group's 8 unpacked quant registers do not all fit in AVX2's 16, yet) measured 152 / 145
# GMAC/s against 4's 126 / 139 and 2's 133 / 124 (8 rows by 1536 x 576 / 576 x 1536, 2 threads)
GROUP_ROWS = 8


# ---- the layout ----


@njit(cache=True, parallel=True)
def _repack(rows, out, size, qs_at):
    """The copy, in 16-bit units: block sizes, quant offsets and 4-byte chunks are all even
    (SmolLM2's matrices, 2 threads: 1.6 GB/s byte by byte, 3.7-4.3 GB/s so)."""
    m, row_bytes = rows.shape
    src = rows.reshape(-1).view(np.uint16)
    dst = out.reshape(-1).view(np.uint16)
    h, hq, hrow = size // 2, qs_at // 2, row_bytes // 2
    nb = row_bytes // size
    chunks = (size - qs_at) // 4
    for g in prange(m // 8):
        base = g * 8 * hrow
        for b in range(nb):
            at = base + b * 8 * h
            for r in range(8):
                s0 = (8 * g + r) * hrow + b * h
                dst[at + r] = src[s0]  # d, row by row
                if hq == 2:
                    dst[at + 8 + r] = src[s0 + 1]  # Q4_1's m
                q0 = at + 8 * hq + 2 * r
                for c in range(chunks):
                    dst[q0 + 16 * c] = src[s0 + hq + 2 * c]
                    dst[q0 + 16 * c + 1] = src[s0 + hq + 2 * c + 1]


@njit(cache=True, parallel=True)
def _repack_q5_0(rows, out):
    """Q5_0's copy: scales and nibble chunks as Q4_0's, and between them the 8 rows' high
    bits transposed (module docstring: byte 4r + j of the 32, bit c, is the high bit of
    quant 4c + j of row r)."""
    m, row_bytes = rows.shape
    nb = row_bytes // 22
    dst = out.reshape(-1)
    for g in prange(m // 8):
        for b in range(nb):
            at = g * 8 * row_bytes + b * 176
            for r in range(8):
                src = rows[8 * g + r, b * 22 : b * 22 + 22]
                dst[at + 2 * r] = src[0]
                dst[at + 2 * r + 1] = src[1]
                qh = np.uint32(src[2]) | (np.uint32(src[3]) << 8)
                qh |= (np.uint32(src[4]) << 16) | (np.uint32(src[5]) << 24)
                for j in range(4):
                    # bits j, j + 4, .., j + 28 of qh to bits 0..7, three folds
                    t = (qh >> j) & 0x11111111
                    t = (t | (t >> 3)) & 0x03030303
                    t = (t | (t >> 6)) & 0x000F000F
                    dst[at + 16 + 4 * r + j] = (t | (t >> 12)) & 0xFF
                for c in range(4):
                    for j in range(4):
                        dst[at + 48 + 32 * c + 4 * r + j] = src[6 + 4 * c + j]


@njit(cache=True, parallel=True)
def _repack_q4_k(rows, out):
    """Q4_K's copy (module docstring): per group and super-block, the 8 rows' d and dmin,
    their 8 scales and 8 mins unpacked from 6 bits (get_scale_min_k4), then the quants in
    chunks of 4 bytes of each row's 32-byte runs."""
    m, row_bytes = rows.shape
    nb = row_bytes // 144
    xrow = out.shape[1]
    dst = out.reshape(-1)
    for g in prange(m // 8):
        for b in range(nb):
            at = g * 8 * xrow + b * 8 * 148
            for r in range(8):
                src = rows[8 * g + r, b * 144 : b * 144 + 144]
                for e in range(2):
                    dst[at + 2 * r + e] = src[e]
                    dst[at + 16 + 2 * r + e] = src[2 + e]
                q = src[4:16]
                for j in range(8):
                    if j < 4:
                        sc = q[j] & 63
                        mn = q[j + 4] & 63
                    else:
                        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)
                        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
                    dst[at + 32 + 8 * j + r] = sc
                    dst[at + 96 + 16 * (j // 2) + 2 * r + j % 2] = mn
                for p in range(4):
                    for c in range(8):
                        for e in range(4):
                            dst[at + 160 + 32 * (8 * p + c) + 4 * r + e] = src[
                                16 + 32 * p + 4 * c + e
                            ]


def repack(rows: np.ndarray, qtype) -> np.ndarray:
    """The x8 layout (module docstring) of Q4_0, Q4_1, Q5_0, Q8_0 or Q4_K rows uint8 (m,
    row_bytes), m a multiple of 8: a new array, of the same shape but for Q4_K (148 bytes
    a row and super-block instead of 144)."""
    qtype = GGMLType(qtype)
    if qtype not in X8_TYPES:
        raise ValueError(f"no x8 layout for {qtype.name}")
    m, row_bytes = rows.shape
    if m % X8_ROWS or row_bytes % _SIZE[qtype]:
        raise ValueError(f"x8 needs rows in groups of 8 and whole blocks; got {rows.shape}")
    out = np.empty((m, row_bytes // _SIZE[qtype] * _X8_SIZE[qtype]), np.uint8)
    if qtype == GGMLType.Q4_K:
        _repack_q4_k(np.ascontiguousarray(rows), out)
    elif qtype == GGMLType.Q5_0:
        _repack_q5_0(np.ascontiguousarray(rows), out)
    else:
        _repack(np.ascontiguousarray(rows), out, _SIZE[qtype], _QS[qtype])
    return out


# ---- activations ----


@njit(cache=True, nogil=True)
def _quantize_blocks(x, xqp, xdp, xsp, kind, lo, hi):
    """Blocks lo..hi of every row of x as ggml's Q8_0 / Q8_1, block-major as
    ``qdot_act.quantize_packed`` writes them; ``xsp[b, u]`` is, by ``kind``, the Q8_1 sum
    (SUMS, for Q4_1), -8, -16 or -128 times the sum of the block's quants (OFFSETS for
    Q4_0, OFFSETS16 for Q5_0, OFFSETS128 for Q8_0 with VNNI: exact), or not there
    (NOTHING, for Q8_0 without)."""
    n = x.shape[0]
    for b in range(lo, hi):
        qrow = xqp[b]
        for u in range(n):
            db, sd = q8_block(x, u, b * 32, qrow, 32 * u)
            xdp[b, u] = round_f16(db)
            if kind == OFFSETS or kind == OFFSETS16 or kind == OFFSETS128:
                s = 0
                for e in range(32 * u, 32 * u + 32):
                    s += np.int32(qrow[e])
                f = -8 if kind == OFFSETS else (-16 if kind == OFFSETS16 else -128)
                xsp[b, u] = np.float32(f * s)
            elif kind == SUMS:
                xsp[b, u] = round_f16(sd)


# a batch's blocks are quantized by all threads from this many on (as ``qdot``)
_PARALLEL_BLOCKS = 256


@njit(cache=True, nogil=True)
def _quantize_k_blocks(x, xqp, xdp, xsp, lo, hi):
    """Q8_K blocks lo..hi of every row of x, block-major: quants ``xqp[b, 256 u ..]``, d
    ``xdp[b, u]`` (float32, as Q8_K keeps it), and the 8 sums of 32 quants as 4 words of
    two int16 each (sums 2k and 2k + 1) at ``xsp[b, 4 u + k]`` (int32 bits in float32)."""
    n = x.shape[0]
    xsi = xsp.view(np.int32)
    for b in range(lo, hi):
        qrow = xqp[b]
        for u in range(n):
            xdp[b, u] = q8k_block(x, u, b * 256, qrow, 256 * u)
            for kk in range(4):
                s0 = 0
                s1 = 0
                for e in range(256 * u + 64 * kk, 256 * u + 64 * kk + 32):
                    s0 += np.int32(qrow[e])
                    s1 += np.int32(qrow[e + 32])
                xsi[b, 4 * u + kk] = (s0 & 0xFFFF) | (s1 << 16)


@njit(cache=True, parallel=True, nogil=True)
def x8_quantize(x, kind):
    """x (n, k) float32, C-contiguous, as the x8 dots read it: ``(xq, xd, xs)`` int8
    (nb, 32 n), float32 (nb, n), float32 (nb, n) (``_quantize_blocks``); for KSUMS (Q4_K)
    Q8_K blocks: int8 (nb, 256 n), float32 (nb, n), float32 (nb, 4 n)
    (``_quantize_k_blocks``)."""
    n, k = x.shape
    if kind == KSUMS:
        nb = k // 256
        xq = np.empty((nb, n * 256), np.int8)
        xd = np.empty((nb, n), np.float32)
        xs = np.empty((nb, 4 * n), np.float32)
        if n * nb * 8 >= _PARALLEL_BLOCKS:
            for b in prange(nb):
                _quantize_k_blocks(x, xq, xd, xs, b, b + 1)
        else:
            _quantize_k_blocks(x, xq, xd, xs, 0, nb)
        return xq, xd, xs
    nb = k // 32
    xq = np.empty((nb, n * 32), np.int8)
    xd = np.empty((nb, n), np.float32)
    xs = np.empty((nb, n if kind != NOTHING else 0), np.float32)
    if n * nb >= _PARALLEL_BLOCKS:
        for b in prange(nb):
            _quantize_blocks(x, xq, xd, xs, kind, b, b + 1)
    else:
        _quantize_blocks(x, xq, xd, xs, kind, 0, nb)
    return xq, xd, xs


# ---- the dot ----


def _define_x8(module: ir.Module, qtype: GGMLType, n_rows: int) -> ir.Function:
    """``f(w, nb, xq, sq, xd, sd, xs, out, so)``: the 8 rows of the group at ``w`` dotted
    with ``n_rows`` activation rows; activation row r's block b at ``xq + b * sq + 32 r``,
    its scale and sum (or offset) at ``xd + b * sd + 4 r`` and ``xs + b * sd + 4 r``; the
    8 results of row r stored at ``out + r * so``."""
    name = f"picollama_vec_dot_x8_{qtype.name.lower()}_{n_rows}"
    p8 = I8.as_pointer()
    fn, new = inline_function(module, name, [p8, I64, p8, I64, p8, I64, p8, p8, I64])
    if not new:
        return fn
    w, nb, xq, sq, xd, sd, xs, out, so = fn.args
    entry = fn.append_basic_block("entry")
    loop = fn.append_basic_block("loop")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    o = _Ops(b)
    size = 8 * _X8_SIZE[qtype]
    qs = 8 * _QS.get(qtype, 0)  # (Q4_K lays out its own super-blocks)
    v8f = _vec(F32, 8)
    zeros = ir.Constant(v8f, [ir.Constant(F32, 0.0)] * 8)
    ones16 = _splat(I16, 16, 1)
    low = _splat(I8, 32, 0x0F)

    def c64(v):
        return ir.Constant(I64, v)

    def splat_f32(ptr, offset):
        v = b.load(b.bitcast(b.gep(ptr, [offset]), F32.as_pointer()), align=4)
        return o.splat8(v)

    def splat_i32(ptr, offset):
        v = o.load(ptr, offset, I32)
        v8 = b.insert_element(ir.Constant(_vec(I32, 8), None), v, ir.Constant(I32, 0))
        return b.bitcast(b.shuffle_vector(v8, v8, _mask([0] * 8)), _vec(I8, 32))

    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(I64)
    accs = [b.phi(v8f) for _ in range(n_rows)]
    base = b.mul(i, c64(size))
    prefetch(b, w, b.add(base, c64(PREFETCH_AHEAD)), size)
    dw = b.fpext(o.load(w, base, _vec(F16, 8)), v8f)
    if qtype == GGMLType.Q4_K:
        new = _q4_k_block(b, o, w, base, dw, xq, sq, xd, sd, xs, i, accs, splat_i32, splat_f32)
    elif qtype == GGMLType.Q8_0:
        new = _q8_0_block(b, o, w, base, dw, xq, sq, xd, sd, xs, i, accs, splat_i32, splat_f32)
    else:  # blocks of 32 of 4 or 5 bits
        mw = b.fpext(o.load(w, b.add(base, c64(16)), _vec(F16, 8)), v8f) if qs == 32 else None
        q5 = qtype == GGMLType.Q5_0
        if q5:  # the 8 rows' high bits: bit c of a byte belongs to the quant in chunk c
            high = b.bitcast(o.load(w, b.add(base, c64(16)), _vec(I8, 32)), _vec(I16, 16))
            bit4 = _splat(I8, 32, 0x10)

        def high_bits(c):
            """Chunk c's high bits as 0x10 or 0 per byte: bit c moved to bit 4 by a 16-bit
            shift (bit 4 of each byte comes from the same byte for shifts up to 4 left or 3
            right), then masked."""
            if c < 4:
                h = b.shl(high, _splat(I16, 16, 4 - c))
            elif c > 4:
                h = b.lshr(high, _splat(I16, 16, c - 4))
            else:
                h = high
            return b.and_(b.bitcast(h, _vec(I8, 32)), bit4)

        nib = []  # (unsigned quants, the activation bytes' offset in the block) pairs
        for c in range(4):
            v = o.load(w, b.add(base, c64(qs + 32 * c)), _vec(I8, 32))
            shifted = b.lshr(b.bitcast(v, _vec(I16, 16)), _splat(I16, 16, 4))
            lo = b.and_(v, low)
            hi = b.and_(b.bitcast(shifted, _vec(I8, 32)), low)
            if q5:  # 0..31: the quant + 16
                lo = b.or_(lo, high_bits(c))
                hi = b.or_(hi, high_bits(c + 4))
            nib.append((lo, 4 * c))
            nib.append((hi, 16 + 4 * c))
        if q5:  # sums of 4 products of 5-bit quants fit in 16 bits, of 8 not: lows, then highs
            nib = nib[0::2] + nib[1::2]
        q0 = b.mul(i, sq)
        d0 = b.mul(i, sd)
        new = []
        for r in range(n_rows):
            at = b.add(q0, c64(32 * r))
            if HAS_VNNI:  # vpdpbusd: 4 products a lane summed into 32 bits, exactly
                pairs = [(u, splat_i32(xq, b.add(at, c64(off)))) for u, off in nib]
                isum = b.sitofp(_dot_chains(b, o, pairs), v8f)
                new.append(_finish_row(b, o, qtype, isum, dw, mw, xd, xs, d0, r, accs, splat_f32))
                continue
            parts = [o.maddubs(u, splat_i32(xq, b.add(at, c64(off)))) for u, off in nib]
            if q5:
                # a pair of products is at most 2 * 31 * 127 = 7874: four pmaddubsw sum to
                # 31496 in 16 bits; each half of the block then goes to 32 bits
                halves = []
                for part in (parts[:4], parts[4:]):
                    while len(part) > 1:
                        part = [b.add(part[j], part[j + 1]) for j in range(0, len(part), 2)]
                    halves.append(o.maddwd(part[0], ones16))
                parts = [b.add(halves[0], halves[1])]
            while len(parts) > 1:
                parts = [b.add(parts[j], parts[j + 1]) for j in range(0, len(parts), 2)]
            isum = b.sitofp(parts[0] if q5 else o.maddwd(parts[0], ones16), v8f)
            new.append(_finish_row(b, o, qtype, isum, dw, mw, xd, xs, d0, r, accs, splat_f32))
    i1 = b.add(i, c64(1))
    latch = b.block  # (Q4_K's body is a loop of its own)
    i.add_incoming(c64(0), entry)
    i.add_incoming(i1, latch)
    for phi, acc in zip(accs, new, strict=True):
        phi.add_incoming(zeros, entry)
        phi.add_incoming(acc, latch)
    b.cbranch(b.icmp_unsigned("<", i1, nb), loop, done)
    b.position_at_end(done)
    for r, acc in enumerate(new):
        dst = b.gep(out, [b.mul(c64(r), so)])
        b.store(acc, b.bitcast(dst, v8f.as_pointer()), align=4)
    b.ret_void()
    return fn


def _dot_chains(b, o, pairs):
    """The sum of vpdpbusd over ``pairs`` of (unsigned quants, signed activation bytes):
    <8 x i32>, exact; two chains, so that a lone activation row waits on half as many
    dependent instructions (VNNI only)."""
    chains = [_splat(I32, 8, 0), _splat(I32, 8, 0)]
    for e, (u, y) in enumerate(pairs):
        chains[e % 2] = o.dpbusd8(chains[e % 2], u, y)
    return b.add(chains[0], chains[1])


def _finish_row(b, o, qtype, isum, dw, mw, xd, xs, d0, r, accs, splat_f32):
    """Activation row r's accumulator after a 4- or 5-bit block whose integer sum is
    ``isum`` (float32 lanes): the offset (Q4_0, Q5_0) or the min's product (Q4_1), and the
    scales' FMA."""
    dat = b.add(d0, ir.Constant(I64, 4 * r))
    if qtype in (GGMLType.Q4_0, GGMLType.Q5_0):
        isum = b.fadd(isum, splat_f32(xs, dat))
    acc = o.fma8(b.fmul(dw, splat_f32(xd, dat)), isum, accs[r])
    if mw is not None:
        acc = o.fma8(mw, splat_f32(xs, dat), acc)
    return acc


def _pair_loop(b, n_rows, body):
    """A loop of 4 trips (a block's or super-block's pairs of chunks or sub-blocks) that
    carries one 32-bit sum vector per activation row: ``body(p, sums)`` emits trip ``p``'s
    code and returns the sums after it; the sums after the last trip come back, the
    builder placed after the loop. A loop, not straight code: LLVM would hoist every
    trip's loads and unpacking to the top and spill them."""
    v8i = _vec(I32, 8)
    c64 = functools.partial(ir.Constant, I64)
    head = b.block
    loop = b.function.append_basic_block("pairs")
    after = b.function.append_basic_block("pairs.done")
    b.branch(loop)
    b.position_at_end(loop)
    p = b.phi(I64)
    phis = [b.phi(v8i) for _ in range(n_rows)]
    sums = body(p, list(phis))
    p1 = b.add(p, c64(1))
    latch = b.block
    p.add_incoming(c64(0), head)
    p.add_incoming(p1, latch)
    zero = ir.Constant(v8i, [ir.Constant(I32, 0)] * 8)
    for phi, v in zip(phis, sums, strict=True):
        phi.add_incoming(zero, head)
        phi.add_incoming(v, latch)
    b.cbranch(b.icmp_unsigned("<", p1, c64(4)), loop, after)
    b.position_at_end(after)
    return sums


def _q8_0_block(b, o, w, base, dw, xq, sq, xd, sd, xs, i, accs, splat_i32, splat_f32):
    """One Q8_0 block of the group at ``base`` against each activation row (the
    ``_define_x8`` loop's body): the accumulators after it. Signed bytes go through ggml's
    sign trick (``|w|`` by ``y`` with ``w``'s sign), and as a pair of its products reaches
    2 * 128 * 127 each ``pmaddubsw`` is widened alone; the 32-bit sums add up exactly. A
    loop over the block's 4 pairs of chunks (straight code spilled ~100 stack references a
    block: the 8 chunks and their ``|w|`` loaded first)."""
    c64 = functools.partial(ir.Constant, I64)
    ones16 = _splat(I16, 16, 1)
    q0 = b.mul(i, sq)
    d0 = b.mul(i, sd)

    def pair(p, sums):
        for e in range(2):  # chunk 2p + e: bytes 8p + 4e .. + 3 of each row
            at_w = b.add(base, b.add(c64(16 + 32 * e), b.mul(p, c64(64))))
            v = o.load(w, at_w, _vec(I8, 32))
            if HAS_VNNI:  # w + 128 as unsigned bytes: one vpdpbusd a row
                u = b.xor(v, _splat(I8, 32, -128))
            else:
                ax = o.sign(v, v)
            for r in range(len(accs)):
                at = b.add(q0, b.add(c64(32 * r + 4 * e), b.mul(p, c64(8))))
                if HAS_VNNI:
                    y = splat_i32(xq, at)
                    if len(accs) > 2:
                        sums[r] = o.dpbusd8(sums[r], u, y)
                    else:  # few rows: no chain of dependent vpdpbusd through the block
                        sums[r] = b.add(sums[r], o.dpbusd8(_splat(I32, 8, 0), u, y))
                    continue
                y = o.sign(splat_i32(xq, at), v)
                sums[r] = b.add(sums[r], o.maddwd(o.maddubs(ax, y), ones16))
        return sums

    sums = _pair_loop(b, len(accs), pair)
    out = []
    for r, acc in enumerate(accs):
        dat = b.add(d0, c64(4 * r))
        isum = b.sitofp(sums[r], _vec(F32, 8))
        if HAS_VNNI:  # less 128 times the block's sum of activation quants: exact in float32
            isum = b.fadd(isum, splat_f32(xs, dat))
        out.append(o.fma8(b.fmul(dw, splat_f32(xd, dat)), isum, acc))
    return out


def _q4_k_block(b, o, w, base, dw, xq, sq, xd, sd, xs, i, accs, splat_i32, splat_f32):
    """One Q4_K super-block of the group at ``base`` against each activation row (the
    ``_define_x8`` loop's body): the accumulators after it. A loop over the 4 pairs of
    sub-blocks (2p, 2p + 1: the low and high nibbles of the same 32-byte runs): per half of
    the pair's chunks, each row's 4 products of a sub-block sum in 16 bits (4 * 2 * 15 *
    127) and one pmaddwd by the rows' scales (each in both halves of its row's lane) gives
    ``sc * isum`` per row; all add up exactly in 32 bits, as the mins' products with the
    activation's sums of 32 do. A loop, not straight code: LLVM would hoist the unpacking
    of every sub-block to the top and spill it (~600 stack references a super-block)."""
    v8f = _vec(F32, 8)
    v8i = _vec(I32, 8)
    c64 = functools.partial(ir.Constant, I64)
    low = _splat(I8, 32, 0x0F)
    q0 = b.mul(i, sq)
    d0 = b.mul(i, sd)
    s0 = b.mul(i, b.mul(sd, c64(4)))
    n = len(accs)

    def scales(j):
        """Sub-block j's 8 scales (j may be a value), each in both halves of its row's lane."""
        s8 = o.load(w, b.add(base, b.add(c64(32), b.mul(j, c64(8)))), _vec(I8, 8))
        s32 = b.zext(s8, v8i)
        return b.bitcast(b.or_(s32, b.shl(s32, _splat(I32, 8, 16))), _vec(I16, 16))

    def pair(p, sums):
        j_lo = b.mul(p, c64(2))
        sc = (scales(j_lo), scales(b.add(j_lo, c64(1))))
        run = b.add(base, b.add(c64(160), b.mul(p, c64(256))))  # the pair's 8 chunks
        for half in (range(4), range(4, 8)):
            raw = {c: o.load(w, b.add(run, c64(32 * c)), _vec(I8, 32)) for c in half}
            four = _splat(I16, 16, 4)
            nib = (  # sub-block 2p's quants (low nibbles), 2p + 1's (high)
                {c: b.and_(v, low) for c, v in raw.items()},
                {
                    c: b.and_(b.bitcast(b.lshr(b.bitcast(v, _vec(I16, 16)), four), v.type), low)
                    for c, v in raw.items()
                },
            )
            for r in range(n):
                at = b.add(q0, b.add(c64(256 * r), b.mul(p, c64(64))))
                for e in range(2):  # sub-block 2p + e
                    parts = [
                        o.maddubs(nib[e][c], splat_i32(xq, b.add(at, c64(32 * e + 4 * c))))
                        for c in half
                    ]
                    while len(parts) > 1:
                        parts = [b.add(parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
                    sums[r] = b.add(sums[r], o.maddwd(parts[0], sc[e]))
        return sums

    sums = _pair_loop(b, n, pair)
    dmin = b.fpext(o.load(w, b.add(base, c64(16)), _vec(F16, 8)), v8f)
    neg_dmin = b.fneg(dmin)
    out = []
    for r, acc in enumerate(accs):
        msum = None
        for k in range(4):
            m16 = b.zext(o.load(w, b.add(base, c64(96 + 16 * k)), _vec(I8, 16)), _vec(I16, 16))
            y = splat_i32(xs, b.add(s0, c64(16 * r + 4 * k)))
            t = o.maddwd(m16, b.bitcast(y, _vec(I16, 16)))
            msum = t if msum is None else b.add(msum, t)
        dy = splat_f32(xd, b.add(d0, c64(4 * r)))
        acc = o.fma8(b.fmul(dw, dy), b.sitofp(sums[r], v8f), acc)
        acc = o.fma8(b.fmul(neg_dmin, dy), b.sitofp(msum, v8f), acc)
        out.append(acc)
    return out


@intrinsic
def vec_dot_x8(typingctx, qtype, n_rows, w, g, xq, xd, xs, t, out, i):
    """``vec_dot_x8(qtype, n_rows, w, g, xq, xd, xs, t, out, i)``: for k in 0..n_rows-1
    and j in 0..7, ``out[i + k, 8 g + j]`` = the dot of row 8g + j of the x8 weights ``w``
    (uint8 (m, row_bytes)) with row ``t + k`` of the activations ``x8_quantize`` gave.
    ``qtype`` and ``n_rows`` are literals."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (qtype, n_rows)):
        return None
    qt = GGMLType(qtype.literal_value)
    if qt not in X8_TYPES:
        return None
    count = n_rows.literal_value
    sig = types.void(qtype, n_rows, w, g, xq, xd, xs, t, out, i)

    def codegen(context, builder, signature, args):
        _, _, w_t, g_t, xq_t, xd_t, xs_t, t_t, out_t, i_t = signature.args
        _, _, w_v, g_v, xq_v, xd_v, xs_v, t_v, out_v, i_v = args
        fn = _define_x8(builder.module, qt, count)
        intp = context.get_value_type(types.intp)
        g_ = context.cast(builder, g_v, g_t, types.intp)
        t_ = context.cast(builder, t_v, t_t, types.intp)
        i_ = context.cast(builder, i_v, i_t, types.intp)
        wd, ws, row_bytes = _array_parts(context, builder, w_t, w_v)
        qd, qs, _ = _array_parts(context, builder, xq_t, xq_v)
        dd, ds, _ = _array_parts(context, builder, xd_t, xd_v)
        sd_, _, _ = _array_parts(context, builder, xs_t, xs_v)
        od, os_, _ = _array_parts(context, builder, out_t, out_v)
        c = ir.Constant
        nb = builder.udiv(row_bytes, c(intp, _X8_SIZE[qt]))
        t4 = builder.mul(t_, c(intp, 4))
        ts = builder.mul(t_, c(intp, 16 if qt == GGMLType.Q4_K else 4))
        out_at = builder.add(builder.mul(i_, os_), builder.mul(g_, c(intp, 32)))
        builder.call(
            fn,
            [
                builder.gep(wd, [builder.mul(g_, builder.mul(ws, c(intp, 8)))]),
                nb,
                builder.gep(qd, [builder.mul(t_, c(intp, _QBLOCK[qt]))]),
                qs,
                builder.gep(dd, [t4]),
                ds,
                builder.gep(sd_, [ts]),
                builder.gep(od, [out_at]),
                os_,
            ],
        )
        return context.get_dummy_value()

    return sig, codegen


# ---- rows of a product ----

TILE_ROWS = 64  # activation rows a group is dotted with before the next group


def _dot_few(qtype, count, w, g, xq, xd, xs, t, out):
    """``vec_dot_x8`` of ``count`` rows, 1..GROUP_ROWS - 1 known at run time only
    (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("_dot_few is only callable from Numba-compiled code")


@overload(_dot_few, inline="always")
def _dot_few_overload(qtype, count, w, g, xq, xd, xs, t, out):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    q = qtype.literal_value
    assert GROUP_ROWS == 8

    def impl(qtype, count, w, g, xq, xd, xs, t, out):
        if count == 1:
            vec_dot_x8(q, 1, w, g, xq, xd, xs, t, out, t)
        elif count == 2:
            vec_dot_x8(q, 2, w, g, xq, xd, xs, t, out, t)
        elif count == 3:
            vec_dot_x8(q, 3, w, g, xq, xd, xs, t, out, t)
        elif count == 4:
            vec_dot_x8(q, 4, w, g, xq, xd, xs, t, out, t)
        elif count == 5:
            vec_dot_x8(q, 5, w, g, xq, xd, xs, t, out, t)
        elif count == 6:
            vec_dot_x8(q, 6, w, g, xq, xd, xs, t, out, t)
        elif count == 7:
            vec_dot_x8(q, 7, w, g, xq, xd, xs, t, out, t)

    return impl


def x8_rows(qtype, w, xq, xd, xs, out, g_lo, g_hi):
    """Columns ``8 g_lo .. 8 g_hi`` of ``out`` (n, m): x8 weights ``w`` by the activations
    ``x8_quantize`` gave, each group dotted with a tile of activation rows GROUP_ROWS at a
    time (compiled code only, ``qtype`` a literal)."""
    raise NotImplementedError("x8_rows is only callable from Numba-compiled code")


@overload(x8_rows, inline="always")
def _x8_rows_overload(qtype, w, xq, xd, xs, out, g_lo, g_hi):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    q = qtype.literal_value

    def impl(qtype, w, xq, xd, xs, out, g_lo, g_hi):
        n = out.shape[0]
        for i0 in range(0, n, TILE_ROWS):
            i1 = min(n, i0 + TILE_ROWS)
            full = (i1 - i0) // GROUP_ROWS
            rest = i0 + full * GROUP_ROWS
            for g in range(g_lo, g_hi):
                for j in range(full):
                    t = i0 + j * GROUP_ROWS
                    vec_dot_x8(q, GROUP_ROWS, w, g, xq, xd, xs, t, out, t)
                if rest < i1:
                    _dot_few(q, i1 - rest, w, g, xq, xd, xs, rest, out)

    return impl


@njit(inline="always")
def x8_span(m, t, n_tasks):
    """Task ``t``'s share of the ``m // 8`` groups of a product: ``(g_lo, g_hi)``."""
    g = m // X8_ROWS
    return t * g // n_tasks, (t + 1) * g // n_tasks


# ---- whole products (the op-by-op path; the compiled step calls the parts above) ----


@functools.cache
def _kernel3(qtype: int):
    """Up to three products of one x by x8 weights of one type in one parallel region (an
    absent weight has 0 rows); captures only the type id, so it is disk-cached."""
    qtype = int(qtype)
    kind = ACTIVATION[GGMLType(qtype)]

    @njit(cache=True, parallel=True, nogil=True)
    def kernel(x, w0, w1, w2, o0, o1, o2, n_tasks):
        xq, xd, xs = x8_quantize(x, kind)
        ws, os = (w0, w1, w2), (o0, o1, o2)
        for t in prange(n_tasks):
            # one call site: the dot's code (every row count's variant) is inlined once,
            # not once per weight (a third of the compile, most of all without AVX2)
            for j in range(3):
                lo, hi = x8_span(ws[j].shape[0], t, n_tasks)
                x8_rows(qtype, ws[j], xq, xd, xs, os[j], lo, hi)

    return kernel


def matmul_x8(x: np.ndarray, ws: list[np.ndarray], qtype, k: int) -> list[np.ndarray]:
    """``x @ W.T`` for each of one to three x8 weights ``ws`` (``repack``'s arrays, of one
    type and width ``k``) in one parallel pass that quantizes x once: float32 (n, m) each."""
    qtype = GGMLType(qtype)
    if qtype not in X8_TYPES or not 1 <= len(ws) <= 3:
        raise ValueError(f"matmul_x8 takes 1 to 3 x8 weights of one type: {len(ws)} {qtype.name}")
    row_bytes = k // _QBLOCK[qtype] * _X8_SIZE[qtype]
    for w in ws:
        if w.dtype != np.uint8 or w.ndim != 2 or w.shape[1] != row_bytes or w.shape[0] % 8:
            raise ValueError(f"x8 {qtype.name} weights with k={k}: uint8 (8 g, {row_bytes})")
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (n, {k}); got {x.shape}")
    n = x.shape[0]
    outs = [np.empty((n, w.shape[0]), np.float32) for w in ws]
    if n == 0:
        return outs
    w3 = list(ws) + [ws[0][:0]] * (3 - len(ws))
    o3 = outs + [np.empty((n, 0), np.float32)] * (3 - len(ws))
    groups = sum(w.shape[0] for w in ws) // X8_ROWS
    _kernel3(int(qtype))(x, *w3, *o3, _n_tasks(groups))
    return outs
