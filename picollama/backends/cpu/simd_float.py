"""SIMD dot products of one float weight row (F32, F16 or BF16) with several rows of x.

``float_dot_rows(qtype, n_rows, w, r, xf, i, out, k)`` (a Numba intrinsic, the first two
literals) sets ``out[i + t, r]`` for t in 0..n_rows-1 to the dot of the ``k`` weights of
row ``r`` (``w``: the raw weight bytes, uint8 (m, row_bytes)) with row ``i + t`` of ``xf``
(float32 (n, k), rows contiguous; for F16 and BF16 weights already rounded to that type). The
weights are loaded (and widened) once for all ``n_rows`` rows of x.

Every row's arithmetic is one fixed sequence, whatever ``n_rows`` is and whichever rows
share a call, so a row's result is the same bits alone or in any batch:

- two 16-lane float32 accumulators per row; chunk c (32 weights) does
  ``acc0 = fma(w[32c : 32c+16], x[...], acc0)`` and ``acc1`` likewise for the next 16;
- the ``k % 32`` weights past the last chunk form one more chunk, zero-padded (0 * 0 adds
  nothing, except that it may turn a -0 sum into +0);
- then ``acc0 + acc1``, the upper 8 lanes onto the lower, 4 onto 4, 2 onto 2, lane 0 + 1.

The code is plain LLVM vector IR (``llvm.fma`` and vector loads), which LLVM lowers for
any target: AVX-512 runs a 16-lane operation as one instruction, AVX2 as two, other CPUs
as whatever they have, each lane with the same rounding, so the bits are the same
everywhere. Its float operations carry a flag that keeps Numba's fast-math pass off them,
so a caller compiled with fast math cannot re-associate the sums. The one difference by
ISA is F16's widening: ``vcvtph2ps`` with F16C, else exact integer bit manipulation (same
values; a signalling NaN keeps its payload instead of being quieted).

How many rows a call should take: ``FLOAT_GROUP``, as many as keep their accumulators in
registers (8 rows x 2 zmm on AVX-512, 3 rows x 4 ymm on AVX2).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from picollama.backends.cpu.intrinsics import HAS_F16C
from picollama.backends.cpu.simd import HAS_AVX512BW, PREFETCH_AHEAD, inline_function, prefetch
from picollama.gguf.constants import GGMLType

__all__ = ["FLOAT_TYPES", "FLOAT_GROUP", "float_dot_rows"]

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

# Rows of x a call takes at most: each row holds 32 float32 accumulator lanes in registers
# (2 of AVX-512's 32 zmm, 4 of AVX2's 16 ymm), with room left for the weights.
FLOAT_GROUP = 8 if HAS_AVX512BW else 3

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()
V16 = ir.VectorType(F32, 16)
CHUNK = 32  # weights per loop iteration: two 16-lane halves

# Numba's fast-math pass flags every float operation that has no flags; "arcp" (allow a
# reciprocal for a division) means nothing to an add, but its presence keeps the pass away.
_STRICT = ("arcp",)


def _vec(t, n):
    return ir.VectorType(t, n)


def _mask(indices):
    return ir.Constant(_vec(I32, len(indices)), [ir.Constant(I32, i) for i in indices])


def _splat_i32(n, value):
    return ir.Constant(_vec(I32, n), [ir.Constant(I32, value)] * n)


def _fma16(module):
    name = "llvm.fma.v16f32"
    try:
        return module.get_global(name)
    except KeyError:
        return ir.Function(module, ir.FunctionType(V16, [V16] * 3), name)


def _widen_f16(b: ir.IRBuilder, halves):
    """<16 x i16> IEEE half bits -> <16 x float>, exactly."""
    if HAS_F16C:
        return b.fpext(b.bitcast(halves, _vec(F16, 16)), V16)
    # without F16C LLVM would call a runtime helper the JIT may not have: rebias instead
    # (exponent and mantissa moved into place, times 2**112; subnormal halves come out
    # exact, as float32 normals), then inf/NaN get the full exponent, then the sign
    h = b.zext(halves, _vec(I32, 16))
    o = b.shl(b.and_(h, _splat_i32(16, 0x7FFF)), _splat_i32(16, 13))
    magic = b.bitcast(_splat_i32(16, (254 - 15) << 23), V16)
    f = b.fmul(b.bitcast(o, V16), magic, flags=_STRICT)
    infnan = b.fcmp_ordered(">=", f, b.bitcast(_splat_i32(16, (127 + 16) << 23), V16))
    o = b.bitcast(f, _vec(I32, 16))
    o = b.select(infnan, b.or_(o, _splat_i32(16, 255 << 23)), o)
    o = b.or_(o, b.shl(b.and_(h, _splat_i32(16, 0x8000)), _splat_i32(16, 16)))
    return b.bitcast(o, V16)


def _widen_bf16(b: ir.IRBuilder, halves):
    """<16 x i16> bfloat16 bits -> <16 x float> (the upper half of the float32 bits)."""
    return b.bitcast(b.shl(b.zext(halves, _vec(I32, 16)), _splat_i32(16, 16)), V16)


def _load_weights(b: ir.IRBuilder, qtype, wrow, e):
    """Weights e..e+15 of the row (an element index, i64) as <16 x float>."""
    if qtype == GGMLType.F32:
        p = b.gep(b.bitcast(wrow, F32.as_pointer()), [e])
        return b.load(b.bitcast(p, V16.as_pointer()), align=4)
    p = b.gep(b.bitcast(wrow, I16.as_pointer()), [e])
    halves = b.load(b.bitcast(p, _vec(I16, 16).as_pointer()), align=2)
    return _widen_f16(b, halves) if qtype == GGMLType.F16 else _widen_bf16(b, halves)


def _load_x(b: ir.IRBuilder, xrow, e):
    p = b.gep(xrow, [e])
    return b.load(b.bitcast(p, V16.as_pointer()), align=4)


def _hsum16(b: ir.IRBuilder, acc0, acc1):
    """acc0 + acc1, then halves folded onto halves down to one lane."""
    s = b.fadd(acc0, acc1, flags=_STRICT)
    for width in (8, 4, 2):
        lo = b.shuffle_vector(s, s, _mask(range(width)))
        hi = b.shuffle_vector(s, s, _mask(range(width, 2 * width)))
        s = b.fadd(lo, hi, flags=_STRICT)
    e0 = b.extract_element(s, ir.Constant(I32, 0))
    e1 = b.extract_element(s, ir.Constant(I32, 1))
    return b.fadd(e0, e1, flags=_STRICT)


def _define(module: ir.Module, qtype: GGMLType, n_rows: int) -> ir.Function:
    """``f(w, x, x_stride, k, out, out_stride)``: for t < n_rows, the float32 at
    ``out + t * out_stride`` becomes the dot of the weight row at ``w`` (k elements of the
    type) with the k float32 at ``x + t * x_stride`` (strides in bytes)."""
    isa = "f16c" if HAS_F16C else "generic"
    name = f"picollama_float_dot_{qtype.name.lower()}_{n_rows}_{isa}"
    p8 = I8.as_pointer()
    fn, new = inline_function(module, name, [p8, p8, I64, I64, p8, I64])
    if not new:
        return fn
    w, x, sx, k, out, so = fn.args
    entry = fn.append_basic_block("entry")
    loop = fn.append_basic_block("loop")
    after = fn.append_basic_block("after")
    tail = fn.append_basic_block("tail")
    tail_loop = fn.append_basic_block("tail_loop")
    tail_done = fn.append_basic_block("tail_done")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    fma = _fma16(module)
    xrows = [
        b.bitcast(b.gep(x, [b.mul(ir.Constant(I64, t), sx)]), F32.as_pointer())
        for t in range(n_rows)
    ]
    zero = ir.Constant(V16, [ir.Constant(F32, 0.0)] * 16)
    n_chunks = b.udiv(k, ir.Constant(I64, CHUNK))
    b.cbranch(b.icmp_unsigned(">", n_chunks, ir.Constant(I64, 0)), loop, after)

    # the chunks: the weights loaded (and widened) once, an FMA per row and half
    b.position_at_end(loop)
    c = b.phi(I64)
    accs = [b.phi(V16) for _ in range(2 * n_rows)]
    e = b.mul(c, ir.Constant(I64, CHUNK))
    e16 = b.add(e, ir.Constant(I64, 16))
    w0 = _load_weights(b, qtype, w, e)
    w1 = _load_weights(b, qtype, w, e16)
    if n_rows > 1:
        # weights PREFETCH_AHEAD bytes on (the rows of a matrix lie end to end): a batch's
        # FMAs keep the core busy long enough that the hardware prefetcher alone lets the
        # loads wait on memory (8 rows, 226 MB of F32: 18.5 ms without, 12.1 ms with)
        size = 4 if qtype == GGMLType.F32 else 2
        at = b.add(b.mul(e, ir.Constant(I64, size)), ir.Constant(I64, PREFETCH_AHEAD))
        prefetch(b, w, at, CHUNK * size)
    new = []
    for t in range(n_rows):
        new.append(b.call(fma, [w0, _load_x(b, xrows[t], e), accs[2 * t]]))
        new.append(b.call(fma, [w1, _load_x(b, xrows[t], e16), accs[2 * t + 1]]))
    c1 = b.add(c, ir.Constant(I64, 1))
    c.add_incoming(ir.Constant(I64, 0), entry)
    c.add_incoming(c1, loop)
    for phi, v in zip(accs, new, strict=True):
        phi.add_incoming(zero, entry)
        phi.add_incoming(v, loop)
    b.cbranch(b.icmp_unsigned("<", c1, n_chunks), loop, after)

    b.position_at_end(after)
    accs_after = []
    for v in new:
        phi = b.phi(V16)
        phi.add_incoming(zero, entry)
        phi.add_incoming(v, loop)
        accs_after.append(phi)
    e_tail = b.mul(n_chunks, ir.Constant(I64, CHUNK))
    rem = b.sub(k, e_tail)
    b.cbranch(b.icmp_unsigned(">", rem, ir.Constant(I64, 0)), tail, done)

    # the k % 32 last weights: one more chunk, built lane by lane, zero past the end
    v32 = _vec(F32, 32)
    zero32 = ir.Constant(v32, [ir.Constant(F32, 0.0)] * 32)
    b.position_at_end(tail)
    b.branch(tail_loop)
    b.position_at_end(tail_loop)
    j = b.phi(I64)
    lanes = [b.phi(v32) for _ in range(n_rows + 1)]  # the weights, then each row of x
    ej = b.add(e_tail, j)
    if qtype == GGMLType.F32:
        wj = b.load(b.gep(b.bitcast(w, F32.as_pointer()), [ej]))
    else:
        h = b.load(b.gep(b.bitcast(w, I16.as_pointer()), [ej]))
        hv = b.insert_element(ir.Constant(_vec(I16, 16), None), h, ir.Constant(I32, 0))
        widen = _widen_f16 if qtype == GGMLType.F16 else _widen_bf16
        wj = b.extract_element(widen(b, hv), ir.Constant(I32, 0))
    lane = b.trunc(j, I32)
    filled = [b.insert_element(lanes[0], wj, lane)]
    for t in range(n_rows):
        filled.append(b.insert_element(lanes[t + 1], b.load(b.gep(xrows[t], [ej])), lane))
    j1 = b.add(j, ir.Constant(I64, 1))
    j.add_incoming(ir.Constant(I64, 0), tail)
    j.add_incoming(j1, tail_loop)
    for phi, v in zip(lanes, filled, strict=True):
        phi.add_incoming(zero32, tail)
        phi.add_incoming(v, tail_loop)
    b.cbranch(b.icmp_unsigned("<", j1, rem), tail_loop, tail_done)

    b.position_at_end(tail_done)

    def halves(v):
        return (
            b.shuffle_vector(v, v, _mask(range(16))),
            b.shuffle_vector(v, v, _mask(range(16, 32))),
        )

    tw0, tw1 = halves(filled[0])
    accs_tail = []
    for t in range(n_rows):
        tx0, tx1 = halves(filled[t + 1])
        accs_tail.append(b.call(fma, [tw0, tx0, accs_after[2 * t]]))
        accs_tail.append(b.call(fma, [tw1, tx1, accs_after[2 * t + 1]]))
    b.branch(done)

    b.position_at_end(done)
    final = []
    for v_after, v_tail in zip(accs_after, accs_tail, strict=True):
        phi = b.phi(V16)
        phi.add_incoming(v_after, after)
        phi.add_incoming(v_tail, tail_done)
        final.append(phi)
    for t in range(n_rows):
        total = _hsum16(b, final[2 * t], final[2 * t + 1])
        dst = b.gep(out, [b.mul(ir.Constant(I64, t), so)])
        b.store(total, b.bitcast(dst, F32.as_pointer()))
    b.ret_void()
    return fn


def _parts(context, builder, arrty, arr):
    """(data as i8*, stride of axis 0 in bytes, stride of axis 1, length of axis 1)."""
    ary = context.make_array(arrty)(context, builder, arr)
    s0, s1 = cgutils.unpack_tuple(builder, ary.strides, 2)
    n1 = cgutils.unpack_tuple(builder, ary.shape, 2)[1]
    return builder.bitcast(ary.data, I8.as_pointer()), s0, s1, n1


@functools.cache
def _qtype(value: int) -> GGMLType | None:
    try:
        qt = GGMLType(value)
    except ValueError:
        return None
    return qt if qt in FLOAT_TYPES else None


@intrinsic
def float_dot_rows(typingctx, qtype, n_rows, w, r, xf, i, out, k):
    """``float_dot_rows(qtype, n_rows, w, r, xf, i, out, k)``: ``out[i + t, r]`` for t in
    0..n_rows-1 (literals ``qtype``, ``n_rows``) as the module docstring says. ``w``: uint8
    (m, row_bytes), its rows contiguous; ``xf``: float32 (n, k), C-contiguous; the caller
    checks the indices."""
    if not (isinstance(qtype, types.IntegerLiteral) and isinstance(n_rows, types.IntegerLiteral)):
        return None
    qt = _qtype(qtype.literal_value)
    if qt is None or not isinstance(xf, types.Array) or xf.layout != "C":
        return None
    count = n_rows.literal_value
    sig = types.void(qtype, n_rows, w, r, xf, i, out, k)

    def codegen(context, builder, signature, args):
        _, _, w_t, r_t, xf_t, i_t, out_t, k_t = signature.args
        _, _, w_v, r_v, xf_v, i_v, out_v, k_v = args
        fn = _define(builder.module, qt, count)
        r_ = context.cast(builder, r_v, r_t, types.intp)
        i_ = context.cast(builder, i_v, i_t, types.intp)
        wd, ws, _, _ = _parts(context, builder, w_t, w_v)
        xd, xs, _, _ = _parts(context, builder, xf_t, xf_v)
        k_ = context.cast(builder, k_v, k_t, types.intp)
        od, os0, os1, _ = _parts(context, builder, out_t, out_v)
        wrow = builder.gep(wd, [builder.mul(r_, ws)])
        xrow = builder.gep(xd, [builder.mul(i_, xs)])
        dst = builder.gep(od, [builder.add(builder.mul(i_, os0), builder.mul(r_, os1))])
        builder.call(fn, [wrow, xrow, xs, k_, dst, os0])
        return context.get_dummy_value()

    return sig, codegen
