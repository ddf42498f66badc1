"""picollama-bench-grammar: the cost of grammar-constrained sampling.

    python -m picollama.tools.bench_grammar [-m MODEL ...] [--generate N] [--llama-cpp BIN_DIR]

Full-mask time, per vocabulary and grammar (llama.cpp's json.gbnf and a JSON schema with
nested objects, arrays and enums), over the grammar states met while reading a sample
document token by token:

- cold: a fresh engine, so each state's byte transitions are computed on the way (the
  first generation with a new grammar);
- uncached: the engine knows the transitions, the state's mask is not cached (a mask
  cache miss later in a generation);
- cached: a mask cache hit.

``--generate N``: tokens/s of N-token generations on the model, unconstrained and under
each grammar (median of ``--gen-repetitions`` interleaved runs), the sampler's time per
token (sampling and accepting, grammar included), and the constrained/unconstrained ratio
those sampler times give at the median model evaluation time (steady where tokens/s
swing with the load of a shared machine); ``--llama-cpp BIN_DIR``: the same figures from
llama.cpp's ``llama-completion --grammar-file`` beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "JSON_GBNF", "BENCH_SCHEMA", "BENCH_DOCUMENT"]

# llama.cpp's grammars/json.gbnf
JSON_GBNF = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "pets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string"}},
                "required": ["kind", "name"],
            },
        },
    },
    "required": ["name", "age", "tags", "address"],
}

# valid under both grammars (required properties come first, as the converter orders them)
BENCH_DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], '
    '"address": {"street": "12 St James Square", "city": "London", "zip": "12345"}, '
    '"email": "ada@example.org", '
    '"pets": [{"kind": "cat", "name": "Tom"}, {"kind": "dog", "name": "Rex"}]}'
)

PROMPT = "Write a JSON object describing a person, with name, age, tags and address:\n"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _grammars() -> dict[str, str]:
    from picollama.sampling.json_schema import schema_to_gbnf

    return {"json.gbnf": JSON_GBNF, "schema": schema_to_gbnf(BENCH_SCHEMA)}


def mask_timings(tokenizer, vocab, grammar_text: str, repeats: int = 3) -> dict[str, list[float]]:
    """Milliseconds per full mask (cold, uncached, cached) along ``BENCH_DOCUMENT``."""
    from picollama.sampling.grammar import Grammar, TokenConstraint

    ids = tokenizer.encode(BENCH_DOCUMENT, add_bos=False, parse_special=False)
    out: dict[str, list[float]] = {"cold": [], "uncached": [], "cached": []}
    for _ in range(repeats):
        c = TokenConstraint(Grammar.parse(grammar_text), vocab)  # a fresh engine
        m = c.matcher()
        auto = c.grammar.automaton
        for tok in ids:
            nid = m._sync()
            t0 = time.perf_counter()
            with auto.lock:
                c.mask(nid)
            out["cold"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            with auto.lock:
                c.compute_mask(nid)
            out["uncached"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            m.allowed_mask()
            out["cached"].append((time.perf_counter() - t0) * 1e3)
            m.accept_token(tok)
    return out


def _generate(ctx, tokenizer, prompt_ids, n: int, seed: int, constraint=None) -> dict:
    """One generation: tokens/s after the prompt, and per token the model's evaluation
    time and the sampler's (sample + accept, the grammar included)."""
    from picollama.sampling.samplers import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(seed=seed), ctx.n_vocab, grammar=constraint)
    spent = 0.0
    sample, accept = sampler.sample, sampler.accept

    def timed_sample(logits):
        nonlocal spent
        t = time.perf_counter()
        tok = sample(logits)
        spent += time.perf_counter() - t
        return tok

    def timed_accept(tok, *a):
        nonlocal spent
        t = time.perf_counter()
        accept(tok, *a)
        spent += time.perf_counter() - t

    sampler.sample, sampler.accept = timed_sample, timed_accept
    t0 = time.perf_counter()
    out = list(ctx.generate(prompt_ids, sampler, n))
    total = time.perf_counter() - t0
    timings = ctx.timings
    n_out = max(len(out), 1)
    return {
        "tokens": len(out),
        "tok_s": len(out) / max(total - timings.prompt_ms / 1e3, 1e-9),
        "eval_ms_per_token": timings.predicted_ms / max(timings.predicted_tokens, 1),
        "sample_ms_per_token": spent * 1e3 / n_out,
        "text": tokenizer.decode(out),
    }


