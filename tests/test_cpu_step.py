"""The CPU backend's compiled decode step (``backends/cpu/step.py``) against op by op.

A compiled step runs the same kernels as the op-by-op pass in the same order, so the test
is equality, bit for bit: logits of every decode step and the KV cache they leave. Each
case also checks that the compiled program really ran (it was traced and proven), and
that a model it cannot express (a weight type without a SIMD kernel, a batch of several
tokens) still gets the op-by-op answer.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import pytest
from model_factory import TinySpec, write_tiny_model

from picollama.backends.base import BackendError, get_backend
from picollama.backends.cpu import step
from picollama.gguf import GGMLType, GGUFReader
from picollama.models import load_model
from picollama.models.base import Segment

PROMPT = [256, 72, 101, 108, 108, 111]
DECODE = [44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67, 68, 69]

Q = GGMLType
CASES = {
    "llama-q4_1": TinySpec(weight_type=Q.Q4_1),
    "llama-q4_0-untied": TinySpec(weight_type=Q.Q4_0, tied=False, n_layers=3),
    "llama-q5_0-q5_1": TinySpec(
        weight_type=Q.Q5_0,
        overrides={"blk.1.ffn_down.weight": ((96, 64), Q.Q5_1)},
    ),
    "llama-q8_0-swa": TinySpec(weight_type=Q.Q8_0, sliding_window=4),
    "llama-k-mixed": TinySpec(
        weight_type=Q.Q4_K,
        n_embd=256,
        n_ff=512,
        head_dim=64,
        overrides={
            "blk.0.attn_v.weight": ((256, 128), Q.Q6_K),
            "blk.1.ffn_down.weight": ((512, 256), Q.Q6_K),
        },
    ),
    "gemma3-q4_k-q6_k": TinySpec(
        arch="gemma3",
        weight_type=Q.Q4_K,
        n_layers=7,
        n_embd=256,
        n_ff=512,
        head_dim=64,
        sliding_window=4,
        overrides={"blk.2.attn_v.weight": ((256, 128), Q.Q6_K)},
    ),
    "gemma3-q8_0": TinySpec(arch="gemma3", weight_type=Q.Q8_0, n_layers=2),
    "llama-f32": TinySpec(weight_type=Q.F32),
    "llama-f16-bf16": TinySpec(
        weight_type=Q.F16, overrides={"blk.0.ffn_down.weight": ((96, 64), Q.BF16)}
    ),
    # float and quantized products in one program: its matmuls dispatch on both kinds
    "llama-q8_0-f16": TinySpec(
        weight_type=Q.Q8_0, overrides={"blk.1.ffn_down.weight": ((96, 64), Q.F16)}
    ),
}


@contextlib.contextmanager
def _tiny_q4_1(tmp_path):
    """The tiny Q4_1 llama (CASES["llama-q4_1"]) written and loaded on a 2-thread CPU
    backend: (backend, model) while the file is open."""
    path = tmp_path / "m.gguf"
    write_tiny_model(path, CASES["llama-q4_1"])
    backend = get_backend("cpu", n_threads=2)
    with GGUFReader(path) as reader:
        yield backend, load_model(reader, backend)


def _decode(path, compiled: bool, n_ctx: int = 32):
    """Logits of each decode step after the prompt, the cache, and the step program."""
    backend = get_backend("cpu", n_threads=2)
    backend.compiled_steps = compiled
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(n_ctx)
        model.forward(np.array(PROMPT), 0, cache)
        logits = []
        for i, tok in enumerate(DECODE):
            logits.append(model.forward(np.array([tok]), len(PROMPT) + i, cache))
        program = backend._steps.program(model)
        return np.concatenate(logits), cache, program


@pytest.mark.parametrize("name", CASES)
def test_compiled_step_equals_op_by_op(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    write_tiny_model(path, CASES[name])
    want, want_cache, _ = _decode(path, compiled=False)
    got, got_cache, program = _decode(path, compiled=True)
    assert program is not None and program is not False and program.trusted, name
    assert np.array_equal(got, want)
    for layer in range(len(want_cache.k)):
        assert np.array_equal(got_cache.k[layer], want_cache.k[layer])
        assert np.array_equal(got_cache.v[layer], want_cache.v[layer])


def test_untraceable_weight_type_runs_op_by_op(tmp_path):
    spec = TinySpec(weight_type=Q.Q2_K, n_embd=256, n_ff=256, head_dim=64)
    path = tmp_path / "m.gguf"
    write_tiny_model(path, spec)
    want, _, _ = _decode(path, compiled=False)
    got, _, program = _decode(path, compiled=True)
    assert program is False  # traced, refused: no kernel in programs for this type
    assert np.array_equal(got, want)


def test_exact_arithmetic_and_new_prompts_never_compile(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, CASES["llama-q4_1"])
    backend = get_backend("cpu", n_threads=2, arithmetic="exact")
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(16)
        for i, tok in enumerate(PROMPT):
            model.forward(np.array([tok]), i, cache)
        assert model not in backend._steps._programs
    backend = get_backend("cpu", n_threads=2)
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(16)
        model.forward(np.array(PROMPT), 0, cache)  # a prompt seen once: op by op
        assert backend._steps.program(model, ((len(PROMPT), None),)) is None


def test_speculative_rounds_compile_at_first_sight(tmp_path):
    """A verification batch (every row's logits) recurs in every round of its size: traced
    the first time, proven the second, compiled from the third."""
    with _tiny_q4_1(tmp_path) as (backend, model):
        cache = model.new_cache(32)
        shape = ((3, (0, 1, 2)),)
        for round_ in range(3):
            seg = Segment(np.array(PROMPT[:3]), 3 * round_, cache, np.arange(3))
            backend.forward_step(model, [seg])
            program = backend._steps.program(model, shape)
            assert program is not None and program is not False
            assert program.trusted == (round_ >= 1)


def test_compiled_step_errors_name_the_problem(tmp_path):
    with _tiny_q4_1(tmp_path) as (backend, model):
        cache = model.new_cache(4)
        for i in range(4):  # trace, prove, then compiled steps
            model.forward(np.array([65 + i]), i, cache)
        assert backend._steps.program(model).trusted
        with pytest.raises(BackendError, match="overflows"):
            model.forward(np.array([65]), 4, cache)
        with pytest.raises(IndexError, match="out of range"):
            model.forward(np.array([100000]), 3, cache)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "mistral", "phi3"])
def test_every_architecture_compiles(tmp_path, arch):
    """The tiny converted checkpoints of tests/data/convert at Q8_0: Qwen2's Q/K/V biases
    (a constant row added to every row) and Gemma 2's final logit softcap are traced too,
    so each architecture's decode step runs compiled, with op-by-op's logits and cache."""
    from picollama.convert.hf import convert_hf_to_gguf

    data = Path(__file__).parent / "data" / "convert" / arch
    path = convert_hf_to_gguf(data, tmp_path / f"{arch}.gguf", "q8_0")
    want, want_cache, _ = _decode(path, compiled=False)
    got, got_cache, program = _decode(path, compiled=True)
    assert program is not None and program is not False and program.trusted, arch
    assert np.array_equal(got, want)
    for layer in range(len(want_cache.k)):
        assert np.array_equal(got_cache.k[layer], want_cache.k[layer])


def _batched(path, compiled: bool, rounds: int = 4):
    """Speculative-style verification (5 tokens of one sequence, logits of every row) and
    server-style continuous batching (one token of each of three sequences at different
    positions), ``rounds`` times each: logits of every pass, the caches, the programs."""
    backend = get_backend("cpu", n_threads=2)
    backend.compiled_steps = compiled
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        one = model.new_cache(64)
        model.forward(np.array(PROMPT), 0, one)
        logits, at = [], len(PROMPT)
        for r in range(rounds):
            toks = np.array(DECODE[r : r + 5])
            logits.append(model.forward(toks, at, one, np.arange(5)))
            at += 3  # as if two drafts were rejected: the next pass overwrites them
        caches = [model.new_cache(32) for _ in range(3)]
        for i, cache in enumerate(caches):
            model.forward(np.array(PROMPT[: i + 2]), 0, cache)
        for r in range(rounds):
            segs = [
                Segment(np.array([DECODE[r + i]]), i + 2 + r, cache)
                for i, cache in enumerate(caches)
            ]
            logits += backend.forward_step(model, segs)
        shapes = (((5, tuple(range(5))),), ((1, None),) * 3)
        programs = [backend._steps.program(model, s) for s in shapes]
        return np.concatenate(logits), [one, *caches], programs


@pytest.mark.parametrize("name", ["llama-q4_1", "llama-k-mixed", "gemma3-q4_k-q6_k", "llama-f32"])
def test_compiled_batches_equal_op_by_op(tmp_path, name):
    """Programs of several rows (a verification) and of several sequences (continuous
    batching) give the op-by-op pass's logits and caches, bit for bit."""
    path = tmp_path / f"{name}.gguf"
    write_tiny_model(path, CASES[name])
    want, want_caches, _ = _batched(path, compiled=False)
    got, got_caches, programs = _batched(path, compiled=True)
    for program in programs:
        assert isinstance(program, step._Program) and program.trusted, name
    assert np.array_equal(got, want)
    for w, g in zip(want_caches, got_caches, strict=True):
        for layer in range(len(w.k)):
            assert np.array_equal(g.k[layer], w.k[layer])
            assert np.array_equal(g.v[layer], w.v[layer])


def test_batch_shapes_that_never_compile(tmp_path):
    """Two segments on one cache, or more rows than a program takes, run op by op."""
    with _tiny_q4_1(tmp_path) as (backend, model):
        cache = model.new_cache(step.MAX_ROWS + 8)
        seg = [Segment(np.array([65]), 0, cache), Segment(np.array([66]), 1, cache)]
        assert step.batch_shape(seg) is None
        long = Segment(np.arange(step.MAX_ROWS + 1) % 200, 0, cache)
        assert step.batch_shape([long]) is None
        for _ in range(3):
            backend.forward_step(model, [long])
        assert model not in backend._steps._programs or not backend._steps._programs[model]


def test_arena_is_reused(tmp_path):
    """Dead buffers' room is given to later ones: a SmolLM2-sized layer stack would
    otherwise need an arena as large as every intermediate of every layer."""
    path = tmp_path / "m.gguf"
    write_tiny_model(path, CASES["llama-q4_1"])
    _, _, programs = _batched(path, compiled=True, rounds=3)
    program = programs[0]
    logits = program.outs[0].size
    # what is not the logits (live to the end) needs far less room than it was traced with
    assert program.arena.size - logits < (program.traced_size - logits) / 3


def test_two_threads_stepping_one_engine(tmp_path):
    """Compiled steps release the GIL, so two sequences of one model may step at once in
    two threads; each gets the logits it gets alone (the program's buffers are taken in
    turn)."""
    import threading

    with _tiny_q4_1(tmp_path) as (backend, model):

        def decode(tokens, out):
            cache = model.new_cache(64)
            model.forward(np.array(PROMPT), 0, cache)
            for i, tok in enumerate(tokens):
                out.append(model.forward(np.array([tok]), len(PROMPT) + i, cache))

        seqs = [DECODE * 3, DECODE[::-1] * 3]
        alone = [[], []]
        for toks, out in zip(seqs, alone, strict=True):
            decode(toks, out)
        assert backend._steps.program(model).trusted
        together = [[], []]
        threads = [
            threading.Thread(target=decode, args=(toks, out))
            for toks, out in zip(seqs, together, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a, b in zip(alone, together, strict=True):
            assert len(b) == len(a)
            assert np.array_equal(np.concatenate(a), np.concatenate(b))


def test_background_compile_decodes_op_by_op_until_ready(tmp_path, monkeypatch):
    """With ``compile_in_background`` (the CLI, the server), steps run op by op while the
    interpreter's code is made in a thread, and the program runs (and is proven) once it is
    done; the logits are the op-by-op ones throughout."""
    path = tmp_path / "m.gguf"
    write_tiny_model(path, CASES["llama-q4_1"])
    want, _, _ = _decode(path, compiled=False)
    background = step._BackgroundCompile()
    background.LOAD_WAIT = 0.0
    made = threading.Event()
    release = threading.Event()

    def compile_slowly():
        release.wait(60)
        made.set()

    monkeypatch.setattr(step, "BACKGROUND", background)
    monkeypatch.setattr(background, "compiled", made.is_set)
    monkeypatch.setattr(background, "_compile", compile_slowly)

    backend = get_backend("cpu", n_threads=2)
    backend.compile_in_background = True
    got = []
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(32)
        model.forward(np.array(PROMPT), 0, cache)
        half = len(DECODE) // 2
        for i, tok in enumerate(DECODE):
            if i == half:
                program = backend._steps.program(model)
                assert program is not None and program is not False
                assert not program.trusted  # traced, never run: the compile is pending
                assert background.pending()
                release.set()
                backend.finish_compiling()
                assert not background.pending()
            got.append(model.forward(np.array([tok]), len(PROMPT) + i, cache))
        assert backend._steps.program(model).trusted
    assert np.array_equal(np.concatenate(got), want)


def test_cache_blocks_are_remembered_per_cache_and_dropped_with_it():
    """The step checks a cache's layout once (a server's slots step with the same caches):
    the check is redone when the cache's end layers are other arrays, and the memo keeps
    no array of a dropped cache alive."""
    import gc

    be = get_backend("cpu")
    cache = be.new_kv_cache(4, 64, 2, 8, 8)
    first = step._cache_blocks(cache)
    assert first is not None and step._cache_blocks(cache) is first
    assert first[0].shape == (4, 64, 2, 8)
    key = id(cache)
    cache.k[-1] = cache.k[-1].copy()  # the last layer is no longer a view of the block
    assert step._cache_blocks(cache) is None
    del cache
    gc.collect()
    assert key not in step._BLOCKS


def test_kind_times_splits_a_kept_run_by_op(tmp_path):
    """With keep_last the compiler keeps its last trusted run (off by default: the run's
    cache addresses must not outlive the caches), and kind_times times each kind of the
    program's rows alone on it: every row counted once, the products among the kinds."""
    with _tiny_q4_1(tmp_path) as (backend, model):
        cache = model.new_cache(32)
        model.forward(np.array(PROMPT), 0, cache)
        for i, tok in enumerate(DECODE[:4]):
            model.forward(np.array([tok]), len(PROMPT) + i, cache)
        assert backend._steps.last is None
        backend._steps.keep_last = True
        model.forward(np.array([DECODE[4]]), len(PROMPT) + 4, cache)
        program, args = backend._steps.last
        assert program is backend._steps.program(model) and program.trusted
        rows = step.kind_times(program, args, reps=2)
    assert rows[0][0] == "all" and rows[0][1] == len(program.code)
    kinds = {name: count for name, count, _ in rows[1:]}
    assert sum(kinds.values()) == len(program.code)
    assert {"matmul", "gated matmul", "attention", "rms_norm", "rope"} <= set(kinds)
    assert all(ms > 0 for _, _, ms in rows)


def test_the_step_and_its_kernels_stay_cacheable(tmp_path):
    """Every compiled function on the step's path can go to Numba's disk cache: one that
    reaches a dynamic global (a ctypes pointer, ``numba.get_num_threads()`` in jitted code)
    can't, and neither can anything that calls it, so each process would compile the whole
    step again (about a minute on 2 cores) with only a NumbaWarning to show for it."""
    from picollama.backends.cpu import qdot, simd_x8

    Q4_0, Q4_1, Q5_0, Q8_0 = GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0
    path = tmp_path / "m.gguf"
    write_tiny_model(path, CASES["llama-q4_1"])
    _batched(path, compiled=True, rounds=2)
    # a batch and a single row of each 32-weight type, as a server step takes them
    rng = np.random.default_rng(3)
    for qtype in (Q4_0, Q4_1, Q5_0, Q8_0):
        w = rng.integers(0, 256, (8, 18 * {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q5_0: 22}[qtype]))
        w = w.astype(np.uint8)
        w[:, 1::2] &= 0xBF  # finite fp16 scales
        for n in (1, 8, 40):
            x = rng.standard_normal((n, 576)).astype(np.float32)
            qdot.matmul_q8(x, w, qtype, 576)
            if qtype in simd_x8.X8_TYPES:
                simd_x8.matmul_x8(x, [simd_x8.repack(w, qtype)], qtype, 576)
    w = rng.integers(0, 256, (8, 2 * 144)).astype(np.uint8)  # Q4_K, k = 512
    w[:, 1::2] &= 0xBF
    for n in (1, 8, 40):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        simd_x8.matmul_x8(x, [simd_x8.repack(w, GGMLType.Q4_K)], GGMLType.Q4_K, 512)
    # (the functions Python calls: each one's code links in everything it calls, so one
    # uncacheable callee makes it uncacheable too; loaded from the cache, it was cacheable)
    dispatchers = [step._run] + [qdot._simd_kernel(int(t)) for t in (Q4_0, Q4_1, Q5_0, Q8_0)]
    dispatchers += [simd_x8._kernel3(int(t)) for t in (Q4_0, Q4_1, Q5_0, Q8_0, GGMLType.Q4_K)]
    for d in dispatchers:
        assert d.overloads, d
        for sig, compiled in d.overloads.items():
            assert not compiled.library.has_dynamic_globals, (d, sig)


@pytest.mark.parametrize("k", [1, 5, 40, 300])
def test_top_rows_select_as_the_reference(k):
    """The compiled step's top-k read-back (``_top_rows``) gives ``top_logits``' pairs:
    the k largest, best first, equal logits by lower id, NaN after every number; rows
    full of ties, with NaNs and -inf, and rows shorter than k."""
    from picollama.backends.base import top_logits

    rng = np.random.default_rng(k)
    rows = [
        rng.standard_normal(1000).astype(np.float32),
        rng.integers(-3, 3, 1000).astype(np.float32),  # ties everywhere
        np.full(1000, 2.0, np.float32),
        np.where(rng.random(1000) < 0.3, np.nan, rng.standard_normal(1000)).astype(np.float32),
        np.where(rng.random(1000) < 0.99, np.nan, 1.0).astype(np.float32),  # few numbers
        np.where(rng.random(1000) < 0.5, -np.inf, rng.standard_normal(1000)).astype(np.float32),
        np.sort(rng.standard_normal(1000)).astype(np.float32),  # ascending: every one enters
    ]
    arena = np.concatenate([np.zeros(7, np.float32), *rows])
    starts = 7 + 1000 * np.arange(len(rows))
    ids = np.empty((len(rows), min(k, 1000)), np.int32)
    vals = np.empty_like(ids, dtype=np.float32)
    step._top_rows(arena, starts.astype(np.int64), 1000, ids, vals)
    want = top_logits(np.stack(rows), k)
    assert np.array_equal(ids, want["id"])
    assert np.array_equal(vals, want["logit"], equal_nan=True)
    short = np.empty((1, 5), np.int32)
    step._top_rows(arena, np.array([7], np.int64), 5, short, np.empty((1, 5), np.float32))
    assert sorted(short[0].tolist()) == [0, 1, 2, 3, 4]


def test_compiled_batches_read_back_the_top_logits(tmp_path):
    """Segments whose samplers need only their rows' largest logits (``Segment.top_k``)
    get those from a trusted program, as ``TOP_LOGITS`` equal to ``top_logits`` of the
    whole rows the same step gives without it; a batch where one segment needs the whole
    row gets whole rows for all."""
    from picollama.backends.base import TOP_LOGITS, top_logits

    path = tmp_path / "q4_1.gguf"
    write_tiny_model(path, CASES["llama-q4_1"])
    backend = get_backend("cpu", n_threads=2)
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        caches = [model.new_cache(32) for _ in range(3)]
        for i, cache in enumerate(caches):
            model.forward(np.array(PROMPT[: i + 2]), 0, cache)
        for r in range(4):
            tops = [7, 3, 12] if r < 3 else [7, 0, 12]

            def segs(ks, r=r):
                return [
                    Segment(np.array([DECODE[r + i]]), i + 2 + r, c, top_k=kk)
                    for i, (c, kk) in enumerate(zip(caches, ks, strict=True))
                ]

            whole = backend.forward_step(model, segs([0, 0, 0]))
            got = backend.forward_step(model, segs(tops))  # the same positions again
            if r < 2:
                continue  # the program is traced, then proved, on the first sightings
            if r == 3:
                assert all(g.dtype == np.float32 for g in got)
                assert all(np.array_equal(g, w) for g, w in zip(got, whole, strict=True))
                continue
            for g, w in zip(got, whole, strict=True):
                assert g.dtype == TOP_LOGITS and g.shape == (1, 12)
                assert np.array_equal(g, top_logits(w, 12))
