"""The GBNF parser, the matcher and token masks: syntax, errors, UTF-8, and the fast engine
checked against a direct port of llama.cpp's matching on random walks."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
from test_grammar_reference import RefMatcher

from picollama.sampling.grammar import (
    Grammar,
    GrammarError,
    GrammarMatcher,
    LlamaGrammar,
    TokenConstraint,
    TokenVocab,
)

GRAMMARS = Path(__file__).parent / "data" / "grammars"
VOCABS = Path(__file__).parent / "data" / "vocab"


def _vocab(name: str) -> TokenVocab:
    from picollama.gguf import GGUFReader
    from picollama.tokenizer import Tokenizer

    path = VOCABS / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return TokenVocab.from_tokenizer(Tokenizer.from_gguf(GGUFReader(path)))


@pytest.fixture(scope="module")
def gpt2_vocab():
    return _vocab("ggml-vocab-gpt-2")


@pytest.fixture(scope="module")
def spm_vocab():
    return _vocab("ggml-vocab-llama-spm")


# -- syntax ---------------------------------------------------------------------------------


def test_every_fixture_grammar_parses():
    files = sorted(GRAMMARS.glob("*.gbnf"))
    assert len(files) >= 8
    for f in files:
        g = Grammar.parse(f.read_text())
        assert g.symbol_ids["root"] == 0, f.name


@pytest.mark.parametrize(
    "grammar,good,bad",
    [
        (r'root ::= "\x41\u00e9\U0001F600\t\n\r\\\"\[\]\-"', 'Aé😀\t\n\r\\"[]-', "A"),
        (r"root ::= [\x41-\x43\u00e9] [^\n]", "é!", "D!"),
        ("root ::= [a-c]{2} [0-9]{1,3} [x]{2,} [y]?", "ab1xx", "ab1234xx"),
        ("root ::= . . .", "a😀é", "ab"),
        (
            '# comment\nroot ::= a | # more\n  b\na ::= "x" # tail\nb ::= (\n "y"\n "z"\n)',
            "yz",
            "xy",
        ),
        ('root ::= ("a" | "b" "c")* "d"', "abcad", "abd"),
        ('root ::= "" | "a"', "", "b"),
        ("root ::= [ぁ-ゟ]+", "ひらがな", "カ"),
        ("root ::= [^a]", "é", "a"),
    ],
)
def test_syntax(grammar, good, bad):
    g = Grammar.parse(grammar)
    assert g.accepts(good)
    assert not g.accepts(bad)


@pytest.mark.parametrize(
    "text,message,line,column",
    [
        ('root ::= "abc', "unterminated literal", 1, 10),
        ("root ::= [abc", "unterminated character class", 1, 10),
        ('root ::= "a"\nfoo ::= "b" [c', "unterminated character class", 2, 13),
        ("root ::= foo", "undefined rule 'foo'", 1, 10),
        ('foo ::= "a"', "no rule named 'root'", 1, 1),
        ('root ::= "\\q"', "unknown escape", 1, 11),
        ('root ::= "\\x4"', "hex digits", 1, 11),
        ('root = "a"', "expecting ::=", 1, 6),
        ('root ::= ("a"', "unclosed '('", 1, 10),
        ('root ::= "a")', "expecting newline", 1, 13),
        ("root ::= *", "expecting an item", 1, 10),
        ('root ::= "a"{3,2}', "below lower bound", 1, 13),
        ('root ::= "a"{x}', "integer", 1, 14),
        ("", "empty grammar", 1, 1),
        ("root ::= <think>", "needs a vocabulary", 1, 10),
        ("root ::= <[12", "expecting ']'", 1, 14),
        ('root ::= "a" | root "b"', "left recursion in rule 'root'", 1, 1),
    ],
)
def test_errors_carry_position(text, message, line, column):
    with pytest.raises(GrammarError, match=re.escape(message)) as err:
        Grammar.parse(text)
    assert (err.value.line, err.value.column) == (line, column)
    assert isinstance(err.value, ValueError)


def test_left_recursion_through_nullable_rules_is_refused():
    # llama.cpp only skips rules with an empty alternative; "b?" hides the recursion from
    # it and its parser would then loop forever growing the stack
    text = 'root ::= b? root "x" | "y"\nb ::= "b"'
    with pytest.raises(GrammarError, match="left recursion"):
        Grammar.parse(text)
    # recursion in tail position through a nullable rule is fine (llama.cpp accepts it)
    g = Grammar.parse("root ::= ( [x]* )*\n")
    assert g.accepts("xxx") and g.accepts("")


def test_printing_round_trips():
    text = (GRAMMARS / "json.gbnf").read_text()
    g = Grammar.parse(text)
    again = Grammar.parse(str(g))
    for s in ['{"a": [1, 2.5e3, true, null, "x\\n"]}', "{}", '{"a":}']:
        assert g.accepts(s) == again.accepts(s)


# -- matching bytes -------------------------------------------------------------------------


def test_partial_utf8_across_calls():
    g = Grammar.parse('root ::= "é" [ぁ-ゟ]+')
    m = g.matcher()
    m.accept_bytes(b"\xc3")
    assert not m.can_end()
    m.accept_bytes(b"\xa9\xe3")
    m.accept_bytes(b"\x81")
    with pytest.raises(GrammarError):
        m.accept_bytes(b"A")  # not a continuation byte: rejected, state kept
    m.accept_bytes(b"\x82")  # あ
    assert m.can_end()
    with pytest.raises(GrammarError):
        g.matcher().accept_bytes("é".encode() + "カ".encode())


def test_snapshot_restore_and_clone():
    g = Grammar.parse('root ::= "ab" "c"+')
    m = g.matcher()
    m.accept_bytes(b"a")
    snap = m.snapshot()
    twin = m.clone()
    m.accept_bytes(b"bcc")
    assert m.can_end() and not twin.can_end()
    m.restore(snap)
    assert not m.try_accept_bytes(b"c")
    m.accept_bytes(b"bc")
    assert m.can_end()
    twin.accept_bytes(b"bc")
    assert twin.can_end()


def test_complete_and_can_end():
    g = Grammar.parse('root ::= "a" "b"?')
    m = g.matcher()
    assert not m.can_end() and not m.is_complete()
    m.accept_bytes(b"a")
    assert m.can_end() and not m.is_complete()
    m.accept_bytes(b"b")
    assert m.can_end() and m.is_complete()


# -- the engine against the reference -----------------------------------------------------------

_UNICODE_GRAMMARS = [
    'root ::= ([ぁ-ゟ] | "é" | [a-z])+ "😀"?',
    "root ::= [^\\x00-\\x7F]{1,4} [0-9] .",
    'root ::= ("Ā" | [\\u0100-\\u017F] | [^\\u0000-\\u07FF])* "!"',
]


def _small_vocab(rng: random.Random) -> list[bytes]:
    """Pieces that exercise the engine: ASCII, JSON-ish words, multi-byte characters
    whole and split at every byte, stray continuation bytes."""
    words = ['{"', '":', '", "', "true", "null", "1.5", "-3", "e+1", " ", "\n", '\\"', "\\u00e9"]
    chars = ["é", "ā", "あ", "😀", "ひら", "中文", "Ā", "ſ"]
    pieces = [bytes([b]) for b in range(1, 128)] + [w.encode() for w in words]
    for ch in chars:
        data = ch.encode()
        pieces.append(data)
        for cut in range(1, len(data)):
            pieces += [data[:cut], data[cut:]]
    pieces += [b"\x80", b"\xbf", b"\xc0", b"\xff", b"a\xc3", b"\xa9b", b"\xed", b"\xe0"]
    pieces += [b"\xed\xa0\x80", b"\xe0\x80", b"\xe0\xa0", b"\xf4\x90", b"\xf0\x8f", b"\xf5"]
    pieces += [bytes(rng.randrange(32, 127) for _ in range(rng.randrange(2, 5))) for _ in range(40)]
    return list(dict.fromkeys(pieces))


@pytest.mark.parametrize(
    "source", [f.name for f in sorted(GRAMMARS.glob("*.gbnf"))] + _UNICODE_GRAMMARS
)
def test_engine_matches_reference_on_random_walks(source):
    text = (GRAMMARS / source).read_text() if source.endswith(".gbnf") else source
    g = Grammar.parse(text)
    rng = random.Random(source)
    pieces = _small_vocab(rng)
    eog = len(pieces)
    constraint = TokenConstraint(g, pieces + [b""], [eog])
    for _walk in range(3):
        m = constraint.matcher()
        ref = RefMatcher(g)
        for _step in range(40):
            mask = m.allowed_mask()
            # the end is allowed only with no UTF-8 sequence pending (llama.cpp ignores it)
            can_end = ref.can_end() and ref.partial[1] == 0
            want = np.array([ref.allows(p) for p in pieces] + [can_end])
            bad = np.nonzero(mask != want)[0]
            assert not len(bad), [(pieces[i] if i < eog else "EOG", mask[i]) for i in bad[:5]]
            for i in rng.sample(range(len(pieces)), 20):
                assert m.allows(i) == want[i]
            choices = np.nonzero(want[:eog])[0]
            if not len(choices) or (ref.can_end() and rng.random() < 0.1):
                break
            tok = int(rng.choice(choices.tolist()))
            m.accept_token(tok)
            ref.accept(pieces[tok])
            if ref.partial[1] == 0:
                assert m.can_end() == ref.can_end()


# -- masks on real vocabularies -------------------------------------------------------------


def _walk_json(constraint: TokenConstraint, text: str):
    """Matchers after each prefix of ``text`` fed byte-wise (token-independent)."""
    m = constraint.matcher()
    for i in range(len(text)):
        m.accept_bytes(text[i].encode())
        yield m.clone()


@pytest.mark.parametrize("vocab_name", ["gpt2_vocab", "spm_vocab"])
def test_full_mask_equals_token_by_token(vocab_name, request):
    vocab = request.getfixturevalue(vocab_name)
    g = Grammar.parse((GRAMMARS / "json.gbnf").read_text())
    c = TokenConstraint(g, vocab)
    text = '{"name": "x\\u00e9y", "list": [1, -2.5e3, true], "n": null, "jp": "日本語 é"}'
    rng = np.random.default_rng(0)
    non_ascii = np.array([i for i, p in enumerate(vocab.pieces) if any(b >= 0x80 for b in p)])
    for i, m in enumerate(_walk_json(c, text)):
        if i % 7 and i < len(text) - 8:
            continue
        mask = m.allowed_mask()
        ids = rng.choice(vocab.n_vocab, 400, replace=False)
        extra = rng.choice(non_ascii, min(600, len(non_ascii)), replace=False)
        ids = np.concatenate([ids, extra, np.nonzero(mask)[0][:50]])
        fresh = TokenConstraint(g, vocab).matcher()  # no cached masks
        fresh.restore(m.snapshot())
        for t in ids:
            assert fresh.allows(int(t)) == mask[t], (text[: i + 1], t, vocab.piece(int(t)))
        assert (mask[vocab.eog_ids] == m.can_end()).all()


def test_mask_is_cached_and_read_only(gpt2_vocab):
    c = TokenConstraint(Grammar.parse((GRAMMARS / "json.gbnf").read_text()), gpt2_vocab)
    m = c.matcher()
    m.accept_bytes(b'{"')
    a = m.allowed_mask()
    b = m.allowed_mask()
    assert a is b and not a.flags.writeable
    assert c.stats["mask_hits"] >= 1
    assert a.sum() > gpt2_vocab.n_vocab // 2  # inside a string most tokens fit


def test_end_of_generation_only_where_the_grammar_may_end(gpt2_vocab):
    eog = int(gpt2_vocab.eog_ids[0])
    c = TokenConstraint(Grammar.parse('root ::= "ab" "c"?'), gpt2_vocab)
    m = c.matcher()
    assert not m.allows(eog)
    m.accept_bytes(b"ab")
    assert m.allows(eog) and m.allowed_mask()[eog]
    m.accept_token(eog)  # accepted, nothing changes
    m.accept_bytes(b"c")
    assert m.is_complete()
    mask = m.allowed_mask()
    assert mask[eog] and mask.sum() == len(gpt2_vocab.eog_ids)
    m2 = c.matcher()
    with pytest.raises(GrammarError):
        m2.accept_token(eog)


def test_token_elements():
    pieces = [b"<think>", b"</think>", b"a", b"b", b"", b"<"]
    eog = 4

    def lookup(text):
        return {"<think>": 0, "</think>": 1}.get(text)

    vocab = TokenVocab(pieces, [eog], token_lookup=lookup)
    g = LlamaGrammar.from_string("root ::= <think> (!</think>)* </think> [ab]")
    m = g.constraint(vocab).matcher()
    assert m.allowed_mask().tolist() == [True, False, False, False, False, False]
    m.accept_token(0)
    assert m.allowed_mask().tolist() == [True, True, True, True, False, True]
    m.accept_token(2)
    m.accept_token(1)
    assert m.allowed_mask().tolist() == [False, False, True, True, False, False]
    m.accept_token(3)
    assert m.is_complete()


def test_matcher_without_vocabulary_refuses_token_questions():
    m = Grammar.parse('root ::= "a"').matcher()
    assert isinstance(m, GrammarMatcher)
    with pytest.raises(GrammarError, match="vocabulary"):
        m.allows(0)


# -- request surfaces ------------------------------------------------------------------------


def test_grammar_from_request():
    from picollama.sampling.grammar import grammar_from_request

    assert grammar_from_request() is None
    assert grammar_from_request(response_format={"type": "text"}) is None
    cases = [
        ({"grammar": 'root ::= "a"'}, "a", "b"),
        ({"json_schema": {"type": "integer"}}, "12", "x"),
        ({"response_format": {"type": "json_object"}}, '{"k": [1]}', "[1]"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": 1}}}},
            "1",
            "2",
        ),
        ({"regex": "[0-9]+"}, "42", "x"),
        ({"choices": ["yes", "no"]}, "no", "maybe"),
    ]
    for kw, good, bad in cases:
        g = Grammar.parse(grammar_from_request(**kw).grammar)
        assert g.accepts(good) and not g.accepts(bad), kw
    for kw in [
        {"grammar": 'root ::= "a"', "regex": "a"},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
        {"grammar": "root ::= ("},
        {"json_schema": {"type": "kaboom"}},
    ]:
        with pytest.raises(GrammarError):
            grammar_from_request(**kw)


def test_llama_grammar_from_file(tmp_path):
    f = tmp_path / "g.gbnf"
    f.write_text('root ::= "hi"\n')
    assert Grammar.parse(LlamaGrammar.from_file(f).grammar).accepts("hi")
    with pytest.raises(GrammarError, match="cannot read"):
        LlamaGrammar.from_file(tmp_path / "missing.gbnf")
    (tmp_path / "empty.gbnf").write_text("  \n")
    with pytest.raises(GrammarError, match="empty"):
        LlamaGrammar.from_file(tmp_path / "empty.gbnf")


def test_state_table_rebuilds_keep_matchers_correct(monkeypatch):
    """With a tiny state table the engine rebuilds it often; matchers, snapshots and masks
    must not notice."""
    from picollama.sampling import automaton
    from picollama.sampling import grammar as grammar_mod

    monkeypatch.setattr(automaton, "MAX_DFA_NODES", 40)
    monkeypatch.setattr(grammar_mod, "MAX_DFA_NODES", 40)
    g = Grammar.parse((GRAMMARS / "json.gbnf").read_text())
    rng = random.Random(1)
    pieces = _small_vocab(rng)
    c = TokenConstraint(g, pieces + [b""], [len(pieces)])
    m = c.matcher()
    other = c.matcher()
    ref = RefMatcher(g)
    snaps = []
    for _ in range(60):
        want = np.array([ref.allows(p) for p in pieces])
        assert (m.allowed_mask()[: len(pieces)] == want).all()
        choices = np.nonzero(want)[0]
        if not len(choices):
            break
        tok = int(rng.choice(choices.tolist()))
        snaps.append((m.snapshot(), tok))
        m.accept_token(tok)
        ref.accept(pieces[tok])
        other.allowed_mask()  # a second matcher on the same engine
    assert g.automaton.epoch > 0
    state, tok = snaps[len(snaps) // 2]
    m.restore(state)
    assert m.allows(tok)
    m.accept_token(tok)
