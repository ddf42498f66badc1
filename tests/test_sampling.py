"""The sampler chain: each sampler's rule, llama.cpp's defaults, seeded reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from picollama.sampling.samplers import (
    Candidates,
    Sampler,
    SamplingParams,
    apply_penalties,
    min_p,
    temperature,
    top_k,
    top_p,
    typical,
)
from picollama.sampling.stop import StopStrings


def _cands(logits):
    return Candidates.from_logits(np.array(logits, dtype=np.float32))


def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (p.repeat_penalty, p.repeat_last_n) == (1.0, 64)


def test_greedy_at_zero_temperature():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.0, seed=1), 1000)
    assert s.sample(logits) == int(np.argmax(logits))


def test_top_k_keeps_the_k_largest():
    c = top_k(_cands([0.1, 3.0, -1.0, 2.0, 2.5]), 3)
    assert c.ids.tolist() == [1, 4, 3]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    c = top_p(_cands(np.log(probs)), 0.8)
    assert sorted(c.ids.tolist()) == [0, 1]
    c = top_p(_cands(np.log(probs)), 0.81)
    assert sorted(c.ids.tolist()) == [0, 1, 2]


def test_min_p_relative_to_best():
    probs = np.array([0.6, 0.3, 0.05, 0.04, 0.01])
    c = min_p(_cands(np.log(probs)), 0.1)  # keep p >= 0.06
    assert sorted(c.ids.tolist()) == [0, 1]


def test_typical_keeps_at_least_min_keep():
    c = typical(_cands([5.0, 0.0, 0.0, 0.0]), 0.01, min_keep=2)
    assert len(c) == 2


def test_temperature_scales_logits():
    c = temperature(_cands([1.0, 2.0]), 0.5)
    assert c.logits.tolist() == [2.0, 4.0]


def test_penalties_follow_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_penalties(logits, [0, 0, 1, 3], repeat=2.0, freq=0.1, present=0.5)
    # positive logits divide, negative multiply, then count*freq + present subtract
    assert out[0] == pytest.approx(2.0 / 2 - 2 * 0.1 - 0.5)
    assert out[1] == pytest.approx(-2.0 * 2 - 0.1 - 0.5)
    assert out[2] == 1.0
    assert out[3] == pytest.approx(0.5 / 2 - 0.1 - 0.5)


def test_seed_reproduces_and_differs():
    logits = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    params = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)

    def run(seed):
        s = Sampler(SamplingParams(seed=seed, **params), 500)
        return [s.sample(logits) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_logit_bias_bans_a_token():
    logits = np.array([5.0, 1.0, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={0: -np.inf}), 3)
    assert s.sample(logits) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_p", 1.1),
        ("min_p", -0.1),
        ("temperature", float("nan")),
        ("repeat_last_n", -2),
        ("repeat_penalty", 0.0),
    ],
)
def test_invalid_parameters_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        Sampler(SamplingParams(**{field: value}), 10)


def test_logit_bias_out_of_vocab():
    with pytest.raises(ValueError, match="logit_bias token 10"):
        Sampler(SamplingParams(logit_bias={10: 1.0}), 10)


def test_stop_strings_hold_back_partial_match():
    s = StopStrings(["</end>"])
    assert s.push("Hello </") == "Hello "
    assert s.push("en") == ""
    assert s.push("d> tail") == ""
    assert s.hit and s.text == "Hello "


def test_stop_strings_release_false_alarm():
    s = StopStrings(["###"])
    assert s.push("a#") == "a"
    assert s.push("b") == "#b"
    assert not s.hit
    assert s.flush() == ""


def test_top_k_block_filter_keeps_every_winner():
    """The first pass keeps only blocks of 64 whose maximum reaches the k-th largest
    maximum: rows made to trip it (the k largest all in one block, ties at that threshold
    spread over blocks, blocks of NaN and of -inf, a short last block, fewer numbers than
    k) still give a stable sort's first k."""
    from picollama.sampling.samplers import _top_k_indices

    rng = np.random.default_rng(3)
    n = 64 * 300 + 17
    rows = []
    one_block = rng.standard_normal(n).astype(np.float32)
    one_block[640:704] += 50  # every winner in block 10
    rows.append(one_block)
    ties = np.round(rng.standard_normal(n), 0).astype(np.float32)  # few values, many ties
    rows.append(ties)
    holes = rng.standard_normal(n).astype(np.float32)
    holes[: 64 * 200] = np.nan  # whole blocks of NaN
    holes[64 * 250 : 64 * 260] = -np.inf
    holes[-5:] = 40.0  # winners in the short last block
    rows.append(holes)
    sparse = np.full(n, np.nan, np.float32)
    sparse[::997] = rng.standard_normal(len(sparse[::997]))  # 20 numbers for k = 40
    rows.append(sparse)
    for row in rows:
        for k in (1, 40, 75):
            finite = np.flatnonzero(~np.isnan(row))
            order = finite[np.lexsort((finite, -row[finite]))]
            assert np.array_equal(_top_k_indices(row, k), order[:k])


