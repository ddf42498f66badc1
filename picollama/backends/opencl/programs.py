"""The OpenCL C sources of the backend, with the macros that specialize them per device.

``ops_source()`` is common.cl + ops.cl; ``quant_source(qtype, shape)`` is the per-type
program (common.cl + quant.cl) with the type's field sizes from the device layout, which
the OpenCL backend shares with the CUDA backend (``picollama.backends.cuda.layout``: pure
Python, the same field-major regrouping of the file's bytes). quant.cl refuses to compile
(``#error``) if the sizes passed in are not the ones its decoder reads.

``KernelShape`` is the work-group geometry of the matrix kernels, chosen per device:
- GPUs: 16 work-items per matvec row (neighbouring work-items read neighbouring chunks of
  a row), and the tiled gemm kernel for more than 8 tokens;
- CPUs: one work-item per matvec row (it walks the row in 8-wide vectors; PoCL maps
  work-items to loops, so a reduction through local memory would only cost), and no tiled
  gemm: the matvec kernel runs over groups of 16 tokens instead, which on PoCL is ~6x
  faster than the tiled kernel's local-memory loops (6-7 vs 1.1 GFLOPS on one core).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from picollama.backends.cuda.layout import FIELDS
from picollama.gguf.constants import GGMLType

__all__ = ["KernelShape", "kernel_shape", "ops_source", "quant_source", "build_options"]

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class KernelShape:
    mv_max_tokens: int = 8  # rows of x that take the matvec kernel; more go through gemm
    mv_wg: int = 64  # work-items of a matvec work-group
    mv_lpr: int = 16  # work-items per weight row in the matvec kernel (a power of two)
    gemm_m: int = 64  # weight rows of a gemm tile
    gemm_n: int = 32  # tokens of a gemm tile
    gemm_wm: int = 16  # work-items of a gemm work-group along rows ...
    gemm_wn: int = 8  # ... and along tokens
    tiled: bool = True  # more tokens: the gemm kernel (else the matvec over token groups)

    def defines(self) -> list[str]:
        return [
            f"#define MV_MAX_TOKENS {self.mv_max_tokens}",
            f"#define MV_WG {self.mv_wg}",
            f"#define MV_LPR {self.mv_lpr}",
            f"#define GEMM_M {self.gemm_m}",
            f"#define GEMM_N {self.gemm_n}",
            f"#define GEMM_WM {self.gemm_wm}",
            f"#define GEMM_WN {self.gemm_wn}",
        ]


def kernel_shape(is_cpu: bool, max_work_group: int, mv_lanes: int | None = None) -> KernelShape:
    """The matrix kernels' geometry for a device (``mv_lanes`` overrides work-items per row)."""
    lanes = mv_lanes if mv_lanes is not None else (1 if is_cpu else 16)
    if lanes < 1 or lanes & (lanes - 1) or lanes > 64:
        raise ValueError(f"mv_lanes must be a power of two from 1 to 64, got {lanes}")
    if is_cpu and lanes == 1:
        return KernelShape(mv_max_tokens=16, mv_wg=16, mv_lpr=1, tiled=False)
    mv_wg = max(64, lanes)
    if max_work_group >= 128:
        return KernelShape(mv_wg=mv_wg, mv_lpr=lanes)
    return KernelShape(mv_wg=mv_wg, mv_lpr=lanes, gemm_m=32, gemm_n=32, gemm_wm=8, gemm_wn=8)


@cache
def _read(name: str) -> str:
    return (_HERE / name).read_text()


def build_options(fp64: bool, fma: bool) -> list[str]:
    options = []
    if fp64:
        options.append("-DUSE_FP64")
    if fma:
        options.append("-DHAVE_FMA")
    return options


def ops_source() -> str:
    """OpenCL C of the non-matmul ops."""
    return _read("common.cl") + "\n" + _read("ops.cl")


def quant_source(qtype: GGMLType, shape: KernelShape) -> str:
    """OpenCL C of the matvec, gemm and get_rows kernels of ``qtype``."""
    qtype = GGMLType(qtype)
    block, fields = FIELDS[qtype]
    sizes = [size for _, size in fields] + [0] * (4 - len(fields))
    defines = [f"#define QTYPE_{qtype.name} 1", f"#define LAYOUT_BLOCK {block}"]
    defines += [f"#define LAYOUT_SZ{i} {size}" for i, size in enumerate(sizes)]
    defines += shape.defines()
    return "\n".join(defines) + "\n" + _read("common.cl") + "\n" + _read("quant.cl")
