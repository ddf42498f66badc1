"""picollama-bench: llama-bench's pp/tg figures, optionally beside llama-bench in the same run.

    picollama-bench -m MODEL [-p 512] [-n 128] [-r 5] [-t 2] [--vs-llama-cpp BIN_DIR]

pp<N>: tokens/s of one prompt batch of N tokens from an empty cache. tg<N>: tokens/s of N
tokens decoded one at a time from an empty cache. Each figure is the median ± standard
deviation over -r repetitions after one warm-up run; with --vs-llama-cpp, our runs and
llama-bench's (-r 1 each) alternate round by round. Decode reads every weight once per
token, so the table also shows the memory-bandwidth ceiling (a large numpy copy's rate
divided by the bytes read per token) and how close tg gets to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from picollama.tools.cli import (
    add_backend_args,
    add_repack_arg,
    backend_choice,
    note_gpu_layers,
)

__all__ = ["main", "measure_bandwidth"]


# general.file_type (llama.cpp's llama_ftype) -> the name llama-bench shows; a file without
# it is named by the type holding most of its bytes
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    25: "IQ4_NL",
    30: "IQ4_XS",
    32: "BF16",
}


def measure_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a large array copy (read + write), the best of ``repeats``."""
    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n_bytes / best


def _fmt_size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _fill(ctx, depth: int, rng) -> None:
    """An empty context, then ``depth`` random tokens in it (untimed): llama-bench's ``-d``."""
    ctx.reset()
    if depth:
        ctx.eval(rng.integers(0, ctx.n_vocab, size=depth).tolist())


def _run_pp(ctx, n: int, rng, depth: int = 0) -> float:
    tokens = rng.integers(0, ctx.n_vocab, size=n).tolist()
    _fill(ctx, depth, rng)
    t0 = time.perf_counter()
    ctx.eval(tokens)
    return n / (time.perf_counter() - t0)


def _run_tg(ctx, n: int, rng, depth: int = 0) -> float:
    tokens = rng.integers(0, ctx.n_vocab, size=n).tolist()
    _fill(ctx, depth, rng)
    t0 = time.perf_counter()
    for tok in tokens:
        ctx.eval([tok])
    return n / (time.perf_counter() - t0)


def _test_name(kind: str, n: int, depth: int) -> str:
    """llama-bench's name of a test: "tg128", "pp512 @ d1024"."""
    return f"{kind}{n}" + (f" @ d{depth}" if depth else "")


