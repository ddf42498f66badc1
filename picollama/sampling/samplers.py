"""The sampler chain: llama.cpp's samplers, defaults and order, as small pure functions.

Each sampler takes and returns ``Candidates`` (token ids with their logits, like llama.cpp's
``llama_token_data_array``); the last step draws a token with an explicit random generator,
so a seed reproduces a run. The default order is llama.cpp's: penalties, top-k, typical,
top-p, min-p, temperature, then the draw. A temperature of 0 (or less) is greedy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numba
import numpy as np

from picollama.backends.base import TOP_LOGITS

__all__ = [
    "SamplingParams",
    "Candidates",
    "Sampler",
    "apply_penalties",
    "top_k",
    "typical",
    "top_p",
    "min_p",
    "temperature",
    "ban",
]

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: pick a random seed


@dataclass
class SamplingParams:
    """llama.cpp's ``common_params_sampling`` defaults."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_keep: int = 0
    seed: int = DEFAULT_SEED
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self, n_vocab: int | None = None) -> None:
        """Raise ``ValueError`` naming the first parameter out of range."""
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 <= self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in [0, 1], got {self.typical_p}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n}")
        if self.repeat_penalty <= 0 or not math.isfinite(self.repeat_penalty):
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if n_vocab is not None:
            for tok in self.logit_bias:
                if not 0 <= int(tok) < n_vocab:
                    raise ValueError(f"logit_bias token {tok} is outside the vocabulary")


@dataclass
class Candidates:
    """Token ids and their logits; ``sorted`` says whether they are in descending order."""

    ids: np.ndarray  # int64
    logits: np.ndarray  # float32
    sorted: bool = False

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> Candidates:
        return cls(_token_ids(len(logits)), logits.astype(np.float32, copy=False))

    def __len__(self) -> int:
        return len(self.ids)

    def sort(self) -> Candidates:
        if not self.sorted:
            order = np.argsort(-self.logits, kind="stable")
            return Candidates(self.ids[order], self.logits[order], True)
        return self

    def keep(self, n: int) -> Candidates:
        c = self.sort()
        return Candidates(c.ids[:n], c.logits[:n], True)

    def probs(self) -> np.ndarray:
        """Softmax of the logits, in float64 for stable cumulative sums."""
        z = self.logits.astype(np.float64)
        z = np.exp(z - z.max())
        return z / z.sum()


_IDS: dict[int, np.ndarray] = {}


def _token_ids(n: int) -> np.ndarray:
    """``arange(n)`` as int64, made once per vocabulary size and read-only (candidates only
    ever index it into new arrays): a 49k-token vocabulary's took a tenth of a sample."""
    ids = _IDS.get(n)
    if ids is None:
        ids = _IDS[n] = np.arange(n, dtype=np.int64)
        ids.flags.writeable = False
    return ids


def apply_penalties(
    logits: np.ndarray,
    history: Sequence[int],
    repeat: float,
    freq: float,
    present: float,
    ids: np.ndarray | None = None,
) -> np.ndarray:
    """Repetition, frequency and presence penalties over ``history`` (the last N tokens).

    ``logits`` is the full-vocabulary row (penalties come first in the chain), or with
    ``ids`` (ascending) the logits of those tokens alone: history tokens not among them are
    left out (a penalty only lowers a logit). A new array is returned.
    """
    if not history or (repeat == 1.0 and freq == 0.0 and present == 0.0):
        return logits
    logits = logits.copy()
    for tok, count in Counter(history).items():
        i = tok
        if ids is not None:
            i = int(np.searchsorted(ids, tok))
            if i == len(ids) or ids[i] != tok:
                continue
        elif not 0 <= tok < len(logits):
            continue
        if logits[i] <= 0:
            logits[i] *= repeat
        else:
            logits[i] /= repeat
        logits[i] -= count * freq + (count > 0) * present
    return logits


