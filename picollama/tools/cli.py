"""picollama-cli: completion or chat with a GGUF model, with llama.cpp's flags and defaults.

    picollama-cli -m MODEL -p "Once upon a time" -n 64        # completion
    picollama-cli -m MODEL -cnv                               # interactive chat
    picollama-cli                                             # chat with the default model
    picollama-cli -m MODEL -p "A dog as JSON:" -j '{"type": "object"}'   # constrained output

With a prompt (-p/-f) and no -cnv it completes the prompt and exits, like llama-completion.
Without a prompt, or with -cnv, it chats: the model's chat template frames each turn, tokens
stream as they come, Ctrl-C stops the current answer and Ctrl-D (or /exit) ends the chat.

A grammar (--grammar, --grammar-file: GBNF) or a JSON schema (-j, -jf: converted to GBNF)
constrains the completion, or in chat each answer from its start, as llama.cpp's
``common_sampler_reset`` does between turns. One that cannot be built is a one-line error
before the model loads, never a silent fall back to unconstrained output.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from picollama.sampling.samplers import DEFAULT_SEED, Sampler, SamplingParams

__all__ = ["main", "build_parser", "sampling_params"]


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=d.temperature, help="temperature (0: greedy)")
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--min-p", type=float, default=d.min_p)
    g.add_argument("--typical", type=float, default=d.typical_p, help="locally typical p")
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    g.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n)
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("-s", "--seed", type=int, default=DEFAULT_SEED, help="RNG seed (-1: random)")


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grammar", "constrain the output (one of these at most)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--grammar", default=None, help="GBNF grammar to constrain generations")
    x.add_argument(
        "--grammar-file", metavar="FNAME", default=None, help="file to read grammar from"
    )
    x.add_argument(
        "-j",
        "--json-schema",
        metavar="SCHEMA",
        default=None,
        help="JSON schema to constrain generations, e.g. '{}' for any JSON value",
    )
    x.add_argument(
        "-jf",
        "--json-schema-file",
        metavar="FILE",
        default=None,
        help="file containing a JSON schema to constrain generations",
    )


class _GrammarArgError(ValueError):
    """A grammar flag whose value cannot be used; the message is the whole line to print."""


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise _GrammarArgError(f"cannot read {what} {path!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise _GrammarArgError(f"cannot read {what} {path!r}: not UTF-8 text ({err})") from None


def _grammar_from_args(args: argparse.Namespace):
    """The ``LlamaGrammar`` of --grammar, --grammar-file, -j or -jf, or None if none is given.

    Parsed and checked here, before any model loads; raises ``_GrammarArgError`` naming the
    source and, for GBNF, the line and column.
    """
    from picollama.sampling.grammar import GrammarError, LlamaGrammar

    if args.grammar is not None:
        text, build = args.grammar, LlamaGrammar.from_string
    elif args.grammar_file is not None:
        text, build = _read_text(args.grammar_file, "grammar file"), LlamaGrammar.from_string
    elif args.json_schema is not None:
        text, build = args.json_schema, LlamaGrammar.from_json_schema
    elif args.json_schema_file is not None:
        text = _read_text(args.json_schema_file, "json schema file")
        build = LlamaGrammar.from_json_schema
    else:
        return None
    try:
        return build(text)
    except GrammarError as err:
        raise _GrammarArgError(_grammar_error_line(args, err)) from None


def _grammar_error_line(args: argparse.Namespace, err) -> str:
    """``SOURCE: line L, column C: message``, SOURCE naming the flag's grammar or file."""
    if args.grammar_file is not None:
        source = f"grammar file {args.grammar_file!r}"
    elif args.json_schema is not None:
        source = "json schema"
    elif args.json_schema_file is not None:
        source = f"json schema file {args.json_schema_file!r}"
    else:
        source = "grammar"
    where = f"line {err.line}, column {err.column}: " if err.line is not None else ""
    return f"{source}: {where}{err.message}"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags every tool that loads a model shares (-m, -c, -b, -t, --backend)."""
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="GGUF file or built-in model name (default: the default model)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=4096,
        help="context size in tokens (0: the model's training context)",
    )
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt batch size")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    add_backend_args(p)
    add_repack_arg(p)
    add_lora_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """--backend and llama.cpp's -ngl and -fa (backend_choice reads them)."""
    p.add_argument(
        "--backend", default=None, help="cpu, cuda or opencl (default: cpu; with -ngl, a GPU)"
    )
    p.add_argument(
        "-ngl",
        "--gpu-layers",
        "--n-gpu-layers",
        dest="n_gpu_layers",
        type=int,
        default=None,
        metavar="N",
        help="as llama.cpp's: any N but 0 runs the model on a GPU (cuda, else an OpenCL GPU; "
        "picollama puts all layers there, it does not split a model); no GPU: the cpu",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cuda: GPU index; opencl: device index, PLATFORM:DEVICE or a name such as pocl "
        "(default: PYOPENCL_CTX, else the first GPU, else the first device)",
    )
    p.add_argument(
        "-mg",
        "--main-gpu",
        type=int,
        default=None,
        metavar="INDEX",
        help="as llama.cpp's: the GPU to run on, where --device does not say",
    )
    p.add_argument(
        "-fa",
        "--flash-attn",
        nargs="?",
        const="on",
        default="auto",
        choices=("on", "off", "auto", "1", "0"),
        metavar="on|off|auto",
        help="as llama.cpp's; picollama's attention is always flash attention (keys streamed "
        "with an online softmax, as ggml's flash-attention arithmetic), so off is ignored",
    )


