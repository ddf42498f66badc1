"""Tiny synthetic models for runtime tests: GGUF files with random weights, and a float64
numpy forward pass written straight from the architectures' definitions to check against.

The vocabulary is GPT-2 style byte-level BPE with no merges (every byte is a token), plus
<s> and </s>, so any text tokenizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from picollama.gguf import GGMLType, GGUFWriter
from picollama.quant import dequantize, quantize

__all__ = ["TinySpec", "write_tiny_model", "reference_logits", "byte_vocab"]


def byte_vocab() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


@dataclass
class TinySpec:
    arch: str = "llama"
    n_layers: int = 2
    n_embd: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_ff: int = 96
    rope_base: float = 10000.0
    eps: float = 1e-5
    sliding_window: int = 0
    weight_type: GGMLType = GGMLType.F32
    tied: bool = True
    seed: int = 0
    overrides: dict = field(default_factory=dict)  # tensor name -> (shape, type) to corrupt
    declared_layers: int | None = None  # block_count to write, if not n_layers
    specials: tuple[str, str] = ("<s>", "</s>")  # the two tokens after the 256 bytes

    @property
    def n_vocab(self) -> int:
        return 258


def _tensor_shapes(s: TinySpec) -> dict[str, tuple[int, ...]]:
    d, hd = s.n_embd, s.head_dim
    shapes = {"token_embd.weight": (d, s.n_vocab), "output_norm.weight": (d,)}
    if not s.tied:
        shapes["output.weight"] = (d, s.n_vocab)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (d,),
                p + "attn_q.weight": (d, s.n_heads * hd),
                p + "attn_k.weight": (d, s.n_kv_heads * hd),
                p + "attn_v.weight": (d, s.n_kv_heads * hd),
                p + "attn_output.weight": (s.n_heads * hd, d),
                p + "ffn_norm.weight": (d,),
                p + "ffn_gate.weight": (d, s.n_ff),
                p + "ffn_up.weight": (d, s.n_ff),
                p + "ffn_down.weight": (s.n_ff, d),
            }
        )
        if s.arch == "gemma3":
            shapes.update(
                {
                    p + "attn_q_norm.weight": (hd,),
                    p + "attn_k_norm.weight": (hd,),
                    p + "post_attention_norm.weight": (d,),
                    p + "post_ffw_norm.weight": (d,),
                }
            )
    return shapes


def write_tiny_model(path, spec: TinySpec) -> dict[str, np.ndarray]:
    """Write the model; return its weights as float64 arrays in numpy (out, in) shape,
    exactly as the file stores them (dequantized where quantized)."""
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(path, arch=spec.arch)
    a = spec.arch
    w.add_uint32(f"{a}.block_count", spec.declared_layers or spec.n_layers)
    w.add_uint32(f"{a}.context_length", 256)
    w.add_uint32(f"{a}.embedding_length", spec.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
    w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.eps)
    if spec.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", spec.sliding_window)
    tokens = byte_vocab() + list(spec.specials)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", np.array([1] * 256 + [3, 3], dtype=np.int32))
    w.add_array("tokenizer.ggml.merges", ["Ġ Ġ"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 256)
    w.add_uint32("tokenizer.ggml.eos_token_id", 257)
    w.add_bool("tokenizer.ggml.add_bos_token", True)

    weights = {}
    for name, shape in _tensor_shapes(spec).items():
        shape, ggml_type = spec.overrides.get(name, (shape, None))
        numpy_shape = tuple(reversed(shape))
        if len(shape) == 1:
            data = (1.0 + 0.1 * rng.standard_normal(numpy_shape)).astype(np.float32)
            w.add_tensor(name, data)
            weights[name] = data.astype(np.float64)
            continue
        data = (rng.standard_normal(numpy_shape) / math.sqrt(shape[0])).astype(np.float32)
        qtype = ggml_type if ggml_type is not None else spec.weight_type
        if qtype == GGMLType.F32:
            w.add_tensor(name, data)
            weights[name] = data.astype(np.float64)
        else:
            raw = (
                quantize(data, qtype) if qtype in _QUANTIZABLE else _random_blocks(rng, data, qtype)
            )
            w.add_tensor(name, raw, ggml_type=qtype, shape=shape)
            if qtype in _QUANTIZABLE:
                weights[name] = dequantize(raw, qtype).reshape(numpy_shape).astype(np.float64)
    w.write()
    return weights


_QUANTIZABLE = {
    GGMLType.F16,
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
    GGMLType.BF16,
}


def _random_blocks(rng, data, qtype):
    """Random bytes of the right size for a type we can't quantize (to test rejection)."""
    from picollama.gguf.constants import row_nbytes

    rows, k = data.shape
    return rng.integers(0, 256, size=(rows, row_nbytes(qtype, k)), dtype=np.uint8)


# -- reference forward (float64) -------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, base, neox):
    hd = x.shape[-1]
    half = hd // 2
    ang = pos[:, None] * base ** (-2.0 * np.arange(half) / hd)[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_logits(spec: TinySpec, W: dict, tokens: list[int]) -> np.ndarray:
    """All-position logits of the model, computed in float64 with plain numpy."""
    n, hd, H, Hkv = len(tokens), spec.head_dim, spec.n_heads, spec.n_kv_heads
    gemma = spec.arch == "gemma3"
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][tokens]
    if gemma:
        x = x * math.sqrt(spec.n_embd)
    for il in range(spec.n_layers):
        p = f"blk.{il}."
        swa = gemma and il % 6 < 5
        h = _rms(x, W[p + "attn_norm.weight"], spec.eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(n, H, hd)
        k = (h @ W[p + "attn_k.weight"].T).reshape(n, Hkv, hd)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, Hkv, hd)
        if gemma:
            q = _rms(q, W[p + "attn_q_norm.weight"], spec.eps)
            k = _rms(k, W[p + "attn_k_norm.weight"], spec.eps)
        base = 10000.0 if swa else spec.rope_base
        q, k = _rope(q, pos, base, gemma), _rope(k, pos, base, gemma)
        mask = np.tril(np.ones((n, n), bool))
        window = spec.sliding_window if (swa or (not gemma and spec.sliding_window)) else 0
        if window:
            mask &= (np.arange(n)[:, None] - np.arange(n)[None, :]) < window
        out = np.zeros((n, H, hd))
        for h_i in range(H):
            kv = h_i // (H // Hkv)
            s = q[:, h_i] @ k[:, kv].T / math.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            e = np.exp(s - s.max(1, keepdims=True))
            out[:, h_i] = (e / e.sum(1, keepdims=True)) @ v[:, kv]
        a = out.reshape(n, -1) @ W[p + "attn_output.weight"].T
        if gemma:
            a = _rms(a, W[p + "post_attention_norm.weight"], spec.eps)
        x = x + a
        h = _rms(x, W[p + "ffn_norm.weight"], spec.eps)
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        act = _gelu(g) if gemma else g / (1 + np.exp(-g))
        f = (act * u) @ W[p + "ffn_down.weight"].T
        if gemma:
            f = _rms(f, W[p + "post_ffw_norm.weight"], spec.eps)
        x = x + f
    x = _rms(x, W["output_norm.weight"], spec.eps)
    out_w = W["token_embd.weight"] if spec.tied else W["output.weight"]
    return x @ out_w.T
