"""GBNF grammars as token constraints: parse once, bind to a vocabulary, match per sequence.

    g = Grammar.parse(open("json.gbnf").read())        # GrammarError with line/column
    c = TokenConstraint(g, pieces, eog_ids)             # or TokenConstraint.from_tokenizer
    m = c.matcher()                                     # one per generated sequence
    m.allows(token_id); m.allowed_mask(); m.accept_token(token_id); m.can_end()

What is accepted is what llama.cpp accepts (``llama_grammar_accept_token``,
``llama_grammar_apply_impl``): a token is allowed when some parse stack consumes all its
code points, it may end inside a UTF-8 sequence that some stack can still complete, an
end-of-generation token is allowed only where the grammar may end, and tokens with empty
bytes (control tokens) only where a token element (``<[id]>``) names them. Deliberate
differences, all stricter: bytes that are not valid UTF-8 are rejected (llama.cpp decodes
some into garbage code points), the end is not allowed while a UTF-8 sequence is pending,
and left recursion through rules that may be empty is refused at parse time (llama.cpp
would loop on it).

How it stays fast (``automaton``, ``vocab_trie``): states are interned and their byte
transitions cached, so checking one token is a few array lookups; a full mask is a walk of
the vocabulary's byte trie over those cached transitions (Numba), pruned where the grammar
rejects a prefix, and kept per state (``MASK_CACHE_BYTES``). The sampler checks the token
it drew first and asks for a full mask only when that token is rejected.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from picollama.sampling.automaton import (
    DEAD,
    MAX_DFA_NODES,
    Automaton,
    CompiledGrammar,
    check_left_recursion,
)
from picollama.sampling.gbnf import GrammarError, GType, ParsedGrammar, format_rules, parse_gbnf

__all__ = [
    "GrammarError",
    "Grammar",
    "GrammarMatcher",
    "GrammarState",
    "TokenVocab",
    "TokenConstraint",
    "LlamaGrammar",
    "grammar_from_request",
    "MASK_CACHE_BYTES",
]

MASK_CACHE_BYTES = 64 << 20  # per vocabulary binding: cached masks, one byte per token each


class Grammar:
    """A parsed, checked GBNF grammar (vocabulary-free); ``parse`` builds one."""

    def __init__(self, parsed: ParsedGrammar, root: str = "root"):
        if root not in parsed.symbol_ids:
            raise GrammarError(f"grammar has no rule named {root!r} to start from", 1, 1)
        check_left_recursion(parsed)
        self.parsed = parsed
        self.root = root
        self.compiled = CompiledGrammar(parsed, parsed.symbol_ids[root])
        self._automaton: Automaton | None = None
        self._lock = threading.Lock()

    @classmethod
    def parse(
        cls,
        text: str | bytes,
        root: str = "root",
        *,
        token_lookup: Callable[[str], int | None] | Mapping[str, int] | None = None,
    ) -> Grammar:
        """Parse GBNF ``text`` starting at rule ``root``.

        ``token_lookup`` resolves ``<text>`` tokens (a mapping or a function giving the id,
        or ``None`` when the text is not exactly one token).
        """
        lookup = token_lookup.get if isinstance(token_lookup, Mapping) else token_lookup
        return cls(parse_gbnf(text, lookup), root)

    @property
    def text(self) -> str:
        return self.parsed.text

    @property
    def symbol_ids(self) -> dict[str, int]:
        return self.parsed.symbol_ids

    @property
    def rules(self) -> list[list[tuple[int, int]]]:
        return self.parsed.rules

    @property
    def automaton(self) -> Automaton:
        if self._automaton is None:
            with self._lock:
                if self._automaton is None:
                    self._automaton = Automaton(self.compiled)
        return self._automaton

    def matcher(self) -> GrammarMatcher:
        """A byte-level matcher (no vocabulary): ``accept_bytes``, ``can_end``..."""
        return GrammarMatcher(self)

    def accepts(self, text: str | bytes) -> bool:
        """Whether the whole of ``text`` is a complete match."""
        m = self.matcher()
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return m.try_accept_bytes(data) and m.can_end()

    def __str__(self) -> str:
        return format_rules(self.parsed)

    def __repr__(self) -> str:
        return f"Grammar(root={self.root!r}, rules={len(self.parsed.rules)})"


@dataclass(frozen=True)
class GrammarState:
    """A matcher's position (``snapshot``), to ``restore`` later, e.g. after a rejected
    speculative draft."""

    stacks: frozenset[int]
    value: int
    n_remain: int
    ended: bool


class GrammarMatcher:
    """The grammar's progress through one sequence.

    Bound to a ``TokenConstraint`` it works on token ids (``allows``, ``allowed_mask``,
    ``accept_token``); unbound, on bytes (``accept_bytes``). Partial UTF-8 sequences carry
    over from one call to the next.
    """

    def __init__(self, grammar: Grammar, constraint: TokenConstraint | None = None):
        self.grammar = grammar
        self.constraint = constraint
        self._auto = grammar.automaton
        with self._auto.lock:
            self._auto.maybe_reset()
            self._set(self._auto.initial())
        self._ended = False

    # -- state ------------------------------------------------------------------------------

    def _sync(self) -> int:
        """The current state id (the caller holds the engine's lock). This is the one place
        where the engine's table may be rebuilt; the state is then re-interned."""
        auto = self._auto
        if len(auto.node_key) > MAX_DFA_NODES:
            auto.maybe_reset()
        if self._epoch != auto.epoch:
            self._nid = auto.node(*self._state_key)
            self._epoch = auto.epoch
        return self._nid

    def _set(self, nid: int) -> None:
        self._nid = nid
        self._epoch = self._auto.epoch
        self._state_key = self._auto.node_key[nid]

    def snapshot(self) -> GrammarState:
        stacks, value, n_remain = self._state_key
        return GrammarState(stacks, value, n_remain, self._ended)

    def restore(self, state: GrammarState) -> None:
        with self._auto.lock:
            self._auto.maybe_reset()
            self._set(self._auto.node(state.stacks, state.value, state.n_remain))
        self._ended = state.ended

    def clone(self) -> GrammarMatcher:
        other = object.__new__(GrammarMatcher)
        other.__dict__.update(self.__dict__)
        return other

    def can_end(self) -> bool:
        """Whether the grammar may end here (end-of-generation is allowed only then)."""
        with self._auto.lock:
            return self._auto.node_can_end[self._sync()]

    def is_complete(self) -> bool:
        """Whether the grammar has matched and nothing more can follow."""
        auto = self._auto
        with auto.lock:
            nid = self._sync()
            return auto.node_can_end[nid] and not auto.node_chars[nid] and not auto.node_tokens[nid]

    # -- bytes ------------------------------------------------------------------------------

    def try_accept_bytes(self, data: bytes) -> bool:
        """Advance over ``data``; on a mismatch return False and leave the state unchanged."""
        auto = self._auto
        with auto.lock:
            nid = auto.walk(self._sync(), bytes(data))
            if nid == DEAD:
                return False
            self._set(nid)
            return True

    def accept_bytes(self, data: bytes) -> None:
        if not self.try_accept_bytes(data):
            raise GrammarError(f"grammar rejects {bytes(data)[:64]!r}")

    def accept_str(self, text: str) -> None:
        self.accept_bytes(text.encode("utf-8"))

    # -- tokens -----------------------------------------------------------------------------

    def _require_constraint(self) -> TokenConstraint:
        if self.constraint is None:
            raise GrammarError("this matcher has no vocabulary: bind it with TokenConstraint")
        return self.constraint

    def _next_state(self, nid: int, token_id: int, piece: bytes) -> int:
        """llama_grammar_accept_token: stacks whose top is a token element match by id,
        the others consume the token's bytes (a token's bytes must end where the engine
        allows a token to end, as ``allows`` says)."""
        auto = self._auto
        by_token = auto.after_token(nid, token_id) if auto.node_tokens[nid] else frozenset()
        # a token without bytes (a control token) moves only token elements
        walked = auto.walk(nid, piece) if piece else DEAD
        if walked != DEAD and not auto.end_ok[walked]:
            walked = DEAD  # ends inside a character no stack can complete
        if not by_token:
            return walked
        if walked == DEAD:
            return auto.node(by_token)
        stacks, value, n_remain = auto.node_key[walked]
        return auto.node(stacks | by_token, value, n_remain)

    def accept_token(self, token_id: int, piece: bytes | None = None) -> None:
        """Advance over one token (its vocabulary bytes, or ``piece`` when given).

        An end-of-generation token is accepted only where the grammar may end and leaves
        the state as it is. Raises ``GrammarError`` (state unchanged) if rejected.
        """
        token_id = int(token_id)
        c = self.constraint
        if c is not None and token_id in c.vocab.eog_set and piece is None:
            if not self.can_end():
                raise GrammarError(f"end-of-generation token {token_id} before the grammar ends")
            self._ended = True
            return
        if piece is None:
            piece = self._require_constraint().vocab.piece(token_id)
        auto = self._auto
        with auto.lock:
            nid = self._next_state(self._sync(), token_id, bytes(piece))
            if nid == DEAD:
                raise GrammarError(f"grammar rejects token {token_id} ({bytes(piece)[:64]!r})")
            self._set(nid)

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (cheap: walks only this token's bytes)."""
        c = self._require_constraint()
        token_id = int(token_id)
        vocab = c.vocab
        if not 0 <= token_id < vocab.n_vocab:
            return False
        if token_id in vocab.eog_set:
            return self.can_end()
        auto = self._auto
        with auto.lock:
            nid = self._sync()
            mask = c.cached_mask(nid, auto.epoch)
            if mask is not None:
                return bool(mask[token_id])
            piece = vocab.piece(token_id)
            if auto.node_tokens[nid] and _token_element_allows(auto, nid, token_id, bool(piece)):
                return True
            if piece:
                end = auto.walk(nid, piece)
                return end != DEAD and bool(auto.end_ok[end])
            return False

    def allowed_mask(self) -> np.ndarray:
        """Boolean mask over the whole vocabulary of the tokens that may come next
        (read-only: it is shared with the cache)."""
        c = self._require_constraint()
        auto = self._auto
        with auto.lock:
            return c.mask(self._sync())


def _token_element_allows(auto: Automaton, nid: int, token_id: int, has_piece: bool) -> bool:
    g = auto.g
    for s in auto.node_tokens[nid]:
        p = auto.st_top[s]
        if g.etype[p] == GType.TOKEN:
            if g.evalue[p] == token_id:
                return True
        elif g.evalue[p] != token_id and has_piece:
            return True
    return False


class TokenVocab:
    """A vocabulary as the grammar engine sees it: each token's bytes and the
    end-of-generation ids; the byte trie is built on first use and shared.

    ``pieces[i]`` is ``b""`` for tokens a grammar must never produce from text (control
    tokens). ``token_lookup`` resolves ``<text>`` token elements.
    """

    def __init__(
        self,
        pieces: Sequence[bytes],
        eog_ids: Iterable[int] = (),
        token_lookup: Callable[[str], int | None] | None = None,
    ):
        self.pieces = [bytes(p) for p in pieces]
        self.n_vocab = len(self.pieces)
        self.eog_ids = np.array(sorted({int(t) for t in eog_ids}), dtype=np.int64)
        for t in self.eog_ids:
            if not 0 <= t < self.n_vocab:
                raise ValueError(f"end-of-generation id {t} is outside the vocabulary")
        self.eog_set = frozenset(int(t) for t in self.eog_ids)
        self.token_lookup = token_lookup
        self.has_piece = np.fromiter((bool(p) for p in self.pieces), bool, self.n_vocab)
        self.has_piece[self.eog_ids] = False
        self._trie = None
        self._lock = threading.Lock()

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    @property
    def trie(self):
        if self._trie is None:
            with self._lock:
                if self._trie is None:
                    from picollama.sampling.vocab_trie import VocabTrie

                    pieces = [b"" if i in self.eog_set else p for i, p in enumerate(self.pieces)]
                    self._trie = VocabTrie(pieces)
        return self._trie

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenVocab:
        """The vocabulary of a ``picollama.tokenizer.Tokenizer`` (cached per tokenizer)."""
        got = _VOCABS.get(tokenizer)
        if got is not None:
            return got
        pieces = [tokenizer.token_to_piece(i, special=False) for i in range(tokenizer.n_vocab)]

        def lookup(text: str) -> int | None:
            try:
                ids = tokenizer.encode(text, add_bos=False, parse_special=True)
            except Exception:
                return None
            return ids[0] if len(ids) == 1 else None

        vocab = cls(pieces, tokenizer.eog_ids, lookup)
        try:
            _VOCABS[tokenizer] = vocab
        except TypeError:  # pragma: no cover - not weak-referenceable
            pass
        return vocab


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TokenConstraint:
    """A grammar bound to a vocabulary: shared by all the sequences it constrains.

    ``matcher()`` gives the per-sequence state; masks are cached here, per grammar state,
    up to ``MASK_CACHE_BYTES``.
    """

    def __init__(
        self,
        grammar: Grammar | str,
        vocab: TokenVocab | Sequence[bytes],
        eog_ids: Iterable[int] = (),
        *,
        root: str = "root",
    ):
        if not isinstance(vocab, TokenVocab):
            vocab = TokenVocab(vocab, eog_ids)
        elif eog_ids:
            raise ValueError("give eog_ids with the pieces, not with a TokenVocab")
        self.vocab = vocab
        if isinstance(grammar, str | bytes):
            grammar = Grammar.parse(grammar, root, token_lookup=vocab.token_lookup)
        self.grammar = grammar
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._mask_epoch = -1
        self._max_masks = max(4, MASK_CACHE_BYTES // max(vocab.n_vocab, 1))
        self.stats = {"mask_hits": 0, "mask_misses": 0}

    @classmethod
    def from_tokenizer(cls, grammar: Grammar | str, tokenizer: Any, root: str = "root"):
        return cls(grammar, TokenVocab.from_tokenizer(tokenizer), root=root)

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def eog_ids(self) -> np.ndarray:
        return self.vocab.eog_ids

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.grammar, self)

    def cached_mask(self, nid: int, epoch: int) -> np.ndarray | None:
        if epoch != self._mask_epoch:
            return None
        return self._masks.get(nid)

    def mask(self, nid: int) -> np.ndarray:
        """The mask of engine state ``nid`` (caller holds the engine's lock)."""
        auto = self.grammar.automaton
        if auto.epoch != self._mask_epoch:
            self._masks.clear()
            self._mask_epoch = auto.epoch
        got = self._masks.get(nid)
        if got is not None:
            self._masks.move_to_end(nid)
            self.stats["mask_hits"] += 1
            return got
        self.stats["mask_misses"] += 1
        got = self.compute_mask(nid)
        got.setflags(write=False)
        self._masks[nid] = got
        if len(self._masks) > self._max_masks:
            self._masks.popitem(last=False)
        return got

    def compute_mask(self, nid: int) -> np.ndarray:
        """The mask of engine state ``nid``, computed afresh (no cache)."""
        from picollama.sampling.vocab_trie import walk_mask

        auto = self.grammar.automaton
        vocab = self.vocab
        out = np.zeros(vocab.n_vocab, dtype=np.uint8)
        with auto.lock:
            if auto.node_chars[nid]:
                walk_mask(vocab.trie, auto, nid, out)
            mask = out.view(bool)
            g = auto.g
            for s in auto.node_tokens[nid]:
                p = auto.st_top[s]
                tok = g.evalue[p]
                if g.etype[p] == GType.TOKEN:
                    if tok < vocab.n_vocab:
                        mask[tok] = True
                else:
                    allowed = vocab.has_piece.copy()
                    if tok < vocab.n_vocab:
                        allowed[tok] = False
                    mask |= allowed
            mask[vocab.eog_ids] = auto.node_can_end[nid]
        return mask


# -- llama-cpp-python's LlamaGrammar ----------------------------------------------------------


class LlamaGrammar:
    """A GBNF grammar in llama-cpp-python's manner: text now, bound to a vocabulary when a
    generation uses it. Syntax, undefined rules, root and left recursion are checked at
    creation (``GrammarError``)."""

    def __init__(self, *args: Any, _grammar: str, root: str = "root", **kwargs: Any):
        self._grammar = _grammar
        self._root = root
        self._has_token_text = False

        def any_token(text: str) -> int:
            self._has_token_text = True
            return 0

        parsed = Grammar.parse(_grammar, root, token_lookup=any_token)
        self._plain = None if self._has_token_text else parsed
        self._constraints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True, root: str = "root") -> LlamaGrammar:
        return cls(_grammar=grammar, root=root)

    @classmethod
    def from_file(cls, file: str | os.PathLike, verbose: bool = True) -> LlamaGrammar:
        try:
            with open(file, encoding="utf-8") as f:
                grammar = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise GrammarError(f"cannot read grammar file {os.fspath(file)!r}: {err}") from None
        if not grammar.strip():
            raise GrammarError(f"grammar file {os.fspath(file)!r} is empty")
        return cls.from_string(grammar, verbose=verbose)

    @classmethod
    def from_json_schema(
        cls, json_schema: str | Mapping[str, Any] | bool, verbose: bool = True, strict: bool = True
    ) -> LlamaGrammar:
        from picollama.sampling.json_schema import schema_to_gbnf

        return cls.from_string(schema_to_gbnf(json_schema, strict=strict), verbose=verbose)

    @classmethod
    def from_regex(cls, pattern: str) -> LlamaGrammar:
        from picollama.sampling.regex import regex_to_gbnf

        return cls.from_string(regex_to_gbnf(pattern))

    @classmethod
    def from_choices(cls, choices: Sequence[str]) -> LlamaGrammar:
        from picollama.sampling.regex import choices_to_gbnf

        return cls.from_string(choices_to_gbnf(choices))

    @property
    def grammar(self) -> str:
        return self._grammar

    @property
    def root(self) -> str:
        return self._root

    def compile(self, vocab: TokenVocab | None = None) -> Grammar:
        if self._plain is not None:
            return self._plain
        lookup = vocab.token_lookup if vocab is not None else None
        return Grammar.parse(self._grammar, self._root, token_lookup=lookup)

    def constraint(self, vocab: TokenVocab) -> TokenConstraint:
        """This grammar bound to ``vocab`` (one binding per vocabulary, reused)."""
        got = self._constraints.get(vocab)
        if got is None:
            got = self._constraints[vocab] = TokenConstraint(self.compile(vocab), vocab)
        return got

    def __repr__(self) -> str:
        return f"LlamaGrammar({json.dumps(self._grammar[:60])}...)"


def grammar_from_request(
    *,
    grammar: LlamaGrammar | Grammar | str | None = None,
    json_schema: Mapping[str, Any] | str | bool | None = None,
    response_format: Mapping[str, Any] | None = None,
    regex: str | None = None,
    choices: Sequence[str] | None = None,
) -> LlamaGrammar | None:
    """The structured-output constraint of a request, from whichever of llama.cpp's
    ``grammar`` / ``json_schema``, OpenAI's ``response_format`` or SGLang's ``regex`` /
    ``choices`` it gives; ``None`` when it gives none (or ``response_format`` "text").

    Two at once, or one that cannot be built, is a ``GrammarError``: the request fails
    rather than running unconstrained.
    """
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise GrammarError("response_format must be an object")
        kind = response_format.get("type", "text")
        if kind == "text":
            response_format = None
        elif kind == "json_object":
            response_format = response_format.get("schema") or {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise GrammarError("response_format json_schema needs json_schema.schema")
            response_format = spec["schema"]
        else:
            raise GrammarError(f"unsupported response_format type {kind!r}")
    given = {
        name: value
        for name, value in (
            ("grammar", grammar),
            ("json_schema", json_schema),
            ("response_format", response_format),
            ("regex", regex),
            ("choices", choices),
        )
        if value is not None
    }
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"give one constraint, not {' and '.join(given)}")
    ((name, value),) = given.items()
    if name == "grammar":
        if isinstance(value, LlamaGrammar):
            return value
        if isinstance(value, Grammar):
            return LlamaGrammar.from_string(value.text, root=value.root)
        if not isinstance(value, str):
            raise GrammarError("grammar must be GBNF text")
        return LlamaGrammar.from_string(value)
    if name in ("json_schema", "response_format"):
        return LlamaGrammar.from_json_schema(value)
    if name == "regex":
        if not isinstance(value, str):
            raise GrammarError("regex must be a string")
        return LlamaGrammar.from_regex(value)
    return LlamaGrammar.from_choices(value)
