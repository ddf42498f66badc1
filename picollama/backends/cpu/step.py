"""Compiled forward passes of a few tokens: one Numba function per batch shape.

A decode step of a small model is hundreds of short ops (a norm of 576 floats, a RoPE of
nine heads), and calling each from Python costs more than it computes: about 2 ms of a
7 ms SmolLM2 step. So the CPU backend traces a model's ``forward_batch`` once per batch
shape, with symbolic arrays in place of numpy ones (``_Tracer``), into a program: one row
of integers and floats per op, buffers as offsets into one float32 arena (reused once a
buffer is dead), weights as indices into a list. ``_run`` then executes the program in
compiled code, calling the same kernels the op-by-op path calls (``simd`` block dots, the
float rows, ggml's norm, RoPE, SwiGLU/GeGLU and flash attention), so its logits are the
op-by-op path's bit for bit. Each matmul is one parallel region over row ranges, as before.

A batch shape is the number of tokens of each segment and the rows whose logits are
wanted: one token of one sequence (plain decoding), ``n`` tokens of one sequence (a
speculative verification) or one token of each of several sequences (the server's
continuous batching). What may vary between runs of a shape is the tokens, the positions
and the caches: the tracer records every argument that equals the traced positions (or a
segment's start) as such, and refuses anything it cannot express (a weight type without a
kernel here, a position used another way, an array operation it does not know), in which
case that shape keeps the op-by-op path. A shape is traced the first time it is seen, but
a prompt's chunk (several tokens, the last one's logits) only the second time (a prompt's
length seldom recurs), and its program is trusted only after its first run gave the
op-by-op path's logits exactly.
"""

from __future__ import annotations

import math
import threading
import time
import weakref

import numba as nb
import numpy as np
from numba import prange, types
from numba.extending import intrinsic

from picollama.backends.base import TOP_LOGITS, Backend, BackendError, Weight, logits_top_k
from picollama.backends.cpu import attention as _attn
from picollama.backends.cpu import ggml_math, kernels, ops
from picollama.backends.cpu.intrinsics import f16_bits
from picollama.backends.cpu.lora_kernels import LoraB, _row, lora_rows
from picollama.backends.cpu.qdot import float_convert, float_rows, simd_quantize, simd_rows
from picollama.backends.cpu.simd import SIMD_TYPES
from picollama.backends.cpu.simd_x8 import ACTIVATION, X8_TYPES, x8_quantize, x8_rows
from picollama.gguf.constants import GGMLType
from picollama.sampling.samplers import _top_k_indices

__all__ = ["StepCompiler"]

# opcodes of a program row: [op, a0, a1, ...] in ``code``, float arguments in ``fargs``
_OP_SCALE, _OP_ADD, _OP_MUL, _OP_RMS_NORM, _OP_MATMUL, _OP_GATED = 1, 2, 3, 4, 5, 6
_OP_ROPE, _OP_STORE_KV, _OP_ATTENTION, _OP_SILU_MUL, _OP_GELU_MUL = 7, 8, 9, 10, 11
_OP_LORA = 12  # a LoRA adapter's term on a projection (``lora_kernels``)
_OP_ADD_CONST, _OP_SOFTCAP = 13, 14  # a bias added to every row; cap * tanh(x / cap)
_OP_COPY = 15
_N_INT_ARGS = 14

# program rows' arguments that are arena offsets, per opcode (-1: none there)
_ARENA_ARGS = {
    _OP_SCALE: (1, 2),
    _OP_ADD: (1, 2, 3),
    _OP_MUL: (1, 2, 3),
    _OP_RMS_NORM: (1, 2),
    _OP_MATMUL: (1, 4, 7, 10),
    _OP_GATED: (1, 4, 7, 10),
    _OP_ROPE: (1, 2),
    _OP_STORE_KV: (1, 2),
    _OP_ATTENTION: (1, 2),
    _OP_SILU_MUL: (1, 2, 3),
    _OP_GELU_MUL: (1, 2, 3),
    _OP_LORA: (1, 5, 6),
    _OP_ADD_CONST: (1, 3),
    _OP_SOFTCAP: (1, 2),
    _OP_COPY: (1, 2),
}

# the most tokens a program takes (more: a prompt, op by op) and programs kept per model
MAX_ROWS = 32
MAX_PROGRAMS = 32

_Q4_0 = int(GGMLType.Q4_0)
_Q4_1 = int(GGMLType.Q4_1)
_Q5_0 = int(GGMLType.Q5_0)
_Q5_1 = int(GGMLType.Q5_1)
_Q8_0 = int(GGMLType.Q8_0)
_Q4_K = int(GGMLType.Q4_K)
_Q6_K = int(GGMLType.Q6_K)
assert {_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q6_K} == {int(t) for t in SIMD_TYPES}
# a weight in the x8 layout (``simd_x8``) has this added to its type in ``wmeta``
_X8 = 256
_Q4_0X8 = _X8 + _Q4_0
_Q4_1X8 = _X8 + _Q4_1
_Q5_0X8 = _X8 + _Q5_0
_Q8_0X8 = _X8 + _Q8_0
_Q4_KX8 = _X8 + _Q4_K
_X8_CODES = {_Q4_0X8, _Q4_1X8, _Q5_0X8, _Q8_0X8, _Q4_KX8}
assert {c - _X8 for c in _X8_CODES} == {int(t) for t in X8_TYPES}
# the activation kind ``x8_quantize`` takes, by weight type code (simd_x8.ACTIVATION)
_X8_KIND = np.full(max(int(t) for t in X8_TYPES) + 1, -1, np.int64)
for _t, _kind in ACTIVATION.items():
    _X8_KIND[int(_t)] = _kind
_F32 = int(GGMLType.F32)
_F16 = int(GGMLType.F16)
_BF16 = int(GGMLType.BF16)
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
STEP_TYPES = SIMD_TYPES | FLOAT_TYPES


class Untraceable(Exception):
    """The model's step does something a program cannot express; it runs op by op."""


# ---- the interpreter ----

# A program's weights and the segments' caches reach ``_run`` as tables of addresses and
# shapes, turned back into arrays in compiled code: a Numba typed list made from Python
# compiles its methods at every start (a second of a CLI's first token), and unboxing one
# costs microseconds a step. The arrays behind the addresses are held by the program (the
# weights) or the caller (the caches) for as long as a run lasts.


def _pointer_intrinsic(dtype):
    @intrinsic
    def pointer(typingctx, address):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return pointer


_u8_at = _pointer_intrinsic(types.uint8)
_u16_at = _pointer_intrinsic(types.uint16)
_f32_at = _pointer_intrinsic(types.float32)


@nb.njit(inline="always")
def _weight(wmeta, wid):
    """Weight ``wid``'s raw rows: uint8 (m, row_bytes)."""
    return nb.carray(_u8_at(wmeta[wid, 0]), (wmeta[wid, 1], wmeta[wid, 2]))


