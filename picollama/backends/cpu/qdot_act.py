"""Activation quantization as ggml-cpu does it before a quantized matmul (bit for bit).

Before ``ggml_compute_forward_mul_mat`` multiplies a quantized weight, it converts each row
of the activations with ``from_float`` of the weight type's ``vec_dot_type``. The peer build
(llama.cpp 0c1e570, x86 with AVX2) runs:

- ``quantize_row_q8_0`` / ``quantize_row_q8_1`` (ggml-cpu/arch/x86/quants.c, AVX2): per
  block of 32, ``amax = max |x|``, ``d = amax / 127``, ``id = 127 / amax`` (0 when amax is
  0), ``q = round_half_even(x * id)`` (``_mm256_round_ps(_MM_ROUND_NEAREST)``, not the
  reference ``roundf``), ``d`` stored as fp16 (F16C, round-to-nearest-even). Q8_1 also stores
  ``s = fp16(d * sum(q))`` with the float32 ``d`` (not its fp16 rounding).
- ``quantize_row_q8_K`` = ``quantize_row_q8_K_ref`` (ggml-quants.c): per block of 256,
  ``max`` = the first element of largest magnitude (signed), ``iscale = -127 / max``,
  ``q = min(127, nearest_int(iscale * x))`` (round half to even of the float32 product; the
  peer's base library is built without FMA, so the product is rounded first),
  ``d = 1 / iscale`` kept as float32, and ``bsums`` = sums of 16 consecutive quants. An
  all-zero block gets ``d = 0`` and zero quants (ggml leaves its bsums unwritten; we write 0).
- F16: ``ggml_cpu_fp32_to_fp16`` (F16C, round-to-nearest-even); BF16:
  ``ggml_compute_fp32_to_bf16`` (round-to-nearest-even, NaN forced quiet); F32: unchanged.

The kernels take the quantized activations as separate arrays (quants, float32 scales,
sums); ``pack_rows`` lays them out as ggml's blocks, for comparison with ggml's bytes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from picollama.backends.cpu.intrinsics import bits_from_f32, f16_bits, f32_from_bits, round_f16
from picollama.backends.cpu.simd import _mask, _Ops, _splat, _vec
from picollama.gguf.constants import QK_K, GGMLType

__all__ = [
    "VEC_DOT_TYPE",
    "QuantizedRows",
    "quantize_rows",
    "pack_rows",
    "f32_to_f16_bits",
    "f16_bits_to_f32",
    "q8_block",
    "q8k_block",
    "quantize_packed",
]

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)

# ggml-cpu.c type_traits_cpu[...].vec_dot_type of each weight type we multiply.
VEC_DOT_TYPE: dict[GGMLType, GGMLType] = {
    GGMLType.Q4_0: GGMLType.Q8_0,
    GGMLType.Q5_0: GGMLType.Q8_0,
    GGMLType.Q8_0: GGMLType.Q8_0,
    GGMLType.IQ4_NL: GGMLType.Q8_0,
    GGMLType.Q4_1: GGMLType.Q8_1,
    GGMLType.Q5_1: GGMLType.Q8_1,
    GGMLType.Q2_K: GGMLType.Q8_K,
    GGMLType.Q3_K: GGMLType.Q8_K,
    GGMLType.Q4_K: GGMLType.Q8_K,
    GGMLType.Q5_K: GGMLType.Q8_K,
    GGMLType.Q6_K: GGMLType.Q8_K,
    GGMLType.IQ4_XS: GGMLType.Q8_K,
    GGMLType.F16: GGMLType.F16,
    GGMLType.BF16: GGMLType.BF16,
    GGMLType.F32: GGMLType.F32,
}


@njit(cache=True)
def f32_to_f16_bits(f):
    """IEEE half bits of float32 ``f``, rounded to nearest even (as F16C's vcvtps2ph)."""
    # int64 arithmetic throughout: Numba turns mixed unsigned/signed integer ops into floats
    u = np.int64(bits_from_f32(np.float32(f)))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: keep the top payload bits, force quiet
        return np.uint16(sign | 0x7E00 | (a >> 13))
    if a >= 0x477FF000:  # rounds to infinity (>= 65520)
        return np.uint16(sign | 0x7C00)
    if a < 0x38800000:  # half subnormal or zero: units of 2**-24, exact scaling then rint
        h = np.int64(np.rint(f32_from_bits(np.uint32(a)) * np.float32(16777216.0)))
        return np.uint16(sign | h)
    h = (a - 0x38000000) >> 13
    rem = a & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
        h += 1
    return np.uint16(sign | h)


@njit(cache=True)
def f16_bits_to_f32(h):
    """float32 value of IEEE half bits ``h`` (exact)."""
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if e == 0:
        v = np.float32(np.float32(mant) * np.float32(5.960464477539063e-08))  # 2**-24
        return -v if sign else v
    if e == 31:
        return f32_from_bits(np.uint32(sign | 0x7F800000 | (mant << 13)))
    return f32_from_bits(np.uint32(sign | ((e + 112) << 23) | (mant << 13)))


@njit(cache=True)
def _bf16_round(f):
    """float32 value of ggml_compute_fp32_to_bf16(f)."""
    u = np.int64(bits_from_f32(np.float32(f)))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return f32_from_bits(np.uint32((((u >> 16) | 64) << 16) & 0xFFFFFFFF))
    return f32_from_bits(np.uint32((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF))


def _lanes(b, v, idx):
    return b.shuffle_vector(v, v, _mask(list(idx)))


@intrinsic
def q8_block(typingctx, x, i, b0, qs, q0):
    """ggml's AVX2 quantize_row_q8_0/1 on the block ``x[i, b0 : b0 + 32]`` (float32, rows
    contiguous): its 32 quants go to ``qs[q0 : q0 + 32]`` (int8, 1-D contiguous), and it
    returns ``(d, d * sum of the quants)`` in float32, before their fp16 rounding.

    Vector code in LLVM's portable form, so the block is four 8-lane registers, as in ggml:
    ``amax`` is a max over |x| (exact in any order; activations hold no NaN, and ggml's
    _mm256_max_ps tree is no more particular), ``d = amax / 127``, ``id = 127 / amax`` (0
    for an all-zero block), ``q = clamp(rint(x * id))`` (round half to even, the multiply
    rounded first), and the sum of the quants in int32 (exact in any order). Numba's own
    loop of these steps kept the max a chain of 32 scalar compares and the sum in int64."""
    if x.dtype != types.float32 or qs.dtype != types.int8 or x.layout != "C":
        return None
    sig = types.UniTuple(types.float32, 2)(x, i, b0, qs, q0)

    def codegen(context, builder, signature, args):
        b = builder
        x_t, i_t, b0_t, qs_t, q0_t = signature.args
        x_v, i_v, b0_v, qs_v, q0_v = args
        xa = context.make_array(x_t)(context, b, x_v)
        stride0 = cgutils.unpack_tuple(b, xa.strides, x_t.ndim)[0]
        row = context.cast(b, i_v, i_t, types.intp)
        col = context.cast(b, b0_v, b0_t, types.intp)
        at = b.add(b.mul(row, stride0), b.mul(col, ir.Constant(_I64, 4)))
        v8 = _vec(_F32, 8)
        xp = b.bitcast(b.gep(b.bitcast(xa.data, _I8.as_pointer()), [at]), v8.as_pointer())
        xs = [b.load(b.gep(xp, [ir.Constant(_I64, c)]), align=4) for c in range(4)]
        fabs = _Ops(b)._intrinsic("llvm.fabs.v8f32", v8, [v8])
        rint = _Ops(b)._intrinsic("llvm.rint.v8f32", v8, [v8])

        def vmax(p, q):
            return b.select(b.fcmp_ordered(">", p, q), p, q)

        a = [b.call(fabs, [v]) for v in xs]
        m = vmax(vmax(a[0], a[1]), vmax(a[2], a[3]))
        m = vmax(_lanes(b, m, range(4)), _lanes(b, m, range(4, 8)))
        m = vmax(_lanes(b, m, range(2)), _lanes(b, m, range(2, 4)))
        amax = vmax(*(b.extract_element(m, ir.Constant(_I32, j)) for j in range(2)))
        c127 = ir.Constant(_F32, 127.0)
        zero = ir.Constant(_F32, 0.0)
        d = b.fdiv(amax, c127)
        inv = b.select(b.fcmp_unordered("!=", amax, zero), b.fdiv(c127, amax), zero)
        inv8 = b.insert_element(ir.Constant(v8, None), inv, ir.Constant(_I32, 0))
        inv8 = _lanes(b, inv8, [0] * 8)
        lo, hi = _splat(_F32, 8, -128.0), _splat(_F32, 8, 127.0)
        qa = context.make_array(qs_t)(context, b, qs_v)
        q_at = context.cast(b, q0_v, q0_t, types.intp)
        qp = b.gep(b.bitcast(qa.data, _I8.as_pointer()), [q_at])
        qp = b.bitcast(qp, _vec(_I8, 8).as_pointer())
        total = None
        for c in range(4):
            r = b.call(rint, [b.fmul(xs[c], inv8)])
            r = b.select(b.fcmp_ordered("<", r, lo), lo, r)
            r = b.select(b.fcmp_ordered(">", r, hi), hi, r)
            q = b.fptosi(r, _vec(_I32, 8))
            b.store(b.trunc(q, _vec(_I8, 8)), b.gep(qp, [ir.Constant(_I64, c)]), align=1)
            total = q if total is None else b.add(total, q)
        total = b.add(_lanes(b, total, range(4)), _lanes(b, total, range(4, 8)))
        total = b.add(_lanes(b, total, range(2)), _lanes(b, total, range(2, 4)))
        total = b.add(*(b.extract_element(total, ir.Constant(_I32, j)) for j in range(2)))
        sd = b.fmul(d, b.sitofp(total, _F32))
        return context.make_tuple(b, signature.return_type, [d, sd])

    return sig, codegen


@njit(cache=True)
def _quantize_q8_0(x, qs, d, dbits, s, sbits, with_sum):
    """Q8_0 (and Q8_1 when ``with_sum``) of each row of x: AVX2 quantize_row_q8_0/1
    (``q8_block``), with fp16 conversions by F16C where the CPU has it."""
    n, k = x.shape
    for i in range(n):
        row = qs[i]
        for b in range(k // 32):
            db, sd = q8_block(x, i, b * 32, row, b * 32)
            dbits[i, b] = f16_bits(db)
            d[i, b] = round_f16(db)
            if with_sum:
                sbits[i, b] = f16_bits(sd)
                s[i, b] = round_f16(sd)


@njit(cache=True, nogil=True)
def quantize_packed(x, xqp, xdp, xsp, xcp, lo, hi):
    """Blocks ``lo .. hi`` of every row of x quantized as ``_quantize_q8_0`` does, written
    block-major for the batched dots (``simd.vec_dot_packed``): row u's quants of block b at
    ``xqp[b, 32 u : 32 u + 32]``, its scale at ``xdp[b, u]``, its Q8_1 sum at ``xsp[b, u]``
    (when ``xsp`` has columns) and, when ``xcp`` has columns, -128 times the sums of its
    quants four by four at ``xcp[b, 8 u : 8 u + 8]`` (the VNNI dots' offsets)."""
    n = x.shape[0]
    with_sum = xsp.shape[1] > 0
    with_offset = xcp.shape[1] > 0
    for b in range(lo, hi):
        qrow = xqp[b]
        for u in range(n):
            db, sd = q8_block(x, u, b * 32, qrow, 32 * u)
            xdp[b, u] = round_f16(db)
            if with_sum:
                xsp[b, u] = round_f16(sd)
            if with_offset:
                for g in range(8):
                    e = 32 * u + 4 * g
                    s4 = np.int32(qrow[e]) + np.int32(qrow[e + 1])
                    s4 += np.int32(qrow[e + 2]) + np.int32(qrow[e + 3])
                    xcp[b, 8 * u + g] = -128 * s4


@njit(inline="always")
def q8k_block(x, i, x0, qrow, q0):
    """One Q8_K block of row i of x (``QK_K`` values from column x0) as
    quantize_row_q8_K_ref makes it: its quants into ``qrow[q0 : q0 + QK_K]``; returns d."""
    vmax = np.float32(0.0)
    amax = np.float32(0.0)
    for e in range(QK_K):
        a = abs(x[i, x0 + e])
        if a > amax:
            amax = a
            vmax = x[i, x0 + e]
    if amax == 0:
        for e in range(QK_K):
            qrow[q0 + e] = 0
        return np.float32(0.0)
    iscale = np.float32(np.float32(-127.0) / vmax)
    for e in range(QK_K):
        v = np.rint(np.float32(iscale * x[i, x0 + e]))
        qrow[q0 + e] = int(min(v, 127.0))
    return np.float32(np.float32(1.0) / iscale)


@njit(cache=True)
def _quantize_q8_k(x, qs, d, bsums):
    """Q8_K of each row of x: quantize_row_q8_K_ref."""
    n, k = x.shape
    for i in range(n):
        for b in range(k // QK_K):
            x0 = b * QK_K
            d[i, b] = q8k_block(x, i, x0, qs[i], x0)
            for j in range(QK_K // 16):
                t = 0
                for e in range(16):
                    t += qs[i, x0 + 16 * j + e]
                bsums[i, b * 16 + j] = t


@njit(cache=True)
def _round_f16(x, out, bits):
    n, k = x.shape
    for i in range(n):
        for j in range(k):
            h = f32_to_f16_bits(x[i, j])
            bits[i, j] = h
            out[i, j] = f16_bits_to_f32(h)


@njit(cache=True)
def _round_bf16(x, out):
    n, k = x.shape
    for i in range(n):
        for j in range(k):
            out[i, j] = _bf16_round(x[i, j])


class QuantizedRows:
    """Rows of x in a vec_dot_type, as arrays the kernels read.

    - ``qs``: int8 (n, k) quants (Q8_*), or float32 (n, k) rounded values (F16/BF16/F32);
    - ``d``: float32 (n, k // block) block scales (fp16 values widened for Q8_0/Q8_1);
    - ``s``: float32 (n, k // 32) Q8_1 sums ``fp16(d * sum(q))`` (else empty);
    - ``bsums``: int32 (n, k // 16) Q8_K sums of 16 quants (else empty);
    - ``dbits``/``sbits``/``hbits``: the fp16 bit patterns, for ``pack_rows``.
    """

    __slots__ = ("vtype", "k", "qs", "d", "s", "bsums", "dbits", "sbits", "hbits")

    def __init__(self, vtype, k, qs, d, s, bsums, dbits, sbits, hbits):
        self.vtype = vtype
        self.k = k
        self.qs = qs
        self.d = d
        self.s = s
        self.bsums = bsums
        self.dbits = dbits
        self.sbits = sbits
        self.hbits = hbits


_EMPTY_F32 = np.zeros((0, 0), np.float32)
_EMPTY_I32 = np.zeros((0, 0), np.int32)
_EMPTY_U16 = np.zeros((0, 0), np.uint16)


def quantize_rows(x: np.ndarray, vtype: GGMLType) -> QuantizedRows:
    """Convert float32 rows ``x`` (n, k) to ``vtype`` as ggml-cpu's ``from_float`` does."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    vtype = GGMLType(vtype)
    if vtype in (GGMLType.Q8_0, GGMLType.Q8_1):
        if k % 32:
            raise ValueError(f"k={k} is not a multiple of the {vtype.name} block (32)")
        nb = k // 32
        qs = np.empty((n, k), np.int8)
        d = np.empty((n, nb), np.float32)
        dbits = np.empty((n, nb), np.uint16)
        with_sum = vtype == GGMLType.Q8_1
        s = np.empty((n, nb if with_sum else 0), np.float32)
        sbits = np.empty((n, nb if with_sum else 0), np.uint16)
        _quantize_q8_0(x, qs, d, dbits, s, sbits, with_sum)
        return QuantizedRows(vtype, k, qs, d, s, _EMPTY_I32, dbits, sbits, _EMPTY_U16)
    if vtype == GGMLType.Q8_K:
        if k % QK_K:
            raise ValueError(f"k={k} is not a multiple of the Q8_K block ({QK_K})")
        qs = np.empty((n, k), np.int8)
        d = np.empty((n, k // QK_K), np.float32)
        bsums = np.empty((n, k // 16), np.int32)
        _quantize_q8_k(x, qs, d, bsums)
        return QuantizedRows(vtype, k, qs, d, _EMPTY_F32, bsums, _EMPTY_U16, _EMPTY_U16, _EMPTY_U16)
    if vtype == GGMLType.F16:
        out = np.empty((n, k), np.float32)
        hbits = np.empty((n, k), np.uint16)
        _round_f16(x, out, hbits)
        return QuantizedRows(
            vtype, k, out, _EMPTY_F32, _EMPTY_F32, _EMPTY_I32, _EMPTY_U16, _EMPTY_U16, hbits
        )
    if vtype == GGMLType.BF16:
        out = np.empty((n, k), np.float32)
        _round_bf16(x, out)
        return QuantizedRows(
            vtype, k, out, _EMPTY_F32, _EMPTY_F32, _EMPTY_I32, _EMPTY_U16, _EMPTY_U16, _EMPTY_U16
        )
    if vtype == GGMLType.F32:
        return QuantizedRows(
            vtype, k, x, _EMPTY_F32, _EMPTY_F32, _EMPTY_I32, _EMPTY_U16, _EMPTY_U16, _EMPTY_U16
        )
    raise ValueError(f"no activation conversion to {vtype.name}")


def pack_rows(q: QuantizedRows) -> np.ndarray:
    """ggml's bytes of the quantized rows: uint8 (n, row_bytes)."""
    n = q.qs.shape[0]
    if q.vtype == GGMLType.Q8_0:
        nb = q.k // 32
        blocks = np.empty((n, nb, 34), np.uint8)
        blocks[:, :, 0:2] = q.dbits.reshape(n, nb, 1).view(np.uint8)
        blocks[:, :, 2:] = q.qs.reshape(n, nb, 32).view(np.uint8)
        return blocks.reshape(n, -1)
    if q.vtype == GGMLType.Q8_1:
        nb = q.k // 32
        blocks = np.empty((n, nb, 36), np.uint8)
        blocks[:, :, 0:2] = q.dbits.reshape(n, nb, 1).view(np.uint8)
        blocks[:, :, 2:4] = q.sbits.reshape(n, nb, 1).view(np.uint8)
        blocks[:, :, 4:] = q.qs.reshape(n, nb, 32).view(np.uint8)
        return blocks.reshape(n, -1)
    if q.vtype == GGMLType.Q8_K:
        nb = q.k // QK_K
        blocks = np.empty((n, nb, 4 + QK_K + 32), np.uint8)
        blocks[:, :, 0:4] = q.d.reshape(n, nb, 1).view(np.uint8)
        blocks[:, :, 4 : 4 + QK_K] = q.qs.reshape(n, nb, QK_K).view(np.uint8)
        bs = q.bsums.astype(np.int16).reshape(n, nb, 16)
        blocks[:, :, 4 + QK_K :] = bs.view(np.uint8)
        return blocks.reshape(n, -1)
    if q.vtype == GGMLType.F16:
        return np.ascontiguousarray(q.hbits).view(np.uint8)
    if q.vtype == GGMLType.BF16:
        bits = (q.qs.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8)
    return np.ascontiguousarray(q.qs, dtype=np.float32).view(np.uint8)
