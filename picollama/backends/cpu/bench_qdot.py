"""Benchmark qdot.matmul_q8: GB/s of weight bytes for matvec, GFLOP/s for prefill.

Usage::

    python -m picollama.backends.cpu.bench_qdot [--types Q4_1,Q8_0] [--threads N]

Weights are random bytes with finite fp16 scales; each shape is timed after a warm-up call
(compilation excluded), best of several runs.
"""

from __future__ import annotations

import argparse
import functools
import time

import numba
import numpy as np

from picollama.backends.cpu.qdot import SUPPORTED_TYPES, matmul_q8
from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = ["main"]

# (k, m) of the matvec shapes: SmolLM2-135M's and Gemma 3 270M's projections and, for Q8_0,
# SmolLM2's vocabulary; shapes whose k is not a multiple of the block are skipped ("-").
MATVEC_SHAPES = ((576, 1536), (1536, 576), (640, 2048), (2048, 640))
VOCAB_SHAPE = (576, 49152)
PREFILL_ROWS = (128, 512)
PREFILL_SHAPE = (1536, 576)  # k, m: k a multiple of every block
DEFAULT_TYPES = "Q4_1,Q8_0,Q5_0,Q4_K,Q6_K,Q4_0,Q5_1,Q2_K,Q3_K,Q5_K,IQ4_NL,IQ4_XS,F16,BF16,F32"


def random_weights(rng: np.random.Generator, qtype: GGMLType, m: int, k: int) -> np.ndarray:
    info = GGML_TYPES[qtype]
    nbytes = k // info.block_size * info.type_size
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        v = rng.standard_normal((m, k)).astype(np.float32)
        if qtype == GGMLType.F32:
            return v.view(np.uint8)
        if qtype == GGMLType.F16:
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    w = rng.integers(0, 256, (m, nbytes), dtype=np.uint8)
    # any finite fp16 is fine for timing: clear the exponent's top bit of every byte pair
    w[:, 1::2] &= 0xBF
    return w


def best_time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=DEFAULT_TYPES)
    parser.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"threads={args.threads}")
    for name in args.types.split(","):
        qtype = GGMLType[name]
        if qtype not in SUPPORTED_TYPES:
            print(f"{name}: not supported")
            continue
        shapes = MATVEC_SHAPES + ((VOCAB_SHAPE,) if qtype == GGMLType.Q8_0 else ())
        cells = []
        for k, m in shapes:
            if k % GGML_TYPES[qtype].block_size:
                cells.append(f"{k}x{m}    -    ")
                continue
            w = random_weights(rng, qtype, m, k)
            x = rng.standard_normal((1, k)).astype(np.float32)
            t = best_time(functools.partial(matmul_q8, x, w, qtype, k), 30 if m < 10000 else 5)
            cells.append(f"{k}x{m} {w.nbytes / t / 1e9:5.1f} GB/s")
        k, m = PREFILL_SHAPE
        w = random_weights(rng, qtype, m, k)
        for n in PREFILL_ROWS:
            x = rng.standard_normal((n, k)).astype(np.float32)
            t = best_time(functools.partial(matmul_q8, x, w, qtype, k), 3)
            cells.append(f"n={n} {2 * n * m * k / t / 1e9:5.1f} GFLOP/s")
        print(f"{name:7s} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
