"""LoRA adapters in GGUF, applied at run time: ``y = W x + scale * (alpha / rank) * B (A x)``.

An adapter file is what llama.cpp's ``convert_lora_to_gguf.py`` (or ``picollama-convert
--lora``) writes: ``general.type = "adapter"``, ``adapter.type = "lora"``,
``adapter.lora.alpha``, and for each adapted weight ``<name>.lora_a`` (GGUF shape ``(k, r)``:
r rows of the weight's k inputs) and ``<name>.lora_b`` (``(r, m)``: the weight's m outputs).

The base model is never modified or copied. ``with_adapters(model, [(adapter, scale)])``
returns a view of the model (a shallow copy sharing every weight) whose backend is a
``LoraBackend``: a proxy that adds each adapter's term after the matmuls of the weights it
adapts, through the backend's ``lora_add`` op. Several adapters stack (their terms add up);
switching adapters is taking another view, so nothing is reloaded; the CPU backend compiles
each view's decode step once (``backends.cpu.step`` traces ``lora_add`` as one op).

``LoraSet`` is what the API and the server hold: the adapters loaded for an engine, by id,
each with a global scale (llama-server's ``/lora-adapters``), and the views per scale set.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from picollama.backends.base import BackendError, Weight
from picollama.gguf import GGUFError, GGUFReader
from picollama.gguf.constants import GGMLType

__all__ = [
    "LoraError",
    "LoraAdapter",
    "LoraBackend",
    "LoraSet",
    "with_adapters",
    "model_weights",
    "write_random_adapter",
]

_SUFFIX_A = ".lora_a"
_SUFFIX_B = ".lora_b"
# llama.cpp applies a token_embd adapter to the embedding lookup, not to a matmul; with tied
# embeddings our output matmul reads token_embd, so such an adapter would land in the wrong
# place: refused at load
_NOT_MATMUL = ("token_embd.weight",)


class LoraError(ValueError):
    """An adapter file that does not fit the model, or a bad adapter id or scale."""


@dataclass
class _Pair:
    base: Weight
    a: Weight  # r rows of base.k inputs
    b: Weight  # base.m rows of r inputs
    rank: int  # r as in the file (a backend may hold it padded with zeros)


@dataclass
class _Tensor:
    """A slice of an adapter tensor, shaped like the reader's ``TensorInfo``."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray


def _split_parts(weights: dict[str, Weight], name: str) -> list[Weight]:
    """The row ranges ``name[0]``, ``name[1]``, ... a model split the weight ``name`` into."""
    parts = []
    while f"{name}[{len(parts)}]" in weights:
        parts.append(weights[f"{name}[{len(parts)}]"])
    return parts


# bytes per entry of the float types a rank can be padded in
_FLOAT_ENTRY = {GGMLType.F32: 4, GGMLType.F16: 2, GGMLType.BF16: 2}


