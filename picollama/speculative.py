"""Speculative decoding: a cheap drafter proposes tokens, the target checks them all at once.

Each round the target model evaluates its pending token and up to ``n_max`` drafted
tokens in one batched forward pass, so it reads its weights once for several tokens, then
keeps the longest run of drafts it agrees with plus one token of its own, and rolls its KV
cache back past the rest. Two drafters:

- ``ModelDrafter``: a smaller model with the same vocabulary (``-md/--model-draft``) decodes
  ahead in its own KV cache, which is synchronized with the accepted tokens each round;
- ``LookupDrafter``: prompt lookup (``--lookup-ngram N``), no second model: the tokens that
  followed the latest earlier occurrence of the last ``n`` tokens (longest ``n`` first) in
  the prompt and output.

Correctness. The output is the target's, in distribution and at temperature 0 token for
token:

- greedy (temperature <= 0) and grammar-constrained sampling: at every position the target's
  own sampler picks the token from the verified logits (which are the logits a plain decode
  would compute, since every earlier token of the batch is the accepted one), and a draft
  token is kept only if it is that pick. So a draft the grammar rejects is never kept, and
  the output is exactly what the sampler would produce one token at a time;
- sampling without a grammar: the rejection rule of Leviathan et al. (2023) / Chen et al.
  (2023): a draft token ``x`` drawn from the drafter's distribution ``q`` is kept with
  probability ``min(1, p(x) / q(x))``, where ``p`` is the target sampler's distribution
  (penalties, top-k/top-p/min-p, temperature) at that position; at the first rejection the
  token is drawn from ``max(0, p - q)`` renormalized, and after a fully accepted draft one
  more token from ``p``. Prompt lookup proposes deterministically (``q`` a point mass).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from picollama.sampling.samplers import Candidates, Sampler
from picollama.sampling.samplers import ban as ban_tokens  # the local ban() wraps it

__all__ = [
    "SpeculativeError",
    "SpecParams",
    "SpecStats",
    "Drafter",
    "ModelDrafter",
    "LookupDrafter",
    "Speculator",
    "check_vocab_match",
]


class SpeculativeError(ValueError):
    """A draft model that cannot draft for this target, or bad speculative settings."""


@dataclass
class SpecParams:
    """llama.cpp's speculative knobs: ``--spec-draft-n-max`` (tokens drafted per round),
    ``--spec-draft-n-min`` (a shorter draft is dropped) and ``--spec-draft-p-min`` (the
    draft model stops when its most likely token is less likely than this)."""

    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0

    def validate(self) -> None:
        if self.n_max < 1:
            raise SpeculativeError(f"--spec-draft-n-max must be at least 1, got {self.n_max}")
        if not 0 <= self.n_min <= self.n_max:
            raise SpeculativeError(
                f"--spec-draft-n-min must be between 0 and n-max ({self.n_max}), got {self.n_min}"
            )
        if not 0.0 <= self.p_min <= 1.0:
            raise SpeculativeError(f"--spec-draft-p-min must be in [0, 1], got {self.p_min}")


@dataclass
class SpecStats:
    """Counts over a generation, as llama.cpp's speculative tools print them."""

    n_drafted: int = 0
    n_accepted: int = 0
    n_rounds: int = 0  # target forward passes after the prompt
    n_generated: int = 0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.n_generated / self.n_rounds if self.n_rounds else 0.0

    def report(self) -> str:
        total = self.draft_ms + self.target_ms
        speed = self.n_generated / (total / 1000) if total > 0 else 0.0
        return (
            f"n_predict = {self.n_generated}\n"
            f"n_drafted = {self.n_drafted}\n"
            f"n_accept  = {self.n_accepted}\n"
            f"accept    = {100 * self.acceptance:.3f}%\n"
            f"target passes = {self.n_rounds} ({self.tokens_per_pass:.2f} tokens per pass)\n"
            f"draft time = {self.draft_ms:.2f} ms, target time = {self.target_ms:.2f} ms, "
            f"decode speed = {speed:.2f} tokens per second"
        )


class Drafter:
    """Proposes tokens to follow ``history``; ``q`` says how they were drawn."""

    def start(self, prompt: Sequence[int], sampler: Sampler | None = None) -> None:
        """A new generation after ``prompt`` with the target's ``sampler`` (a drafter with
        a cache may prefill the prompt)."""

    def draft(self, history: list[int], n: int) -> tuple[list[int], list[Candidates | None]]:
        """Up to ``n`` tokens to follow ``history``, each with the distribution it was
        drawn from (None: proposed deterministically, a point mass)."""
        raise NotImplementedError


def _vocab(engine) -> tuple[str, list]:
    tokens = engine.reader.get("tokenizer.ggml.tokens") or []
    return str(engine.reader.get("tokenizer.ggml.model", "")), list(tokens)


