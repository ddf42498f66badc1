"""Loading a model for inference, and the generation loop shared by CLI, server and API.

``Context`` holds one model, its tokenizer and a KV cache. ``generate`` is a generator:
it prefills the prompt in batches (reusing whatever prefix the cache already holds), then
yields sampled tokens one at a time until an end-of-generation token, the token budget or
the end of the context.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from picollama.backends.base import Backend, get_backend
from picollama.gguf import GGUFReader
from picollama.models import load_model
from picollama.models.registry import resolve_model_path
from picollama.sampling.samplers import Sampler, ban

__all__ = ["ContextOverflowError", "Timings", "Engine", "Context", "eval_batch"]


class ContextOverflowError(ValueError):
    """The prompt (plus the tokens asked for) does not fit in the context."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, n_predict: int = 0):
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.n_predict = n_predict
        if n_predict > 0:
            msg = (
                f"the prompt has {n_prompt_tokens} tokens and {n_predict} more were asked for, "
                f"but the context holds {n_ctx} (raise -c/n_ctx or ask for fewer tokens)"
            )
        else:
            msg = (
                f"the prompt has {n_prompt_tokens} tokens, more than the context of "
                f"{n_ctx} can hold (raise -c/n_ctx or shorten the prompt)"
            )
        super().__init__(msg)


@dataclass
class Timings:
    """What llama.cpp prints at the end of a run: load, prompt and generation times."""

    load_ms: float = 0.0
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_tokens: int = 0
    predicted_ms: float = 0.0
    extra: dict = field(default_factory=dict)

    @staticmethod
    def _rate(n: int, ms: float) -> float:
        return n / (ms / 1000.0) if ms > 0 else 0.0

    @property
    def prompt_per_second(self) -> float:
        return self._rate(self.prompt_tokens, self.prompt_ms)

    @property
    def predicted_per_second(self) -> float:
        return self._rate(self.predicted_tokens, self.predicted_ms)

    def report(self) -> str:
        return (
            f"load time = {self.load_ms:10.2f} ms\n"
            f"prompt eval time = {self.prompt_ms:10.2f} ms / {self.prompt_tokens:5d} tokens "
            f"({self.prompt_per_second:8.2f} tokens per second)\n"
            f"eval time = {self.predicted_ms:10.2f} ms / {self.predicted_tokens:5d} tokens "
            f"({self.predicted_per_second:8.2f} tokens per second)"
        )


class Engine:
    """A loaded model, its tokenizer and backend: what every sequence shares."""

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        n_batch: int = 512,
        n_threads: int | None = None,
        backend: str | Backend = "cpu",
    ):
        from picollama.tokenizer import Tokenizer

        t0 = time.perf_counter()
        if n_batch <= 0:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        self.path = resolve_model_path(model_path)
        self.backend = (
            get_backend(backend, n_threads=n_threads) if isinstance(backend, str) else backend
        )
        self.reader = GGUFReader(self.path)
        self.model = load_model(self.reader, self.backend)
        self.tokenizer = Tokenizer.from_gguf(self.reader)
        self.n_vocab = self.model.args.n_vocab
        self.n_batch = int(n_batch)
        self.load_ms = (time.perf_counter() - t0) * 1000

    def new_sequence(self, n_ctx: int) -> Context:
        """A sequence with its own KV cache of ``n_ctx`` positions (0: the training length)."""
        return Context(self, n_ctx=n_ctx)

    def close(self) -> None:
        self.reader.close()


