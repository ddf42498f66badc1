"""SIMD dot products of one quantized weight row with one quantized activation row.

Each ``vec_dot_<type>`` here is an LLVM function written with llvmlite's IR builder, one
block per loop iteration, the same operations in the same order as ggml-cpu's AVX2
``ggml_vec_dot_<type>_<vec_dot_type>`` (arch/x86/quants.c):

- the weight block's quants are unpacked in registers (nibbles with a mask and a shift,
  high bits spread from a bit field), never written out;
- integer products of 32 unsigned by 32 signed bytes summed in pairs to 16 bits
  (``pmaddubsw``), then in pairs to 32 bits (``pmaddwd``), exact;
- eight float32 lanes accumulate ``d * float(isum)`` with one fused multiply-add per block,
  and are summed at the end in ggml's ``hsum_float_8`` order.

So a result is bit for bit ggml's (the test checks it against the frozen output of the
peer's libggml-cpu) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K. Q6_K's integer sums are
exact too, but the peer adds its float terms in another order than the AVX2 source we
follow, so its results differ from ggml's in float32 rounding only. On an x86 CPU with AVX2 the
byte products use the x86 intrinsics; elsewhere the same values come from portable LLVM
vector code (widen, multiply, add adjacent pairs), which LLVM lowers for any target.

``vec_dot_rows(qtype, n, nw, w, r, xq, xd, xs, bsums, i, out)`` (a Numba intrinsic, the
first three literals) dots rows ``r..r+nw-1`` of the weights ``w`` (uint8 (m, row_bytes))
with rows ``i..i+n-1`` of the quantized activations (``qdot._simd_parts``: int8 quants ``xq``,
float32 block scales ``xd``, Q8_1 (scale, sum) pairs ``xs``, Q8_K ``bsums``) into column ``r`` of
``out``; the weight block is unpacked once for the ``n`` rows (prefill).

``vec_dot_packed`` does the same for the 32-weight types with activations copied
block-major (a block's quants of adjacent rows side by side, their scales in one vector):
there two rows share each 512-bit register on AVX-512, and the rows' scales come from one
vector multiply, with every lane's arithmetic that of the single-row dot, so a row's
result is the same bits (ggml's) in any batch.
"""

from __future__ import annotations

import functools

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from picollama.backends.cpu.intrinsics import CPU_ISA, HOST_FEATURES
from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = [
    "SIMD_TYPES",
    "LEGACY_TYPES",
    "HAS_AVX2",
    "HAS_VNNI",
    "HAS_AVX512BW",
    "vec_dot_rows",
    "vec_dot_packed",
    "PACKED_OFFSET",
]

_FEATURES = HOST_FEATURES if llvm.get_process_triple().startswith("x86_64") else ""
HAS_AVX2 = "+avx2" in _FEATURES
# AVX512-VNNI with VL: vpdpbusd does pmaddubsw + pmaddwd(1) in one instruction, with the
# same sums (no pair of u8 * s8 products here reaches pmaddubsw's int16 saturation)
HAS_VNNI = (
    HAS_AVX2 and CPU_ISA == "native" and "+avx512vnni" in _FEATURES and "+avx512vl" in _FEATURES
)
# AVX512-BW: Q4_K's two sub-blocks of one 32-byte load (low and high nibbles) go through one
# 512-bit pmaddubsw / pmaddwd, half the instructions of two 256-bit ones, same integer sums
HAS_AVX512BW = HAS_AVX2 and CPU_ISA == "native" and "+avx512bw" in _FEATURES

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, value):
    return ir.Constant(_vec(t, n), [ir.Constant(t, value)] * n)


def _mask(indices):
    return ir.Constant(_vec(I32, len(indices)), [ir.Constant(I32, i) for i in indices])


