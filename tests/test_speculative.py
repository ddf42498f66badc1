"""Speculative decoding: the output is the target's own, exactly at temperature 0 and in
distribution when sampling.

Greedy: a verified batch gives the logits a one-token decode gives (same kernels per row),
so speculative greedy output must equal plain greedy output token for token, whatever the
drafter proposes. Sampling: the joint distribution of the first three tokens is computed
exactly from the target (the sampler's own chain over a top-4), and speculative
runs with many seeds must match it by a chi-square test.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from model_factory import TinySpec, write_tiny_model

from picollama.api import Llama, LlamaPromptLookupDecoding
from picollama.generation import Context, Engine
from picollama.sampling.samplers import Sampler, SamplingParams
from picollama.speculative import (
    LookupDrafter,
    ModelDrafter,
    SpecParams,
    SpeculativeError,
    Speculator,
    check_vocab_match,
)

# a prompt that repeats itself, so that prompt lookup has something to find
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "Rewrite the code above with width renamed to w:\n\n"
)


def _greedy(ctx: Context, prompt: list[int], n: int, speculator=None, grammar=None):
    ctx.reset()
    ctx.speculator = speculator
    sampler = Sampler(SamplingParams(temperature=0.0), ctx.n_vocab, grammar=grammar)
    out = list(ctx.generate(prompt, sampler, n, ignore_eos=True))
    ctx.speculator = None
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    engine = Engine(smollm2_path, n_threads=2)
    yield engine
    engine.close()


def test_greedy_equals_plain_with_a_draft_model(smollm2):
    ctx = Context(smollm2, n_ctx=512)
    prompt = smollm2.tokenizer.encode(CODE, add_bos=True)
    plain = _greedy(ctx, prompt, 128)
    draft = Context(smollm2, n_ctx=512)  # the same weights: a draft that is always right
    spec = Speculator(ModelDrafter(draft, SpecParams(n_max=4)), SpecParams(n_max=4))
    assert _greedy(ctx, prompt, 128, spec) == plain
    st = spec.stats
    assert st.n_generated == 128 and st.n_drafted > 64
    assert st.acceptance > 0.9  # the same model proposes its own greedy tokens
    assert st.tokens_per_pass > 3.0


def test_greedy_equals_plain_with_prompt_lookup(smollm2):
    ctx = Context(smollm2, n_ctx=512)
    prompt = smollm2.tokenizer.encode(CODE, add_bos=True)
    plain = _greedy(ctx, prompt, 128)
    spec = Speculator(LookupDrafter(3), SpecParams(n_max=8))
    assert _greedy(ctx, prompt, 128, spec) == plain
    st = spec.stats
    assert st.n_drafted > 0 and 0 < st.n_accepted < st.n_drafted  # rejections exercised
    assert st.n_rounds < 128


def test_greedy_with_a_grammar_equals_plain(smollm2):
    from picollama.sampling.grammar import TokenVocab, grammar_from_request

    constraint = grammar_from_request(grammar='root ::= "[" [0-9]+ ("," [0-9]+)* "]"').constraint(
        TokenVocab.from_tokenizer(smollm2.tokenizer)
    )
    ctx = Context(smollm2, n_ctx=512)
    prompt = smollm2.tokenizer.encode("A list of prime numbers: ", add_bos=True)
    plain = _greedy(ctx, prompt, 24, grammar=constraint)
    spec = Speculator(LookupDrafter(2), SpecParams(n_max=4))
    assert _greedy(ctx, prompt, 24, spec, grammar=constraint) == plain
    text = smollm2.tokenizer.decode(plain)
    assert text.startswith("[") and set(text) <= set("[]0123456789,")


def test_p_min_and_n_min_limit_drafts(smollm2):
    ctx = Context(smollm2, n_ctx=256)
    prompt = smollm2.tokenizer.encode("Once upon a time", add_bos=True)
    plain = _greedy(ctx, prompt, 16)
    draft = Context(smollm2, n_ctx=256)
    strict = SpecParams(n_max=3, p_min=1.0)  # no token is ever certain: nothing drafted
    spec = Speculator(ModelDrafter(draft, strict), strict)
    assert _greedy(ctx, prompt, 16, spec) == plain
    assert spec.stats.n_drafted == 0 and spec.stats.n_rounds == 15
    picky = SpecParams(n_max=2, n_min=3)
    with pytest.raises(SpeculativeError, match="n-min"):
        Speculator(LookupDrafter(2), picky)


def test_api_draft_model_and_lookup(smollm2_path):
    prompt = CODE
    with Llama(smollm2_path, n_ctx=512, n_threads=2, seed=3) as plain_llm:
        want = plain_llm.create_completion(prompt, max_tokens=48, temperature=0)
        want_text = want["choices"][0]["text"]
        assert plain_llm.spec_stats is None
    with Llama(smollm2_path, n_ctx=512, n_threads=2, draft_model=smollm2_path) as llm:
        got = llm.create_completion(prompt, max_tokens=48, temperature=0)
        assert got["choices"][0]["text"] == want_text
        assert llm.spec_stats.n_accepted > 0
    lookup = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=6)
    with Llama(smollm2_path, n_ctx=512, n_threads=2, draft_model=lookup) as llm:
        got = llm.create_completion(prompt, max_tokens=48, temperature=0)
        assert got["choices"][0]["text"] == want_text
        assert llm.ctx.speculator.params.n_max == 6


# -- vocabulary checks --------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    target = tmp_path / "target.gguf"
    draft = tmp_path / "draft.gguf"
    write_tiny_model(target, TinySpec())
    write_tiny_model(draft, TinySpec(seed=1, specials=("<s>", "<|end|>")))
    a, b = Engine(target, n_threads=1), Engine(draft, n_threads=1)
    try:
        with pytest.raises(SpeculativeError, match=r"token 257 is '<\|end\|>' in the draft"):
            check_vocab_match(a, b)
    finally:
        a.close()
        b.close()
    with pytest.raises(SpeculativeError, match="vocabularies differ"):
        Llama(str(target), n_ctx=64, n_threads=1, draft_model=str(draft))
    cli = [sys.executable, "-m", "picollama.tools.cli", "-m", str(target), "-p", "hi", "-n", "2"]
    proc = subprocess.run(
        [*cli, "-no-cnv", "-md", str(draft)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1
    assert "vocabularies differ" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_prints_speculative_statistics(tmp_path):
    target = tmp_path / "target.gguf"
    write_tiny_model(target, TinySpec())
    cmd = [sys.executable, "-m", "picollama.tools.cli", "-m", str(target), "-p", "abcabcabc"]
    proc = subprocess.run(
        [*cmd, "-n", "12", "-no-cnv", "--temp", "0", "--lookup-ngram", "3", "--draft-max", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "n_drafted" in proc.stderr and "accept" in proc.stderr
    proc = subprocess.run(
        [*cmd, "-n", "2", "-no-cnv", "--spec-type", "draft-simple"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "needs a draft model" in proc.stderr


# -- sampling: the target's distribution ---------------------------------------------------

TOP_K = 4
PARAMS = dict(temperature=1.0, top_k=TOP_K, top_p=1.0, min_p=0.0)


def _exact_distribution(ctx: Context, prompt: list[int], n: int) -> dict:
    """P(t1, ..., tn) under the target sampler's chain (top-k then temperature)."""
    sampler = Sampler(SamplingParams(**PARAMS), ctx.n_vocab)
    dist = {}

    def walk(prefix: tuple, p: float) -> None:
        if len(prefix) == n:
            dist[prefix] = p
            return
        ctx.reset()
        c = sampler.candidates(ctx.eval(prompt + list(prefix)))
        for t, pt in zip(c.ids.tolist(), c.probs().tolist(), strict=True):
            walk((*prefix, t), p * pt)

    walk((), 1.0)
    return dist