def add_repack_arg(p: argparse.ArgumentParser) -> None:
    """-nr / --no-repack, as llama.cpp's."""
    p.add_argument(
        "-nr",
        "--no-repack",
        action="store_true",
        help="cpu: multiply Q4_0/Q4_1/Q5_0/Q8_0/Q4_K matrices in the file's layout (ggml's "
        "vec_dot, bit for bit) instead of repacking them 8 rows at a time (faster; float32 "
        "rounding apart)",
    )


def backend_choice(args):
    """The backend that --backend, -ngl and --device / -mg ask for: a name, or a backend made
    here (the GPU that -ngl found, one on the device asked for, or for --no-repack a CPU
    backend made without repacking). A notice, such as -ngl without a usable GPU (then the
    device is dropped with the GPU), goes to stderr; ``args.backend`` is set to the
    backend's name."""
    from picollama.backends.base import BackendError, get_backend, gpu_layers_backend

    backend, notice = gpu_layers_backend(
        getattr(args, "n_gpu_layers", None),
        args.backend,
        device=getattr(args, "device", None),
        main_gpu=getattr(args, "main_gpu", None),
        n_threads=args.threads,
    )
    if notice:
        print(f"warning: {notice}", file=sys.stderr)
    if getattr(args, "flash_attn", None) in ("off", "0"):
        print("warning: -fa off is ignored: picollama always uses flash attention", file=sys.stderr)
    args.backend = backend if isinstance(backend, str) else backend.name
    if not getattr(args, "no_repack", False):
        return backend
    if args.backend != "cpu":
        raise BackendError(f"--no-repack is a cpu backend flag, not {args.backend}'s")
    return get_backend("cpu", n_threads=args.threads, repack=False)


def note_gpu_layers(args, model) -> None:
    """A note on stderr where -ngl asked for fewer layers than ``model`` has on a GPU:
    picollama puts them all there (it does not split a model between devices)."""
    n, layers = getattr(args, "n_gpu_layers", None), model.args.n_layers
    if n is not None and 0 < n < layers and args.backend != "cpu":
        print(
            f"note: -ngl {n} of {layers} layers: all {layers} run on {args.backend} (picollama "
            "does not split a model between devices)",
            file=sys.stderr,
        )


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """--lora FILE and --lora-scaled FILE SCALE, repeatable, as llama.cpp's."""
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE",
        help="LoRA adapter GGUF at scale 1 (repeatable; adapters stack)",
    )
    p.add_argument(
        "--lora-scaled",
        action="append",
        nargs=2,
        default=[],
        metavar=("FILE", "SCALE"),
        help="LoRA adapter GGUF with a scale (repeatable)",
    )


