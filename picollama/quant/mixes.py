"""llama.cpp's quantization mixes: which ggml type each tensor of a model gets.

A port of ``llama_tensor_get_type`` and its helpers in llama.cpp's ``src/llama-quant.cpp``
(``tensor_allows_quantization``, ``tensor_get_category``, ``llama_tensor_get_type_impl``,
``tensor_type_fallback``, ``llama_ftype_get_default_type``), for the file types picollama
can write. Everything here is a pure function of tensor names, shapes and a few
hyper-parameters; :func:`plan_types` walks the tensors in the order llama-quantize writes
them (:func:`llama_tensor_order`), because two of the rules count tensors as they go.

Usage::

    ftype = parse_ftype("Q4_K_M")
    model = ModelParams.from_metadata(reader.metadata)
    plan = plan_types([(t.name, t.shape, t.type) for t in tensors], model, QuantizeParams(ftype))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

import numpy as np

from picollama.gguf.constants import GGML_TYPES, GGMLType

__all__ = [
    "LlamaFType",
    "FTYPE_ALIASES",
    "SUPPORTED_FTYPES",
    "Category",
    "ModelParams",
    "QuantizeParams",
    "TensorChoice",
    "MixError",
    "parse_ftype",
    "parse_ggml_type",
    "default_type",
    "tensor_category",
    "allows_quantization",
    "use_more_bits",
    "llama_tensor_order",
    "plan_types",
]

T = GGMLType


class MixError(ValueError):
    """A file type, tensor type or model that a mix cannot be planned for."""


class LlamaFType(IntEnum):
    """llama.h ``enum llama_ftype``: the value written as ``general.file_type``."""

    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ4_XS = 30
    MOSTLY_BF16 = 32

    @property
    def label(self) -> str:
        """The name llama-quantize takes on its command line (``Q4_K_M``, ``F16``, ``F32``)."""
        return "F32" if self == LlamaFType.ALL_F32 else self.name.removeprefix("MOSTLY_")


F = LlamaFType

# llama_ftype_get_default_type, for the file types above
_DEFAULT_TYPES: dict[LlamaFType, GGMLType] = {
    F.ALL_F32: T.F32,
    F.MOSTLY_F16: T.F16,
    F.MOSTLY_BF16: T.BF16,
    F.MOSTLY_Q4_0: T.Q4_0,
    F.MOSTLY_Q4_1: T.Q4_1,
    F.MOSTLY_Q5_0: T.Q5_0,
    F.MOSTLY_Q5_1: T.Q5_1,
    F.MOSTLY_Q8_0: T.Q8_0,
    F.MOSTLY_Q2_K: T.Q2_K,
    F.MOSTLY_Q3_K_S: T.Q3_K,
    F.MOSTLY_Q3_K_M: T.Q3_K,
    F.MOSTLY_Q3_K_L: T.Q3_K,
    F.MOSTLY_Q4_K_S: T.Q4_K,
    F.MOSTLY_Q4_K_M: T.Q4_K,
    F.MOSTLY_Q5_K_S: T.Q5_K,
    F.MOSTLY_Q5_K_M: T.Q5_K,
    F.MOSTLY_Q6_K: T.Q6_K,
    F.MOSTLY_IQ4_NL: T.IQ4_NL,
    F.MOSTLY_IQ4_XS: T.IQ4_XS,
}

SUPPORTED_FTYPES: tuple[LlamaFType, ...] = tuple(_DEFAULT_TYPES)

# llama-quantize's aliases: a k-quant without a size letter is its _M mix
FTYPE_ALIASES: dict[str, LlamaFType] = {
    "Q3_K": F.MOSTLY_Q3_K_M,
    "Q4_K": F.MOSTLY_Q4_K_M,
    "Q5_K": F.MOSTLY_Q5_K_M,
}

# Types a tensor may be given with --output-tensor-type / --token-embedding-type: those
# picollama can write.
_WRITABLE_TYPES = (
    T.F32,
    T.F16,
    T.BF16,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q8_0,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.IQ4_NL,
    T.IQ4_XS,
)

# Float and integer types: ggml_is_quantized is false for them.
_NOT_QUANTIZED = {T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64}


def is_quantized(ggml_type: GGMLType) -> bool:
    """ggml's ``ggml_is_quantized``."""
    return ggml_type not in _NOT_QUANTIZED