@nb.njit(inline="always")
def _weight32(wmeta, wid):
    """An F32 weight's rows as float32 (m, k); (0, 0) for other types."""
    if wmeta[wid, 3] != _F32:
        return nb.carray(_f32_at(wmeta[wid, 0]), (0, 0))
    return nb.carray(_f32_at(wmeta[wid, 0]), (wmeta[wid, 1], wmeta[wid, 2] // 4))


@nb.njit(inline="always")
def _cache(cmeta, seg, which, layer):
    """Layer ``layer`` of segment ``seg``'s K (``which`` 0) or V (1) cache: uint16 F16 bits
    (n_ctx, n_kv_heads, head_dim)."""
    m = cmeta[seg, which]
    return nb.carray(_u16_at(m[0] + layer * m[2] * m[3] * m[4] * 2), (m[2], m[3], m[4]))


@nb.njit(cache=True, nogil=True)
def _quantize_any(qt, x):
    """x (n, k) in the dot type of weight type ``qt``: ``(xq, xd, xs, bsums)``."""
    if qt >= _X8:
        xq, xd, xs = x8_quantize(x, _X8_KIND[qt - _X8])
        return xq, xd, xs, np.empty((0, 0), np.int32)
    if qt == _Q4_0:
        return simd_quantize(_Q4_0, x)
    if qt == _Q4_1:
        return simd_quantize(_Q4_1, x)
    if qt == _Q5_0:
        return simd_quantize(_Q5_0, x)
    if qt == _Q5_1:
        return simd_quantize(_Q5_1, x)
    if qt == _Q4_K:
        return simd_quantize(_Q4_K, x)
    if qt == _Q6_K:
        return simd_quantize(_Q6_K, x)
    return simd_quantize(_Q8_0, x)


@nb.njit(cache=True, nogil=True)
def _rows_any(qt, w, xq, xd, xs, bsums, out, lo, hi):
    """Outputs ``lo..hi`` of ``x @ W.T`` for weights of type ``qt`` (x8: multiples of 8)."""
    if qt == _Q4_0X8:
        x8_rows(_Q4_0, w, xq, xd, xs, out, lo // 8, hi // 8)
    elif qt == _Q4_1X8:
        x8_rows(_Q4_1, w, xq, xd, xs, out, lo // 8, hi // 8)
    elif qt == _Q5_0X8:
        x8_rows(_Q5_0, w, xq, xd, xs, out, lo // 8, hi // 8)
    elif qt == _Q8_0X8:
        x8_rows(_Q8_0, w, xq, xd, xs, out, lo // 8, hi // 8)
    elif qt == _Q4_KX8:
        x8_rows(_Q4_K, w, xq, xd, xs, out, lo // 8, hi // 8)
    elif qt == _Q4_0:
        simd_rows(_Q4_0, w, xq, xd, xs, bsums, out, lo, hi)
    elif qt == _Q4_1:
        simd_rows(_Q4_1, w, xq, xd, xs, bsums, out, lo, hi)
    elif qt == _Q5_0:
        simd_rows(_Q5_0, w, xq, xd, xs, bsums, out, lo, hi)
    elif qt == _Q5_1:
        simd_rows(_Q5_1, w, xq, xd, xs, bsums, out, lo, hi)
    elif qt == _Q4_K:
        simd_rows(_Q4_K, w, xq, xd, xs, bsums, out, lo, hi)
    elif qt == _Q6_K:
        simd_rows(_Q6_K, w, xq, xd, xs, bsums, out, lo, hi)
    else:
        simd_rows(_Q8_0, w, xq, xd, xs, bsums, out, lo, hi)


@nb.njit(cache=True, nogil=True)
def _convert_any(qt, x):
    """x (n, k) in the dot type of float weight type ``qt``, as float32."""
    if qt == _F16:
        return float_convert(_F16, x)
    if qt == _BF16:
        return float_convert(_BF16, x)
    return float_convert(_F32, x)


@nb.njit(cache=True, nogil=True)
def _float_rows_any(qt, xf, w, w32, out, lo, hi):
    """Outputs ``lo..hi`` of ``x @ W.T`` for float weights of type ``qt``."""
    k = xf.shape[1]
    if qt == _F16:
        float_rows(_F16, xf, w, w32, out, k, lo, hi)
    elif qt == _BF16:
        float_rows(_BF16, xf, w, w32, out, k, lo, hi)
    else:
        float_rows(_F32, xf, w, w32, out, k, lo, hi)


@nb.njit(inline="always")
def _is_float(qt):
    return qt == _F32 or qt == _F16 or qt == _BF16


@nb.njit(nogil=True)
def _activation(qt, x):
    """x in the dot type of weight type ``qt``: ``(xf, xq, xd, xs, bsums)``, the float rows
    for a float type, else the quantized ones (the others empty)."""
    if _is_float(qt):
        xf = _convert_any(qt, x)
        return (
            xf,
            np.empty((0, 0), np.int8),
            np.empty((0, 0), np.float32),
            np.empty((0, 0), np.float32),
            np.empty((0, 0), np.int32),
        )
    xq, xd, xs, bsums = _quantize_any(qt, x)
    return np.empty((0, 0), np.float32), xq, xd, xs, bsums


@nb.njit(inline="always")
def _span(qt, m, t, n_tasks):
    """Task ``t``'s rows of a product of ``m`` rows: whole groups of 8 for x8 weights."""
    if qt >= _X8:
        g = m // 8
        return 8 * (t * g // n_tasks), 8 * ((t + 1) * g // n_tasks)
    return t * m // n_tasks, (t + 1) * m // n_tasks


@nb.njit(nogil=True)
def _product_rows(qt, wmeta, wid, act, out, lo, hi):
    """Outputs ``lo..hi`` of the product with weight ``wid`` of type ``qt`` (``act``: the
    activation as ``_activation`` gives it)."""
    xf, xq, xd, xs, bsums = act
    if _is_float(qt):
        _float_rows_any(qt, xf, _weight(wmeta, wid), _weight32(wmeta, wid), out, lo, hi)
    else:
        _rows_any(qt, _weight(wmeta, wid), xq, xd, xs, bsums, out, lo, hi)


@nb.njit(cache=True, nogil=True, parallel=True)
def _matmuls(arena, src, n, k, wmeta, ins, n_tasks, act, act_dst, gelu):
    """Up to three products of one activation (n, k) (``ins``: rows of (wid, dst, m), wid
    -1 for none) in one parallel region, a row range of each per task (an absent product
    has 0 rows); x is converted once per weight type. One region, whatever the types: each
    prange loop compiles the kernels it calls into its own code, so one loop, not the four
    of a path per kind of types, keeps the first run's compile shorter (SmolLM2's first
    step, 2 cores: 73 -> 66 s). ``act`` 0 (SiLU) or 1 (GELU, ``gelu`` its table): the first
    two products are a gate and an up, and each task writes act(gate) * up of its columns
    at ``act_dst`` (-1: none), the same bits as one pass over the rows (``ggml_math``)."""
    x = arena[src : src + n * k].reshape(n, k)
    q0 = wmeta[ins[0, 0], 3]
    q1 = wmeta[ins[1, 0], 3] if ins[1, 0] >= 0 else q0
    q2 = wmeta[ins[2, 0], 3] if ins[2, 0] >= 0 else q0
    a0 = _activation(q0, x)
    a1 = a0 if q1 == q0 else _activation(q1, x)
    a2 = a0 if q2 == q0 else a1 if q2 == q1 else _activation(q2, x)
    i0, i1, i2 = ins[0, 0], max(ins[1, 0], 0), max(ins[2, 0], 0)
    m0 = ins[0, 2]
    m1 = ins[1, 2] if ins[1, 0] >= 0 else 0
    m2 = ins[2, 2] if ins[2, 0] >= 0 else 0
    o0 = arena[ins[0, 1] : ins[0, 1] + n * m0].reshape(n, m0)
    o1 = arena[max(ins[1, 1], 0) : max(ins[1, 1], 0) + n * m1].reshape(n, m1)
    o2 = arena[max(ins[2, 1], 0) : max(ins[2, 1], 0) + n * m2].reshape(n, m2)
    m_act = m0 if act >= 0 else 0
    out = arena[max(act_dst, 0) : max(act_dst, 0) + n * m_act].reshape(n, m_act)
    for t in prange(n_tasks):
        lo, hi = _span(q0, m0, t, n_tasks)
        _product_rows(q0, wmeta, i0, a0, o0, lo, hi)
        lo1, hi1 = _span(q1, m1, t, n_tasks)
        _product_rows(q1, wmeta, i1, a1, o1, lo1, hi1)
        lo2, hi2 = _span(q2, m2, t, n_tasks)
        _product_rows(q2, wmeta, i2, a2, o2, lo2, hi2)
        if act == 0:  # m1 == m0: this task's up rows are its gate rows
            ggml_math._silu_mul_cols(o0, o1, out, lo, hi)
        elif act == 1:
            ggml_math._gelu_mul_cols(o0, o1, out, gelu, lo, hi)


@nb.njit(cache=True, nogil=True)
def _run(
    code,
    fargs,
    wmeta,
    consts,
    arena,
    cmeta,
    positions,
    starts,
    n_tasks,
    gelu,
):
    """Execute a program for tokens at ``positions`` (their embeddings already in the
    arena); segment s starts at ``starts[s]`` in caches ``k_caches[s]``, ``v_caches[s]``:
    (n_layers, n_ctx, n_kv_heads, head_dim) uint16 F16 bits."""
    ins = np.full((3, 3), -1, np.int64)
    for i in range(code.shape[0]):
        c = code[i]
        op = c[0]
        # (the elementwise loops run over slices, not offsets into the arena: LLVM then
        # vectorizes them, 4608 adds 6.1 -> 0.5 us; the same float operations)
        if op == _OP_SCALE:
            s = np.float32(fargs[i, 0])
            x, out = arena[c[1] : c[1] + c[3]], arena[c[2] : c[2] + c[3]]
            for j in range(c[3]):
                out[j] = x[j] * s
        elif op == _OP_ADD or op == _OP_MUL:
            a, b = arena[c[1] : c[1] + c[4]], arena[c[2] : c[2] + c[4]]
            out = arena[c[3] : c[3] + c[4]]
            if op == _OP_ADD:
                for j in range(c[4]):
                    out[j] = a[j] + b[j]
            else:
                for j in range(c[4]):
                    out[j] = a[j] * b[j]
        elif op == _OP_COPY:
            x, out = arena[c[1] : c[1] + c[3]], arena[c[2] : c[2] + c[3]]
            for j in range(c[3]):
                out[j] = x[j]
        elif op == _OP_ADD_CONST:
            # [op, src, const, dst, rows, d]
            d = c[5]
            bias = consts[c[2] : c[2] + d]
            for r in range(c[4]):
                x = arena[c[1] + r * d : c[1] + (r + 1) * d]
                out = arena[c[3] + r * d : c[3] + (r + 1) * d]
                for j in range(d):
                    out[j] = x[j] + bias[j]
        elif op == _OP_SOFTCAP:
            # [op, src, dst, size]; fargs: 1 / cap, cap
            ops._softcap(
                arena[c[1] : c[1] + c[3]],
                np.float32(fargs[i, 0]),
                np.float32(fargs[i, 1]),
                arena[c[2] : c[2] + c[3]],
            )
        elif op == _OP_RMS_NORM:
            rows, d = c[3], c[4]
            x = arena[c[1] : c[1] + rows * d].reshape(rows, d)
            out = arena[c[2] : c[2] + rows * d].reshape(rows, d)
            w = consts[c[5] : c[5] + d] if c[5] >= 0 else consts[:0]
            ops._rms_norm(x, w, np.float32(fargs[i, 0]), c[5] >= 0, out)
        elif op == _OP_MATMUL or op == _OP_GATED:
            # [op, src, k, wid0, dst0, m0, wid1, dst1, m1, wid2, dst2, m2, act/dst, n]
            n = c[13]
            for j in range(3):
                ins[j, 0] = c[3 + 3 * j]
                ins[j, 1] = c[4 + 3 * j]
                ins[j, 2] = c[5 + 3 * j]
            # a gated product's activation runs inside the products' parallel region
            act, dst = (c[12], c[10]) if op == _OP_GATED else (-1, -1)
            _matmuls(arena, c[1], n, c[2], wmeta, ins, n_tasks, act, dst, gelu)
        elif op == _OP_SILU_MUL or op == _OP_GELU_MUL:
            # [op, gate, up, dst, rows, m]
            n, m = c[4], c[5]
            g = arena[c[1] : c[1] + n * m].reshape(n, m)
            u = arena[c[2] : c[2] + n * m].reshape(n, m)
            out = arena[c[3] : c[3] + n * m].reshape(n, m)
            if op == _OP_SILU_MUL:
                ggml_math._silu_mul(g, u, out)
            else:
                ggml_math._gelu_mul(g, u, out, gelu)
        elif op == _OP_ROPE:
            # [op, src, dst, n_heads, head_dim, n_rot, neox, rows]; fargs: base, freq scale
            n, nh, hd = c[7], c[3], c[4]
            x = arena[c[1] : c[1] + n * nh * hd].reshape(n, nh, hd)
            out = arena[c[2] : c[2] + n * nh * hd].reshape(n, nh, hd)
            ops._rope(
                x,
                positions,
                c[5],
                np.float32(fargs[i, 0]),
                np.float32(fargs[i, 1]),
                c[6] != 0,
                True,
                out,
            )
        elif op == _OP_STORE_KV:
            # [op, k_src, v_src, layer, n_k, n_v, segment, rows]: F16 rounding as ggml's copy
            seg, n, nk, nv = c[6], c[7], c[4], c[5]
            kl = _cache(cmeta, seg, 0, c[3])
            vl = _cache(cmeta, seg, 1, c[3])
            for t in range(n):
                kc = kl[starts[seg] + t].reshape(-1)
                vc = vl[starts[seg] + t].reshape(-1)
                ks = arena[c[1] + t * nk : c[1] + (t + 1) * nk]
                vs = arena[c[2] + t * nv : c[2] + (t + 1) * nv]
                for j in range(nk):
                    kc[j] = f16_bits(ks[j])
                for j in range(nv):
                    vc[j] = f16_bits(vs[j])
        elif op == _OP_ATTENTION and c[10] > 1:
            _attention_group(code, fargs, i, c[10], arena, cmeta, starts)
        elif op == _OP_ATTENTION and c[10] == 1:
            # [op, q, dst, layer, n_heads, head_dim, window, head_dim_v, segment, rows,
            # group]; fargs: scale, softcap
            nh, hd, hdv, seg, n = c[4], c[5], c[7], c[8], c[9]
            q = arena[c[1] : c[1] + n * nh * hd].reshape(n, nh, hd)
            out = arena[c[2] : c[2] + n * nh * hdv].reshape(n, nh * hdv)
            kc = _cache(cmeta, seg, 0, c[3])
            vc = _cache(cmeta, seg, 1, c[3])
            start = starts[seg]
            scale = np.float32(fargs[i, 0])
            softcap = np.float32(fargs[i, 1])
            # as ``attention.attention`` chooses, so the result is the op-by-op one
            chunk = n < _attn.FA_TILE_Q
            if n * nh * (start + n) * hd >= _attn._PARALLEL_MIN_WORK:
                _attn._parallel(q, kc, vc, start, scale, c[6], softcap, out, chunk)
            else:
                _attn._serial(q, kc, vc, start, scale, c[6], softcap, out, chunk)
        elif op == _OP_LORA and c[8] == 1:
            # [op, x, k, a_wid, bt_wid, y, dst, m, n_terms]; fargs: scale
            k, m = c[2], c[7]
            x = arena[c[1] : c[1] + k].reshape(1, k)
            y = arena[c[5] : c[5] + m].reshape(1, m)
            out = arena[c[6] : c[6] + m].reshape(1, m)
            s = np.float32(fargs[i, 0])
            a, bt = _weight(wmeta, c[3]), _weight(wmeta, c[4])
            lora_rows(x, a, wmeta[c[3], 3], bt, wmeta[c[4], 3], s, y, out)
        elif op == _OP_LORA and c[8] > 1:
            _lora_terms(code, fargs, i, c[8], wmeta, arena)


@nb.njit(cache=True, nogil=True, parallel=True)
def _lora_terms(code, fargs, first, n, wmeta, arena):
    """LoRA terms of one input (Q, K and V; gate and up), program rows ``first ..``, a task
    each: the adapter's bytes stream through every core, not one. Each term is the same
    ``_row`` that ``lora_rows`` runs, so the floats are the op-by-op pass's."""
    for j in prange(n):
        c = code[first + j]
        k, m = c[2], c[7]
        a, bt = _weight(wmeta, c[3]), _weight(wmeta, c[4])
        t = np.empty(a.shape[0], np.float32)
        x = arena[c[1] : c[1] + k]
        y = arena[c[5] : c[5] + m]
        out = arena[c[6] : c[6] + m]
        s = np.float32(fargs[first + j, 0])
        _row(x, a, wmeta[c[3], 3], bt, wmeta[c[4], 3], s, y, out, t)


@nb.njit(cache=True, nogil=True, parallel=True)
def _attention_group(code, fargs, first, n, arena, cmeta, starts):
    """Attention rows ``first ..`` of one layer, each another segment's, in one parallel
    region: a task per (segment, row, head), each ``attention.one_chunk`` as the op-by-op
    pass runs it (its rows are below ``FA_TILE_Q``), so the results are the same."""
    ends = np.empty(n + 1, np.int64)  # ends[g]: the first job of row first + g
    ends[0] = 0
    for g in range(n):
        c = code[first + g]
        ends[g + 1] = ends[g] + c[9] * c[4]
    for job in prange(ends[n]):
        g = 0
        while ends[g + 1] <= job:
            g += 1
        c = code[first + g]
        nh, hd, hdv, seg, rows = c[4], c[5], c[7], c[8], c[9]
        q = arena[c[1] : c[1] + rows * nh * hd].reshape(rows, nh, hd)
        out = arena[c[2] : c[2] + rows * nh * hdv].reshape(rows, nh * hdv)
        kc = _cache(cmeta, seg, 0, c[3])
        vc = _cache(cmeta, seg, 1, c[3])
        scale = np.float32(fargs[first + g, 0])
        softcap = np.float32(fargs[first + g, 1])
        if softcap > 0:
            scale = np.float32(scale / softcap)  # as ``attention._driver``
        local = job - ends[g]
        group = nh // kc.shape[1]
        _attn.one_chunk(
            q, kc, vc, starts[seg], scale, c[6], softcap, out, local // nh, local % nh, group
        )


# ---- tracing ----


class _Sym:
    """A symbolic float32 array: a region of the arena with a shape."""

    __slots__ = ("offset", "shape", "size")

    def __init__(self, offset: int, shape: tuple[int, ...]):
        self.offset = offset
        self.shape = tuple(int(s) for s in shape)
        self.size = math.prod(self.shape)  # read on every run of a program: a plain int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape) -> _Sym:
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        shape = list(shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
            shape[shape.index(-1)] = self.size // max(known, 1)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise Untraceable(f"reshape {self.shape} -> {tuple(shape)}")
        return _Sym(self.offset, tuple(shape))

    def __getitem__(self, key) -> _Sym:
        # only contiguous ranges of rows (a segment's tokens) are expressible
        if isinstance(key, slice) and key.step in (None, 1) and self.ndim >= 1:
            lo, hi, _ = key.indices(self.shape[0])
            hi = max(lo, hi)
            row = self.size // max(self.shape[0], 1)
            return _Sym(self.offset + lo * row, (hi - lo, *self.shape[1:]))
        raise Untraceable(f"indexing {key!r}")

    def __array__(self, *args, **kwargs):
        raise Untraceable("a symbolic array was used as a numpy array")


class _Tracer:
    """Stands in for the CPU backend while a model's forward pass of one batch shape is
    traced: ``segments`` are the traced call's, whose tokens, starts and caches become the
    program's inputs."""

    def __init__(self, backend, segments):
        self.backend = backend
        self.segments = segments
        self.tokens = np.concatenate([np.asarray(s.tokens, np.int64) for s in segments])
        self.positions = np.concatenate(
            [np.arange(s.start, s.start + len(s.tokens), dtype=np.int64) for s in segments]
        )
        self.rows: list[tuple[list[int], list[float]]] = []
        self.regions: list[tuple[int, int]] = []  # (offset, size) of each buffer
        self.arena_size = 0
        self.weights: list = []
        self._wid: dict[int, int] = {}
        self.consts: list[np.ndarray] = []
        self.consts_size = 0
        self._cid: dict[int, int] = {}
        self.embedding = None  # (weight, arena offset)

    def __getattr__(self, name):
        raise Untraceable(f"backend attribute '{name}'")

    # segment by segment, through store_kv and attention below (``_group_attention``)
    attend_batch = Backend.attend_batch

    # -- bookkeeping --

    def _new(self, shape) -> _Sym:
        sym = _Sym(self.arena_size, shape)
        self.regions.append((sym.offset, sym.size))
        self.arena_size += sym.size
        return sym

    def _emit(self, op: int, ints: list[int], floats: tuple[float, ...] = ()) -> None:
        self.rows.append(([op, *ints], list(floats)))

    def _weight(self, w, types=STEP_TYPES) -> int:
        if w.type not in types:
            raise Untraceable(f"weight '{w.name}' of type {w.type.name}")
        wid = self._wid.get(id(w))
        if wid is None:
            wid = self._wid[id(w)] = len(self.weights)
            self.weights.append(w)
        return wid

    def _const(self, v: np.ndarray) -> int:
        off = self._cid.get(id(v))
        if off is None:
            off = self._cid[id(v)] = self.consts_size
            self.consts.append(np.ascontiguousarray(v, np.float32).reshape(-1))
            self.consts_size += v.size
        return off

    def _sym(self, x) -> _Sym:
        if not isinstance(x, _Sym):
            raise Untraceable(f"a {type(x).__name__} operand")
        return x

    def _segment(self, cache, start, rows: _Sym) -> int:
        """The index of the segment whose cache is ``cache``: its start and row count must be
        the ones given."""
        for i, seg in enumerate(self.segments):
            if seg.cache is cache:
                if np.asarray(start).reshape(-1).tolist() != [seg.start]:
                    raise Untraceable("a position other than the segment's start")
                if rows.shape[0] != len(seg.tokens):
                    raise Untraceable("a cache access of another number of rows")
                return i
        raise Untraceable("a cache that is not a segment's")

    def _same(self, a: _Sym, b: _Sym) -> None:
        if a.size != b.size:
            raise Untraceable(f"shapes {a.shape} and {b.shape}")

    def _copy_rows(self, parts: list[tuple[_Sym, int, int]], shape) -> _Sym:
        """A new buffer of ``shape`` filled with rows ``lo..hi`` of each part, in order."""
        out = self._new(shape)
        at = out.offset
        for x, lo, hi in parts:
            row = x.size // max(x.shape[0], 1)
            self._emit(_OP_COPY, [x.offset + lo * row, at, (hi - lo) * row])
            at += (hi - lo) * row
        return out

    # -- the op interface --

    def from_host(self, a):
        raise Untraceable("a host array entering the step")

    def to_host(self, x):
        return self._sym(x)

    def to_host_top(self, x, k):
        return self.to_host(x)  # the CPU hands back whole rows

    def get_rows(self, w, ids):
        if self.embedding is not None or not np.array_equal(np.asarray(ids), self.tokens):
            raise Untraceable("an embedding lookup other than the batch's tokens")
        out = self._new((len(self.tokens), w.k))
        self.embedding = (w, out.offset)
        return out

    def take_rows(self, x, rows):
        x = self._sym(x)
        rows = np.asarray(rows, np.int64).reshape(-1)
        if np.array_equal(rows, np.arange(x.shape[0])):
            return x
        if rows.size and (rows.min() < 0 or rows.max() >= x.shape[0]):
            raise Untraceable("take_rows out of range")
        runs: list[tuple[_Sym, int, int]] = []
        for r in rows.tolist():
            if runs and runs[-1][2] == r:
                runs[-1] = (x, runs[-1][1], r + 1)
            else:
                runs.append((x, r, r + 1))
        return self._copy_rows(runs, (len(rows), *x.shape[1:]))

    def concat(self, parts):
        parts = [self._sym(p) for p in parts]
        if len({p.shape[1:] for p in parts}) != 1:
            raise Untraceable("concat of different row shapes")
        n = sum(p.shape[0] for p in parts)
        return self._copy_rows([(p, 0, p.shape[0]) for p in parts], (n, *parts[0].shape[1:]))

    def scale(self, x, s):
        x = self._sym(x)
        out = self._new(x.shape)
        self._emit(_OP_SCALE, [x.offset, out.offset, x.size], (float(s),))
        return out

    def _binary(self, op, a, b):
        a, b = self._sym(a), self._sym(b)
        self._same(a, b)
        out = self._new(a.shape)
        self._emit(op, [a.offset, b.offset, out.offset, a.size])
        return out

    def add(self, a, b):
        if isinstance(a, _Sym) and isinstance(b, np.ndarray) and b.ndim == 1:
            # a constant row (a bias) added to every row of a
            a = self._sym(a)
            d = b.size
            if a.shape[-1] != d:
                raise Untraceable(f"a constant of {d} added to shape {a.shape}")
            out = self._new(a.shape)
            self._emit(_OP_ADD_CONST, [a.offset, self._const(b), out.offset, a.size // d, d])
            return out
        return self._binary(_OP_ADD, a, b)

    def softcap(self, x, cap):
        x = self._sym(x)
        out = self._new(x.shape)
        self._emit(
            _OP_SOFTCAP, [x.offset, out.offset, x.size], (float(np.float32(1.0 / cap)), float(cap))
        )
        return out

    def mul(self, a, b):
        return self._binary(_OP_MUL, a, b)

    def rms_norm(self, x, weight, eps):
        x = self._sym(x)
        d = x.shape[-1]
        out = self._new(x.shape)
        if weight is not None and np.asarray(weight).size != d:
            raise Untraceable("a norm weight of another length")
        w_off = -1 if weight is None else self._const(np.asarray(weight))
        self._emit(_OP_RMS_NORM, [x.offset, out.offset, x.size // d, d, w_off], (float(eps),))
        return out

    def _products(self, op, x, ws, extra=0):
        x = self._sym(x)
        k = ws[0].k
        if x.ndim != 2 or x.shape[-1] != k or len(ws) > 3:
            raise Untraceable(f"a matmul of shape {x.shape}")
        n = x.shape[0]
        ints, outs = [x.offset, k], []
        for w in ws:
            if w.k != k:
                raise Untraceable("matmuls of different widths")
            out = self._new((n, w.m))
            ints += [self._weight(w), out.offset, w.m]
            outs.append(out)
        ints += [-1, -1, 0] * (3 - len(ws))
        self._emit(op, ints + [extra, n])
        return outs

    def matmul(self, x, w):
        return self._products(_OP_MATMUL, x, (w,))[0]

    def matmul_many(self, x, ws):
        return self._products(_OP_MATMUL, x, tuple(ws))

    def gated_ffn(self, x, w_gate, w_up, act):
        if act not in ("silu", "gelu") or w_gate.m != w_up.m:
            raise Untraceable(f"gated_ffn '{act}'")
        x = self._sym(x)
        out = self._new((x.shape[0], w_gate.m))
        self._products(_OP_GATED, x, (w_gate, w_up, w_gate), 0 if act == "silu" else 1)
        # the third product slot carries the output: it is not computed (see below)
        row = self.rows[-1][0]
        row[9:12] = [-1, out.offset, 0]
        return out

    def lora_add(self, y, x, a, b, s):
        x, y = self._sym(x), self._sym(y)
        if not isinstance(b, LoraB):
            raise Untraceable(f"LoRA weights of types {a.type.name}, {b.type.name}")
        if x.shape[0] != 1 or x.size != a.k or b.k != a.m or y.size != b.m:
            raise Untraceable("a LoRA term of several rows")
        a_id = self._weight(a, (a.type,))
        # the program's weight list holds raw rows: B's transposed ones
        b_id = self._weight(Weight(b.name, b.type, b.shape, b.t_data), (b.type,))
        out = self._new(y.shape)
        ints = [x.offset, a.k, a_id, b_id, y.offset, out.offset, b.m]
        self._emit(_OP_LORA, ints, (float(s),))
        return out

    def silu_mul(self, gate, up):
        return self._act(_OP_SILU_MUL, gate, up)

    def gelu_mul(self, gate, up):
        return self._act(_OP_GELU_MUL, gate, up)

    def _act(self, op, gate, up):
        g, u = self._sym(gate), self._sym(up)
        self._same(g, u)
        out = self._new(g.shape)
        m = g.shape[-1]
        self._emit(op, [g.offset, u.offset, out.offset, g.size // m, m])
        return out

    def rope(self, x, positions, n_rot, freq_base, freq_scale=1.0, neox=False):
        x = self._sym(x)
        if x.ndim != 3 or not np.array_equal(np.asarray(positions), self.positions):
            raise Untraceable("rope of rows other than the batch's")
        out = self._new(x.shape)
        ints = [x.offset, out.offset, x.shape[1], x.shape[2], int(n_rot), int(bool(neox))]
        self._emit(_OP_ROPE, ints + [x.shape[0]], (float(freq_base), float(freq_scale)))
        return out

    def store_kv(self, cache, layer, k, v, start):
        k, v = self._sym(k), self._sym(v)
        seg = self._segment(cache, start, k)
        n = k.shape[0]
        if k.size != n * cache.n_kv_heads * cache.head_dim_k:
            raise Untraceable("a key row of another size")
        if v.shape[0] != n or v.size != n * cache.n_kv_heads * cache.head_dim_v:
            raise Untraceable("a value row of another size")
        ints = [k.offset, v.offset, int(layer), k.size // n, v.size // n, seg, n]
        self._emit(_OP_STORE_KV, ints)

    def attention(self, q, cache, layer, start, scale, window=0, softcap=0.0):
        q = self._sym(q)
        seg = self._segment(cache, start, q)
        if q.ndim != 3 or q.shape[2] != cache.head_dim_k:
            raise Untraceable(f"attention of shape {q.shape}")
        n, n_heads = q.shape[0], q.shape[1]
        out = self._new((n, n_heads * cache.head_dim_v))
        ints = [q.offset, out.offset, int(layer), n_heads, cache.head_dim_k, int(window)]
        ints += [cache.head_dim_v, seg, n, 1]
        self._emit(_OP_ATTENTION, ints, (float(scale), float(softcap)))
        return out


def _group_lora_terms(code: np.ndarray, fargs: np.ndarray) -> None:
    """Mark runs of LoRA rows on one input that do not read each other's outputs: the first
    row of a run gets the run's length (``_run`` does them in one parallel region), the
    others 0 (already done)."""
    i, n = 0, len(code)
    while i < n:
        if code[i, 0] != _OP_LORA:
            i += 1
            continue
        j, written = i + 1, {int(code[i, 6])}
        while (
            j < n
            and code[j, 0] == _OP_LORA
            and code[j, 1] == code[i, 1]
            and int(code[j, 5]) not in written
        ):
            written.add(int(code[j, 6]))
            j += 1
        # the largest term last: three terms on two threads go (0, 1) and (2), so Q (the
        # largest of Q, K, V) runs beside K and V, not K beside V
        order = sorted(range(i, j), key=lambda row: int(code[row, 2] + code[row, 7]))
        code[i:j], fargs[i:j] = code[order], fargs[order]
        code[i, 8] = j - i
        code[i + 1 : j, 8] = 0
        i = j


def _group_attention(code: np.ndarray, fargs: np.ndarray) -> None:
    """Runs of (store_kv, attention) pairs of one layer on distinct segments (the server's
    batch: ``Batch.attend`` goes segment by segment) become every store first, then the
    attentions as one group (its first row gets the group's size, the others 0): each
    attention reads only its own segment's cache, written by its own store, still before
    it. Attention rows outside a group get 1."""
    code[code[:, 0] == _OP_ATTENTION, 10] = 1
    i, n = 0, len(code)
    while i < n:
        j, segs = i, set()
        while (
            j + 1 < n
            and code[j, 0] == _OP_STORE_KV
            and code[j + 1, 0] == _OP_ATTENTION
            and code[j, 6] == code[j + 1, 8]
            and code[j, 3] == code[j + 1, 3] == code[i, 3]
            and int(code[j, 6]) not in segs
            and code[j + 1, 9] < _attn.FA_TILE_Q
        ):
            segs.add(int(code[j, 6]))
            j += 2
        k = (j - i) // 2
        if k < 2:
            i = max(j, i + 1)
            continue
        order = list(range(i, j, 2)) + list(range(i + 1, j, 2))
        code[i:j], fargs[i:j] = code[order], fargs[order]
        code[i + k, 10] = k
        code[i + k + 1 : j, 10] = 0
        i = j


def _run_length(row) -> int:
    """How many program rows, from this one, run at once (a LoRA run, an attention group)."""
    if row[0] == _OP_LORA:
        return int(row[8])
    if row[0] == _OP_ATTENTION:
        return int(row[10])
    return 1


def _pack_arena(code: np.ndarray, regions: list[tuple[int, int]], pinned: set[int]) -> int:
    """Give dead buffers' room to later ones: each region of the traced arena gets a new
    offset, first fit among the places free from its first to its last use (the rows of
    a LoRA run or an attention group count as one use: they run at once), and the offsets
    in ``code`` are rewritten. Regions holding an offset in ``pinned`` (the embedding, the
    outputs) stay live from start to end. A region is never given the room of one that
    dies in the op that writes it, so no op reads and writes the same memory. Returns the
    arena's size."""
    starts = np.array([r[0] for r in regions], np.int64)

    def region_of(offset: int) -> int:
        return int(np.searchsorted(starts, offset, side="right")) - 1

    first = {}
    last = {}
    time, run_left = -1, 0
    for i, row in enumerate(code):
        if run_left > 0:
            run_left -= 1
        else:
            time = i
            run_left = max(_run_length(row), 1) - 1
        for a in _ARENA_ARGS[int(row[0])]:
            if row[a] < 0:
                continue
            r = region_of(int(row[a]))
            first.setdefault(r, time)
            last[r] = time
    end = len(code)
    for off in pinned:
        r = region_of(off)
        first[r] = -1
        last[r] = end
    # events in time order: at time t, regions born at t get room, then those dying at t free it
    placed: dict[int, int] = {}
    free: list[tuple[int, int]] = []  # (offset, size), sorted by offset
    size = 0
    order = sorted(first, key=lambda r: (first[r], r))
    dying: dict[int, list[int]] = {}
    for r in order:
        dying.setdefault(last[r], []).append(r)
    births: dict[int, list[int]] = {}
    for r in order:
        births.setdefault(first[r], []).append(r)
    for t in sorted(set(births) | set(dying)):
        for r in births.get(t, []):
            need = regions[r][1]
            for j, (off, room) in enumerate(free):
                if room >= need:
                    placed[r] = off
                    if room == need:
                        free.pop(j)
                    else:
                        free[j] = (off + need, room - need)
                    break
            else:
                placed[r] = size
                size += need
        for r in dying.get(t, []):
            free.append((placed[r], regions[r][1]))
            free.sort()
            merged: list[tuple[int, int]] = []
            for off, room in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + room)
                else:
                    merged.append((off, room))
            free = merged
    for row in code:
        for a in _ARENA_ARGS[int(row[0])]:
            if row[a] >= 0:
                r = region_of(int(row[a]))
                row[a] = placed[r] + (row[a] - regions[r][0])
    return size


class _Program:
    """A traced forward pass of one batch shape, ready to run: the arrays ``_run`` takes."""

    def __init__(self, tracer: _Tracer, outs: list[_Sym]):
        n = len(tracer.rows)
        self.code = np.zeros((n, _N_INT_ARGS), np.int64)
        self.fargs = np.zeros((n, 2), np.float64)
        for i, (ints, floats) in enumerate(tracer.rows):
            self.code[i, : len(ints)] = ints
            self.fargs[i, : len(floats)] = floats
        _group_lora_terms(self.code, self.fargs)
        _group_attention(self.code, self.fargs)
        self.embedding, embd_offset = tracer.embedding
        # the outputs and the embedding keep their own room; record them as rows of the
        # program so that packing relocates them with everything else
        pinned = [embd_offset] + [o.offset for o in outs]
        marks = np.zeros((len(pinned), _N_INT_ARGS), np.int64)
        marks[:, 0] = _OP_COPY
        marks[:, 1] = pinned
        marks[:, 2] = pinned
        both = np.concatenate([self.code, marks])
        size = _pack_arena(both, tracer.regions, set(pinned))
        self.code = np.ascontiguousarray(both[:n])
        self.embd_offset = int(both[n, 1])
        self.outs = [_Sym(int(both[n + 1 + i, 1]), o.shape) for i, o in enumerate(outs)]
        # (address, rows, row bytes, type) of each weight, in the x8 layout where the
        # backend multiplies it so (its type + _X8); the arrays are kept alive here
        self.weights, meta = [], []
        for w in tracer.weights:
            x8 = tracer.backend.x8_rows(w)
            a = np.ascontiguousarray(w.data if x8 is None else x8)
            self.weights.append(a)
            code = int(w.type) + (0 if x8 is None else _X8)
            meta.append((a.ctypes.data, a.shape[0], a.shape[1], code))
        self.wmeta = np.array(meta, np.int64).reshape(-1, 4)
        self.consts = (
            np.concatenate(tracer.consts) if tracer.consts else np.zeros(0, np.float32)
        ).astype(np.float32)
        self.arena = np.zeros(max(size, 1), np.float32)
        self.traced_size = tracer.arena_size  # the arena without reuse
        self.trusted = False
        self._lock = threading.Lock()

    def run(self, tokens, positions, starts, cmeta, n_tasks: int, top_k: int = 0):
        """The outputs' rows (one array per segment), or with ``top_k`` each row's
        ``top_k`` largest logits as ``TOP_LOGITS`` (``Backend.to_host_top``): selected in
        the arena, the whole rows never copied out."""
        w = self.embedding
        rows = kernels.get_rows(w.data, tokens, w.type, w.k)
        # one run at a time: the arena is the program's, and runs release the GIL (two
        # sequences of one engine may step in two threads)
        with self._lock:
            self.arena[self.embd_offset : self.embd_offset + rows.size] = rows.reshape(-1)
            _run(
                self.code,
                self.fargs,
                self.wmeta,
                self.consts,
                self.arena,
                cmeta,
                positions,
                starts,
                n_tasks,
                ggml_math.gelu_table(),
            )
            arena = self.arena
            if top_k <= 0:
                return [
                    arena[o.offset : o.offset + o.size].reshape(o.shape).copy() for o in self.outs
                ]
            n_vocab = self.outs[0].shape[-1]
            starts_ = [o.offset + r * n_vocab for o in self.outs for r in range(o.size // n_vocab)]
            k = min(top_k, n_vocab)
            ids = np.empty((len(starts_), k), np.int32)
            vals = np.empty((len(starts_), k), np.float32)
            _top_rows(arena, np.array(starts_, np.int64), n_vocab, ids, vals)
        top = np.empty(ids.shape, TOP_LOGITS)
        top["id"], top["logit"] = ids, vals
        out, at = [], 0
        for o in self.outs:
            n = o.size // n_vocab
            out.append(top[at : at + n])
            at += n
        return out


@nb.njit(cache=True, nogil=True, parallel=True)
def _top_rows(arena, starts, n_vocab, ids, vals):
    """Row r (``arena[starts[r] :][:n_vocab]``)'s k largest logits, best first, into
    ``ids[r]`` and ``vals[r]``, in ``top_logits``' order: the sampler's own selection
    (``_top_k_indices``: equal logits by lower id), then, where the row has fewer than k
    numbers, its NaNs by id."""
    k = ids.shape[1]
    for r in prange(starts.shape[0]):
        row = arena[starts[r] : starts[r] + n_vocab]
        best = _top_k_indices(row, k)
        m = best.shape[0]
        for a in range(m):
            ids[r, a] = best[a]
            vals[r, a] = row[best[a]]
        i = 0
        while m < k:
            if row[i] != row[i]:
                ids[r, m] = i
                vals[r, m] = row[i]
                m += 1
            i += 1


_KIND_NAMES = {
    _OP_SCALE: "scale",
    _OP_ADD: "add",
    _OP_MUL: "mul",
    _OP_RMS_NORM: "rms_norm",
    _OP_MATMUL: "matmul",
    _OP_GATED: "gated matmul",
    _OP_ROPE: "rope",
    _OP_STORE_KV: "store_kv",
    _OP_ATTENTION: "attention",
    _OP_SILU_MUL: "silu_mul",
    _OP_GELU_MUL: "gelu_mul",
    _OP_LORA: "lora",
    _OP_ADD_CONST: "add_const",
    _OP_SOFTCAP: "softcap",
    _OP_COPY: "copy",
}


def kind_times(program: _Program, args: tuple, reps: int = 10) -> list[tuple[str, int, float]]:
    """Where a compiled step's time goes: (kind, rows, ms) for each kind of program row run
    alone (medians of ``reps`` runs, each set of runs after one run of the whole program,
    so that every row reads values of a real step: dropping a kind instead would feed the
    others values that float arithmetic may take slower paths on), largest first, after
    ("all", rows, the whole program's ms). A benchmark's diagnostic: the runs leave the
    arena and the caches' rows of the step rewritten (``args``: a run's tokens, positions,
    starts, cache table and tasks, which must still point at live caches)."""
    _, positions, starts, cmeta, n_tasks = args
    code, fargs = program.code, program.fargs
    # (a group of rows, the attention of several segments or LoRA terms, is one row read
    # with the rows after it: all of one kind, so they are kept or dropped together)
    ops = code[:, 0]

    def run(c, f) -> None:
        _run(c, f, program.wmeta, program.consts, program.arena, cmeta, positions, starts,
             n_tasks, ggml_math.gelu_table())  # fmt: skip

    def ms(keep: np.ndarray) -> float:
        run(code, fargs)
        c, f = np.ascontiguousarray(code[keep]), np.ascontiguousarray(fargs[keep])
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(c, f)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    rows = [("all", len(code), ms(np.ones(len(code), dtype=bool)))]
    for op in np.unique(ops):
        rows.append((_KIND_NAMES.get(int(op), str(op)), int((ops == op).sum()), ms(ops == op)))
    return rows[:1] + sorted(rows[1:], key=lambda r: -r[2])


_BLOCKS: dict[int, tuple] = {}  # id(cache) -> (weakref to it, its end layers' arrays, blocks)


def _cache_blocks(cache) -> tuple[np.ndarray, np.ndarray] | None:
    """The cache's (n_layers, n_ctx, n_kv_heads, head_dim) F16 blocks, if its per-layer
    arrays are views of them (as ``CPUBackend.new_kv_cache`` makes them). Checked once per
    cache and arrays of its first and last layers (a server's slots step with the same
    caches for hours); the entry goes when the cache does, so it keeps no array alive."""
    ends = (cache.k[0], cache.v[0], cache.k[-1], cache.v[-1])
    key = id(cache)
    hit = _BLOCKS.get(key)
    if (
        hit is not None
        and hit[0]() is cache
        and all(a is b for a, b in zip(hit[1], ends, strict=True))
    ):
        return hit[2]
    blocks = _check_blocks(cache)
    _BLOCKS[key] = (weakref.ref(cache, lambda _, key=key: _BLOCKS.pop(key, None)), ends, blocks)
    return blocks


def _check_blocks(cache) -> tuple[np.ndarray, np.ndarray] | None:
    k0, v0 = cache.k[0], cache.v[0]
    k4, v4 = k0.base, v0.base
    if (
        not isinstance(k4, np.ndarray)
        or not isinstance(v4, np.ndarray)
        or k4.ndim != 4
        or v4.ndim != 4
        or k4.dtype != np.uint16
        or v4.dtype != np.uint16
        or len(k4) != len(cache.k)
        or not k4.flags.c_contiguous
        or not v4.flags.c_contiguous
    ):
        return None
    for layer in range(len(cache.k)):
        if cache.k[layer].base is not k4 or cache.v[layer].base is not v4:
            return None
    if k4[0].ctypes.data != k0.ctypes.data or v4[0].ctypes.data != v0.ctypes.data:
        return None
    return k4, v4


def batch_shape(segments) -> tuple | None:
    """The key of a batch's program: (tokens, logit rows) per segment; None for a batch no
    program takes (too many rows, or two segments on one cache)."""
    if not segments or sum(len(s.tokens) for s in segments) > MAX_ROWS:
        return None
    if len({id(s.cache) for s in segments}) != len(segments):
        return None
    key = []
    for s in segments:
        n = len(s.tokens)
        if n == 0:
            return None
        rows = (
            None if s.logit_rows is None else tuple(np.asarray(s.logit_rows).reshape(-1).tolist())
        )
        if rows == (n - 1,):
            rows = None
        key.append((n, rows))
    return tuple(key)


# ---- the program interpreter's first compile, off the decoding thread ----

# ``_run``'s argument types (every program passes the same ones)
_RUN_SIGNATURE = (
    types.int64[:, ::1],  # code
    types.float64[:, ::1],  # fargs
    types.int64[:, ::1],  # wmeta
    types.float32[::1],  # consts
    types.float32[::1],  # arena
    types.int64[:, :, ::1],  # cmeta
    types.int64[::1],  # positions
    types.int64[::1],  # starts
    types.int64,  # n_tasks
    types.float32[::1],  # the GELU table
)


class _BackgroundCompile:
    """``_run``'s machine code, made in a thread of its own.

    Its first compile on a fresh machine takes about a minute on two cores (a few hundred
    milliseconds from the disk cache after that), and a step that calls ``_run`` first
    waits for it: an interactive front end (the CLI, the server) would stop mid-answer for
    that long. With ``CPUBackend.compile_in_background``, steps run op by op (the same
    logits) until the thread is done. An error in the thread is kept and ``ready`` says
    True, so that the next call compiles in the caller and raises it there."""

    LOAD_WAIT = 2.0  # seconds

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @staticmethod
    def compiled() -> bool:
        return _RUN_SIGNATURE in _run.overloads

    def ready(self) -> bool:
        """True if ``_run`` has its code (or failed to get it). Else starts the thread (once)
        and gives it ``LOAD_WAIT`` seconds, enough to load the code from the disk cache,
        so that a warm start does not decode op by op: False if it is still compiling."""
        if self.compiled() or self.error is not None:
            return True
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._compile, name="picollama-step-compile", daemon=True
                )
                self._thread.start()
                self._thread.join(self.LOAD_WAIT)
        return self.compiled() or self.error is not None

    def _compile(self) -> None:
        try:
            _run.compile(_RUN_SIGNATURE)
        except Exception as err:  # kept for the caller's own compile to raise
            self.error = err

    def pending(self) -> bool:
        """A compile is running."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running compile; True if none is left running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.pending()


BACKGROUND = _BackgroundCompile()


class StepCompiler:
    """Per model and batch shape: trace the forward pass once the shape recurs, prove the
    program once, then run it compiled."""

    def __init__(self, backend):
        self.backend = backend
        # model -> {batch shape: program, False (untraceable) or a count of sightings}
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # a benchmark's diagnostic (``kind_times``): with keep_last, the last trusted run's
        # program and arguments (raw cache addresses: use them while the caches live)
        self.keep_last = False
        self.last: tuple | None = None

    def program(self, model, shape=((1, None),)):
        """The program of ``shape`` for ``model`` (None before it was traced; False if it
        cannot be)."""
        entry = self._programs.get(model, {}).get(shape)
        return entry if isinstance(entry, (_Program, bool)) else None

    def forward_step(self, model, segments: list) -> list[np.ndarray]:
        shape = batch_shape(segments)
        if shape is None:
            return model.forward_batch(segments)
        blocks = [_cache_blocks(s.cache) for s in segments]
        if any(b is None for b in blocks) or len({id(b[0]) for b in blocks}) != len(blocks):
            return model.forward_batch(segments)
        programs = self._programs.setdefault(model, {})
        entry = programs.get(shape, 0)
        if entry is False:
            return model.forward_batch(segments)
        if not isinstance(entry, _Program):
            # a prompt's chunk (several tokens, the last one's logits) seldom recurs: trace
            # it when it does. One token per sequence (decode, the server's batches) and
            # every row's logits (a speculative round) recur from the start.
            prompt_like = any(n > 1 and rows is None for n, rows in shape)
            if entry == 0 and prompt_like:
                if len(programs) < 4 * MAX_PROGRAMS:
                    programs[shape] = 1
                return model.forward_batch(segments)
            if sum(isinstance(p, _Program) for p in programs.values()) >= MAX_PROGRAMS:
                return model.forward_batch(segments)
            programs[shape] = self._trace(model, segments)
            return model.forward_batch(segments)
        for s in segments:
            if s.start + len(s.tokens) > s.cache.n_ctx:
                raise BackendError(
                    f"KV cache of {s.cache.n_ctx} positions overflows at {s.start + len(s.tokens)}"
                )
        tokens = np.concatenate([np.asarray(s.tokens, np.int64).reshape(-1) for s in segments])
        positions = np.concatenate(
            [np.arange(s.start, s.start + len(s.tokens), dtype=np.int64) for s in segments]
        )
        starts = np.array([s.start for s in segments], np.int64)
        cmeta = np.array(
            [[(a.ctypes.data, *a.shape) for a in pair] for pair in blocks], np.int64
        )  # (segments, K/V, address and 4 dims)
        n_tasks = max(1, 4 * nb.get_num_threads())
        args = (tokens, positions, starts, cmeta, n_tasks)
        if entry.trusted:
            if self.keep_last:
                self.last = (entry, args)
            # each sampler's largest logits, or whole rows (``Segment.top_k``)
            return entry.run(*args, top_k=logits_top_k(segments))
        if getattr(self.backend, "compile_in_background", False) and not BACKGROUND.ready():
            return model.forward_batch(segments)  # until the interpreter's code is made
        # the program first, then the op-by-op pass, whose cache rows are the ones kept
        got = entry.run(*args)
        expected = model.forward_batch(segments)
        if len(expected) == len(got) and all(
            np.array_equal(e, g) for e, g in zip(expected, got, strict=True)
        ):
            entry.trusted = True
        else:
            programs[shape] = False
        return expected

    def _trace(self, model, segments):
        tracer = _Tracer(self.backend, segments)
        saved = model.backend
        # a wrapper of the backend (LoRA adapters: ``picollama.lora``) wraps the tracer instead
        rebind = getattr(saved, "rebind", None)
        model.backend = rebind(tracer) if rebind is not None else tracer
        try:
            out = model.forward_batch(segments)
        except Untraceable:
            return False
        finally:
            model.backend = saved
        if (
            not isinstance(out, list)
            or len(out) != len(segments)
            or not all(isinstance(o, _Sym) for o in out)
            or tracer.embedding is None
        ):
            return False
        return _Program(tracer, out)
