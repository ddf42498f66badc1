"""Phi-3 / Phi-3.5 / Phi-4 (dense): the Llama block with fused projections.

llama.cpp's ``phi3`` graph: RMSNorm, one fused QKV projection (``attn_qkv``: the Q rows,
then K, then V; older files may have separate ``attn_q/k/v``), NeoX RoPE over the first
``rope.dimension_count`` dims of each head, GQA attention, output projection, RMSNorm, and
a SwiGLU feed-forward whose ``ffn_up`` holds the gate rows and then the up rows.

The fused weights are split into row ranges when loaded (zero-copy views of the file: a
weight's rows are contiguous), so the forward pass is the same op sequence as Llama's and a
backend needs nothing new.

Sliding window: HF's Phi-3 masks keys further back than ``sliding_window`` in every layer;
llama.cpp ignores the window for Phi-3 (its converters wrote windows the models were not
trained with, llama.cpp PR 13676). We follow the file's ``attention.sliding_window``, as
transformers does; it only matters past the window (2047 tokens for Phi-3-mini-4k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from picollama.backends.base import Backend, BackendError, Weight
from picollama.gguf import GGUFReader
from picollama.models.base import (
    BaseModel,
    Batch,
    CommonArgs,
    ModelLoadError,
    Segment,
    WeightLoader,
    meta_float,
    meta_int,
)
from picollama.models.llama import _vocab_size

__all__ = ["ModelArgs", "Model"]


@dataclass
class ModelArgs(CommonArgs):
    norm_eps: float = 1e-5
    n_ff: int = 0
    n_rot: int = 0
    rope_freq_base: float = 10000.0
    sliding_window: int = 0

    @classmethod
    def from_gguf(cls, reader: GGUFReader, arch: str = "phi3") -> ModelArgs:
        def key(template: str) -> str:
            return template.format(arch=arch)

        n_embd = meta_int(reader, key("{arch}.embedding_length"))
        n_heads = meta_int(reader, key("{arch}.attention.head_count"))
        if n_heads == 0 or n_embd % n_heads:
            raise ModelLoadError(
                f"embedding_length {n_embd} is not a multiple of head_count {n_heads}"
            )
        n_kv_heads = meta_int(reader, key("{arch}.attention.head_count_kv"), n_heads)
        if n_kv_heads == 0 or n_heads % n_kv_heads:
            raise ModelLoadError(
                f"head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}"
            )
        head_dim = n_embd // n_heads  # llama.cpp's phi3 graph asserts key == value length
        n_rot = meta_int(reader, key("{arch}.rope.dimension_count"), head_dim)
        if n_rot > head_dim or n_rot % 2:
            raise ModelLoadError(
                f"rope.dimension_count {n_rot} must be even and at most the head size {head_dim}"
            )
        if "rope_factors_long.weight" in reader or "rope_factors_short.weight" in reader:
            raise ModelLoadError(
                "LongRoPE frequency factors (rope_factors_long/short.weight, the 128k-context "
                "Phi-3 models) are not supported yet"
            )
        scaling = reader.get(key("{arch}.rope.scaling.type"), "none")
        if scaling not in ("none", None):
            raise ModelLoadError(f"RoPE scaling type '{scaling}' is not supported for phi3")
        return cls(
            arch=arch,
            n_vocab=_vocab_size(reader, arch),
            n_embd=n_embd,
            n_layers=meta_int(reader, key("{arch}.block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim_k=head_dim,
            head_dim_v=head_dim,
            n_ctx_train=meta_int(reader, key("{arch}.context_length"), 4096),
            norm_eps=meta_float(reader, key("{arch}.attention.layer_norm_rms_epsilon"), 1e-5),
            n_ff=meta_int(reader, key("{arch}.feed_forward_length")),
            n_rot=n_rot,
            rope_freq_base=meta_float(reader, key("{arch}.rope.freq_base"), 10000.0),
            sliding_window=meta_int(reader, key("{arch}.attention.sliding_window"), 0),
        )


def _split_rows(load: WeightLoader, name: str, k: int, parts: list[int]) -> list[Weight]:
    """The weight ``name`` (``k`` inputs, ``sum(parts)`` rows) as one weight per row range."""
    info = load._info(name, (k, sum(parts)))
    row_bytes = info.data.nbytes // sum(parts)
    weights, row = [], 0
    for i, m in enumerate(parts):
        data = info.data[row * row_bytes : (row + m) * row_bytes]
        try:
            weights.append(load.backend.weight(f"{name}[{i}]", info.type, (k, m), data))
        except BackendError as err:
            raise ModelLoadError(str(err)) from None
        row += m
    return weights


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
    def __init__(self, reader: GGUFReader, backend: Backend, arch: str = "phi3"):
        self.args = a = ModelArgs.from_gguf(reader, arch)
        self.backend = backend
        load = WeightLoader(reader, backend)
        d, hd = a.n_embd, a.head_dim_k
        n_q, n_kv = a.n_heads * hd, a.n_kv_heads * hd
        self.tok_embd = load.weight("token_embd.weight", (d, a.n_vocab))
        self.layers = []
        for i in range(a.n_layers):
            p = f"blk.{i}."
            if load.has(p + "attn_qkv.weight"):
                wq, wk, wv = _split_rows(load, p + "attn_qkv.weight", d, [n_q, n_kv, n_kv])
            else:
                wq = load.weight(p + "attn_q.weight", (d, n_q))
                wk = load.weight(p + "attn_k.weight", (d, n_kv))
                wv = load.weight(p + "attn_v.weight", (d, n_kv))
            # ffn_up: (n_embd, 2 * n_ff), the gate's rows first (llama.cpp's fused SwiGLU)
            w_gate, w_up = _split_rows(load, p + "ffn_up.weight", d, [a.n_ff, a.n_ff])
            self.layers.append(
                _Layer(
                    attn_norm=load.vector(p + "attn_norm.weight", d),
                    wq=wq,
                    wk=wk,
                    wv=wv,
                    wo=load.weight(p + "attn_output.weight", (n_q, d)),
                    ffn_norm=load.vector(p + "ffn_norm.weight", d),
                    w_gate=w_gate,
                    w_up=w_up,
                    w_down=load.weight(p + "ffn_down.weight", (a.n_ff, d)),
                )
            )
        self.output_norm = load.vector("output_norm.weight", d)
        if load.has("output.weight"):
            self.output = load.weight("output.weight", (d, a.n_vocab))
        else:
            self.output = self.tok_embd
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
            q = be.rope(q, positions, a.n_rot, a.rope_freq_base, 1.0, neox=True)
            k = be.rope(k, positions, a.n_rot, a.rope_freq_base, 1.0, neox=True)
            attn = batch.attend(be, il, q, k, v, self.attn_scale, a.sliding_window)
            x = be.add(x, be.matmul(attn, layer.wo))  # attn: (n, n_heads * head_dim)
            h = be.rms_norm(x, layer.ffn_norm, a.norm_eps)
            ff = be.gated_ffn(h, layer.w_gate, layer.w_up, "silu")
            x = be.add(x, be.matmul(ff, layer.w_down))  # ff: (n, n_ff)
        x = be.rms_norm(be.take_rows(x, batch.logit_rows), self.output_norm, a.norm_eps)
        return batch.split(be.to_host(be.matmul(x, self.output)))  # (rows, n_vocab) each