class Context:
    """One sequence: a KV cache of ``n_ctx`` positions over an engine's model.

    ``Context(model_path, ...)`` loads its own engine; ``engine.new_sequence(n_ctx)`` makes
    another sequence that shares a loaded one (server slots).
    """

    def __init__(
        self,
        model_path: str | os.PathLike | Engine | None = None,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_threads: int | None = None,
        backend: str | Backend = "cpu",
    ):
        self._owns_engine = not isinstance(model_path, Engine)
        if isinstance(model_path, Engine):
            self.engine = model_path
        else:
            self.engine = Engine(model_path, n_batch=n_batch, n_threads=n_threads, backend=backend)
        e = self.engine
        self.path, self.backend, self.reader = e.path, e.backend, e.reader
        self.model, self.tokenizer, self.n_vocab = e.model, e.tokenizer, e.n_vocab
        self.n_batch = e.n_batch
        if n_ctx <= 0:
            n_ctx = self.model.args.n_ctx_train
        self.n_ctx = int(n_ctx)
        self.cache = self.model.new_cache(self.n_ctx)
        self.tokens: list[int] = []  # what the KV cache holds, position by position
        self.finish_reason: str | None = None
        self.timings = Timings(load_ms=e.load_ms)
        # a ``speculative.Speculator``: generate() drafts ahead and verifies in batches
        self.speculator = None

    def close(self) -> None:
        """Release the engine (only when this context loaded it itself)."""
        if self._owns_engine:
            self.engine.close()

    # -- evaluation -------------------------------------------------------------------------

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, n: int) -> None:
        """Forget every cached position from ``n`` on (the cache rolls back)."""
        n = max(0, min(n, len(self.tokens)))
        del self.tokens[n:]
        self.cache.n_past = n

    def eval(self, tokens: Sequence[int], all_logits: bool = False, top_k: int = 0) -> np.ndarray:
        """Append ``tokens`` to the cache, in batches of ``n_batch``.

        Returns the logits of the last token (n_vocab,), or of every token
        (len(tokens), n_vocab) with ``all_logits``. With ``top_k`` (the sampler's
        ``top_needed``) the last token's may come back as its ``top_k`` largest alone
        (``TOP_LOGITS``; ``Sampler.sample`` takes either).
        """
        tokens = [int(t) for t in tokens]
        self._check_append(tokens)
        out = []
        for i in range(0, len(tokens), self.n_batch):
            batch = np.array(tokens[i : i + self.n_batch], dtype=np.int64)
            rows = np.arange(len(batch)) if all_logits else None
            start = len(self.tokens)
            last = i + self.n_batch >= len(tokens)
            k = top_k if last and not all_logits else 0
            logits = self.model.forward(batch, start, self.cache, rows, k)
            self.tokens.extend(batch.tolist())
            self.cache.n_past = len(self.tokens)
            out.append(logits)
        return np.concatenate(out) if all_logits else out[-1][-1]

    def _check_append(self, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("eval needs at least one token")
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise ValueError(f"invalid token id {t} (vocabulary has {self.n_vocab})")
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(len(self.tokens) + len(tokens), self.n_ctx)

    def prefill(self, prompt: Sequence[int], top_k: int = 0) -> np.ndarray:
        """Make the cache hold exactly ``prompt``; return the last token's logits.

        The longest common prefix with what the cache holds is kept; at least the last
        prompt token is evaluated again so its logits are fresh.
        """
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty (no tokens, and no BOS to start from)")
        if len(prompt) > self.n_ctx:
            raise ContextOverflowError(len(prompt), self.n_ctx)
        n_keep = 0
        for a, b in zip(self.tokens, prompt[:-1], strict=False):
            if a != b:
                break
            n_keep += 1
        self.truncate(n_keep)
        return self.eval(prompt[n_keep:], top_k=top_k)

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        sampler: Sampler,
        max_tokens: int = -1,
        stop_tokens: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> Iterator[int]:
        """Yield sampled tokens after ``prompt``.

        Stops at an end-of-generation token (not yielded; ``stop_tokens`` default to the
        tokenizer's end-of-generation set), after ``max_tokens`` (-1: until the context is
        full), or when the context is full. ``self.finish_reason`` says which: "stop" or
        "length".
        """
        prompt = list(prompt)
        if max_tokens is not None and max_tokens > 0 and len(prompt) + max_tokens > self.n_ctx:
            raise ContextOverflowError(len(prompt), self.n_ctx, max_tokens)
        stop = set(stop_tokens) if stop_tokens is not None else None
        if self.speculator is not None:
            yield from self.speculator.generate(self, prompt, sampler, max_tokens, stop, ignore_eos)
            return
        self.finish_reason = "length"
        t0 = time.perf_counter()
        n_cached = len(self.tokens)
        for tok in prompt:
            sampler.accept(tok)
        # --ignore-eos bans the end-of-generation tokens, as llama.cpp's logit bias does
        banned = np.array(sorted(self.tokenizer.eog_ids), dtype=np.int64) if ignore_eos else None
        n_banned = 0 if banned is None else len(banned)
        # the logits the sampler needs (a backend may read back only a row's largest)
        logits = self.prefill(prompt, top_k=sampler.top_needed(n_banned))
        t1 = time.perf_counter()
        self.timings.prompt_tokens = len(prompt) - min(n_cached, len(prompt) - 1)
        self.timings.prompt_ms = (t1 - t0) * 1000
        self.timings.predicted_tokens = 0
        self.timings.predicted_ms = 0.0
        n_generated = 0
        while max_tokens is None or max_tokens < 0 or n_generated < max_tokens:
            if n_banned:
                logits = ban(logits, banned)
            token = sampler.sample(logits)
            sampler.accept(token)
            is_end = (token in stop) if stop is not None else self.tokenizer.is_eog(token)
            if is_end and not ignore_eos:
                self.finish_reason = "stop"
                return
            n_generated += 1
            yield token
            if len(self.tokens) >= self.n_ctx:
                return
            t2 = time.perf_counter()
            logits = self.eval([token], top_k=sampler.top_needed(n_banned))
            self.timings.predicted_ms += (time.perf_counter() - t2) * 1000
            self.timings.predicted_tokens += 1


def eval_batch(
    work: Sequence[tuple[Context, Sequence[int]]], top_k: Sequence[int] | None = None
) -> list[np.ndarray]:
    """Append tokens to several sequences of one engine in a single forward pass.

    The continuous-batching step: each context gets its tokens (a prompt chunk or one
    decode token) and its last token's logits back; the weights are read once for all.
    ``top_k``: per sequence, what its sampler needs (``Segment.top_k``; default: whole rows).
    """
    from picollama.models.base import Segment

    if not work:
        return []
    model = work[0][0].model
    segments = []
    tops = [0] * len(work) if top_k is None else list(top_k)
    for (ctx, tokens), k in zip(work, tops, strict=True):
        if ctx.model is not model:
            raise ValueError("eval_batch needs sequences of one engine")
        tokens = [int(t) for t in tokens]
        ctx._check_append(tokens)
        seg = Segment(np.array(tokens, dtype=np.int64), len(ctx.tokens), ctx.cache, top_k=k)
        segments.append(seg)
    logits = model.backend.forward_step(model, segments)  # one decode token: compiled steps
    for (ctx, _), seg in zip(work, segments, strict=True):
        ctx.tokens.extend(seg.tokens.tolist())
        ctx.cache.n_past = len(ctx.tokens)
    return [rows[-1] for rows in logits]
