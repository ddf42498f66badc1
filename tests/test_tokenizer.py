"""Tokenizer tests against frozen llama.cpp answers.

Oracles (all frozen, nothing runs llama.cpp here):
- tests/data/vocab/*.gguf with .inp/.out: llama.cpp's own test-tokenizer-0 cases;
- tests/data/tokenizer/*.json: written by gen_expected.py from llama-tokenize and
  llama-completion's load log (ids of a corpus and of random texts, token bytes, special
  ids and end-of-generation sets).
"""

from __future__ import annotations

import functools
import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from picollama.gguf import GGUFReader
from picollama.tokenizer import (
    PRE_TOKENIZERS,
    Tokenizer,
    TokenizerError,
    Vocab,
    pre_tokenizer_for,
)
from picollama.tokenizer.pretokenize import PRE_TYPE_PATTERNS
from picollama.tokenizer.unicode import (
    BYTE_TO_UNICODE,
    LETTER,
    MARK,
    NUMBER,
    PUNCTUATION,
    SYMBOL,
    UNICODE_VERSION,
    category_flag,
)

DATA = Path(__file__).parent / "data"
VOCAB_DIR = DATA / "vocab"
TOK_DIR = DATA / "tokenizer"
VOCABS = sorted(p.name for p in VOCAB_DIR.glob("*.gguf"))
MODELS = ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m")


def _json(name: str):
    return json.loads((TOK_DIR / name).read_text(encoding="utf-8"))


@functools.cache
def _metadata(path: str) -> dict:
    with GGUFReader(path) as reader:
        md = dict(reader.metadata)
    # numpy views may point into the mapping: keep copies
    return {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in md.items()}


@functools.cache
def vocab_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(_metadata(str(VOCAB_DIR / name)))


@functools.cache
def model_tokenizer(name: str) -> Tokenizer:
    from picollama.models.registry import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(name)
    except ModelNotFoundError:
        pytest.skip(f"model {name} is not installed: picollama-models pull {name}")
    return Tokenizer.from_metadata(_metadata(str(path)))


def any_tokenizer(name: str) -> Tokenizer:
    return vocab_tokenizer(name) if name.endswith(".gguf") else model_tokenizer(name)


def _marks(name: str) -> list:
    return [] if name.endswith(".gguf") else [pytest.mark.model]


# -- llama.cpp's own tokenizer cases ----------------------------------------------------------


