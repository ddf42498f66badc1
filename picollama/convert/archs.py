"""Per-architecture knowledge: HF class -> GGUF architecture, tensor names, metadata.

Everything here mirrors what llama.cpp's ``convert_hf_to_gguf.py`` writes for the same
checkpoint, so a converted file loads in llama.cpp and in picollama alike:

- Llama-style checkpoints keep Q and K rows in the "rotate halves" (NeoX) order of HF's
  RoPE; llama.cpp's ``llama`` graph rotates adjacent pairs, so the converter permutes the
  rows of each head (``permute_qk``). Qwen2/Qwen3/Gemma3 run NeoX RoPE: no permutation.
- Gemma's RMSNorm computes ``x * (1 + w)``; GGUF stores ``1 + w`` (``norm_shift``).
- Mistral is written as ``llama`` (llama.cpp's converter does the same); its sliding window,
  which llama.cpp's converter drops, goes in ``llama.attention.sliding_window``.
- Phi-3 keeps its fused tensors: ``attn_qkv`` (Q, K, V rows stacked) and ``ffn_up`` (gate
  rows, then up rows); LongRoPE checkpoints get ``rope_factors_long/short.weight``.
- 1-D tensors and norms stay F32 whatever the output type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from picollama.convert.errors import ConvertError
from picollama.gguf.constants import GGUFValueType

__all__ = [
    "ArchSpec",
    "ARCHS",
    "arch_for",
    "Metadata",
    "permute_qk",
    "phi3_rope_factors",
    "rope_parameters",
]

VT = GGUFValueType

# (key, value, type) triples in the order llama.cpp writes them; a later duplicate replaces
# an earlier one, as gguf-py's writer does.
Metadata = list[tuple[str, Any, GGUFValueType]]

# HF layer tensor (after "model.layers.{i}.") -> GGUF (after "blk.{i}.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 2/3 sandwich norms: the norm after attention is not the FFN's input norm.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_PHI3_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Buffers HF sometimes saves that no GGUF graph uses (llama.cpp drops them too).
_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str
    layer_names: dict[str, str]
    metadata: Callable[[dict[str, Any], str], Metadata]
    permute_qk: bool = False
    norm_shift: float = 0.0
    dropped: tuple[str, ...] = ()  # HF tensors llama.cpp's converter skips for this class

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF tensor name for ``hf_name``; None for tensors to drop."""
        if hf_name.endswith(_SKIPPED_SUFFIXES) or hf_name in self.dropped:
            return None
        if hf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[hf_name]
        parts = hf_name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdecimal():
            suffix = self.layer_names.get(parts[3])
            if suffix is not None:
                return f"blk.{int(parts[2])}.{suffix}"
        raise ConvertError(f"tensor {hf_name} has no GGUF name for architecture {self.gguf_arch}")


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head from HF's (first half, second half) RoPE order to adjacent pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _find(config: dict[str, Any], *keys: str) -> Any:
    return next((config[k] for k in keys if k in config), None)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings in transformers 5's ``rope_parameters`` shape, from either spelling."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = _find(config, "global_rope_theta", "rope_global_theta", "rope_theta_global")
    theta = theta if theta is not None else _find(config, "rope_theta", "rotary_emb_base")
    local = _find(
        config,
        "local_rope_theta",
        "rope_local_theta",
        "rope_theta_local",
        "swa_rope_theta",
        "rope_local_base_freq",
    )
    if "full_attention" not in params and "sliding_attention" not in params:
        if local is not None:
            params["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in params and theta is not None:
            params["rope_theta"] = theta
        if "rope_type" not in params and params.get("type") is not None:
            params["rope_type"] = params["type"]
    return params


def _base_metadata(config: dict[str, Any], arch: str) -> Metadata:
    """TextModel.set_gguf_parameters: the keys every text architecture gets."""
    md: Metadata = []

    def add(key: str, value: Any, vtype: GGUFValueType) -> None:
        md.append((key.format(arch=arch), value, vtype))

    add("{arch}.block_count", _find(config, "num_hidden_layers", "n_layers"), VT.UINT32)
    ctx = _find(config, "max_position_embeddings", "n_ctx", "n_positions", "max_length")
    if ctx is not None:
        add("{arch}.context_length", ctx, VT.UINT32)
    for key, names in (
        ("{arch}.embedding_length", ("hidden_size", "n_embd", "dim")),
        ("{arch}.feed_forward_length", ("intermediate_size", "n_inner", "hidden_dim")),
        ("{arch}.attention.head_count", ("num_attention_heads", "n_head", "n_heads")),
        ("{arch}.attention.head_count_kv", ("num_key_value_heads", "n_kv_heads")),
    ):
        if (value := _find(config, *names)) is not None:
            add(key, value, VT.UINT32)
    rope_all = rope_parameters(config)
    rope = rope_all.get("full_attention", rope_all)
    rope_type = rope.get("rope_type")
    factor = rope.get("factor")
    if rope_type == "linear" and factor is not None:
        add("{arch}.rope.scaling.type", "linear", VT.STRING)
        add("{arch}.rope.scaling.factor", factor, VT.FLOAT32)
    elif rope_type == "yarn" and factor is not None:
        add("{arch}.rope.scaling.type", "yarn", VT.STRING)
        add("{arch}.rope.scaling.factor", factor, VT.FLOAT32)
        add(
            "{arch}.rope.scaling.original_context_length",
            rope["original_max_position_embeddings"],
            VT.UINT32,
        )
    elif rope_type not in (None, "default", "llama3"):
        raise ConvertError(f"RoPE scaling type {rope_type!r} is not supported by the converter")
    if (theta := rope.get("rope_theta")) is not None:
        add("{arch}.rope.freq_base", theta, VT.FLOAT32)
    if (local := rope_all.get("sliding_attention", {}).get("rope_theta")) is not None:
        add("{arch}.rope.freq_base_swa", local, VT.FLOAT32)
    if (eps := _find(config, "rms_norm_eps", "norm_eps")) is not None:
        add("{arch}.attention.layer_norm_rms_epsilon", eps, VT.FLOAT32)
    if (head_dim := config.get("head_dim")) is not None:
        add("{arch}.attention.key_length", head_dim, VT.UINT32)
        add("{arch}.attention.value_length", head_dim, VT.UINT32)
    return md


def _llama_metadata(config: dict[str, Any], arch: str) -> Metadata:
    md = _base_metadata(config, arch)
    md.append((f"{arch}.vocab_size", config["vocab_size"], VT.UINT32))
    rope_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    md.append((f"{arch}.rope.dimension_count", rope_dim, VT.UINT32))
    return md


def _gemma3_metadata(config: dict[str, Any], arch: str) -> Metadata:
    md = _base_metadata(config, arch)
    rope_all = rope_parameters(config)
    head_dim = config.get("head_dim", 256)
    md += [
        (f"{arch}.context_length", config.get("max_position_embeddings", 131072), VT.UINT32),
        (f"{arch}.attention.head_count", config.get("num_attention_heads", 8), VT.UINT32),
        (f"{arch}.attention.layer_norm_rms_epsilon", config.get("rms_norm_eps", 1e-6), VT.FLOAT32),
        (f"{arch}.attention.key_length", head_dim, VT.UINT32),
        (f"{arch}.attention.value_length", head_dim, VT.UINT32),
        (
            f"{arch}.rope.freq_base",
            rope_all.get("full_attention", rope_all).get("rope_theta", 1_000_000.0),
            VT.FLOAT32,
        ),
    ]
    if config.get("attn_logit_softcapping") is not None:
        raise ConvertError("Gemma 3 has no attention logit softcapping; config.json sets one")
    if softcap := config.get("final_logit_softcapping"):
        md.append((f"{arch}.final_logit_softcapping", softcap, VT.FLOAT32))
    if config.get("sliding_window_pattern") != 1:
        md.append(
            (f"{arch}.attention.sliding_window", config.get("sliding_window", 4096), VT.UINT32)
        )
    md.append((f"{arch}.attention.head_count_kv", config.get("num_key_value_heads", 4), VT.UINT32))
    return md


def _mistral_metadata(config: dict[str, Any], arch: str) -> Metadata:
    md = _llama_metadata(config, arch)
    if window := config.get("sliding_window"):
        md.append((f"{arch}.attention.sliding_window", window, VT.UINT32))
    return md


def _phi3_rope(config: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """Phi-3's RoPE settings, its original context length and its rotary dims per head."""
    rope = rope_parameters(config)
    rope = rope.get("full_attention", rope)
    n_embd, n_heads = config["hidden_size"], config["num_attention_heads"]
    orig_ctx = _find(rope, "original_max_position_embeddings")
    if orig_ctx is None:
        orig_ctx = _find(config, "original_max_position_embeddings")
    if orig_ctx is None:
        raise ConvertError("config.json has no original_max_position_embeddings (Phi-3 needs it)")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return rope, orig_ctx, int(partial * n_embd) // n_heads


def _phi3_metadata(config: dict[str, Any], arch: str) -> Metadata:
    """Phi3MiniModel.set_gguf_parameters (and the LongRoPE attention factor)."""
    rope, orig_ctx, n_rot = _phi3_rope(config)
    n_heads = config["num_attention_heads"]
    md: Metadata = [
        (f"{arch}.context_length", config["max_position_embeddings"], VT.UINT32),
        (f"{arch}.rope.scaling.original_context_length", orig_ctx, VT.UINT32),
        (f"{arch}.embedding_length", config["hidden_size"], VT.UINT32),
        (f"{arch}.feed_forward_length", config["intermediate_size"], VT.UINT32),
        (f"{arch}.block_count", config["num_hidden_layers"], VT.UINT32),
        (f"{arch}.attention.head_count", n_heads, VT.UINT32),
        (
            f"{arch}.attention.head_count_kv",
            config.get("num_key_value_heads", n_heads),
            VT.UINT32,
        ),
        (f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"], VT.FLOAT32),
        (f"{arch}.rope.dimension_count", n_rot, VT.UINT32),
        (f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0), VT.FLOAT32),
        (f"{arch}.attention.sliding_window", config.get("sliding_window") or 0, VT.UINT32),
    ]
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / orig_ctx
        rope_type = str(rope.get("rope_type", rope.get("type", ""))).lower()
        if rope_type in ("su", "longrope"):
            factor = math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1 else 1.0
        elif rope_type == "yarn":
            factor = 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0
        else:
            raise ConvertError(f"Phi-3 RoPE scaling type {rope_type!r} is not supported")
        md.append((f"{arch}.rope.scaling.attn_factor", factor, VT.FLOAT32))
    return md


def phi3_rope_factors(config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's ``rope_factors_long/short.weight`` for a LongRoPE Phi-3, else none."""
    rope, _, n_rot = _phi3_rope(config)
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return []
    if not short or len(long) != len(short) or len(long) != n_rot // 2:
        raise ConvertError(
            f"RoPE long_factor and short_factor must both have {n_rot // 2} entries "
            f"(got {len(long)} and {len(short or [])})"
        )
    return [
        ("rope_factors_long.weight", np.array(long, dtype=np.float32)),
        ("rope_factors_short.weight", np.array(short, dtype=np.float32)),
    ]


def _gemma2_metadata(config: dict[str, Any], arch: str) -> Metadata:
    """Gemma2Model.set_gguf_parameters: no RoPE keys (base 10000), both softcaps, window."""
    n_heads = config["num_attention_heads"]
    md: Metadata = [
        (f"{arch}.context_length", config["max_position_embeddings"], VT.UINT32),
        (f"{arch}.embedding_length", config["hidden_size"], VT.UINT32),
        (f"{arch}.block_count", config["num_hidden_layers"], VT.UINT32),
        (f"{arch}.feed_forward_length", config["intermediate_size"], VT.UINT32),
        (f"{arch}.attention.head_count", n_heads, VT.UINT32),
        (
            f"{arch}.attention.head_count_kv",
            config.get("num_key_value_heads", n_heads),
            VT.UINT32,
        ),
        (f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"], VT.FLOAT32),
        (f"{arch}.attention.key_length", config["head_dim"], VT.UINT32),
        (f"{arch}.attention.value_length", config["head_dim"], VT.UINT32),
    ]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is None:
            raise ConvertError(f"config.json has no {key} (Gemma 2 needs it)")
        md.append((f"{arch}.{key}", config[key], VT.FLOAT32))
    md.append((f"{arch}.attention.sliding_window", config["sliding_window"], VT.UINT32))
    rope = rope_parameters(config)
    rope = rope.get("full_attention", rope)
    if rope.get("rope_type") not in (None, "default") or rope.get("rope_theta", 1e4) != 1e4:
        raise ConvertError("Gemma 2 with RoPE other than the default (base 10000) is not supported")
    return md


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs.weight`` for Llama 3.1-style RoPE scaling, else None."""
    rope_all = rope_parameters(config)
    rope = rope_all.get("full_attention", rope_all)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = config.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


_LLAMA = ArchSpec("llama", _LAYER_NAMES, _llama_metadata, permute_qk=True)
_QWEN2 = ArchSpec("qwen2", _LAYER_NAMES, _base_metadata)
_QWEN3 = ArchSpec("qwen3", _LAYER_NAMES, _base_metadata)
_GEMMA3 = ArchSpec("gemma3", _GEMMA3_LAYER_NAMES, _gemma3_metadata, norm_shift=1.0)
_MISTRAL = ArchSpec("llama", _LAYER_NAMES, _mistral_metadata, permute_qk=True)
_PHI3 = ArchSpec("phi3", _PHI3_LAYER_NAMES, _phi3_metadata)
# llama.cpp's Gemma 2 reuses the embedding as the output: it skips lm_head.weight
_GEMMA2 = ArchSpec(
    "gemma2", _GEMMA3_LAYER_NAMES, _gemma2_metadata, norm_shift=1.0, dropped=("lm_head.weight",)
)

# config.json "architectures"[0] -> spec (llama.cpp writes Mistral as "llama")
ARCHS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": _LLAMA,
    "LLaMAForCausalLM": _LLAMA,
    "MistralForCausalLM": _MISTRAL,
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "Phi3ForCausalLM": _PHI3,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
}


def arch_for(config: dict[str, Any]) -> tuple[str, ArchSpec]:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConvertError('config.json has no "architectures" list naming the model class')
    spec = ARCHS.get(archs[0])
    if spec is None:
        raise ConvertError(
            f"model class {archs[0]} is not supported (supported: {', '.join(sorted(ARCHS))})"
        )
    return archs[0], spec
