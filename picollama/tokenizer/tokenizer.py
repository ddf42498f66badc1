"""Text to token ids and back, as llama.cpp's ``llama_tokenize`` / ``llama_detokenize`` do.

Encoding first cuts special tokens out of the raw text (``tokenizer_st_partition``): every
control, user-defined and unknown token of the vocabulary, longest first, is found in the
text and kept as a whole token. User-defined tokens are always cut; control and unknown
tokens only when parsing specials (the default for prompts; off for untrusted user content).
The remaining fragments go to the SPM, BPE or WPM algorithm.
"""

from __future__ import annotations

import codecs
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any

from picollama.tokenizer.bpe import BpeTokenizer
from picollama.tokenizer.errors import TokenizerError
from picollama.tokenizer.spm import SpmTokenizer
from picollama.tokenizer.unicode import UNICODE_TO_BYTE
from picollama.tokenizer.vocab import TOKEN_NULL, TokenAttr, Vocab, VocabType
from picollama.tokenizer.wpm import WpmTokenizer

__all__ = ["Tokenizer", "Detokenizer"]

# C's isspace() in the "C" locale: what llama.cpp strips around lstrip/rstrip tokens.
_C_SPACE = " \t\n\v\f\r"
_ESCAPED_SPACE = "\u2581"  # ▁, SentencePiece's visible space

_CONTROL_OR_UNKNOWN = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
_LSTRIP = int(TokenAttr.LSTRIP)
_RSTRIP = int(TokenAttr.RSTRIP)


