"""Throughput of the CPU kernels: ``python -m picollama.backends.cpu.bench_kernels``.

Decode is memory-bound, so matrix-vector products are reported as GB/s of weight bytes
streamed, beside the machine's read bandwidth (a large numpy sum) as the ceiling. Prefill
is compute-bound and reported as GFLOP/s (2 flops a multiply-add). Weights are random
blocks of each type; the first call of each type compiles (or loads) its kernels and is
not timed; a figure is the best of several rounds.

The load average is printed first: on a machine busier than its core count, figures for
more than one thread say little, as each parallel region waits until every one of its
threads gets a core.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import numba
import numpy as np

from picollama.backends.cpu.kernels import SUPPORTED_TYPES, matmul
from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = ["main"]

DEFAULT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
# (m, k): output features, input features
MATVEC_SHAPES = ((576, 576), (1536, 576), (576, 1536), (2048, 2048), (4096, 4096))
PREFILL_SHAPE = (2048, 2048)
PREFILL_ROWS = (64, 128, 512)
# one layer of a SmolLM2-135M-like model (hidden 576, 3 KV heads of 64, FFN 1536): the
# attention q, k, v, o and the FFN gate, up, down matrices, as (m, k)
LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
N_LAYERS = 30


def random_weights(rng: np.random.Generator, qtype: GGMLType, m: int, k: int) -> np.ndarray:
    """Random blocks of ``qtype``, every f16 (or f32) scale finite: bytes of real quants."""
    if qtype == GGMLType.F32:
        return rng.standard_normal((m, k), dtype=np.float32).view(np.uint8)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        return rng.integers(0, 0x3C00, (m, k), dtype=np.uint16).view(np.uint8)
    info = GGML_TYPES[qtype]
    blocks = rng.integers(0, 256, (m, k // info.block_size, info.type_size), dtype=np.uint8)
    # clearing bit 6 of every byte caps any f16 read from the block below 2.0 (and any f32,
    # for Q8_K's scale): finite scales wherever the layout puts them
    blocks &= 0xBF
    return blocks.reshape(m, -1)


def round_k(qtype: GGMLType, k: int) -> int:
    """``k`` rounded up to a whole number of ``qtype`` blocks (576 is 768 for the k-quants)."""
    block = GGML_TYPES[qtype].block_size
    return -(-k // block) * block


def best_seconds(fn: Callable[[], object], min_time: float = 0.2, repeats: int = 5) -> float:
    """Best time of one call over ``repeats`` rounds of enough calls to last ``min_time``."""
    fn()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - t0 >= min_time / repeats or calls >= 1 << 16:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def read_bandwidth() -> float:
    """GB/s of a 256 MiB numpy sum: the memory read ceiling of one thread."""
    a = np.ones(32 << 20, dtype=np.float64)
    return a.nbytes / best_seconds(a.sum, repeats=3) / 1e9


def bench_matvec(qtype: GGMLType, rng: np.random.Generator) -> list[float]:
    rates = []
    for m, k in MATVEC_SHAPES:
        k = round_k(qtype, k)
        w = random_weights(rng, qtype, m, k)
        x = rng.standard_normal((1, k), dtype=np.float32)
        out = np.empty((1, m), dtype=np.float32)
        rates.append(w.nbytes / best_seconds(functools.partial(matmul, x, w, qtype, k, out)) / 1e9)
    return rates


def bench_layers(qtype: GGMLType, rng: np.random.Generator) -> tuple[float, float]:
    """(GB/s, ms) of one decode step's matrix-vector products over N_LAYERS layers."""
    shapes = [(m, round_k(qtype, k)) for m, k in LAYER]
    layers = [[random_weights(rng, qtype, m, k) for m, k in shapes] for _ in range(N_LAYERS)]
    xs = {k: rng.standard_normal((1, k), dtype=np.float32) for _, k in shapes}
    nbytes = sum(w.nbytes for layer in layers for w in layer)

    def step():
        for layer in layers:
            for (_, k), w in zip(shapes, layer, strict=True):
                matmul(xs[k], w, qtype, k)

    seconds = best_seconds(step, min_time=1.0)
    return nbytes / seconds / 1e9, seconds * 1e3


def bench_prefill(qtype: GGMLType, rng: np.random.Generator) -> list[float]:
    m, k = PREFILL_SHAPE
    w = random_weights(rng, qtype, m, k)
    rates = []
    for n in PREFILL_ROWS:
        x = rng.standard_normal((n, k), dtype=np.float32)
        seconds = best_seconds(functools.partial(matmul, x, w, qtype, k), min_time=0.5, repeats=3)
        rates.append(2 * n * m * k / seconds / 1e9)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-t", "--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    parser.add_argument(
        "--types", nargs="+", default=list(DEFAULT_TYPES), help="ggml type names, or 'all'"
    )
    parser.add_argument("--no-layers", action="store_true", help="skip the 30-layer loop")
    parser.add_argument("--no-prefill", action="store_true", help="skip prefill")
    args = parser.parse_args(argv)
    names = [t.name for t in sorted(SUPPORTED_TYPES)] if args.types == ["all"] else args.types
    try:
        qtypes = [GGMLType[name.upper()] for name in names]
    except KeyError as e:
        parser.error(f"unknown type {e}")
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"threads: {numba.get_num_threads()} (load average {load:.1f}, {os.cpu_count()} cores);"
        f" read bandwidth (1 thread, numpy sum): {read_bandwidth():.1f} GB/s"
    )
    print("\nmatrix-vector, GB/s of weights (m x k; k rounded up to whole blocks):")
    print("type    " + "".join(f"{f'{m}x{k}':>11}" for m, k in MATVEC_SHAPES))
    for qtype in qtypes:
        rates = bench_matvec(qtype, rng)
        print(f"{qtype.name:8s}" + "".join(f"{r:11.2f}" for r in rates), flush=True)

    if not args.no_layers:
        print(f"\n{N_LAYERS} layers of {len(LAYER)} matrix-vector products (a decode step):")
        for qtype in qtypes:
            rate, ms = bench_layers(qtype, rng)
            print(f"{qtype.name:8s}{rate:8.2f} GB/s {ms:8.2f} ms/step", flush=True)

    if not args.no_prefill:
        m, k = PREFILL_SHAPE
        print(f"\nprefill {m}x{k}, GFLOP/s for n rows of x:")
        print("type    " + "".join(f"{f'n={n}':>9}" for n in PREFILL_ROWS))
        for qtype in qtypes:
            rates = bench_prefill(qtype, rng)
            print(f"{qtype.name:8s}" + "".join(f"{r:9.1f}" for r in rates), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