@numba.njit(cache=True, nogil=True)
def _heap_top_k(logits, k, blocks, block):
    """``_top_k_indices`` over the logits of the ``blocks`` (runs of ``block`` logits
    from ``blocks[j] * block``, in increasing order; the last may be short), the others
    taken as out of the running: one pass with a min-heap of ``k`` entries. Once the heap
    is full, a run of logits none of which beats its root (a later logit equal to it loses
    the tie) is passed over after counting those that do, a loop that vectorizes."""
    heap_v = np.empty(k, np.float32)
    heap_i = np.empty(k, np.int64)
    size = 0
    n = logits.shape[0]
    for jb in range(blocks.shape[0]):
        r0 = blocks[jb] * block
        r1 = min(r0 + block, n)
        if size == k:
            root = heap_v[0]
            beats = 0
            for t in range(r0, r1):
                beats += logits[t] > root  # NaN beats nothing
            if beats == 0:
                continue
        for i in range(r0, r1):
            v = logits[i]
            if v != v:  # NaN never wins
                continue
            if size < k:
                j = size
                size += 1
            elif v > heap_v[0]:
                j = 0  # replace the root, then sift it down
                while True:
                    c = 2 * j + 1
                    if c >= k:
                        break
                    if c + 1 < k and (
                        heap_v[c + 1] < heap_v[c]
                        or (heap_v[c + 1] == heap_v[c] and heap_i[c + 1] > heap_i[c])
                    ):
                        c += 1
                    if heap_v[c] < v or (heap_v[c] == v and heap_i[c] > i):
                        heap_v[j] = heap_v[c]
                        heap_i[j] = heap_i[c]
                        j = c
                    else:
                        break
                heap_v[j] = v
                heap_i[j] = i
                continue
            else:
                continue
            # sift up a new entry (heap order: smallest value, then highest index, at the root)
            while j > 0:
                parent = (j - 1) // 2
                if heap_v[parent] > v or (heap_v[parent] == v and heap_i[parent] < i):
                    heap_v[j] = heap_v[parent]
                    heap_i[j] = heap_i[parent]
                    j = parent
                else:
                    break
            heap_v[j] = v
            heap_i[j] = i
    out = heap_i[:size].copy()
    vals = heap_v[:size].copy()
    order = np.argsort(-vals, kind="mergesort")  # stable: equal logits keep index order
    # mergesort is stable over the heap's order, not the indices: fix ties by index
    res = out[order]
    rv = vals[order]
    start = 0
    for i in range(1, size + 1):
        if i == size or rv[i] != rv[start]:
            if i - start > 1:  # a tie
                res[start:i] = np.sort(res[start:i])
            start = i
    return res


# logits a block of ``_top_k_indices``' first pass takes (its maximum: ``_block_max``)
_TOPK_BLOCK = 64


@numba.njit(cache=True, nogil=True, inline="always")
def _block_max(logits, r0, r1):
    """The largest of ``logits[r0 : r1]``, NaN never winning (-inf if all are NaN): eight
    running maxima in scalars, which LLVM packs into one vector max a step (a running-
    maxima array in memory stays scalar), then the last few one by one."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(-np.inf)
    end = r0 + (r1 - r0) // 8 * 8
    for t in range(r0, end, 8):
        v = logits[t]
        m0 = v if v > m0 else m0
        v = logits[t + 1]
        m1 = v if v > m1 else m1
        v = logits[t + 2]
        m2 = v if v > m2 else m2
        v = logits[t + 3]
        m3 = v if v > m3 else m3
        v = logits[t + 4]
        m4 = v if v > m4 else m4
        v = logits[t + 5]
        m5 = v if v > m5 else m5
        v = logits[t + 6]
        m6 = v if v > m6 else m6
        v = logits[t + 7]
        m7 = v if v > m7 else m7
    a = m0 if m0 > m1 else m1
    b = m2 if m2 > m3 else m3
    c = m4 if m4 > m5 else m5
    d = m6 if m6 > m7 else m7
    a = a if a > b else b
    c = c if c > d else d
    m = a if a > c else c
    for t in range(end, r1):
        m = logits[t] if logits[t] > m else m
    return m


@numba.njit(cache=True, nogil=True)
def _top_k_indices(logits, k):
    """Indices of the ``k`` largest logits, largest first (ties: the lower index first).

    Two passes: the maximum of every block of ``_TOPK_BLOCK`` logits (NaN never wins; a
    block of NaNs -inf), then the heap (``_heap_top_k``) over the blocks whose maximum
    reaches the k-th largest of those maxima (``np.partition``). That k-th maximum is at
    most the k-th largest logit (the k blocks it ranks among hold k logits at least as
    large, or it is -inf and every block takes part), so every block holding one of the k
    largest takes part, and the heap orders them as over the whole row; it sees a few
    dozen blocks instead of the whole vocabulary (an argpartition of a 262k vocabulary
    takes several milliseconds, a decode step's worth; the heap over all of SmolLM2's
    49152 logits took ~135 us a row, these two passes ~30)."""
    n = logits.shape[0]
    block = _TOPK_BLOCK
    n_blocks = (n + block - 1) // block
    if k <= 0 or n_blocks < 4 * k:
        return _heap_top_k(logits, k, np.arange(n_blocks), block)
    maxima = np.empty(n_blocks, np.float32)
    # the whole blocks apart from the last: their known length unrolls the maximum's loop
    # (one loop over all blocks with a min() bound ran at a third of the speed)
    for b in range(n_blocks - 1):
        maxima[b] = _block_max(logits, b * block, b * block + block)
    maxima[-1] = _block_max(logits, (n_blocks - 1) * block, n)
    kth = np.partition(maxima, n_blocks - k)[n_blocks - k]
    keep = np.empty(n_blocks, np.int64)  # (np.flatnonzero took longer than this loop)
    n_keep = 0
    for b in range(n_blocks):
        if maxima[b] >= kth:
            keep[n_keep] = b
            n_keep += 1
    return _heap_top_k(logits, k, keep[:n_keep], block)


# the most candidates the compiled chain takes: numpy sums up to 128 numbers in one block
FAST_CHAIN_MAX = 128


@numba.njit(cache=True, nogil=True)
def _block_sum(a):
    """numpy's sum of up to 128 float64 numbers, in its order (eight lanes, then the
    rest), so that a sum here has numpy's bits. (Above 128 numpy halves the array
    recursively; Numba's cache can't hold a recursive function, and the chain never
    needs it.)"""
    n = len(a)
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[i]
        return res
    r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    i = 8
    while i < n - n % 8:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[i]
        i += 1
    return res


@numba.njit(cache=True, nogil=True)
def _probs(logits):
    """``Candidates.probs`` of up to FAST_CHAIN_MAX logits compiled: the float64
    softmax, numpy's operations in order."""
    z = logits.astype(np.float64)
    z = np.exp(z - z.max())
    return z / _block_sum(z)