class _Ops:
    """Vector building blocks over one IRBuilder, x86 intrinsics where the CPU has them."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder
        self.module = builder.module

    def _intrinsic(self, name, ret, args):
        fnty = ir.FunctionType(ret, args)
        try:
            return self.module.get_global(name)
        except KeyError:
            return ir.Function(self.module, fnty, name)

    def load(self, ptr, offset, ty):
        """Unaligned load of ``ty`` at byte ``offset`` (an i64 value) of the i8* ``ptr``."""
        p = self.b.gep(ptr, [offset])
        return self.b.load(self.b.bitcast(p, ty.as_pointer()), align=1)

    def load_f16(self, ptr, offset, last=False):
        """The half at ``offset``, widened. It comes with the two bytes after it (``last``:
        before it, for a block's closing scale) in one zero-extending 32-bit load: a 16-bit
        load into a vector lane (vpinsrw) keeps the register's other lanes, a false
        dependency on whatever the register held, the accumulator chain among others."""
        b = self.b
        at = b.sub(offset, ir.Constant(offset.type, 2)) if last else offset
        pair = b.fpext(b.bitcast(self.load(ptr, at, I32), _vec(F16, 2)), _vec(F32, 2))
        return b.extract_element(pair, ir.Constant(I32, 1 if last else 0))

    def load_f16_pair(self, ptr, offset):
        """The two adjacent halves at ``offset`` (a block's d and m), widened in one go."""
        b = self.b
        pair = b.fpext(self.load(ptr, offset, _vec(F16, 2)), _vec(F32, 2))
        return (
            b.extract_element(pair, ir.Constant(I32, 0)),
            b.extract_element(pair, ir.Constant(I32, 1)),
        )

    def scale_and_min(self, w, base, xs, i, summs):
        """A Q4_1 / Q5_1 block's ``dx * dy`` splat to 8 lanes, and ``summs`` with the
        block's ``m * sy`` added: ggml's two scalar products done as one multiply of the
        pairs (dx, m) and (dy, sy), the latter side by side in ``xs``. ``summs`` is
        <2 x float>; lane 1 is ggml's running sum of the min terms (lane 0 adds the
        dx * dy products, never read)."""
        b = self.b
        pair = b.fpext(self.load(w, base, _vec(F16, 2)), _vec(F32, 2))
        y = self.load(xs, b.mul(i, ir.Constant(I64, 8)), _vec(F32, 2))
        prod = b.fmul(pair, y)
        return self.splat8(b.extract_element(prod, ir.Constant(I32, 0))), b.fadd(summs, prod)

    def maddubs(self, a_u8, b_s8):
        """pmaddubsw: adjacent pairs of u8 * s8 products summed to i16 (saturating)."""
        if HAS_AVX2:
            fn = self._intrinsic(
                "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [_vec(I8, 32), _vec(I8, 32)]
            )
            return self.b.call(fn, [a_u8, b_s8])
        b = self.b
        prod = b.mul(b.zext(a_u8, _vec(I16, 32)), b.sext(b_s8, _vec(I16, 32)))
        even = b.shuffle_vector(prod, prod, _mask(range(0, 32, 2)))
        odd = b.shuffle_vector(prod, prod, _mask(range(1, 32, 2)))
        fn = self._intrinsic("llvm.sadd.sat.v16i16", _vec(I16, 16), [_vec(I16, 16)] * 2)
        return b.call(fn, [even, odd])

    def maddwd(self, a, c):
        """pmaddwd: adjacent pairs of i16 * i16 products summed to i32."""
        if HAS_AVX2:
            fn = self._intrinsic(
                "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [_vec(I16, 16), _vec(I16, 16)]
            )
            return self.b.call(fn, [a, c])
        b = self.b
        prod = b.mul(b.sext(a, _vec(I32, 16)), b.sext(c, _vec(I32, 16)))
        even = b.shuffle_vector(prod, prod, _mask(range(0, 16, 2)))
        odd = b.shuffle_vector(prod, prod, _mask(range(1, 16, 2)))
        return b.add(even, odd)

    def sign(self, a, s):
        """psignb: a negated where s < 0, zeroed where s == 0."""
        if HAS_AVX2:
            fn = self._intrinsic(
                "llvm.x86.avx2.psign.b", _vec(I8, 32), [_vec(I8, 32), _vec(I8, 32)]
            )
            return self.b.call(fn, [a, s])
        b = self.b
        zero = _splat(I8, 32, 0)
        neg = b.select(b.icmp_signed("<", s, zero), b.sub(zero, a), a)
        return b.select(b.icmp_signed("==", s, zero), zero, neg)

    def sum_i16_pairs_float(self, x16):
        return self.b.sitofp(self.maddwd(_splat(I16, 16, 1), x16), _vec(F32, 8))

    def mul_sum_us8_pairs_float(self, ax, sy):
        if HAS_VNNI:
            return self.b.sitofp(self.dpbusd8(_splat(I32, 8, 0), ax, sy), _vec(F32, 8))
        return self.sum_i16_pairs_float(self.maddubs(ax, sy))

    def mul_sum_i8_pairs_float(self, x, y):
        return self.mul_sum_us8_pairs_float(self.sign(x, x), self.sign(y, x))

    def dpbusd8(self, acc, ax, sy):
        """vpdpbusd (VNNI only): ``acc`` <8 x i32> plus, per 32-bit lane, the sum of its
        four u8 * s8 products, exactly."""
        v8 = _vec(I32, 8)
        fn = self._intrinsic("llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8])
        b = self.b
        return b.call(fn, [acc, b.bitcast(ax, v8), b.bitcast(sy, v8)])

    def dot_us8_512(self, ax, sy, init=None):
        """Sums of four adjacent u8 * s8 products, 64 bytes to 16 int32 lanes (AVX-512):
        vpdpbusd with VNNI, else pmaddubsw and pmaddwd by ones (the same sums where no
        pair of products saturates int16, as in ``mul_sum_us8_pairs_float``). ``init``
        (VNNI only): <16 x i32> added to the sums, exactly."""
        b = self.b
        v16 = _vec(I32, 16)
        if HAS_VNNI:
            fn = self._intrinsic("llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
            acc = _splat(I32, 16, 0) if init is None else init
            return b.call(fn, [acc, b.bitcast(ax, v16), b.bitcast(sy, v16)])
        assert init is None
        maddubs = self._intrinsic(
            "llvm.x86.avx512.pmaddubs.w.512", _vec(I16, 32), [_vec(I8, 64), _vec(I8, 64)]
        )
        maddwd = self._intrinsic("llvm.x86.avx512.pmaddw.d.512", v16, [_vec(I16, 32)] * 2)
        return b.call(maddwd, [_splat(I16, 32, 1), b.call(maddubs, [ax, sy])])

    def fma8(self, a, x, acc):
        fn = self._intrinsic("llvm.fma.v8f32", _vec(F32, 8), [_vec(F32, 8)] * 3)
        return self.b.call(fn, [a, x, acc])

    def splat8(self, value):
        b = self.b
        v = b.insert_element(ir.Constant(_vec(F32, 8), None), value, ir.Constant(I32, 0))
        return b.shuffle_vector(v, v, _mask([0] * 8))

    def nibbles_32(self, ptr, offset):
        """bytes_from_nibbles_32: 16 bytes -> low nibbles in bytes 0..15, high in 16..31."""
        b = self.b
        q = self.load(ptr, offset, _vec(I8, 16))
        both = b.bitcast(b.shuffle_vector(q, q, _mask(list(range(16)) * 2)), _vec(I32, 8))
        shift = ir.Constant(_vec(I32, 8), [ir.Constant(I32, s) for s in [0] * 4 + [4] * 4])
        return b.and_(b.bitcast(b.lshr(both, shift), _vec(I8, 32)), _splat(I8, 32, 0x0F))

    def bits_32(self, ptr, offset):
        """bytes_from_bits_32: bit j of the u32 at ``offset`` -> byte j, 0xFF or 0x00."""
        b = self.b
        bits = b.bitcast(self.load(ptr, offset, I32), _vec(ir.IntType(1), 32))
        return b.sext(bits, _vec(I8, 32))

    def hsum_float_8(self, x):
        """ggml's hsum_float_8: (hi4 + lo4), then the upper pair onto the lower, then 0 + 1."""
        b = self.b
        hi = b.shuffle_vector(x, x, _mask([4, 5, 6, 7]))
        lo = b.shuffle_vector(x, x, _mask([0, 1, 2, 3]))
        r = b.fadd(hi, lo)
        r2 = b.fadd(r, b.shuffle_vector(r, r, _mask([2, 3, 2, 3])))
        e0 = b.extract_element(r2, ir.Constant(I32, 0))
        e1 = b.extract_element(r2, ir.Constant(I32, 1))
        return b.fadd(e0, e1)


def prefetch(b: ir.IRBuilder, ptr, offset, n_bytes: int) -> None:
    """Read prefetches (``llvm.prefetch``) into every cache level of the lines of the
    ``n_bytes`` at byte ``offset`` (an i64 value) of the i8* ``ptr``, one per 64 bytes; a
    prefetch past an array's end is harmless (it never faults)."""
    name = "llvm.prefetch.p0i8"
    try:
        fn = b.module.get_global(name)
    except KeyError:
        fnty = ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
        fn = ir.Function(b.module, fnty, name)
    for line in range(0, n_bytes, 64):
        at = b.gep(ptr, [b.add(offset, ir.Constant(offset.type, line))])
        # read, keep in every cache level, a data (not instruction) line
        b.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def inline_function(module: ir.Module, name: str, arg_types: list) -> tuple[ir.Function, bool]:
    """The module's internal, always-inlined void function ``name`` of ``arg_types``:
    ``(fn, True)`` when it was just declared (the caller builds its body), ``(fn, False)``
    when the module already has it."""
    try:
        return module.get_global(name), False
    except KeyError:
        pass
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), arg_types), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    return fn, True


# -- the functions ------------------------------------------------------------------------

# Arguments of every vec_dot function: the weight row, the activation quants, block scales,
# Q8_1 block sums (f32) or Q8_K bsums (i32, passed as i8*), and the number of blocks.
_ARGS = [I8.as_pointer(), I8.as_pointer(), F32.as_pointer(), I8.as_pointer(), I64]


def _legacy_body(qtype):
    """The per-block step of the 32-weight types, as ``step(ops, w, xq, xd, xs, i, acc, summs)``."""
    size = _LEGACY_SIZE[qtype]
    weights = _legacy_weights(qtype)
    signed = qtype in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0)

    def step(o: _Ops, w, xq, xd, xs, i, acc, summs):
        b = o.b
        qy = o.load(xq, b.mul(i, ir.Constant(I64, 32)), _vec(I8, 32))
        dx, _, qx = weights(o, w, i)
        if qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
            base = b.mul(i, ir.Constant(I64, size))
            d, summs = o.scale_and_min(w, base, xs, i, summs)
        else:
            d = o.splat8(b.fmul(dx, b.load(b.gep(xd, [i]))))
        if signed:
            q = o.mul_sum_i8_pairs_float(qx, qy)
        else:
            q = o.mul_sum_us8_pairs_float(qx, qy)
        acc = o.fma8(d, q, acc)
        return acc, summs

    return step


_LEGACY_SIZE = {
    GGMLType.Q4_0: 18,
    GGMLType.Q4_1: 20,
    GGMLType.Q5_0: 22,
    GGMLType.Q5_1: 24,
    GGMLType.Q8_0: 34,
}


# how far ahead the weight loops prefetch, in bytes: 512 to 8192 measured alike (2048 a
# little ahead), in decode steps and in float batches
PREFETCH_AHEAD = 2048


def _legacy_weights(qtype):
    """``weights(o, w, i)`` -> (dx, m, qx): block i's scale, min (Q4_1, Q5_1, else None)
    and 32 quant bytes (signed for Q4_0, Q5_0, Q8_0): ggml's unpacking, for ``_legacy_body``
    and ``_define_packed``."""
    size = _LEGACY_SIZE[qtype]

    def weights(o: _Ops, w, i):
        b = o.b
        base = b.mul(i, ir.Constant(I64, size))
        m = None
        if qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
            dx, m = o.load_f16_pair(w, base)
        else:
            dx = o.load_f16(w, base)
        if qtype == GGMLType.Q4_0:
            qx = b.sub(o.nibbles_32(w, b.add(base, ir.Constant(I64, 2))), _splat(I8, 32, 8))
        elif qtype == GGMLType.Q4_1:
            qx = o.nibbles_32(w, b.add(base, ir.Constant(I64, 4)))
        elif qtype == GGMLType.Q5_0:
            qx = o.nibbles_32(w, b.add(base, ir.Constant(I64, 6)))
            hi = o.bits_32(w, b.add(base, ir.Constant(I64, 2)))
            hi = b.and_(b.xor(hi, _splat(I8, 32, -1)), _splat(I8, 32, -16))  # andnot 0xF0
            qx = b.or_(qx, hi)
        elif qtype == GGMLType.Q5_1:
            qx = o.nibbles_32(w, b.add(base, ir.Constant(I64, 8)))
            hi = b.and_(o.bits_32(w, b.add(base, ir.Constant(I64, 4))), _splat(I8, 32, 0x10))
            qx = b.or_(qx, hi)
        else:  # Q8_0
            qx = o.load(w, b.add(base, ir.Constant(I64, 2)), _vec(I8, 32))
        return dx, m, qx

    return weights


# blocks of a ``vec_dot_packed`` chunk: their scales wait in a stack buffer of
# _PACKED_CHUNK x n_rows floats (2 KB) while their integer dots run; a row of up to 2048
# weights is one chunk, so each weight row is one pass of each loop
_PACKED_CHUNK = 64


def _define_packed(module: ir.Module, qtype: GGMLType, n_rows: int) -> ir.Function:
    """A 32-weight type's vec_dot of one weight row with ``n_rows`` rows of packed
    activations (``vec_dot_packed``).

    ``f(w, xq, xq_stride, xd, xd_stride, xs, nb, out, out_stride)``: block b of activation
    row r has its 32 quants at ``xq + b * xq_stride + 32 r`` and its float32 scale (and
    Q8_1 sum) at ``xd + b * xd_stride + 4 r`` (``xs`` likewise); the dot is stored at
    ``out + r * out_stride``. Per block, the weights are unpacked once for all the rows,
    and the rows' scales ``dx * dy`` (and min terms ``m * s``) come from one vector
    multiply over the adjacent ``dy`` (and ``s``): lane by lane the scalar operations of
    ``_legacy_body``. Where the CPU has AVX-512, two adjacent rows share a 512-bit
    register: the weight block's 32 bytes broadcast to both halves, the rows' 64 bytes in
    one load, one integer dot (vpdpbusd, or pmaddubsw + pmaddwd), one sitofp and one FMA
    with the two rows' scales give in lanes 0..7 and 8..15 the two rows' accumulators of
    the 256-bit code. Every lane's operations and roundings are those of the single-row
    vec_dot, so each result is its bits (ggml's), whatever the grouping of rows.
    """
    isa = "vnni" if HAS_VNNI else "avx512" if HAS_AVX512BW else "avx2" if HAS_AVX2 else "generic"
    name = f"picollama_vec_dot_packed_{qtype.name.lower()}_{n_rows}_{isa}"
    p8 = I8.as_pointer()
    fn, new = inline_function(module, name, [p8, p8, I64, p8, I64, p8, p8, I64, I64, p8, I64])
    if not new:
        return fn
    w, xq, sq, xd, sd, xs, yc, sc, nb, out, so = fn.args
    entry = fn.append_basic_block("entry")
    outer = fn.append_basic_block("outer")
    pre = fn.append_basic_block("pre")
    loop = fn.append_basic_block("loop")
    latch = fn.append_basic_block("latch")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    o = _Ops(b)
    signed = qtype in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0)
    with_sum = qtype in (GGMLType.Q4_1, GGMLType.Q5_1)
    vn = _vec(F32, n_rows)
    if HAS_AVX512BW:
        groups = [tuple(range(r, min(r + 2, n_rows))) for r in range(0, n_rows, 2)]
    else:
        groups = [(r,) for r in range(n_rows)]

    def zeros(n):
        return ir.Constant(_vec(F32, n), [ir.Constant(F32, 0.0)] * n)

    def splat_n(value):
        v = b.insert_element(ir.Constant(vn, None), value, ir.Constant(I32, 0))
        return b.shuffle_vector(v, v, _mask([0] * n_rows))

    # the blocks go in chunks of _PACKED_CHUNK: first the rows' scales of a chunk's blocks
    # into a buffer on the stack (and the min terms into ``summs``), then its integer dots,
    # each row's scale broadcast from that buffer (a load, where taking lane r of a register
    # costs one or two shuffles a row)
    buf = b.alloca(ir.ArrayType(F32, _PACKED_CHUNK * n_rows))
    b.branch(outer)

    b.position_at_end(outer)
    b0 = b.phi(I64)
    accs = [b.phi(_vec(F32, 8 * len(g))) for g in groups]
    summs = b.phi(vn) if with_sum else None
    left = b.sub(nb, b0)
    chunk = ir.Constant(I64, _PACKED_CHUNK)
    count = b.select(b.icmp_unsigned("<", left, chunk), left, chunk)
    # the weights PREFETCH_AHEAD bytes on, as in the decode dots (a task's rows are one
    # short stream; 8 rows of x by a model's matrices from DRAM, best of 6 runs: 62 -> 67
    # GMAC/s, on a noisy host)
    size = _LEGACY_SIZE[qtype]
    at = b.add(b.mul(b0, ir.Constant(I64, size)), ir.Constant(I64, PREFETCH_AHEAD))
    prefetch(b, w, at, size * _PACKED_CHUNK)
    b.branch(pre)

    b.position_at_end(pre)
    j = b.phi(I64)
    summs_p = b.phi(vn) if with_sum else None
    i = b.add(b0, j)
    dx, m, _ = _legacy_weights(qtype)(o, w, i)
    dy = b.load(b.bitcast(b.gep(xd, [b.mul(i, sd)]), vn.as_pointer()), align=4)
    at = b.gep(buf, [ir.Constant(I64, 0), b.mul(j, ir.Constant(I64, n_rows))])
    b.store(b.fmul(splat_n(dx), dy), b.bitcast(at, vn.as_pointer()), align=4)
    if with_sum:
        sy = b.load(b.bitcast(b.gep(xs, [b.mul(i, sd)]), vn.as_pointer()), align=4)
        summs1 = b.fadd(summs_p, b.fmul(splat_n(m), sy))
    j1 = b.add(j, ir.Constant(I64, 1))
    j.add_incoming(ir.Constant(I64, 0), outer)
    j.add_incoming(j1, pre)
    if with_sum:
        summs_p.add_incoming(summs, outer)
        summs_p.add_incoming(summs1, pre)
    b.cbranch(b.icmp_unsigned("<", j1, count), pre, loop)

    b.position_at_end(loop)
    j = b.phi(I64)
    accs_l = [b.phi(_vec(F32, 8 * len(g))) for g in groups]
    i = b.add(b0, j)
    _, _, qx = _legacy_weights(qtype)(o, w, i)
    ax = o.sign(qx, qx) if signed else qx
    qoff = b.mul(i, sq)

    def scale(r):  # lane r of the block's scales: the scalar dx * dy of row r
        at = b.add(b.mul(j, ir.Constant(I64, n_rows)), ir.Constant(I64, r))
        return b.load(b.gep(buf, [ir.Constant(I64, 0), at]), align=4)

    # VNNI, signed quants: (qx + 128) . qy - 128 * (sum of qy's group of 4), the same exact
    # int32 sums as |qx| . sign(qy, qx) without the per-row sign: the second term comes
    # with the packed rows (``yc``), as vpdpbusd's starting value
    offset = signed and HAS_VNNI
    if offset:
        ax_off = b.xor(qx, _splat(I8, 32, -128))  # qx + 128 as u8
        ax_off2 = b.shuffle_vector(ax_off, ax_off, _mask(list(range(32)) * 2))
        coff = b.mul(i, sc)
    new = []
    for g, acc in zip(groups, accs_l, strict=True):
        if len(g) == 2:
            qy = o.load(xq, b.add(qoff, ir.Constant(I64, 32 * g[0])), _vec(I8, 64))
            qx2 = b.shuffle_vector(qx, qx, _mask(list(range(32)) * 2))
            if offset:
                init = o.load(yc, b.add(coff, ir.Constant(I64, 32 * g[0])), _vec(I32, 16))
                isum = o.dot_us8_512(ax_off2, qy, init)
            else:
                if signed:  # psign: qy negated where qx < 0, zeroed where qx == 0
                    zero = _splat(I8, 64, 0)
                    neg = b.select(b.icmp_signed("<", qx2, zero), b.sub(zero, qy), qy)
                    sy2 = b.select(b.icmp_signed("==", qx2, zero), zero, neg)
                else:
                    sy2 = qy
                ax2 = b.shuffle_vector(ax, ax, _mask(list(range(32)) * 2))
                isum = o.dot_us8_512(ax2, sy2)
            q = b.sitofp(isum, _vec(F32, 16))
            pair = b.insert_element(
                b.insert_element(ir.Constant(_vec(F32, 2), None), scale(g[0]), ir.Constant(I32, 0)),
                scale(g[1]),
                ir.Constant(I32, 1),
            )
            d = b.shuffle_vector(pair, pair, _mask([0] * 8 + [1] * 8))
            fn16 = o._intrinsic("llvm.fma.v16f32", _vec(F32, 16), [_vec(F32, 16)] * 3)
            new.append(b.call(fn16, [d, q, acc]))
        else:
            qy = o.load(xq, b.add(qoff, ir.Constant(I64, 32 * g[0])), _vec(I8, 32))
            sy1 = o.sign(qy, qx) if signed else qy
            q = o.mul_sum_us8_pairs_float(ax, sy1)
            new.append(o.fma8(o.splat8(scale(g[0])), q, acc))
    j1 = b.add(j, ir.Constant(I64, 1))
    j.add_incoming(ir.Constant(I64, 0), pre)
    j.add_incoming(j1, loop)
    for phi, acc0, acc1 in zip(accs_l, accs, new, strict=True):
        phi.add_incoming(acc0, pre)
        phi.add_incoming(acc1, loop)
    b.cbranch(b.icmp_unsigned("<", j1, count), loop, latch)

    b.position_at_end(latch)
    b1 = b.add(b0, chunk)
    b0.add_incoming(ir.Constant(I64, 0), entry)
    b0.add_incoming(b1, latch)
    for g, phi, acc1 in zip(groups, accs, new, strict=True):
        phi.add_incoming(zeros(8 * len(g)), entry)
        phi.add_incoming(acc1, latch)
    if with_sum:
        summs.add_incoming(zeros(n_rows), entry)
        summs.add_incoming(summs1, latch)
    b.cbranch(b.icmp_unsigned("<", b1, nb), outer, done)
    b.position_at_end(done)
    for g, acc1 in zip(groups, new, strict=True):
        for t, r in enumerate(g):
            lanes = acc1
            if len(g) == 2:  # row r: lanes 8t..8t+7
                lanes = b.shuffle_vector(acc1, acc1, _mask(range(8 * t, 8 * t + 8)))
            total = o.hsum_float_8(lanes)
            if with_sum:
                total = b.fadd(total, b.extract_element(summs1, ir.Constant(I32, r)))
            dst = b.gep(out, [b.mul(ir.Constant(I64, r), so)])
            b.store(total, b.bitcast(dst, F32.as_pointer()))
    b.ret_void()
    return fn


