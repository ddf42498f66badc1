"""The host's side of ``ring.cu``: which one-token matvecs of a decode graph run as phases
of one persistent launch, and the argument block that launch reads.

A chain is a run of consecutive one-token int8 matvecs of Q4_K / Q6_K weights in which
each one's x is the output of the one before (attn_output -> gate + up -> ffn_down -> the
next layer's Q/K/V + RoPE, or -> the output matrix): at most ``MAX_PHASES`` of them, the
first without a norm (its x comes from before the launch), every later normed one taking
its norm's sum of squares from the phase before (``_SumSquares`` links). The chain's
launch takes one block a multiprocessor (grid = the SM count: every block must be resident,
since each phase waits for all blocks of the phase before).
"""

from __future__ import annotations

import ctypes

import numpy as np

from picollama.backends.cuda import layout
from picollama.gguf.constants import GGMLType

__all__ = [
    "MAX_PHASES", "N_COUNTERS", "THREADS", "RingArgs", "args_bytes", "build_args", "chain_at",
    "group_warps", "phase_rows", "ring_smem", "rows_per_stage", "share_bytes", "slot_bytes",
]  # fmt: skip

MAX_PHASES = 4  # ring.cu's RING_MAX_PHASES
# RingArgs.counters: a phase's blocks done, the blocks done, a phase's next stage (RING_DYN)
N_COUNTERS = 2 * MAX_PHASES + 1
_XMAX = 14336  # RING_XMAX: the widest x
_WARPS = 16  # RING_WARPS
THREADS = (_WARPS + 1) * 32  # a block: the consumer warps and a producer warp
_ROPE_PAIRS = 128  # RING_ROPE_PAIRS
_HEAD = 256  # RING_HEAD: the barriers
_QTYPE = {qtype: i for i, qtype in enumerate(layout.RING_TYPES)}  # RingWeight.qtype


def slot_bytes() -> int:
    """Bytes of a ring slot (ring.cu's RING_SLOT_BYTES, a build variant's if set)."""
    return layout.define_value("RING_SLOT_BYTES", 48 * 1024)


def share_bytes() -> int:
    """Bytes of a consumer group's share of the ring (its RING_SLOTS / RING_GROUPS slots):
    a stage's room in a phase whose stages do not fit a slot (RingPhase.whole)."""
    slots, groups = layout.define_value("RING_SLOTS", 4), layout.define_value("RING_GROUPS", 4)
    return slots // groups * slot_bytes()


def group_warps() -> int:
    """Warps of a consumer group (ring.cu's RING_GW): the rows of a stage are shared by
    these, whole rows each."""
    return _WARPS // layout.define_value("RING_GROUPS", 4)


def ring_smem() -> int:
    """Dynamic shared memory of matvec_ring (ring.cu's carving: barriers, RoPE table, block
    sums, x's codes, scales and half sums, then the slots)."""
    head = _HEAD + _ROPE_PAIRS * 8 + _WARPS * 8
    head += _XMAX + _XMAX // 32 * 4 + _XMAX // 16 * 4
    head = (head + 127) // 128 * 128
    return head + layout.define_value("RING_SLOTS", 4) * slot_bytes()


class _Weight(ctypes.Structure):  # RingWeight
    _fields_ = [
        ("f", ctypes.c_uint64 * 4), ("fsz", ctypes.c_int * 4), ("qtype", ctypes.c_int),
        ("m", ctypes.c_int), ("rows", ctypes.c_int), ("y", ctypes.c_uint64),
    ]  # fmt: skip


class _Phase(ctypes.Structure):  # RingPhase
    _fields_ = [
        ("w", _Weight * 3), ("n_w", ctypes.c_int), ("kind", ctypes.c_int), ("k", ctypes.c_int),
        ("act", ctypes.c_int), ("n_stages", ctypes.c_int), ("whole", ctypes.c_int),
        ("x", ctypes.c_uint64),
        ("norm_w", ctypes.c_uint64), ("eps", ctypes.c_float), ("ssq_in", ctypes.c_uint64),
        ("ssq_n", ctypes.c_int), ("resid", ctypes.c_uint64), ("ssq_out", ctypes.c_uint64),
        ("pos", ctypes.c_uint64), ("start", ctypes.c_uint64), ("kcs", ctypes.c_uint64),
        ("vcs", ctypes.c_uint64), ("head_dim", ctypes.c_int), ("head_dim_v", ctypes.c_int),
        ("n_rot", ctypes.c_int), ("n_ctx", ctypes.c_int), ("theta_scale", ctypes.c_float),
        ("freq_scale", ctypes.c_float),
    ]  # fmt: skip


class RingArgs(ctypes.Structure):  # RingArgs
    _fields_ = [
        ("ph", _Phase * MAX_PHASES), ("n_phases", ctypes.c_int), ("counters", ctypes.c_uint64),
    ]  # fmt: skip


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