def parse_ftype(text: str) -> LlamaFType:
    """A file type from llama-quantize's TYPE argument: a name (any case) or its number."""
    s = text.strip()
    if s.isdigit():
        try:
            ftype = LlamaFType(int(s))
        except ValueError:
            ftype = None
        if ftype is not None and ftype in _DEFAULT_TYPES:
            return ftype
    else:
        upper = s.upper()
        if upper in FTYPE_ALIASES:
            return FTYPE_ALIASES[upper]
        for ftype in SUPPORTED_FTYPES:
            if ftype.label == upper:
                return ftype
    names = ", ".join(f.label for f in SUPPORTED_FTYPES)
    raise MixError(f"unknown quantization type {text!r} (supported: {names})")


def parse_ggml_type(text: str) -> GGMLType:
    """A tensor type for --output-tensor-type / --token-embedding-type (``q8_0``, ``Q6_K``)."""
    upper = text.strip().upper()
    for ggml_type in _WRITABLE_TYPES:
        if ggml_type.name == upper:
            return ggml_type
    names = ", ".join(t.name for t in _WRITABLE_TYPES)
    raise MixError(f"unknown tensor type {text!r} (supported: {names})")


def default_type(ftype: LlamaFType) -> GGMLType:
    """``llama_ftype_get_default_type``: the type most tensors of a file type get."""
    return _DEFAULT_TYPES[LlamaFType(ftype)]


# ------------------------------------------------------------------------ tensor names


class Category(Enum):
    """llama-quant.cpp's ``tensor_category``: broad roles, found by name."""

    TOKEN_EMBD = "token_embd"
    ATTENTION_Q = "attn_q"
    ATTENTION_V = "attn_v"
    ATTENTION_K = "attn_k"
    ATTENTION_QKV = "attn_qkv"
    ATTENTION_KV_B = "attn_kv_b"
    ATTENTION_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OUTPUT = "output"
    OTHER = "other"


C = Category

# Substring tests in the order the C tries them (the first match wins).
_CATEGORY_SUBSTRINGS: tuple[tuple[str, Category], ...] = (
    ("attn_qkv.weight", C.ATTENTION_QKV),
    ("attn_kv_b.weight", C.ATTENTION_KV_B),
    ("attn_v.weight", C.ATTENTION_V),
    ("attn_k.weight", C.ATTENTION_K),
    ("attn_q.weight", C.ATTENTION_Q),
    ("attn_output.weight", C.ATTENTION_OUTPUT),
    ("ffn_up", C.FFN_UP),
    ("ffn_gate", C.FFN_GATE),
    ("ffn_down", C.FFN_DOWN),
)

_ATTN_V_LIKE = {C.ATTENTION_V, C.ATTENTION_QKV, C.ATTENTION_KV_B}


def tensor_category(name: str) -> Category:
    """``tensor_get_category``."""
    if name == "output.weight":
        return C.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return C.TOKEN_EMBD
    for substring, category in _CATEGORY_SUBSTRINGS:
        if substring in name:
            return category
    return C.OTHER


