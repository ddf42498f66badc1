"""What every architecture file shares: the load-time checks and the model protocol.

An architecture module defines a ``ModelArgs`` dataclass built from GGUF metadata and a
``Model`` class whose ``forward`` is written only against the backend op interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from picollama.backends.base import Backend, BackendError, KVCache, Weight, logits_top_k
from picollama.gguf import GGUFError, GGUFReader
from picollama.gguf.constants import GGMLType

__all__ = [
    "ModelLoadError",
    "CommonArgs",
    "WeightLoader",
    "Segment",
    "Batch",
    "BaseModel",
    "head_counts",
    "vocab_size",
]


class ModelLoadError(ValueError):
    """A model file whose metadata or tensors don't make a model we can run."""


@dataclass
class CommonArgs:
    """Hyper-parameters the generation loop needs from any architecture."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int


class WeightLoader:
    """Takes tensors from a reader into a backend, checking each shape against metadata."""

    def __init__(self, reader: GGUFReader, backend: Backend):
        self.reader = reader
        self.backend = backend
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.reader

    def weight(self, name: str, shape: tuple[int, ...]) -> Weight:
        """A quantized weight of GGUF shape ``shape`` (``shape[0]`` inputs per row)."""
        info = self._info(name, shape)
        try:
            return self.backend.weight(info.name, info.type, info.shape, info.data)
        except BackendError as err:
            raise ModelLoadError(str(err)) from None

    def output(self, tok_embd: Weight, n_embd: int, n_vocab: int) -> Weight:
        """``output.weight``, or the token embedding where the file ties the two (no
        ``output.weight``: the embedding table doubles as the output projection)."""
        if self.has("output.weight"):
            return self.weight("output.weight", (n_embd, n_vocab))
        return tok_embd

    def vector(self, name: str, n: int):
        """A 1-D float tensor (a norm weight), as a backend float32 array."""
        info = self._info(name, (n,))
        if info.type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            raise ModelLoadError(f"tensor '{name}': expected a float type, got {info.type.name}")
        from picollama.quant import dequantize

        host = dequantize(info.data, info.type).astype(np.float32, copy=False)
        return self.backend.from_host(host)

    def _info(self, name: str, shape: tuple[int, ...]):
        if name not in self.reader:
            raise ModelLoadError(f"tensor '{name}' is missing from the model file")
        info = self.reader.tensor(name)
        # GGUF may drop trailing dims of size 1; compare without them
        got = tuple(info.shape)
        want = tuple(shape)
        while len(got) > 1 and got[-1] == 1:
            got = got[:-1]
        while len(want) > 1 and want[-1] == 1:
            want = want[:-1]
        if got != want:
            raise ModelLoadError(
                f"tensor '{name}' has shape {list(info.shape)}, but the metadata implies "
                f"{list(shape)}"
            )
        self.used.add(name)
        return info


def meta_int(reader: GGUFReader, key: str, default: int | None = None) -> int:
    try:
        value = reader.get_int(key) if default is None else reader.get_int(key, default)
    except GGUFError as err:
        raise ModelLoadError(str(err)) from None
    if value < 0:
        raise ModelLoadError(f"metadata '{key}' is negative ({value})")
    return value


def head_counts(reader: GGUFReader, arch: str, embd_per_head: bool = True):
    """(n_embd, n_heads, n_kv_heads) from ``{arch}.*`` metadata, checked: the KV heads must
    divide the heads and, with ``embd_per_head``, the heads the embedding length (for
    architectures whose head size defaults to ``n_embd / n_heads``)."""
    n_embd = meta_int(reader, f"{arch}.embedding_length")
    n_heads = meta_int(reader, f"{arch}.attention.head_count")
    if embd_per_head and (n_heads == 0 or n_embd % n_heads):
        raise ModelLoadError(f"embedding_length {n_embd} is not a multiple of head_count {n_heads}")
    n_kv_heads = meta_int(reader, f"{arch}.attention.head_count_kv", n_heads)
    if n_heads == 0 or n_kv_heads == 0 or n_heads % n_kv_heads:
        raise ModelLoadError(
            f"head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}"
        )
    return n_embd, n_heads, n_kv_heads


def vocab_size(reader: GGUFReader, arch: str) -> int:
    """The vocabulary size: from metadata, else the token list, else the embedding rows."""
    n = reader.get(f"{arch}.vocab_size")
    if n is None:
        tokens = reader.get("tokenizer.ggml.tokens")
        n = len(tokens) if tokens is not None else None
    if n is None and "token_embd.weight" in reader:
        shape = reader.tensor("token_embd.weight").shape
        n = shape[1] if len(shape) > 1 else None
    if n is None:
        raise ModelLoadError("cannot tell the vocabulary size (no vocab_size, no tokens)")
    return int(n)


def meta_float(reader: GGUFReader, key: str, default: float) -> float:
    try:
        return float(reader.get_float(key, default))
    except GGUFError as err:
        raise ModelLoadError(str(err)) from None


@dataclass
class Segment:
    """Tokens of one sequence at positions ``start ..`` in its own KV cache.

    ``logit_rows`` picks the tokens (indices within the segment) whose logits are wanted;
    None means the last one. ``top_k`` > 0 says that the sampler needs only each row's
    ``top_k`` largest logits: the backend may then hand back those alone (``TOP_LOGITS``
    rows, ``Backend.to_host_top``) instead of the whole rows.
    """

    tokens: np.ndarray
    start: int
    cache: KVCache
    logit_rows: np.ndarray | None = None
    top_k: int = 0


@dataclass
class Batch:
    """Several sequences' tokens run through one forward pass (continuous batching).

    Row-wise work (matmuls, norms, RoPE, activations) runs once over all rows; only the KV
    cache writes and attention go segment by segment.
    """

    segments: list[Segment]
    tokens: np.ndarray = field(init=False)
    positions: np.ndarray = field(init=False)
    bounds: list[tuple[int, int]] = field(init=False)
    logit_rows: np.ndarray = field(init=False)

    def __post_init__(self):
        self.bounds, rows, offset = [], [], 0
        for seg in self.segments:
            n = len(seg.tokens)
            self.bounds.append((offset, offset + n))
            local = np.array([n - 1]) if seg.logit_rows is None else np.asarray(seg.logit_rows)
            rows.append(local + offset)
            offset += n
        self.tokens = np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in self.segments])
        self.positions = np.concatenate(
            [np.arange(s.start, s.start + len(s.tokens), dtype=np.int64) for s in self.segments]
        )
        self.logit_rows = np.concatenate(rows)

    def __len__(self) -> int:
        return len(self.tokens)

    def attend(
        self, be: Backend, layer: int, q, k, v, scale: float, window: int = 0, softcap: float = 0.0
    ):
        """Store each segment's k/v in its cache and attend within it; rows concatenated
        (``Backend.attend_batch``)."""
        return be.attend_batch(self, layer, q, k, v, scale, window, softcap)

    @property
    def top_k(self) -> int:
        """How many of each logit row's largest entries the step's samplers need: the
        largest ``Segment.top_k`` where every segment asks for some, else 0 (whole rows)."""
        return logits_top_k(self.segments)

    def host_logits(self, be: Backend, logits) -> list[np.ndarray]:
        """The logits of ``logit_rows`` read back, one array per segment: whole rows, or
        each row's largest where every segment's sampler needs no more (``top_k``)."""
        k = self.top_k
        return self.split(be.to_host_top(logits, k) if k else be.to_host(logits))

    def split(self, logits: np.ndarray) -> list[np.ndarray]:
        """The host logits of ``logit_rows``, one array per segment."""
        out, at = [], 0
        for seg in self.segments:
            n = 1 if seg.logit_rows is None else len(seg.logit_rows)
            out.append(logits[at : at + n])
            at += n
        return out


class BaseModel:
    """The protocol the generation loop drives (subclasses implement ``forward``)."""

    args: CommonArgs
    backend: Backend

    def new_cache(self, n_ctx: int) -> KVCache:
        a = self.args
        return self.backend.new_kv_cache(
            a.n_layers, n_ctx, a.n_kv_heads, a.head_dim_k, a.head_dim_v
        )

    def forward(
        self,
        tokens: np.ndarray,
        start: int,
        cache: KVCache,
        logit_rows: np.ndarray | None = None,
        top_k: int = 0,
    ) -> np.ndarray:
        """Run ``tokens`` at positions ``start ..``; return logits for ``logit_rows``.

        ``logit_rows`` selects which of the batch's tokens get logits (default: the last);
        the result is a host float32 array (len(logit_rows), n_vocab), or with ``top_k``
        possibly each row's largest logits alone (``Segment``).
        """
        segments = [Segment(np.asarray(tokens), start, cache, logit_rows, top_k)]
        return self.backend.forward_step(self, segments)[0]  # default: forward_batch

    def forward_batch(self, segments: list[Segment]) -> list[np.ndarray]:
        """Run several sequences in one pass; host logits per segment."""
        raise NotImplementedError