def rows_per_stage(
    qtype: GGMLType, k: int, m: int, per_row: int, even: bool, room: int | None = None
) -> int:
    """Rows of a weight a stage takes (each of gate and up with ``per_row`` 2): the most, a
    power of two and at most 16 / per_row, whose bytes fit ``room`` (a slot's by default),
    whose fields are whole bulk copies and that divide m, and that the warps of a group
    share as whole rows (as whole pairs with ``even``: RoPE's pairs); 0 if none."""
    room = slot_bytes() if room is None else room
    bpr = k // 256
    row = bpr * layout.ggml_block_bytes(qtype)
    fields = [size for _src, size in layout.FIELDS[qtype][1]]
    r = _WARPS // per_row
    while r >= group_warps() * (2 if even else 1):
        # each field of a stage is one bulk copy: a multiple of 16 bytes from a 16-byte
        # boundary (Q6_K's 2-byte d of 2 rows of 512 is 8 bytes: no copy can move it)
        whole = all(r * bpr * size % 16 == 0 for size in fields)
        if whole and per_row * r * row <= room and m % r == 0:
            return r
        r //= 2
    return 0


def phase_rows(mv) -> tuple[bool, list[int]] | None:
    """A matvec's rows a stage, each weight's, in slots (whole False) or, where some weight
    has none there, in a group's whole share (whole True); None where neither holds."""
    per_row = 2 if mv.act else 1
    even = mv.rope is not None
    for whole, room in ((False, slot_bytes()), (True, share_bytes())):
        rows = [rows_per_stage(dw.qtype, mv.k, dw.m, per_row, even, room) for dw in mv.weights]
        if all(rows):
            return whole, rows
    return None


def _eligible(mv, matvec_type) -> bool:
    """One token of an int8 matvec the ring multiplies (types, width, RoPE's form)."""
    if not isinstance(mv, matvec_type) or not mv.q8 or mv.n != 1:
        return False
    if mv.k % 256 or mv.k > _XMAX:
        return False
    if any(dw.qtype not in _QTYPE for dw in mv.weights):
        return False
    if mv.act and len({dw.qtype for dw in mv.weights}) > 1:  # a warp takes gate and up rows
        return False
    if mv.act and mv.act not in (1, 2):
        return False
    rs = mv.rope
    if rs is not None:
        if rs.neox or rs.n_rot // 2 > _ROPE_PAIRS or rs.head_dim % 2 or rs.head_dim_v % 2:
            return False
    return phase_rows(mv) is not None


def chain_at(launches: list, i: int, matvec_type) -> list:
    """The chain of launches starting at ``launches[i]`` (see the module's doc), or []."""
    first = launches[i]
    if not _eligible(first, matvec_type) or first.norm_w is not None:
        return []
    chain = [first]
    for mv in launches[i + 1 :]:
        if len(chain) == MAX_PHASES or not _eligible(mv, matvec_type):
            break
        prev = chain[-1]
        y = prev.ys[0]
        if mv.x.data.ptr != y.data.ptr or mv.x.size != y.size:
            break
        if mv.norm_w is not None and (mv.ssq_in is None or mv.ssq_in is not prev.ssq_out):
            break
        chain.append(mv)
    return chain if len(chain) >= 2 else []


def build_args(chain: list, counters, n_blocks: int) -> RingArgs:
    """The argument block of a chain's launch (``n_blocks``: its grid, which writes the
    sums of squares the next normed phase reads)."""
    args = RingArgs()
    args.n_phases = len(chain)
    args.counters = _ptr(counters)
    for p, mv in enumerate(chain):
        ph = args.ph[p]
        whole, rows = phase_rows(mv)
        ph.whole = int(whole)
        ph.kind = 1 if mv.act else (2 if mv.rope is not None else 0)
        ph.k, ph.act, ph.n_w = mv.k, mv.act, len(mv.weights)
        stages = 0
        for j, dw in enumerate(mv.weights):
            w = ph.w[j]
            lay = layout.device_layout(dw.qtype, dw.k, dw.m)
            for f, (offset, _src, size) in enumerate(lay.regions):
                w.f[f], w.fsz[f] = _ptr(dw.buf) + offset, size
            w.qtype, w.m = _QTYPE[dw.qtype], dw.m
            w.rows = rows[j]
            w.y = _ptr(mv.ys[j] if j < len(mv.ys) else None)
            stages += dw.m // w.rows
        ph.n_stages = mv.weights[0].m // ph.w[0].rows if mv.act else stages
        ph.x, ph.eps = _ptr(mv.x), float(mv.eps)
        ph.norm_w = _ptr(mv.norm_w)
        if mv.norm_w is not None:  # the phase before wrote x's sums, a block each
            ph.ssq_in, ph.ssq_n = _ptr(mv.ssq_in.buf), n_blocks
        ph.resid = _ptr(mv.resid)
        if mv.ssq_out is not None:
            ph.ssq_out = _ptr(mv.ssq_out.buf)
            mv.ssq_out.n = n_blocks  # for a normed reader after the chain
        rs = mv.rope
        if rs is not None:
            ph.pos, ph.start, ph.kcs, ph.vcs = map(_ptr, (rs.pos, rs.start, rs.kcs, rs.vcs))
            ph.head_dim, ph.head_dim_v, ph.n_rot, ph.n_ctx = (
                rs.head_dim, rs.head_dim_v, rs.n_rot, rs.n_ctx,
            )  # fmt: skip
            ph.theta_scale, ph.freq_scale = float(rs.theta_scale), float(rs.freq_scale)
    return args


def args_bytes(args: RingArgs) -> np.ndarray:
    """The argument block as the bytes to copy to the device."""
    return np.frombuffer(bytes(args), dtype=np.uint8)