class Tokenizer:
    """Encoder and decoder for one GGUF vocabulary.

    ``encode`` and ``decode`` give the ids and text that llama.cpp gives for the same file;
    ``detokenizer()`` decodes a stream of ids without ever splitting a UTF-8 character.
    """

    def __init__(self, vocab: Vocab, metadata: Mapping[str, Any] | None = None):
        self.vocab = vocab
        # the file's other metadata (chat template, names), without the big token arrays
        self.metadata: dict[str, Any] = {
            k: v for k, v in (metadata or {}).items() if not k.startswith("tokenizer.ggml.")
        }
        if vocab.type == VocabType.SPM:
            self._impl: SpmTokenizer | BpeTokenizer | WpmTokenizer = SpmTokenizer(vocab)
        elif vocab.type == VocabType.BPE:
            self._impl = BpeTokenizer(vocab)
        elif vocab.type == VocabType.WPM:
            self._impl = WpmTokenizer(vocab)
        else:
            raise TokenizerError(f"unsupported vocabulary type {vocab.type.name}")
        self._pieces: dict[int, bytes] = {}
        self._finders: dict[bool, tuple[re.Pattern[str] | None, list[int]]] = {}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        return cls(Vocab.from_metadata(metadata), metadata)

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """The tokenizer of an open ``picollama.gguf.GGUFReader``."""
        return cls.from_metadata(reader.metadata)

    # -- facts -----------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_tokens

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id, -1 if the vocabulary has none."""
        return self.vocab.special["bos"]

    @property
    def eos_id(self) -> int:
        return self.vocab.special["eos"]

    @property
    def eot_id(self) -> int:
        """End-of-turn id (``<|im_end|>``, ``<end_of_turn>``, ...), -1 if none."""
        return self.vocab.special["eot"]

    @property
    def unk_id(self) -> int:
        return self.vocab.special["unk"]

    @property
    def pad_id(self) -> int:
        return self.vocab.special["pad"]

    @property
    def add_bos(self) -> bool:
        """Whether the file asks for a BOS token in front of every prompt."""
        return self.vocab.add_bos

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every token that ends generation, as llama.cpp computes the set."""
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def is_control(self, token_id: int) -> bool:
        self._check_id(token_id)
        return self.vocab.is_control(token_id)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (``▁``/``Ġ`` and all)."""
        self._check_id(token_id)
        return self.vocab.tokens[token_id]

    # -- encoding --------------------------------------------------------------------------

    def encode(
        self, text: str | bytes, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_bos``: ``None`` adds what the file asks for (BOS and/or EOS, llama.cpp's
        ``add_special``), ``False`` adds nothing, ``True`` adds BOS even where the file does
        not ask for it. ``parse_special``: match control tokens written as text (such as
        ``<|im_start|>``); turn it off for text from users. Invalid UTF-8 (in ``bytes``) or
        lone surrogates (in ``str``) raise ``TokenizerError`` with the offset.
        """
        text = _checked_text(text)
        vocab = self.vocab
        add_special = add_bos is not False
        if vocab.type == VocabType.WPM:
            return self._encode_wpm(text, add_special, parse_special)
        out: list[int] = []
        if add_special and (vocab.add_bos or add_bos):
            if self.bos_id == TOKEN_NULL:
                raise TokenizerError("a BOS token was asked for, but the vocabulary has none")
            out.append(self.bos_id)

        fragments = self._partition(text, parse_special) if text else []
        if vocab.type == VocabType.SPM:
            prev_special = True  # a space prefix goes before the first text fragment
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    prev_special = True
                    continue
                if vocab.add_space_prefix and prev_special:
                    fragment = " " + fragment
                self._impl.encode(fragment.replace(" ", _ESCAPED_SPACE), out)
                prev_special = False
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    continue
                if vocab.escape_whitespaces:
                    fragment = fragment.replace(" ", _ESCAPED_SPACE)
                self._impl.encode(fragment, out)

        if add_special and vocab.add_eos:
            if self.eos_id == TOKEN_NULL:
                raise TokenizerError("the file asks for an EOS token, but the vocabulary has none")
            out.append(self.eos_id)
        return out

    def _encode_wpm(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        # BERT: [CLS] text [SEP] whenever specials are added, whatever add_bos says
        out: list[int] = []
        if add_special:
            if self.bos_id == TOKEN_NULL or self.vocab.special["sep"] == TOKEN_NULL:
                raise TokenizerError("a WPM vocabulary needs BOS and SEP ids to add them")
            out.append(self.bos_id)
        for fragment in self._partition(text, parse_special) if text else []:
            if isinstance(fragment, int):
                out.append(fragment)
            else:
                self._impl.encode(fragment, out)
        if add_special:
            out.append(self.vocab.special["sep"])
        return out

    def _special_finder(self, parse_special: bool) -> tuple[re.Pattern[str] | None, list[int]]:
        """A regex that finds where special tokens start, and the tokens it covers."""
        found = self._finders.get(parse_special)
        if found is None:
            vocab = self.vocab
            ids = [
                tid
                for tid in vocab.special_tokens
                if parse_special or not vocab.attrs[tid] & _CONTROL_OR_UNKNOWN
            ]
            regex = _trie_regex([vocab.tokens[tid] for tid in ids]) if ids else None
            found = self._finders[parse_special] = (regex, ids)
        return found

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Raw text cut into text fragments and special token ids (in text order)."""
        vocab = self.vocab
        regex, ids = self._special_finder(parse_special)
        if regex is None:
            return [text]
        # The longest special token starting at each position; every special token in the
        # text is a substring of one of these.
        longest = {m.group(1) for m in regex.finditer(text)}
        if not longest:
            return [text]
        tokens, attrs = vocab.tokens, vocab.attrs
        present = [tid for tid in ids if any(tokens[tid] in s for s in longest)]

        fragments: list[str | int] = [text]
        for tid in present:
            needle = tokens[tid]
            attr = attrs[tid]
            out: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or needle not in fragment:
                    out.append(fragment)
                    continue
                pos = 0
                while True:
                    match = fragment.find(needle, pos)
                    if match < 0:
                        break
                    left = fragment[pos:match]
                    if attr & _LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    pos = match + len(needle)
                    if attr & _RSTRIP:
                        while pos < len(fragment) and fragment[pos] in _C_SPACE:
                            pos += 1
                if pos < len(fragment):
                    out.append(fragment[pos:])
            fragments = out
        return fragments

    # -- decoding --------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes of one token (llama.cpp ``token_to_piece``).

        ``special``: render control and unknown tokens as their text; without it they are
        empty. Byte tokens give one raw byte, which may be part of a UTF-8 character.
        """
        self._check_id(token_id)
        if not special and self.vocab.attrs[token_id] & _CONTROL_OR_UNKNOWN:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id)
        return piece

    def _render(self, tid: int) -> bytes:
        vocab = self.vocab
        text = vocab.tokens[tid]
        attr = vocab.attrs[tid]
        if attr & (_CONTROL_OR_UNKNOWN | TokenAttr.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & TokenAttr.NORMAL:
            if vocab.type != VocabType.BPE or vocab.escape_whitespaces:
                return text.replace(_ESCAPED_SPACE, " ").encode("utf-8", "surrogateescape")
            return _gpt2_decode(text)
        if attr & TokenAttr.BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                raise TokenizerError(f"byte token {tid} has malformed text {text!r}") from None
        return b""  # unused and undefined tokens render as nothing

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """The bytes of ``ids`` (llama.cpp ``llama_detokenize``).

        ``skip_special``: drop the leading BOS / trailing EOS that the file adds and render
        control tokens as nothing (llama.cpp's ``remove_special`` and not
        ``unparse_special``). Space cleanup (``clean_spaces``) applies as in llama.cpp.
        """
        ids = list(ids)
        for tid in ids:
            self._check_id(tid)
        vocab = self.vocab
        remove_space = vocab.add_space_prefix
        if skip_special and vocab.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and vocab.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for tid in ids:
            piece = self.token_to_piece(tid, special=not skip_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        data = b"".join(parts)
        if vocab.clean_spaces:
            data = _clean_spaces(data)
        return data

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    def detokenizer(self, skip_special: bool = False) -> Detokenizer:
        """An incremental decoder: ``push(id)`` returns the newly completed text."""
        return Detokenizer(self, skip_special)

    def _check_id(self, token_id: int) -> None:
        try:
            if isinstance(token_id, bool):
                raise TypeError
            index = operator.index(token_id)  # ints and numpy integers
        except TypeError:
            raise TokenizerError(f"invalid token id {token_id!r}: not an integer") from None
        if not 0 <= index < self.n_vocab:
            raise TokenizerError(f"invalid token id {index}: the vocabulary has {self.n_vocab}")


class Detokenizer:
    """Turns token ids into text one at a time, never splitting a UTF-8 character.

    Each ``push`` returns the text that became complete; bytes of a character still
    missing its tail wait for the next token. ``flush`` returns what is left, with an
    unfinished character as U+FFFD. Joined, the chunks equal ``Tokenizer.decode`` of the
    same ids (except llama.cpp's ``clean_spaces`` cleanup, which, as in llama.cpp's own
    streaming, is not applied token by token).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self._remove_space = tokenizer.vocab.add_space_prefix

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        if self._first:
            self._first = False
            if self.skip_special and tok.vocab.add_bos and token_id == tok.bos_id:
                tok._check_id(token_id)
                self._remove_space = False
                return ""
        piece = tok.token_to_piece(token_id, special=not self.skip_special)
        if self._remove_space and piece.startswith(b" "):
            piece = piece[1:]
        self._remove_space = False
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """The rest of the text; an incomplete trailing character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


def _checked_text(text: str | bytes) -> str:
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerError(
                f"input is not valid UTF-8: byte 0x{exc.object[exc.start]:02x} at offset "
                f"{exc.start} ({exc.reason})"
            ) from None
    if not isinstance(text, str):
        raise TokenizerError(f"can only tokenize str or bytes, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TokenizerError(
            f"input has a lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start}, "
            "which is not valid UTF-8"
        ) from None
    return text


def _gpt2_decode(text: str) -> bytes:
    """GPT-2 byte-level text back to bytes (llama.cpp ``llama_decode_text``)."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in text)
    except KeyError:
        pass
    out = bytearray()
    for c in text:
        b = UNICODE_TO_BYTE.get(c)
        if b is not None:
            out.append(b)
        else:  # llama.cpp's marker for a character outside the byte alphabet
            raw = c.encode("utf-8", "surrogateescape")
            out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8", "surrogateescape")
            out += b"]"
    return bytes(out)


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's ``clean_spaces`` passes (``clean_up_tokenization_spaces``)."""
    if not data:
        return data
    # " ?", " !", " .", " ,": drop the space
    text = bytearray(data[:1])
    for i in range(1, len(data)):
        x = data[i]
        if data[i - 1] == 0x20 and x in b"?!.,":
            text.pop()
        text.append(x)
    # " ' ": drop both spaces around a lone apostrophe. llama.cpp works in place and
    # overwrites the second space with NUL, which the next test then sees.
    src = bytes(text)
    text = bytearray(src[:1])
    nul = -1
    i = 1
    while i < len(src):
        x = src[i]
        before = 0 if i - 1 == nul else src[i - 1]
        if x == 0x27 and i + 1 < len(src) and before == 0x20 and src[i + 1] == 0x20:
            text.pop()
            text.append(x)
            nul = i + 1
            i += 2
            continue
        text.append(x)
        i += 1
    # " 's", " 'm", " 're", " 've": drop the space
    src = bytes(text)
    text = bytearray(src[:1])
    for i in range(1, len(src)):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < len(src):
            x1 = src[i + 1]
            if x1 in b"sm" or (i + 2 < len(src) and src[i + 1 : i + 3] in (b"re", b"ve")):
                text.pop()
        text.append(x)
    return bytes(text)


def _trie_regex(words: list[str]) -> re.Pattern[str]:
    """A regex whose lookahead finds, at every position, the longest of ``words`` there."""
    trie: dict = {}
    for word in words:
        node = trie
        for c in word:
            node = node.setdefault(c, {})
        node[""] = {}

    def emit(node: dict) -> str:
        branches = [re.escape(c) + emit(child) for c, child in sorted(node.items()) if c]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # greedy: prefer the longer word when this node also ends one
        return f"(?:{body})?" if "" in node else body

    return re.compile("(?=(" + emit(trie) + "))")