# Substrings of tensors that are never quantized (tensor_allows_quantization), beside norms,
# 1-D tensors and names that do not end in "weight".
_KEEP_SUBSTRINGS = (
    "_norm.weight",
    "ffn_gate_inp.weight",  # expert gating
    "ffn_gate_tid2eid.weight",  # an i32 routing table
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
# BERT's positional embeddings and token types (LLM_TENSOR_POS_EMBD, LLM_TENSOR_TOKEN_TYPES)
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")


def n_dims(shape: Sequence[int]) -> int:
    """``ggml_n_dims``: dimensions up to the last one that is not 1 (at least 1)."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] != 1:
            return i + 1
    return 1


def allows_quantization(name: str, shape: Sequence[int], quantize_output_tensor: bool) -> bool:
    """``tensor_allows_quantization``: 2-D and larger weights, except norms and a list of
    small or special tensors; ``output.weight`` only when ``quantize_output_tensor``."""
    if n_dims(shape) < 2:
        return False
    # The C tests name.rfind("weight") == name.size() - 6 with unsigned arithmetic; Python's
    # -1 for "not found" and len - 6 agree with it on every length.
    if name.rfind("weight") != len(name) - 6:
        return False
    if any(s in name for s in _KEEP_SUBSTRINGS):
        return False
    if not quantize_output_tensor and name == "output.weight":
        return False
    return name not in _KEEP_NAMES


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers a ``_M`` mix gives more bits: the first and last eighth, and every third
    layer in between."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or _c_mod(i_layer - n_layers // 8, 3) == 2
    )


def _c_mod(a: int, b: int) -> int:
    """C's ``%`` (truncating), not Python's (flooring)."""
    r = abs(a) % abs(b)
    return -r if a < 0 else r


def _c_div(a: int, b: int) -> int:
    """C's integer ``/`` (truncating)."""
    q = abs(a) // abs(b)
    return -q if (a < 0) != (b < 0) else q


def _layer_of(name: str) -> int:
    """``sscanf(name, "blk.%d.", &layer)``; -1 when the name does not start that way."""
    m = re.match(r"blk\.([+-]?\d+)\.", name)
    return int(m.group(1)) if m else -1


def llama_tensor_order(names: Iterable[str]) -> list[str]:
    """The order llama-quantize writes tensors in (llama_model_loader's ``weights_map``):
    tensors outside the blocks first, then by block number, each group by name.

    The comparison is on the names' bytes (``std::string`` compares ``char``s as unsigned),
    which for UTF-8 is the order of the code points.
    """
    return sorted(names, key=lambda name: (_layer_of(name), name))


# ------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class ModelParams:
    """The hyper-parameters the mixes look at (llama_hparams and llm_type)."""

    arch: str
    n_layer: int  # hparams.n_layer_all: {arch}.block_count
    n_head: int = 0  # of layer 0
    n_head_kv: int = 0  # of layer 0
    n_expert: int = 0
    is_70b: bool = False  # LLM_TYPE_70B

    @property
    def n_gqa(self) -> int:
        """``hparams.n_gqa()``: query heads per KV head (0 without KV heads)."""
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ModelParams:
        """Read ``general.architecture`` and ``{arch}.*`` counts the way llama.cpp's loader
        does: a per-layer array counts its first element, a missing KV head count is the
        head count, a missing expert count is 0."""
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise MixError("the file has no general.architecture string")

        def count(key: str, default: int | None) -> int:
            value = metadata.get(f"{arch}.{key}")
            if value is None:
                if default is None:
                    raise MixError(f"the file has no {arch}.{key}")
                return default
            if not isinstance(value, int) and not isinstance(value, str):
                try:  # a per-layer array: llama.cpp's loader reads layer 0's value here
                    value = value[0] if len(value) else 0
                except TypeError:
                    pass
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise MixError(f"{arch}.{key} is not an integer: {str(value)[:40]!r}")
            value = int(value)
            if value < 0 or value >= 1 << 31:
                raise MixError(f"{arch}.{key} = {value} is out of range")
            return value

        n_layer = count("block_count", None)
        n_head = count("attention.head_count", 0)
        n_head_kv = count("attention.head_count_kv", n_head)
        n_expert = count("expert_count", 0)
        # llama_model::load_hparams: an 80-layer llama with grouped-query attention is 70B
        is_70b = arch == "llama" and n_layer == 80 and n_head != n_head_kv
        return cls(arch, n_layer, n_head, n_head_kv, n_expert, is_70b)


@dataclass(frozen=True)
class QuantizeParams:
    """The llama_model_quantize_params the mixes read."""

    ftype: LlamaFType
    output_tensor_type: GGMLType | None = None  # --output-tensor-type
    token_embedding_type: GGMLType | None = None  # --token-embedding-type
    pure: bool = False  # --pure
    quantize_output_tensor: bool = True  # False with --leave-output-tensor


@dataclass(frozen=True)
class TensorChoice:
    """What a tensor becomes: ``new_type``, and ``fallback`` (llama-quantize's warning) when
    its rows did not fit the mix's type."""

    name: str
    shape: tuple[int, ...]
    cur_type: GGMLType
    new_type: GGMLType
    fallback: str | None = None

    @property
    def changes(self) -> bool:
        return self.new_type != self.cur_type


@dataclass
class _State:
    """quantize_state_impl: counters that the rules advance tensor by tensor."""

    model: ModelParams
    params: QuantizeParams
    n_attention_wv: int = 0
    n_ffn_down: int = 0
    n_ffn_gate: int = 0
    n_ffn_up: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    has_tied_embeddings: bool = True
    fallbacks: list[str] = field(default_factory=list)


def _block_size(ggml_type: GGMLType) -> int:
    return GGML_TYPES[ggml_type].block_size


def _layer_info(qs: _State, i_layer: int, n_layer: int, name: str) -> tuple[int, int]:
    """With experts, the layer comes from the tensor's name, not the running count."""
    n_expert = max(1, qs.model.n_expert)
    if n_expert > 1:
        i_layer = _layer_of(name)
        if not re.match(r"blk\.[+-]?\d+\.", name):
            raise MixError(f"failed to determine the layer of tensor {name!r}")
        if i_layer < 0 or i_layer >= n_layer:
            raise MixError(f"bad layer {i_layer} for tensor {name!r}: must be in [0, {n_layer})")
    return i_layer, n_layer


def _get_type_impl(
    qs: _State, new_type: GGMLType, name: str, shape: Sequence[int], category: Category
) -> GGMLType:
    """``llama_tensor_get_type_impl`` for the file types of :class:`LlamaFType`."""
    ftype = qs.params.ftype
    model = qs.model
    arch = model.arch
    falcon = arch == "falcon"

    if category == C.OUTPUT or (qs.has_tied_embeddings and category == C.TOKEN_EMBD):
        # a tied token embedding is the output matrix too: it gets the output's type
        if qs.params.output_tensor_type is not None:
            return qs.params.output_tensor_type
        nx = shape[0]
        if falcon or nx % _block_size(new_type) != 0:
            return T.Q8_0
        if new_type != T.Q8_0:
            return T.Q6_K
        return new_type
    if category == C.TOKEN_EMBD:
        if qs.params.token_embedding_type is not None:
            return qs.params.token_embedding_type
        return new_type
    if category in _ATTN_V_LIKE:
        if ftype == F.MOSTLY_Q2_K:
            new_type = T.Q4_K if model.n_gqa >= 4 else T.Q3_K
        elif ftype == F.MOSTLY_Q3_K_M:
            new_type = T.Q5_K if qs.i_attention_wv < 2 else T.Q4_K
        elif ftype == F.MOSTLY_Q3_K_L:
            new_type = T.Q5_K
        elif ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and model.n_gqa >= 4:
            new_type = T.Q5_K
        elif ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(
            qs.i_attention_wv, qs.n_attention_wv
        ):
            new_type = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and qs.i_attention_wv < 4:
            new_type = T.Q5_K
        if model.is_70b and new_type in (T.Q3_K, T.Q4_K):
            # 8 heads share each attn_v: 8x smaller than attn_q, so more bits are cheap
            new_type = T.Q5_K
        if model.n_expert == 8:
            new_type = T.Q8_0
        qs.i_attention_wv += 1
        return new_type
    if category == C.ATTENTION_K:
        return T.Q8_0 if model.n_expert == 8 else new_type
    if category == C.ATTENTION_Q:
        return new_type
    if category == C.FFN_DOWN:
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_down, qs.n_ffn_down, name)
        eighth = _c_div(n_layer, 8)
        if ftype == F.MOSTLY_Q2_K:
            new_type = T.Q3_K
        elif ftype == F.MOSTLY_Q3_K_M:
            if i_layer < _c_div(n_layer, 16):
                new_type = T.Q5_K
            elif not falcon or use_more_bits(i_layer, n_layer):
                new_type = T.Q4_K
            else:
                new_type = T.Q3_K
        elif ftype == F.MOSTLY_Q3_K_L:
            new_type = T.Q4_K if falcon else T.Q5_K
        elif ftype == F.MOSTLY_Q4_K_M:
            if falcon:
                if i_layer < _c_div(n_layer, 16):
                    new_type = T.Q6_K
                elif use_more_bits(i_layer, n_layer):
                    new_type = T.Q5_K
                else:
                    new_type = T.Q4_K
            elif use_more_bits(i_layer, n_layer):
                new_type = T.Q6_K
        elif i_layer < eighth and ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS):
            new_type = T.Q5_K  # (only without an importance matrix, which we never have)
        elif ftype == F.MOSTLY_Q5_K_M and use_more_bits(i_layer, n_layer):
            new_type = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and not falcon and i_layer < eighth:
            new_type = T.Q5_K
        qs.i_ffn_down += 1
        return new_type
    if category == C.ATTENTION_OUTPUT:
        if not falcon:
            if model.n_expert == 8:
                if ftype in (
                    F.MOSTLY_Q2_K,
                    F.MOSTLY_Q3_K_S,
                    F.MOSTLY_Q3_K_M,
                    F.MOSTLY_IQ4_NL,
                    F.MOSTLY_Q4_K_S,
                    F.MOSTLY_Q4_K_M,
                    F.MOSTLY_IQ4_XS,
                ):
                    new_type = T.Q5_K
            elif ftype == F.MOSTLY_Q2_K:
                new_type = T.Q3_K
            elif ftype == F.MOSTLY_Q3_K_M:
                new_type = T.Q4_K
            elif ftype == F.MOSTLY_Q3_K_L:
                new_type = T.Q5_K
        elif ftype == F.MOSTLY_Q3_K_L:
            new_type = T.Q4_K
        return new_type
    if category == C.ATTENTION_QKV:  # unreachable: attn_qkv is attn_v-like above (as in C)
        return new_type
    if category == C.FFN_GATE:
        _layer_info(qs, qs.i_ffn_gate, qs.n_ffn_gate, name)
        qs.i_ffn_gate += 1
        return new_type
    if category == C.FFN_UP:
        _layer_info(qs, qs.i_ffn_up, qs.n_ffn_up, name)
        qs.i_ffn_up += 1
        return new_type
    return new_type