# get_scale_shuffle_k4(i): 16-bit scale i broadcast to every 16-bit lane
def _k_quant_body(qtype):
    def step(o: _Ops, w, xq, xd, xs, i, acc, summs):
        b = o.b
        bsums = b.bitcast(xs, I32.as_pointer())
        dy = b.load(b.gep(xd, [i]))
        q8 = b.mul(i, ir.Constant(I64, 256))
        if qtype == GGMLType.Q4_K:
            base = b.mul(i, ir.Constant(I64, 144))
            dw, mw = o.load_f16_pair(w, base)
            d = b.fmul(dy, dw)
            dmin = b.fmul(b.fneg(dy), mw)
            # the 8 6-bit scales and mins (ggml's utmp shuffle) in four 32-bit lanes at once,
            # u = [s0 & m1, (s2 & m2) | (s0 >> 2 & 0x30..),
            #      s1 & m1, (s2 >> 4 & m2) | (s1 >> 2 & 0x30..)]
            # where ((s >> 6) & 0x03..) << 4 is (s >> 2) & 0x30.. byte by byte
            v4 = _vec(I32, 4)
            sc = o.load(w, b.add(base, ir.Constant(I64, 4)), v4)  # scales[12] + 4 bytes of qs
            a_ = b.shuffle_vector(sc, sc, _mask([0, 2, 1, 2]))
            b_ = b.shuffle_vector(sc, sc, _mask([0, 0, 1, 1]))
            km1, km2, k30 = 0x3F3F3F3F, 0x0F0F0F0F, 0x30303030
            lo = b.and_(
                b.lshr(a_, ir.Constant(v4, [ir.Constant(I32, c) for c in (0, 0, 0, 4)])),
                ir.Constant(v4, [ir.Constant(I32, c) for c in (km1, km2, km1, km2)]),
            )
            hi = b.and_(
                b.lshr(b_, _splat(I32, 4, 2)),
                ir.Constant(v4, [ir.Constant(I32, c) for c in (0, k30, 0, k30)]),
            )
            u = b.or_(lo, hi)
            bytes16 = b.bitcast(u, _vec(I8, 16))
            ms = b.zext(bytes16, _vec(I16, 16))  # scales in lanes 0..7, mins in 8..15
            # mins . (bsums summed in pairs), fmadd into a 4-lane accumulator
            bs = o.load(
                b.bitcast(bsums, I8.as_pointer()), b.mul(i, ir.Constant(I64, 64)), _vec(I32, 16)
            )
            pairs = b.add(
                b.shuffle_vector(bs, bs, _mask(range(0, 16, 2))),
                b.shuffle_vector(bs, bs, _mask(range(1, 16, 2))),
            )
            # _mm_hadd_epi16 sums in 16 bits; bsums fit, and so do their pair sums (|.| <= 8128)
            pairs16 = b.trunc(pairs, _vec(I16, 8))
            mins = b.shuffle_vector(ms, ms, _mask(range(8, 16)))
            prod = b.mul(b.sext(mins, _vec(I32, 8)), b.sext(pairs16, _vec(I32, 8)))
            prod4 = b.add(
                b.shuffle_vector(prod, prod, _mask([0, 2, 4, 6])),
                b.shuffle_vector(prod, prod, _mask([1, 3, 5, 7])),
            )
            acc_m = summs  # a <4 x float> here
            fn = o._intrinsic("llvm.fma.v4f32", _vec(F32, 4), [_vec(F32, 4)] * 3)
            dmin4 = b.shuffle_vector(
                b.insert_element(ir.Constant(_vec(F32, 4), None), dmin, ir.Constant(I32, 0)),
                ir.Constant(_vec(F32, 4), None),
                _mask([0] * 4),
            )
            acc_m = b.call(fn, [dmin4, b.sitofp(prod4, _vec(F32, 4)), acc_m])
            if HAS_AVX512BW:
                sumi = _q4_k_sumi_512(o, w, base, xq, q8, ms)
            else:
                sumi = _splat(I32, 8, 0)
                for j in range(4):
                    sl = b.shuffle_vector(ms, ms, _mask([2 * j] * 16))
                    sh = b.shuffle_vector(ms, ms, _mask([2 * j + 1] * 16))
                    q4 = o.load(w, b.add(base, ir.Constant(I64, 16 + 32 * j)), _vec(I8, 32))
                    q4l = b.and_(q4, _splat(I8, 32, 0x0F))
                    q4h = b.lshr(q4, _splat(I8, 32, 4))
                    q8l = o.load(xq, b.add(q8, ir.Constant(I64, 64 * j)), _vec(I8, 32))
                    q8h = o.load(xq, b.add(q8, ir.Constant(I64, 64 * j + 32)), _vec(I8, 32))
                    pl = o.maddwd(sl, o.maddubs(q4l, q8l))
                    ph = o.maddwd(sh, o.maddubs(q4h, q8h))
                    sumi = b.add(sumi, b.add(pl, ph))
            acc = o.fma8(o.splat8(d), b.sitofp(sumi, _vec(F32, 8)), acc)
            return acc, acc_m
        # Q6_K: ql[128], qh[64], scales[16] (int8), d
        base = b.mul(i, ir.Constant(I64, 210))
        d = b.fmul(dy, o.load_f16(w, b.add(base, ir.Constant(I64, 208)), last=True))
        scales = b.sext(o.load(w, b.add(base, ir.Constant(I64, 192)), _vec(I8, 16)), _vec(I16, 16))
        # The quants are q - 32 with q in 0..63. ggml subtracts 32 * q8 pair by pair
        # (pmaddubsw of 32s); we take the same integer total as sum(scale_g * q * q8) minus
        # 32 * sum(scale_g * bsum_g), the Q8_K group sums, in one pmaddwd per super-block.
        # The int32 lanes hold other partial sums than ggml's, so the float result may
        # differ from ggml's in float32 rounding (its own AVX2 and generic code differ so).
        bs = o.load(
            b.bitcast(bsums, I8.as_pointer()), b.mul(i, ir.Constant(I64, 64)), _vec(I32, 16)
        )
        corr = o.maddwd(scales, b.trunc(bs, _vec(I16, 16)))  # |bsum| <= 16 * 128
        if HAS_AVX512BW:
            sumi = _q6_k_sumi_512(o, w, base, xq, q8, scales)
        else:
            sumi = _splat(I32, 8, 0)
            m4, m3 = _splat(I8, 32, 0x0F), _splat(I8, 32, 3)
            for j in range(2):
                ql1 = o.load(w, b.add(base, ir.Constant(I64, 64 * j)), _vec(I8, 32))
                ql2 = o.load(w, b.add(base, ir.Constant(I64, 64 * j + 32)), _vec(I8, 32))
                qh = o.load(w, b.add(base, ir.Constant(I64, 128 + 32 * j)), _vec(I8, 32))
                hs = [
                    b.shl(b.and_(b.lshr(qh, _splat(I8, 32, 2 * t)), m3), _splat(I8, 32, 4))
                    for t in range(4)
                ]
                q6 = [
                    b.or_(b.and_(ql1, m4), hs[0]),
                    b.or_(b.and_(ql2, m4), hs[1]),
                    b.or_(b.lshr(ql1, _splat(I8, 32, 4)), hs[2]),
                    b.or_(b.lshr(ql2, _splat(I8, 32, 4)), hs[3]),
                ]
                for t in range(4):
                    q8t = o.load(xq, b.add(q8, ir.Constant(I64, 128 * j + 32 * t)), _vec(I8, 32))
                    # get_scale_shuffle(is): scale 2*is in lanes 0..7, 2*is + 1 in lanes 8..15
                    s_ = 4 * j + t
                    sc = b.shuffle_vector(scales, scales, _mask([2 * s_] * 8 + [2 * s_ + 1] * 8))
                    sumi = b.add(sumi, o.maddwd(sc, o.maddubs(q6[t], q8t)))
        sumi = b.sub(sumi, b.shl(corr, _splat(I32, 8, 5)))
        acc = o.fma8(o.splat8(d), b.sitofp(sumi, _vec(F32, 8)), acc)
        return acc, summs

    return step


