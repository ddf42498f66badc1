"""Gemma 3 (text): scaled embeddings, QK-norm, sandwich norms, GeGLU, local/global layers.

Every sixth layer attends globally with the file's RoPE base; the other five attend within
a sliding window with RoPE base 10000 (llama.cpp's ``set_swa_pattern(6)`` and
``rope_freq_base_train_swa``). GGUF norm weights already hold Gemma's ``1 + w``.
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

SWA_PATTERN = 6  # layers il with il % 6 < 5 are sliding-window layers
ROPE_FREQ_BASE_SWA = 10000.0


@dataclass
class ModelArgs(CommonArgs):
    norm_eps: float = 1e-6
    n_ff: int = 0
    rope_freq_base: float = 1_000_000.0
    rope_freq_scale: float = 1.0
    sliding_window: int = 512
    attn_scale: float = 0.0

    def is_swa(self, il: int) -> bool:
        return il % SWA_PATTERN < SWA_PATTERN - 1

    @classmethod
    def from_gguf(cls, reader: GGUFReader, arch: str = "gemma3") -> ModelArgs:
        def key(template: str) -> str:
            return template.format(arch=arch)

        n_embd, n_heads, n_kv_heads = head_counts(reader, arch, embd_per_head=False)
        head_dim = meta_int(reader, key("{arch}.attention.key_length"), n_embd // n_heads)
        head_dim_v = meta_int(reader, key("{arch}.attention.value_length"), head_dim)
        scaling = reader.get(key("{arch}.rope.scaling.type"), "none")
        freq_scale = 1.0
        if scaling == "linear":
            freq_scale = 1.0 / meta_float(reader, key("{arch}.rope.scaling.factor"), 1.0)
        elif scaling not in ("none", None):
            raise ModelLoadError(f"RoPE scaling type '{scaling}' is not supported for gemma3")
        n_layers = meta_int(reader, key("{arch}.block_count"))
        return cls(
            arch=arch,
            n_vocab=vocab_size(reader, arch),
            n_embd=n_embd,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim_k=head_dim,
            head_dim_v=head_dim_v,
            n_ctx_train=meta_int(reader, key("{arch}.context_length"), 131072),
            norm_eps=meta_float(reader, key("{arch}.attention.layer_norm_rms_epsilon"), 1e-6),
            n_ff=meta_int(reader, key("{arch}.feed_forward_length")),
            rope_freq_base=meta_float(reader, key("{arch}.rope.freq_base"), 1_000_000.0),
            rope_freq_scale=freq_scale,
            sliding_window=meta_int(reader, key("{arch}.attention.sliding_window"), 512),
            # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(n_embd/n_heads)
            attn_scale=1.0 / math.sqrt(n_embd / n_heads if n_layers == 62 else head_dim),
        )


@dataclass
class _Layer:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    q_norm: object
    k_norm: object
    wo: object
    post_attn_norm: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object
    post_ffn_norm: object


class Model(BaseModel):
    def __init__(self, reader: GGUFReader, backend: Backend, arch: str = "gemma3"):
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
                    q_norm=load.vector(p + "attn_q_norm.weight", hd),
                    k_norm=load.vector(p + "attn_k_norm.weight", hd),
                    wo=load.weight(p + "attn_output.weight", (a.n_heads * hdv, d)),
                    post_attn_norm=load.vector(p + "post_attention_norm.weight", d),
                    ffn_norm=load.vector(p + "ffn_norm.weight", d),
                    w_gate=load.weight(p + "ffn_gate.weight", (d, a.n_ff)),
                    w_up=load.weight(p + "ffn_up.weight", (d, a.n_ff)),
                    w_down=load.weight(p + "ffn_down.weight", (a.n_ff, d)),
                    post_ffn_norm=load.vector(p + "post_ffw_norm.weight", d),
                )
            )
        self.output_norm = load.vector("output_norm.weight", d)
        self.output = load.output(self.tok_embd, d, a.n_vocab)
        self.embd_scale = math.sqrt(d)

    def forward_batch(self, segments: list[Segment]) -> list[np.ndarray]:
        a, be = self.args, self.backend
        batch = Batch(segments)
        n = len(batch)
        positions = batch.positions
        x = be.scale(be.get_rows(self.tok_embd, batch.tokens), self.embd_scale)  # (n, n_embd)
        for il, layer in enumerate(self.layers):
            swa = a.is_swa(il)
            base = ROPE_FREQ_BASE_SWA if swa else a.rope_freq_base
            fscale = 1.0 if swa else a.rope_freq_scale
            h = be.rms_norm(x, layer.attn_norm, a.norm_eps)
            q, k, v = be.matmul_many(h, (layer.wq, layer.wk, layer.wv))
            q = q.reshape(n, a.n_heads, a.head_dim_k)
            k = k.reshape(n, a.n_kv_heads, a.head_dim_k)
            v = v.reshape(n, a.n_kv_heads, a.head_dim_v)
            q = be.rms_norm(q, layer.q_norm, a.norm_eps)  # QK-norm, per head
            k = be.rms_norm(k, layer.k_norm, a.norm_eps)
            q = be.rope(q, positions, a.head_dim_k, base, fscale, neox=True)
            k = be.rope(k, positions, a.head_dim_k, base, fscale, neox=True)
            q = be.scale(q, a.attn_scale)
            window = a.sliding_window if swa else 0
            attn = batch.attend(be, il, q, k, v, 1.0, window)
            attn = be.rms_norm(be.matmul(attn, layer.wo), layer.post_attn_norm, a.norm_eps)
            x = be.add(x, attn)
            h = be.rms_norm(x, layer.ffn_norm, a.norm_eps)
            ff = be.gated_ffn(h, layer.w_gate, layer.w_up, "gelu")
            ff = be.rms_norm(be.matmul(ff, layer.w_down), layer.post_ffn_norm, a.norm_eps)
            x = be.add(x, ff)
        x = be.rms_norm(be.take_rows(x, batch.logit_rows), self.output_norm, a.norm_eps)
        return batch.host_logits(be, be.matmul(x, self.output))  # (rows, n_vocab) each
