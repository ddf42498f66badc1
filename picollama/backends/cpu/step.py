"""Compiled decode steps: one token's forward pass run by one Numba function.

A decode step of a small model is hundreds of short ops (a norm of 576 floats, a RoPE of
nine heads), and calling each from Python costs more than it computes: about 2 ms of a
7 ms SmolLM2 step. So the CPU backend traces a model's single-token ``forward_batch``
once, with symbolic arrays in place of numpy ones (``_Tracer``), into a program: one row of
integers and floats per op, buffers as offsets into one float32 arena, weights as indices
into a list. ``_run`` then executes the program in compiled code, calling the same kernels
the op-by-op path calls (``simd`` block dots, ggml's norm, RoPE, SwiGLU/GeGLU and flash
attention), so its logits are the op-by-op path's bit for bit. Each matmul is one parallel
region over row ranges, as before.

What may vary between steps is only the token id and the position: the tracer records
every argument that equals the traced position as "the position", and refuses anything it
cannot express (a weight type without a SIMD kernel, a position used another way, an
array operation it does not know), in which case the model keeps the op-by-op path. A
program is trusted only after its first run gave the op-by-op path's logits exactly.
"""

from __future__ import annotations

import weakref

import numba as nb
import numpy as np
from numba import prange
from numba.typed import List

from picollama.backends.base import BackendError, Weight
from picollama.backends.cpu import attention as _attn
from picollama.backends.cpu import ggml_math, kernels, ops
from picollama.backends.cpu.lora_kernels import LoraB, _row, lora_rows
from picollama.backends.cpu.qdot import simd_quantize, simd_rows
from picollama.backends.cpu.qdot_act import f32_to_f16_bits
from picollama.backends.cpu.simd import SIMD_TYPES
from picollama.gguf.constants import GGMLType

__all__ = ["StepCompiler"]

# opcodes of a program row: [op, a0, a1, ...] in ``code``, float arguments in ``fargs``
_OP_SCALE, _OP_ADD, _OP_MUL, _OP_RMS_NORM, _OP_MATMUL, _OP_GATED = 1, 2, 3, 4, 5, 6
_OP_ROPE, _OP_STORE_KV, _OP_ATTENTION, _OP_SILU_MUL, _OP_GELU_MUL = 7, 8, 9, 10, 11
_OP_LORA = 12  # a LoRA adapter's term on a projection (``lora_kernels``)
_OP_ADD_CONST, _OP_SOFTCAP = 13, 14  # a bias added to every row; cap * tanh(x / cap)
_N_INT_ARGS = 13

_Q4_0 = int(GGMLType.Q4_0)
_Q4_1 = int(GGMLType.Q4_1)
_Q5_0 = int(GGMLType.Q5_0)
_Q5_1 = int(GGMLType.Q5_1)
_Q8_0 = int(GGMLType.Q8_0)
_Q4_K = int(GGMLType.Q4_K)
_Q6_K = int(GGMLType.Q6_K)
assert {_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q6_K} == {int(t) for t in SIMD_TYPES}


class Untraceable(Exception):
    """The model's step does something a program cannot express; it runs op by op."""


# ---- the interpreter ----


@nb.njit(cache=True)
def _quantize_any(qt, x):
    """x (1, k) in the dot type of weight type ``qt``: ``(xq, xd, xs, bsums)``."""
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


@nb.njit(cache=True)
def _rows_any(qt, w, xq, xd, xs, bsums, out, lo, hi):
    """Outputs ``lo..hi`` of ``x @ W.T`` for weights of type ``qt``."""
    if qt == _Q4_0:
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