def check_vocab_match(target, draft) -> None:
    """Refuse a draft model whose vocabulary is not the target's (engines)."""
    t_model, t_tokens = _vocab(target)
    d_model, d_tokens = _vocab(draft)
    problem = None
    if t_model != d_model:
        problem = f"tokenizer '{d_model}' against the target's '{t_model}'"
    elif target.n_vocab != draft.n_vocab:
        problem = f"{draft.n_vocab} tokens against the target's {target.n_vocab}"
    elif len(t_tokens) != len(d_tokens):
        problem = f"{len(d_tokens)} token strings against the target's {len(t_tokens)}"
    else:
        for i, (a, b) in enumerate(zip(t_tokens, d_tokens, strict=True)):
            if a != b:
                problem = f"token {i} is {b!r} in the draft and {a!r} in the target"
                break
    if problem is None:
        for name in ("bos_id", "eos_id"):
            a, b = getattr(target.tokenizer, name, None), getattr(draft.tokenizer, name, None)
            if a != b:
                problem = f"{name} {b} against the target's {a}"
                break
    if problem is not None:
        raise SpeculativeError(
            f"the draft model cannot draft for this target, their vocabularies differ: {problem}"
        )


class ModelDrafter(Drafter):
    """A draft model decoding ahead in its own context (``generation.Context``)."""

    def __init__(self, ctx, params: SpecParams):
        self.ctx = ctx
        self.params = params
        self.sampler = None  # None: greedy drafts (a point mass each)

    def start(self, prompt: Sequence[int], sampler: Sampler | None = None) -> None:
        self.sampler = None
        p = sampler.params if sampler is not None else None
        if p is not None and p.temperature > 0.0 and sampler.grammar is None:
            # the draft's own distribution q: the target's chain without penalties (q may
            # be any distribution the draft really samples from)
            quiet = replace(
                p,
                repeat_penalty=1.0,
                frequency_penalty=0.0,
                presence_penalty=0.0,
                seed=(sampler.seed + 1) % (1 << 32),
            )
            self.sampler = Sampler(quiet, self.ctx.n_vocab)
        if len(prompt) > 1:
            self._sync(list(prompt)[:-1], want_logits=False)

    def _sync(self, history: list[int], want_logits: bool = True):
        """Make the draft cache hold ``history``; the logits after it."""
        ctx = self.ctx
        n_keep = 0
        for a, b in zip(ctx.tokens, history, strict=False):
            if a != b:
                break
            n_keep += 1
        if want_logits:
            n_keep = min(n_keep, len(history) - 1)  # evaluate the last token again
        ctx.truncate(n_keep)
        if n_keep < len(history):
            return ctx.eval(history[n_keep:])
        return None

    def draft(self, history, n):
        n = min(n, self.ctx.n_ctx - len(history))
        if n <= 0:
            return [], []
        logits = self._sync(history)
        tokens, dists = [], []
        for i in range(n):
            if self.sampler is None:
                token = int(np.argmax(logits))
                # (a softmax over the vocabulary costs ~0.2 ms: only when p_min asks)
                if self.params.p_min > 0.0 and _softmax_top(logits) < self.params.p_min:
                    break
                dist = None
            else:
                dist = self.sampler.candidates(logits)
                token = self.sampler._draw(dist)
                if float(dist.probs().max()) < self.params.p_min:
                    break
            tokens.append(token)
            dists.append(dist)
            if i + 1 < n:
                logits = self.ctx.eval([token])
        return tokens, dists


def _softmax_top(logits: np.ndarray) -> float:
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    return float(1.0 / np.exp(z - m).sum())


class LookupDrafter(Drafter):
    """Prompt lookup: the continuation of the latest earlier match of the last ``n``
    tokens, for ``n`` from ``ngram`` down to ``ngram_min``."""

    def __init__(self, ngram: int = 3, ngram_min: int = 1):
        if ngram < 1 or not 1 <= ngram_min <= ngram:
            raise SpeculativeError(f"--lookup-ngram must be at least 1, got {ngram}")
        self.ngram = ngram
        self.ngram_min = ngram_min

    def draft(self, history, n):
        h = np.asarray(history, dtype=np.int64)
        for size in range(min(self.ngram, len(h) - 1), self.ngram_min - 1, -1):
            pattern = h[-size:]
            body = h[:-1]  # a match must have at least one token after it
            if len(body) < size:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(body, size)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + size
                return h[start : start + n].tolist(), [None] * min(n, len(h) - start)
        return [], []