def _counts(text: str) -> list[int]:
    """llama-bench's value lists: "512" or "128,256,512"."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count or a list of them") from None


def _csv(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def _llama_bench(
    bin_dir: str,
    model: str,
    threads: int,
    pp: list[int],
    tg: list[int],
    reps: int,
    depth: list[int] | None = None,
) -> dict:
    exe = os.path.join(bin_dir, "llama-bench")
    cmd = [exe, "-m", model, "-t", str(threads), "-r", str(reps), "-o", "json"]
    cmd += ["-p", _csv(pp), "-n", _csv(tg)]
    if depth and any(depth):
        cmd += ["-d", _csv(depth)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr.strip()[-400:]}")
    results = {}
    for row in json.loads(proc.stdout):
        kind, n = ("pp", row["n_prompt"]) if row["n_prompt"] else ("tg", row["n_gen"])
        name = _test_name(kind, n, row.get("n_depth", 0))
        results[name] = (row["avg_ts"], row["stddev_ts"])
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-bench", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF file or built-in model name")
    p.add_argument(
        "-p",
        "--n-prompt",
        type=_counts,
        default=[512],
        help="prompt tokens (0: skip); a list such as 128,512 runs each, as llama-bench's",
    )
    p.add_argument(
        "-n",
        "--n-gen",
        type=_counts,
        default=[128],
        help="generated tokens (0: skip); a list runs each",
    )
    p.add_argument(
        "-d",
        "--n-depth",
        type=_counts,
        default=[0],
        help="tokens already in the context before each test (llama-bench's -d; untimed); "
        "a list runs every test at each",
    )
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-b", "--batch-size", type=int, default=512)
    add_backend_args(p)
    add_repack_arg(p)
    p.add_argument(
        "--vs-llama-cpp",
        metavar="BIN_DIR",
        default=None,
        help="also run llama-bench from this folder and print the ratios",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE",
        help="LoRA adapter (repeatable): every test runs without and then with the adapters",
    )
    p.add_argument(
        "--lora-scaled",
        action="append",
        nargs=2,
        default=[],
        metavar=("FILE", "SCALE"),
        help="LoRA adapter with a scale (repeatable)",
    )
    p.add_argument(
        "--lora-random",
        type=int,
        default=0,
        metavar="RANK",
        help="also a random F16 adapter of this rank on every projection of the model",
    )
    args = p.parse_args(argv)

    from picollama.errors import USER_ERRORS
    from picollama.generation import Context

    if min(*args.n_prompt, *args.n_gen, *args.n_depth) < 0:
        print("picollama-bench: error: -p, -n and -d take counts >= 0", file=sys.stderr)
        return 1
    try:
        n_ctx = max(*args.n_prompt, *args.n_gen, 1) + max(args.n_depth)
        ctx = Context(
            args.model,
            n_ctx=n_ctx,
            n_batch=args.batch_size,
            n_threads=args.threads,
            backend=backend_choice(args),
        )
    except USER_ERRORS as err:
        print(f"picollama-bench: error: {err}", file=sys.stderr)
        return 1
    note_gpu_layers(args, ctx.model)
    try:
        lora_model = _lora_model(ctx, args)
    except (*USER_ERRORS, ValueError) as err:
        print(f"picollama-bench: error: {err}", file=sys.stderr)
        return 1
    threads = getattr(ctx.backend, "n_threads", args.threads or 0)
    reader = ctx.reader
    weight_bytes = sum(t.nbytes for t in reader.tensors)
    n_params = sum(t.n_elements for t in reader.tensors)
    types = {}
    for t in reader.tensors:
        types[t.type.name] = types.get(t.type.name, 0) + t.nbytes
    main_type = _FILE_TYPES.get(reader.get("general.file_type"), max(types, key=types.get))
    model_desc = f"{ctx.model.args.arch} {n_params / 1e6:.0f}M {main_type}"
    rng = np.random.default_rng(0)

    tests = []  # (name, run, tokens, depth), in llama-bench's order
    for depth in args.n_depth:
        for n in args.n_prompt:
            if n > 0:
                tests.append((_test_name("pp", n, depth), _run_pp, n, depth))
        for n in args.n_gen:
            if n > 0:
                tests.append((_test_name("tg", n, depth), _run_tg, n, depth))
    # Beside llama-bench, the two alternate: each round runs every test of ours once, then
    # llama-bench once (-r 1), so a burst of load from elsewhere on a shared machine falls
    # on both sides alike; figures are medians over the rounds.
    vs = bool(args.vs_llama_cpp)
    reps = max(args.repetitions, 1)
    # with adapters too: without and with them alternate round by round, for the same reason
    rounds, per_round = (reps, 1) if vs or lora_model else (1, reps)
    base_model = ctx.model
    # with adapters: each test without them, then with them (the same cache and weights)
    variants = [(base_model, "")] + ([(lora_model, " +lora")] if lora_model else [])
    our_runs: dict[str, list[float]] = {}
    their_runs: dict[str, list[float]] = {}
    for round_ in range(rounds):
        for model, suffix in variants:
            ctx.model = model
            for name, fn, n, depth in tests:
                if round_ == 0:
                    fn(ctx, min(n, 16), rng)  # warm-up: compiles and touches the weights
                runs = our_runs.setdefault(name + suffix, [])
                runs.extend(fn(ctx, n, rng, depth) for _ in range(per_round))
        ctx.model = base_model
        if vs:
            try:
                got = _llama_bench(
                    args.vs_llama_cpp,
                    str(ctx.path),
                    threads,
                    args.n_prompt,
                    args.n_gen,
                    1,
                    args.n_depth,
                )
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
                print(f"picollama-bench: llama-bench did not run: {err}", file=sys.stderr)
                vs = False
                their_runs = {}
                continue
            for name, (mean, _) in got.items():
                their_runs.setdefault(name, []).append(mean)

    def summary(runs: list[float]) -> tuple[float, float]:
        return statistics.median(runs), statistics.stdev(runs) if len(runs) > 1 else 0.0

    ours = {name: summary(runs) for name, runs in our_runs.items()}
    theirs = {name: summary(runs) for name, runs in their_runs.items()}

    # a GPU backend measures its own device memory (measure_bandwidth); the CPU a numpy copy
    device_bandwidth = getattr(ctx.backend, "measure_bandwidth", None)
    bandwidth = device_bandwidth() if device_bandwidth else measure_bandwidth()
    # a decode step reads every weight once (and with -d, a cache that may not be small)
    ceiling = bandwidth / weight_bytes
    header = "| model | size | params | backend | threads | test | t/s (median ± sd) |"
    sep = "| --- | ---: | ---: | --- | ---: | --- | ---: |"
    if theirs:
        header += " llama.cpp t/s | ratio |"
        sep += " ---: | ---: |"
    print(header)
    print(sep)
    for name, (median, std) in ours.items():
        row = (
            f"| {model_desc} | {_fmt_size(weight_bytes)} | {n_params / 1e6:.2f} M | "
            f"{args.backend.upper()} | {threads} | {name} | {median:.2f} ± {std:.2f} |"
        )
        if theirs:
            if name in theirs:
                lm, ls = theirs[name]
                row += f" {lm:.2f} ± {ls:.2f} | {median / lm:.2f}x |"
            else:
                row += " - | - |"
        print(row)
    print(
        f"\nmemory bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"({'device copy' if device_bandwidth else 'numpy copy'}); decode ceiling "
        f"{ceiling:.1f} tokens/s for {_fmt_size(weight_bytes)} of weights",
        end="",
    )
    tg = [v for k, v in ours.items() if k.startswith("tg")]
    if tg:
        print(f"; tg reaches {tg[0][0] / ceiling:.0%} of it", end="")
    print()
    for name, *_ in tests:
        if name + " +lora" in ours:
            ratio = ours[name + " +lora"][0] / ours[name][0]
            print(f"{name} with the LoRA adapters: {ratio:.2f}x the speed without them")
    return 0


def _lora_model(ctx, args):
    """The model view with the adapters of --lora/--lora-scaled/--lora-random, or None."""
    from picollama.lora import LoraSet, write_random_adapter

    specs = [(path, 1.0) for path in args.lora]
    specs += [(path, float(scale)) for path, scale in args.lora_scaled]
    tmp = None
    if args.lora_random > 0:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="picollama-bench-")
        path = os.path.join(tmp.name, f"random-r{args.lora_random}.gguf")
        write_random_adapter(ctx.model, path, rank=args.lora_random)
        specs.append((path, 1.0))
    if not specs:
        return None
    adapters = LoraSet(ctx.model, specs)
    if tmp is not None:
        tmp.cleanup()  # the adapter's mmap stays valid after its file is unlinked
    n = sum(len(a.pairs) for a in adapters.adapters)
    print(f"LoRA: {len(adapters)} adapter(s) on {n} weights", file=sys.stderr)
    return adapters.model_for()


if __name__ == "__main__":
    sys.exit(main())