def _vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """The .inp/.out pairs, read as test-tokenizer-0 reads them."""
    base = VOCAB_DIR / name
    raw = Path(f"{base}.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs = raw.split(sep)
    if raw.endswith(sep):  # a trailing separator starts no further test
        inputs.pop()
    outs = Path(f"{base}.out").read_bytes().decode("utf-8").split("\n")
    if outs[-1] == "":  # getline() sees no line after a final newline
        outs.pop()
    assert len(inputs) == len(outs), (len(inputs), len(outs))
    return [(text, [int(t) for t in out.split()]) for text, out in zip(inputs, outs, strict=True)]


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vocab_cases(name):
    tok = vocab_tokenizer(name)
    cases = _vocab_cases(name)
    assert len(cases) > 40
    for text, expected in cases:
        # test-tokenizer-0: add_special=false, parse_special=false
        assert tok.encode(text, add_bos=False, parse_special=False) == expected, repr(text)


@pytest.mark.parametrize("name", [*VOCABS, *(pytest.param(m, marks=_marks(m)) for m in MODELS)])
def test_special_ids_and_eog_set_match_llama_cpp(name):
    facts = _json("vocab_facts.json")[name]
    tok = any_tokenizer(name)
    assert tok.n_vocab == facts["n_vocab"]
    assert tok.vocab.type.name == facts["vocab_type"]
    assert tok.bos_id == facts.get("bos", -1)
    assert tok.eos_id == facts.get("eos", -1)
    assert tok.unk_id == facts.get("unk", -1)
    assert tok.pad_id == facts.get("pad", -1)
    assert sorted(tok.eog_ids) == facts["eog"]
    assert all(tok.is_eog(t) for t in facts["eog"])
    # llama.cpp picks its EOT among candidate texts in hash-map order: compare where the
    # vocabulary has only one candidate, so that the choice is defined.
    from picollama.tokenizer.vocab import _TEXT_CANDIDATES

    candidates = [t for t in _TEXT_CANDIDATES["eot"] if t in tok.vocab.token_to_id]
    if len(candidates) <= 1:
        assert tok.eot_id == facts.get("eot", -1)
    else:
        assert tok.eot_id in tok.eog_ids


# -- a random-text regression set, all seven vocabularies ---------------------------------------


@functools.cache
def _fuzz() -> dict:
    return _json("fuzz_expected.json")


@pytest.mark.parametrize("parse_special", [True, False], ids=["specials", "no_specials"])
@pytest.mark.parametrize("name", [*VOCABS, *(pytest.param(m, marks=_marks(m)) for m in MODELS)])
def test_random_texts_match_llama_cpp(name, parse_special):
    data = _fuzz()
    entry = data["vocabs"][name]
    sep = entry["separator"]
    joined = sep.join(t.replace(sep, "") for t in data["texts"])
    expected = entry["parse_special" if parse_special else "no_parse_special"]
    got = any_tokenizer(name).encode(joined, add_bos=False, parse_special=parse_special)
    assert got == expected


# -- the real models on our corpus ------------------------------------------------------------


@functools.cache
def _expected(model: str) -> dict:
    return _json(f"expected_{model}.json")


_VARIANTS = {
    "default": {},
    "no_bos": {"add_bos": False},
    "no_bos_no_special": {"add_bos": False, "parse_special": False},
}


@pytest.mark.model
@pytest.mark.parametrize("model", MODELS)
def test_corpus_ids_match_llama_tokenize(model):
    tok = model_tokenizer(model)
    cases = _expected(model)["cases"]
    assert len(cases) >= 40
    for case in cases:
        for variant, kwargs in _VARIANTS.items():
            got = tok.encode(case["text"], **kwargs)
            assert got == case[variant], (case["name"], variant)


@pytest.mark.model
@pytest.mark.parametrize("model", MODELS)
def test_token_pieces_match_llama_tokenize(model):
    tok = model_tokenizer(model)
    pieces = _expected(model)["pieces"]
    assert len(pieces) > 500
    for tid, piece in pieces.items():
        assert tok.token_to_piece(int(tid)) == bytes.fromhex(piece), tid


def _llama_cpp_text(model: str, case: dict) -> bytes:
    """What llama.cpp's pieces of the no-BOS ids join to (neither model cleans spaces)."""
    pieces = _expected(model)["pieces"]
    return b"".join(bytes.fromhex(pieces[str(t)]) for t in case["no_bos"])


@pytest.mark.model
@pytest.mark.parametrize("model", MODELS)
def test_detokenize_round_trips_where_llama_cpp_does(model):
    tok = model_tokenizer(model)
    n_round_trips = 0
    for case in _expected(model)["cases"]:
        text = case["text"]
        ids = tok.encode(text, add_bos=False)
        assert tok.decode_bytes(ids) == _llama_cpp_text(model, case), case["name"]
        if _llama_cpp_text(model, case) == text.encode("utf-8"):
            n_round_trips += 1
            assert tok.decode(ids) == text, case["name"]
            # with the file's BOS, and specials as text: skip_special drops the BOS again
            with_bos = tok.encode(text, parse_special=False)
            assert tok.decode(with_bos, skip_special=True) == text, case["name"]
    assert n_round_trips >= 40


@pytest.mark.model
@pytest.mark.parametrize("model", MODELS)
def test_streaming_decode_gives_whole_characters_and_the_full_text(model):
    tok = model_tokenizer(model)
    for case in _expected(model)["cases"]:
        text = case["text"]
        ids = tok.encode(text, add_bos=False)
        det = tok.detokenizer()
        chunks = [det.push(t) for t in ids]
        chunks.append(det.flush())
        for chunk in chunks:
            assert isinstance(chunk, str)
            chunk.encode("utf-8")  # no lone surrogates: valid UTF-8
            if "\ufffd" not in text:
                assert "\ufffd" not in chunk, case["name"]
        assert "".join(chunks) == tok.decode(ids), case["name"]
        if _llama_cpp_text(model, case) == text.encode("utf-8"):
            assert "".join(chunks) == text, case["name"]


@pytest.mark.model
def test_streaming_emoji_split_over_byte_tokens():
    tok = model_tokenizer("gemma3-270m-q4_k_m")
    byte_ids = [tok.vocab.byte_to_token(b) for b in "🦙é".encode()]
    det = tok.detokenizer()
    assert [det.push(t) for t in byte_ids] == ["", "", "", "🦙", "", "é"]
    assert det.flush() == ""


# WordPiece vocabularies have no byte tokens, so no stream can stop inside a character.
@pytest.mark.parametrize("name", [v for v in VOCABS if "bert" not in v])
def test_stream_stopping_mid_character_ends_in_valid_text(name):
    tok = vocab_tokenizer(name)
    ids = tok.encode("ok 🦙", add_bos=False)
    pieces = b"".join(tok.token_to_piece(t) for t in ids)
    assert pieces.endswith("🦙".encode())
    # cut the stream inside the llama's bytes (every vocabulary here splits it)
    for cut in range(1, len(ids)):
        det = tok.detokenizer()
        text = "".join(det.push(t) for t in ids[:cut]) + det.flush()
        text.encode("utf-8")
        assert text == tok.decode(ids[:cut])


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"\xe6\xad", b"abc\xe6\xadxyz", b"\xc0\xaf", b"\xed\xa0\x80", b"\xff", b"ok\x80"],
    ids=["truncated", "truncated_inside", "overlong", "surrogate", "ff", "continuation"],
)
def test_invalid_utf8_bytes_are_a_clear_error(data):
    tok = vocab_tokenizer("ggml-vocab-gpt-2.gguf")
    with pytest.raises(TokenizerError, match="not valid UTF-8.*offset"):
        tok.encode(data)


