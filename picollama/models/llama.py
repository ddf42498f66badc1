"""Llama family: Llama 1/2/3, Mistral, SmolLM, TinyLlama.

Pre-norm decoder blocks: RMSNorm, attention with GQA and RoPE (normal ordering: llama.cpp's
converter permutes Q and K so adjacent pairs rotate), RMSNorm, SwiGLU feed-forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from picollama.backends.base import Backend
from picollama.gguf import GGUFReader
from picollama.models.base import (
    BaseModel,
    Batch,
    CommonArgs,
    ModelLoadError,
    Segment,
    WeightLoader,
    head_counts,
    meta_float,
    meta_int,
    vocab_size,
)

__all__ = ["ModelArgs", "Model"]


@dataclass
class ModelArgs(CommonArgs):
    norm_eps: float = 1e-5
    n_ff: int = 0
    n_rot: int = 0
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    sliding_window: int = 0

    @classmethod
    def from_gguf(cls, reader: GGUFReader, arch: str) -> ModelArgs:
        def key(template: str) -> str:
            return template.format(arch=arch)

        n_embd, n_heads, n_kv_heads = head_counts(reader, arch)
        head_dim = meta_int(reader, key("{arch}.attention.key_length"), n_embd // n_heads)
        head_dim_v = meta_int(reader, key("{arch}.attention.value_length"), head_dim)
        n_vocab = vocab_size(reader, arch)
        scaling = reader.get(key("{arch}.rope.scaling.type"), "none")
        freq_scale = 1.0
        if scaling == "linear":
            freq_scale = 1.0 / meta_float(reader, key("{arch}.rope.scaling.factor"), 1.0)
        elif scaling not in ("none", None):
            raise ModelLoadError(f"RoPE scaling type '{scaling}' is not supported yet")
        if "rope_freqs.weight" in reader:
            raise ModelLoadError("RoPE frequency factors (rope_freqs.weight) are not supported yet")
        return cls(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layers=meta_int(reader, key("{arch}.block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim_k=head_dim,
            head_dim_v=head_dim_v,
            n_ctx_train=meta_int(reader, key("{arch}.context_length"), 2048),
            norm_eps=meta_float(reader, key("{arch}.attention.layer_norm_rms_epsilon"), 1e-5),
            n_ff=meta_int(reader, key("{arch}.feed_forward_length")),
            n_rot=meta_int(reader, key("{arch}.rope.dimension_count"), head_dim),
            rope_freq_base=meta_float(reader, key("{arch}.rope.freq_base"), 10000.0),
            rope_freq_scale=freq_scale,
            sliding_window=meta_int(reader, key("{arch}.attention.sliding_window"), 0),
        )


@dataclass
class _Layer:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object


class Model(BaseModel):
    def __init__(self, reader: GGUFReader, backend: Backend, arch: str = "llama"):
        self.args = a = ModelArgs.from_gguf(reader, arch)
        self.backend = backend
        load = WeightLoader(reader, backend)
        d, hd, hdv = a.n_embd, a.head_dim_k, a.head_dim_v
        self.tok_embd = load.weight("token_embd.weight", (d, a.n_vocab))
        self.layers = []
        for i in range(a.n_layers):
            p = f"blk.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=load.vector(p + "attn_norm.weight", d),
                    wq=load.weight(p + "attn_q.weight", (d, a.n_heads * hd)),
                    wk=load.weight(p + "attn_k.weight", (d, a.n_kv_heads * hd)),
                    wv=load.weight(p + "attn_v.weight", (d, a.n_kv_heads * hdv)),
                    wo=load.weight(p + "attn_output.weight", (a.n_heads * hdv, d)),
                    ffn_norm=load.vector(p + "ffn_norm.weight", d),
                    w_gate=load.weight(p + "ffn_gate.weight", (d, a.n_ff)),
                    w_up=load.weight(p + "ffn_up.weight", (d, a.n_ff)),
                    w_down=load.weight(p + "ffn_down.weight", (a.n_ff, d)),
                )
            )
        self.output_norm = load.vector("output_norm.weight", d)
        self.output = load.output(self.tok_embd, d, a.n_vocab)
        self.attn_scale = 1.0 / math.sqrt(hd)

    def forward_batch(self, segments: list[Segment]) -> list[np.ndarray]:
        a, be = self.args, self.backend
        batch = Batch(segments)
        n = len(batch)
        positions = batch.positions
        x = be.get_rows(self.tok_embd, batch.tokens)  # x: (n, n_embd)
        for il, layer in enumerate(self.layers):
            h = be.rms_norm(x, layer.attn_norm, a.norm_eps)
            q, k, v = be.matmul_many(h, (layer.wq, layer.wk, layer.wv))
            q = q.reshape(n, a.n_heads, a.head_dim_k)
            k = k.reshape(n, a.n_kv_heads, a.head_dim_k)
            v = v.reshape(n, a.n_kv_heads, a.head_dim_v)
            q = be.rope(q, positions, a.n_rot, a.rope_freq_base, a.rope_freq_scale)
            k = be.rope(k, positions, a.n_rot, a.rope_freq_base, a.rope_freq_scale)
            attn = batch.attend(be, il, q, k, v, self.attn_scale, a.sliding_window)
            x = be.add(x, be.matmul(attn, layer.wo))  # attn: (n, n_heads * head_dim_v)
            h = be.rms_norm(x, layer.ffn_norm, a.norm_eps)
            ff = be.gated_ffn(h, layer.w_gate, layer.w_up, "silu")
            x = be.add(x, be.matmul(ff, layer.w_down))  # ff: (n, n_ff)
        x = be.rms_norm(be.take_rows(x, batch.logit_rows), self.output_norm, a.norm_eps)
        return batch.host_logits(be, be.matmul(x, self.output))  # (rows, n_vocab) each