@pytest.mark.parametrize("vocab", [50, 49152, 262144])
def test_top_k_selection_equals_a_stable_sort(vocab):
    """The single-pass heap top-k (runs that can't enter the heap passed over): the k
    largest logits, largest first, ties by lower id (a stable sort's order), on
    vocabularies of both real models' sizes."""
    from picollama.sampling.samplers import _top_k_indices

    rng = np.random.default_rng(vocab)
    logits = np.round(rng.standard_normal(vocab) * 3, 1).astype(np.float32)  # many ties
    # random, rising (every run of logits beats the heap's root) and falling (none does)
    for row in (logits, np.sort(logits), np.sort(logits)[::-1].copy()):
        for k in (1, 40, 50):
            k = min(k, vocab)
            ref = np.lexsort((np.arange(vocab), -row))[:k]
            assert np.array_equal(_top_k_indices(row, k), ref)
    nan_row = logits.copy()
    nan_row[::3] = np.nan
    c = top_k(Candidates.from_logits(nan_row), 40)
    assert len(c) == 40 and np.isfinite(c.logits[: min(40, np.isfinite(nan_row).sum())]).all()


def test_top_logits_order():
    """The reference of a backend's top-k read-back: largest first, equal logits by lower
    id, NaN after every number (-inf included)."""
    from picollama.backends.base import top_logits

    row = np.array([[1.0, 3.0, np.nan, 3.0, -np.inf, 2.0, 3.0]], dtype=np.float32)
    top = top_logits(row, 7)[0]
    assert top["id"].tolist() == [1, 3, 6, 5, 0, 4, 2]
    assert top_logits(row, 3)[0]["id"].tolist() == [1, 3, 6]


TOP_CASES = [
    dict(temperature=0.8),
    dict(temperature=0.0),
    dict(temperature=1.2, top_k=5, top_p=0.9, min_p=0.0),
    dict(temperature=0.7, top_k=40, typical_p=0.8, min_keep=3),
    dict(temperature=0.9, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1),
    dict(temperature=0.0, repeat_penalty=1.5, repeat_last_n=-1),
    dict(temperature=1.0, top_k=64, top_p=1.0, min_p=0.1, repeat_penalty=1.1),
]