def test_lone_surrogate_is_a_clear_error():
    tok = vocab_tokenizer("ggml-vocab-llama-spm.gguf")
    with pytest.raises(TokenizerError, match="surrogate U\\+D800 at index 2"):
        tok.encode("ab\ud800cd")


def test_valid_utf8_bytes_encode_like_text():
    tok = vocab_tokenizer("ggml-vocab-qwen2.gguf")
    text = "héllo 🦙 <|im_start|>"
    assert tok.encode(text.encode("utf-8")) == tok.encode(text)


@pytest.mark.parametrize("bad", [-1, 2**31, 10**20, "3", 1.5, None])
def test_out_of_range_ids_are_a_clear_error(bad):
    tok = vocab_tokenizer("ggml-vocab-llama-spm.gguf")
    for call in (
        lambda: tok.decode([1, 2, bad]),
        lambda: tok.token_to_piece(bad),
        lambda: tok.detokenizer().push(bad),
    ):
        with pytest.raises(TokenizerError, match="invalid token"):
            call()


def test_n_vocab_is_out_of_range():
    tok = vocab_tokenizer("ggml-vocab-gpt-2.gguf")
    with pytest.raises(TokenizerError, match=f"invalid token id {tok.n_vocab}"):
        tok.decode([tok.n_vocab])
    assert tok.decode([tok.n_vocab - 1]) == "<|endoftext|>"


def _with(name: str, **changes) -> dict:
    md = dict(_metadata(str(VOCAB_DIR / name)))
    for key, value in changes.items():
        key = "tokenizer.ggml." + key
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(TokenizerError, match="unknown pre-tokenizer.*'no-such-pre'"):
        Vocab.from_metadata(_with("ggml-vocab-gpt-2.gguf", pre="no-such-pre"))


def test_missing_pre_tokenizer_falls_back_to_default():
    vocab = Vocab.from_metadata(_with("ggml-vocab-gpt-2.gguf", pre=None))
    assert vocab.pre.type == "default"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model": "rwkv"}, "'rwkv'.*not supported"),
        ({"model": "t5"}, "'t5'.*not supported"),
        ({"model": "klingon"}, "unknown tokenizer model"),
        ({"model": None}, "tokenizer.ggml.model is missing"),
        ({"tokens": None}, "tokenizer.ggml.tokens is missing"),
        ({"tokens": ["a", "a", "b"]}, "duplicate token"),
        ({"tokens": "abc"}, "array of strings"),
        ({"scores": np.zeros(3, dtype=np.float32)}, "3 entries for 32000 tokens"),
        ({"scores": np.zeros(32000, dtype=np.int8)}, "FLOAT32 or INT32"),
        ({"token_type": np.zeros(32000, dtype=np.float32)}, "integer array"),
        ({"bos_token_id": "1"}, "must be an integer"),
        ({"add_bos_token": 1}, "must be a bool"),
    ],
)
def test_malformed_vocabulary_metadata_is_a_clear_error(changes, message):
    with pytest.raises(TokenizerError, match=message):
        Vocab.from_metadata(_with("ggml-vocab-llama-spm.gguf", **changes))


