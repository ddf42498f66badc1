"""The engine loop: ``-np`` slots over one model, served by a single thread (continuous batching).

HTTP handler threads never touch the model. They build a ``GenRequest`` (prompt tokens, a
sampler, limits) and ``submit`` it; the engine thread admits it into a free slot between two
steps, and streams ``Event``\\ s back through the request's queue. A step gathers the tokens
of every active slot (a chunk of prompt for a slot still prefilling, one token for a slot
that is decoding) and evaluates them through ONE call, ``engine_step``; each slot then samples
its next token. A request that finishes, fails or is cancelled leaves its slot at the end of
the step, and a waiting one takes it at the start of the next.

Prompt reuse: every slot keeps its KV cache after a request, and a prefix tree shared by the
slots (``prefix_tree.PrefixTree``, after SGLang's RadixAttention) keeps what any slot has
evaluated: a slot's prompt once its prefill is done, its whole sequence when it finishes. A
new request goes to the free slot whose own cache shares the longest prefix with its prompt;
if the tree holds a longer one, the missing positions are copied from it, so the prefill
starts after the shared part, even when the slot that computed it has since moved on.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from picollama.generation import Context, Engine, eval_batch
from picollama.sampling.samplers import Sampler, ban
from picollama.sampling.stop import StopStrings
from picollama.server.prefix_tree import PrefixTree

__all__ = ["GenRequest", "Event", "Slot", "Scheduler", "QueueFullError", "engine_step"]


class QueueFullError(RuntimeError):
    """Every slot is busy and the waiting queue is full (HTTP 503 with Retry-After)."""


@dataclass
class Event:
    """What the engine sends back to a request's handler thread.

    ``kind`` is "token" (``text`` is the new text, possibly empty while a UTF-8 character
    or a possible stop string is held back), "done" (``finish_reason`` and ``stats``) or
    "error" (``message``).
    """

    kind: str
    index: int = 0
    text: str = ""
    token: int = -1
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    stats: dict | None = None
    message: str = ""


@dataclass
class GenRequest:
    """One sequence to generate (a request with ``n`` choices submits ``n`` of them)."""

    prompt: list[int]
    sampler: Sampler
    max_tokens: int  # > 0; prompt + max_tokens fits the slot's context (checked on submit)
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report each token's log-probability
    n_probs: int = 0  # and this many top alternatives per token
    index: int = 0  # the choice index within its HTTP request
    cache_prompt: bool = True
    id_slot: int = -1  # llama.cpp's id_slot: -1 lets the scheduler choose
    lora: tuple[float, ...] | None = None  # a scale per loaded LoRA adapter (None: none loaded)
    # False: the handler wants the whole answer only, so token events wait here and go out
    # with the last one: its thread wakes once a request instead of once a token (on a
    # small CPU, each wake-up takes the core a decode step is using)
    stream: bool = True
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)
    held: list[Event] = field(default_factory=list)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, ev: Event) -> None:
        """Send ``ev`` to the handler (a token of a request that does not stream: later)."""
        if ev.kind == "token" and not self.stream:
            self.held.append(ev)
            return
        for held in self.held:
            self.out.put(held)
        self.held.clear()
        self.out.put(ev)


class Slot:
    """One sequence of the engine: a KV cache, and the request it is serving (if any)."""

    def __init__(self, slot_id: int, ctx: Context):
        self.id = slot_id
        self.ctx = ctx
        self.req: GenRequest | None = None
        self.pending: list[int] = []  # prompt tokens still to evaluate
        self.next_token: int | None = None  # sampled, to be evaluated next step
        self.n_decoded = 0
        self.n_cached = 0  # prompt tokens reused from a cache
        self.decoder = None
        self.stops: StopStrings | None = None
        self.t_start = 0.0
        self.t_prompt = 0.0
        self.t_last_used = 0.0
        self.banned: np.ndarray | None = None
        self.stop_type = "none"  # llama.cpp's: "eos", "word" (a stop string) or "limit"

    @property
    def is_busy(self) -> bool:
        return self.req is not None

    @property
    def state(self) -> str:
        if self.req is None:
            return "idle"
        return "prefill" if self.pending else "decode"

    def step_tokens(self, n_batch: int) -> list[int]:
        """The tokens this slot puts into the next step."""
        if self.pending:
            return self.pending[:n_batch]
        assert self.next_token is not None
        return [self.next_token]


def engine_step(
    batch: list[tuple[Context, list[int]]], top_k: list[int] | None = None
) -> list[np.ndarray]:
    """Evaluate one step for every active sequence; return each one's last-token logits.

    One forward pass for all slots (continuous batching): one matmul over the tokens of
    every slot, attention per sequence against its own KV cache. Each ``Context`` appends
    its tokens to its cache. ``top_k``: what each sequence's sampler needs (``eval_batch``).
    """
    tops = [0] * len(batch) if top_k is None else top_k
    # slots whose LoRA adapters differ run different model views (picollama.lora): one pass
    # per view, as llama-server does not batch slots with different adapters
    groups: dict[int, list[int]] = {}
    for i, (ctx, _) in enumerate(batch):
        groups.setdefault(id(ctx.model), []).append(i)
    if len(groups) == 1:
        return eval_batch(batch, tops)
    out: list = [None] * len(batch)
    for rows in groups.values():
        part = eval_batch([batch[i] for i in rows], [tops[i] for i in rows])
        for i, logits in zip(rows, part, strict=True):
            out[i] = logits
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


class Scheduler:
    """The engine thread, its slots and its waiting queue."""

    def __init__(
        self,
        engine: Engine,
        n_slots: int,
        n_ctx_slot: int,
        max_queue: int = 64,
        lora=None,
        prefix_cache_tokens: int = -1,
    ):
        """``prefix_cache_tokens``: the most tokens the shared prefix tree holds (-1: as
        many as all slots' caches together; 0: no tree, a slot reuses only its own cache)."""
        self.lora = lora  # a picollama.lora.LoraSet, or None
        if n_slots <= 0:
            raise ValueError(f"the number of slots (-np) must be positive, got {n_slots}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.slots = [Slot(i, engine.new_sequence(n_ctx_slot)) for i in range(n_slots)]
        self.n_ctx_slot = self.slots[0].ctx.n_ctx
        if prefix_cache_tokens < 0:
            prefix_cache_tokens = n_slots * self.n_ctx_slot
        cache = self.slots[0].ctx.cache
        # the tree copies rows by position: not for ring-buffer (sliding-window) layers, whose
        # rows are not positions; and it keeps them in host memory, so device caches (CUDA,
        # OpenCL) copy from the other slots instead
        by_position = all(
            isinstance(a, np.ndarray) and a.shape[0] == cache.n_ctx for a in cache.k + cache.v
        )
        self.tree = PrefixTree(prefix_cache_tokens) if prefix_cache_tokens and by_position else None
        self.max_queue = max_queue
        self.n_batch = engine.n_batch
        self._pending: collections.deque[GenRequest] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._eog = np.array(sorted(self.tokenizer.eog_ids), dtype=np.int64)
        # counters for /metrics (written by the engine thread; ints are safe to read)
        self.n_requests_total = 0
        self.n_requests_done = 0
        self.n_requests_cancelled = 0
        self.n_requests_rejected = 0
        self.n_prompt_tokens_total = 0
        self.n_prompt_tokens_cached = 0
        self.n_tokens_predicted_total = 0
        self.n_steps = 0
        self.n_slot_steps = 0  # sum over steps of the slots in each (batch occupancy)
        self.t_prompt_total = 0.0
        self.t_predict_total = 0.0

    # -- threads ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="picollama-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, reqs: Sequence[GenRequest]) -> None:
        """Queue ``reqs`` (all or none); ``QueueFullError`` when they don't fit."""
        with self._cond:
            n_free = sum(1 for s in self.slots if not s.is_busy)
            if len(self._pending) + len(reqs) > self.max_queue + n_free:
                self.n_requests_rejected += 1
                raise QueueFullError(
                    f"the server is busy: {len(self.slots)} slots in use and "
                    f"{len(self._pending)} requests waiting (queue size {self.max_queue})"
                )
            self._pending.extend(reqs)
            self.n_requests_total += len(reqs)
            self._cond.notify_all()

    @property
    def n_pending(self) -> int:
        return len(self._pending)

    @property
    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.is_busy)

    def _run(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stop and not self._pending and not any(s.is_busy for s in self.slots)
                ):
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    for s in self.slots:
                        if s.req is not None:
                            self._finish(s, "error", message="the server is shutting down")
                    return
                admitted = self._admit_locked()
            for slot, req in admitted:
                try:
                    self._start(slot, req)
                except Exception as exc:  # nor one request that cannot start
                    slot.ctx.truncate(0)
                    self._finish(slot, "error", message=f"internal error: {exc!r}")
            try:
                self.step()
            except Exception as exc:  # a bug in one step must not stop the server
                for s in self.slots:
                    if s.req is not None:
                        self._finish(s, "error", message=f"internal error: {exc!r}")
                        s.ctx.truncate(0)

    # -- admission --------------------------------------------------------------------------

    def _admit_locked(self) -> list[tuple[Slot, GenRequest]]:
        out = []
        while self._pending:
            req = self._pending[0]
            if req.cancelled.is_set():
                self._pending.popleft()
                self.n_requests_cancelled += 1
                req.emit(Event("done", req.index, finish_reason="cancelled", stats={}))
                continue
            free = [s for s in self.slots if not s.is_busy and s not in (x for x, _ in out)]
            if not free:
                break
            if 0 <= req.id_slot < len(self.slots):
                chosen = next((s for s in free if s.id == req.id_slot), None)
                if chosen is None:
                    break  # wait for that slot, as llama.cpp does
            else:
                chosen = self._pick_slot(free, req)
            self._pending.popleft()
            chosen.req = req  # reserve it
            out.append((chosen, req))
        return out

    def _pick_slot(self, free: list[Slot], req: GenRequest) -> Slot:
        """The free slot with the longest cached prefix of the prompt; else the least
        recently used one (so caches that others may reuse survive longest)."""
        best = max(
            free,
            key=lambda s: (
                _common_prefix(s.ctx.tokens, req.prompt) if req.cache_prompt else 0,
                -s.t_last_used,
            ),
        )
        return best

    def _start(self, slot: Slot, req: GenRequest) -> None:
        ctx = slot.ctx
        prompt = req.prompt
        model = self.engine.model if self.lora is None else self.lora.model_for(req.lora)
        if ctx.model is not model:  # its cache was computed with other LoRA adapters
            ctx.model = model
            ctx.truncate(0)
        n_keep = _common_prefix(ctx.tokens, prompt[:-1]) if req.cache_prompt else 0
        ctx.truncate(n_keep)
        if req.cache_prompt:
            n_keep = self._copy_prefix(slot, prompt, n_keep)
        slot.n_cached = n_keep
        slot.pending = list(prompt[n_keep:])
        slot.next_token = None
        slot.n_decoded = 0
        slot.stop_type = "none"
        slot.decoder = self.tokenizer.detokenizer(skip_special=True)
        slot.stops = StopStrings(list(req.stop))
        slot.t_start = time.perf_counter()
        slot.t_prompt = 0.0
        slot.banned = self._eog if req.ignore_eos and len(self._eog) else None
        for tok in prompt:
            req.sampler.accept(tok)
        self.n_prompt_tokens_total += len(prompt)
        self.n_prompt_tokens_cached += n_keep

    def _copy_prefix(self, slot: Slot, prompt: list[int], n_have: int) -> int:
        """Copy a longer cached prefix of ``prompt`` than the slot holds from the prefix tree
        (entries of the slot's model view only: other LoRA adapters give other KV); without
        a tree, from the other slot that holds the longest one."""
        ctx = slot.ctx
        limit = len(prompt) - 1  # the last prompt token is always evaluated again
        if self.tree is not None:
            n = self.tree.restore(ctx.model, prompt, ctx.cache, n_have, limit)
        else:
            n = self._copy_from_slot(slot, prompt, n_have, limit)
        if n > n_have:
            ctx.tokens[n_have:] = prompt[n_have:n]
            ctx.cache.n_past = n
        return n

    def _copy_from_slot(self, slot: Slot, prompt: list[int], n_have: int, limit: int) -> int:
        best, n_best = None, n_have
        for other in self.slots:
            if other is slot or other.ctx.model is not slot.ctx.model:  # other LoRA adapters
                continue
            n = _common_prefix(other.ctx.tokens[:limit], prompt[:limit])
            if n > n_best:
                best, n_best = other, n
        if best is None:
            return n_have
        src, dst = best.ctx.cache, slot.ctx.cache
        if any(a.shape[0] != src.n_ctx for a in src.k) or any(
            a.shape[0] != dst.n_ctx for a in dst.k
        ):
            return n_have  # ring-buffer (sliding-window) layers: positions don't line up
        slot.ctx.model.backend.copy_kv(src, dst, n_have, n_best)
        return n_best

    def _remember(self, s: Slot) -> None:
        """Put what the slot's cache holds into the prefix tree."""
        if self.tree is not None and s.req is not None and s.req.cache_prompt:
            self.tree.insert(s.ctx.model, s.ctx.tokens, s.ctx.cache)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        """Evaluate one step for every active slot, then sample and stream."""
        for s in self.slots:
            if s.req is not None and s.req.cancelled.is_set():
                self.n_requests_cancelled += 1
                self._finish(s, "cancelled")
        active = [s for s in self.slots if s.req is not None]
        if not active:
            return
        batch, tops = [], []
        for s in active:
            tokens = s.step_tokens(self.n_batch)
            batch.append((s.ctx, tokens))
            tops.append(self._top_needed(s))  # (a prompt chunk's logits go unused)
        t0 = time.perf_counter()
        try:
            all_logits = engine_step(batch, tops)
        except Exception as exc:
            for s in active:
                self._finish(s, "error", message=f"evaluation failed: {exc}")
                s.ctx.truncate(0)
            return
        dt = time.perf_counter() - t0
        self.n_steps += 1
        self.n_slot_steps += len(active)
        n_total = sum(len(t) for _, t in batch)
        for s, (_, tokens), logits in zip(active, batch, all_logits, strict=True):
            share = dt * len(tokens) / n_total
            if s.pending:
                del s.pending[: len(tokens)]
                s.t_prompt += share
                self.t_prompt_total += share
                if s.pending:
                    continue
                self._remember(s)  # the prompt is in: other slots may share it from now
            else:
                self.t_predict_total += share
            self._sample(s, logits)

    def _top_needed(self, s: Slot) -> int:
        """How many of the slot's next logit row its sampler needs (0: all of it; log
        probabilities need the whole row)."""
        req = s.req
        if req is None or req.logprobs or req.n_probs > 0:
            return 0
        return req.sampler.top_needed(0 if s.banned is None else len(s.banned))

    def _sample(self, s: Slot, logits: np.ndarray) -> None:
        req = s.req
        assert req is not None
        if s.banned is not None:
            logits = ban(logits, s.banned)
        try:
            token = req.sampler.sample(logits)
        except Exception as exc:  # a grammar that cannot continue, for one
            self._finish(s, "error", message=str(exc))
            return
        req.sampler.accept(token)
        if self.tokenizer.is_eog(token) and not req.ignore_eos:
            s.stop_type = "eos"
            self._finish(s, "stop")
            return
        s.n_decoded += 1
        self.n_tokens_predicted_total += 1
        logprob, top = None, None
        if req.logprobs or req.n_probs > 0:
            lp = _log_softmax(logits)
            logprob = float(lp[token])
            top = []
            k = min(req.n_probs, len(lp))
            if k > 0:
                idx = np.argpartition(-lp, k - 1)[:k]
                idx = idx[np.argsort(-lp[idx], kind="stable")]
                top = [(int(i), float(lp[i])) for i in idx]
        text = s.stops.push(s.decoder.push(token))
        if s.stops.hit:
            req.emit(Event("token", req.index, text, token, logprob, top))
            s.stop_type = "word"
            self._finish(s, "stop")
            return
        req.emit(Event("token", req.index, text, token, logprob, top))
        if s.n_decoded >= req.max_tokens or len(s.ctx.tokens) >= s.ctx.n_ctx:
            s.stop_type = "limit"
            self._finish(s, "length")  # (or "stop", if the flushed tail ends in a stop string)
            return
        s.next_token = token

    def _finish(self, s: Slot, reason: str, message: str = "") -> None:
        req = s.req
        if req is None:
            return
        now = time.perf_counter()
        n_eval = len(req.prompt) - s.n_cached
        stats = {
            "id_slot": s.id,
            "tokens_cached": len(s.ctx.tokens),
            "prompt_n": n_eval,
            "prompt_cached": s.n_cached,
            "prompt_ms": s.t_prompt * 1000,
            "predicted_n": s.n_decoded,
            "predicted_ms": max(0.0, now - s.t_start - s.t_prompt) * 1000,
            "queue_ms": (s.t_start - req.t_submit) * 1000,
        }
        if reason in ("stop", "length"):
            # flush what the decoder and stop strings still hold
            if s.decoder is not None and s.stops is not None and not s.stops.hit:
                tail = s.stops.push(s.decoder.flush())
                if s.stops.hit:
                    reason, s.stop_type = "stop", "word"
                else:
                    tail += s.stops.flush()
                if tail:
                    req.emit(Event("token", req.index, tail))
            self.n_requests_done += 1
            self._remember(s)
        stats["stop_type"] = s.stop_type
        if reason == "error":
            req.emit(Event("error", req.index, message=message, stats=stats))
        else:
            req.emit(Event("done", req.index, finish_reason=reason, stats=stats))
        s.req = None
        s.pending = []
        s.next_token = None
        s.t_last_used = now

    # -- introspection ----------------------------------------------------------------------

    def slots_info(self) -> list[dict]:
        return [
            {
                "id": s.id,
                "n_ctx": s.ctx.n_ctx,
                "is_processing": s.is_busy,
                "state": s.state,
                "n_cached_tokens": len(s.ctx.tokens),
                "n_decoded": s.n_decoded if s.is_busy else 0,
            }
            for s in self.slots
        ]