class LoraAdapter:
    """One adapter file, checked against a model and taken into its backend.

    ``alpha`` is ``adapter.lora.alpha``; each adapted weight's term is scaled by
    ``scale * alpha / rank`` (rank: its own ``lora_b`` row length), or by ``scale`` alone
    when alpha is 0, as llama.cpp does.
    """

    def __init__(self, path: str | os.PathLike, model):
        self.path = os.fspath(path)
        try:
            self.reader = GGUFReader(self.path)
        except GGUFError as err:
            raise LoraError(f"LoRA adapter {self.path}: {err}") from None
        try:
            self._load(model)
        except BaseException:
            self.reader.close()
            raise

    def _fail(self, what: str) -> LoraError:
        return LoraError(f"LoRA adapter {self.path}: {what}")

    def _load(self, model) -> None:
        r = self.reader
        kind = r.get("general.type")
        if kind != "adapter":
            raise self._fail(f"general.type is {kind!r}, not 'adapter' (is this a model file?)")
        if r.get("adapter.type") != "lora":
            raise self._fail(f"adapter.type is {r.get('adapter.type')!r}, not 'lora'")
        self.arch = r.get("general.architecture")
        base_arch = model.args.arch
        if self.arch != base_arch:
            raise self._fail(f"architecture {self.arch!r} does not match the model's {base_arch!r}")
        if "adapter.lora.alpha" not in r.metadata:
            raise self._fail("adapter.lora.alpha is missing")
        try:
            self.alpha = float(r.get_float("adapter.lora.alpha"))
        except GGUFError as err:
            raise self._fail(str(err)) from None
        if r.get("adapter.alora.invocation_tokens") is not None:
            raise self._fail("activated LoRA (aLoRA invocation tokens) is not supported")

        weights = model_weights(model)
        halves: dict[str, dict[str, object]] = {}
        for info in r.tensors:
            if info.name.endswith(_SUFFIX_A):
                halves.setdefault(info.name[: -len(_SUFFIX_A)], {})["a"] = info
            elif info.name.endswith(_SUFFIX_B):
                halves.setdefault(info.name[: -len(_SUFFIX_B)], {})["b"] = info
            else:
                raise self._fail(f"tensor '{info.name}' is not a .lora_a/.lora_b tensor")
        if not halves:
            raise self._fail("no LoRA tensors")
        backend = model.backend
        self.pairs: dict[str, _Pair] = {}
        for name, half in halves.items():
            if "a" not in half or "b" not in half:
                missing = _SUFFIX_A if "a" not in half else _SUFFIX_B
                raise self._fail(
                    f"tensor '{name}{missing}' is missing (LoRA tensors come in pairs)"
                )
            if name in _NOT_MATMUL:
                raise self._fail(f"a LoRA on '{name}' (the embedding table) is not supported")
            # a model may hold a fused weight as row ranges ("attn_qkv.weight[0]", ...): the
            # term on each is B's rows of that range times the same A x
            parts = [weights[name]] if name in weights else _split_parts(weights, name)
            if not parts:
                raise self._fail(f"'{name}' is not a weight of the model")
            a, b = half["a"], half["b"]
            if len(a.shape) != 2 or len(b.shape) != 2:
                raise self._fail(f"'{name}': LoRA tensors must be matrices")
            k, m = parts[0].k, sum(part.m for part in parts)
            if a.shape[0] != k or b.shape[1] != m:
                raise self._fail(
                    f"'{name}': lora_a {list(a.shape)} and lora_b {list(b.shape)} do not fit the "
                    f"weight's shape {[k, m]} (are A and B swapped?)"
                )
            if a.shape[1] != b.shape[0]:
                raise self._fail(
                    f"'{name}': lora_a {list(a.shape)} has rank {a.shape[1]} but lora_b "
                    f"{list(b.shape)} has rank {b.shape[0]}"
                )
            row_bytes, row = b.data.nbytes // m, 0
            for i, part in enumerate(parts):
                b_part = b
                if len(parts) > 1:
                    data = b.data[row * row_bytes : (row + part.m) * row_bytes]
                    b_part = _Tensor(f"{b.name}[{i}]", b.type, (b.shape[0], part.m), data)
                wa, wb = self._take(backend, a, b_part)
                self.pairs[part.name] = _Pair(part, wa, wb, int(a.shape[1]))
                row += part.m

    def _take(self, backend, a, b) -> tuple[Weight, Weight]:
        """The pair on the backend. GPU kernels read rows in blocks of 32 (or 256) weights,
        which a lora_b row of r = 8 or 16 is not: there the rank is padded with zeros (zero
        rows of A, zero columns of B), which leaves B A unchanged."""
        try:
            wa = backend.weight(a.name, a.type, tuple(a.shape), a.data)
            wb = backend.weight(b.name, b.type, tuple(b.shape), b.data)
            return backend.lora_weights(wa, wb)
        except BackendError as err:
            first = err
        entry = _FLOAT_ENTRY.get(b.type)
        r, m = int(a.shape[1]), int(b.shape[1])
        for multiple in (32, 256):
            rp = -(-r // multiple) * multiple
            if entry is None or rp == r:
                continue
            a_rows = np.asarray(a.data).reshape(r, -1)
            a_pad = np.zeros((rp, a_rows.shape[1]), np.uint8)
            a_pad[:r] = a_rows
            b_pad = np.zeros((m, rp * entry), np.uint8)
            b_pad[:, : r * entry] = np.asarray(b.data).reshape(m, r * entry)
            try:
                wa = backend.weight(a.name, a.type, (int(a.shape[0]), rp), a_pad.reshape(-1))
                wb = backend.weight(b.name, b.type, (rp, m), b_pad.reshape(-1))
                return backend.lora_weights(wa, wb)
            except BackendError:
                continue
        raise self._fail(str(first))

    def term_scale(self, pair: _Pair, scale: float) -> float:
        return scale * self.alpha / pair.rank if self.alpha else scale

    def close(self) -> None:
        self.reader.close()

    def __repr__(self) -> str:
        return f"LoraAdapter({self.path!r}, alpha={self.alpha}, {len(self.pairs)} weights)"


def model_weights(model) -> dict[str, Weight]:
    """Every ``Weight`` a model holds, by GGUF name (attributes, lists of layers, layers)."""
    found: dict[str, Weight] = {}

    def visit(obj, depth: int) -> None:
        if isinstance(obj, Weight):
            found.setdefault(obj.name, obj)
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for value in vars(obj).values():
                visit(value, depth + 1)

    for value in vars(model).values():
        visit(value, 0)
    return found


class LoraBackend:
    """A backend proxy: every op goes to ``inner``; the matmuls of adapted weights get each
    adapter's term added (``inner.lora_add``). ``table`` maps a weight name to its
    ``(a, b, scale)`` terms, scale already ``scale * alpha / rank``."""

    def __init__(self, inner, table: dict[str, list[tuple[Weight, Weight, float]]]):
        self.inner = inner
        self.table = table

    def __getattr__(self, name):
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def rebind(self, inner) -> LoraBackend:
        """The same adapters over another backend (the CPU step compiler's tracer)."""
        return LoraBackend(inner, self.table)

    def _terms(self, y, x, w: Weight):
        for a, b, s in self.table.get(w.name, ()):
            y = self.inner.lora_add(y, x, a, b, s)
        return y

    def matmul(self, x, w: Weight):
        return self._terms(self.inner.matmul(x, w), x, w)

    def matmul_many(self, x, ws):
        ys = self.inner.matmul_many(x, ws)
        return [self._terms(y, x, w) for y, w in zip(ys, ws, strict=True)]

    def gated_ffn(self, x, w_gate: Weight, w_up: Weight, act: str):
        if w_gate.name not in self.table and w_up.name not in self.table:
            return self.inner.gated_ffn(x, w_gate, w_up, act)
        gate, up = self.matmul_many(x, (w_gate, w_up))
        if act == "silu":
            return self.inner.silu_mul(gate, up)
        return self.inner.gelu_mul(gate, up)


def _base_model(model):
    backend = model.backend
    while isinstance(backend, LoraBackend):
        model = model._lora_base
        backend = model.backend
    return model


def with_adapters(model, adapters: Iterable[tuple[LoraAdapter, float]]):
    """A view of ``model`` with ``adapters`` (adapter, scale) applied; ``model`` itself when
    every scale is 0. The view shares the model's weights and backend."""
    base = _base_model(model)
    table: dict[str, list[tuple[Weight, Weight, float]]] = {}
    for adapter, scale in adapters:
        scale = float(scale)
        if scale == 0.0:
            continue
        for name, pair in adapter.pairs.items():
            table.setdefault(name, []).append((pair.a, pair.b, adapter.term_scale(pair, scale)))
    if not table:
        return base
    view = copy.copy(base)
    view.backend = LoraBackend(base.backend, table)
    view._lora_base = base
    return view


class LoraSet:
    """The adapters loaded for one model, by id (their order), with global scales.

    ``specs`` are ``(path, scale)`` pairs. ``model_for(scales)`` gives the model view for a
    scale per adapter (None: the global scales), cached, so each set of scales is built (and
    on the CPU, compiled) once.
    """

    # views kept per scale set; beyond this the oldest is dropped (a client may send any
    # floats)
    MAX_VIEWS = 16

    def __init__(self, model, specs: Sequence[tuple[str | os.PathLike, float]] = ()):
        self.model = _base_model(model)
        self.adapters: list[LoraAdapter] = []
        self.scales: list[float] = []
        self._views: dict[tuple[float, ...], object] = {}
        try:
            for path, scale in specs:
                self.adapters.append(LoraAdapter(path, self.model))
                self.scales.append(_check_scale(scale, f"adapter {path}"))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.adapters)

    def model_for(self, scales: Sequence[float] | None = None):
        scales = tuple(self.scales if scales is None else scales)
        if len(scales) != len(self.adapters):
            raise LoraError(f"{len(scales)} scales for {len(self.adapters)} adapters")
        view = self._views.get(scales)
        if view is None:
            view = with_adapters(self.model, zip(self.adapters, scales, strict=True))
            if len(self._views) >= self.MAX_VIEWS:
                self._views.pop(next(iter(self._views)))
            self._views[scales] = view
        return view

    def describe(self, scales: Sequence[float] | None = None) -> list[dict]:
        """llama-server's ``GET /lora-adapters`` list: ``[{id, path, scale}]``."""
        scales = self.scales if scales is None else scales
        return [
            {"id": i, "path": a.path, "scale": s}
            for i, (a, s) in enumerate(zip(self.adapters, scales, strict=True))
        ]

    def parse(self, items) -> list[float]:
        """Scales from a request's ``[{"id": i, "scale": s}, ...]`` list; adapters not named
        get 0, as llama-server does. Raises ``LoraError`` naming a bad entry."""
        scales = [0.0] * len(self.adapters)
        if not isinstance(items, list):
            raise LoraError('"lora" must be a list of {"id": ..., "scale": ...} objects')
        for item in items:
            if not isinstance(item, dict) or "id" not in item or "scale" not in item:
                raise LoraError(f'LoRA entry {item!r} needs an "id" and a "scale"')
            i = item["id"]
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.adapters):
                raise LoraError(
                    f"LoRA adapter id {i!r} is not one of the {len(self.adapters)} loaded"
                )
            scales[i] = _check_scale(item["scale"], f"adapter {i}")
        return scales

    def set_scales(self, items) -> None:
        """``POST /lora-adapters``: new global scales (adapters not named go to 0)."""
        self.scales = self.parse(items)

    def close(self) -> None:
        for adapter in self.adapters:
            adapter.close()
        self._views.clear()


