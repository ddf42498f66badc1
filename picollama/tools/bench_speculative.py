"""picollama-bench-spec: decode speed with and without speculative decoding, same run.

    picollama-bench-spec -m TARGET (-md DRAFT | --lookup-ngram N) -p PROMPT | -f FILE
        [-n 128] [--draft-max 3] [-r 3] [-t 2] [--vs-llama-cpp BIN_DIR]

Greedy generation of -n tokens (end-of-generation ignored) from the prompt, plain and
speculative, -r times each; prints the median decode tokens/s of each, the speed-up, the
acceptance rate and tokens per target pass, and checks that both outputs are the same
tokens. With --vs-llama-cpp, llama-speculative-simple runs the same pair and prompt.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

__all__ = ["main"]


def _run(ctx, prompt, n):
    from picollama.sampling.samplers import Sampler, SamplingParams

    ctx.reset()
    sampler = Sampler(SamplingParams(temperature=0.0), ctx.n_vocab)
    gen = ctx.generate(prompt, sampler, n, ignore_eos=True)
    first = next(gen)  # the prompt's pass, not timed
    t0 = time.perf_counter()
    out = [first, *gen]
    return out, (len(out) - 1) / (time.perf_counter() - t0)


def _llama_cpp(bin_dir, args, prompt_text) -> str:
    cmd = [f"{bin_dir}/llama-speculative-simple", "-m", args.model, "-p", prompt_text]
    cmd += ["-n", str(args.n_predict), "--temp", "0", "-t", str(args.threads), "-c", "4096"]
    cmd += ["--spec-draft-n-max", str(args.draft_max)]
    if args.model_draft:
        cmd += ["--spec-type", "draft-simple", "-md", args.model_draft]
    else:
        cmd += ["--spec-type", "ngram-simple"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    text = proc.stdout + proc.stderr
    found = []
    for key in ("decoded", "n_drafted", "n_accept", "accept"):
        # lines may carry llama.cpp's log prefix ("0.04.766 I decoded ...")
        m = re.search(rf"^(?:[\d.]+ [A-Z] )?\s*{key}\s*[=:]?\s*(.*)$", text, re.M)
        if m:
            found.append(f"{key} {m.group(1).strip()}")
    return "; ".join(found) if found else f"exit {proc.returncode}: {text.strip()[-300:]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-bench-spec", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-md", "--model-draft", default=None)
    p.add_argument("--lookup-ngram", type=int, default=0)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--draft-max", "--spec-draft-n-max", dest="draft_max", type=int, default=3)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--vs-llama-cpp", metavar="BIN_DIR", default=None)
    args = p.parse_args(argv)
    if bool(args.model_draft) == bool(args.lookup_ngram):
        p.error("give one of -md DRAFT and --lookup-ngram N")
    text = args.prompt
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    if not text:
        p.error("give a prompt (-p or -f)")

    from picollama.errors import USER_ERRORS
    from picollama.generation import Context, Engine
    from picollama.speculative import (
        LookupDrafter,
        ModelDrafter,
        SpecParams,
        Speculator,
        check_vocab_match,
    )

    try:
        target = Engine(args.model, n_threads=args.threads)
        ctx = Context(target, n_ctx=4096)
        prompt = target.tokenizer.encode(text, add_bos=True, parse_special=True)
        params = SpecParams(n_max=args.draft_max)
        if args.model_draft:
            draft = Engine(args.model_draft, backend=target.backend)
            check_vocab_match(target, draft)
            drafter = ModelDrafter(Context(draft, n_ctx=4096), params)
        else:
            drafter = LookupDrafter(args.lookup_ngram)
        spec = Speculator(drafter, params)
        _run(ctx, prompt, 8)  # warm-up: compiles
        ctx.speculator = spec
        _run(ctx, prompt, 8)
        plain, fast, stats = [], [], []
        for _ in range(args.repetitions):
            ctx.speculator = None
            want, speed = _run(ctx, prompt, args.n_predict)
            plain.append(speed)
            ctx.speculator = spec
            got, speed = _run(ctx, prompt, args.n_predict)
            fast.append(speed)
            stats.append(spec.stats)
            if got != want:
                print("picollama-bench-spec: outputs differ!", file=sys.stderr)
                return 1
    except USER_ERRORS as err:
        print(f"picollama-bench-spec: error: {err}", file=sys.stderr)
        return 1
    a, b = statistics.median(plain), statistics.median(fast)
    acc = statistics.median(s.acceptance for s in stats)
    tpp = statistics.median(s.tokens_per_pass for s in stats)
    kind = f"draft {args.model_draft}" if args.model_draft else f"lookup n={args.lookup_ngram}"
    n = args.n_predict
    print(f"prompt {len(prompt)} tokens, {n} generated, {kind}, n_max {args.draft_max}")
    print(f"plain decode:       {a:8.2f} t/s (median of {len(plain)})")
    print(f"speculative decode: {b:8.2f} t/s  speed-up {b / a:.2f}x")
    print(f"acceptance {100 * acc:.1f}%, {tpp:.2f} tokens per target pass; outputs identical")
    if args.vs_llama_cpp:
        print("llama-speculative-simple: " + _llama_cpp(args.vs_llama_cpp, args, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
