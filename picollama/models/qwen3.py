"""Qwen3 (dense): the Llama block with RMSNorm on each head of Q and K, no biases.

llama.cpp's ``qwen3`` graph: RMSNorm, Q/K/V projections, per-head RMSNorm of Q and K
(``attn_q_norm``/``attn_k_norm``, over head_dim, before RoPE), NeoX RoPE, GQA attention
with head_dim from ``key_length`` (n_heads * head_dim may differ from n_embd), output
projection, RMSNorm, SwiGLU feed-forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from picollama.backends.base import Backend
from picollama.gguf import GGUFReader
from picollama.models.base import BaseModel, Batch, Segment, WeightLoader
from picollama.models.llama import ModelArgs

__all__ = ["ModelArgs", "Model"]


@dataclass
class _Layer:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    q_norm: object
    k_norm: object
    wo: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object


class Model(BaseModel):
    def __init__(self, reader: GGUFReader, backend: Backend, arch: str = "qwen3"):
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
            q = be.rms_norm(q, layer.q_norm, a.norm_eps)  # QK-norm: each head on its own
            k = be.rms_norm(k, layer.k_norm, a.norm_eps)
            q = be.rope(q, positions, a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True)
            k = be.rope(k, positions, a.n_rot, a.rope_freq_base, a.rope_freq_scale, neox=True)
            attn = batch.attend(be, il, q, k, v, self.attn_scale, a.sliding_window)
            x = be.add(x, be.matmul(attn, layer.wo))  # attn: (n, n_heads * head_dim_v)
            h = be.rms_norm(x, layer.ffn_norm, a.norm_eps)
            ff = be.gated_ffn(h, layer.w_gate, layer.w_up, "silu")
            x = be.add(x, be.matmul(ff, layer.w_down))  # ff: (n, n_ff)
        x = be.rms_norm(be.take_rows(x, batch.logit_rows), self.output_norm, a.norm_eps)
        return batch.host_logits(be, be.matmul(x, self.output))  # (rows, n_vocab) each
