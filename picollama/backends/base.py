"""The tensor op interface every backend implements, and the backend registry.

Model files are written only against ``Backend``: they never touch numpy, CuPy or PyOpenCL
arrays directly, so one forward pass runs on every backend. A backend owns its arrays
(``Array`` is whatever it uses: a numpy array on the CPU, a CuPy array on CUDA, ...) and its
weights, which stay in their quantized GGUF form; the matmul dequantizes block by block.

Shapes use the row-major numpy convention: activations are ``(n_tokens, features)``; a weight
of GGUF shape ``(k, m)`` (``ne[0] = k`` inputs per row, ``m`` rows) maps ``k`` features to
``m``. Keep where memory lives (``weight``, ``from_host``, ``new_kv_cache``) apart from what
computes (the ops).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from picollama.gguf.constants import GGMLType

__all__ = [
    "Array",
    "Weight",
    "KVCache",
    "Backend",
    "BackendError",
    "TOP_LOGITS",
    "top_logits",
    "logits_top_k",
    "BACKENDS",
    "get_backend",
    "available_backends",
    "backend_on_device",
    "device_index",
    "gpu_layers_backend",
]

Array = Any  # the backend's own array type

# A row's largest logits as ``Backend.to_host_top`` hands them back: (token id, logit) pairs,
# largest logit first, equal logits by lower id first (the order the sampler's top-k keeps).
TOP_LOGITS = np.dtype([("id", np.int32), ("logit", np.float32)])


def top_logits(logits: np.ndarray, k: int) -> np.ndarray:
    """The reference of ``Backend.to_host_top`` on the host: each row's ``k`` largest logits
    (rows, k) of ``TOP_LOGITS``. NaN ranks below every number."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1, logits.shape[-1])
    k = min(k, x.shape[1])
    out = np.empty((x.shape[0], k), dtype=TOP_LOGITS)
    for r, row in enumerate(x):
        key = np.where(np.isnan(row), -np.inf, row)
        # lexsort: its last key is the primary one; ids ascending break the ties
        order = np.lexsort((np.arange(len(row)), np.isnan(row), -key))[:k]
        out[r]["id"] = order
        out[r]["logit"] = row[order]
    return out


def logits_top_k(segments) -> int:
    """How many of each logit row's largest entries a step's samplers need: the largest
    ``Segment.top_k`` where every segment asks for some, else 0 (whole rows)."""
    if not segments or any(s.top_k <= 0 for s in segments):
        return 0
    return max(s.top_k for s in segments)


class BackendError(RuntimeError):
    """A backend that can't run here (library or device missing), or an op it can't do."""


@dataclass
class Weight:
    """A model weight as the backend holds it: quantized, never expanded to floats.

    ``data`` is backend-specific (CPU: the uint8 rows, a zero-copy view into the mmap).
    ``shape`` is the GGUF shape: ``shape[0]`` weights per row.
    """

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    data: Any

    @property
    def k(self) -> int:
        """Inputs per row (``ne[0]``)."""
        return self.shape[0]

    @property
    def m(self) -> int:
        """Number of rows (outputs of a matmul, entries of an embedding table)."""
        n = 1
        for dim in self.shape[1:]:
            n *= dim
        return n


@dataclass
class KVCache:
    """Per-layer key and value storage for ``n_ctx`` positions.

    ``k[layer]`` is ``(n_ctx, n_kv_heads, head_dim_k)`` and ``v[layer]`` is
    ``(n_ctx, n_kv_heads, head_dim_v)``, in the backend's array type. ``n_past`` is the
    number of positions written so far; the generation loop moves it (rolling back is
    just lowering it, since every position is written before it is read).
    """

    n_ctx: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    n_past: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def geometry(self) -> tuple[int, int, int, int, int]:
        """(n_layers, n_ctx, n_kv_heads, head_dim_k, head_dim_v): what two caches must share
        for rows to be copied between them or for one kernel launch to serve both."""
        return (self.n_layers, self.n_ctx, self.n_kv_heads, self.head_dim_k, self.head_dim_v)