def _check_scale(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoraError(f"{where}: scale {value!r} is not a number")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise LoraError(f"{where}: scale {value} is not finite")
    return value


def write_random_adapter(
    model,
    path: str | os.PathLike,
    rank: int = 16,
    alpha: float | None = None,
    ggml_type=None,
    seed: int = 0,
) -> None:
    """Write a random LoRA adapter for every projection matrix of the blocks of ``model``
    (``blk.*`` weights with two axes): for tests and ``picollama-bench --lora-random``.

    ``ggml_type`` is F16 (default) or F32; ``alpha`` defaults to ``rank`` (scale 1). The
    terms are about a tenth of a typical activation, so outputs move without diverging.
    """
    from picollama.gguf.writer import GGUFWriter

    ggml_type = GGMLType.F16 if ggml_type is None else GGMLType(ggml_type)
    if ggml_type not in (GGMLType.F16, GGMLType.F32):
        raise LoraError(f"random adapters are F16 or F32, not {ggml_type.name}")
    if rank <= 0:
        raise LoraError(f"rank must be positive, got {rank}")
    dtype = np.float16 if ggml_type == GGMLType.F16 else np.float32
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch=model.args.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank if alpha is None else alpha))
    # the file's weights: row ranges a model split a fused weight into count as one
    shapes: dict[str, tuple[int, int]] = {}
    for name, w in sorted(model_weights(model).items()):
        if not name.startswith("blk.") or len(w.shape) != 2:
            continue
        base = re.sub(r"\[\d+\]$", "", name)
        k, m = shapes.get(base, (w.k, 0))
        shapes[base] = (k, m + w.m)
    for name, (k, m) in shapes.items():
        a = rng.standard_normal((rank, k)) / np.sqrt(k)  # (r, k): GGUF (k, r)
        b = rng.standard_normal((m, rank)) * (0.1 / np.sqrt(rank))  # (m, r): GGUF (r, m)
        writer.add_tensor(name + _SUFFIX_A, a.astype(dtype))
        writer.add_tensor(name + _SUFFIX_B, b.astype(dtype))
    writer.write()
