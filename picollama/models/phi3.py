"""Phi-3 / Phi-3.5 / Phi-4 (dense): the Llama block with fused projections.

llama.cpp's ``phi3`` graph: RMSNorm, one fused QKV projection (``attn_qkv``: the Q rows,
then K, then V; older files may have separate ``attn_q/k/v``), NeoX RoPE over the first
``rope.dimension_count`` dims of each head, GQA attention, output projection, RMSNorm, and
a SwiGLU feed-forward whose ``ffn_up`` holds the gate rows and then the up rows.

The fused weights are split into row ranges when loaded (zero-copy views of the file: a
weight's rows are contiguous), so the forward pass is the same op sequence as Llama's and a
backend needs nothing new.

LongRoPE (the 128k-context files: ``rope_factors_short/long.weight``): pair i of each head
rotates at ``p * base^(-2i/n_rot) / factor_i``, and the rotated dims are scaled by
``rope.scaling.attn_factor``. Like llama.cpp, a sequence uses the long factors when its
context (KV cache) is longer than ``rope.scaling.original_context_length``, else the short
ones; transformers decides by the length of each forward's sequence instead, which agrees
whenever the context is sized to what is run. The backends' RoPE op has no per-pair
factors, so this rotation is composed from ops: ``x * cos + rotate_half(x) * sin``, the
cos/sin tables built on the host for the batch's positions and ``rotate_half`` a fixed
signed permutation applied as an F32 matmul.

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
    sliding_window: int = 0
    n_ctx_orig: int = 4096  # LongRoPE: contexts longer than this use the long factors
    rope_attn_factor: float = 1.0

    @classmethod
    def from_gguf(cls, reader: GGUFReader, arch: str = "phi3") -> ModelArgs:
        def key(template: str) -> str:
            return template.format(arch=arch)

        n_embd, n_heads, n_kv_heads = head_counts(reader, arch)
        head_dim = n_embd // n_heads  # llama.cpp's phi3 graph asserts key == value length
        n_rot = meta_int(reader, key("{arch}.rope.dimension_count"), head_dim)
        if n_rot > head_dim or n_rot % 2:
            raise ModelLoadError(
                f"rope.dimension_count {n_rot} must be even and at most the head size {head_dim}"
            )
        scaling = reader.get(key("{arch}.rope.scaling.type"), "none")
        if scaling not in ("none", None):
            raise ModelLoadError(f"RoPE scaling type '{scaling}' is not supported for phi3")
        return cls(
            arch=arch,
            n_vocab=vocab_size(reader, arch),
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
            n_ctx_orig=meta_int(
                reader,
                key("{arch}.rope.scaling.original_context_length"),
                meta_int(reader, key("{arch}.context_length"), 4096),
            ),
            rope_attn_factor=meta_float(reader, key("{arch}.rope.scaling.attn_factor"), 1.0),
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


class _LongRoPE:
    """Phi-3's LongRoPE rotation, composed from matmul, mul and add (see the module doc)."""

    NAMES = ("rope_factors_short.weight", "rope_factors_long.weight")

    def __init__(self, args: ModelArgs, short: np.ndarray, long: np.ndarray, rotate_half):
        self.args = args
        self.factors = {False: short.astype(np.float64), True: long.astype(np.float64)}
        self.rotate_half = rotate_half

    @classmethod
    def present(cls, load: WeightLoader) -> bool:
        return any(load.has(name) for name in cls.NAMES)

    @classmethod
    def load(cls, load: WeightLoader, a: ModelArgs) -> _LongRoPE:
        from picollama.gguf.constants import GGMLType
        from picollama.quant import dequantize

        factors = []
        for name in cls.NAMES:
            info = load._info(name, (a.n_rot // 2,))  # both needed; shape checked
            if info.type != GGMLType.F32:
                raise ModelLoadError(f"tensor '{name}': expected F32, got {info.type.name}")
            values = dequantize(info.data, info.type)
            if not np.isfinite(values).all() or (values <= 0).any():
                raise ModelLoadError(f"tensor '{name}': RoPE factors must be positive")
            factors.append(values)
        if a.n_ctx_orig == 0:
            raise ModelLoadError("rope.scaling.original_context_length is 0")
        # rotate_half as a matrix: row r of the output takes -x[r + h] (r < h) or x[r - h]
        hd, h = a.head_dim_k, a.n_rot // 2
        w = np.zeros((hd, hd), np.float32)  # (outputs, inputs), GGUF shape (hd, hd)
        w[np.arange(h), np.arange(h) + h] = -1.0
        w[np.arange(h) + h, np.arange(h)] = 1.0
        try:
            rot = load.backend.weight(
                "rope.rotate_half", GGMLType.F32, (hd, hd), w.view(np.uint8).reshape(-1)
            )
        except BackendError as err:
            raise ModelLoadError(str(err)) from None
        return cls(a, factors[0], factors[1], rot)

    def tables(self, be: Backend, batch: Batch) -> dict:
        """cos and sin of every row's angles, (n, head_dim) on the host, then per head count."""
        a = self.args
        h = a.n_rot // 2
        inv = a.rope_freq_base ** (-np.arange(h, dtype=np.float64) / h)  # base^(-2i/n_rot)
        rows_cos, rows_sin = [], []
        for seg in batch.segments:
            factors = self.factors[seg.cache.n_ctx > a.n_ctx_orig]
            pos = np.arange(seg.start, seg.start + len(seg.tokens), dtype=np.float64)
            ang = pos[:, None] * (inv / factors)[None, :]  # (tokens, n_rot / 2)
            cos = np.ones((len(pos), a.head_dim_k))  # dims past n_rot pass through
            sin = np.zeros((len(pos), a.head_dim_k))
            cos[:, :h] = cos[:, h : 2 * h] = np.cos(ang) * a.rope_attn_factor
            sin[:, :h] = sin[:, h : 2 * h] = np.sin(ang) * a.rope_attn_factor
            rows_cos.append(cos)
            rows_sin.append(sin)
        cos, sin = np.concatenate(rows_cos), np.concatenate(rows_sin)
        out = {}
        for heads in {a.n_heads, a.n_kv_heads}:  # one row per (token, head), as x is reshaped
            out[heads] = (
                be.from_host(np.repeat(cos, heads, axis=0).astype(np.float32)),
                be.from_host(np.repeat(sin, heads, axis=0).astype(np.float32)),
            )
        return out

    def apply(self, be: Backend, tables: dict, x, n: int, heads: int):
        """x: (n, heads, head_dim) -> x * cos + rotate_half(x) * sin, same shape."""
        hd = self.args.head_dim_k
        cos, sin = tables[heads]
        flat = x.reshape(n * heads, hd)
        rotated = be.matmul(flat, self.rotate_half)
        return be.add(be.mul(flat, cos), be.mul(rotated, sin)).reshape(n, heads, hd)


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
        self.output = load.output(self.tok_embd, d, a.n_vocab)
        self.attn_scale = 1.0 / math.sqrt(hd)
        self.longrope = _LongRoPE.load(load, a) if _LongRoPE.present(load) else None

    def forward_batch(self, segments: list[Segment]) -> list[np.ndarray]:
        a, be = self.args, self.backend
        batch = Batch(segments)
        n = len(batch)
        positions = batch.positions
        x = be.get_rows(self.tok_embd, batch.tokens)  # x: (n, n_embd)
        tables = None if self.longrope is None else self.longrope.tables(be, batch)
        for il, layer in enumerate(self.layers):
            h = be.rms_norm(x, layer.attn_norm, a.norm_eps)
            q, k, v = be.matmul_many(h, (layer.wq, layer.wk, layer.wv))
            q = q.reshape(n, a.n_heads, a.head_dim_k)
            k = k.reshape(n, a.n_kv_heads, a.head_dim_k)
            v = v.reshape(n, a.n_kv_heads, a.head_dim_v)
            if self.longrope is not None:
                q = self.longrope.apply(be, tables, q, n, a.n_heads)
                k = self.longrope.apply(be, tables, k, n, a.n_kv_heads)
            else:
                q = be.rope(q, positions, a.n_rot, a.rope_freq_base, 1.0, neox=True)
                k = be.rope(k, positions, a.n_rot, a.rope_freq_base, 1.0, neox=True)
            attn = batch.attend(be, il, q, k, v, self.attn_scale, a.sliding_window)
            x = be.add(x, be.matmul(attn, layer.wo))  # attn: (n, n_heads * head_dim)
            h = be.rms_norm(x, layer.ffn_norm, a.norm_eps)
            ff = be.gated_ffn(h, layer.w_gate, layer.w_up, "silu")
            x = be.add(x, be.matmul(ff, layer.w_down))  # ff: (n, n_ff)
        x = be.rms_norm(be.take_rows(x, batch.logit_rows), self.output_norm, a.norm_eps)
        return batch.host_logits(be, be.matmul(x, self.output))  # (rows, n_vocab) each
