"""Byte-pair encoding from merge ranks (llama.cpp ``llm_tokenizer_bpe_session``).

The pre-tokenizer cuts the text into words; each word, in GPT-2's byte-to-character
encoding (or raw UTF-8 for SPM-style BPE vocabularies), starts as one symbol per character.
The adjacent pair with the lowest merge rank (then the leftmost) is merged, its new pairs
are queued, stale ones skipped, until no pair has a rank. Each final symbol is its token;
a symbol missing from the vocabulary falls back to single-byte tokens, as llama.cpp does.
Words repeat a lot in real text, so results are cached per word.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from picollama.tokenizer.errors import TokenizerError
from picollama.tokenizer.unicode import BYTE_TO_UNICODE
from picollama.tokenizer.vocab import Vocab

__all__ = ["BpeTokenizer"]

_CACHE_LIMIT = 200_000

# str.translate table: a Latin-1 decoded byte to its GPT-2 character.
_BYTE_ENCODE_TABLE = {b: c for b, c in BYTE_TO_UNICODE.items()}


class BpeTokenizer:
    """Encodes text with a BPE vocabulary and its pre-tokenizer."""

    def __init__(self, vocab: Vocab):
        if vocab.pre is None:
            raise TokenizerError("a BPE vocabulary needs a pre-tokenizer")
        self.vocab = vocab
        self.pre = vocab.pre
        self._token_to_id = vocab.token_to_id
        self._ranks = vocab.bpe_ranks
        self._byte_encode = vocab.pre.byte_encode
        self._newline_words = vocab.pre.type == "gemma4"
        self._ignore_merges = vocab.ignore_merges
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        """Append the tokens of ``text`` (one raw-text fragment) to ``out``."""
        cache = self._cache
        for word in self.pre.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = tuple(self._encode_word(word))
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _encode_word(self, word: str) -> list[int]:
        if self._byte_encode:
            word = word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)
        token_to_id = self._token_to_id
        if self._ignore_merges or (self._newline_words and word.strip("\n") == ""):
            tid = token_to_id.get(word)
            if tid is not None:
                return [tid]
        return [tid for symbol in self._merge(word) for tid in self._symbol_tokens(symbol)]

    def _merge(self, word: str) -> list[str]:
        ranks = self._ranks
        syms = list(word)
        n = len(syms)
        if n < 2:
            return syms
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1

        # (rank, left, right, len(left), len(right)): a queued pair is stale once either
        # side has changed, which always changes (or empties) that side's length.
        heap: list[tuple[int, int, int, int, int]] = []
        for i in range(n - 1):
            rank = ranks.get((syms[i], syms[i + 1]))
            if rank is not None:
                heap.append((rank, i, i + 1, 1, 1))
        heapify(heap)

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            rank = ranks.get((syms[left], syms[right]))
            if rank is not None:
                heappush(heap, (rank, left, right, len(syms[left]), len(syms[right])))

        while heap:
            _, left, right, n_left, n_right = heappop(heap)
            sym_left, sym_right = syms[left], syms[right]
            if len(sym_left) != n_left or len(sym_right) != n_right or not sym_right:
                continue
            syms[left] = sym_left + sym_right
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [s for s in syms if s]

    def _symbol_tokens(self, symbol: str) -> list[int]:
        tid = self._token_to_id.get(symbol)
        if tid is not None:
            return [tid]
        # A symbol the vocabulary lacks: one token per byte, where such a token exists
        # (GPT-2 style: the byte as a one-byte string; SPM style: <0xXX>); others vanish.
        out = []
        for b in symbol.encode("utf-8"):
            if self._byte_encode:
                key = bytes([b]).decode("utf-8", "surrogateescape")
            else:
                key = f"<0x{b:02X}>"
            tid = self._token_to_id.get(key)
            if tid is not None:
                out.append(tid)
        return out