def _chi_square_ok(counts: dict, exact: dict, n: int) -> tuple[float, float]:
    """Chi-square statistic (cells with expected count < 5 pooled) and the 1e-4 critical
    value by the Wilson-Hilferty approximation."""
    cells, pool_e, pool_o = [], 0.0, 0
    for key, p in exact.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pool_e += e
            pool_o += o
        else:
            cells.append((o, e))
    outside = n - sum(counts.get(k, 0) for k in exact)
    assert outside == 0, f"{outside} outcomes outside the target's support"
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, drafter):
    target_path = tmp_path / "target.gguf"
    write_tiny_model(target_path, TinySpec())
    target = Engine(target_path, n_threads=1)
    ctx = Context(target, n_ctx=64)
    prompt = [256, 97, 98, 99, 97, 98, 99, 97, 98]  # "abcab" repeated: lookup proposes "c..."
    exact = _exact_distribution(ctx, prompt, 3)
    if drafter == "model":
        draft_path = tmp_path / "draft.gguf"
        write_tiny_model(draft_path, TinySpec(seed=7))  # other weights: q differs from p
        draft_engine = Engine(draft_path, n_threads=1)
        params = SpecParams(n_max=2)
        spec = Speculator(ModelDrafter(Context(draft_engine, n_ctx=64), params), params)
    else:
        draft_engine = None
        spec = Speculator(LookupDrafter(3), SpecParams(n_max=2))
    counts: dict = {}
    n, drafted, accepted = 2000, 0, 0
    try:
        for seed in range(n):
            ctx.reset()
            ctx.speculator = spec
            sampler = Sampler(SamplingParams(seed=seed + 1, **PARAMS), ctx.n_vocab)
            out = tuple(ctx.generate(prompt, sampler, 3, ignore_eos=True))
            counts[out] = counts.get(out, 0) + 1
            drafted += spec.stats.n_drafted
            accepted += spec.stats.n_accepted
    finally:
        target.close()
        if draft_engine is not None:
            draft_engine.close()
    assert 0 < accepted < drafted  # both acceptance and rejection were exercised
    stat, crit = _chi_square_ok(counts, exact, n)
    assert stat < crit, f"chi-square {stat:.1f} over {crit:.1f}"
