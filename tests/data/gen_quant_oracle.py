"""Freeze llama.cpp's own quantize/dequantize output as test data for picollama.quant.

Usage::

    python tests/data/gen_quant_oracle.py PATH/TO/libggml-base.so [--out DIR] [--source TEXT]

It loads ggml's base library with ctypes and, for every type picollama.quant supports,
writes ``DIR/<TYPE>.npz`` (default DIR: ``quant/`` beside this script) holding

- ``quantized``: what ``quantize_row_<type>_ref`` (ggml-quants.c; ``ggml_fp32_to_fp16_row``
  and ``ggml_fp32_to_bf16_row_ref`` for F16/BF16) writes for each row of the shared inputs;
- ``blocks`` / ``dequantized``: random blocks (fp16 scale fields overwritten with random
  finite halves, so NaN/inf do not spoil comparisons) and what ``dequantize_row_<type>``
  makes of them. ggml has no ``dequantize_row_q8_1``: for Q8_1 the oracle is
  ``dequantize_row_q8_0`` applied to each block's (d, qs), the rule ggml's dot products use.

and ``DIR/inputs.npz`` with the float rows (fixed seed; a mix of kinds, see ``make_inputs``)
and their kind names. The tests read only these files.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant import QUANT_TYPES

SEED = 20251202
ROW = 512  # weights per row: 2 super-blocks of 256, 16 blocks of 32
RANDOM_WEIGHTS = 8192  # weights of random blocks per type for the dequantize oracle

# Byte offsets of each type's fp16 fields (scales, mins, sums) inside a block.
FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.F16: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q8_1: (0, 2),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}


def quantize_fns_data(n: int, offset: float, amplitude: float = 2.0) -> np.ndarray:
    """llama.cpp tests/test-quantize-fns.cpp ``generate_data``: 0.1 + amplitude*cosf(i + offset)."""
    i = np.arange(n, dtype=np.float32)
    c = np.cos(i + np.float32(offset)).astype(np.float32)
    return (0.1 + (np.float32(amplitude) * c).astype(np.float64)).astype(np.float32)


def make_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """128 rows of ROW floats: (kind name, row count, row maker)."""
    kinds = [
        ("gaussian", 16, lambda: rng.standard_normal(ROW) * 10.0 ** rng.uniform(-3, 2)),
        ("uniform", 16, lambda: rng.uniform(-1, 1, ROW)),
        ("outliers", 16, lambda: _outliers(rng)),
        ("zeros", 3, lambda: np.zeros(ROW)),
        ("negative_zeros", 1, lambda: np.full(ROW, -0.0)),
        ("tiny", 6, lambda: rng.standard_normal(ROW) * 1e-30),
        ("huge_range", 8, lambda: rng.standard_normal(ROW) * 10.0 ** rng.uniform(-6, 5, ROW)),
        ("cos", 16, lambda: quantize_fns_data(ROW, rng.uniform(0, 100))),
        ("constant", 4, lambda: np.full(ROW, rng.standard_normal())),
        ("ties", 8, lambda: rng.integers(-8, 9, ROW) * rng.choice([0.5, 1.0, 0.25])),
        ("half_steps", 4, lambda: _half_steps(rng)),
        ("sparse", 8, lambda: _sparse(rng)),
        ("positive", 6, lambda: np.abs(rng.standard_normal(ROW))),
        ("negative", 6, lambda: -np.abs(rng.standard_normal(ROW))),
        ("any_scale", 6, lambda: rng.standard_normal(ROW) * 10.0 ** rng.uniform(-12, 6)),
        # finite inputs whose squares and sums overflow float32 inside the quantizers
        ("near_float_max", 2, lambda: _near_float_max(rng)),
        ("any_exponent", 2, lambda: rng.standard_normal(ROW) * 10.0 ** rng.uniform(-40, 30, ROW)),
    ]
    rows, names = [], []
    for name, count, make in kinds:
        for _ in range(count):
            rows.append(np.asarray(make(), dtype=np.float32))
            names.append(name)
    return np.stack(rows), np.array(names)


def _outliers(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(ROW) * 0.02
    idx = rng.integers(0, ROW, ROW // 64)
    x[idx] *= 300
    return x


def _near_float_max(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(ROW)
    x[rng.integers(0, ROW, 6)] = rng.choice([-3e38, 3e38, 1e30], 6)
    return x


def _half_steps(rng: np.random.Generator) -> np.ndarray:
    """k + 0.5 with one +-127 per block of 32: Q8_0's d is 1, so every x/d is a rounding tie."""
    x = rng.integers(-127, 127, ROW) + 0.5
    x[np.arange(0, ROW, 32) + rng.integers(0, 32, ROW // 32)] = 127.0 * rng.choice([-1, 1])
    return x


def _sparse(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(ROW)
    zero = rng.random(ROW) < 0.7
    x[zero] = np.where(rng.random(zero.sum()) < 0.5, 0.0, -0.0)
    return x


def random_blocks(rng: np.random.Generator, qtype: GGMLType, n_blocks: int) -> np.ndarray:
    """Random bytes for ``n_blocks`` blocks, with finite fp16 (and Q8_K f32) fields."""
    info = GGML_TYPES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, info.type_size), dtype=np.uint8)
    for offset in FP16_FIELDS.get(qtype, ()):
        # every finite half, subnormals included: exponent field below 31, either sign
        halves = rng.integers(0, 0x7C00, n_blocks, dtype=np.uint16)
        halves |= rng.integers(0, 2, n_blocks, dtype=np.uint16) << 15
        blocks[:, offset : offset + 2] = halves.astype("<u2").reshape(-1, 1).view(np.uint8)
    if qtype == GGMLType.Q8_K:
        d = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 6, n_blocks)).astype("<f4")
        blocks[:, 0:4] = d.reshape(-1, 1).view(np.uint8)
    return blocks