def _q4_k_sumi_512(o: _Ops, w, base, xq, q8, ms):
    """Q4_K's integer sums with 512-bit vectors: the 8 int32 lanes of ggml's ``sumi``.

    Each 32-byte load of quants holds sub-block 2j (low nibbles) and 2j+1 (high); one
    512-bit pmaddubsw takes both against their 64 activation bytes, and one pmaddwd scales
    lanes 0..15 by scale 2j and 16..31 by scale 2j+1. Lane k of the 16-lane sum is ggml's
    ``pl`` lane k summed over j, lane 8 + k its ``ph``: their sum is ggml's sumi, exactly.
    """
    b = o.b
    maddubs = o._intrinsic(
        "llvm.x86.avx512.pmaddubs.w.512", _vec(I16, 32), [_vec(I8, 64), _vec(I8, 64)]
    )
    maddwd = o._intrinsic(
        "llvm.x86.avx512.pmaddw.d.512", _vec(I32, 16), [_vec(I16, 32), _vec(I16, 32)]
    )
    sumi = _splat(I32, 16, 0)
    for j in range(4):
        q4 = o.load(w, b.add(base, ir.Constant(I64, 16 + 32 * j)), _vec(I8, 32))
        q4x = b.shuffle_vector(
            b.and_(q4, _splat(I8, 32, 0x0F)), b.lshr(q4, _splat(I8, 32, 4)), _mask(range(64))
        )
        q8x = o.load(xq, b.add(q8, ir.Constant(I64, 64 * j)), _vec(I8, 64))
        sc = b.shuffle_vector(ms, ms, _mask([2 * j] * 16 + [2 * j + 1] * 16))
        sumi = b.add(sumi, b.call(maddwd, [sc, b.call(maddubs, [q4x, q8x])]))
    return b.add(
        b.shuffle_vector(sumi, sumi, _mask(range(8))),
        b.shuffle_vector(sumi, sumi, _mask(range(8, 16))),
    )


