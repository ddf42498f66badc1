"""ggml block formats: numpy reference ``dequantize`` and ``quantize`` for each quant type.

The API mirrors PyPI ``gguf.quants``::

    w = dequantize(raw_bytes, GGMLType.Q4_K)    # uint8 (..., n_bytes) -> float32 (..., n)
    raw = quantize(w, GGMLType.Q4_K)             # float (..., n) -> uint8, as llama.cpp writes

``dequantize`` matches ggml's ``dequantize_row_*`` bit for bit and ``quantize`` writes the
same bytes as ggml's ``quantize_row_*_ref`` (no importance matrix). These are references
for tests, conversion and tools; the backends' fused kernels are checked against them.
"""

from picollama.quant.base import (
    QUANT_TYPES,
    Quant,
    UnsupportedTypeError,
    dequantize,
    quant_class,
    quantize,
    supports,
)
from picollama.quant.floats import BF16, F16, F32
from picollama.quant.iquants import IQ4_NL, IQ4_XS
from picollama.quant.kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K
from picollama.quant.legacy import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1

__all__ = [
    "QUANT_TYPES",
    "Quant",
    "UnsupportedTypeError",
    "dequantize",
    "quantize",
    "quant_class",
    "supports",
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q8_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "IQ4_NL",
    "IQ4_XS",
]
