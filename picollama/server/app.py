"""The server's endpoints, apart from HTTP: a request body in, a response (or a stream) out.

``App`` owns the engine, the scheduler and the chat template; ``picollama.server.http``
maps URLs to its methods. Request fields mirror OpenAI's and llama.cpp's servers; every
bad field is an ``APIError`` (400) naming it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from picollama.generation import Engine
from picollama.lora import LoraError, LoraSet
from picollama.sampling.samplers import DEFAULT_SEED, Sampler, SamplingParams
from picollama.server import params as P
from picollama.server.errors import APIError, bad_request
from picollama.server.scheduler import Event, GenRequest, QueueFullError, Scheduler
from picollama.server.tools import ToolMode

__all__ = ["ServerConfig", "App", "Stream"]


@dataclass
class ServerConfig:
    n_slots: int = 1
    n_ctx: int = 4096  # total, split across the slots as llama-server's -c
    n_predict: int = -1  # default cap on generated tokens (-1: up to the context)
    max_queue: int = 64  # requests waiting for a slot before 503
    api_key: str | None = None
    cors_origin: str | None = None
    alias: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_logprobs: int = 20
    max_n: int = 8  # choices per request
    allow_template_kwargs: bool = False  # chat_template_kwargs from requests (RELIABILITY 21)
    lora_adapters: list = field(default_factory=list)  # (path, scale) GGUF LoRA adapters
    prefix_cache_tokens: int = -1  # the shared prefix tree's size (-1: all slots' n_ctx; 0: off)


@dataclass
class Stream:
    """A streamed response: ``chunks`` yields bytes (SSE events); closing it cancels."""

    chunks: Iterator[bytes]


Disconnected = Callable[[], bool]


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


class App:
    def __init__(self, engine: Engine, config: ServerConfig):
        from picollama.tokenizer import ChatTemplate

        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        n_ctx_slot = max(1, config.n_ctx // config.n_slots) if config.n_ctx > 0 else 0
        self.lora = LoraSet(engine.model, config.lora_adapters) if config.lora_adapters else None
        self.scheduler = Scheduler(
            engine,
            config.n_slots,
            n_ctx_slot,
            config.max_queue,
            lora=self.lora,
            prefix_cache_tokens=config.prefix_cache_tokens,
        )
        self.n_ctx_slot = self.scheduler.n_ctx_slot
        self.model_name = config.alias or os.path.basename(str(engine.path))
        self.template = ChatTemplate.for_model(engine.reader.metadata, config.chat_template)
        self._template_lock = threading.Lock()  # a template's sandbox holds per-render state
        self._vocab = None
        self._vocab_lock = threading.Lock()
        self.created = int(time.time())
        self.n_http_requests = 0
        self.n_http_errors = 0

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # -- simple endpoints -------------------------------------------------------------------

    def health(self) -> dict:
        return {"status": "ok"}

    def models(self) -> dict:
        args = self.engine.model.args
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "picollama",
                    "meta": {
                        "n_vocab": self.engine.n_vocab,
                        "n_ctx_train": args.n_ctx_train,
                        "size": os.path.getsize(self.engine.path),
                    },
                }
            ],
        }

    def props(self) -> dict:
        return {
            "default_generation_settings": {
                "n_ctx": self.n_ctx_slot,
                "params": self._settings(SamplingParams(), self.config.n_predict),
            },
            "total_slots": self.config.n_slots,
            "model_path": str(self.engine.path),
            "chat_template": self.template.source,
            "build_info": "picollama",
        }

    def slots(self) -> list[dict]:
        return self.scheduler.slots_info()

    def metrics(self) -> str:
        s = self.scheduler
        rows = [
            (
                "prompt_tokens_total",
                "counter",
                "Number of prompt tokens processed.",
                s.n_prompt_tokens_total,
            ),
            (
                "prompt_tokens_cached_total",
                "counter",
                "Prompt tokens reused from a cache.",
                s.n_prompt_tokens_cached,
            ),
            (
                "tokens_predicted_total",
                "counter",
                "Number of generation tokens processed.",
                s.n_tokens_predicted_total,
            ),
            ("prompt_seconds_total", "counter", "Prompt process time.", s.t_prompt_total),
            (
                "tokens_predicted_seconds_total",
                "counter",
                "Predict process time.",
                s.t_predict_total,
            ),
            ("requests_total", "counter", "Generation requests submitted.", s.n_requests_total),
            (
                "requests_completed_total",
                "counter",
                "Generation requests completed.",
                s.n_requests_done,
            ),
            (
                "requests_cancelled_total",
                "counter",
                "Generation requests cancelled.",
                s.n_requests_cancelled,
            ),
            (
                "requests_rejected_total",
                "counter",
                "Requests refused with 503 (queue full).",
                s.n_requests_rejected,
            ),
            ("http_requests_total", "counter", "HTTP requests received.", self.n_http_requests),
            (
                "http_errors_total",
                "counter",
                "HTTP requests answered with an error.",
                self.n_http_errors,
            ),
            ("n_decode_total", "counter", "Engine steps (batched decode calls).", s.n_steps),
            (
                "n_busy_slots_per_decode",
                "gauge",
                "Average number of slots in one engine step.",
                s.n_slot_steps / s.n_steps if s.n_steps else 0.0,
            ),
            (
                "requests_processing",
                "gauge",
                "Number of requests processing (slots in use).",
                s.n_busy,
            ),
            (
                "requests_deferred",
                "gauge",
                "Number of requests waiting (queue depth).",
                s.n_pending,
            ),
            ("slots_total", "gauge", "Number of slots (-np).", len(s.slots)),
            (
                "prefix_cache_tokens",
                "gauge",
                "Tokens whose KV the shared prefix tree holds.",
                s.tree.n_tokens if s.tree is not None else 0,
            ),
            ("slots_busy", "gauge", "Slots serving a request.", s.n_busy),
        ]
        out = []
        for name, kind, help_text, value in rows:
            out.append(f"# HELP llamacpp:{name} {help_text}")
            out.append(f"# TYPE llamacpp:{name} {kind}")
            out.append(f"llamacpp:{name} {value}")
        return "\n".join(out) + "\n"

    # -- LoRA adapters (llama-server's /lora-adapters) ------------------------------------

    def lora_adapters(self) -> list[dict]:
        return self.lora.describe() if self.lora is not None else []

    def set_lora_adapters(self, body) -> dict:
        """New global scales, ``[{"id": i, "scale": s}]`` (adapters not named get 0); for
        requests that start from now on, without reloading anything."""
        if self.lora is None:
            raise bad_request("no LoRA adapters are loaded (--lora)")
        try:
            self.lora.set_scales(body)
        except LoraError as exc:
            raise bad_request(str(exc)) from None
        return {"success": True}

    def _lora_scales(self, body: dict) -> tuple[float, ...] | None:
        """The request's ``lora`` list as a scale per adapter; else the global scales."""
        if "lora" not in body:
            return tuple(self.lora.scales) if self.lora is not None else None
        if self.lora is None:
            raise bad_request("no LoRA adapters are loaded (--lora)", "lora")
        try:
            return tuple(self.lora.parse(body["lora"]))
        except LoraError as exc:
            raise bad_request(str(exc), "lora") from None

    def tokenize(self, body: dict) -> dict:
        content = body.get("content")
        if not isinstance(content, str):
            raise bad_request("'content' must be a string", "content")
        add_special = P.get_bool(body, "add_special", False)
        parse_special = P.get_bool(body, "parse_special", True)
        with_pieces = P.get_bool(body, "with_pieces", False)
        ids = self._encode(content, add_special, parse_special)
        if not with_pieces:
            return {"tokens": ids}
        pieces = []
        for t in ids:
            raw = self.tokenizer.token_to_piece(t)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": t, "piece": piece})
        return {"tokens": pieces}

    def detokenize(self, body: dict) -> dict:
        ids = self._token_list(body.get("tokens"), "tokens")
        return {"content": self.tokenizer.decode(ids)}

    def apply_template(self, body: dict) -> dict:
        prompt, _ = self._chat_prompt(body)
        return {"prompt": prompt}

    # -- helpers ----------------------------------------------------------------------------

    def _encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        from picollama.tokenizer import TokenizerError

        try:
            return self.tokenizer.encode(
                text, add_bos=None if add_special else False, parse_special=parse_special
            )
        except TokenizerError as exc:
            raise bad_request(str(exc)) from None

    def _token_list(self, value, name: str) -> list[int]:
        if not isinstance(value, list):
            raise bad_request(f"'{name}' must be a list of token ids", name)
        n_vocab = self.engine.n_vocab
        for t in value:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise bad_request(
                    f"invalid token {t!r} in '{name}' (vocabulary: 0..{n_vocab - 1})", name
                )
        return list(value)

    def _prompt_tokens(self, prompt, name: str = "prompt") -> list[int]:
        """A prompt: text, token ids, or llama.cpp's mix of both."""
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and all(isinstance(p, (str, int)) for p in prompt):
            out: list[int] = []
            for i, part in enumerate(prompt):
                if isinstance(part, str):
                    out.extend(self._encode(part, add_special=i == 0))
                else:
                    out.extend(self._token_list([part], name))
            return out
        raise bad_request(f"'{name}' must be a string or a list of token ids", name)

    def _chat_prompt(self, body: dict, tools=None) -> tuple[str, list[dict]]:
        from picollama.tokenizer import TemplateError

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", "messages")
        if "chat_template" in body:
            raise bad_request("'chat_template' in a request is not allowed", "chat_template")
        kwargs = {}
        if body.get("chat_template_kwargs") is not None:
            if not self.config.allow_template_kwargs:
                raise bad_request(
                    "'chat_template_kwargs' is not allowed on this server "
                    "(start it with --allow-chat-template-kwargs)",
                    "chat_template_kwargs",
                )
            kwargs = body["chat_template_kwargs"]
            if not isinstance(kwargs, dict):
                raise bad_request("'chat_template_kwargs' must be an object")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(
                    f"messages[{i}] must be an object with a 'role' string", "messages"
                )
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        raise APIError(
                            400,
                            f"messages[{i}]: only text content parts are supported",
                            param="messages",
                        )
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            elif content is not None and not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string or parts", "messages")
            clean.append({**m, "content": content})
        if tools is not None:
            clean = tools.rewrite_messages(clean)
        else:
            clean = [{**m, "content": m["content"] or ""} for m in clean]
        try:
            with self._template_lock:
                text = self.template.render(
                    clean,
                    add_generation_prompt=True,
                    tools=tools.template_tools if tools else None,
                    **kwargs,
                )
        except TemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        return text, clean

    def _encode_chat(self, text: str) -> list[int]:
        tok = self.tokenizer
        bos = tok.token_to_piece(tok.bos_id).decode("utf-8", "replace") if tok.bos_id >= 0 else ""
        return self._encode(text, add_special=not (bos and text.startswith(bos)))

    def _vocab_for_grammar(self):
        from picollama.sampling.grammar import TokenVocab

        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = TokenVocab.from_tokenizer(self.tokenizer)
            return self._vocab

    def _constraint(self, body: dict, extra_schema=None):
        """The request's grammar bound to the vocabulary, or None; 400 if it can't be built."""
        from picollama.sampling.gbnf import GrammarError
        from picollama.sampling.grammar import grammar_from_request
        from picollama.sampling.json_schema import SchemaError
        from picollama.sampling.regex import RegexError

        fields = {
            "grammar": body.get("grammar") or None,
            "json_schema": body.get("json_schema"),
            "response_format": body.get("response_format"),
            "regex": body.get("regex"),
        }
        if extra_schema is not None:
            if any(v is not None for v in fields.values()):
                raise bad_request("tools cannot be combined with a grammar or response_format")
            fields = {"json_schema": extra_schema}
        try:
            g = grammar_from_request(**fields)
            if g is None:
                return None
            return g.constraint(self._vocab_for_grammar())
        except (GrammarError, SchemaError, RegexError, ValueError, RecursionError) as exc:
            name = next((k for k, v in fields.items() if v is not None), "grammar")
            raise bad_request(f"invalid {name}: {exc}", name) from None

    def _sampling(self, body: dict, n_vocab: int) -> SamplingParams:
        d = SamplingParams()
        temp = P.get_float(body, "temperature", d.temperature, lo=0.0)
        seed = P.get_int(body, "seed", DEFAULT_SEED)
        if seed < 0:
            seed = DEFAULT_SEED
        p = SamplingParams(
            temperature=temp,
            top_k=P.get_int(body, "top_k", d.top_k, lo=0),
            top_p=P.get_float(body, "top_p", d.top_p, lo=0.0, hi=1.0),
            min_p=P.get_float(body, "min_p", d.min_p, lo=0.0, hi=1.0),
            typical_p=P.get_float(body, "typical_p", d.typical_p, lo=0.0, hi=1.0),
            repeat_penalty=P.get_float(body, "repeat_penalty", d.repeat_penalty, lo=0.0),
            repeat_last_n=P.get_int(body, "repeat_last_n", d.repeat_last_n, lo=-1),
            frequency_penalty=P.get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
            presence_penalty=P.get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
            seed=seed & 0xFFFFFFFF,
            logit_bias=P.get_logit_bias(body, n_vocab, lambda s: self._encode(s, False, False)),
        )
        if p.repeat_penalty == 0.0:
            raise bad_request("'repeat_penalty' must be > 0, got 0", "repeat_penalty")
        try:
            p.validate(n_vocab)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return p

    def _settings(self, p: SamplingParams, n_predict: int) -> dict:
        return {
            "n_predict": n_predict,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "typical_p": p.typical_p,
            "repeat_penalty": p.repeat_penalty,
            "repeat_last_n": p.repeat_last_n,
            "frequency_penalty": p.frequency_penalty,
            "presence_penalty": p.presence_penalty,
            "seed": p.seed,
        }

    def _max_tokens(self, body: dict, names: tuple[str, ...], n_prompt: int, native: bool) -> int:
        n_ctx = self.n_ctx_slot
        if n_prompt >= n_ctx:
            raise APIError(
                400,
                f"the request exceeds the available context size: the prompt has {n_prompt} "
                f"tokens and the context of a slot holds {n_ctx}",
                "exceed_context_size_error",
                n_prompt_tokens=n_prompt,
                n_ctx=n_ctx,
            )
        room = n_ctx - n_prompt
        asked = None
        for name in names:
            v = P.get_int(body, name, None, lo=-1 if native else 1)
            if v is not None:
                asked, asked_name = v, name
                break
        if asked is None or asked == -1:
            cap = self.config.n_predict
            return room if cap is None or cap < 0 else min(cap, room)
        if asked > room:
            raise APIError(
                400,
                f"'{asked_name}' is {asked}, but the prompt has {n_prompt} tokens and the "
                f"context of a slot holds {n_ctx}: at most {room} can be generated",
                "exceed_context_size_error",
                param=asked_name,
                n_prompt_tokens=n_prompt,
                n_ctx=n_ctx,
            )
        return asked

    def _requests(
        self,
        body: dict,
        prompts: list[list[int]],
        max_names: tuple[str, ...],
        native: bool,
        n_probs: int,
        logprobs: bool,
        constraint=None,
    ) -> list[GenRequest]:
        n = P.get_int(body, "n", 1, lo=1, hi=self.config.max_n)
        if len(prompts) * n > self.config.max_n:
            raise bad_request(
                f"{len(prompts)} prompts x n={n} is over {self.config.max_n} choices", "n"
            )
        P.get_int(body, "n_keep", 0, lo=-1)
        P.get_int(body, "n_discard", 0, lo=0)
        stop = P.get_stop(body)
        ignore_eos = P.get_bool(body, "ignore_eos", False)
        cache_prompt = P.get_bool(body, "cache_prompt", True)
        id_slot = P.get_int(body, "id_slot", -1, lo=-1, hi=self.config.n_slots - 1)
        params = self._sampling(body, self.engine.n_vocab)
        lora = self._lora_scales(body)
        stream = P.get_bool(body, "stream", False)
        out = []
        q: queue.Queue[Event] = queue.Queue()
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise bad_request("the prompt is empty", "prompt")
            max_tokens = self._max_tokens(body, max_names, len(prompt), native)
            for j in range(n):
                pj = SamplingParams(**{**params.__dict__, "logit_bias": dict(params.logit_bias)})
                if j and pj.seed != DEFAULT_SEED:
                    pj.seed = (pj.seed + j) & 0xFFFFFFFF  # distinct choices, still reproducible
                grammar = constraint.matcher() if constraint is not None else None
                sampler = Sampler(pj, self.engine.n_vocab, grammar=grammar)
                out.append(
                    GenRequest(
                        prompt=prompt,
                        sampler=sampler,
                        max_tokens=max_tokens,
                        stop=stop,
                        ignore_eos=ignore_eos,
                        logprobs=logprobs,
                        n_probs=n_probs,
                        index=i * n + j,
                        cache_prompt=cache_prompt,
                        id_slot=id_slot,
                        lora=lora,
                        stream=stream,
                        out=q,
                    )
                )
        return out

    def _submit(self, reqs: list[GenRequest]) -> None:
        try:
            self.scheduler.submit(reqs)
        except QueueFullError as exc:
            raise APIError(503, str(exc), headers={"Retry-After": "1"}) from None

    def _events(self, reqs: list[GenRequest], disconnected: Disconnected) -> Iterator[Event]:
        """Events of submitted ``reqs`` until all are done; cancels them if the client goes
        away or the consumer stops early (closing the generator)."""
        q = reqs[0].out
        remaining = len(reqs)
        try:
            while remaining:
                try:
                    ev = q.get(timeout=0.1)
                except queue.Empty:
                    if disconnected():
                        return
                    continue
                if ev.kind in ("done", "error"):
                    remaining -= 1
                yield ev
        finally:
            for r in reqs:
                r.cancel()

    def _piece(self, token: int) -> str:
        return self.tokenizer.token_to_piece(token).decode("utf-8", "replace")

    def _timings(self, st: dict) -> dict:
        pn, pms = st.get("prompt_n", 0), st.get("prompt_ms", 0.0)
        gn, gms = st.get("predicted_n", 0), st.get("predicted_ms", 0.0)
        return {
            "cache_n": st.get("prompt_cached", 0),
            "prompt_n": pn,
            "prompt_ms": pms,
            "prompt_per_token_ms": pms / pn if pn else 0.0,
            "prompt_per_second": pn / pms * 1000 if pms else 0.0,
            "predicted_n": gn,
            "predicted_ms": gms,
            "predicted_per_token_ms": gms / gn if gn else 0.0,
            "predicted_per_second": gn / gms * 1000 if gms else 0.0,
        }

    # -- OpenAI chat completions ------------------------------------------------------------

    def chat_completions(self, body: dict, disconnected: Disconnected):
        n_top = P.get_int(body, "top_logprobs", 0, lo=0, hi=self.config.max_logprobs)
        logprobs = P.get_bool(body, "logprobs", False)
        if n_top and not logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        stream = P.get_bool(body, "stream", False)
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = P.get_bool(so, "include_usage", False)
        tools = ToolMode.from_request(body, self.template)
        text, _ = self._chat_prompt(body, tools)
        prompt = self._encode_chat(text)
        constraint = self._constraint(body, tools.schema if tools else None)
        reqs = self._requests(
            body,
            [prompt],
            ("max_completion_tokens", "max_tokens"),
            False,
            n_top,
            logprobs,
            constraint,
        )
        self._submit(reqs)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        base = {
            "id": cid,
            "created": created,
            "model": self.model_name,
            "system_fingerprint": "picollama",
        }
        events = self._events(reqs, disconnected)
        if stream:
            return Stream(
                self._chat_stream(events, reqs, base, tools, logprobs, include_usage, len(prompt))
            )
        texts = {r.index: "" for r in reqs}
        lps = {r.index: [] for r in reqs}
        reasons, stats = {}, {}
        for ev in events:
            if ev.kind == "error":
                raise APIError(500, ev.message)
            if ev.kind == "token":
                texts[ev.index] += ev.text
                if logprobs and ev.token >= 0:
                    lps[ev.index].append(self._chat_logprob(ev))
            else:
                reasons[ev.index], stats[ev.index] = ev.finish_reason, ev.stats or {}
        if len(reasons) < len(reqs):
            raise APIError(499, "the client went away")
        choices = []
        for r in reqs:
            message = {"role": "assistant", "content": texts[r.index]}
            reason = reasons[r.index]
            if tools is not None:
                message, reason = tools.parse(texts[r.index], reason)
            choices.append(
                {
                    "index": r.index,
                    "message": message,
                    "logprobs": {"content": lps[r.index]} if logprobs else None,
                    "finish_reason": reason,
                }
            )
        n_out = sum(s.get("predicted_n", 0) for s in stats.values())
        return {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": n_out,
                "total_tokens": len(prompt) + n_out,
            },
            "timings": self._timings(stats.get(0, {})),
        }

    def _chat_logprob(self, ev: Event) -> dict:
        def entry(tok, lp):
            piece = self.tokenizer.token_to_piece(tok)
            return {"token": piece.decode("utf-8", "replace"), "logprob": lp, "bytes": list(piece)}

        out = entry(ev.token, ev.logprob)
        out["top_logprobs"] = [entry(t, lp) for t, lp in ev.top_logprobs or []]
        return out

    def _chat_stream(self, events, reqs, base, tools, logprobs, include_usage, n_prompt):
        def chunk(index, delta, reason=None, lp=None):
            return _sse(
                {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [
                        {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
                    ],
                }
            )

        n_out = 0
        try:
            for r in reqs:
                yield chunk(r.index, {"role": "assistant", "content": None})
            held = {r.index: "" for r in reqs}  # tool mode: the reply is parsed at the end
            for ev in events:
                if ev.kind == "error":
                    yield _sse(APIError(500, ev.message).body())
                    continue
                if ev.kind == "token":
                    if tools is not None:
                        held[ev.index] += ev.text
                        continue
                    lp = (
                        {"content": [self._chat_logprob(ev)]}
                        if logprobs and ev.token >= 0
                        else None
                    )
                    if ev.text or lp:
                        yield chunk(ev.index, {"content": ev.text}, None, lp)
                    continue
                n_out += (ev.stats or {}).get("predicted_n", 0)
                reason = ev.finish_reason
                if reason == "cancelled":
                    return
                if tools is not None:
                    message, reason = tools.parse(held[ev.index], reason)
                    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                    if "tool_calls" in delta:
                        delta["tool_calls"] = [
                            {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
                        ]
                    yield chunk(ev.index, delta)
                yield chunk(ev.index, {}, reason)
            if include_usage:
                yield _sse(
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": {
                            "prompt_tokens": n_prompt,
                            "completion_tokens": n_out,
                            "total_tokens": n_prompt + n_out,
                        },
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            events.close()

    # -- OpenAI completions -----------------------------------------------------------------

    def completions(self, body: dict, disconnected: Disconnected):
        n_top = P.get_int(body, "logprobs", None, lo=0, hi=self.config.max_logprobs)
        stream = P.get_bool(body, "stream", False)
        echo = P.get_bool(body, "echo", False)
        so = body.get("stream_options") or {}
        include_usage = P.get_bool(so, "include_usage", False) if isinstance(so, dict) else False
        raw = body.get("prompt")
        if raw is None:
            raise bad_request("'prompt' is required", "prompt")
        if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw) and len(raw) > 1:
            prompts_in = raw
        elif isinstance(raw, list) and raw and all(isinstance(p, list) for p in raw):
            prompts_in = raw
        else:
            prompts_in = [raw]
        prompts = [self._prompt_tokens(p) for p in prompts_in]
        texts_in = [
            p if isinstance(p, str) else self.tokenizer.decode(t)
            for p, t in zip(prompts_in, prompts, strict=True)
        ]
        constraint = self._constraint(body)
        reqs = self._requests(
            body, prompts, ("max_tokens",), False, n_top or 0, n_top is not None, constraint
        )
        n = len(reqs) // len(prompts)
        self._submit(reqs)
        cid = f"cmpl-{uuid.uuid4().hex}"
        base = {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": "picollama",
        }
        events = self._events(reqs, disconnected)
        n_prompt = sum(len(p) for p in prompts) * n
        if stream:
            return Stream(
                self._completion_stream(
                    events, reqs, base, echo, texts_in, n, n_top, include_usage, n_prompt
                )
            )
        texts = {r.index: (texts_in[r.index // n] if echo else "") for r in reqs}
        lps = {r.index: [] for r in reqs}
        reasons, n_out = {}, 0
        for ev in events:
            if ev.kind == "error":
                raise APIError(500, ev.message)
            if ev.kind == "token":
                texts[ev.index] += ev.text
                if n_top is not None and ev.token >= 0:
                    lps[ev.index].append(ev)
            else:
                reasons[ev.index] = ev.finish_reason
                n_out += (ev.stats or {}).get("predicted_n", 0)
        if len(reasons) < len(reqs):
            raise APIError(499, "the client went away")
        choices = [
            {
                "index": r.index,
                "text": texts[r.index],
                "logprobs": self._legacy_logprobs(lps[r.index]) if n_top is not None else None,
                "finish_reason": reasons[r.index],
            }
            for r in reqs
        ]
        return {
            **base,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }

    def _legacy_logprobs(self, evs: list[Event]) -> dict:
        tokens, token_lps, tops, offsets, pos = [], [], [], [], 0
        for ev in evs:
            piece = self._piece(ev.token)
            tokens.append(piece)
            token_lps.append(ev.logprob)
            tops.append({self._piece(t): lp for t, lp in ev.top_logprobs or []})
            offsets.append(pos)
            pos += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _completion_stream(
        self, events, reqs, base, echo, texts_in, n, n_top, include_usage, n_prompt
    ):
        def chunk(index, text, reason=None, lp=None):
            return _sse(
                {
                    **base,
                    "choices": [
                        {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
                    ],
                }
            )

        n_out = 0
        try:
            if echo:
                for r in reqs:
                    yield chunk(r.index, texts_in[r.index // n])
            for ev in events:
                if ev.kind == "error":
                    yield _sse(APIError(500, ev.message).body())
                elif ev.kind == "token":
                    lp = (
                        self._legacy_logprobs([ev]) if n_top is not None and ev.token >= 0 else None
                    )
                    if ev.text or lp:
                        yield chunk(ev.index, ev.text, None, lp)
                else:
                    if ev.finish_reason == "cancelled":
                        return
                    n_out += (ev.stats or {}).get("predicted_n", 0)
                    yield chunk(ev.index, "", ev.finish_reason)
            if include_usage:
                yield _sse(
                    {
                        **base,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": n_prompt,
                            "completion_tokens": n_out,
                            "total_tokens": n_prompt + n_out,
                        },
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            events.close()

    # -- llama.cpp's native /completion -----------------------------------------------------

    def completion(self, body: dict, disconnected: Disconnected):
        n_probs = P.get_int(body, "n_probs", 0, lo=0, hi=self.config.max_logprobs)
        stream = P.get_bool(body, "stream", False)
        raw = body.get("prompt", body.get("content"))
        if raw is None:
            raise bad_request("'prompt' is required", "prompt")
        prompt = self._prompt_tokens(raw)
        constraint = self._constraint(body)
        if P.get_int(body, "n", 1, lo=1, hi=1) != 1:
            raise bad_request("'n' is not supported by /completion", "n")
        reqs = self._requests(
            body, [prompt], ("n_predict", "max_tokens"), True, n_probs, n_probs > 0, constraint
        )
        req = reqs[0]
        if req.max_tokens == 0:
            # llama.cpp: n_predict 0 evaluates nothing and returns no text
            return self._native_final("", req, {"stop_type": "limit", "prompt_n": 0}, [], n_probs)
        self._submit(reqs)
        events = self._events(reqs, disconnected)
        if stream:
            return Stream(self._native_stream(events, req, n_probs))
        text, probs, stats = "", [], {}
        for ev in events:
            if ev.kind == "error":
                raise APIError(500, ev.message)
            if ev.kind == "token":
                text += ev.text
                if n_probs and ev.token >= 0:
                    probs.append(self._native_prob(ev))
            else:
                stats = dict(ev.stats or {}, finish_reason=ev.finish_reason)
        if not stats:
            raise APIError(499, "the client went away")
        return self._native_final(text, req, stats, probs, n_probs)

    def _native_prob(self, ev: Event) -> dict:
        return {
            "id": ev.token,
            "token": self._piece(ev.token),
            "logprob": ev.logprob,
            "bytes": list(self.tokenizer.token_to_piece(ev.token)),
            "top_logprobs": [
                {
                    "id": t,
                    "token": self._piece(t),
                    "logprob": lp,
                    "bytes": list(self.tokenizer.token_to_piece(t)),
                }
                for t, lp in ev.top_logprobs or []
            ],
        }

    def _native_final(self, text, req, stats, probs, n_probs) -> dict:
        out = {
            "index": 0,
            "content": text,
            "tokens": [],
            "id_slot": stats.get("id_slot", -1),
            "stop": True,
            "model": self.model_name,
            "tokens_predicted": stats.get("predicted_n", 0),
            "tokens_evaluated": len(req.prompt),
            "generation_settings": {
                **self._settings(req.sampler.params, req.max_tokens),
                "n_probs": n_probs,
            },
            "prompt": self.tokenizer.decode(req.prompt),
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": stats.get("stop_type", "none"),
            "stopping_word": "",
            "tokens_cached": stats.get("tokens_cached", 0),
            "timings": self._timings(stats),
        }
        if n_probs:
            out["completion_probabilities"] = probs
        return out

    def _native_stream(self, events, req, n_probs):
        text = ""
        try:
            for ev in events:
                if ev.kind == "error":
                    yield _sse(APIError(500, ev.message).body())
                elif ev.kind == "token":
                    text += ev.text
                    chunk = {
                        "index": 0,
                        "content": ev.text,
                        "tokens": [ev.token] if ev.token >= 0 else [],
                        "stop": False,
                        "id_slot": -1,
                    }
                    if n_probs and ev.token >= 0:
                        chunk["completion_probabilities"] = [self._native_prob(ev)]
                    yield _sse(chunk)
                else:
                    if ev.finish_reason == "cancelled":
                        return
                    final = self._native_final("", req, dict(ev.stats or {}), [], 0)
                    final.pop("completion_probabilities", None)
                    yield _sse(final)
        finally:
            events.close()
