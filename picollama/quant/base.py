"""The quant type registry, the public ``dequantize``/``quantize``, and ggml's scalar helpers.

Each quant type is one subclass of :class:`Quant`, registered by naming its ``qtype``; it works
on whole blocks: ``dequantize_blocks`` maps ``(n_blocks, type_size)`` uint8 to
``(n_blocks, block_size)`` float32 and ``quantize_blocks`` goes back. The functions here
validate shapes, split big arrays into chunks of blocks (so temporaries stay cache-sized) and
pick the class.

Quantizers reproduce ggml's ``quantize_row_*_ref`` byte for byte. That means doing the
arithmetic in float32 in the order the C does it (never float64, never numpy's pairwise
sums), rounding the way the C rounds (``nearest_int`` is round-half-even through a float
trick, ``roundf`` is half away from zero) and converting to fp16 with round-to-nearest-even.
The ggml-base library these were checked against is built without FMA, so products are
never fused with sums.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = [
    "Quant",
    "QUANT_TYPES",
    "UnsupportedTypeError",
    "dequantize",
    "quantize",
    "supports",
    "quant_class",
    "fp16_to_fp32",
    "fp32_to_fp16_bits",
    "nearest_int",
    "roundf",
    "seq_sum",
    "first_absmax",
    "first_min_max",
    "GROUP_MAX_EPS",
]

# Weights per chunk: big enough to amortize numpy's per-call cost, small enough that the
# few float32 temporaries of a chunk (2 MiB each) stay in cache.
_CHUNK_WEIGHTS = 1 << 19

_REGISTRY: dict[GGMLType, type[Quant]] = {}

# The set of types this package can (de)quantize; filled as the type modules are imported.
QUANT_TYPES: set[GGMLType] = set()


class UnsupportedTypeError(ValueError):
    """A ggml type that picollama.quant cannot (de)quantize (IQ2_XXS, TQ1_0, MXFP4, ...)."""


class Quant:
    """One ggml quant type. Subclass with ``qtype=GGMLType.X`` to register it.

    Subclasses implement the two classmethods over whole blocks; they are never instantiated.
    """

    qtype: ClassVar[GGMLType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, *, qtype: GGMLType, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        info = GGML_TYPES[qtype]
        cls.qtype = qtype
        cls.block_size = info.block_size
        cls.type_size = info.type_size
        assert qtype not in _REGISTRY, f"{qtype.name} registered twice"
        _REGISTRY[qtype] = cls
        QUANT_TYPES.add(qtype)

    def __new__(cls, *args, **kwargs):
        raise TypeError(f"{cls.__name__} is a namespace of classmethods; do not instantiate it")

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``(n_blocks, type_size)`` uint8 -> ``(n_blocks, block_size)`` float32.

        ``out`` (optional, default: a new array) receives the result.
        """
        raise NotImplementedError

    @classmethod
    def quantize_blocks(cls, x_blocks: np.ndarray) -> np.ndarray:
        """``(n_blocks, block_size)`` float32 -> ``(n_blocks, type_size)`` uint8."""
        raise NotImplementedError


def _ggml_type(qtype) -> GGMLType | None:
    try:
        return GGMLType(int(qtype))
    except (TypeError, ValueError):
        return None


def _type_name(qtype) -> str:
    ggml_type = _ggml_type(qtype)
    if ggml_type is None:
        return f"{qtype!r} (not a ggml type id)"
    return f"{ggml_type.name} (id {int(ggml_type)})"


def _where(what: str | None) -> str:
    return f"{what}: " if what else ""


def quant_class(qtype, *, what: str | None = None) -> type[Quant]:
    """The registered class of ``qtype``; raises :class:`UnsupportedTypeError` otherwise."""
    quant = _REGISTRY.get(_ggml_type(qtype))
    if quant is None:
        raise UnsupportedTypeError(
            f"{_where(what)}ggml type {_type_name(qtype)} is not supported by picollama.quant "
            f"(supported: {', '.join(t.name for t in sorted(QUANT_TYPES))})"
        )
    return quant


def supports(qtype) -> bool:
    """Whether :func:`dequantize` and :func:`quantize` handle ``qtype``."""
    return _ggml_type(qtype) in _REGISTRY


def dequantize(data: np.ndarray, qtype, *, what: str | None = None) -> np.ndarray:
    """Decode ``data`` (uint8, last axis bytes) of ggml type ``qtype`` to float32.

    The result keeps the leading axes; its last axis holds the weights. ``data`` may be a
    read-only view (say, into an mmap); a contiguous one is read in place. For F32 the result
    is a view of ``data`` itself, every other type gives a new array. ``what`` (optional,
    default: none) names the tensor in error messages.
    """
    quant = quant_class(qtype, what=what)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise TypeError(f"{_where(what)}dequantize takes uint8 bytes, not {data.dtype}")
    if data.ndim == 0:
        raise ValueError(f"{_where(what)}dequantize needs at least one axis of bytes")
    n_bytes = data.shape[-1]
    if n_bytes % quant.type_size:
        raise ValueError(
            f"{_where(what)}{n_bytes} bytes per row is not a multiple of the "
            f"{quant.qtype.name} block size of {quant.type_size} bytes"
        )
    out_shape = (*data.shape[:-1], n_bytes // quant.type_size * quant.block_size)
    blocks = data.reshape(-1, quant.type_size)  # a view unless data is not contiguous
    if quant.qtype == GGMLType.F32:
        return blocks.view(np.float32).reshape(out_shape)
    out = np.empty((blocks.shape[0], quant.block_size), dtype=np.float32)
    step = max(1, _CHUNK_WEIGHTS // quant.block_size)
    # inf and NaN scales are data here, decoded as the C decodes them, not a numpy error
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], step):
            quant.dequantize_blocks(blocks[start : start + step], out=out[start : start + step])
    return out.reshape(out_shape)