def test_bpe_without_merges_is_a_clear_error():
    with pytest.raises(TokenizerError, match="merges is missing"):
        Vocab.from_metadata(_with("ggml-vocab-gpt-2.gguf", merges=None))


# -- pieces of the machinery --------------------------------------------------------------------


SAMPLE = (
    "Hello, World! It's 1234567 o'clock; don't 'LL  \t\n\r\n tabs\u00a0 🦙🚀 你好世界 こんにちは "
    "مرحبا ١٢٣ e\u0301 <sentinel:12> IMGIMGABZ 　\u3000x\n\n\n  y"
)


@pytest.mark.parametrize("name", PRE_TOKENIZERS)
def test_every_pre_tokenizer_compiles_and_keeps_all_text(name):
    pre = pre_tokenizer_for(name)
    words = pre.split(SAMPLE)
    assert "".join(words) == SAMPLE
    assert all(words)
    assert pre.split("") == []


def test_every_pre_tokenizer_type_is_reachable():
    reachable = {pre_tokenizer_for(name).type for name in PRE_TOKENIZERS}
    assert reachable == set(PRE_TYPE_PATTERNS)


def test_category_table_is_unicode_15_1():
    assert UNICODE_VERSION == "15.1.0"
    assert category_flag(ord("a")) == LETTER
    assert category_flag(ord("٣")) == NUMBER
    assert category_flag(ord("\u0301")) == MARK
    assert category_flag(ord("!")) == PUNCTUATION
    assert category_flag(ord("$")) == SYMBOL
    # agree with Python's own tables wherever those know the codepoint
    mapping = {"L": LETTER, "N": NUMBER, "M": MARK, "P": PUNCTUATION, "S": SYMBOL}
    known_to_python = 0
    for cp in range(0, 0x30000, 7):
        cat = unicodedata.category(chr(cp))
        if cat == "Cn":
            continue
        known_to_python += 1
        if cat[0] in mapping:
            assert category_flag(cp) == mapping[cat[0]], hex(cp)
    assert known_to_python > 10000


def test_gpt2_byte_map_is_a_bijection_onto_printable_characters():
    chars = set(BYTE_TO_UNICODE.values())
    assert len(chars) == 256
    assert all(c.isprintable() and not c.isspace() for c in chars)
    assert BYTE_TO_UNICODE[ord(" ")] == "Ġ"


def test_add_bos_argument():
    spm = vocab_tokenizer("ggml-vocab-llama-spm.gguf")
    assert spm.add_bos
    assert spm.encode("Hello")[0] == spm.bos_id
    assert spm.encode("Hello", add_bos=False)[0] != spm.bos_id
    gpt2 = vocab_tokenizer("ggml-vocab-gpt-2.gguf")
    assert not gpt2.add_bos
    assert gpt2.encode("Hello")[0] != gpt2.bos_id
    assert gpt2.encode("Hello", add_bos=True)[0] == gpt2.bos_id
    assert spm.encode("") == [spm.bos_id]
    assert spm.encode("", add_bos=False) == []


def test_parse_special_off_keeps_control_tokens_as_text():
    tok = vocab_tokenizer("ggml-vocab-qwen2.gguf")
    im_start = tok.vocab.token_to_id["<|im_start|>"]
    assert tok.encode("<|im_start|>user", parse_special=True)[0] == im_start
    assert im_start not in tok.encode("<|im_start|>user", parse_special=False)
    assert tok.decode(tok.encode("<|im_start|>user", parse_special=False)) == "<|im_start|>user"


def test_decode_skip_special_hides_control_tokens():
    tok = vocab_tokenizer("ggml-vocab-phi-3.gguf")
    ids = tok.encode("<|user|>\nHi<|end|>")
    controls = [t for t in ids if tok.is_control(t)]
    assert len(controls) == 3  # <s>, <|user|>, <|end|>
    shown = tok.decode(ids)
    hidden = tok.decode(ids, skip_special=True)
    for t in controls:
        text = tok.token_text(t)
        assert text in shown
        assert text not in hidden
    assert "Hi" in hidden
