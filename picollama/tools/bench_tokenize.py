"""picollama-bench-tokenize: tokenization speed, and llama-tokenize's on the same file.

    picollama-bench-tokenize -m MODEL -f FILE [--vs-llama-cpp BIN_DIR] [-r REPEATS]

Prints the time to load the vocabulary and to encode the file (first pass, with empty
caches, and the best of the repeats), in MB/s of UTF-8 input. With ``--vs-llama-cpp``,
runs ``BIN_DIR/llama-tokenize`` on the same file in the same run (its time includes its
own vocabulary load, so both are shown for picollama too) and checks that the ids agree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main"]

PROG = "picollama-bench-tokenize"


def _llama_cpp(bin_dir: Path, model: Path, file: Path, parse_special: bool) -> tuple[float, list]:
    exe = bin_dir / "llama-tokenize"
    if not exe.is_file():
        raise FileNotFoundError(f"no llama-tokenize in {bin_dir}")
    cmd = [str(exe), "-m", str(model), "-f", str(file), "--ids", "--log-disable", "--no-escape"]
    if not parse_special:
        cmd.append("--no-parse-special")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed: {proc.stderr.decode(errors='replace')[-500:]}")
    return elapsed, json.loads(proc.stdout.decode().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF file or built-in model name")
    ap.add_argument("-f", "--file", required=True, help="UTF-8 text to tokenize")
    ap.add_argument("--vs-llama-cpp", metavar="BIN_DIR", help="llama.cpp bin folder")
    ap.add_argument("-r", "--repeats", type=int, default=3, help="timed runs (default 3)")
    ap.add_argument("--no-parse-special", action="store_true", help="specials as plain text")
    args = ap.parse_args(argv)

    from picollama.gguf import GGUFError, GGUFReader
    from picollama.models.registry import ModelNotFoundError, resolve_model_path
    from picollama.tokenizer import Tokenizer, TokenizerError

    try:
        path = resolve_model_path(args.model)
        data = Path(args.file).read_bytes()
        t0 = time.perf_counter()
        with GGUFReader(path) as reader:
            tokenizer = Tokenizer.from_gguf(reader)
        t_load = time.perf_counter() - t0
        parse_special = not args.no_parse_special
        t0 = time.perf_counter()
        ids = tokenizer.encode(data, parse_special=parse_special)
        t_first = time.perf_counter() - t0
        t_best = t_first
        for _ in range(max(args.repeats - 1, 0)):
            t0 = time.perf_counter()
            tokenizer.encode(data, parse_special=parse_special)
            t_best = min(t_best, time.perf_counter() - t0)
    except (ModelNotFoundError, GGUFError, TokenizerError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1

    mb = len(data) / 1e6
    print(f"model: {path.name}  file: {args.file} ({len(data)} bytes, {len(ids)} tokens)")
    print(f"picollama   load {t_load:6.2f} s")
    print(f"picollama   encode, first run  {t_first:6.2f} s  {mb / t_first:6.2f} MB/s")
    print(f"picollama   encode, best of {args.repeats:<2} {t_best:6.2f} s  {mb / t_best:6.2f} MB/s")
    print(
        f"picollama   load + first run   {t_load + t_first:6.2f} s  "
        f"{mb / (t_load + t_first):6.2f} MB/s"
    )
    if args.vs_llama_cpp:
        try:
            bin_dir = Path(args.vs_llama_cpp)
            t_cpp, cpp_ids = _llama_cpp(bin_dir, path, Path(args.file), parse_special)
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 1
        same = "same ids" if cpp_ids == ids else "IDS DIFFER"
        print(f"llama.cpp   load + run         {t_cpp:6.2f} s  {mb / t_cpp:6.2f} MB/s  ({same})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
