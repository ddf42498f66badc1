"""SentencePiece-style tokenization from scores (llama.cpp ``llm_tokenizer_spm_session``).

The text (spaces already escaped as ``▁``) starts as one symbol per codepoint. Every pair
of neighbours whose concatenation is a token is a candidate merge, ranked by that token's
score (higher first, then leftmost). The best candidate is merged, new candidates with its
neighbours are queued, stale ones are skipped, until none is left. Each final symbol is its
token, or, if the vocabulary lacks it, one byte token (``<0xXX>``) per UTF-8 byte.

Text is cut before each ``▁`` (escaped space) unless some token of the vocabulary holds
the character before it followed by ``▁``: no merge can then ever span the cut, so the
words on either side tokenize independently, with exactly the result of one pass over the
whole text, and repeated words come from a cache.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from picollama.tokenizer.vocab import Vocab

__all__ = ["SpmTokenizer"]

_ESCAPED_SPACE = "\u2581"
# Piece cache entries kept before the cache is cleared.
_CACHE_LIMIT = 200_000


class SpmTokenizer:
    """Encodes escaped text with an SPM vocabulary."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._token_to_id = vocab.token_to_id
        self._scores = vocab.scores
        self._cache: dict[str, tuple[int, ...]] = {}
        self._before_space: frozenset[str] | None = None

    def _chars_before_space(self) -> frozenset[str]:
        """Every character that some token has right before a ``▁``."""
        if self._before_space is None:
            chars = set()
            for text in self.vocab.tokens:
                i = text.find(_ESCAPED_SPACE, 1)
                while i != -1:
                    chars.add(text[i - 1])
                    i = text.find(_ESCAPED_SPACE, i + 1)
            self._before_space = frozenset(chars)
        return self._before_space

    def encode(self, text: str, out: list[int]) -> None:
        """Append the tokens of ``text`` (already space-escaped) to ``out``."""
        keep_together = self._chars_before_space()
        start = 0
        i = text.find(_ESCAPED_SPACE, 1)
        while i != -1:
            if text[i - 1] not in keep_together:
                out.extend(self._encode_piece(text[start:i]))
                start = i
            i = text.find(_ESCAPED_SPACE, i + 1)
        out.extend(self._encode_piece(text[start:]))

    def _encode_piece(self, text: str) -> tuple[int, ...]:
        cached = self._cache.get(text)
        if cached is not None:
            return cached
        ids = tuple(self._merge(text))
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[text] = ids
        return ids

    def _merge(self, text: str) -> list[int]:
        token_to_id = self._token_to_id
        scores = self._scores
        n = len(text)
        if n == 0:
            return []
        # symbol i covers text[start[i] : start[i] + size[i]]; size 0 once merged away
        start = list(range(n))
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1

        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = token_to_id.get(text[i : i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapify(heap)

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = text[start[left] : start[right] + size[right]]
            tid = token_to_id.get(piece)
            if tid is not None:
                heappush(heap, (-scores[tid], left, right, len(piece)))

        while heap:
            _, left, right, length = heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # one side changed since this candidate was queued
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[start[i] : start[i] + size[i]]
            tid = token_to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.vocab.byte_to_token(b) for b in piece.encode("utf-8"))
            i = nxt[i]
        return out
