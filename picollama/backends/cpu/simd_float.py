"""SIMD dot products of a few float weight rows (F32, F16 or BF16) with several rows of x.

``float_dot_rows(qtype, n_rows, n_wrows, w, r, xf, i, out, k, pf_off, pf_step)`` (a Numba
intrinsic, the first three literals) sets ``out[i + t, r + j]`` for t < n_rows and
j < n_wrows to the dot of the ``k`` weights of row ``r + j`` (``w``: the raw weight bytes,
uint8 (m, row_bytes)) with row ``i + t`` of ``xf`` (float32 (n, k), rows contiguous; for
F16 and BF16 weights already rounded to that type). Each weight chunk is loaded (and
widened) once for all the rows of x, each chunk of x once for all the weight rows: a tile
of products.

Every (weight row, row of x) pair's arithmetic is one fixed sequence, whatever the tile,
so a result is the same bits alone, in any batch and in any group of weight rows:

- one 8-lane float32 accumulator per pair; chunk c (8 weights) does
  ``acc = fma(w[8c : 8c+8], x[8c : 8c+8], acc)``, chunks in order;
- the ``k % 8`` weights past the last chunk form one more chunk, zero-padded (0 * 0 adds
  nothing, except that it may turn a -0 sum into +0);
- then the upper 4 lanes onto the lower, 2 onto 2, lane 0 + lane 1.

Eight lanes, not more, so that a tile's accumulators fit AVX2's 16 registers with room for
the weights: 3 weight rows x 4 rows of x take 7 loads for 12 FMAs, where one weight row
with 32-lane accumulators (3 rows of x in 12 registers) took 16. What made the batch fast,
though, is the prefetch below: with more rows of x than a pass takes, the later passes over
a tile read it from the cache and left memory idle (SmolLM2's matrices at F32, 2 cores,
AVX2, 9 rows of x: 45-54 ms before, 26-36 ms after, against 26-31 ms for one row).

The code is plain LLVM vector IR (``llvm.fma`` and vector loads), which LLVM lowers for
any target: AVX2 and AVX-512 run an 8-lane operation as one instruction, other CPUs as
whatever they have, each lane with the same rounding, so the bits are the same
everywhere. Its float operations carry a flag that keeps Numba's fast-math pass off them,
so a caller compiled with fast math cannot re-associate the sums. The one difference by
ISA is F16's widening: ``vcvtph2ps`` with F16C, else exact integer bit manipulation (same
values; a signalling NaN keeps its payload instead of being quieted).

The tile: ``FLOAT_GROUP`` rows of x by ``FLOAT_WROWS`` weight rows, as many accumulators
as the registers hold (AVX2's 16, AVX-512's 32). A decode step (one row of x) takes one
weight row at a time (``qdot``): a task's rows are then one sequential stream.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from picollama.backends.cpu.intrinsics import HAS_F16C
from picollama.backends.cpu.simd import HAS_AVX512BW, inline_function, prefetch
from picollama.gguf.constants import GGMLType

__all__ = ["FLOAT_TYPES", "FLOAT_GROUP", "FLOAT_WROWS", "float_dot_rows"]

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

# The tile, as many 8-lane accumulators as leave registers for a chunk of each weight row
# and one of x: 4 x 3 = 12 of AVX2's 16, 6 x 4 = 24 of AVX-512's 32. (The tile's shape
# changes no bits: every pair keeps its own accumulator.)
FLOAT_GROUP, FLOAT_WROWS = (6, 4) if HAS_AVX512BW else (4, 3)

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()
LANES = 8
V8 = ir.VectorType(F32, LANES)

# Numba's fast-math pass flags every float operation that has no flags; "arcp" (allow a
# reciprocal for a division) means nothing to an add, but its presence keeps the pass away.
_STRICT = ("arcp",)


def _vec(t, n):
    return ir.VectorType(t, n)


def _mask(indices):
    return ir.Constant(_vec(I32, len(indices)), [ir.Constant(I32, i) for i in indices])


def _splat_i32(n, value):
    return ir.Constant(_vec(I32, n), [ir.Constant(I32, value)] * n)


def _fma8(module):
    name = "llvm.fma.v8f32"
    try:
        return module.get_global(name)
    except KeyError:
        return ir.Function(module, ir.FunctionType(V8, [V8] * 3), name)


def _widen_f16(b: ir.IRBuilder, halves):
    """<8 x i16> IEEE half bits -> <8 x float>, exactly."""
    if HAS_F16C:
        return b.fpext(b.bitcast(halves, _vec(F16, LANES)), V8)
    # without F16C LLVM would call a runtime helper the JIT may not have: rebias instead
    # (exponent and mantissa moved into place, times 2**112; subnormal halves come out
    # exact, as float32 normals), then inf/NaN get the full exponent, then the sign
    h = b.zext(halves, _vec(I32, LANES))
    o = b.shl(b.and_(h, _splat_i32(LANES, 0x7FFF)), _splat_i32(LANES, 13))
    magic = b.bitcast(_splat_i32(LANES, (254 - 15) << 23), V8)
    f = b.fmul(b.bitcast(o, V8), magic, flags=_STRICT)
    infnan = b.fcmp_ordered(">=", f, b.bitcast(_splat_i32(LANES, (127 + 16) << 23), V8))
    o = b.bitcast(f, _vec(I32, LANES))
    o = b.select(infnan, b.or_(o, _splat_i32(LANES, 255 << 23)), o)
    o = b.or_(o, b.shl(b.and_(h, _splat_i32(LANES, 0x8000)), _splat_i32(LANES, 16)))
    return b.bitcast(o, V8)


def _widen_bf16(b: ir.IRBuilder, halves):
    """<8 x i16> bfloat16 bits -> <8 x float> (the upper half of the float32 bits)."""
    return b.bitcast(b.shl(b.zext(halves, _vec(I32, LANES)), _splat_i32(LANES, 16)), V8)


def _widen(b: ir.IRBuilder, qtype, halves):
    return _widen_f16(b, halves) if qtype == GGMLType.F16 else _widen_bf16(b, halves)


def _load_weights(b: ir.IRBuilder, qtype, wrow, e):
    """Weights e..e+7 of the row (an element index, i64) as <8 x float>."""
    if qtype == GGMLType.F32:
        p = b.gep(b.bitcast(wrow, F32.as_pointer()), [e])
        return b.load(b.bitcast(p, V8.as_pointer()), align=4)
    p = b.gep(b.bitcast(wrow, I16.as_pointer()), [e])
    return _widen(b, qtype, b.load(b.bitcast(p, _vec(I16, LANES).as_pointer()), align=2))


def _load_x(b: ir.IRBuilder, xrow, e):
    p = b.gep(xrow, [e])
    return b.load(b.bitcast(p, V8.as_pointer()), align=4)


def _hsum8(b: ir.IRBuilder, s):
    """The upper 4 lanes onto the lower, 2 onto 2, then lane 0 + lane 1."""
    for width in (4, 2):
        lo = b.shuffle_vector(s, s, _mask(range(width)))
        hi = b.shuffle_vector(s, s, _mask(range(width, 2 * width)))
        s = b.fadd(lo, hi, flags=_STRICT)
    e0 = b.extract_element(s, ir.Constant(I32, 0))
    e1 = b.extract_element(s, ir.Constant(I32, 1))
    return b.fadd(e0, e1, flags=_STRICT)


def _define(module: ir.Module, qtype: GGMLType, n_rows: int, n_wrows: int) -> ir.Function:
    """``f(w, w_stride, x, x_stride, k, out, out_stride, out_col, pf_off, pf_step)``: for
    t < n_rows and j < n_wrows, the float32 at ``out + t * out_stride + j * out_col``
    becomes the dot of the weight row at ``w + j * w_stride`` (k elements of the type)
    with the k float32 at
    ``x + t * x_stride`` (strides in bytes). A batch (``n_rows`` > 1) prefetches the lines
    at ``w + pf_off + c * pf_step`` as it takes chunk c (up to the tile's bytes a chunk)."""
    isa = "f16c" if HAS_F16C else "generic"
    name = f"picollama_float_dot8_{qtype.name.lower()}_{n_wrows}x{n_rows}_{isa}"
    p8 = I8.as_pointer()
    fn, new = inline_function(module, name, [p8, I64, p8, I64, I64, p8, I64, I64, I64, I64])
    if not new:
        return fn
    w, sw, x, sx, k, out, so, sc, pf_off, pf_step = fn.args
    entry = fn.append_basic_block("entry")
    loop = fn.append_basic_block("loop")
    after = fn.append_basic_block("after")
    tail = fn.append_basic_block("tail")
    tail_loop = fn.append_basic_block("tail_loop")
    tail_done = fn.append_basic_block("tail_done")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    fma = _fma8(module)
    wrows = [b.gep(w, [b.mul(ir.Constant(I64, j), sw)]) for j in range(n_wrows)]
    xrows = [
        b.bitcast(b.gep(x, [b.mul(ir.Constant(I64, t), sx)]), F32.as_pointer())
        for t in range(n_rows)
    ]
    pairs = [(j, t) for t in range(n_rows) for j in range(n_wrows)]
    zero = ir.Constant(V8, [ir.Constant(F32, 0.0)] * LANES)
    n_chunks = b.udiv(k, ir.Constant(I64, LANES))
    b.cbranch(b.icmp_unsigned(">", n_chunks, ir.Constant(I64, 0)), loop, after)

    # the chunks: each weight chunk loaded (and widened) once for every row of x, each
    # chunk of x once for every weight row
    b.position_at_end(loop)
    c = b.phi(I64)
    accs = [b.phi(V8) for _ in pairs]
    e = b.mul(c, ir.Constant(I64, LANES))
    ws = [_load_weights(b, qtype, wrows[j], e) for j in range(n_wrows)]
    if n_rows > 1:
        # a batch: the FMAs keep the core busy long enough that the hardware prefetcher
        # alone lets the loads wait on memory, and with more rows of x than a tile takes,
        # the second and later passes over a tile read it from the cache, leaving memory
        # idle. So every pass prefetches its share of the bytes that come next
        # (``pf_off``, ``pf_step`` bytes a chunk, relative to the tile's first row), and
        # memory streams during all of them.
        size = 4 if qtype == GGMLType.F32 else 2
        at = b.add(pf_off, b.mul(c, pf_step))
        prefetch(b, w, at, -(-n_wrows * LANES * size // 64) * 64)
    xs = [_load_x(b, xrows[t], e) for t in range(n_rows)]
    new = [b.call(fma, [ws[j], xs[t], acc]) for (j, t), acc in zip(pairs, accs, strict=True)]
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
        phi = b.phi(V8)
        phi.add_incoming(zero, entry)
        phi.add_incoming(v, loop)
        accs_after.append(phi)
    e_tail = b.mul(n_chunks, ir.Constant(I64, LANES))
    rem = b.sub(k, e_tail)
    b.cbranch(b.icmp_unsigned(">", rem, ir.Constant(I64, 0)), tail, done)

    # the k % 8 last weights: one more chunk, built lane by lane, zero past the end
    b.position_at_end(tail)
    b.branch(tail_loop)
    b.position_at_end(tail_loop)
    jj = b.phi(I64)
    lanes = [b.phi(V8) for _ in range(n_wrows + n_rows)]  # the weight rows, then x's
    ej = b.add(e_tail, jj)
    lane = b.trunc(jj, I32)
    filled = []
    for j in range(n_wrows):
        if qtype == GGMLType.F32:
            wj = b.load(b.gep(b.bitcast(wrows[j], F32.as_pointer()), [ej]))
        else:
            h = b.load(b.gep(b.bitcast(wrows[j], I16.as_pointer()), [ej]))
            hv = b.insert_element(ir.Constant(_vec(I16, LANES), None), h, ir.Constant(I32, 0))
            wj = b.extract_element(_widen(b, qtype, hv), ir.Constant(I32, 0))
        filled.append(b.insert_element(lanes[j], wj, lane))
    for t in range(n_rows):
        xj = b.load(b.gep(xrows[t], [ej]))
        filled.append(b.insert_element(lanes[n_wrows + t], xj, lane))
    j1 = b.add(jj, ir.Constant(I64, 1))
    jj.add_incoming(ir.Constant(I64, 0), tail)
    jj.add_incoming(j1, tail_loop)
    for phi, v in zip(lanes, filled, strict=True):
        phi.add_incoming(zero, tail)
        phi.add_incoming(v, tail_loop)
    b.cbranch(b.icmp_unsigned("<", j1, rem), tail_loop, tail_done)

    b.position_at_end(tail_done)
    accs_tail = [
        b.call(fma, [filled[j], filled[n_wrows + t], acc])
        for (j, t), acc in zip(pairs, accs_after, strict=True)
    ]
    b.branch(done)

    b.position_at_end(done)
    final = []
    for v_after, v_tail in zip(accs_after, accs_tail, strict=True):
        phi = b.phi(V8)
        phi.add_incoming(v_after, after)
        phi.add_incoming(v_tail, tail_done)
        final.append(phi)
    for (j, t), phi in zip(pairs, final, strict=True):
        dst = b.gep(out, [b.add(b.mul(ir.Constant(I64, t), so), b.mul(ir.Constant(I64, j), sc))])
        b.store(_hsum8(b, phi), b.bitcast(dst, F32.as_pointer()))
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
def float_dot_rows(typingctx, qtype, n_rows, n_wrows, w, r, xf, i, out, k, pf_off, pf_step):
    """``float_dot_rows(qtype, n_rows, n_wrows, w, r, xf, i, out, k, pf_off, pf_step)``:
    ``out[i + t, r + j]`` for t < n_rows, j < n_wrows (literals ``qtype``, ``n_rows``,
    ``n_wrows``) as the module docstring says; a batch prefetches the weight bytes at
    ``pf_off + c * pf_step`` from row ``r``'s start as it takes chunk c. ``w``: uint8
    (m, row_bytes), its rows contiguous; ``xf``: float32
    (n, k), C-contiguous; ``out``: float32 (n, m); the caller checks the indices."""
    literals = (qtype, n_rows, n_wrows)
    if not all(isinstance(v, types.IntegerLiteral) for v in literals):
        return None
    qt = _qtype(qtype.literal_value)
    if qt is None or not isinstance(xf, types.Array) or xf.layout != "C":
        return None
    count, wcount = n_rows.literal_value, n_wrows.literal_value
    sig = types.void(qtype, n_rows, n_wrows, w, r, xf, i, out, k, pf_off, pf_step)

    def codegen(context, builder, signature, args):
        w_t, r_t, xf_t, i_t, out_t, k_t, po_t, ps_t = signature.args[3:]
        w_v, r_v, xf_v, i_v, out_v, k_v, po_v, ps_v = args[3:]
        fn = _define(builder.module, qt, count, wcount)
        r_ = context.cast(builder, r_v, r_t, types.intp)
        i_ = context.cast(builder, i_v, i_t, types.intp)
        wd, ws, _, _ = _parts(context, builder, w_t, w_v)
        xd, xs, _, _ = _parts(context, builder, xf_t, xf_v)
        k_ = context.cast(builder, k_v, k_t, types.intp)
        od, os0, os1, _ = _parts(context, builder, out_t, out_v)
        wrow = builder.gep(wd, [builder.mul(r_, ws)])
        xrow = builder.gep(xd, [builder.mul(i_, xs)])
        dst = builder.gep(od, [builder.add(builder.mul(i_, os0), builder.mul(r_, os1))])
        po = context.cast(builder, po_v, po_t, types.intp)
        ps = context.cast(builder, ps_v, ps_t, types.intp)
        builder.call(fn, [wrow, ws, xrow, xs, k_, dst, os0, os1, po, ps])
        return context.get_dummy_value()

    return sig, codegen