@nb.njit(cache=True, parallel=True)
def _matmuls(arena, src, k, ws, wtypes, ins, n_tasks):
    """Up to three products of one activation (``ins``: rows of (wid, dst, m), wid -1 for
    none): one quantization and one parallel region when the weights share a type."""
    x = arena[src : src + k].reshape(1, k)
    qt = wtypes[ins[0, 0]]
    same = True
    for j in range(1, 3):
        if ins[j, 0] >= 0 and wtypes[ins[j, 0]] != qt:
            same = False
    if same:
        xq, xd, xs, bsums = _quantize_any(qt, x)
        # a row range of each product per task (an absent product has 0 rows)
        w0, w1, w2 = ws[ins[0, 0]], ws[max(ins[1, 0], 0)], ws[max(ins[2, 0], 0)]
        m0 = ins[0, 2]
        m1 = ins[1, 2] if ins[1, 0] >= 0 else 0
        m2 = ins[2, 2] if ins[2, 0] >= 0 else 0
        o0 = arena[ins[0, 1] : ins[0, 1] + m0].reshape(1, m0)
        o1 = arena[max(ins[1, 1], 0) : max(ins[1, 1], 0) + m1].reshape(1, m1)
        o2 = arena[max(ins[2, 1], 0) : max(ins[2, 1], 0) + m2].reshape(1, m2)
        for t in prange(n_tasks):
            _rows_any(qt, w0, xq, xd, xs, bsums, o0, t * m0 // n_tasks, (t + 1) * m0 // n_tasks)
            _rows_any(qt, w1, xq, xd, xs, bsums, o1, t * m1 // n_tasks, (t + 1) * m1 // n_tasks)
            _rows_any(qt, w2, xq, xd, xs, bsums, o2, t * m2 // n_tasks, (t + 1) * m2 // n_tasks)
        return
    for j in range(3):
        wid = ins[j, 0]
        if wid < 0:
            continue
        qj = wtypes[wid]
        m = ins[j, 2]
        xq, xd, xs, bsums = _quantize_any(qj, x)
        out = arena[ins[j, 1] : ins[j, 1] + m].reshape(1, m)
        w = ws[wid]
        for t in prange(n_tasks):
            _rows_any(qj, w, xq, xd, xs, bsums, out, t * m // n_tasks, (t + 1) * m // n_tasks)


@nb.njit(cache=True)
def _run(code, fargs, ws, wtypes, consts, arena, k_cache, v_cache, pos, n_tasks, gelu):
    """Execute a program for one token at position ``pos`` (its embedding already in the
    arena); caches are (n_layers, n_ctx, n_kv_heads, head_dim) uint16 F16 bits."""
    positions = np.full(1, pos, np.int64)
    ins = np.full((3, 3), -1, np.int64)
    for i in range(code.shape[0]):
        c = code[i]
        op = c[0]
        if op == _OP_SCALE:
            s = np.float32(fargs[i, 0])
            for j in range(c[3]):
                arena[c[2] + j] = arena[c[1] + j] * s
        elif op == _OP_ADD:
            for j in range(c[4]):
                arena[c[3] + j] = arena[c[1] + j] + arena[c[2] + j]
        elif op == _OP_MUL:
            for j in range(c[4]):
                arena[c[3] + j] = arena[c[1] + j] * arena[c[2] + j]
        elif op == _OP_ADD_CONST:
            # [op, src, const, dst, rows, d]
            d = c[5]
            for r in range(c[4]):
                for j in range(d):
                    arena[c[3] + r * d + j] = arena[c[1] + r * d + j] + consts[c[2] + j]
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
            # [op, src, k, wid0, dst0, m0, wid1, dst1, m1, wid2, dst2, m2, act/dst]
            for j in range(3):
                ins[j, 0] = c[3 + 3 * j]
                ins[j, 1] = c[4 + 3 * j]
                ins[j, 2] = c[5 + 3 * j]
            _matmuls(arena, c[1], c[2], ws, wtypes, ins, n_tasks)
            if op == _OP_GATED:
                m = c[5]
                g = arena[c[4] : c[4] + m].reshape(1, m)
                u = arena[c[7] : c[7] + m].reshape(1, m)
                out = arena[c[10] : c[10] + m].reshape(1, m)
                if c[12] == 0:
                    ggml_math._silu_mul(g, u, out)
                else:
                    ggml_math._gelu_mul(g, u, out, gelu)
        elif op == _OP_SILU_MUL or op == _OP_GELU_MUL:
            m = c[4]
            g = arena[c[1] : c[1] + m].reshape(1, m)
            u = arena[c[2] : c[2] + m].reshape(1, m)
            out = arena[c[3] : c[3] + m].reshape(1, m)
            if op == _OP_SILU_MUL:
                ggml_math._silu_mul(g, u, out)
            else:
                ggml_math._gelu_mul(g, u, out, gelu)
        elif op == _OP_ROPE:
            # [op, src, dst, n_heads, head_dim, n_rot, neox]; fargs: base, freq scale
            nh, hd = c[3], c[4]
            x = arena[c[1] : c[1] + nh * hd].reshape(1, nh, hd)
            out = arena[c[2] : c[2] + nh * hd].reshape(1, nh, hd)
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
            # [op, k_src, v_src, layer, n_k, n_v]: round to F16 as ggml's copy
            kc = k_cache[c[3], pos].reshape(-1)
            vc = v_cache[c[3], pos].reshape(-1)
            for j in range(c[4]):
                kc[j] = f32_to_f16_bits(arena[c[1] + j])
            for j in range(c[5]):
                vc[j] = f32_to_f16_bits(arena[c[2] + j])
        elif op == _OP_ATTENTION:
            # [op, q, dst, layer, n_heads, head_dim, window, head_dim_v]; fargs: scale, softcap
            nh, hd, hdv = c[4], c[5], c[7]
            q = arena[c[1] : c[1] + nh * hd].reshape(1, nh, hd)
            out = arena[c[2] : c[2] + nh * hdv].reshape(1, nh * hdv)
            kc = k_cache[c[3]]
            vc = v_cache[c[3]]
            scale = np.float32(fargs[i, 0])
            softcap = np.float32(fargs[i, 1])
            if nh * (pos + 1) * hd >= _attn._PARALLEL_MIN_WORK:
                _attn._parallel(q, kc, vc, pos, scale, c[6], softcap, out, True)
            else:
                _attn._serial(q, kc, vc, pos, scale, c[6], softcap, out, True)
        elif op == _OP_LORA and c[8] == 1:
            # [op, x, k, a_wid, bt_wid, y, dst, m, n_terms]; fargs: scale
            k, m = c[2], c[7]
            x = arena[c[1] : c[1] + k].reshape(1, k)
            y = arena[c[5] : c[5] + m].reshape(1, m)
            out = arena[c[6] : c[6] + m].reshape(1, m)
            s = np.float32(fargs[i, 0])
            lora_rows(x, ws[c[3]], wtypes[c[3]], ws[c[4]], wtypes[c[4]], s, y, out)
        elif op == _OP_LORA and c[8] > 1:
            _lora_terms(code, fargs, i, c[8], ws, wtypes, arena)


@nb.njit(cache=True, parallel=True)
def _lora_terms(code, fargs, first, n, ws, wtypes, arena):
    """LoRA terms of one input (Q, K and V; gate and up), program rows ``first ..``, a task
    each: the adapter's bytes stream through every core, not one. Each term is the same
    ``_row`` that ``lora_rows`` runs, so the floats are the op-by-op pass's."""
    for j in prange(n):
        c = code[first + j]
        k, m = c[2], c[7]
        t = np.empty(ws[c[3]].shape[0], np.float32)
        x = arena[c[1] : c[1] + k]
        y = arena[c[5] : c[5] + m]
        out = arena[c[6] : c[6] + m]
        s = np.float32(fargs[first + j, 0])
        _row(x, ws[c[3]], wtypes[c[3]], ws[c[4]], wtypes[c[4]], s, y, out, t)


# ---- tracing ----


class _Sym:
    """A symbolic float32 array: a region of the arena with a shape."""

    __slots__ = ("offset", "shape")

    def __init__(self, offset: int, shape: tuple[int, ...]):
        self.offset = offset
        self.shape = tuple(int(s) for s in shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

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
        # only whole-array row slices (a single sequence of one token) are expressible
        if isinstance(key, slice) and key.step in (None, 1):
            lo, hi, _ = key.indices(self.shape[0])
            if lo == 0 and hi == self.shape[0]:
                return self
        raise Untraceable(f"indexing {key!r}")

    def __array__(self, *args, **kwargs):
        raise Untraceable("a symbolic array was used as a numpy array")


class _Tracer:
    """Stands in for the CPU backend while a model's single-token step is traced."""

    def __init__(self, backend, token: int, pos: int):
        self.backend = backend
        self.token = token
        self.pos = pos
        self.rows: list[tuple[list[int], list[float]]] = []
        self.arena_size = 0
        self.weights: list = []
        self._wid: dict[int, int] = {}
        self.consts: list[np.ndarray] = []
        self.consts_size = 0
        self._cid: dict[int, int] = {}
        self.embedding = None  # (weight, arena offset)
        self.cache = None

    def __getattr__(self, name):
        raise Untraceable(f"backend attribute '{name}'")

    # -- bookkeeping --

    def _new(self, shape) -> _Sym:
        sym = _Sym(self.arena_size, shape)
        self.arena_size += sym.size
        return sym

    def _emit(self, op: int, ints: list[int], floats: tuple[float, ...] = ()) -> None:
        self.rows.append(([op, *ints], list(floats)))

    def _weight(self, w, types=SIMD_TYPES) -> int:
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

    def _at_pos(self, value) -> None:
        if np.asarray(value).reshape(-1).tolist() != [self.pos]:
            raise Untraceable("a position other than the step's")

    def _same(self, a: _Sym, b: _Sym) -> None:
        if a.size != b.size:
            raise Untraceable(f"shapes {a.shape} and {b.shape}")

    # -- the op interface --

    def from_host(self, a):
        raise Untraceable("a host array entering the step")

    def to_host(self, x):
        return self._sym(x)

    def get_rows(self, w, ids):
        if self.embedding is not None or np.asarray(ids).reshape(-1).tolist() != [self.token]:
            raise Untraceable("an embedding lookup other than the step's token")
        out = self._new((1, w.k))
        self.embedding = (w, out.offset)
        return out

    def take_rows(self, x, rows):
        x = self._sym(x)
        if x.shape[0] != 1 or np.asarray(rows).reshape(-1).tolist() != [0]:
            raise Untraceable("take_rows of several rows")
        return x

    def concat(self, parts):
        if len(parts) != 1:
            raise Untraceable("concat")
        return self._sym(parts[0])

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
        if x.shape[0] != 1 or x.shape[-1] != ws[0].k or len(ws) > 3:
            raise Untraceable("a matmul of several rows")
        ints, outs = [x.offset, ws[0].k], []
        for w in ws:
            if w.k != ws[0].k:
                raise Untraceable("matmuls of different widths")
            out = self._new((1, w.m))
            ints += [self._weight(w), out.offset, w.m]
            outs.append(out)
        ints += [-1, -1, 0] * (3 - len(ws))
        self._emit(op, ints + [extra])
        return outs

    def matmul(self, x, w):
        return self._products(_OP_MATMUL, x, (w,))[0]

    def matmul_many(self, x, ws):
        return self._products(_OP_MATMUL, x, tuple(ws))

    def gated_ffn(self, x, w_gate, w_up, act):
        if act not in ("silu", "gelu") or w_gate.m != w_up.m:
            raise Untraceable(f"gated_ffn '{act}'")
        out = self._new((1, w_gate.m))
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
        self._emit(op, [g.offset, u.offset, out.offset, g.size])
        return out

    def rope(self, x, positions, n_rot, freq_base, freq_scale=1.0, neox=False):
        x = self._sym(x)
        if x.ndim != 3 or x.shape[0] != 1:
            raise Untraceable("rope of several rows")
        self._at_pos(positions)
        out = self._new(x.shape)
        ints = [x.offset, out.offset, x.shape[1], x.shape[2], int(n_rot), int(bool(neox))]
        self._emit(_OP_ROPE, ints, (float(freq_base), float(freq_scale)))
        return out

    def _check_cache(self, cache):
        if self.cache is None:
            self.cache = cache
        elif cache is not self.cache:
            raise Untraceable("two caches in one step")

    def store_kv(self, cache, layer, k, v, start):
        k, v = self._sym(k), self._sym(v)
        self._check_cache(cache)
        self._at_pos(start)
        if k.size != cache.n_kv_heads * cache.head_dim_k:
            raise Untraceable("a key row of another size")
        if v.size != cache.n_kv_heads * cache.head_dim_v:
            raise Untraceable("a value row of another size")
        self._emit(_OP_STORE_KV, [k.offset, v.offset, int(layer), k.size, v.size])

    def attention(self, q, cache, layer, start, scale, window=0, softcap=0.0):
        q = self._sym(q)
        self._check_cache(cache)
        self._at_pos(start)
        if q.ndim != 3 or q.shape[0] != 1 or q.shape[2] != cache.head_dim_k:
            raise Untraceable("attention of several rows")
        n_heads = q.shape[1]
        out = self._new((1, n_heads * cache.head_dim_v))
        ints = [q.offset, out.offset, int(layer), n_heads, cache.head_dim_k, int(window)]
        self._emit(_OP_ATTENTION, ints + [cache.head_dim_v], (float(scale), float(softcap)))
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


class _Program:
    """A traced step, ready to run: the arrays ``_run`` takes."""

    def __init__(self, tracer: _Tracer, out: _Sym):
        n = len(tracer.rows)
        self.code = np.zeros((n, _N_INT_ARGS), np.int64)
        self.fargs = np.zeros((n, 2), np.float64)
        for i, (ints, floats) in enumerate(tracer.rows):
            self.code[i, : len(ints)] = ints
            self.fargs[i, : len(floats)] = floats
        _group_lora_terms(self.code, self.fargs)
        self.weights = List()
        for w in tracer.weights:
            view = np.asarray(w.data).view()
            view.flags.writeable = False
            self.weights.append(view)
        self.wtypes = np.array([int(w.type) for w in tracer.weights], np.int64)
        self.consts = (
            np.concatenate(tracer.consts) if tracer.consts else np.zeros(0, np.float32)
        ).astype(np.float32)
        self.arena = np.zeros(tracer.arena_size, np.float32)
        self.embedding, self.embd_offset = tracer.embedding
        self.out = out
        self.trusted = False

    def run(self, token: int, pos: int, k4: np.ndarray, v4: np.ndarray, n_tasks: int):
        w = self.embedding
        row = kernels.get_rows(w.data, np.array([token], np.int64), w.type, w.k)
        self.arena[self.embd_offset : self.embd_offset + w.k] = row[0]
        _run(
            self.code,
            self.fargs,
            self.weights,
            self.wtypes,
            self.consts,
            self.arena,
            k4,
            v4,
            pos,
            n_tasks,
            ggml_math.gelu_table(),
        )
        o = self.out
        return self.arena[o.offset : o.offset + o.size].reshape(o.shape).copy()


def _cache_blocks(cache) -> tuple[np.ndarray, np.ndarray] | None:
    """The cache's (n_layers, n_ctx, n_kv_heads, head_dim) F16 blocks, if its per-layer
    arrays are views of them (as ``CPUBackend.new_kv_cache`` makes them)."""
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


class StepCompiler:
    """Per model: trace the single-token step once, prove it once, then run it compiled."""

    def __init__(self, backend):
        self.backend = backend
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def forward_step(self, model, segments: list) -> list[np.ndarray]:
        seg = segments[0] if len(segments) == 1 else None
        if seg is None or len(seg.tokens) != 1:
            return model.forward_batch(segments)
        if seg.logit_rows is not None and np.asarray(seg.logit_rows).reshape(-1).tolist() != [0]:
            return model.forward_batch(segments)
        blocks = _cache_blocks(seg.cache)
        if blocks is None:
            return model.forward_batch(segments)
        token, pos = int(np.asarray(seg.tokens).reshape(-1)[0]), int(seg.start)
        program = self._programs.get(model)
        if program is False:
            return model.forward_batch(segments)
        if program is None:
            program = self._trace(model, segments, token, pos)
            self._programs[model] = program
            return model.forward_batch(segments)
        if pos + 1 > seg.cache.n_ctx:
            raise BackendError(f"KV cache of {seg.cache.n_ctx} positions overflows at {pos + 1}")
        n_tasks = max(1, 4 * nb.get_num_threads())
        if program.trusted:
            return [program.run(token, pos, *blocks, n_tasks)]
        expected = model.forward_batch(segments)
        got = program.run(token, pos, *blocks, n_tasks)
        if len(expected) == 1 and np.array_equal(expected[0], got):
            program.trusted = True
        else:
            self._programs[model] = False
        return expected

    def _trace(self, model, segments, token: int, pos: int):
        tracer = _Tracer(self.backend, token, pos)
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
            or len(out) != 1
            or not isinstance(out[0], _Sym)
            or tracer.embedding is None
            or tracer.cache is not segments[0].cache
        ):
            return False
        return _Program(tracer, out[0])
