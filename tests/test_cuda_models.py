"""CUDA backend end to end: synthetic llama and gemma3 models against the CPU backend.

The models are written with fixed seeds by model_factory (our GGUF writer and quantizers).
Greedy decoding runs 64 tokens on both backends and must pick the same tokens; decode steps
run as CUDA graphs (op by op, then whole) and must give the very logits of eager execution;
perplexity must agree within 0.1%.

Which CPU backend: the CPU's "exact" arithmetic (float32 dot products of exactly
dequantized weights) is what the CUDA kernels compute with arithmetic="exact", up to the
order of float32 sums (relative differences ~1e-6). The CUDA KV cache is fp16, the CPU's
float32; for the greedy comparison the CPU reference rounds what it stores to fp16 too, so
that a storage choice the issue asks for does not count as a kernel error: with ~1e-6
relative differences a greedy flip needs two logits within ~1e-6 of each other, which on
these models (logits spread over ~1) has odds of order 1e-4 over 64 tokens. Perplexity is
compared with the plain CPU backend (float32 cache).

The default arithmetic ("ggml": int8 activations in the matvecs, as llama.cpp's CUDA
backend) is off by the activation rounding, ~5e-3 of each matmul's outputs; it is compared
teacher-forced (test_int8_activations_follow_cpu).
"""

from __future__ import annotations

import numpy as np
import pytest
from backend_cases import N_GEN, PROMPT, SPECS, f16_kv_cpu
from model_factory import TinySpec, write_tiny_model

from picollama.backends.base import BackendError, get_backend
from picollama.backends.cuda.backend import _TRUST_AFTER, MV_MAX_TOKENS
from picollama.gguf import GGMLType, GGUFReader
from picollama.models import load_model


def _cuda(**options):
    try:
        return get_backend("cuda", **options)
    except BackendError as err:
        pytest.skip(f"CUDA backend unavailable here: {err}")


@pytest.fixture(scope="module", params=list(SPECS))
def model_file(request, tmp_path_factory):
    _cuda()  # skip before writing files when there is no GPU
    path = tmp_path_factory.mktemp("cuda_models") / f"{request.param}.gguf"
    write_tiny_model(path, SPECS[request.param])
    return path


def _greedy(backend, path, n_gen=N_GEN):
    """Greedy tokens and every step's logits: one prefill, then one token at a time."""
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(128)
        logits = model.forward(np.array(PROMPT), 0, cache)[-1]
        tokens, all_logits = [], [logits]
        pos = len(PROMPT)
        for _ in range(n_gen):
            tok = int(np.argmax(logits))
            tokens.append(tok)
            logits = model.forward(np.array([tok]), pos, cache)[-1]
            all_logits.append(logits)
            pos += 1
    return tokens, np.array(all_logits)


def _forced(backend, path, tokens):
    """Logits of the prompt and then of each of ``tokens`` fed one at a time."""
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(128)
        logits = [model.forward(np.array(PROMPT), 0, cache)[-1]]
        for pos, tok in enumerate(tokens, start=len(PROMPT)):
            logits.append(model.forward(np.array([tok]), pos, cache)[-1])
    return np.array(logits)


def test_greedy_tokens_match_cpu(model_file):
    cuda = _cuda(graphs=True, arithmetic="exact")
    tokens, logits = _greedy(cuda, model_file)
    ref_tokens, ref_logits = _greedy(f16_kv_cpu(), model_file)
    assert tokens == ref_tokens
    scale = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() <= 1e-4 * scale
    # the decode steps ran as graphs, and the first one was recorded; after _TRUST_AFTER
    # clean op-by-op replays the rest ran whole (no Python per op)
    assert cuda.graph_stats["recorded"] == 1
    assert 0 < cuda.graph_stats["kernels"]
    assert cuda.graph_stats["replayed"] == N_GEN - 1
    assert cuda.graph_stats["whole"] == N_GEN - 1 - _TRUST_AFTER
    assert cuda.graph_stats["fallbacks"] == 0


