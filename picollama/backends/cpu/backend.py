"""The CPU backend: numpy arrays, Numba kernels, weights as zero-copy views into the mmap."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numba
import numpy as np

from picollama.backends.base import Backend, BackendError, KVCache, Weight
from picollama.backends.cpu import ggml_math, kernels, lora_kernels, ops, qdot, simd_x8, step
from picollama.gguf.constants import GGMLType, row_nbytes

__all__ = ["CPUBackend", "CPUWeight"]


@dataclass(eq=False)
class CPUWeight(Weight):
    """A weight's rows as the file has them (``data``, a view into the mmap) and, once a
    product has needed them, the same weights in the x8 layout (``simd_x8``) for Q4_0,
    Q4_1, Q5_0, Q8_0 and Q4_K matrices: made at the first product, never for a table only
    looked up (an embedding; a tied one, also the output matrix, is held both ways)."""

    x8: np.ndarray | None = field(default=None, repr=False)


class CPUBackend(Backend):
    """The reference backend: what the GPU backends are checked against.

    ``arithmetic`` "ggml" (default) computes as llama.cpp's CPU backend does, so answers
    track llama.cpp's: each activation row is quantized to the weight type's dot type
    (Q8_0, Q8_1 or Q8_K) and integer products are summed per block (``qdot``, ``simd``);
    the KV cache is F16 and attention follows ggml's flash attention (``attention``); SiLU
    and GELU use ggml's approximations (``ggml_math``). "exact" dequantizes the weights to
    float32 inside the dot product, keeps a float32 cache and computes activations in
    float32: the closer-to-exact reference.

    ``repack`` (default on, llama.cpp's ``--no-repack`` turns it off there too): Q4_0, Q4_1,
    Q5_0, Q8_0 and Q4_K matrices of a multiple of 8 rows are multiplied in the x8 layout
    (``simd_x8``), up to 2.6 times as fast; their results then differ from ggml's
    ``vec_dot`` by float32 rounding (as llama.cpp's own repacked Q4_0 does). Off, every
    product is ggml's ``vec_dot`` bit for bit.
    """

    name = "cpu"

    def __init__(self, n_threads: int | None = None, arithmetic: str = "ggml", repack: bool = True):
        if arithmetic not in ("ggml", "exact"):
            raise BackendError(f"unknown CPU arithmetic '{arithmetic}' (ggml or exact)")
        self.arithmetic = arithmetic
        self.repack = bool(repack)
        self._repack_lock = threading.Lock()
        if n_threads is None or n_threads <= 0:
            n_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
            n_threads = n_threads or os.cpu_count() or 1
        self.n_threads = min(int(n_threads), numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(self.n_threads)
        self._weight_bytes = 0
        self._x8_bytes = 0
        self._kv_bytes = 0
        self.compiled_steps = True
        # compile the step interpreter in a thread, decoding op by op meanwhile (the CLI and
        # the server set it: a fresh machine's first compile takes about a minute)
        self.compile_in_background = False
        self._steps = step.StepCompiler(self)

    def finish_compiling(self, notify=None) -> None:
        """Wait for a step compile running in the background (``compile_in_background``),
        calling ``notify()`` first if there is one: a process that exits before it ends
        would leave nothing in the disk cache, and its next run would compile again."""
        if step.BACKGROUND.pending():
            if notify is not None:
                notify()
            step.BACKGROUND.wait()

    # -- memory ---------------------------------------------------------------------------

    def weight(self, name: str, ggml_type: GGMLType, shape: tuple[int, ...], data) -> Weight:
        if not kernels.supports(ggml_type):
            raise BackendError(
                f"tensor '{name}': type {GGMLType(ggml_type).name} is not supported by the "
                "CPU backend"
            )
        k = shape[0]
        m = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        rows = data.reshape(m, row_nbytes(ggml_type, k))
        self._weight_bytes += rows.nbytes
        return CPUWeight(name, GGMLType(ggml_type), tuple(shape), rows)

    def x8_rows(self, w: Weight) -> np.ndarray | None:
        """``w``'s rows in the x8 layout when its products use it (made the first time,
        kept on the weight), else None."""
        if not (
            self.repack
            and self.arithmetic == "ggml"
            and isinstance(w, CPUWeight)
            and w.type in simd_x8.X8_TYPES
            and w.m % simd_x8.X8_ROWS == 0
        ):
            return None
        if w.x8 is None:
            with self._repack_lock:
                if w.x8 is None:
                    w.x8 = simd_x8.repack(w.data, w.type)
                    self._x8_bytes += w.x8.nbytes
        return w.x8

    def from_host(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def new_kv_cache(
        self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int
    ) -> KVCache:
        # "ggml": an F16 cache as llama.cpp's default (-ctk/-ctv f16), kept as uint16 bits since
        # Numba has no half type; "exact": float32
        dtype = np.uint16 if self.arithmetic == "ggml" else np.float32
        cache = KVCache(n_ctx, n_kv_heads, head_dim_k, head_dim_v)
        # one block per K and V, the layers' arrays views of it (a compiled step takes the
        # blocks whole)
        k = np.zeros((n_layers, n_ctx, n_kv_heads, head_dim_k), dtype)
        v = np.zeros((n_layers, n_ctx, n_kv_heads, head_dim_v), dtype)
        cache.k.extend(k[i] for i in range(n_layers))
        cache.v.extend(v[i] for i in range(n_layers))
        self._kv_bytes += sum(a.nbytes for a in cache.k) + sum(a.nbytes for a in cache.v)
        return cache

    def memory_report(self) -> dict[str, int]:
        # "repacked": the x8 copies made so far (in memory beside the file's mapped pages)
        return {
            "weights": self._weight_bytes,
            "repacked": self._x8_bytes,
            "kv_cache": self._kv_bytes,
        }

    def supports(self, op: str, ggml_type: GGMLType | None = None) -> bool:
        if ggml_type is not None:
            return op in ("matmul", "get_rows", "weight") and kernels.supports(ggml_type)
        return callable(getattr(self, op, None))

    # -- compute --------------------------------------------------------------------------

    def matmul(self, x: np.ndarray, w: Weight) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        x8 = self.x8_rows(w)
        if x8 is not None:
            return simd_x8.matmul_x8(x, [x8], w.type, w.k)[0]
        if self.arithmetic == "ggml" and qdot.supports(w.type):
            return qdot.matmul_q8(x, w.data, w.type, w.k)
        return kernels.matmul(x, w.data, w.type, w.k)

    def matmul_many(self, x: np.ndarray, ws) -> list[np.ndarray]:
        qtype = ws[0].type
        x8s = [self.x8_rows(w) for w in ws]
        if 2 <= len(ws) <= 3 and all(
            a is not None and w.type == qtype and w.k == ws[0].k
            for a, w in zip(x8s, ws, strict=True)
        ):
            return simd_x8.matmul_x8(x, x8s, qtype, ws[0].k)
        if (
            self.arithmetic == "ggml"
            and 2 <= len(ws) <= 3
            and qtype in qdot.SIMD_TYPES
            and all(w.type == qtype and w.k == ws[0].k for w in ws)
        ):
            return qdot.matmul_many_q8(x, [w.data for w in ws], qtype, ws[0].k)
        return [self.matmul(x, w) for w in ws]

    def gated_ffn(self, x, w_gate: Weight, w_up: Weight, act: str) -> np.ndarray:
        gate, up = self.matmul_many(x, (w_gate, w_up))
        if self.arithmetic == "ggml":
            fused = ggml_math.silu_mul if act == "silu" else ggml_math.gelu_mul
            return fused(gate, up)
        return ops.silu_mul(gate, up) if act == "silu" else ops.gelu_mul(gate, up)

    def lora_weights(self, a: Weight, b: Weight) -> tuple[Weight, Weight]:
        # F32/F16 adapters (llama.cpp's converter writes those) run fused, with B transposed
        if a.type in lora_kernels.LORA_TYPES and b.type in lora_kernels.LORA_TYPES:
            return a, lora_kernels.transpose_b(b)
        return a, b

    def lora_add(self, y, x, a: Weight, b: Weight, s: float) -> np.ndarray:
        # one fused pass, which the compiled decode step calls too; other types as matmuls
        if isinstance(b, lora_kernels.LoraB):
            return lora_kernels.lora_add(y, x, a, b, s)
        return super().lora_add(y, x, a, b, s)

    def get_rows(self, w: Weight, ids: np.ndarray) -> np.ndarray:
        return kernels.get_rows(w.data, np.asarray(ids, dtype=np.int64), w.type, w.k)

    def rms_norm(self, x, weight, eps):
        return ops.rms_norm(x, weight, eps)

    def rope(self, x, positions, n_rot, freq_base, freq_scale=1.0, neox=False):
        return ops.rope(
            x, positions, n_rot, freq_base, freq_scale, neox, fused=self.arithmetic == "ggml"
        )

    def store_kv(self, cache: KVCache, layer: int, k, v, start: int) -> None:
        n = k.shape[0]
        if start + n > cache.n_ctx:
            raise BackendError(f"KV cache of {cache.n_ctx} positions overflows at {start + n}")
        if cache.k[layer].dtype == np.uint16:  # round to nearest even, as ggml's F16 copy
            k = np.asarray(k, np.float32).astype(np.float16).view(np.uint16)
            v = np.asarray(v, np.float32).astype(np.float16).view(np.uint16)
        cache.k[layer][start : start + n] = k
        cache.v[layer][start : start + n] = v

    def attention(self, q, cache, layer, start, scale, window=0, softcap=0.0):
        return ops.attention(q, cache.k[layer], cache.v[layer], start, scale, window, softcap)

    def silu_mul(self, gate, up):
        if self.arithmetic == "ggml":
            return ggml_math.silu_mul(gate, up)
        return ops.silu_mul(gate, up)

    def gelu_mul(self, gate, up):
        if self.arithmetic == "ggml":
            return ggml_math.gelu_mul(gate, up)
        return ops.gelu_mul(gate, up)

    def add(self, a, b):
        return np.add(a, b, dtype=np.float32)

    def mul(self, a, b):
        return np.multiply(a, b, dtype=np.float32)

    def scale(self, x, s):
        return np.multiply(x, np.float32(s), dtype=np.float32)

    def softcap(self, x, cap):
        return ops.softcap(x, cap)

    def concat(self, parts):
        return np.concatenate(parts, axis=0)

    def forward_step(self, model, segments: list) -> list[np.ndarray]:
        """A single-token step through its compiled program (``step``) once it is proven
        identical to the op-by-op pass; everything else op by op."""
        if self.arithmetic != "ggml" or not self.compiled_steps:
            return model.forward_batch(segments)
        return self._steps.forward_step(model, segments)

    def take_rows(self, x, rows):
        return np.ascontiguousarray(x[np.asarray(rows)])