class Backend(ABC):
    """A device and its ops. Subclasses register themselves in ``BACKENDS`` by name."""

    name: ClassVar[str] = ""

    # -- memory ---------------------------------------------------------------------------

    @abstractmethod
    def weight(self, name: str, ggml_type: GGMLType, shape: tuple[int, ...], data) -> Weight:
        """Take a weight from its GGUF bytes (a uint8 view into the mmap), kept quantized."""

    @abstractmethod
    def from_host(self, a: np.ndarray) -> Array:
        """Copy (or view) a host float32/int32 array into the backend."""

    @abstractmethod
    def to_host(self, x: Array) -> np.ndarray:
        """The array as a host numpy array (logits, for the sampler)."""

    def to_host_top(self, x: Array, k: int) -> np.ndarray:
        """Logit rows ``x`` (rows, n_vocab) for a sampler that needs only each row's ``k``
        largest: those as (rows, k) of ``TOP_LOGITS`` (``top_logits``), or, where reading
        the whole rows back costs no more (optional, default), ``to_host(x)``. Callers take
        either (``picollama.sampling.samplers.Sampler.sample`` does)."""
        return self.to_host(x)

    @abstractmethod
    def new_kv_cache(
        self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int
    ) -> KVCache:
        """Allocate a KV cache for ``n_ctx`` positions."""

    def memory_report(self) -> dict[str, int]:
        """Bytes held by weights, KV cache and workspace (optional, default: empty)."""
        return {}

    def supports(self, op: str, ggml_type: GGMLType | None = None) -> bool:
        """Whether ``op`` (and, for weight ops, weights of ``ggml_type``) can run here."""
        return hasattr(self, op) and ggml_type is None

    # -- compute --------------------------------------------------------------------------

    @abstractmethod
    def matmul(self, x: Array, w: Weight) -> Array:
        """``x @ dequant(w).T``: (n_tokens, k) -> (n_tokens, m), dequantizing block by block."""

    def matmul_many(self, x: Array, ws: tuple[Weight, ...]) -> list[Array]:
        """``[matmul(x, w) for w in ws]``: projections of the same input (Q, K and V; gate
        and up). A backend may do them in one pass, converting ``x`` once."""
        return [self.matmul(x, w) for w in ws]

    def gated_ffn(self, x: Array, w_gate: Weight, w_up: Weight, act: str) -> Array:
        """``act(x @ gate.T) * (x @ up.T)``, ``act`` "silu" (SwiGLU) or "gelu" (GeGLU)."""
        gate, up = self.matmul_many(x, (w_gate, w_up))
        return self.silu_mul(gate, up) if act == "silu" else self.gelu_mul(gate, up)

    def lora_weights(self, a: Weight, b: Weight) -> tuple[Weight, Weight]:
        """A LoRA adapter's pair as ``lora_add`` will take it: a backend may lay its small
        matrices out anew here, once at load (optional, default: as loaded)."""
        return a, b

    def lora_add(self, y: Array, x: Array, a: Weight, b: Weight, s: float) -> Array:
        """``y + s * (x @ A.T) @ B.T``: a LoRA adapter's term on the projection ``y`` of ``x``
        (``a``: r rows of k inputs, ``b``: m rows of r). ``y`` is not written (optional,
        default: two matmuls, a scale and an add)."""
        return self.add(y, self.scale(self.matmul(self.matmul(x, a), b), s))

    @abstractmethod
    def get_rows(self, w: Weight, ids: np.ndarray) -> Array:
        """Rows ``ids`` of an embedding table, dequantized: (len(ids), k)."""

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        """RMS-normalize each row of ``x`` (last axis), then scale by ``weight`` if given."""

    @abstractmethod
    def rope(
        self,
        x: Array,
        positions: np.ndarray,
        n_rot: int,
        freq_base: float,
        freq_scale: float = 1.0,
        neox: bool = False,
    ) -> Array:
        """Rotary embedding of ``x`` (n_tokens, n_heads, head_dim) at ``positions``.

        The first ``n_rot`` dims of each head rotate; pairs are adjacent ``(2i, 2i+1)`` in
        the normal ordering and ``(i, i + n_rot/2)`` in the NeoX ordering. The angle of pair
        i at position p is ``p * freq_scale * freq_base ** (-2i / n_rot)``.
        """

    @abstractmethod
    def store_kv(self, cache: KVCache, layer: int, k: Array, v: Array, start: int) -> None:
        """Write ``k``/``v`` (n_tokens, n_kv_heads, head_dim) at positions start, start+1, ..."""

    def copy_kv(self, src: KVCache, dst: KVCache, start: int, end: int) -> None:
        """Copy positions ``start .. end - 1`` of every layer from ``src`` to ``dst`` (a
        prompt prefix another sequence has computed; same geometry). A backend whose
        caches are not sliceable arrays, or that orders its work on a queue of its own,
        overrides this."""
        for layer in range(src.n_layers):
            dst.k[layer][start:end] = src.k[layer][start:end]
            dst.v[layer][start:end] = src.v[layer][start:end]

    @abstractmethod
    def attention(
        self,
        q: Array,
        cache: KVCache,
        layer: int,
        start: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Array:
        """Causal attention of ``q`` (n_tokens, n_heads, head_dim_k) at positions start...

        Keys and values come from the cache (positions ``0 .. start + n_tokens - 1``, the
        current tokens already stored). Query heads share KV heads in groups (GQA). With
        ``window`` > 0 a query at p sees only keys at p0 with ``p - p0 < window``; with
        ``softcap`` > 0 scores become ``softcap * tanh(score / softcap)`` before the softmax.
        Returns (n_tokens, n_heads * head_dim_v).
        """

    def attend_batch(
        self,
        batch,
        layer: int,
        q: Array,
        k: Array,
        v: Array,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Array:
        """``store_kv`` and ``attention`` for each sequence of a batch; rows concatenated.

        ``batch`` is a ``models.base.Batch``: its ``segments`` (tokens, start, cache) and the
        rows ``bounds`` of each in ``q``, ``k``, ``v``. A backend may do all the segments in
        one launch (the server's decode steps: one token of each of several sequences);
        each segment's result must be what the loop below gives it.
        """
        parts = []
        for seg, (a, b) in zip(batch.segments, batch.bounds, strict=True):
            self.store_kv(seg.cache, layer, k[a:b], v[a:b], seg.start)
            att = self.attention(q[a:b], seg.cache, layer, seg.start, scale, window, softcap)
            parts.append(att)
        return parts[0] if len(parts) == 1 else self.concat(parts)

    @abstractmethod
    def silu_mul(self, gate: Array, up: Array) -> Array:
        """``silu(gate) * up`` (SwiGLU)."""

    @abstractmethod
    def gelu_mul(self, gate: Array, up: Array) -> Array:
        """``gelu(gate) * up`` with the tanh approximation (GeGLU), as ggml computes it."""

    @abstractmethod
    def add(self, a: Array, b: Array) -> Array:
        """Elementwise ``a + b`` (``b`` may broadcast over rows)."""

    @abstractmethod
    def mul(self, a: Array, b: Array) -> Array:
        """Elementwise ``a * b`` (``b`` may broadcast over rows)."""

    @abstractmethod
    def scale(self, x: Array, s: float) -> Array:
        """``x * s``."""

    @abstractmethod
    def softcap(self, x: Array, cap: float) -> Array:
        """``cap * tanh(x / cap)`` (final-logit softcapping)."""

    @abstractmethod
    def concat(self, parts: list[Array]) -> Array:
        """Stack 2-D activations by rows."""

    @abstractmethod
    def take_rows(self, x: Array, rows: np.ndarray) -> Array:
        """Rows ``rows`` of a 2-D activation (keep only the tokens whose logits are wanted)."""

    def synchronize(self) -> None:
        """Wait for queued work (optional, default: nothing to wait for)."""

    def forward_step(self, model, segments: list) -> list[np.ndarray]:
        """Run one forward pass of ``model`` (optional, default: ``model.forward_batch``).

        ``BaseModel.forward`` calls this, so a backend that records decode steps may replay
        a step it has proven identical instead of walking the model's ops (the CUDA graphs).
        """
        return model.forward_batch(segments)


# name -> "module:Class"; GPU modules are imported only when asked for.
BACKENDS: dict[str, str] = {
    "cpu": "picollama.backends.cpu.backend:CPUBackend",
    "cuda": "picollama.backends.cuda.backend:CUDABackend",
    "opencl": "picollama.backends.opencl.backend:OpenCLBackend",
}


def available_backends() -> list[str]:
    return list(BACKENDS)


def get_backend(name: str = "cpu", **options) -> Backend:
    """Create the backend called ``name``; ``BackendError`` says plainly why it can't run."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})")
    module_name, class_name = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise BackendError(f"backend '{name}' is not part of this picollama build") from None
        raise BackendError(
            f"backend '{name}' needs the Python package '{err.name}', which is not installed"
        ) from None
    return getattr(module, class_name)(**options)


def device_index(device):
    """``device`` with a digit string (a command line's ``--device 1``) read as an index."""
    if isinstance(device, str) and device.strip().isdigit():
        return int(device)
    return device


def backend_on_device(name: str, device: int | str, n_threads: int | None = None) -> Backend:
    """Backend ``name`` created on ``device`` (a digit string counts as an index)."""
    device = device_index(device)
    try:
        return get_backend(name, n_threads=n_threads, device=device)
    except TypeError as err:
        if "device" not in str(err):
            raise
        raise BackendError(
            f"the {name} backend has no devices to pick (device={device!r})"
        ) from None


# the GPU backends that -ngl / n_gpu_layers tries, in order
GPU_BACKENDS = ("cuda", "opencl")


def gpu_layers_backend(
    n_gpu_layers: int | None,
    backend: str | None = None,
    *,
    device: int | str | None = None,
    main_gpu: int | None = None,
    n_threads: int | None = None,
) -> tuple[str | Backend, str | None]:
    """The backend that ``backend``, llama.cpp's ``-ngl N`` (llama-cpp-python's
    ``n_gpu_layers``) and ``device`` ask for, and a notice for the user (None when there is
    nothing to say): a name, or the backend made here where a device was picked.

    picollama runs a model wholly on one backend: no layers (0, or None: not asked) means
    ``backend`` (default the CPU); any other count (-1 or 99 for all, as the llama.cpp
    habit is, or fewer) puts every layer on a GPU: ``backend`` where one is named, else
    the CUDA backend where it starts, else OpenCL where its device is a GPU. With no usable
    GPU the model runs on the CPU and the notice says why, as llama.cpp ignores -ngl
    without one; with ``backend="cpu"`` named, -ngl is ignored. Where there is a notice,
    ``device`` (the GPU's) is dropped too; else the backend is made on it
    (``backend_on_device``: a digit string counts as an index). ``main_gpu`` (llama.cpp's
    -mg) is the device where ``device`` is None and a GPU is asked for (-ngl, or a backend
    other than the CPU's); else it is ignored, as llama.cpp ignores -mg without a GPU."""
    device = device_index(device)
    if device is None and main_gpu is not None and (n_gpu_layers or backend not in (None, "cpu")):
        device = main_gpu
    if n_gpu_layers and backend == "cpu":
        return "cpu", "-ngl (n_gpu_layers) is ignored: the cpu backend was asked for"
    if n_gpu_layers and backend is None:
        why = []
        for name in GPU_BACKENDS:
            if name == "opencl":
                missing = _opencl_gpu_missing(device)
                if missing:
                    why.append(f"opencl: {missing}")
                    continue
            try:
                if device is None:
                    return get_backend(name, n_threads=n_threads), None
                return backend_on_device(name, device, n_threads), None
            except BackendError as err:
                why.append(f"{name}: {err}")
        reasons = "; ".join(why)
        notice = "no usable GPU found, so -ngl is ignored and the cpu backend runs"
        return "cpu", f"{notice} ({reasons})"
    backend = backend or "cpu"
    if device is not None:
        return backend_on_device(backend, device, n_threads), None
    return backend, None


def _opencl_gpu_missing(device: int | str | None = None) -> str | None:
    """Why the OpenCL device that ``device`` picks (None: the default, an index: llama.cpp's
    -mg) is not a GPU here (None: it is one, or ``device`` names a device, which is taken
    as it is: ``--device pocl``)."""
    try:
        import pyopencl as cl
    except ImportError:
        return "PyOpenCL is not installed"
    from picollama.backends.opencl.device import select_device

    try:
        info = select_device(cl, device)
    except BackendError as err:
        return str(err)
    if info.kind != "CPU" or isinstance(device, str):
        return None
    return f"its device here is a CPU ({info.label})"