def _q6_k_sumi_512(o: _Ops, w, base, xq, q8, scales):
    """Q6_K's sum(scale_g * q * q8) with 512-bit vectors, in the 8 int32 lanes of the
    256-bit code's ``sumi`` (lanes 8..15 of each 512-bit pmaddwd fold onto 0..7).

    Half j of the block (128 weights) holds ql[64 j .. 64 j + 63] (low nibbles: weights
    0..63 of the half, high nibbles: 64..127) and qh[32 j .. 32 j + 31] (bit pairs 0..3 the
    top bits of the four 32-weight runs), so two 512-bit registers cover a half, each
    against 64 contiguous activation bytes."""
    b = o.b
    maddubs = o._intrinsic(
        "llvm.x86.avx512.pmaddubs.w.512", _vec(I16, 32), [_vec(I8, 64), _vec(I8, 64)]
    )
    maddwd = o._intrinsic(
        "llvm.x86.avx512.pmaddw.d.512", _vec(I32, 16), [_vec(I16, 32), _vec(I16, 32)]
    )
    v32, v64 = _vec(I8, 32), _vec(I8, 64)
    sumi = _splat(I32, 16, 0)
    for j in range(2):
        ql = o.load(w, b.add(base, ir.Constant(I64, 64 * j)), v64)
        qh = o.load(w, b.add(base, ir.Constant(I64, 128 + 32 * j)), v32)
        top = [  # bits 2t, 2t + 1 of qh moved to bits 4, 5
            b.and_(
                b.shl(qh, _splat(I8, 32, 4)) if t == 0 else b.shl(qh, _splat(I8, 32, 2)),
                _splat(I8, 32, 0x30),
            )
            if t < 2
            else b.and_(qh if t == 2 else b.lshr(qh, _splat(I8, 32, 2)), _splat(I8, 32, 0x30))
            for t in range(4)
        ]
        halves = (
            b.or_(
                b.and_(ql, _splat(I8, 64, 0x0F)), b.shuffle_vector(top[0], top[1], _mask(range(64)))
            ),
            b.or_(
                b.lshr(ql, _splat(I8, 64, 4)), b.shuffle_vector(top[2], top[3], _mask(range(64)))
            ),
        )
        for h, q6 in enumerate(halves):
            q8x = o.load(xq, b.add(q8, ir.Constant(I64, 128 * j + 64 * h)), v64)
            s0, s1 = 4 * j + 2 * h, 4 * j + 2 * h + 1
            sc = b.shuffle_vector(
                scales,
                scales,
                _mask([2 * s0] * 8 + [2 * s0 + 1] * 8 + [2 * s1] * 8 + [2 * s1 + 1] * 8),
            )
            sumi = b.add(sumi, b.call(maddwd, [sc, b.call(maddubs, [q6, q8x])]))
    return b.add(
        b.shuffle_vector(sumi, sumi, _mask(range(8))),
        b.shuffle_vector(sumi, sumi, _mask(range(8, 16))),
    )


