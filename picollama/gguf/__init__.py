"""GGUF files: constants, a validating zero-copy reader and a writer."""

from picollama.gguf.constants import (
    GGML_TYPES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLType,
    GGUFValueType,
    Keys,
    tensor_nbytes,
)
from picollama.gguf.errors import GGUFError, GGUFKeyError
from picollama.gguf.reader import GGUFReader, TensorInfo
from picollama.gguf.writer import GGUFWriter

__all__ = [
    "GGML_TYPES",
    "GGUF_DEFAULT_ALIGNMENT",
    "GGMLType",
    "GGUFValueType",
    "Keys",
    "tensor_nbytes",
    "GGUFError",
    "GGUFKeyError",
    "GGUFReader",
    "TensorInfo",
    "GGUFWriter",
]
