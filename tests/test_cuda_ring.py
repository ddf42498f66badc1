"""The persistent ring kernel (ring.cu, ``PICOLLAMA_CUDA_DEFINES=RING=1``): chains of
one-token Q4_K / Q6_K matvecs as the phases of one launch, against the same graphs with a
launch a matvec.

Every row is one warp's, as in the one-token kernel (matvec_q8_n1), lanes taking the
same chunks in the same order: a row's value is that kernel's bit for bit. A normed
phase's sum of squares comes from the ring's blocks instead of the one-token kernel's
(float64 sums over other sets of rows: at most an ulp of the norm's float32 scale, and
then rarely an int8 code by one), so the bound is test_graph_replay_equals_eager's for
fused int8 graphs, 1e-4 of the largest logit, while a wrong row, slot, phase or position
moves logits by O(1). Skips without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from model_factory import TinySpec, write_tiny_model
from test_cuda_models import _TRUST_AFTER, _cuda, _greedy

from picollama.gguf import GGMLType

# ffn_down of the 8B's width (Q6_K: 4 rows a stage, a warp of each group a row), value
# rows in Q6_K in one layer, Q8_0 in another (that layer's Q/K/V are not a phase)
RING = TinySpec(
    n_layers=3,
    n_embd=512,
    n_heads=8,
    n_kv_heads=4,
    head_dim=64,
    n_ff=14336,
    weight_type=GGMLType.Q4_K,
    tied=False,
    seed=17,
    overrides={
        **{f"blk.{i}.ffn_down.weight": ((14336, 512), GGMLType.Q6_K) for i in range(3)},
        "blk.1.attn_v.weight": ((512, 256), GGMLType.Q6_K),
        "blk.2.attn_v.weight": ((512, 256), GGMLType.Q8_0),
        "output.weight": ((512, 258), GGMLType.Q6_K),
    },
)


# the ring as built by default, and with its stages handed out by a counter (4 atomics in
# flight), one stage ahead of each phase's x, two slots a group (ffn_down's 14336-wide Q6_K
# rows in a group's whole share, gate + up in slots) and x's codes in order (schedules and
# storage orders only: the same bits)
_VARIANTS = "RING=1,RING_DYN=4,RING_BCAP=1,RING_SLOTS=8,RING_SLOT_BYTES=24576,MVQ_XSWZ=0"


@pytest.mark.parametrize("defines", ["RING=1", _VARIANTS])
def test_ring_chains_match_a_launch_a_matvec(tmp_path, monkeypatch, defines):
    _cuda()
    path = tmp_path / "ring.gguf"
    write_tiny_model(path, RING)
    monkeypatch.delenv("PICOLLAMA_CUDA_DEFINES", raising=False)
    plain = _cuda(graphs=True, dependent_launch=True)
    tokens_p, logits_p = _greedy(plain, path, n_gen=12)
    assert plain.graph_stats["ring"] == 0
    monkeypatch.setenv("PICOLLAMA_CUDA_DEFINES", defines)
    ringed = _cuda(graphs=True, dependent_launch=True)
    tokens_r, logits_r = _greedy(ringed, path, n_gen=12)
    # layer 0's attn_output .. layer 1's Q/K/V; layer 1's attn_output .. ffn_down (layer
    # 2's Q/K/V have a Q8_0 weight); layer 2's attn_output .. ffn_down (the output matrix's
    # 258 rows of 512 take no stage of whole bulk copies)
    assert ringed.graph_stats["ring"] == 3
    assert ringed.graph_stats["kernels"] < plain.graph_stats["kernels"]
    assert ringed.graph_stats["whole"] == 12 - 1 - _TRUST_AFTER
    assert tokens_r == tokens_p
    err = np.abs(logits_r - logits_p).max() / np.abs(logits_p).max()
    assert err <= 1e-4, err
    assert np.isfinite(logits_r).all()
    print(f"ring ({defines}): largest logit difference {err:.2e} of the largest logit")


def test_ring_args_mirror_the_kernels_structures():
    import ctypes

    from picollama.backends.cuda import ring

    # ring.cu static_asserts the same sizes and offsets
    assert ctypes.sizeof(ring.RingArgs) == 1424 and ctypes.sizeof(ring._Phase) == 352
    assert ring._Phase.x.offset == 240 and ring.RingArgs.counters.offset == 1416
    assert ring._Phase.whole.offset == 236
    # rows a stage: 16 of Q4_K 4096 (36 KB), 8 of Q6_K 4096, 4 of Q6_K 14336 (46 KB); gate
    # and up 8 each; a group's warps take whole rows (whole RoPE pairs); none where no
    # such power of two divides m
    assert ring.rows_per_stage(GGMLType.Q4_K, 4096, 14336, 1, False) == 16
    assert ring.rows_per_stage(GGMLType.Q6_K, 4096, 1024, 1, True) == 8
    assert ring.rows_per_stage(GGMLType.Q6_K, 14336, 4096, 1, False) == 4
    assert ring.rows_per_stage(GGMLType.Q4_K, 4096, 14336, 2, False) == 8
    assert ring.group_warps() == 4
    assert ring.rows_per_stage(GGMLType.Q4_K, 4096, 4100, 1, False) == 4
    assert ring.rows_per_stage(GGMLType.Q4_K, 4096, 4100, 1, True) == 0
    assert ring.rows_per_stage(GGMLType.Q4_K, 4096, 4098, 1, False) == 0
    # Q6_K's d of 2 rows of 512 would be an 8-byte copy; 4 rows would not divide 258
    assert ring.rows_per_stage(GGMLType.Q6_K, 512, 258, 1, False) == 0
    assert ring.rows_per_stage(GGMLType.Q6_K, 512, 256, 1, True) == 16
    assert ring.ring_smem() <= 227 * 1024


def test_ring_phases_in_slots_or_a_groups_share(monkeypatch):
    """Two 24 KB slots a group: stages fit a slot where they can (gate + up: 4 rows of
    each, 18 KB), and a phase whose weight has no such stage (ffn_down's Q6_K rows of 14336
    are 11.5 KB: 2 rows, fewer than a group's 4 warps) takes a group's 48 KB share."""
    from types import SimpleNamespace as NS

    from picollama.backends.cuda import layout, ring

    monkeypatch.setenv(layout.DEFINES_ENV, "RING_SLOTS=8,RING_SLOT_BYTES=24576")
    assert ring.slot_bytes() == 24576 and ring.share_bytes() == 49152
    gate_up = NS(act=1, rope=None, k=4096, weights=[NS(qtype=GGMLType.Q4_K, m=14336)] * 2)
    down = NS(act=0, rope=None, k=14336, weights=[NS(qtype=GGMLType.Q6_K, m=4096)])
    too_wide = NS(act=0, rope=None, k=14336 * 4, weights=[NS(qtype=GGMLType.Q6_K, m=4096)])
    assert ring.phase_rows(gate_up) == (False, [4, 4])
    assert ring.phase_rows(down) == (True, [4])
    assert ring.phase_rows(too_wide) is None
    assert ring.ring_smem() <= 227 * 1024
    monkeypatch.delenv(layout.DEFINES_ENV)
    assert ring.share_bytes() == ring.slot_bytes() == 49152
    assert ring.phase_rows(gate_up) == (False, [8, 8]) and ring.phase_rows(down) == (False, [4])


def test_ring_chain_rules():
    """chain_at: consecutive one-token matvecs, each reading the last one's output, the
    first without a norm, each normed one linked to the phase before; at most 4."""
    from picollama.backends.cuda import ring

    class Arr:
        def __init__(self, ptr, size=4096):
            self.data = type("D", (), {"ptr": ptr})()
            self.size = size

    class W:
        def __init__(self, qtype=GGMLType.Q4_K, k=4096, m=4096):
            self.qtype, self.k, self.m = qtype, k, m

    class MV:
        def __init__(self, x, y, norm=False, link=None, out=None, qtype=GGMLType.Q4_K):
            self.q8, self.n, self.k, self.act, self.rope = True, 1, 4096, 0, None
            self.weights, self.x, self.ys = [W(qtype)], Arr(x), [Arr(y)]
            self.norm_w = Arr(99) if norm else None
            self.ssq_in, self.ssq_out = link, out

    l1, l2, l3 = object(), object(), object()
    a = MV(1, 2, out=l1)
    b = MV(2, 3, norm=True, link=l1, out=l2)
    c = MV(3, 4, norm=True, link=l2, out=l3)
    d = MV(4, 5, norm=True, link=l3)
    e = MV(5, 6)
    assert ring.chain_at([a, b, c, d, e], 0, MV) == [a, b, c, d]  # four at most
    assert ring.chain_at([b, c], 0, MV) == []  # a normed first phase
    assert ring.chain_at([a, MV(7, 8)], 0, MV) == []  # x from elsewhere
    assert ring.chain_at([a, MV(2, 3, norm=True)], 0, MV) == []  # no sums to norm by
    assert ring.chain_at([a, MV(2, 3, qtype=GGMLType.Q8_0)], 0, MV) == []  # its type


def test_every_8b_tile_fits_a_slot_as_whole_copies():
    """The 8B's weights (Q4_K_M: Q4_K, Q6_K for some V and ffn_down rows, the output) in
    ring stages: each stage within a slot, every field a whole number of 16-byte copies
    from a 16-byte boundary, the rows a whole number of stages."""
    from picollama.backends.cuda import layout, ring

    shapes = [  # (type, k, m, rows of an output, RoPE pairs)
        (GGMLType.Q4_K, 4096, 4096, 1, True), (GGMLType.Q4_K, 4096, 1024, 1, True),
        (GGMLType.Q6_K, 4096, 1024, 1, True), (GGMLType.Q4_K, 4096, 4096, 1, False),
        (GGMLType.Q4_K, 4096, 14336, 2, False), (GGMLType.Q6_K, 14336, 4096, 1, False),
        (GGMLType.Q4_K, 14336, 4096, 1, False), (GGMLType.Q6_K, 4096, 128256, 1, False),
    ]  # fmt: skip
    for qtype, k, m, per_row, even in shapes:
        r = ring.rows_per_stage(qtype, k, m, per_row, even)
        assert r >= 4 and m % r == 0 and (r % 2 == 0 or not even), (qtype, k, m)
        fields = [size for _src, size in layout.FIELDS[qtype][1]]
        stage = [r * (k // 256) * size for size in fields]
        assert all(b % 16 == 0 for b in stage)
        assert per_row * sum(stage) <= ring.slot_bytes()
        assert r * per_row <= 16 and r % ring.group_warps() == 0  # whole rows a warp


def test_ring_py_mirrors_the_kernels_defines(monkeypatch):
    """ring.py sizes the launch, the shared memory and the counters from ring.cu's
    defaults: a mismatch would make the kernel read past what the host allocated."""
    import ast
    import operator
    import re
    from pathlib import Path

    from picollama.backends.cuda import layout, ring

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def value(node, known):  # + - * of integers and earlier defines
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left, known), value(node.right, known))
        raise ValueError(ast.dump(node))

    monkeypatch.delenv(layout.DEFINES_ENV, raising=False)
    src = (Path(ring.__file__).parent / "ring.cu").read_text()
    raw = dict(re.findall(r"^#define (RING_[A-Z_]+) ([^/\n]+?)\s*(?://.*)?$", src, re.M))
    values: dict[str, int] = {}
    for name, expr in raw.items():
        try:
            values[name] = value(ast.parse(expr, mode="eval").body, values)
        except (KeyError, SyntaxError, ValueError):
            continue  # not an integer (a macro of code)
    assert values["RING_WARPS"] == ring._WARPS and ring.THREADS == (ring._WARPS + 1) * 32
    assert values["RING_XMAX"] == ring._XMAX and values["RING_ROPE_PAIRS"] == ring._ROPE_PAIRS
    assert values["RING_MAX_PHASES"] == ring.MAX_PHASES
    assert values["RING_NEXT"] + values["RING_MAX_PHASES"] == ring.N_COUNTERS
    assert values["RING_SLOT_BYTES"] == ring.slot_bytes() and values["RING_HEAD"] == ring._HEAD
    ring_bytes = values["RING_SLOTS"] * values["RING_SLOT_BYTES"]
    assert ring_bytes == ring.share_bytes() * values["RING_GROUPS"]
    assert values["RING_WARPS"] // values["RING_GROUPS"] == ring.group_warps()
    head = ring.ring_smem() - values["RING_SLOTS"] * ring.slot_bytes()
    assert 0 < head < 32 * 1024 and head % 128 == 0  # the slots start 128-byte aligned