@numba.njit(cache=True, nogil=True)
def _fast_chain(logits, k, top_p_, min_p_, keep, temp):
    """top-k, top-p, min-p and temperature (the default chain without typical sampling)
    over unsorted candidates' ``logits``, as the functions above do it, in one compiled
    call: the kept positions, largest first, and the cumulative distribution the draw
    searches (``Generator.choice``'s: the probabilities' cumsum over its last entry).
    ``ok`` is False where the Python chain must decide instead (NaN logits or
    probabilities, where it raises or sorts NaN its own way)."""
    part = _top_k_indices(logits, k)
    if len(part) < k:
        return part, np.empty(0), False
    x = logits[part]
    n = k
    if top_p_ < 1.0:
        cum = np.cumsum(_probs(x))
        m = 0
        while m < n and cum[m] < top_p_:  # searchsorted(cum, p, "left")
            m += 1
        n = min(max(m + 1, keep), n)
    if min_p_ > 0.0 and n > 1:
        threshold = x[:n].max() + np.float32(math.log(min_p_))
        m = 0
        for i in range(n):
            m += x[i] >= threshold
        if m < keep:
            n = keep  # x is sorted: keep(min_keep) is its first ones
        else:
            sel = np.empty(m, np.int64)
            j = 0
            for i in range(n):
                if x[i] >= threshold:
                    sel[j] = i
                    j += 1
            part = part[sel]
            x = x[sel]
            n = m
    part = part[:n]
    x = (x[:n] / np.float32(temp)).astype(np.float32)
    cdf = np.cumsum(_probs(x))
    ok = not np.isnan(cdf[-1])
    return part, cdf / cdf[-1], ok


def top_k(c: Candidates, k: int, min_keep: int = 1) -> Candidates:
    if k <= 0:
        return c
    k = max(k, min_keep)
    if k >= len(c):
        return c.sort()
    part = _top_k_indices(np.ascontiguousarray(c.logits, np.float32), k)
    if len(part) < min(k, len(c)):  # NaN logits: leave them to the full sort's order
        return c.keep(k)
    return Candidates(c.ids[part], c.logits[part], True)