def _llama_completion(
    bin_dir: str, model: str, grammar: str | None, n: int, seed: int, threads: int
) -> dict:
    exe = os.path.join(bin_dir, "llama-completion")
    cmd = [exe, "-m", model, "-p", PROMPT, "-n", str(n), "--seed", str(seed), "-no-cnv"]
    cmd += ["--no-display-prompt", "--simple-io", "-t", str(threads)]
    with tempfile.NamedTemporaryFile("w", suffix=".gbnf", delete=False) as f:
        if grammar is not None:
            f.write(grammar)
            cmd += ["--grammar-file", f.name]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    log = out.stdout + out.stderr
    res: dict = {}
    m = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs.*?([\d.]+) tokens per second", log)
    if m:
        res["tok_s"] = float(m.group(3))
        res["tokens"] = int(m.group(2))
    m = re.search(r"sampling time =\s+([\d.]+) ms", log)
    if m and res.get("tokens"):
        res["sample_ms_per_token"] = float(m.group(1)) / max(res["tokens"], 1)
    if not res:
        res["error"] = log[-300:]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-bench-grammar", description=__doc__.split("\n")[0])
    p.add_argument(
        "-m",
        "--model",
        action="append",
        help="GGUF file or built-in name, repeatable "
        "(default: smollm2-135m-instruct-q4_1 and gemma3-270m-q4_k_m)",
    )
    p.add_argument("-r", "--repetitions", type=int, default=3, help="passes over the document")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="also time generations")
    p.add_argument("--gen-repetitions", type=int, default=3, help="runs of each generation")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--llama-cpp", metavar="BIN_DIR", help="llama.cpp binaries to compare with")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    models = args.model or ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]

    from picollama.gguf import GGUFError, GGUFReader
    from picollama.models.registry import ModelNotFoundError, resolve_model_path
    from picollama.sampling.grammar import TokenConstraint, TokenVocab
    from picollama.tokenizer import Tokenizer

    grammars = _grammars()
    report: dict = {}
    for name in models:
        try:
            path = str(resolve_model_path(name))
            with GGUFReader(path) as reader:
                tokenizer = Tokenizer.from_gguf(reader)
        except (GGUFError, ModelNotFoundError, OSError) as err:
            print(f"picollama-bench-grammar: error: {err}", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        vocab = TokenVocab.from_tokenizer(tokenizer)
        _ = vocab.trie
        entry: dict = {
            "n_vocab": vocab.n_vocab,
            "trie_nodes": vocab.trie.n_nodes,
            "vocab_setup_s": time.perf_counter() - t0,
            "masks": {},
        }
        for gname, text in grammars.items():
            ms = mask_timings(tokenizer, vocab, text, args.repetitions)
            entry["masks"][gname] = {
                kind: {"p50_ms": _pct(xs, 50), "p99_ms": _pct(xs, 99), "n": len(xs)}
                for kind, xs in ms.items()
            }
        if args.generate > 0:
            entry["generate"] = _bench_generation(
                path, tokenizer, vocab, grammars, args, TokenConstraint
            )
            if args.llama_cpp:
                ref: dict[str, list[dict]] = {}
                for _ in range(max(args.gen_repetitions, 1)):
                    for g, text in [("unconstrained", None), *grammars.items()]:
                        ref.setdefault(g, []).append(
                            _llama_completion(
                                args.llama_cpp, path, text, args.generate, args.seed, args.threads
                            )
                        )
                entry["llama.cpp"] = {
                    g: sorted(rs, key=lambda r: r.get("tok_s", 0.0))[len(rs) // 2]
                    for g, rs in ref.items()
                }
        report[name] = entry
        if not args.json:
            _print_entry(name, entry)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _bench_generation(path, tokenizer, vocab, grammars, args, TokenConstraint) -> dict:
    """Each configuration ``--gen-repetitions`` times, interleaved so that load on a shared
    machine hits them alike; the median run of each is reported."""
    from picollama.generation import Context

    ctx = Context(path, n_ctx=1024)
    prompt = tokenizer.encode(PROMPT, add_bos=None, parse_special=False)
    _generate(ctx, tokenizer, prompt, 4, args.seed)  # warm-up (kernel compilation)
    runs = [("unconstrained", None)] + [(g, TokenConstraint(t, vocab)) for g, t in grammars.items()]
    results: dict[str, list[dict]] = {g: [] for g, _ in runs}
    for _ in range(max(args.gen_repetitions, 1)):
        for gname, constraint in runs:
            ctx.reset()
            res = _generate(ctx, tokenizer, prompt, args.generate, args.seed, constraint)
            if constraint is not None:
                res["mask_cache"] = dict(constraint.stats)
            results[gname].append(res)
    out = {g: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for g, rs in results.items()}
    base = out["unconstrained"]["tok_s"]
    # on a loaded machine tokens/s swing with the load; the sampler's own time does not:
    # the ratio expected at the median evaluation time, from the sampler times alone
    evals = sorted(r["eval_ms_per_token"] for rs in results.values() for r in rs)
    e = evals[len(evals) // 2]
    s0 = out["unconstrained"]["sample_ms_per_token"]
    for res in out.values():
        res["vs_unconstrained"] = res["tok_s"] / base if base else float("nan")
        res["vs_unconstrained_at_median_eval"] = (e + s0) / (e + res["sample_ms_per_token"])
        res["median_eval_ms_per_token"] = e
    return out


def _print_entry(name: str, entry: dict) -> None:
    print(f"{name}: {entry['n_vocab']} tokens, {entry['trie_nodes']} trie nodes, "
          f"vocabulary set up in {entry['vocab_setup_s']:.2f} s")  # fmt: skip
    print(f"  {'grammar':<10} {'mask':<9} {'p50 ms':>8} {'p99 ms':>8} {'n':>5}")
    for gname, kinds in entry["masks"].items():
        for kind, r in kinds.items():
            print(f"  {gname:<10} {kind:<9} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['n']:5d}")
    gen = entry.get("generate")
    if gen:
        e = next(iter(gen.values()))["median_eval_ms_per_token"]
        print(f"  {'generation':<14} {'tokens':>6} {'tok/s':>7} {'x':>5} {'sampler ms/tok':>14} "
              f"{'x at eval ' + format(e, '.1f') + ' ms':>16}")  # fmt: skip
        for gname, r in gen.items():
            print(f"  {gname:<14} {r['tokens']:6d} {r['tok_s']:7.2f} {r['vs_unconstrained']:5.2f} "
                  f"{r['sample_ms_per_token']:14.3f} "
                  f"{r['vs_unconstrained_at_median_eval']:16.3f}")  # fmt: skip
    ref = entry.get("llama.cpp")
    if ref:
        for gname, r in ref.items():
            if "error" in r:
                print(f"  llama.cpp {gname}: error {r['error']!r}")
            else:
                ms = r.get("sample_ms_per_token", float("nan"))
                print(f"  llama.cpp {gname:<14} {r['tokens']:6d} {r['tok_s']:7.2f} tok/s, "
                      f"sampling {ms:.3f} ms/tok")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
