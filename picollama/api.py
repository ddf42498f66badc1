"""The Python API, in the manner of llama-cpp-python's ``Llama`` class.

    from picollama import Llama
    llm = Llama("smollm2-135m-instruct-q4_1", n_ctx=2048, seed=0)
    out = llm.create_chat_completion([{"role": "user", "content": "Hi!"}], max_tokens=32)
    print(out["choices"][0]["message"]["content"])

Results are OpenAI-shaped dicts; ``stream=True`` gives an iterator of chunks instead.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence

from picollama.backends.base import Backend, gpu_layers_backend
from picollama.generation import Context
from picollama.sampling.samplers import DEFAULT_SEED, Sampler, SamplingParams
from picollama.sampling.stop import StopStrings
from picollama.speculative import LookupDrafter

__all__ = ["Llama", "LlamaPromptLookupDecoding"]


class Llama:
    """A loaded GGUF model: completions, chat completions, tokenize and detokenize."""

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_threads: int | None = None,
        backend: str | Backend | None = None,
        device: int | str | None = None,
        n_gpu_layers: int = 0,
        main_gpu: int = 0,
        flash_attn: bool | None = None,
        seed: int = DEFAULT_SEED,
        chat_template: str | None = None,
        verbose: bool = False,
        draft_model=None,
        lookup_ngram: int = 0,
        spec_draft_n_max: int = 3,
        spec_draft_n_min: int = 0,
        spec_draft_p_min: float = 0.0,
        lora_adapters: Sequence[tuple[str | os.PathLike, float]] | None = None,
        lora_path: str | os.PathLike | None = None,
        lora_scale: float = 1.0,
    ):
        """``backend`` is "cpu" (the default), "cuda", "opencl" or a backend made by the
        caller. ``device`` picks the device of the cuda backend (a GPU index) or the opencl
        one (an index, ``"platform:device"`` or a name); None: the backend's default.
        ``n_gpu_layers`` (llama-cpp-python's; -1 for all) other than 0 runs the model on a
        GPU, CUDA else OpenCL, where ``backend`` names none: picollama puts every layer there
        rather than splitting the model. Without a usable GPU it runs on the CPU with a
        ``RuntimeWarning`` that says why. ``main_gpu`` is the GPU index where ``device`` is not
        given. Attention is always flash attention (keys streamed with an online softmax),
        so ``flash_attn=True`` changes nothing and ``False`` gets a ``RuntimeWarning``.

        Speculative decoding (``picollama.speculative``): ``draft_model`` is a draft GGUF
        (path or built-in name) with the target's vocabulary, or a drafter such as
        ``LlamaPromptLookupDecoding(num_pred_tokens=10)``; ``lookup_ngram=N`` drafts by prompt
        lookup instead. ``spec_draft_n_max`` tokens are drafted per round (``n_min``,
        ``p_min`` as llama.cpp's). ``spec_stats`` has the counts of the last generation.

        LoRA (``picollama.lora``): ``lora_adapters`` is a list of ``(path, scale)`` GGUF
        adapters, applied together; ``lora_path``/``lora_scale`` (llama-cpp-python's
        spelling) add one more. ``set_lora_adapters`` changes the scales without reloading."""
        if flash_attn is False:
            warnings.warn(
                "flash_attn=False is ignored: picollama always uses flash attention",
                RuntimeWarning,
                stacklevel=2,
            )
        if backend is None or isinstance(backend, str):
            backend, notice = gpu_layers_backend(
                n_gpu_layers, backend, device=device, main_gpu=main_gpu or None, n_threads=n_threads
            )
            if notice:
                warnings.warn(notice, RuntimeWarning, stacklevel=2)
        self.ctx = Context(
            model_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, backend=backend
        )
        self._draft_engine = None
        self.lora = None
        try:
            specs = list(lora_adapters or [])
            if lora_path is not None:
                specs.append((lora_path, lora_scale))
            if specs:
                from picollama.lora import LoraSet

                self.lora = LoraSet(self.ctx.model, specs)
                self.ctx.model = self.lora.model_for()
            self.ctx.speculator = self._speculator(
                draft_model, lookup_ngram, spec_draft_n_max, spec_draft_n_min, spec_draft_p_min
            )
        except BaseException:
            self.close()
            raise
        self.model_path = str(self.ctx.path)
        self.seed = seed
        self.verbose = verbose
        self._chat_template_name = chat_template
        self._chat_template = None

    # -- LoRA adapters ----------------------------------------------------------------------

    def lora_adapters(self) -> list[dict]:
        """The loaded adapters as llama-server lists them: ``[{id, path, scale}]``."""
        return self.lora.describe() if self.lora is not None else []

    def set_lora_adapters(self, scales: list[dict]) -> None:
        """New scales, ``[{"id": i, "scale": s}]`` (adapters not named get 0); the model is
        not reloaded, and the KV cache is dropped since it was computed with the old ones."""
        if self.lora is None:
            from picollama.lora import LoraError

            raise LoraError("no LoRA adapters are loaded")
        self.lora.set_scales(scales)
        self.ctx.model = self.lora.model_for()
        self.ctx.reset()

    # -- tokens -----------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.ctx.tokenizer

    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    def n_vocab(self) -> int:
        return self.ctx.n_vocab

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama-cpp-python's signature: ``special`` parses specials)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        # add_bos=True adds BOS only where the model asks for one, as llama.cpp's add_special
        return self.tokenizer.encode(
            text, add_bos=None if add_bos else False, parse_special=special
        )

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return self.tokenizer.decode(list(tokens), skip_special=not special).encode("utf-8")

    # -- completions ------------------------------------------------------------------------

    def _sampler(self, grammar=None, **kw) -> Sampler:
        seed = kw.pop("seed", None)
        params = SamplingParams(seed=self.seed if seed is None else seed, **kw)
        return Sampler(params, self.ctx.n_vocab, grammar=self._constraint(grammar))

    def _constraint(self, grammar):
        """``grammar`` (a ``LlamaGrammar`` or GBNF text) bound to this model's vocabulary."""
        if grammar is None:
            return None
        from picollama.sampling.grammar import TokenVocab, grammar_from_request

        return grammar_from_request(grammar=grammar).constraint(
            TokenVocab.from_tokenizer(self.tokenizer)
        )

    def _stream_tokens(
        self,
        prompt_tokens: list[int],
        max_tokens: int | None,
        stop: Sequence[str] | str | None,
        sampler: Sampler,
    ) -> Iterator[tuple[str, str | None]]:
        """Yield (text delta, finish_reason or None); the last item carries the reason."""
        if max_tokens is None or max_tokens <= 0:
            max_tokens = self.ctx.n_ctx - len(prompt_tokens)
        decoder = self.tokenizer.detokenizer(skip_special=True)
        stops = StopStrings(stop)
        self._last_completion_tokens = 0
        gen = self.ctx.generate(prompt_tokens, sampler, max_tokens)
        for token in gen:
            self._last_completion_tokens += 1
            text = stops.push(decoder.push(token))
            if stops.hit:
                if text:
                    yield text, None
                gen.close()
                yield "", "stop"
                return
            if text:
                yield text, None
        tail = stops.push(decoder.flush())
        if stops.hit:
            yield tail, "stop"
            return
        yield tail + stops.flush(), self.ctx.finish_reason

    def create_completion(
        self,
        prompt: str | list[int],
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        top_k: int = 40,
        stop: Sequence[str] | str | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        logit_bias: dict[int, float] | None = None,
        echo: bool = False,
        stream: bool = False,
        grammar=None,
    ):
        """A text completion (OpenAI ``text_completion`` shape)."""
        if isinstance(prompt, str):
            prompt_tokens = self.tokenizer.encode(prompt, parse_special=True)
        else:
            prompt_tokens = [int(t) for t in prompt]
            prompt = self.tokenizer.decode(prompt_tokens)
        sampler = self._sampler(
            temperature=temperature,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            top_k=top_k,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            repeat_penalty=repeat_penalty,
            seed=seed,
            logit_bias=dict(logit_bias or {}),
            grammar=grammar,
        )
        cid = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        pieces = self._stream_tokens(prompt_tokens, max_tokens, stop, sampler)

        def chunk(text: str, reason: str | None) -> dict:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": self.model_path,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
            }

        def usage() -> dict:
            n_out = self._last_completion_tokens
            return {
                "prompt_tokens": len(prompt_tokens),
                "completion_tokens": n_out,
                "total_tokens": len(prompt_tokens) + n_out,
            }

        if stream:

            def chunks():
                if echo:
                    yield chunk(prompt, None)
                for text, reason in pieces:
                    yield chunk(text, reason)

            return chunks()
        text, reason = "", None
        for delta, finish in pieces:
            text, reason = text + delta, finish
        out = chunk((prompt if echo else "") + text, reason)
        out["usage"] = usage()
        return out

    __call__ = create_completion

    # -- chat -------------------------------------------------------------------------------

    @property
    def chat_template(self):
        if self._chat_template is None:
            from picollama.tokenizer import ChatTemplate

            self._chat_template = ChatTemplate.for_model(
                self.ctx.reader.metadata, override_name=self._chat_template_name
            )
        return self._chat_template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_chat_text(self, text: str) -> list[int]:
        """Tokens of a rendered chat, specials parsed; no second BOS if the text has one."""
        tok = self.tokenizer
        bos = tok.token_to_piece(tok.bos_id).decode("utf-8", "replace") if tok.bos_id >= 0 else ""
        add_bos = False if bos and text.startswith(bos) else None
        return tok.encode(text, add_bos=add_bos, parse_special=True)

    def create_chat_completion(
        self,
        messages: list[dict],
        max_tokens: int | None = None,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        top_k: int = 40,
        stop: Sequence[str] | str | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        logit_bias: dict[int, float] | None = None,
        stream: bool = False,
        grammar=None,
        response_format: dict | None = None,
    ):
        """A chat completion (OpenAI ``chat.completion`` shape).

        ``grammar`` (a ``LlamaGrammar`` or GBNF text) or ``response_format`` (OpenAI's
        ``json_object`` / ``json_schema``) constrain the reply; one that cannot be built
        raises ``GrammarError``."""
        prompt_tokens = self.encode_chat_text(self.apply_chat_template(messages))
        sampler = self._sampler(
            temperature=temperature,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            top_k=top_k,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            repeat_penalty=repeat_penalty,
            seed=seed,
            logit_bias=dict(logit_bias or {}),
            grammar=_request_grammar(grammar, response_format),
        )
        cid = f"chatcmpl-{uuid.uuid4()}"
        created = int(time.time())
        pieces = self._stream_tokens(prompt_tokens, max_tokens, stop, sampler)
        if stream:

            def chunks():
                yield {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_path,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant"},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                for delta, reason in pieces:
                    yield {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_path,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": delta} if delta else {},
                                "logprobs": None,
                                "finish_reason": reason,
                            }
                        ],
                    }

            return chunks()
        content, reason = "", None
        for delta, finish in pieces:
            content, reason = content + delta, finish
        n_out = self._last_completion_tokens
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_path,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": reason,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_tokens),
                "completion_tokens": n_out,
                "total_tokens": len(prompt_tokens) + n_out,
            },
        }

    def _speculator(self, draft_model, lookup_ngram, n_max, n_min, p_min):
        from picollama import speculative as spec

        params = spec.SpecParams(n_max=n_max, n_min=n_min, p_min=p_min)
        if draft_model is not None and lookup_ngram:
            raise spec.SpeculativeError("use a draft model or prompt lookup, not both")
        if isinstance(draft_model, spec.LookupDrafter):
            if isinstance(draft_model, LlamaPromptLookupDecoding):
                params.n_max = draft_model.num_pred_tokens
            return spec.Speculator(draft_model, params)
        if isinstance(draft_model, spec.Drafter):
            return spec.Speculator(draft_model, params)
        if draft_model is not None:
            from picollama.generation import Engine

            target = self.ctx.engine
            self._draft_engine = Engine(draft_model, n_batch=target.n_batch, backend=target.backend)
            spec.check_vocab_match(target, self._draft_engine)
            draft_ctx = Context(self._draft_engine, n_ctx=self.ctx.n_ctx)
            return spec.Speculator(spec.ModelDrafter(draft_ctx, params), params)
        if lookup_ngram:
            return spec.Speculator(spec.LookupDrafter(lookup_ngram), params)
        return None

    @property
    def spec_stats(self):
        """The speculative counts of the last generation (None without speculation)."""
        sp = self.ctx.speculator
        return None if sp is None else sp.stats

    def close(self) -> None:
        if self.lora is not None:
            self.ctx.model = self.lora.model
            self.lora.close()
            self.lora = None
        self.ctx.close()
        if self._draft_engine is not None:
            self._draft_engine.close()
            self._draft_engine = None

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LlamaPromptLookupDecoding(LookupDrafter):
    """llama-cpp-python's prompt-lookup drafter, for ``Llama(draft_model=...)``: the last
    ``max_ngram_size`` tokens (or fewer) are looked up in the prompt and output, and up to
    ``num_pred_tokens`` of what followed are drafted."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        super().__init__(max_ngram_size)
        self.num_pred_tokens = int(num_pred_tokens)


def _request_grammar(grammar, response_format):
    if grammar is None and response_format is None:
        return None
    from picollama.sampling.grammar import grammar_from_request

    return grammar_from_request(grammar=grammar, response_format=response_format)
