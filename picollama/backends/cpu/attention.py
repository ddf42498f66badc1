"""Causal GQA attention over the KV cache, with ggml's flash-attention arithmetic.

llama.cpp's CPU backend computes attention in ``ggml_compute_forward_flash_attn_ext_f16``
(ggml-cpu ops.cpp), which takes one of two paths by the number of query rows in a batch:

- at least ``FA_TILE_Q`` (64) rows, "tiled": Q stays float32; keys are taken in tiles of
  ``FA_TILE_KV`` (64), widened from the F16 cache; a score is a float32 FMA chain over the
  head dimension in order (``simd_gemm``), times the scale; per tile, the running maximum
  rescales the sums, ``ggml_v_expf`` gives the weights, their sum is added per 8 lanes
  (``ggml_vec_soft_max_f32``), and the value sum is an FMA chain over the tile's keys;
- fewer rows (decode), "one chunk": Q is rounded to F16; a score is ``ggml_vec_dot_f16``
  (32 float32 lanes of FMAs, reduced in its fixed order); an online softmax over the keys
  in order, with the weighted sum of V kept in F16, rounded after every key.

Both are reproduced here operation for operation, so our attention output equals
llama.cpp's bit for bit (its one difference: a decode step over 512 or more cached keys,
which ggml splits between threads and merges; we do not split). A float32 cache (the
"exact" arithmetic) takes the tiled path whatever the batch.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from picollama.backends.cpu.ggml_math import expf, hsum8_f32, v_expf
from picollama.backends.cpu.intrinsics import HAS_F16C, fma_f32, half_to_f32, round_f16

__all__ = ["attention", "FA_TILE_Q", "FA_TILE_KV", "F16_TABLE"]

FA_TILE_Q = 64
FA_TILE_KV = 64

# the float32 value of every IEEE half bit pattern (for CPUs without F16C)
F16_TABLE = (
    np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)

_F = np.float32
_NEG_INF = _F(-np.inf)


def kv(cache, j, h, d):
    """``cache[j, h, d]`` as float32: F16 bits (uint16) widened, or float32 as it is."""
    raise NotImplementedError("kv is only callable from Numba-compiled code")


@overload(kv, inline="always")
def _kv_overload(cache, j, h, d):
    if cache.dtype == types.uint16:

        def impl(cache, j, h, d):
            return half_to_f32(cache[j, h, d], F16_TABLE)

    else:

        def impl(cache, j, h, d):
            return cache[j, h, d]

    return impl


def kv1(row, d):
    """``row[d]`` of one cache row (k_cache[j, h]) as float32 (see ``kv``)."""
    raise NotImplementedError("kv1 is only callable from Numba-compiled code")


@overload(kv1, inline="always")
def _kv1_overload(row, d):
    if row.dtype == types.uint16:

        def impl(row, d):
            return half_to_f32(row[d], F16_TABLE)

    else:

        def impl(row, d):
            return row[d]

    return impl


# -- ggml_vec_dot_f16 and ggml_vec_mad_f16 as LLVM vector code (CPUs with F16C) -------------

_F32, _F16, _I64 = ir.FloatType(), ir.HalfType(), ir.IntType(64)


def _vec(t, n):
    return ir.VectorType(t, n)


def _lanes(builder, v, idx):
    return builder.shuffle_vector(v, v, ir.Constant(_vec(ir.IntType(32), len(idx)), list(idx)))


def _fma_decl(builder, n):
    """llvm.fma of <n x float> in the builder's module."""
    vt = _vec(_F32, n)
    name = f"llvm.fma.v{n}f32"
    try:
        return builder.module.get_global(name)
    except KeyError:
        return ir.Function(builder.module, ir.FunctionType(vt, [vt] * 3), name)


def _data(context, builder, arrty, arr):
    return context.make_array(arrty)(context, builder, arr).data