def test_int8_activations_follow_cpu(model_file):
    """Arithmetic "ggml" (int8 activations, fused kernels, whole-step graphs), fed the CPU's
    greedy tokens. Each matmul is off by its activation rounding (test_cuda_backend's
    bound: ~5e-3 of its outputs in practice), and the errors pass through the layers: on
    these models the logits stay within ~2e-2 of the CPU's largest logit (seen: 1.7e-2 for
    llama, 1.1e-2 for gemma3); we allow 5e-2, while a wrong kernel moves them by O(1).
    The argmax must agree wherever the CPU's top-2 margin exceeds twice that step's largest
    logit error (elsewhere the rounding may legitimately pick either)."""
    ref_tokens, ref_logits = _greedy(f16_kv_cpu(), model_file)
    cuda = _cuda(graphs=True)
    logits = _forced(cuda, model_file, ref_tokens)
    scale = np.abs(ref_logits).max()
    err = np.abs(logits - ref_logits).max(axis=1)
    assert err.max() <= 5e-2 * scale, float(err.max() / scale)
    top2 = np.sort(ref_logits, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 2 * err
    same = np.argmax(logits, axis=1) == np.argmax(ref_logits, axis=1)
    assert np.all(same[decided]), np.nonzero(decided & ~same)[0]
    assert decided.mean() > 0.5  # the check above is not vacuous
    print(f"int8: logit error {err.max() / scale:.2e} of the scale; argmax agrees "
          f"{same.sum()}/{len(same)}")  # fmt: skip
    assert cuda.graph_stats["whole"] == N_GEN - 1 - _TRUST_AFTER


@pytest.mark.parametrize("arithmetic", ["ggml", "exact"])
@pytest.mark.parametrize("fuse", [False, True])
def test_graph_replay_equals_eager(model_file, fuse, arithmetic):
    """The same kernels on the same inputs. Unfused, replay must be bit-identical to eager;
    fused, the norm's float64 sum of squares is added in another order, which can move a
    norm's float32 scale by one ulp in rare cases (and with int8 activations, in rarer
    ones, an int8 code by one): 1e-6 of the largest logit allows the first, 1e-4 the
    second, while a wrong buffer or position moves logits by O(1). The other fusions
    (Q/K/V, with RoPE and the KV write for int8; gate/up/activation; rope/store_kv) compute
    bit-identical values. The graphs' kernels are programmatic dependents here (sm_90 on;
    each waits for the one before inside): a missing wait would show as a race."""
    graphs = _cuda(graphs=True, fuse=fuse, arithmetic=arithmetic, dependent_launch=True)
    tokens_g, logits_g = _greedy(graphs, model_file, n_gen=12)
    tokens_e, logits_e = _greedy(_cuda(graphs=False, arithmetic=arithmetic), model_file, n_gen=12)
    assert tokens_g == tokens_e
    assert graphs.graph_stats["whole"] == 12 - 1 - _TRUST_AFTER
    if int(graphs.cp.cuda.Device(graphs.device_id).compute_capability) >= 90:
        assert graphs.graph_stats["dependent_launch"]  # used, not fallen back from
    if fuse:
        tol = 1e-6 if arithmetic == "exact" else 1e-4
        assert np.abs(logits_g - logits_e).max() <= tol * np.abs(logits_e).max()
    else:
        np.testing.assert_array_equal(logits_g, logits_e)


# rows of 2048, Q4_K with Q6_K's ffn_down and output
WIDE = TinySpec(
    n_layers=2,
    n_embd=2048,
    n_heads=16,
    n_kv_heads=4,
    head_dim=128,
    n_ff=2048,
    weight_type=GGMLType.Q4_K,
    tied=False,
    seed=13,
    overrides={
        **{f"blk.{i}.ffn_down.weight": ((2048, 2048), GGMLType.Q6_K) for i in range(2)},
        "output.weight": ((2048, 258), GGMLType.Q6_K),
    },
)


def test_graph_replay_equals_eager_wide_rows(tmp_path):
    """Rows of 2048 weights, 16 heads of 128 in GQA groups of 4, through the one-token
    Q4_K / Q6_K matvecs (Q/K/V with RoPE, attn_output, gate+up, ffn_down, output): fused
    int8 graphs with programmatic launches against eager execution, within
    test_graph_replay_equals_eager's bound for that case."""
    _cuda()
    path = tmp_path / "wide.gguf"
    write_tiny_model(path, WIDE)
    graphs = _cuda(graphs=True, dependent_launch=True)
    tokens_g, logits_g = _greedy(graphs, path, n_gen=12)
    tokens_e, logits_e = _greedy(_cuda(graphs=False), path, n_gen=12)
    assert tokens_g == tokens_e
    assert graphs.graph_stats["whole"] == 12 - 1 - _TRUST_AFTER
    assert np.abs(logits_g - logits_e).max() <= 1e-4 * np.abs(logits_e).max()


@pytest.mark.parametrize("via", ["forward", "forward_batch"])
def test_two_sequences_alternating(model_file, via):
    """Decode steps of two caches in turn (a server whose slots run alone in turn). Through
    ``model.forward`` (the backend's ``forward_step``, which knows the step's cache) both
    caches replay one graph, whose parameters include the cache's pointers: no step falls
    back, and the steps reach whole-step replay after the first few. Straight through
    ``forward_batch`` the cache is not known before the step, so no graph is made. Every
    logit is eager execution's either way."""
    from picollama.models.base import Segment

    be_g, be_e = _cuda(graphs=True), _cuda(graphs=False)
    results = []
    for be in (be_g, be_e):
        with GGUFReader(model_file) as reader:
            model = load_model(reader, be)
            caches = [model.new_cache(64), model.new_cache(64)]
            starts = [PROMPT[:5], PROMPT[:9]]
            out = []
            for cache, prompt in zip(caches, starts, strict=True):
                out.append(model.forward(np.array(prompt), 0, cache)[-1])
            pos = [5, 9]
            for step in range(16):
                i = step % 2 if step >= 4 else 0  # first a run on cache 0, then alternate
                tok = np.array([int(np.argmax(out[-1]))])
                if via == "forward":
                    out.append(model.forward(tok, pos[i], caches[i])[-1])
                else:
                    out.append(model.forward_batch([Segment(tok, pos[i], caches[i])])[0][-1])
                pos[i] += 1
            results.append(np.array(out))
    np.testing.assert_array_equal(results[0], results[1])
    stats = be_g.graph_stats
    if via == "forward":
        assert stats["recorded"] == 1 and stats["fallbacks"] == 0, stats
        # one key: the first step records, the next _TRUST_AFTER replay op by op
        assert stats["whole"] == 16 - (1 + _TRUST_AFTER), stats
    else:
        assert stats["recorded"] == 0 and stats["replayed"] == 0, stats


def test_one_graph_serves_every_cache_of_its_geometry(model_file):
    """Generations that each decode into a new cache (a server request that gets a fresh
    slot, a CLI run after another) replay the first generation's graph: the cache's
    pointers are a parameter of the step, so no step falls back, and the logits are eager
    execution's bit for bit (unfused, so the kernels are the same ones). A cache of
    another size (another split of the keys) gets a graph of its own."""
    be_g, be_e = _cuda(graphs=True, fuse=False), _cuda(graphs=False)
    sizes = (64, 64, 64, 96)
    results = []
    for be in (be_g, be_e):
        with GGUFReader(model_file) as reader:
            model = load_model(reader, be)
            caches, out = [], []  # every cache kept: each has its own device memory
            for n_ctx in sizes:
                cache = model.new_cache(n_ctx)
                caches.append(cache)
                logits = model.forward(np.array(PROMPT[:6]), 0, cache)[-1]
                for pos in range(6, 14):
                    tok = np.array([int(np.argmax(logits))])
                    logits = model.forward(tok, pos, cache)[-1]
                    out.append(logits)
            results.append(np.array(out))
    np.testing.assert_array_equal(results[0], results[1])
    assert len({c.k[0].data.ptr for c in caches}) == len(sizes)
    stats = be_g.graph_stats
    assert stats["recorded"] == 2 and stats["fallbacks"] == 0, stats
    assert stats["whole"] == 8 * len(sizes) - 2 * (1 + _TRUST_AFTER), stats


PROMPTS = [PROMPT, PROMPT[:5], PROMPT[3:12], PROMPT[:2]]


def _batched_decode(backend, path, n_ctxs, steps=24, prompts=PROMPTS):
    """Greedy steps of several sequences, one token of each per forward pass (the server's
    batches); the logits of every step, (steps, sequences, n_vocab), and the tokens fed."""
    from picollama.models.base import Segment

    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        caches = [model.new_cache(n) for n in n_ctxs]
        pairs = zip(prompts, caches, strict=True)
        logits = [model.forward(np.array(p), 0, c)[-1] for p, c in pairs]
        pos = [len(p) for p in prompts]
        out, fed = [], []
        for _ in range(steps):
            tokens = [int(np.argmax(row)) for row in logits]
            segs = [
                Segment(np.array([t]), p, c) for t, p, c in zip(tokens, pos, caches, strict=True)
            ]
            logits = [rows[-1] for rows in backend.forward_step(model, segs)]
            out.append(np.array(logits))
            fed.append(tokens)
            pos = [p + 1 for p in pos]
    return np.array(out), np.array(fed)


def test_batched_decode_is_each_rows_own(model_file):
    """One token of each of four sequences per pass: the cache writes and the attention of
    all rows run as one launch each (``attend_batch``), and every row's logits are bit for
    bit those of the same batch run segment by segment (the base class's loop: a store and
    an ``attention_gqa_*`` launch per sequence). Positions differ per row, go past the
    sliding window (gemma3) and past several splits of the 128-position caches."""
    from types import MethodType

    from picollama.backends.base import Backend

    be, ref = _cuda(graphs=False), _cuda(graphs=False)
    ref.attend_batch = MethodType(Backend.attend_batch, ref)
    got, fed = _batched_decode(be, model_file, [128] * 4)
    want, fed_ref = _batched_decode(ref, model_file, [128] * 4)
    np.testing.assert_array_equal(fed, fed_ref)
    np.testing.assert_array_equal(got, want)


SEQS = [PROMPT, PROMPT[:5], PROMPT[3:12], PROMPT[:2], PROMPT[7:], PROMPT[1:4]]
# which sequences step together: one set of four; two sets of four taking turns (the same
# graph, other caches); three; one alone
SCHEDULE = [[0, 1, 2, 3]] * 6 + [[4, 5, 0, 1], [2, 3, 4, 5]] * 4 + [[0, 2, 4]] * 4 + [[1]] * 4


def _scheduled_decode(backend, path):
    """Greedy steps of the sequences of SEQS in the groups of SCHEDULE, one token of each
    member per forward pass: the logits of every step, concatenated."""
    from picollama.models.base import Segment

    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        caches = [model.new_cache(128) for _ in SEQS]
        last = [model.forward(np.array(p), 0, c)[-1] for p, c in zip(SEQS, caches, strict=True)]
        pos = [len(p) for p in SEQS]
        out = []
        for group in SCHEDULE:
            segs = [Segment(np.array([np.argmax(last[i])]), pos[i], caches[i]) for i in group]
            for i, rows in zip(group, backend.forward_step(model, segs), strict=True):
                last[i] = rows[-1]
                pos[i] += 1
                out.append(rows[-1])
    return np.array(out)


@pytest.mark.parametrize("fuse", [False, True])
def test_batched_decode_graphs_equal_eager(model_file, fuse):
    """Steps of several sequences as CUDA graphs: one graph per number of sequences, whose
    parameters are the token ids, the positions and the caches' pointers, so two sets of
    caches taking turns replay the same graph (op by op, then whole). Against eager steps:
    unfused bit-identical; fused within test_graph_replay_equals_eager's bound (the norm's
    sum of squares in another order). Programmatic dependent launches on (sm_90)."""
    graphs = _cuda(graphs=True, fuse=fuse, dependent_launch=True)
    got = _scheduled_decode(graphs, model_file)
    want = _scheduled_decode(_cuda(graphs=False), model_file)
    stats = graphs.graph_stats
    print(f"batched graphs, fuse={fuse}: {stats}")
    assert stats["recorded"] == 3  # 4, 3 and 1 sequences
    assert stats["fallbacks"] == 0
    # whole replays: 4 sequences 14 steps, 3 sequences 4 steps, 1 sequence 4 steps; each
    # key's first step records and the next _TRUST_AFTER replay op by op
    assert stats["whole"] == 14 + 4 + 4 - 3 * (1 + _TRUST_AFTER)
    if fuse:
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n_ctxs", [[128] * 4, [128, 96, 128, 64]], ids=["equal", "unequal"])
def test_batched_decode_follows_each_sequence_alone(model_file, n_ctxs):
    """The batched rows against each sequence decoded alone (one-token steps, the graphs'
    kernels), teacher-forced with the batch's tokens: the matvecs of 4 rows and of 1 row
    differ only in the order of float32 sums, so the logits agree to ~1e-5 of their scale.
    Caches of unequal sizes take the segment-by-segment path, with the same results."""
    got, fed = _batched_decode(_cuda(graphs=False), model_file, n_ctxs)
    alone = []
    for i, prompt in enumerate(PROMPTS):
        be = _cuda()
        with GGUFReader(model_file) as reader:
            model = load_model(reader, be)
            cache = model.new_cache(n_ctxs[i])
            model.forward(np.array(prompt), 0, cache)
            rows = []
            for step, tok in enumerate(fed[:, i]):
                rows.append(model.forward(np.array([tok]), len(prompt) + step, cache)[-1])
        alone.append(np.array(rows))
    alone = np.stack(alone, axis=1)
    scale = np.abs(alone).max()
    err = np.abs(got - alone).max() / scale
    print(f"batched vs alone: max |diff| / max |logit| = {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("arithmetic,n_batch", [("exact", 64), ("ggml", 64), ("ggml", 8)])
def test_perplexity_matches_cpu(model_file, arithmetic, n_batch):
    """Batches of 64 run through the dequantized-tile GEMM (float32 with "exact"; fp16
    inputs with "ggml", ~1e-4 of each matmul's outputs): within 0.1% of the CPU. Batches
    of 8 run through the matvec kernels, with int8 activations in "ggml": each matmul is
    then off by ~5e-3 of its outputs (the rounding of test_cuda_backend's bound), which
    moves the perplexity of these random models by a few 1e-3 (seen: +0.28% llama,
    +0.005% gemma3): within 1%."""
    from picollama.generation import Context
    from picollama.tools.perplexity import perplexity

    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 256, size=4 * 64).tolist()
    ppl = {}
    backends = (
        ("cuda", _cuda(arithmetic=arithmetic), n_batch),
        ("cpu", get_backend("cpu", arithmetic="exact"), 64),
    )
    for name, backend, batch in backends:
        ctx = Context(model_file, n_ctx=64, n_batch=batch, backend=backend)
        ppl[name] = perplexity(ctx, tokens, n_ctx=64).ppl
        ctx.close()
    print(f"{arithmetic} n_batch {n_batch}: cuda/cpu - 1 = {ppl['cuda'] / ppl['cpu'] - 1:+.2e}")
    assert abs(ppl["cuda"] / ppl["cpu"] - 1) < (1e-3 if n_batch > MV_MAX_TOKENS else 1e-2), ppl


def test_python_api_on_cuda(model_file):
    from picollama.api import Llama

    _cuda()
    llm = Llama(model_path=str(model_file), n_ctx=64, backend="cuda")
    out = llm.create_completion("Hello", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] <= 8
    assert isinstance(out["choices"][0]["text"], str)


def test_server_slots_on_cuda(model_file):
    """The server's engine loop on CUDA, in process: four requests decoding together (one
    token of each per step: the batched graphs) give each the tokens it gets alone; a
    prompt whose prefix another slot holds copies those rows (``copy_kv``, on the backend's
    stream: device caches have no prefix tree) and gives the tokens of a fresh prefill.

    Every step here has at most 8 rows, so every product is the int8 matvec, whose rows
    are their own whatever the batch (test_cuda_backend); prompt batches of more rows take
    the fp16 GEMM, whose rounding differs (~1e-3), so on CUDA, unlike the CPU, a request's
    tokens may depend on what it was batched with. The copied prefix's last token attends
    through the one-token kernel instead of the prompt kernel: the same sums in another
    order (~1e-6), which moves a greedy token only at a near-tie (odds ~1e-4 here).
    Greedy sampling, ``ignore_eos`` so that every request runs its full length."""
    from picollama.generation import Engine
    from picollama.sampling.samplers import Sampler, SamplingParams
    from picollama.server.scheduler import GenRequest, Scheduler

    backend = _cuda()
    engine = Engine(model_file, backend=backend)
    sched = Scheduler(engine, 4, 64)
    assert sched.tree is None  # device caches: prefixes come from the other slots

    def submit(prompt, n=12, slot=-1):
        sampler = Sampler(SamplingParams(temperature=0))
        req = GenRequest(list(prompt), sampler, n, ignore_eos=True, id_slot=slot)
        sched.submit([req])
        return req

    def collect(req):
        tokens = []
        while (ev := req.out.get(timeout=300)).kind == "token":
            tokens.append(ev.token)
        assert ev.kind == "done", ev.message
        return tokens, ev.stats

    prompts = [[256, 72], [101], [108, 111], [44]]
    sched.start()
    try:
        lone = [collect(submit(p))[0] for p in prompts]
        together = [collect(r)[0] for r in [submit(p) for p in prompts]]
        # a fresh prefill on slot 3, then the same prompt on slot 1 from slot 3's rows
        prompt = [7, 8, 9, 10, 11, 12]
        collect(submit([1, 2], slot=1))  # slot 1 holds nothing of it
        fresh, stats_fresh = collect(submit(prompt, slot=3))
        copied, stats_copied = collect(submit(prompt, slot=1))
    finally:
        sched.stop()
    assert together == lone, (together, lone)
    assert all(len(t) == 12 for t in lone)
    assert stats_fresh["prompt_cached"] == 0, stats_fresh
    assert stats_copied["prompt_cached"] == len(prompt) - 1, stats_copied  # all but the last
    assert copied == fresh, (copied, fresh)
    assert backend.graph_stats["whole"] > 0, backend.graph_stats
    # the slots' lone decode steps share one graph (the cache is a parameter of the step)
    assert sum(t.params.n == 1 for t in backend._traces.values()) == 1, backend._traces


@pytest.mark.parametrize("graphs", [False, True])
def test_sampling_from_rows_largest(model_file, graphs):
    """Two sequences decoded together with seeded samplers (temperature, top-k, penalties)
    where the backend reads back only each row's largest logits (``to_host_top``) draw the
    tokens they draw from whole rows (a zero logit bias makes the samplers ask for those):
    the same steps, so the same logits, both times. With graphs the steps reach whole-step
    replay with the small read-back."""
    from picollama.generation import Engine, eval_batch
    from picollama.sampling.samplers import Sampler, SamplingParams

    runs = []
    for bias in ({}, {0: 0.0}):
        backend = _cuda(graphs=graphs)
        engine = Engine(str(model_file), backend=backend)
        ctxs = [engine.new_sequence(96) for _ in range(2)]
        samplers = [
            Sampler(
                SamplingParams(temperature=1.5, seed=3 + i, repeat_penalty=1.1, logit_bias=bias)
            )
            for i in range(2)
        ]
        prompts = [PROMPT, PROMPT[:5]]
        tops = [s.top_needed() for s in samplers]
        assert all(t > 0 for t in tops) == (not bias)
        logits = eval_batch(list(zip(ctxs, prompts, strict=True)), tops)
        for s, p in zip(samplers, prompts, strict=True):
            for t in p:
                s.accept(t)
        out = []
        for _ in range(40):
            toks = [s.sample(row) for s, row in zip(samplers, logits, strict=True)]
            for s, t in zip(samplers, toks, strict=True):
                s.accept(t)
            out.append(toks)
            tops = [s.top_needed() for s in samplers]
            logits = eval_batch([(c, [t]) for c, t in zip(ctxs, toks, strict=True)], tops)
        runs.append(out)
        if graphs:
            assert backend.graph_stats["whole"] > 0, backend.graph_stats
            assert backend.graph_stats["fallbacks"] == 0, backend.graph_stats
        if not bias:
            assert logits[0].dtype.names == ("id", "logit")  # the rows' largest came back
    assert runs[0] == runs[1]
    assert len({t for toks in runs[0] for t in toks}) > 5