class GGML:
    """The few entry points of libggml-base we call, each ``f(src, dst, n)``."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)

    def _call(self, name: str, src: np.ndarray, dst: np.ndarray, n: int) -> None:
        fn = getattr(self.lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn(src.ctypes.data, dst.ctypes.data, n)

    def quantize_row(self, qtype: GGMLType, x: np.ndarray) -> np.ndarray:
        info = GGML_TYPES[qtype]
        x = np.ascontiguousarray(x, dtype=np.float32)
        # zeroed: Q8_K leaves bsums of an all-zero block unwritten
        out = np.zeros(x.size // info.block_size * info.type_size, dtype=np.uint8)
        name = {
            GGMLType.F16: "ggml_fp32_to_fp16_row",
            GGMLType.BF16: "ggml_fp32_to_bf16_row_ref",
        }.get(qtype, f"quantize_row_{_c_name(qtype)}_ref")
        self._call(name, x, out, x.size)
        return out

    def dequantize(self, qtype: GGMLType, blocks: np.ndarray) -> np.ndarray:
        info = GGML_TYPES[qtype]
        n = blocks.shape[0] * info.block_size
        if qtype == GGMLType.Q8_1:
            qtype = GGMLType.Q8_0
            blocks = np.concatenate([blocks[:, 0:2], blocks[:, 4:36]], axis=1)
        src = np.ascontiguousarray(blocks)
        out = np.zeros(n, dtype=np.float32)
        name = {
            GGMLType.F16: "ggml_fp16_to_fp32_row",
            GGMLType.BF16: "ggml_bf16_to_fp32_row",
        }.get(qtype, f"dequantize_row_{_c_name(qtype)}")
        self._call(name, src, out, n)
        return out.reshape(-1, info.block_size)


def _c_name(qtype: GGMLType) -> str:
    """ggml's spelling in function names: q4_K, iq4_nl, q8_0."""
    return qtype.name.lower().replace("_k", "_K")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lib", help="path to llama.cpp's libggml-base.so")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "quant")
    parser.add_argument("--source", default="", help="what built the library (stored as text)")
    args = parser.parse_args(argv)

    ggml = GGML(args.lib)
    rng = np.random.default_rng(SEED)
    x, kinds = make_inputs(rng)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "inputs.npz", x=x, kinds=kinds, source=args.source)
    total = (args.out / "inputs.npz").stat().st_size
    for qtype in sorted(QUANT_TYPES):
        if qtype == GGMLType.F32:
            continue  # nothing to quantize: ggml copies the floats
        quantized = np.stack([ggml.quantize_row(qtype, row) for row in x])
        blocks = random_blocks(rng, qtype, RANDOM_WEIGHTS // GGML_TYPES[qtype].block_size)
        dequantized = ggml.dequantize(qtype, blocks)
        path = args.out / f"{qtype.name}.npz"
        np.savez_compressed(
            path, quantized=quantized, blocks=blocks, dequantized=dequantized, source=args.source
        )
        total += path.stat().st_size
        print(f"{path.name}: quantized {quantized.shape}, random blocks {blocks.shape}")
    print(f"{total / 2**20:.2f} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