@intrinsic
def _dot_f16_32(typingctx, krow, qh, n32):
    """ggml_vec_dot_f16's AVX2 body over ``n32`` (a multiple of 32) elements: 4 x 8 float32
    lanes of FMAs of the widened F16 ``krow`` with ``qh``, then its reduction order, as
    one float32. ``krow``: uint16 (F16 bits) 1-D contiguous; ``qh``: float32."""
    if krow.dtype != types.uint16 or qh.dtype != types.float32:
        return None

    def codegen(context, builder, signature, args):
        krow_t, qh_t, _ = signature.args
        k_ptr = builder.bitcast(_data(context, builder, krow_t, args[0]), _F16.as_pointer())
        q_ptr = builder.bitcast(_data(context, builder, qh_t, args[1]), _F32.as_pointer())
        n = args[2]
        v32 = _vec(_F32, 32)
        fma = _fma_decl(builder, 32)
        entry = builder.block
        loop = builder.append_basic_block("dot16.loop")
        done = builder.append_basic_block("dot16.done")
        zero = ir.Constant(v32, [ir.Constant(_F32, 0.0)] * 32)
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        acc = builder.phi(v32)
        kp = builder.bitcast(builder.gep(k_ptr, [i]), _vec(_F16, 32).as_pointer())
        qp = builder.bitcast(builder.gep(q_ptr, [i]), v32.as_pointer())
        k = builder.fpext(builder.load(kp, align=2), v32)
        acc1 = builder.call(fma, [k, builder.load(qp, align=4), acc])
        i1 = builder.add(i, ir.Constant(_I64, 32))
        i.add_incoming(ir.Constant(_I64, 0), entry)
        i.add_incoming(i1, loop)
        acc.add_incoming(zero, entry)
        acc.add_incoming(acc1, loop)
        builder.cbranch(builder.icmp_signed("<", i1, n), loop, done)
        builder.position_at_end(done)
        total = builder.phi(v32)
        total.add_incoming(zero, entry)
        total.add_incoming(acc1, loop)
        # lane l < 8: (sum0 + sum2) + (sum1 + sum3), sum_s = lanes 8s .. 8s + 7
        a = builder.fadd(_lanes(builder, total, range(0, 8)), _lanes(builder, total, range(16, 24)))
        b = builder.fadd(
            _lanes(builder, total, range(8, 16)), _lanes(builder, total, range(24, 32))
        )
        r = builder.fadd(a, b)
        t = builder.fadd(_lanes(builder, r, range(0, 4)), _lanes(builder, r, range(4, 8)))
        e = [builder.extract_element(t, ir.Constant(ir.IntType(32), c)) for c in range(4)]
        return builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))

    return types.float32(krow, qh, n32), codegen


