"""The grammar hook in the sampler chain, and a random generator shared by the schema and
regex tests: tokens drawn from random logits through ``Sampler(grammar=...)``, so every
output is what constrained sampling can produce, checked by an independent parser."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from picollama.sampling.grammar import Grammar, GrammarError, TokenConstraint, TokenVocab
from picollama.sampling.samplers import Sampler, SamplingParams

GRAMMARS = Path(__file__).parent / "data" / "grammars"
N_SMALL = 6000  # tokens of GPT-2's vocabulary kept for the small test vocabulary


@lru_cache(maxsize=1)
def small_vocab() -> TokenVocab:
    """GPT-2's first tokens (all 256 bytes, then the most frequent merges) and an end
    token: big enough to split text the way real vocabularies do, small enough for fast
    masks."""
    from picollama.gguf import GGUFReader
    from picollama.tokenizer import Tokenizer

    path = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    tok = Tokenizer.from_gguf(GGUFReader(path))
    pieces = [tok.token_to_piece(i, special=False) for i in range(N_SMALL)]
    return TokenVocab(pieces + [b""], [N_SMALL])


@lru_cache(maxsize=1)
def _bias() -> np.ndarray:
    vocab = small_vocab()
    bias = np.zeros(vocab.n_vocab, dtype=np.float32)
    for i, p in enumerate(vocab.pieces):
        bias[i] = -0.7 * len(p) + 2.0 * sum(p.count(c) for c in b'}]"')
    bias[vocab.eog_ids] = 12.0
    return bias


def random_generate(grammar: Grammar | str, seed: int, max_tokens: int = 600) -> str:
    """Text generated under ``grammar`` from random logits (biased to end soon)."""
    vocab = small_vocab()
    c = TokenConstraint(grammar, vocab)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    s = Sampler(params, vocab.n_vocab, grammar=c)
    rng = np.random.default_rng(seed)
    out = bytearray()
    for _ in range(max_tokens):
        logits = rng.normal(0, 2.5, vocab.n_vocab).astype(np.float32) + _bias()
        tok = s.sample(logits)
        s.accept(tok)
        if tok in vocab.eog_set:
            assert s.grammar.can_end()
            return out.decode("utf-8")
        out += vocab.piece(tok)
    raise AssertionError(f"no end after {max_tokens} tokens: {out[:200]!r}")


# -- the hook ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_json_gbnf_random_generation_parses(seed):
    text = random_generate((GRAMMARS / "json.gbnf").read_text(), seed)
    assert isinstance(json.loads(text), dict)


def test_sampled_token_checked_first_and_mask_only_on_rejection():
    vocab = small_vocab()
    c = TokenConstraint(Grammar.parse('root ::= [a-z]+ "."'), vocab)
    s = Sampler(SamplingParams(temperature=0.0), vocab.n_vocab, grammar=c)
    a = vocab.pieces.index(b"a")
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    logits[a] = 10.0
    assert s.sample(logits) == a  # allowed: no mask needed
    s.accept(a)
    assert c.stats["mask_misses"] == 0
    logits[vocab.pieces.index(b"!")] = 20.0
    tok = s.sample(logits)  # "!" is rejected: masked, greedy picks "a" again
    assert tok == a and c.stats["mask_misses"] == 1


def test_eog_only_where_the_grammar_ends():
    vocab = small_vocab()
    c = TokenConstraint(Grammar.parse('root ::= "ab" | "abc"'), vocab)
    s = Sampler(SamplingParams(temperature=0.0), vocab.n_vocab, grammar=c)
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    logits[vocab.eog_ids] = 50.0
    tok = s.sample(logits)
    assert tok not in vocab.eog_set
    s.accept(tok)
    for _ in range(3):
        tok = s.sample(logits)
        s.accept(tok)
        if tok in vocab.eog_set:
            break
    assert tok in vocab.eog_set


def test_prompt_tokens_do_not_advance_the_grammar():
    vocab = small_vocab()
    c = TokenConstraint(Grammar.parse('root ::= "x"'), vocab)
    s = Sampler(SamplingParams(temperature=0.0), vocab.n_vocab, grammar=c)
    for t in [100, 200, 300]:  # a prompt the grammar would reject
        s.accept(t)
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    assert vocab.piece(s.sample(logits)) == b"x"


def test_every_sampler_in_the_chain_respects_the_grammar():
    vocab = small_vocab()
    g = Grammar.parse("root ::= [0-9]{3}")
    rng = np.random.default_rng(0)
    for params in [
        SamplingParams(seed=1),
        SamplingParams(seed=2, top_k=1),
        SamplingParams(seed=3, top_p=0.1, min_p=0.5),
        SamplingParams(seed=4, typical_p=0.3, temperature=2.0),
        SamplingParams(seed=5, repeat_penalty=1.5, frequency_penalty=1.0, presence_penalty=1),
        SamplingParams(seed=6, logit_bias={vocab.pieces.index(b"a"): 100.0}),
        SamplingParams(seed=7, temperature=0.0),
    ]:
        s = Sampler(params, vocab.n_vocab, grammar=TokenConstraint(g, vocab))
        out = b""
        for _ in range(10):
            tok = s.sample(rng.normal(0, 3, vocab.n_vocab).astype(np.float32))
            s.accept(tok)
            if tok in vocab.eog_set:
                break
            out += vocab.piece(tok)
        assert len(out) == 3 and out.isdigit(), (params, out)


def test_no_allowed_token_is_a_clear_error():
    c = TokenConstraint(Grammar.parse('root ::= "z"'), [b"a", b"b", b""], [2])
    s = Sampler(SamplingParams(), 3, grammar=c)
    with pytest.raises(GrammarError, match="no token"):
        s.sample(np.zeros(3, dtype=np.float32))


def test_matcher_can_be_given_directly_and_logits_longer_than_the_vocabulary():
    c = TokenConstraint(Grammar.parse('root ::= "b"'), [b"a", b"b", b""], [2])
    m = c.matcher()
    s = Sampler(SamplingParams(temperature=0.0), 5, grammar=m)
    logits = np.array([9, 0, 0, 0, 20], dtype=np.float32)  # id 4: padding beyond the vocab
    assert s.sample(logits) == 1
    s.accept(1)
    assert m.is_complete()