class Speculator:
    """A drafter with its settings and the statistics of the last generation."""

    def __init__(self, drafter: Drafter, params: SpecParams | None = None):
        self.drafter = drafter
        self.params = params or SpecParams()
        self.params.validate()
        self.stats = SpecStats()

    def generate(
        self,
        ctx,
        prompt: list[int],
        sampler: Sampler,
        max_tokens: int,
        stop: set[int] | None,
        ignore_eos: bool,
    ) -> Iterator[int]:
        """``Context.generate``'s loop, speculating (the caller checked the budget)."""
        st = self.stats = SpecStats()
        ctx.finish_reason = "length"
        t0 = time.perf_counter()
        n_cached = len(ctx.tokens)
        logits = ctx.prefill(prompt)
        t1 = time.perf_counter()
        ctx.timings.prompt_tokens = len(prompt) - min(n_cached, len(prompt) - 1)
        ctx.timings.prompt_ms = (t1 - t0) * 1000
        ctx.timings.predicted_tokens = 0
        ctx.timings.predicted_ms = 0.0
        for tok in prompt:
            sampler.accept(tok)
        banned = np.array(sorted(ctx.tokenizer.eog_ids), dtype=np.int64) if ignore_eos else None
        rejection = sampler.grammar is None and sampler.params.temperature > 0.0
        self.drafter.start(prompt, sampler)
        unlimited = max_tokens is None or max_tokens < 0

        def is_end(token: int) -> bool:
            hit = (token in stop) if stop is not None else ctx.tokenizer.is_eog(token)
            return hit and not ignore_eos

        def ban(row):
            return ban_tokens(row, banned) if banned is not None and len(banned) else row

        token = sampler.sample(ban(logits))
        sampler.accept(token)
        while True:
            if is_end(token):
                ctx.finish_reason = "stop"
                return
            st.n_generated += 1
            yield token
            if (not unlimited and st.n_generated >= max_tokens) or len(ctx.tokens) >= ctx.n_ctx:
                return
            # the round: draft, then the target checks [token, drafts...] in one pass
            room = ctx.n_ctx - len(ctx.tokens) - 1
            budget = self.params.n_max if unlimited else max_tokens - st.n_generated
            n = max(0, min(self.params.n_max, room, budget))
            t2 = time.perf_counter()
            drafts, dists = self.drafter.draft(ctx.tokens + [token], n) if n else ([], [])
            drafts, dists = drafts[:n], dists[:n]
            if len(drafts) < max(self.params.n_min, 1):
                drafts, dists = [], []
            t3 = time.perf_counter()
            base = len(ctx.tokens)
            if drafts:
                rows = ctx.eval([token, *drafts], all_logits=True)
            else:
                rows = ctx.eval([token])[None, :]  # a plain decode step (compiled)
            t4 = time.perf_counter()
            st.draft_ms += (t3 - t2) * 1000
            st.target_ms += (t4 - t3) * 1000
            ctx.timings.predicted_ms += (t4 - t2) * 1000
            st.n_rounds += 1
            st.n_drafted += len(drafts)
            accepted, nxt = 0, None
            for i, d in enumerate(drafts):
                row = ban(rows[i])
                if rejection:
                    keep, alt = _rejection_step(sampler, row, d, dists[i])
                else:
                    alt = sampler.sample(row)
                    keep = alt == d
                if not keep:
                    nxt = alt
                    break
                sampler.accept(d)
                accepted += 1
                st.n_generated += 1
                st.n_accepted += 1
                if is_end(d):
                    st.n_generated -= 1
                    ctx.truncate(base + 1 + accepted)
                    ctx.finish_reason = "stop"
                    return
                yield d
                if not unlimited and st.n_generated >= max_tokens:
                    ctx.truncate(base + 1 + accepted)
                    return
            if nxt is None:  # every draft kept: one more token from the last row
                nxt = sampler.sample(ban(rows[len(drafts)]))
            ctx.truncate(base + 1 + accepted)
            ctx.timings.predicted_tokens += 1 + accepted
            sampler.accept(nxt)
            token = nxt


def _rejection_step(sampler: Sampler, row, draft: int, q: Candidates | None) -> tuple[bool, int]:
    """Leviathan et al.'s test of one draft token against the target's row: (kept, token)."""
    c = sampler.candidates(row)
    p = c.probs()
    p_ids = c.ids
    where = np.flatnonzero(p_ids == draft)
    p_x = float(p[where[0]]) if len(where) else 0.0
    if q is None:
        q_x = 1.0
        q_on_p = (p_ids == draft).astype(np.float64)
    else:
        qp = q.probs()
        lookup = dict(zip(q.ids.tolist(), qp.tolist(), strict=True))
        q_x = lookup.get(int(draft), 0.0)
        q_on_p = np.array([lookup.get(int(t), 0.0) for t in p_ids.tolist()], dtype=np.float64)
    if q_x > 0.0 and sampler.rng.random() < min(1.0, p_x / q_x):
        return True, draft
    residual = np.maximum(p - q_on_p, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q on p's support: any rejection leaves p itself
        residual, total = p, p.sum()
    return False, int(p_ids[sampler.rng.choice(len(p_ids), p=residual / total)])