def typical(c: Candidates, p: float, min_keep: int = 1) -> Candidates:
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy."""
    if p >= 1.0:
        return c
    probs = c.probs()
    logp = np.log(np.maximum(probs, 1e-300))
    entropy = -(probs * logp).sum()
    shifted = np.abs(-logp - entropy)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, p, side="right")) + 1
    n = min(max(n, min_keep), len(order))
    keep = order[:n]
    return Candidates(c.ids[keep], c.logits[keep], False)


def top_p(c: Candidates, p: float, min_keep: int = 1) -> Candidates:
    if p >= 1.0:
        return c
    c = c.sort()
    cum = np.cumsum(c.probs())
    # keep up to and including the first token where the cumulative mass reaches p
    n = int(np.searchsorted(cum, p, side="left")) + 1
    return c.keep(min(max(n, min_keep), len(c)))


def min_p(c: Candidates, p: float, min_keep: int = 1) -> Candidates:
    if p <= 0.0 or len(c) <= 1:
        return c
    threshold = c.logits.max() + math.log(p)
    mask = c.logits >= threshold
    if mask.sum() < min_keep:
        return c.keep(min_keep)
    return Candidates(c.ids[mask], c.logits[mask], c.sorted)


def temperature(c: Candidates, t: float) -> Candidates:
    if t <= 0.0:
        best = int(np.argmax(c.logits))
        return Candidates(c.ids[best : best + 1], c.logits[best : best + 1], True)
    return Candidates(c.ids, (c.logits / np.float32(t)).astype(np.float32), c.sorted)


def ban(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``logits`` (a row, or a ``TOP_LOGITS`` row of a row's largest) with tokens ``ids``
    at -inf (``ignore_eos``: end-of-generation tokens can't be drawn); a new array."""
    out = logits.copy()
    if out.dtype == TOP_LOGITS:
        hit = np.zeros(out.shape, dtype=bool)
        for tok in np.asarray(ids).reshape(-1).tolist():  # a few ids: cheaper than np.isin
            hit |= out["id"] == tok
        out["logit"][hit] = -np.inf
    else:
        out[ids] = -np.inf
    return out


def _penalized(history: Sequence[int], p: SamplingParams) -> set[int]:
    if p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
        return set()
    return set(history)


