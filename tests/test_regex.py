"""Regex and choices constraints: the grammar's language equals Python's ``re.fullmatch``
(ASCII meanings of \\d \\w \\s), and what constrained sampling produces matches."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from test_grammar_sampling import random_generate

from picollama.sampling.grammar import Grammar, GrammarError, LlamaGrammar
from picollama.sampling.regex import RegexError, choices_to_gbnf, regex_to_gbnf

PATTERNS = [
    r"\d{3}-\d{4}",
    r"(ab|cd)+e?",
    r"[^a-c]{2,3}",
    r"a*?b+?c??",
    r"(?:x|y){0,3}z",
    r"(?P<word>[a-z]+)@(?:ex|am)\.com",
    r"^[A-Z][a-z]*( [A-Z][a-z]*)*$",
    r"\w+\s\W",
    r"[\d.]+|[^\d\s]",
    r"a{2}b{1,}c{,2}",
    r"[-a]|[a-]|[\]]|[^]]",
    r"\x41\u00e9\t.",
    r"(a|)b",
    r"((a|b)(c|d)){2}",
    r"[\w-]{1,3}\.?",
    r"a{3,3}|b{0}c",
    r"\(\)\[\]\{\}\*\+\?\|\^\$\.\\",
    r"{x}|a{",
    r"é+[ぁ-ゟ]?",
]


def _strings(pattern: str, rng: random.Random) -> list[str]:
    lits = [c for c in pattern if c.isprintable()] + list("a0 \n_é-.b")
    alphabet = sorted(set(lits))
    out = set()
    for n in range(0, 4):
        for combo in itertools.product(alphabet[:12], repeat=n):
            out.add("".join(combo))
    for _ in range(600):
        out.add("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9))))
    return sorted(out)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_language_equals_python_re(pattern):
    g = Grammar.parse(regex_to_gbnf(pattern))
    rx = re.compile(pattern, re.ASCII)
    rng = random.Random(pattern)
    cases = _strings(pattern, rng)
    for seed in range(3):
        text = random_generate(g, seed)
        assert rx.fullmatch(text), text
        cases += [text, text + "a", text[:-1]]
    for s in cases:
        assert g.accepts(s) == bool(rx.fullmatch(s)), (pattern, s)


@pytest.mark.parametrize(
    "pattern", [r"[a-z]{3,6}\d{0,2}", r"(\d{1,3}\.){3}\d{1,3}", r"(yes|no|maybe)( !)?"]
)
def test_generation_matches_for_20_seeds(pattern):
    grammar = regex_to_gbnf(pattern)
    for seed in range(20):
        assert re.fullmatch(pattern, random_generate(grammar, seed))


def test_big_bounds_stay_exact_and_small():
    text = regex_to_gbnf("a{2,2503}")
    assert len(text) < 5000
    g = Grammar.parse(text)
    for n, ok in [(1, False), (2, True), (1001, True), (2503, True), (2504, False)]:
        assert g.accepts("a" * n) == ok, n


@pytest.mark.parametrize(
    "pattern,message,column",
    [
        (r"(a)\1", "backreference", 4),
        (r"a(?=b)", "lookaround", 2),
        (r"(?i)abc", "flags", 1),
        (r"a\bc", r"escape \b", 2),
        (r"a++", "possessive", 3),
        (r"a**", "multiple repeat", 3),
        (r"(ab", "unbalanced", 1),
        (r"ab)", "unbalanced", 3),
        (r"[abc", "unterminated", 1),
        (r"a{3,2}", "max < min", 2),
        (r"*a", "nothing to repeat", 1),
        (r"a^b", "anchor", None),
        ("(" * 200 + ")" * 200, "deeper", 101),
        (r"\x0", "escape", 1),
        (r"[z-a]", "reversed", 3),
    ],
)
def test_unsupported_or_invalid_is_an_error(pattern, message, column):
    with pytest.raises(RegexError, match=re.escape(message)) as err:
        regex_to_gbnf(pattern)
    if column is not None:
        assert err.value.column == column
    assert isinstance(err.value, GrammarError)


def test_choices():
    choices = ["red", "green", "", 'say "hi"\n', "redder", "red"]
    g = Grammar.parse(choices_to_gbnf(choices))
    for c in choices:
        assert g.accepts(c)
    for c in ["re", "gree", "blue", "redde", "say hi"]:
        assert not g.accepts(c)
    for seed in range(5):
        assert random_generate(g, seed) in choices
    for bad in [[], "abc", [1], ["a\x00"]]:
        with pytest.raises(GrammarError):
            choices_to_gbnf(bad)


def test_llama_grammar_factories():
    assert Grammar.parse(LlamaGrammar.from_regex(r"\d+").grammar).accepts("42")
    assert Grammar.parse(LlamaGrammar.from_choices(["x", "y"]).grammar).accepts("y")
