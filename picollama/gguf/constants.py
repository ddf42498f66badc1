"""GGUF and ggml format constants: value types, tensor types and their block layouts.

Format knowledge is data here. Numbers match ggml.h and gguf.h (llama.cpp, 2026), so a
file written by llama.cpp or by PyPI's ``gguf`` package reads back with the same meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "GGUF_MAGIC",
    "GGUF_DEFAULT_ALIGNMENT",
    "GGUF_SUPPORTED_VERSIONS",
    "GGML_MAX_DIMS",
    "GGUFValueType",
    "GGMLType",
    "TypeInfo",
    "GGML_TYPES",
    "QK_K",
    "type_info",
    "row_nbytes",
    "tensor_nbytes",
    "Keys",
]

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGUF_SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4

# Super-block size of the k-quants and of the i-quants.
QK_K = 256


class GGUFValueType(IntEnum):
    """Type tag of a metadata value (gguf.h ``enum gguf_type``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLType(IntEnum):
    """Tensor element type (ggml.h ``enum ggml_type``); gaps are ids ggml retired."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


@dataclass(frozen=True)
class TypeInfo:
    """Block layout of one ggml type: ``block_size`` weights stored in ``type_size`` bytes."""

    type: GGMLType
    block_size: int
    type_size: int

    @property
    def name(self) -> str:
        return self.type.name


def _t(ggml_type: GGMLType, block_size: int, type_size: int) -> TypeInfo:
    return TypeInfo(ggml_type, block_size, type_size)


# Block sizes written as the arithmetic of ggml's C block structs (ggml-common.h).
GGML_TYPES: dict[GGMLType, TypeInfo] = {
    info.type: info
    for info in (
        _t(GGMLType.F32, 1, 4),
        _t(GGMLType.F16, 1, 2),
        _t(GGMLType.BF16, 1, 2),
        _t(GGMLType.F64, 1, 8),
        _t(GGMLType.I8, 1, 1),
        _t(GGMLType.I16, 1, 2),
        _t(GGMLType.I32, 1, 4),
        _t(GGMLType.I64, 1, 8),
        _t(GGMLType.Q4_0, 32, 2 + 16),  # d, qs[16]
        _t(GGMLType.Q4_1, 32, 2 + 2 + 16),  # d, m, qs[16]
        _t(GGMLType.Q5_0, 32, 2 + 4 + 16),  # d, qh[4], qs[16]
        _t(GGMLType.Q5_1, 32, 2 + 2 + 4 + 16),  # d, m, qh[4], qs[16]
        _t(GGMLType.Q8_0, 32, 2 + 32),  # d, qs[32]
        _t(GGMLType.Q8_1, 32, 2 + 2 + 32),  # d, s, qs[32]
        _t(GGMLType.Q2_K, QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),  # d, dmin, scales, qs
        _t(GGMLType.Q3_K, QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),  # hmask, qs, scales, d
        _t(GGMLType.Q4_K, QK_K, 2 + 2 + 12 + QK_K // 2),  # d, dmin, scales[12], qs
        _t(GGMLType.Q5_K, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),  # d, dmin, sc, qh, qs
        _t(GGMLType.Q6_K, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # ql, qh, scales, d
        _t(GGMLType.Q8_K, QK_K, 4 + QK_K + QK_K // 16 * 2),  # d (f32), qs, bsums (i16)
        _t(GGMLType.IQ2_XXS, QK_K, 2 + QK_K // 8 * 2),
        _t(GGMLType.IQ2_XS, QK_K, 2 + QK_K // 8 * 2 + QK_K // 32),
        _t(GGMLType.IQ2_S, QK_K, 2 + QK_K // 4 + QK_K // 16),
        _t(GGMLType.IQ3_XXS, QK_K, 2 + 3 * (QK_K // 8)),
        _t(GGMLType.IQ3_S, QK_K, 2 + QK_K // 4 + QK_K // 32 + QK_K // 8 + QK_K // 64),
        _t(GGMLType.IQ1_S, QK_K, 2 + QK_K // 8 + QK_K // 16),
        _t(GGMLType.IQ1_M, QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
        _t(GGMLType.IQ4_NL, 32, 2 + 16),  # d, qs[16]
        _t(GGMLType.IQ4_XS, QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),  # d, scales_h, scales_l, qs
        _t(GGMLType.TQ1_0, QK_K, 2 + (QK_K - 4 * QK_K // 64) // 5 + QK_K // 64),  # d, qs, qh
        _t(GGMLType.TQ2_0, QK_K, 2 + QK_K // 4),
        _t(GGMLType.MXFP4, 32, 1 + 16),  # e (E8M0), qs[16]
        _t(GGMLType.NVFP4, 64, 4 + 32),  # 4 x d (UE4M3), qs[32]
        _t(GGMLType.Q1_0, 128, 2 + 128 // 8),
        _t(GGMLType.Q2_0, 64, 2 + 64 // 4),
    )
}


def type_info(ggml_type: int) -> TypeInfo:
    """The block layout of ``ggml_type``; raises ``KeyError`` for an id ggml does not define."""
    return GGML_TYPES[GGMLType(ggml_type)]


def row_nbytes(ggml_type: int, n: int) -> int:
    """Bytes taken by ``n`` consecutive weights of ``ggml_type`` (``n`` a multiple of the block)."""
    info = type_info(ggml_type)
    if n % info.block_size:
        raise ValueError(
            f"{n} weights is not a multiple of the {info.name} block of {info.block_size}"
        )
    return n // info.block_size * info.type_size


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of GGUF shape ``shape`` (``shape[0]`` is the contiguous row length)."""
    n_rows = 1
    for dim in shape[1:]:
        n_rows *= dim
    return row_nbytes(ggml_type, shape[0] if shape else 1) * n_rows


class Keys:
    """Metadata key names and templates (``{arch}`` is ``general.architecture``)."""

    GENERAL_ARCHITECTURE = "general.architecture"
    GENERAL_NAME = "general.name"
    GENERAL_ALIGNMENT = "general.alignment"
    GENERAL_FILE_TYPE = "general.file_type"
    GENERAL_TYPE = "general.type"
    GENERAL_QUANTIZATION_VERSION = "general.quantization_version"

    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    VOCAB_SIZE = "{arch}.vocab_size"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
    KEY_LENGTH = "{arch}.attention.key_length"
    VALUE_LENGTH = "{arch}.attention.value_length"
    LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
    SLIDING_WINDOW = "{arch}.attention.sliding_window"
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"
    ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
    ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"

    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
    TOKENIZER_SCORES = "tokenizer.ggml.scores"
    TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
    TOKENIZER_MERGES = "tokenizer.ggml.merges"
    TOKENIZER_BOS_ID = "tokenizer.ggml.bos_token_id"
    TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
    TOKENIZER_UNK_ID = "tokenizer.ggml.unknown_token_id"
    TOKENIZER_PAD_ID = "tokenizer.ggml.padding_token_id"
    TOKENIZER_ADD_BOS = "tokenizer.ggml.add_bos_token"
    TOKENIZER_ADD_EOS = "tokenizer.ggml.add_eos_token"
    TOKENIZER_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
    TOKENIZER_CHAT_TEMPLATE = "tokenizer.chat_template"