# tensor_type_fallback: a type whose block does not divide the rows falls back to one that
# does (block size 32); any type whose block still does not divide them falls back to F16.
# (A type with no entry here, Q8_0 say, goes straight to F16: that is what llama-quantize
# 0.5.0 does, where some versions of the source throw "no tensor type fallback" instead.)
_FALLBACKS: dict[GGMLType, GGMLType] = {
    T.IQ4_XS: T.IQ4_NL,
    T.Q2_K: T.Q4_0,
    T.Q3_K: T.Q4_0,
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}


def _fallback(qs: _State, name: str, shape: Sequence[int], target: GGMLType) -> GGMLType:
    ncols = shape[0]
    qk = _block_size(target)
    if ncols % qk == 0:
        return target
    result = _FALLBACKS.get(target, target)
    note = ""
    if ncols % _block_size(result) != 0:
        result = T.F16
        note = " (must use F16 due to unusual shape)"
    qs.fallbacks.append(
        f"{name}: ncols {ncols} not divisible by {qk} (required for type {target.name})"
        f"{note} -> falling back to {result.name}"
    )
    return result


def _get_type(
    qs: _State, name: str, shape: Sequence[int], cur_type: GGMLType, category: Category
) -> GGMLType:
    """``llama_tensor_get_type``, the outer wrapper."""
    params = qs.params
    if not allows_quantization(name, shape, params.quantize_output_tensor):
        return cur_type
    if params.token_embedding_type is not None and category == C.TOKEN_EMBD:
        return params.token_embedding_type
    if params.output_tensor_type is not None and category == C.OUTPUT:
        return params.output_tensor_type
    new_type = default_type(params.ftype)
    if is_quantized(new_type):
        if not params.pure:
            new_type = _get_type_impl(qs, new_type, name, shape, category)
        new_type = _fallback(qs, name, shape, new_type)
    return new_type


def plan_types(
    tensors: Sequence[tuple[str, Sequence[int], GGMLType]],
    model: ModelParams,
    params: QuantizeParams,
) -> list[TensorChoice]:
    """The type of every tensor, as llama-quantize decides it.

    ``tensors`` are ``(name, GGUF shape, current type)`` in llama-quantize's order
    (:func:`llama_tensor_order`): the attn_v counter depends on it. Returns one
    :class:`TensorChoice` per tensor, in the same order.
    """
    qs = _State(model, params)
    categories = [tensor_category(name) for name, _, _ in tensors]
    qs.n_attention_wv = sum(c in _ATTN_V_LIKE for c in categories)
    qs.has_tied_embeddings = C.OUTPUT not in categories
    qs.n_ffn_down = qs.n_ffn_gate = qs.n_ffn_up = model.n_layer
    plan = []
    for (name, shape, cur_type), category in zip(tensors, categories, strict=True):
        n_fallbacks = len(qs.fallbacks)
        new_type = _get_type(qs, name, shape, GGMLType(cur_type), category)
        fallback = qs.fallbacks[-1] if len(qs.fallbacks) > n_fallbacks else None
        plan.append(TensorChoice(name, tuple(shape), GGMLType(cur_type), new_type, fallback))
    return plan
