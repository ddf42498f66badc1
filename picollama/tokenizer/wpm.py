"""WordPiece tokenization for BERT vocabularies (llama.cpp ``llm_tokenizer_wpm_session``).

The text is normalized (optionally accents stripped, by keeping the first codepoint of each
canonical decomposition and dropping marks; optionally lowercased), split on whitespace,
with each punctuation mark, ASCII symbol and CJK ideograph a word of its own. Each word,
with ``▁`` in front (GGUF's spelling of a word start), is then cut greedily into the
longest tokens of the vocabulary; a word that cannot be covered becomes the unknown token.
"""

from __future__ import annotations

from picollama.tokenizer.errors import TokenizerError
from picollama.tokenizer.unicode import (
    CONTROL,
    MARK,
    PUNCTUATION,
    SYMBOL,
    WHITESPACE,
    category_flag,
    nfd_first,
    to_lower,
)
from picollama.tokenizer.vocab import TOKEN_NULL, Vocab

__all__ = ["WpmTokenizer"]

_WORD_START = "\u2581"


def _is_chinese_char(cp: int) -> bool:
    # llama.cpp's ranges (0x2B920 where the Unicode block starts at 0x2B820, as HF has it)
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B920 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


class WpmTokenizer:
    """Encodes text with a WPM (BERT) vocabulary."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._token_to_id = vocab.token_to_id
        # the longest token, in characters (a token of n UTF-8 bytes has at most n)
        self._max_len = max(len(t) for t in vocab.tokens)

    def words(self, text: str) -> list[str]:
        """Normalized words of ``text`` (llama.cpp ``preprocess``)."""
        vocab = self.vocab
        words: list[list[str]] = [[]]
        for c in text:
            cp = ord(c)
            if vocab.strip_accents:
                cp = nfd_first(cp)
            if cp in WHITESPACE:
                if words[-1]:
                    words.append([])
                continue
            flag = category_flag(cp)
            if cp == 0 or cp == 0xFFFD or flag == CONTROL:
                continue
            if vocab.strip_accents and flag == MARK:
                continue
            s = chr(to_lower(cp) if vocab.lowercase else cp)
            if flag == PUNCTUATION or (cp < 0x7F and flag == SYMBOL) or _is_chinese_char(cp):
                if words[-1]:
                    words.append([])
                words[-1].append(s)
                words.append([])
            else:
                words[-1].append(s)
        return ["".join(w) for w in words if w]

    def encode(self, text: str, out: list[int]) -> None:
        """Append the tokens of ``text`` (one raw-text fragment) to ``out``."""
        token_to_id = self._token_to_id
        for word in self.words(text):
            word = _WORD_START + word
            n = len(word)
            start = len(out)
            i = 0
            while i < n:
                for j in range(min(n, i + self._max_len), i, -1):
                    tid = token_to_id.get(word[i:j])
                    if tid is not None:
                        out.append(tid)
                        i = j
                        break
                else:  # no token starts here: the whole word is unknown
                    del out[start:]
                    break
            if len(out) == start:
                unk = self.vocab.special["unk"]
                if unk == TOKEN_NULL:
                    raise TokenizerError(f"word {word[1:]!r} has no tokens and there is no UNK")
                out.append(unk)
