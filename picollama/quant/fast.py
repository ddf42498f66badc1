"""Whole-tensor quantization as llama-quantize does it: ``quantize_rows``.

llama-quantize calls ggml's ``quantize_<type>`` functions, which without an importance
matrix are the ``quantize_row_<type>_ref`` references of :mod:`picollama.quant` for every
type but one: IQ4_NL, whose ``quantize_iq4_nl`` searches 15 scales per block (``ntry = 7``)
where ``quantize_row_iq4_nl_ref`` takes the first least-squares scale.
:func:`quantize_iq4_nl_search` is the numpy reference of that search.

The hot types have Numba kernels in :mod:`picollama.quant.fast_kernels`, run over rows on a
thread pool and byte-identical to the numpy references (the tests compare them on random data);
:func:`quantize_rows` picks the kernel, or the numpy reference where there is none.
"""

from __future__ import annotations

import os

import numpy as np

from picollama.gguf.constants import GGML_TYPES, GGMLType
from picollama.quant.base import fp32_to_fp16_bits, quantize
from picollama.quant.iquants import _iq4_sub_blocks, _pack_codes, best_index_int8

__all__ = ["quantize_rows", "quantize_rows_reference", "quantize_iq4_nl_search", "FAST_TYPES"]

_F32 = np.float32


def quantize_iq4_nl_search(x: np.ndarray) -> np.ndarray:
    """ggml's ``quantize_iq4_nl`` without an importance matrix: float32 (..., n) -> uint8.

    Per block of 32: the scale of ``quantize_row_iq4_nl_impl`` with ``ntry = 7`` (the best
    of 15 grids), stored as fp16, and codes chosen again against the unrounded scale.
    """
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    if n % 32:
        raise ValueError(f"{n} weights per row is not a multiple of the IQ4_NL block of 32")
    blocks = x.reshape(-1, 32)
    out = np.empty((blocks.shape[0], 18), dtype=np.uint8)
    step = 1 << 14
    with np.errstate(all="ignore"):
        for start in range(0, blocks.shape[0], step):
            xb = blocks[start : start + step]
            d, _, _ = _iq4_sub_blocks(np.ascontiguousarray(xb.T), ntry=7)
            inv_d = np.where(d != 0, _F32(1) / d, _F32(0))
            codes = best_index_int8(xb * inv_d[:, None])
            o = out[start : start + step]
            o[:, 0:2] = fp32_to_fp16_bits(d).reshape(-1, 1).view(np.uint8)
            o[:, 2:18] = _pack_codes(codes)
    return out.reshape(*x.shape[:-1], n // 32 * 18)


def quantize_rows_reference(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """The numpy reference of what llama-quantize writes for float32 rows ``x`` (2-D)."""
    if GGMLType(qtype) == GGMLType.IQ4_NL:
        return quantize_iq4_nl_search(x)
    return quantize(x, qtype)


def _kernels():
    # imported on first use: compiling (or loading cached) kernels takes a moment
    from picollama.quant import fast_kernels

    return fast_kernels


FAST_TYPES = frozenset(
    {
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
        GGMLType.IQ4_NL,
        GGMLType.IQ4_XS,
    }
)


def quantize_rows(
    x: np.ndarray, qtype: GGMLType, *, n_threads: int | None = None, reference: bool = False
) -> np.ndarray:
    """Quantize float32 rows ``x`` (n_rows, n_per_row) to ``qtype`` as llama-quantize does.

    Returns uint8 (n_rows, row_bytes). Uses the Numba kernel of ``qtype`` when there is one,
    on ``n_threads`` threads (optional, default: one per CPU), unless ``reference`` is true.
    """
    qtype = GGMLType(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize_rows takes 2-D rows, not shape {x.shape}")
    if reference or qtype not in FAST_TYPES:
        return quantize_rows_reference(x, qtype)
    info = GGML_TYPES[qtype]
    n_rows, n = x.shape
    if n % info.block_size:
        raise ValueError(
            f"{n} weights per row is not a multiple of the {qtype.name} block of {info.block_size}"
        )
    out = np.empty((n_rows, n // info.block_size * info.type_size), dtype=np.uint8)
    # Numba compiles once per array type, and read-only is a type of its own: always pass a
    # read-only view (as the rows of an mmap'd input are) so one compiled kernel serves all.
    x = x.view()
    x.flags.writeable = False
    if n_threads is None:
        n_threads = os.cpu_count() or 1
    _kernels().quantize_into(x, out, int(qtype), n_threads)
    return out
