"""Freeze ggml-cpu's activation quantization and vec_dot results as test data for qdot.

Usage::

    python tests/data/gen_qdot_oracle.py LIB_DIR [--out DIR]

LIB_DIR holds the peer's ``libggml-cpu.so`` (and the ``libggml-base.so`` it links). For each
weight type ``picollama.backends.cpu.qdot`` supports and each case of ``CASES`` it draws
random weights (random bytes; fp16 scale fields replaced by random finite halves of moderate
size) and random activations, and writes ``DIR/<TYPE>.npz`` (default DIR: ``qdot/`` beside
this script) with, per case ``c``:

- ``w{c}``: the weight bytes, uint8 (m, row_bytes); ``x{c}``: float32 (n, k);
- ``xq{c}``: what ``type_traits_cpu[vec_dot_type].from_float`` writes for each row of x;
- ``out{c}``: float32 (n, m), ``type_traits_cpu[type].vec_dot(k, ..., w[r], ..., xq[i], 1)``.

The tests read only these files.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

from picollama.backends.cpu.qdot import SUPPORTED_TYPES, vec_dot_type
from picollama.gguf.constants import GGML_TYPES, GGMLType

SEED = 20261020

# (blocks per row, m, n): k from one block to several, awkward m and n. The super-block
# types (256 weights a block) take fewer blocks in the largest case, to keep the files small.
CASES = ((1, 1, 1), (3, 7, 3), (5, 33, 70))
CASES_K = ((1, 1, 1), (3, 7, 3), (2, 33, 70))

# Byte offsets of each weight type's fp16 fields (scales, mins) inside a block.
FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}


class TypeTraitsCpu(ctypes.Structure):
    """ggml-cpu.h ``struct ggml_type_traits_cpu``."""

    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
)


def random_halves(rng: np.random.Generator, size: int) -> np.ndarray:
    """fp16 bit patterns of finite values of either sign, magnitude 1e-3 .. 1."""
    v = rng.uniform(0.5, 1.0, size) * 10.0 ** rng.uniform(-3, 0, size)
    v *= rng.choice([-1.0, 1.0], size)
    return v.astype(np.float16).view(np.uint16)


def random_weights(rng: np.random.Generator, qtype: GGMLType, m: int, k: int) -> np.ndarray:
    info = GGML_TYPES[qtype]
    if qtype == GGMLType.F32:
        return rng.standard_normal((m, k)).astype(np.float32).view(np.uint8)
    if qtype == GGMLType.F16:
        return rng.standard_normal((m, k)).astype(np.float16).view(np.uint8)
    if qtype == GGMLType.BF16:
        bits = rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    nb = k // info.block_size
    blocks = rng.integers(0, 256, (m, nb, info.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        blocks[:, :, off : off + 2] = random_halves(rng, m * nb).reshape(m, nb, 1).view(np.uint8)
    return blocks.reshape(m, -1)


def random_activations(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Rows of varied scale, with some exact zeros, ties and outliers."""
    x = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-2, 1, (n, 1))
    x[rng.random((n, k)) < 0.05] = 0.0
    ties = rng.random((n, k)) < 0.05
    x[ties] = rng.integers(-8, 9, ties.sum()) * 0.5
    x[rng.random((n, k)) < 0.01] *= 30.0
    if n > 2:
        x[1] = 0.0  # a zero row (all-zero blocks)
    return x.astype(np.float32)


def row_bytes(qtype: GGMLType, k: int) -> int:
    info = GGML_TYPES[qtype]
    return k // info.block_size * info.type_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lib_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "qdot")
    args = parser.parse_args(argv)

    ctypes.CDLL(str(args.lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(args.lib_dir / "libggml-cpu.so"))
    lib.ggml_cpu_init()
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]

    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for qtype in sorted(SUPPORTED_TYPES):
        vtype = vec_dot_type(qtype)
        traits = lib.ggml_get_type_traits_cpu(int(qtype)).contents
        assert traits.vec_dot_type == int(vtype), (qtype, traits.vec_dot_type)
        vec_dot = VEC_DOT(traits.vec_dot)
        from_float = FROM_FLOAT(lib.ggml_get_type_traits_cpu(int(vtype)).contents.from_float)
        block = max(GGML_TYPES[qtype].block_size, 32)
        data = {}
        cases = CASES_K if GGML_TYPES[qtype].block_size == 256 else CASES
        for c, (n_blocks, m, n) in enumerate(cases):
            k = n_blocks * block
            if qtype in (GGMLType.F16, GGMLType.BF16, GGMLType.F32):
                k = n_blocks * 37  # float types take any k
            w = random_weights(rng, qtype, m, k)
            x = random_activations(rng, n, k)
            xq = np.zeros((n, row_bytes(vtype, k)), np.uint8)
            for i in range(n):
                from_float(x[i].ctypes.data, xq[i].ctypes.data, k)
            out = np.zeros((n, m), np.float32)
            s = ctypes.c_float()
            for i in range(n):
                for r in range(m):
                    vec_dot(k, ctypes.addressof(s), 0, w[r].ctypes.data, 0, xq[i].ctypes.data, 0, 1)
                    out[i, r] = s.value
            data.update({f"w{c}": w, f"x{c}": x, f"xq{c}": xq, f"out{c}": out})
        np.savez_compressed(args.out / f"{qtype.name}.npz", **data)
        print(f"{qtype.name}: {len(cases)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
