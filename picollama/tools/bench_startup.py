"""picollama-bench-startup: time from launching the CLI to its first generated token.

    picollama-bench-startup -m MODEL [-r 5] [-t 2] [--vs-llama-cpp BIN_DIR]

Each run starts ``picollama-cli -m MODEL -p PROMPT -n 1`` as a new process and takes the
wall-clock time until it exits, which is the time to the first generated token (load the
file, tokenize, evaluate the prompt, sample one token) plus the exit. "warm" runs find
Numba's compiled kernels in its cache (the usual case after the first start); the "cold"
run gets an empty cache directory (``NUMBA_CACHE_DIR``), so it compiles every kernel it
needs: its difference to the warm median is the JIT compile time a first start pays. With
``--vs-llama-cpp``, llama.cpp's ``llama-completion`` runs the same prompt with ``-n 1`` in
the same rounds, alternating with ours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

PROMPT = "The capital of France is"


def _timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited {proc.returncode}: {tail}")
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-bench-startup", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF file or built-in model name")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="warm runs (median)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--vs-llama-cpp", metavar="BIN_DIR", default=None)
    p.add_argument("--no-cold", action="store_true", help="skip the empty-cache run")
    args = p.parse_args(argv)
    if args.repetitions <= 0:
        p.error("-r must be positive")

    from picollama.models.registry import ModelNotFoundError, resolve_model_path

    try:
        model = str(resolve_model_path(args.model))
    except ModelNotFoundError as err:
        print(f"picollama-bench-startup: error: {err}", file=sys.stderr)
        return 1
    ours = [sys.executable, "-m", "picollama.tools.cli", "-m", model, "-p", PROMPT]
    ours += ["-n", "1", "-t", str(args.threads), "--temp", "0", "--no-display-prompt"]
    peer = None
    if args.vs_llama_cpp:
        exe = os.path.join(args.vs_llama_cpp, "llama-completion")
        if not os.access(exe, os.X_OK):
            print(f"picollama-bench-startup: error: no llama-completion in {args.vs_llama_cpp}")
            return 1
        peer = [exe, "-m", model, "-p", PROMPT, "-n", "1", "-t", str(args.threads)]
        peer += ["--temp", "0", "-no-cnv", "--no-warmup"]
    try:
        _timed(ours)  # fills the Numba cache (and the page cache) for the warm runs
        if peer:
            _timed(peer)
        warm, theirs = [], []
        for _ in range(args.repetitions):
            warm.append(_timed(ours))
            if peer:
                theirs.append(_timed(peer))
        cold = None
        if not args.no_cold:
            with tempfile.TemporaryDirectory() as empty:
                cold = _timed(ours, {**os.environ, "NUMBA_CACHE_DIR": empty})
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"picollama-bench-startup: error: {err}", file=sys.stderr)
        return 1
    w = statistics.median(warm)
    print(f"model {os.path.basename(model)}, prompt {PROMPT!r}, 1 token, -t {args.threads}")
    print(
        f"picollama-cli, warm Numba cache:  {w:6.2f} s to the first token (median of {len(warm)})"
    )
    if peer:
        t = statistics.median(theirs)
        print(f"llama-completion:                 {t:6.2f} s (median of {len(theirs)})")
        print(f"ratio picollama / llama.cpp:      {w / t:6.2f}x")
    if cold is not None:
        print(f"picollama-cli, empty Numba cache: {cold:6.2f} s: JIT compile time {cold - w:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