@pytest.mark.parametrize("case", TOP_CASES, ids=[str(c) for c in TOP_CASES])
@pytest.mark.parametrize("extra", [0, 50])
def test_a_rows_largest_draw_what_the_row_draws(case, extra):
    """A sampler fed only a row's ``top_needed()`` largest logits (what a GPU backend reads
    back, ``Backend.to_host_top``; ``extra`` more than needed, as it may give) draws every
    token the whole row draws, with the same seed: penalties that lower tokens in and out
    of those largest, banned tokens, and ties at the boundary (logits on a grid of halves)."""
    from picollama.backends.base import top_logits
    from picollama.sampling.samplers import ban

    rng = np.random.default_rng(7)
    n_vocab = 3000
    banned = np.array([5, 17, 2999])
    whole = Sampler(SamplingParams(seed=11, **case), n_vocab)
    top = Sampler(SamplingParams(seed=11, **case), n_vocab)
    for t in rng.integers(0, n_vocab, 30).tolist():
        whole.accept(t)
        top.accept(t)
    for step in range(40):
        row = np.round(rng.standard_normal(n_vocab) * 6).astype(np.float32) / 2
        row[rng.integers(0, n_vocab, 4)] = row.max()  # ties at the top as well
        if step % 2 == 0:  # banned tokens among the largest
            row[banned] = row.max() + 0.5
        if step % 3 == 0:  # the window's tokens among the largest
            row[top._window()] = row.max() + rng.integers(0, 3, len(top._window())) / 2
        k = top.top_needed(len(banned))
        assert k > 0
        want = whole.sample(ban(row, banned))
        got = top.sample(ban(top_logits(row, k + extra), banned))
        assert got == want, (step, got, want)
        whole.accept(want)
        top.accept(got)


def test_top_needed_is_zero_where_the_whole_row_counts():
    assert Sampler(SamplingParams(top_k=0, temperature=0.8), 100).top_needed() == 0
    assert Sampler(SamplingParams(logit_bias={3: 1.0}), 100).top_needed() == 0
    assert Sampler(SamplingParams(temperature=0.0), 100).top_needed(2) == 3
    s = Sampler(SamplingParams(top_k=40, repeat_penalty=1.2), 100)
    for t in (1, 2, 2, 3):
        s.accept(t)
    assert s.top_needed(1) == 40 + 3 + 1  # three distinct tokens in the window, one banned


def test_the_compiled_chain_draws_what_the_step_by_step_chain_draws(monkeypatch):
    """``Sampler.sample`` runs the default chain (top-k, top-p, min-p, temperature) in one
    compiled call with one uniform draw; it must draw every token the step-by-step chain
    (``_chain`` then ``_draw``, which draws with ``Generator.choice``) draws from the same
    seed, through rows with ties, banned (-inf) tokens and penalties, for top-k up to and
    past the compiled chain's limit, so that the generator is used alike as well."""
    from picollama.sampling import samplers

    rng = np.random.default_rng(5)
    fast = step = 0
    chain = Sampler._chain

    def counted(self, c):
        nonlocal step
        step += 1
        return chain(self, c)

    for case in range(300):
        n_vocab = int(rng.integers(50, 3000))
        row = (rng.standard_normal(n_vocab) * rng.uniform(0.1, 8)).astype(np.float32)
        if case % 3 == 0:
            row = np.round(row)  # ties
        if case % 5 == 0:
            row[rng.integers(0, n_vocab, 5)] = -np.inf
        params = dict(
            temperature=float(rng.choice([0.2, 0.8, 1.7])),
            top_k=int(rng.choice([1, 2, 5, 40, samplers.FAST_CHAIN_MAX, 200])),
            top_p=float(rng.choice([0.5, 0.95, 1.0])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
            min_keep=int(rng.choice([0, 1, 3])),
            repeat_penalty=float(rng.choice([1.0, 1.3])),
            seed=int(rng.integers(0, 1 << 30)),
        )
        got = Sampler(SamplingParams(**params), n_vocab)
        want = Sampler(SamplingParams(**params), n_vocab)
        for t in rng.integers(0, n_vocab, 10).tolist():
            got.accept(t)
            want.accept(t)
        for _ in range(4):
            monkeypatch.setattr(Sampler, "_chain", counted)
            before = step
            a = got.sample(row)
            fast += step == before
            monkeypatch.setattr(Sampler, "_chain", chain)
            b = want._draw(want._chain(want._prepared(row)))
            assert a == b, (case, params, a, b)
            got.accept(a)
            want.accept(b)
    assert fast > 600  # most cases took the compiled chain