class Sampler:
    """The chain for one generation; ``sample(logits)`` returns a token id.

    Tokens the caller accepts (prompt and output) feed the penalty window through
    ``accept``.

    ``grammar`` (optional, default: none) constrains the output: a
    ``picollama.sampling.grammar.TokenConstraint`` (a matcher is made for this
    generation) or a ``GrammarMatcher``. As llama.cpp's ``common_sampler_sample``, the
    token drawn by the chain is checked first; only if the grammar rejects it are the
    logits masked with the grammar's full mask and the chain run again. End-of-generation
    tokens are allowed only where the grammar may end, and once it is complete they are
    the only tokens allowed.
    """

    def __init__(
        self,
        params: SamplingParams | None = None,
        n_vocab: int | None = None,
        grammar=None,
    ):
        self.params = params or SamplingParams()
        self.params.validate(n_vocab)
        seed = self.params.seed
        if seed is None or seed == DEFAULT_SEED or seed < 0:
            seed = int(np.random.SeedSequence().entropy % (1 << 32))
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.history: list[int] = []
        self.grammar = None
        if grammar is not None:
            self.grammar = grammar if hasattr(grammar, "allows") else grammar.matcher()
        self._sampled: int | None = None  # the last token sample() returned, not yet accepted

    def accept(self, token: int, accept_grammar: bool | None = None) -> None:
        """Record ``token``; advance the grammar too when ``accept_grammar`` (default:
        when ``token`` is the one ``sample`` just returned, so prompt tokens are not fed
        to the grammar, as llama.cpp's ``accept_grammar=false`` for the prompt)."""
        self.history.append(int(token))
        n = self.params.repeat_last_n
        limit = 4096 if n == -1 else max(n, 0)
        if len(self.history) > 2 * max(limit, 64):
            self.history = self.history[-limit:] if limit else []
        if self.grammar is not None:
            if accept_grammar is None:
                accept_grammar = self._sampled is not None and int(token) == self._sampled
            self._sampled = None
            if accept_grammar:
                self.grammar.accept_token(int(token))

    def _window(self) -> list[int]:
        n = self.params.repeat_last_n
        if n == 0:
            return []
        return self.history if n == -1 else self.history[-n:]

    def top_needed(self, n_banned: int = 0) -> int:
        """How many of a logit row's largest entries decide the next draw, whatever the
        rest (0: the whole row is needed): enough for top-k (or greedy) to pick from after
        the penalties, which only lower the logits of the window's tokens, and after
        ``n_banned`` tokens are banned. With a grammar, logit biases or no top-k the whole
        row counts. The backend may then read back only those (``Segment.top_k``)."""
        p = self.params
        if self.grammar is not None or p.logit_bias:
            return 0
        if p.temperature <= 0.0:
            n = max(p.min_keep, 1)  # greedy: the largest (after the penalties)
        elif p.top_k > 0:
            n = max(p.top_k, p.min_keep)
        else:
            return 0
        return n + len(_penalized(self._window(), p)) + max(n_banned, 0)

    def candidates(self, logits: np.ndarray) -> Candidates:
        """The filtered, temperature-scaled candidates before the draw.

        ``logits``: the whole row, or a row's largest as ``TOP_LOGITS`` pairs (at least
        ``top_needed()`` of them): the chain then starts from those, in token order, and
        picks what it picks from the whole row."""
        return self._chain(self._prepared(logits))

    def _top_candidates(self, top: np.ndarray) -> Candidates:
        """Candidates of a row's largest logits, as the whole row's would be before top-k:
        in token order (so that ties fall as they do in the row), penalties applied."""
        p = self.params
        if p.logit_bias or self.grammar is not None:
            raise ValueError("a sampler with logit biases or a grammar needs the whole row")
        order = np.argsort(top["id"], kind="stable")
        ids = top["id"][order].astype(np.int64)
        logits = top["logit"][order].astype(np.float32)
        logits = apply_penalties(
            logits, self._window(), p.repeat_penalty, p.frequency_penalty, p.presence_penalty, ids
        )
        return Candidates(ids, logits)

    def _chain(self, c: Candidates) -> Candidates:
        p = self.params
        keep = max(p.min_keep, 1)
        if p.temperature <= 0.0:
            return temperature(c, p.temperature)
        c = top_k(c, p.top_k, keep)
        c = typical(c, p.typical_p, keep)
        c = top_p(c, p.top_p, keep)
        c = min_p(c, p.min_p, keep)
        return temperature(c, p.temperature)

    def _draw(self, c: Candidates) -> int:
        if len(c) == 1:
            return int(c.ids[0])
        probs = c.probs()
        return int(c.ids[self.rng.choice(len(probs), p=probs)])

    def _chain_draw(self, c: Candidates) -> int:
        """``_draw(_chain(c))``: for the default chain (top-k below the candidates' count
        and at most FAST_CHAIN_MAX, no typical sampling, a temperature) in one compiled
        call and one uniform draw, the same token and the same use of the generator
        (``Generator.choice`` draws one uniform and searches its cumulative distribution);
        else the chain step by step. ~125 -> ~20 us a sample from a row's 128 largest."""
        p = self.params
        keep = max(p.min_keep, 1)
        k = max(p.top_k, keep)
        simple = p.temperature > 0.0 and p.typical_p >= 1.0 and p.top_k > 0
        if not simple or k >= len(c) or k > FAST_CHAIN_MAX:
            return self._draw(self._chain(c))
        logits = np.ascontiguousarray(c.logits, np.float32)
        part, cdf, ok = _fast_chain(logits, k, p.top_p, p.min_p, keep, p.temperature)
        if not ok:
            return self._draw(self._chain(c))
        if len(part) == 1:
            return int(c.ids[part[0]])
        u = self.rng.random()
        return int(c.ids[part[int(np.searchsorted(cdf, u, side="right"))]])

    def _prepared(self, logits: np.ndarray) -> Candidates:
        """The candidates before the chain: biases and penalties applied (the chain's
        first steps), from a whole row or a row's largest."""
        p = self.params
        if logits.dtype == TOP_LOGITS:
            return self._top_candidates(logits.reshape(-1))
        # the filters make new arrays: the row is copied only to add biases
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        if p.logit_bias:
            row = row.copy()
        for tok, bias in p.logit_bias.items():
            row[int(tok)] += np.float32(bias)
        row = apply_penalties(
            row, self._window(), p.repeat_penalty, p.frequency_penalty, p.presence_penalty
        )
        return Candidates.from_logits(row)

    def sample(self, logits: np.ndarray) -> int:
        if self.grammar is None:
            return self._chain_draw(self._prepared(logits))
        token = self._sample_constrained(logits)
        self._sampled = token
        return token

    def _sample_constrained(self, logits: np.ndarray) -> int:
        from picollama.sampling.grammar import GrammarError

        g = self.grammar
        eog = g.constraint.eog_ids
        if g.is_complete():
            if not len(eog):
                raise GrammarError("the grammar is complete and the vocabulary has no end token")
            row = np.asarray(logits, dtype=np.float32).reshape(-1)
            return int(eog[np.argmax(row[eog])]) if len(row) > eog.max() else int(eog[0])
        token = self._chain_draw(self._prepared(logits))
        if g.allows(token):
            return token
        # the drawn token is rejected: mask the logits and run the chain again
        mask = g.allowed_mask()
        if not mask.any():
            raise GrammarError("no token of the vocabulary can continue the grammar here")
        row = np.array(logits, dtype=np.float32).reshape(-1)
        n = min(len(row), len(mask))
        row[:n][~mask[:n]] = -np.inf
        row[n:] = -np.inf
        token = self._chain_draw(self._prepared(row))
        assert mask[token], "masked sampling returned a rejected token"
        return token