_LEGACY = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0)
_K = (GGMLType.Q4_K, GGMLType.Q6_K)
SIMD_TYPES: frozenset[GGMLType] = frozenset(_LEGACY + _K)
LEGACY_TYPES: frozenset[GGMLType] = frozenset(_LEGACY)  # the 32-weight ones
# the types whose packed activations carry -128 * their sums of 4 (``vec_dot_packed``)
PACKED_OFFSET: frozenset[GGMLType] = (
    frozenset((GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0)) if HAS_VNNI else frozenset()
)


def _define(module: ir.Module, qtype: GGMLType, n_rows: int, n_wrows: int) -> ir.Function:
    """The type's vec_dot of ``n_wrows`` weight rows with ``n_rows`` activation rows.

    ``f(w, w_stride, xq, xq_stride, xd, xd_stride, xs, xs_stride, nb, out, out_stride)``:
    weight row j starts ``j * w_stride`` bytes after ``w``, activation row r ``r * stride``
    bytes after ``xq``, ``xd`` and ``xs``; the dot of the two is stored as float32 at
    ``out + r * out_stride + 4 * j``. A block's weights are loaded and unpacked once for all
    the activation rows (the per-row steps repeat the same pure operations on them, and
    LLVM keeps one copy); several weight rows give independent accumulator chains (decode).
    Every pair keeps its own accumulators, so each result is the single vec_dot's, bit for
    bit.
    """
    isa = "vnni" if HAS_VNNI else "avx2" if HAS_AVX2 else "generic"
    name = f"picollama_vec_dot_{qtype.name.lower()}_{n_wrows}x{n_rows}_{isa}"
    p8 = I8.as_pointer()
    fn, new = inline_function(module, name, [p8, I64, p8, I64, p8, I64, p8, I64, I64, p8, I64])
    if not new:
        return fn
    w, sw, xq, sq, xd, sd, xs, ss, nb, out, so = fn.args
    entry = fn.append_basic_block("entry")
    loop = fn.append_basic_block("loop")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    o = _Ops(b)

    def row(ptr, stride, r):
        return b.gep(ptr, [b.mul(ir.Constant(I64, r), stride)])

    wrows = [row(w, sw, j) for j in range(n_wrows)]
    rows = [
        (row(xq, sq, r), b.bitcast(row(xd, sd, r), F32.as_pointer()), row(xs, ss, r))
        for r in range(n_rows)
    ]
    pairs = [(j, r) for r in range(n_rows) for j in range(n_wrows)]
    zero8 = ir.Constant(_vec(F32, 8), [ir.Constant(F32, 0.0)] * 8)
    summs0 = (
        ir.Constant(_vec(F32, 4), [ir.Constant(F32, 0.0)] * 4)
        if qtype == GGMLType.Q4_K
        else ir.Constant(_vec(F32, 2), [ir.Constant(F32, 0.0)] * 2)
        if qtype in (GGMLType.Q4_1, GGMLType.Q5_1)
        else ir.Constant(F32, 0.0)
    )
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(I64)
    accs = [b.phi(_vec(F32, 8)) for _ in pairs]
    summs = [b.phi(summs0.type) for _ in pairs]
    step = _k_quant_body(qtype) if qtype in _K else _legacy_body(qtype)
    # the weights PREFETCH_AHEAD bytes on, a line per 64 bytes of block: a decode step's
    # matrices are small and split among tasks, so each task's stream is short and the
    # hardware prefetcher's ramp-up a large part of it (SmolLM2 Q4_1 step: 8.7 -> 7.1-7.5
    # ms; Gemma 3 Q4_K_M: 11.5-12.8 -> 10.0-11.5)
    size = GGML_TYPES[qtype].type_size
    at = b.add(b.mul(i, ir.Constant(I64, size)), ir.Constant(I64, PREFETCH_AHEAD))
    for j in range(n_wrows):
        prefetch(b, wrows[j], at, size)
    new = [
        step(o, wrows[j], *rows[r], i, acc, sm)
        for (j, r), acc, sm in zip(pairs, accs, summs, strict=True)
    ]
    i1 = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(ir.Constant(I64, 0), entry)
    i.add_incoming(i1, b.block)
    for phi, (acc1, _) in zip(accs, new, strict=True):
        phi.add_incoming(zero8, entry)
        phi.add_incoming(acc1, b.block)
    for phi, (_, sm1) in zip(summs, new, strict=True):
        phi.add_incoming(summs0, entry)
        phi.add_incoming(sm1, b.block)
    b.cbranch(b.icmp_unsigned("<", i1, nb), loop, done)
    b.position_at_end(done)
    for (j, r), (acc1, sm1) in zip(pairs, new, strict=True):
        total = o.hsum_float_8(acc1)
        if qtype == GGMLType.Q4_K:
            # acc_m: + movehl, then lane 0 + lane 1
            t = b.fadd(sm1, b.shuffle_vector(sm1, sm1, _mask([2, 3, 2, 3])))
            m = b.fadd(
                b.extract_element(t, ir.Constant(I32, 0)), b.extract_element(t, ir.Constant(I32, 1))
            )
            total = b.fadd(total, m)
        elif qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
            total = b.fadd(total, b.extract_element(sm1, ir.Constant(I32, 1)))
        dst = b.gep(row(out, so, r), [ir.Constant(I64, 4 * j)])
        b.store(total, b.bitcast(dst, F32.as_pointer()))
    b.ret_void()
    return fn