def lora_specs(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The (path, scale) pairs of --lora and --lora-scaled; ``LoraError`` names a bad scale."""
    from picollama.lora import LoraError

    specs = [(path, 1.0) for path in args.lora]
    for path, scale in args.lora_scaled:
        try:
            specs.append((path, float(scale)))
        except ValueError:
            raise LoraError(f"--lora-scaled {path}: scale {scale!r} is not a number") from None
    return specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="picollama-cli", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None, help="prompt text")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=-1,
        help="tokens to generate (-1: until end of generation or the context)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="don't stop at end-of-generation")
    p.add_argument(
        "-r",
        "--reverse-prompt",
        action="append",
        default=[],
        help="stop when this text is generated (repeatable)",
    )
    p.add_argument("--no-display-prompt", action="store_true", help="don't echo the prompt")
    p.add_argument("-sys", "--system-prompt", default=None, help="system message for chat")
    p.add_argument("--chat-template", default=None, help="built-in template name to use")
    cnv = p.add_mutually_exclusive_group()
    cnv.add_argument(
        "-cnv",
        "--conversation",
        action="store_true",
        default=None,
        help="chat mode (default when no prompt is given)",
    )
    cnv.add_argument(
        "-no-cnv",
        "--no-conversation",
        dest="conversation",
        action="store_false",
        help="completion mode",
    )
    p.add_argument("--verbose-timings", action="store_true", help="print timings after each turn")
    p.add_argument(
        "--list-archs",
        action="store_true",
        help="list the model architectures (general.architecture) this build runs, and exit",
    )
    _add_sampling_args(p)
    _add_grammar_args(p)
    _add_speculative_args(p)
    return p


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "-md",
        "--model-draft",
        "--spec-draft-model",
        dest="model_draft",
        default=None,
        help="draft model (GGUF file or built-in name) with the target's vocabulary",
    )
    g.add_argument(
        "--lookup-ngram",
        type=int,
        default=0,
        metavar="N",
        help="draft by prompt lookup: continue the latest earlier match of the last N "
        "tokens (or fewer) in the prompt and output (no draft model)",
    )
    g.add_argument(
        "--spec-type",
        choices=("none", "draft-simple", "ngram-simple"),
        default=None,
        help="llama.cpp's name: draft-simple needs -md; ngram-simple is prompt lookup",
    )
    g.add_argument(
        "--spec-ngram-simple-size-n",
        type=int,
        default=12,
        metavar="N",
        help="longest n-gram that --spec-type ngram-simple looks up (default: 12)",
    )
    g.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        "--draft-n",
        "--draft",
        dest="draft_max",
        type=int,
        default=3,
        metavar="N",
        help="tokens to draft per round (default: 3)",
    )
    g.add_argument(
        "--spec-draft-n-min",
        "--draft-min",
        dest="draft_min",
        type=int,
        default=0,
        metavar="N",
        help="a shorter draft is not used (default: 0)",
    )
    g.add_argument(
        "--spec-draft-p-min",
        "--draft-p-min",
        dest="draft_p_min",
        type=float,
        default=0.0,
        metavar="P",
        help="the draft model stops when its best token is less likely than P (default: 0)",
    )


def _speculative_kwargs(args: argparse.Namespace) -> dict:
    """Llama(...) keyword arguments for the speculative flags."""
    lookup = args.lookup_ngram
    if args.spec_type == "ngram-simple" and not lookup:
        lookup = args.spec_ngram_simple_size_n
    if args.spec_type == "draft-simple" and args.model_draft is None:
        raise _SpecArgError("--spec-type draft-simple needs a draft model (-md FILE)")
    if args.spec_type == "none":
        return {}
    return {
        "draft_model": args.model_draft,
        "lookup_ngram": lookup,
        "spec_draft_n_max": args.draft_max,
        "spec_draft_n_min": args.draft_min,
        "spec_draft_p_min": args.draft_p_min,
    }


class _SpecArgError(ValueError):
    pass


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        typical_p=args.typical,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )


class _Interrupt:
    """Ctrl-C while generating sets a flag (the answer stops); at the prompt it exits."""

    def __init__(self):
        self.generating = False
        self.stop = threading.Event()

    def __call__(self, signum, frame):
        if self.generating:
            self.stop.set()
        else:
            raise KeyboardInterrupt


def _stream(llm, prompt_tokens, args, sampler, interrupt: _Interrupt, out) -> str:
    """Generate after ``prompt_tokens``, printing text as it comes; returns the text."""
    from picollama.sampling.stop import StopStrings

    ctx = llm.ctx
    decoder = llm.tokenizer.detokenizer(skip_special=True)
    stops = StopStrings(args.reverse_prompt)
    max_tokens = args.n_predict if args.n_predict >= 0 else -1
    if max_tokens > 0:
        max_tokens = min(max_tokens, ctx.n_ctx - len(prompt_tokens))
    text = []
    interrupt.stop.clear()
    interrupt.generating = True
    try:
        gen = ctx.generate(prompt_tokens, sampler, max_tokens, ignore_eos=args.ignore_eos)
        for token in gen:
            piece = stops.push(decoder.push(token))
            out.write(piece)
            out.flush()
            text.append(piece)
            if stops.hit or interrupt.stop.is_set():
                gen.close()
                break
        if not stops.hit:
            tail = stops.push(decoder.flush()) + stops.flush()
            out.write(tail)
            text.append(tail)
        out.flush()
    finally:
        interrupt.generating = False
    return "".join(text)


def _timings(llm, t_start: float) -> None:
    t = llm.ctx.timings
    print(
        f"\nllama_perf: load time = {t.load_ms:.2f} ms\n"
        f"llama_perf: prompt eval time = {t.prompt_ms:.2f} ms / {t.prompt_tokens} tokens "
        f"({t.prompt_per_second:.2f} tokens per second)\n"
        f"llama_perf: eval time = {t.predicted_ms:.2f} ms / {t.predicted_tokens} runs "
        f"({t.predicted_per_second:.2f} tokens per second)\n"
        f"llama_perf: total time = {(time.perf_counter() - t_start) * 1000:.2f} ms",
        file=sys.stderr,
    )


def _chat(llm, args, first_message: str | None, interrupt: _Interrupt, constraint) -> None:
    messages = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    sampler = Sampler(sampling_params(args), llm.ctx.n_vocab)
    pending = first_message
    print("== chat mode: Ctrl-C stops an answer, Ctrl-D or /exit ends the chat ==", file=sys.stderr)
    while True:
        if pending is None:
            try:
                line = input("\n> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if not line.strip():
                continue
            pending = line
        else:
            print(f"> {pending}")
        messages.append({"role": "user", "content": pending})
        pending = None
        text = llm.apply_chat_template(messages)
        prompt = llm.encode_chat_text(text)
        if len(prompt) >= llm.ctx.n_ctx:
            print(
                f"\nerror: the conversation ({len(prompt)} tokens) no longer fits the context "
                f"of {llm.ctx.n_ctx}; start again with a larger -c",
                file=sys.stderr,
            )
            return
        if constraint is not None:
            sampler.grammar = constraint.matcher()  # each answer from the grammar's start
        answer = _stream(llm, prompt, args, sampler, interrupt, sys.stdout)
        messages.append({"role": "assistant", "content": answer})
        print()
        if args.verbose_timings:
            t = llm.ctx.timings
            print(
                f"[{t.prompt_per_second:.1f} t/s prompt, {t.predicted_per_second:.1f} t/s gen]",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_archs:
        from picollama.models import supported_architectures

        print("\n".join(supported_architectures()))
        return 0
    t_start = time.perf_counter()
    prompt = args.prompt
    try:
        if args.file is not None:
            with open(args.file, encoding="utf-8") as f:
                prompt = f.read()
    except (OSError, UnicodeDecodeError) as err:
        print(f"picollama-cli: error: cannot read prompt file: {err}", file=sys.stderr)
        return 1
    conversation = args.conversation if args.conversation is not None else prompt is None
    try:
        grammar = _grammar_from_args(args)
    except _GrammarArgError as err:
        print(f"picollama-cli: error: {err}", file=sys.stderr)
        return 1

    try:
        spec_kwargs = _speculative_kwargs(args)
        adapters = lora_specs(args)
    except (_SpecArgError, ValueError) as err:
        print(f"picollama-cli: error: {err}", file=sys.stderr)
        return 1

    from picollama.api import Llama
    from picollama.errors import USER_ERRORS
    from picollama.sampling.grammar import GrammarError, TokenVocab

    interrupt = _Interrupt()
    try:
        llm = Llama(
            args.model,
            n_ctx=args.ctx_size,
            n_batch=args.batch_size,
            n_threads=args.threads,
            backend=backend_choice(args),
            seed=args.seed,
            chat_template=args.chat_template,
            lora_adapters=adapters,
            **spec_kwargs,
        )
        note_gpu_layers(args, llm.ctx.model)
        # the CPU's step program compiles beside the answer, not in the middle of it
        backend = llm.ctx.backend
        if hasattr(backend, "compile_in_background"):
            backend.compile_in_background = True
        constraint = None
        if grammar is not None:
            constraint = grammar.constraint(TokenVocab.from_tokenizer(llm.tokenizer))
        previous = signal.signal(signal.SIGINT, interrupt)
        try:
            if conversation:
                _chat(llm, args, prompt, interrupt, constraint)
            else:
                prompt_tokens = llm.tokenizer.encode(prompt or "", parse_special=True)
                if not args.no_display_prompt:
                    sys.stdout.write(prompt or "")
                sampler = Sampler(sampling_params(args), llm.ctx.n_vocab, grammar=constraint)
                _stream(llm, prompt_tokens, args, sampler, interrupt, sys.stdout)
                print()
        finally:
            signal.signal(signal.SIGINT, previous)
        _timings(llm, t_start)
        if llm.spec_stats is not None:
            print("\nspeculative decoding:\n" + llm.spec_stats.report(), file=sys.stderr)
        finish = getattr(backend, "finish_compiling", None)
        if finish is not None:
            finish(
                lambda: print(
                    "picollama-cli: compiling the decode program for the next runs "
                    "(once per install, about a minute)...",
                    file=sys.stderr,
                    flush=True,
                )
            )
        return 0
    except USER_ERRORS as err:
        print(f"picollama-cli: error: {err}", file=sys.stderr)
        return 1
    except GrammarError as err:  # binding to the vocabulary, or no token can continue
        sys.stdout.flush()
        print(f"picollama-cli: error: {_grammar_error_line(args, err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