@intrinsic
def _value_sum_f16(typingctx, acc, v_cache, lo, kvh, n, ms, vs, d0, width):
    """ggml's value sum over ``n`` keys from ``lo`` for lanes ``d0 .. d0 + width`` (a
    literal: 64 or 16) of KV head ``kvh``, the lanes held in registers from the first key
    to the last: per key i, ``acc = f16(acc * ms[i])`` where ``ms[i] != 1`` (a new
    maximum: ``one_chunk``'s rescale; times 1 would leave an F16 value as it is), then
    ``acc = f16(fma(f32(v[lo + i]), vs[i], acc))`` (ggml_vec_mad_f16). ``acc``: float32 (F16
    values), updated in place; ``v_cache``: uint16 (n_ctx, n_kv_heads, dv)."""
    if not isinstance(width, types.IntegerLiteral) or v_cache.dtype != types.uint16:
        return None
    w = width.literal_value

    def codegen(context, builder, signature, args):
        acc_t, v_t = signature.args[:2]
        acc_v, v_v, lo_v, kvh_v, n_v, ms_v, vs_v, d0_v, _ = args
        i64 = _I64
        vt = _vec(_F32, w)
        ht = _vec(_F16, w)
        fma = _fma_decl(builder, w)
        cast = [
            context.cast(builder, a, t, types.intp)
            for a, t in zip(
                (lo_v, kvh_v, n_v, d0_v),
                (signature.args[2], signature.args[3], signature.args[4], signature.args[7]),
                strict=True,
            )
        ]
        lo_, kvh_, n_, d0_ = cast
        va = context.make_array(v_t)(context, builder, v_v)
        s0, s1, _ = cgutils.unpack_tuple(builder, va.strides, 3)
        vbase = builder.bitcast(va.data, ir.IntType(8).as_pointer())
        off = builder.add(builder.mul(lo_, s0), builder.mul(kvh_, s1))
        vbase = builder.gep(vbase, [builder.add(off, builder.mul(d0_, ir.Constant(i64, 2)))])
        a_ptr = builder.bitcast(_data(context, builder, acc_t, acc_v), _F32.as_pointer())
        a_ptr = builder.bitcast(builder.gep(a_ptr, [d0_]), vt.as_pointer())
        ms_p = builder.bitcast(_data(context, builder, signature.args[5], ms_v), _F32.as_pointer())
        vs_p = builder.bitcast(_data(context, builder, signature.args[6], vs_v), _F32.as_pointer())

        def splat(x):
            one = builder.insert_element(ir.Constant(vt, None), x, ir.Constant(ir.IntType(32), 0))
            return _lanes(builder, one, [0] * w)

        def to_f16(x):
            return builder.fpext(builder.fptrunc(x, ht), vt)

        a0 = builder.load(a_ptr, align=4)
        entry = builder.block
        loop = builder.append_basic_block("vsum.loop")
        rescale = builder.append_basic_block("vsum.rescale")
        body = builder.append_basic_block("vsum.body")
        done = builder.append_basic_block("vsum.done")
        builder.cbranch(builder.icmp_signed(">", n_, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        a = builder.phi(vt)
        m = builder.load(builder.gep(ms_p, [i]))
        builder.cbranch(builder.fcmp_unordered("!=", m, ir.Constant(_F32, 1.0)), rescale, body)
        builder.position_at_end(rescale)
        a_s = to_f16(builder.fmul(a, splat(m), flags=("arcp",)))
        builder.branch(body)
        builder.position_at_end(body)
        a_in = builder.phi(vt)
        a_in.add_incoming(a, loop)
        a_in.add_incoming(a_s, rescale)
        vp = builder.bitcast(builder.gep(vbase, [builder.mul(i, s0)]), ht.as_pointer())
        v = builder.fpext(builder.load(vp, align=2), vt)
        a1 = to_f16(builder.call(fma, [v, splat(builder.load(builder.gep(vs_p, [i]))), a_in]))
        i1 = builder.add(i, ir.Constant(i64, 1))
        i.add_incoming(ir.Constant(i64, 0), entry)
        i.add_incoming(i1, body)
        a.add_incoming(a0, entry)
        a.add_incoming(a1, body)
        builder.cbranch(builder.icmp_signed("<", i1, n_), loop, done)
        builder.position_at_end(done)
        final = builder.phi(vt)
        final.add_incoming(a0, entry)
        final.add_incoming(a1, body)
        builder.store(final, a_ptr, align=4)
        return context.get_dummy_value()

    sig = types.void(acc, v_cache, lo, kvh, n, ms, vs, d0, width)
    return sig, codegen


@intrinsic
def _tile_scores(typingctx, kt, qrow, n, kq):
    """The tiled path's scores of one query row: ``kq[l] = sum(kt[d, l] * qrow[d])`` for the
    ``FA_TILE_KV`` lanes l, each lane one float32 FMA chain over d = 0 .. n - 1 in order from
    0 (the loop it replaces, with the 64 sums held in registers instead of memory). ``kt``:
    float32 (n, FA_TILE_KV) C-contiguous; ``qrow``, ``kq``: float32, contiguous."""
    f32 = types.float32
    if not (
        isinstance(kt, types.Array)
        and kt.dtype == f32
        and kt.ndim == 2
        and kt.layout == "C"
        and qrow.dtype == f32
        and kq.dtype == f32
    ):
        return None
    w = FA_TILE_KV

    def codegen(context, builder, signature, args):
        kt_t, q_t, n_t, kq_t = signature.args
        vt = _vec(_F32, w)
        kt_p = builder.bitcast(_data(context, builder, kt_t, args[0]), vt.as_pointer())
        q_p = builder.bitcast(_data(context, builder, q_t, args[1]), _F32.as_pointer())
        kq_p = builder.bitcast(_data(context, builder, kq_t, args[3]), vt.as_pointer())
        n = context.cast(builder, args[2], n_t, types.intp)
        fma = _fma_decl(builder, w)
        zero = ir.Constant(vt, [ir.Constant(_F32, 0.0)] * w)
        entry = builder.block
        loop = builder.append_basic_block("scores.loop")
        done = builder.append_basic_block("scores.done")
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        acc = builder.phi(vt)
        qd = builder.load(builder.gep(q_p, [i]))
        one = builder.insert_element(ir.Constant(vt, None), qd, ir.Constant(ir.IntType(32), 0))
        krow = builder.load(builder.gep(kt_p, [i]), align=4)
        acc1 = builder.call(fma, [krow, _lanes(builder, one, [0] * w), acc])
        i1 = builder.add(i, ir.Constant(_I64, 1))
        i.add_incoming(ir.Constant(_I64, 0), entry)
        i.add_incoming(i1, loop)
        acc.add_incoming(zero, entry)
        acc.add_incoming(acc1, loop)
        builder.cbranch(builder.icmp_signed("<", i1, n), loop, done)
        builder.position_at_end(done)
        final = builder.phi(vt)
        final.add_incoming(zero, entry)
        final.add_incoming(acc1, loop)
        builder.store(final, kq_p, align=4)
        return context.get_dummy_value()

    return types.void(kt, qrow, n, kq), codegen


@intrinsic
def _tile_values(typingctx, vt, p, acc, d0, width):
    """The tiled path's value sum of one query row over a tile, lanes ``d0 .. d0 + width``
    (a literal): ``acc[d] = fma(vt[tk, d], p[tk], acc[d])`` for tk = 0 .. FA_TILE_KV - 1 in
    order, the lanes in registers throughout. ``vt``: float32 (FA_TILE_KV, dv) C-contiguous;
    ``p`` (FA_TILE_KV,), ``acc`` (dv,): float32, contiguous."""
    f32 = types.float32
    if not (
        isinstance(width, types.IntegerLiteral)
        and isinstance(vt, types.Array)
        and vt.dtype == f32
        and vt.ndim == 2
        and vt.layout == "C"
        and p.dtype == f32
        and acc.dtype == f32
    ):
        return None
    w = width.literal_value

    def codegen(context, builder, signature, args):
        vt_t, p_t, acc_t, d0_t, _ = signature.args
        vty = _vec(_F32, w)
        va = context.make_array(vt_t)(context, builder, args[0])
        dv = cgutils.unpack_tuple(builder, va.shape, 2)[1]
        d0 = context.cast(builder, args[3], d0_t, types.intp)
        v_p = builder.gep(builder.bitcast(va.data, _F32.as_pointer()), [d0])
        p_p = builder.bitcast(_data(context, builder, p_t, args[1]), _F32.as_pointer())
        a_p = builder.gep(
            builder.bitcast(_data(context, builder, acc_t, args[2]), _F32.as_pointer()), [d0]
        )
        a_p = builder.bitcast(a_p, vty.as_pointer())
        fma = _fma_decl(builder, w)
        a = builder.load(a_p, align=4)
        for tk in range(FA_TILE_KV):  # unrolled: a tile is always FA_TILE_KV keys
            row = builder.gep(v_p, [builder.mul(ir.Constant(_I64, tk), dv)])
            v = builder.load(builder.bitcast(row, vty.as_pointer()), align=4)
            pk = builder.load(builder.gep(p_p, [ir.Constant(_I64, tk)]))
            one = builder.insert_element(ir.Constant(vty, None), pk, ir.Constant(ir.IntType(32), 0))
            a = builder.call(fma, [v, _lanes(builder, one, [0] * w), a])
        builder.store(a, a_p, align=4)
        return context.get_dummy_value()

    return types.void(vt, p, acc, d0, width), codegen


def value_sum(acc, v_cache, lo, kvh, ms, vs):
    """``acc`` (F16 values as float32, zeros) becomes ggml's value sum over the keys
    ``lo .. lo + len(vs)`` of KV head ``kvh`` with the factors of ``one_chunk``'s online
    softmax: per key, the rescale by ``ms`` where it is not 1, then ggml_vec_mad_f16 by ``vs``."""
    raise NotImplementedError("value_sum is only callable from Numba-compiled code")


@overload(value_sum, inline="always")
def _value_sum_overload(acc, v_cache, lo, kvh, ms, vs):
    vector = HAS_F16C and v_cache.dtype == types.uint16

    def impl(acc, v_cache, lo, kvh, ms, vs):
        n = vs.shape[0]
        dv = acc.shape[0]
        d = 0
        if vector:
            # 64 lanes (8 registers) at a time, then 16: each lane its own chain, so
            # the blocks may run one after another, every key for each
            while d + 64 <= dv:
                _value_sum_f16(acc, v_cache, lo, kvh, n, ms, vs, d, 64)
                d += 64
            while d + 16 <= dv:
                _value_sum_f16(acc, v_cache, lo, kvh, n, ms, vs, d, 16)
                d += 16
        if d < dv:
            tail = acc[d:]
            for i in range(n):
                if ms[i] != 1:
                    for e in range(tail.shape[0]):
                        tail[e] = round_f16(tail[e] * ms[i])
                vrow = v_cache[lo + i, kvh]
                for e in range(tail.shape[0]):
                    tail[e] = round_f16(fma_f32(kv1(vrow, d + e), vs[i], tail[e]))

    return impl


def dot_f16_32(krow, qh, n32):
    """``_dot_f16_32`` where the CPU has F16C, else the same sums lane by lane."""
    raise NotImplementedError("dot_f16_32 is only callable from Numba-compiled code")


@overload(dot_f16_32, inline="always")
def _dot_f16_32_overload(krow, qh, n32):
    if HAS_F16C and krow.dtype == types.uint16:

        def impl(krow, qh, n32):
            return _dot_f16_32(krow, qh, n32)

    else:

        def impl(krow, qh, n32):
            lanes = np.zeros(32, _F)
            for i in range(0, n32, 32):
                for ln in range(32):
                    lanes[ln] = fma_f32(kv1(krow, i + ln), qh[i + ln], lanes[ln])
            for ln in range(8):
                lanes[ln] = (lanes[ln] + lanes[ln + 16]) + (lanes[ln + 8] + lanes[ln + 24])
            t0 = lanes[0] + lanes[4]
            t1 = lanes[1] + lanes[5]
            t2 = lanes[2] + lanes[6]
            t3 = lanes[3] + lanes[7]
            return (t0 + t1) + (t2 + t3)

    return impl


# Module-level functions, not closures: Numba's disk cache finds them again in the next
# process (a closure over other compiled functions was compiled anew at every start). The
# cache's dtype is part of each signature, so each dtype gets its own compiled code.


@nb.njit(nogil=True, cache=True, fastmath=False)
def one_chunk(q, k_cache, v_cache, start, scale, window, softcap, out, t, h, group):
    """One query row against its keys: ggml's ..._f16_one_chunk, in three passes.

    ggml walks the keys once: score, online-softmax update (``expf``), value sum. Here the
    scores come first (vector code only), then the softmax's factors in key order (scalar
    code and the ``expf`` calls), then the value sum with its lanes held in registers
    (``value_sum``): the same operations on every value in the same order, so the same
    bits, without a library call inside the vector loop (a call spills every vector
    register the value sum keeps)."""
    head_dim = q.shape[2]
    dv = v_cache.shape[2]
    kvh = h // group
    pos = start + t
    lo = max(0, pos - window + 1) if window > 0 else 0
    hi = pos + 1
    n = max(hi - lo, 0)
    qh = np.empty(head_dim, _F)
    for d in range(head_dim):
        qh[d] = round_f16(q[t, h, d])
    n32 = head_dim - head_dim % 32
    scores = np.empty(n, _F)
    for i in range(n):
        krow = k_cache[lo + i, kvh]  # (head_dim,): one key, contiguous
        # ggml_vec_dot_f16: 4 x 8 lanes of FMAs, its REDUCE order, then the tail in double
        sd = np.float64(dot_f16_32(krow, qh, n32))
        for e in range(n32, head_dim):
            sd += np.float64(kv1(krow, e) * qh[e])
        scores[i] = _F(sd) * scale
    ms_all = np.empty(n, _F)
    vs_all = np.empty(n, _F)
    big_m = _NEG_INF
    total = _F(0.0)
    for i in range(n):
        s = scores[i]
        if softcap > 0:
            s = softcap * math.tanh(s)  # tanhf
        ms = _F(1.0)
        vs = _F(1.0)
        if s > big_m:
            ms = expf(big_m - s)  # the sum so far rescaled, then this key's V added once
            big_m = s
        else:
            vs = expf(s - big_m)
        ms_all[i] = ms
        vs_all[i] = vs
        total = fma_f32(total, ms, vs)  # S = S*ms + vs, contracted by the compiler
    acc = np.zeros(dv, _F)  # VKQ16: F16 values held in float32
    value_sum(acc, v_cache, lo, kvh, ms_all, vs_all)
    inv = _F(1.0) / total if total != 0 else _F(0.0)
    for d in range(dv):
        out[t, h * dv + d] = acc[d] * inv


@nb.njit(nogil=True, cache=True, fastmath=False)
def tiled(q, k_cache, v_cache, start, scale, window, softcap, out, t0, t1, kvh, group):
    """Query rows t0..t1 of the heads of KV head ``kvh``: ggml's ..._tiled."""
    head_dim = q.shape[2]
    dv = v_cache.shape[2]
    rows = (t1 - t0) * group
    big_m = np.full(rows, _NEG_INF, _F)
    total = np.zeros(rows, _F)
    acc = np.zeros((rows, dv), _F)
    kt = np.zeros((head_dim, FA_TILE_KV), _F)  # the K tile, transposed
    vt = np.zeros((FA_TILE_KV, dv), _F)
    kq = np.empty(FA_TILE_KV, _F)
    lo_first = start + t0 - window + 1 if window > 0 else 0
    ic0 = max(0, lo_first) // FA_TILE_KV * FA_TILE_KV
    n_kv = start + t1  # keys beyond the last row's position are masked for every row
    for ic in range(ic0, n_kv, FA_TILE_KV):
        kv_tile = min(FA_TILE_KV, n_kv - ic)
        for tk in range(kv_tile):
            for d in range(head_dim):
                kt[d, tk] = kv(k_cache, ic + tk, kvh, d)
            for d in range(dv):
                vt[tk, d] = kv(v_cache, ic + tk, kvh, d)
        for r in range(rows):
            t = t0 + r // group
            h = kvh * group + r % group
            pos = start + t
            lo = max(0, pos - window + 1) if window > 0 else 0
            if ic + FA_TILE_KV <= lo or ic > pos:
                continue  # every key of this tile is masked for this row
            _tile_scores(kt, q[t, h], head_dim, kq)
            tile_max = _NEG_INF
            for tk in range(FA_TILE_KV):
                s = kq[tk] * scale
                if softcap > 0:
                    s = math.tanh(s) * softcap  # tanhf
                j = ic + tk
                if tk >= kv_tile or j < lo or j > pos:
                    s = _NEG_INF
                kq[tk] = s
                tile_max = max(tile_max, s)
            m_old = big_m[r]
            m_new = max(m_old, tile_max)
            if m_new > m_old:
                ms = expf(m_old - m_new)
                for d in range(dv):
                    acc[r, d] *= ms
                total[r] *= ms
            big_m[r] = m_new
            psum = 0.0  # ggml_float
            for tk in range(FA_TILE_KV):
                kq[tk] = v_expf(kq[tk] - m_new)
            for g in range(0, FA_TILE_KV, 8):
                psum += np.float64(hsum8_f32(kq, g))
            total[r] = _F(np.float64(total[r]) + psum)
            arow = acc[r]
            d = 0
            while d + 64 <= dv:
                _tile_values(vt, kq, arow, d, 64)
                d += 64
            while d + 16 <= dv:
                _tile_values(vt, kq, arow, d, 16)
                d += 16
            for tk in range(FA_TILE_KV):
                p = kq[tk]
                for e in range(d, dv):
                    arow[e] = fma_f32(vt[tk, e], p, arow[e])
    for r in range(rows):
        t = t0 + r // group
        h = kvh * group + r % group
        inv = _F(1.0) / total[r] if total[r] != 0 else _F(0.0)
        for d in range(dv):
            out[t, h * dv + d] = acc[r, d] * inv


def _driver(q, k_cache, v_cache, start, scale, window, softcap, out, chunk):
    n, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[1]
    if softcap > 0:
        scale = _F(scale / softcap)  # ggml: s = softcap * tanh(s * scale / softcap)
    if chunk:
        for job in nb.prange(n * n_heads):
            one_chunk(
                q,
                k_cache,
                v_cache,
                start,
                scale,
                window,
                softcap,
                out,
                job // n_heads,
                job % n_heads,
                group,
            )
    else:
        n_tiles = (n + FA_TILE_Q - 1) // FA_TILE_Q
        n_kv_heads = k_cache.shape[1]
        for job in nb.prange(n_tiles * n_kv_heads):
            # a later tile of query rows has more keys before it: the tiles go last, first,
            # last but one, second, .. so that the equal runs of jobs the threads take
            # share the causal triangle's work (in order, 2 threads: 26 to 10 of 36)
            i = job // n_kv_heads
            tile = n_tiles - 1 - i // 2 if i % 2 == 0 else i // 2
            t0 = tile * FA_TILE_Q
            tiled(
                q,
                k_cache,
                v_cache,
                start,
                scale,
                window,
                softcap,
                out,
                t0,
                min(n, t0 + FA_TILE_Q),
                job % n_kv_heads,
                group,
            )


_serial = nb.njit(nogil=True, cache=True, parallel=False)(_driver)
_parallel = nb.njit(nogil=True, cache=True, parallel=True)(_driver)


# A parallel region costs microseconds to start, more than a short decode-time attention
# takes, so small jobs run on one thread.
_PARALLEL_MIN_WORK = 1 << 13  # query-key dot products: a decode step past ~15 positions


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    start: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """Causal GQA attention of ``q`` (n_tokens, n_heads, head_dim) at positions
    ``start..start+n-1`` against the cache (n_ctx, n_kv_heads, head_dim): uint16 F16 bits
    (ggml's arithmetic, see the module docstring) or float32."""
    n, n_heads, head_dim = q.shape
    out = np.empty((n, n_heads * v_cache.shape[2]), np.float32)
    work = n * n_heads * (start + n) * head_dim
    kernel = _parallel if work >= _PARALLEL_MIN_WORK else _serial
    chunk = k_cache.dtype == np.uint16 and n < FA_TILE_Q
    kernel(
        np.ascontiguousarray(q, dtype=np.float32),
        k_cache,
        v_cache,
        start,
        np.float32(scale),
        window,
        np.float32(softcap),
        out,
        chunk,
    )
    return out