def _array_parts(context, builder, arrty, arr):
    """(data as i8*, stride of axis 0 in bytes, length of axis 1) of a 2-D array."""
    ary = context.make_array(arrty)(context, builder, arr)
    stride0 = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
    n1 = cgutils.unpack_tuple(builder, ary.shape, 2)[1]
    return builder.bitcast(ary.data, I8.as_pointer()), stride0, n1


@functools.cache
def _block(qtype: int) -> int:
    return 256 if GGMLType(qtype) in _K else 32


@intrinsic
def vec_dot_rows(typingctx, qtype, n_rows, n_wrows, w, r, xq, xd, xs, bsums, i, out):
    """``vec_dot_rows(qtype, n_rows, n_wrows, w, r, xq, xd, xs, bsums, i, out)``: for k in
    0..n_rows-1 and j in 0..n_wrows-1, ``out[i + k, r + j]`` = ggml's vec_dot of weight row
    ``r + j`` with activation row ``i + k`` (see the module docstring). ``qtype``,
    ``n_rows`` and ``n_wrows`` are literals."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (qtype, n_rows, n_wrows)):
        return None
    qt = GGMLType(qtype.literal_value)
    if qt not in SIMD_TYPES:
        return None
    count, wcount = n_rows.literal_value, n_wrows.literal_value
    sig = types.void(qtype, n_rows, n_wrows, w, r, xq, xd, xs, bsums, i, out)

    def codegen(context, builder, signature, args):
        _, _, _, w_t, r_t, xq_t, xd_t, xs_t, bs_t, i_t, out_t = signature.args
        _, _, _, w_v, r_v, xq_v, xd_v, xs_v, bs_v, i_v, out_v = args
        fn = _define(builder.module, qt, count, wcount)
        intp = context.get_value_type(types.intp)
        r_ = context.cast(builder, r_v, r_t, types.intp)
        i_ = context.cast(builder, i_v, i_t, types.intp)

        def at(ptr, stride, row, col_bytes=None):
            p = builder.gep(ptr, [builder.mul(row, stride)])
            return p if col_bytes is None else builder.gep(p, [col_bytes])

        wd, ws, _ = _array_parts(context, builder, w_t, w_v)
        qd, qs, k = _array_parts(context, builder, xq_t, xq_v)
        dd, ds, _ = _array_parts(context, builder, xd_t, xd_v)
        if qt in _K:
            sd_, ss, _ = _array_parts(context, builder, bs_t, bs_v)
        elif qt in (GGMLType.Q4_1, GGMLType.Q5_1):
            sd_, ss, _ = _array_parts(context, builder, xs_t, xs_v)
        else:
            sd_, ss = ir.Constant(I8.as_pointer(), None), ir.Constant(intp, 0)
        od, os_, _ = _array_parts(context, builder, out_t, out_v)
        nb = builder.udiv(k, ir.Constant(k.type, _block(int(qt))))
        col = builder.mul(r_, ir.Constant(intp, 4))  # float32 columns of out
        builder.call(
            fn,
            [
                at(wd, ws, r_),
                ws,
                at(qd, qs, i_),
                qs,
                at(dd, ds, i_),
                ds,
                at(sd_, ss, i_),
                ss,
                nb,
                at(od, os_, i_, col),
                os_,
            ],
        )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vec_dot_packed(typingctx, qtype, n_rows, w, r, xqp, xdp, xsp, xcp, t, out, i):
    """``vec_dot_packed(qtype, n_rows, w, r, xqp, xdp, xsp, xcp, t, out, i)``: for k in
    0..n_rows-1, ``out[i + k, r]`` = ggml's vec_dot of weight row ``r`` with row ``t + k``
    of activations of a 32-weight type packed block-major: ``xqp`` int8 (nb, c * 32), row
    u's quants of block b at ``xqp[b, 32 u : 32 u + 32]``; ``xdp`` float32 (nb, c) its
    scales, ``xsp`` float32 (nb, c) its Q8_1 sums (Q4_1, Q5_1; else unused), ``xcp`` int32
    (nb, c * 8) -128 times the sums of its quants four by four (Q4_0, Q5_0, Q8_0 where the
    CPU has VNNI, ``PACKED_OFFSET``; else unused). Adjacent rows
    then sit side by side, so two of them fill one 512-bit register (``_define``).
    ``qtype`` and ``n_rows`` are literals."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (qtype, n_rows)):
        return None
    qt = GGMLType(qtype.literal_value)
    if qt not in _LEGACY:
        return None
    count = n_rows.literal_value
    sig = types.void(qtype, n_rows, w, r, xqp, xdp, xsp, xcp, t, out, i)

    def codegen(context, builder, signature, args):
        _, _, w_t, r_t, xq_t, xd_t, xs_t, xc_t, t_t, out_t, i_t = signature.args
        _, _, w_v, r_v, xq_v, xd_v, xs_v, xc_v, t_v, out_v, i_v = args
        fn = _define_packed(builder.module, qt, count)
        intp = context.get_value_type(types.intp)
        r_ = context.cast(builder, r_v, r_t, types.intp)
        t_ = context.cast(builder, t_v, t_t, types.intp)
        i_ = context.cast(builder, i_v, i_t, types.intp)
        wd, ws, _ = _array_parts(context, builder, w_t, w_v)
        qd, qs, _ = _array_parts(context, builder, xq_t, xq_v)
        dd, ds, _ = _array_parts(context, builder, xd_t, xd_v)
        sd_, _, _ = _array_parts(context, builder, xs_t, xs_v)
        cd, cs, _ = _array_parts(context, builder, xc_t, xc_v)
        od, os_, _ = _array_parts(context, builder, out_t, out_v)
        ary = context.make_array(xq_t)(context, builder, xq_v)
        nb = cgutils.unpack_tuple(builder, ary.shape, 2)[0]
        t4 = builder.mul(t_, ir.Constant(intp, 4))
        with_sum = qt in (GGMLType.Q4_1, GGMLType.Q5_1)
        out_at = builder.add(builder.mul(i_, os_), builder.mul(r_, ir.Constant(intp, 4)))
        builder.call(
            fn,
            [
                builder.gep(wd, [builder.mul(r_, ws)]),
                builder.gep(qd, [builder.mul(t_, ir.Constant(intp, 32))]),
                qs,
                builder.gep(dd, [t4]),
                ds,
                builder.gep(sd_, [t4]) if with_sum else ir.Constant(I8.as_pointer(), None),
                builder.gep(cd, [builder.mul(t_, ir.Constant(intp, 32))]),
                cs,
                nb,
                builder.gep(od, [out_at]),
                os_,
            ],
        )
        return context.get_dummy_value()

    return sig, codegen