def quantize(x: np.ndarray, qtype, *, what: str | None = None) -> np.ndarray:
    """Encode float weights ``x`` (last axis a multiple of the block size) as ggml ``qtype``.

    Returns uint8 with the leading axes of ``x`` and a last axis of bytes, identical to what
    ggml's ``quantize_row_*_ref`` writes (no importance matrix). ``what`` (optional, default:
    none) names the tensor in error messages.
    """
    quant = quant_class(qtype, what=what)
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"{_where(what)}quantize needs at least one axis of weights")
    n = x.shape[-1]
    if n % quant.block_size:
        raise ValueError(
            f"{_where(what)}{n} weights per row is not a multiple of the "
            f"{quant.qtype.name} block size of {quant.block_size} weights"
        )
    out_shape = (*x.shape[:-1], n // quant.block_size * quant.type_size)
    x_blocks = x.reshape(-1, quant.block_size)
    out = np.empty((x_blocks.shape[0], quant.type_size), dtype=np.uint8)
    # Quantizers keep a dozen temporaries per weight; smaller chunks keep them in cache.
    step = max(1, (_CHUNK_WEIGHTS // 8) // quant.block_size)
    # Extreme inputs overflow float32 inside the searches exactly as they do in the C, whose
    # comparisons then pass over the NaNs; that is data, not a numpy error.
    with np.errstate(all="ignore"):
        for start in range(0, x_blocks.shape[0], step):
            chunk = x_blocks[start : start + step].astype(np.float32)
            out[start : start + step] = quant.quantize_blocks(chunk)
    return out.reshape(out_shape)


# ---------------------------------------------------------------- ggml's scalar helpers


def fp16_to_fp32(raw: np.ndarray) -> np.ndarray:
    """fp16 fields, given as uint8 with a last axis of 2 bytes, to float32 (exact)."""
    return raw.view("<f2")[..., 0].astype(np.float32)


def fp32_to_fp16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's ``GGML_FP32_TO_FP16``: round to nearest even; every NaN becomes 0x7E00 | sign."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = x.astype("<f2").view("<u2")
    nan = np.isnan(x)
    if nan.any():
        sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        bits = np.where(nan, sign | np.uint16(0x7E00), bits)
    return bits


# ggml-quants.c: a group of weights whose largest magnitude is below this counts as all zero
GROUP_MAX_EPS = np.float32(1e-15)

_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it leaves the rounded integer in the mantissa


def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``, bit for bit (round half to even for |f| < 2**22), as int32.

    It is the float trick itself, not ``np.rint``, so out-of-range, inf and NaN inputs give
    the same (meaningless) integers as the C.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        bits = (np.asarray(f, dtype=np.float32) + _MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` (half away from zero) of float32 ``v``, as float64.

    In float64 ``|v| + 0.5`` is exact, so 0.49999997 does not round up as it would in float32.
    """
    v = np.asarray(v, dtype=np.float32)
    return np.copysign(np.floor(np.abs(v).astype(np.float64) + 0.5), v)


def seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum over axis 0 one term at a time from +0.0, as C's ``float s = 0; s += t[i];`` does.

    ``np.sum`` promises no order (along a contiguous axis it adds pairwise), and float32
    sums in another order round differently.
    """
    total = np.zeros(terms.shape[1:], dtype=np.float32)
    for t in terms:
        total += t
    return total


def first_absmax(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``(amax, max)`` along ``axis``, as ggml's ``if (fabsf(v) > amax) {amax = ..; max = v;}``.

    ``max`` is the signed value of the first element of largest magnitude, and 0 when all are
    zero (the C starts from ``amax = max = 0`` and never takes a zero, not even -0.0). A NaN
    never wins a ``>``, so NaNs (say, from a sum that overflowed) are passed over.
    """
    ax = np.abs(x)
    ax[np.isnan(ax)] = 0
    idx = np.expand_dims(np.argmax(ax, axis=axis), axis)
    amax = np.take_along_axis(ax, idx, axis=axis).squeeze(axis)
    vmax = np.take_along_axis(x, idx, axis=axis).squeeze(axis)
    vmax = np.where(amax > 0, vmax, np.float32(0.0))
    return amax, vmax


def first_min_max(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``(min, max)`` along ``axis`` as the C scan ``if (v < min) min = v; if (v > max) ...``
    from the first element: the first of a -0.0/+0.0 tie wins, NaNs after the first element
    are passed over (a NaN first element stays, as nothing compares below it).
    """
    finite = np.where(np.isnan(x), np.float32(np.inf), x)
    vmin = np.take_along_axis(x, np.expand_dims(np.argmin(finite, axis=axis), axis), axis)
    finite = np.where(np.isnan(x), np.float32(-np.inf), x)
    vmax = np.take_along_axis(x, np.expand_dims(np.argmax(finite, axis=axis), axis), axis)
    first = np.take(x, [0], axis=axis)
    vmin = np.where(np.isnan(first), first, vmin).squeeze(axis)
    vmax = np.where(np.isnan(first), first, vmax).squeeze(axis)
    return vmin, vmax
