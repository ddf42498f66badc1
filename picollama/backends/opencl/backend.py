"""The OpenCL backend: PyOpenCL buffers, OpenCL C 1.2 kernels, weights kept quantized.

Device. ``device=`` picks a platform and device (see ``device.py``); without it a GPU is
preferred, else the first device, which on a machine with only ``pip install
'picollama[opencl]'`` is PoCL's CPU device. The kernels use nothing beyond core OpenCL 1.2
except what the device reports (double precision, hardware FMA), with float32 fallbacks.

Memory. Each weight is copied to the device once, in its quantized form (the file's bytes,
regrouped field by field as the CUDA backend does: ``cuda/layout.py``), and the KV cache is
F16 on the device. Activations are float32 ``CLArray`` views into buffers from a memory
pool. OpenCL has no portable "free memory" query, so the backend counts what it allocates
against the device's global memory and its largest single buffer: a weight or cache that
would not fit raises ``BackendError`` naming the tensor and the sizes, before it is
allocated. ``memory_report()`` gives weights, KV cache, pool workspace and device totals.

Compute. ``matmul`` runs a fused dequantize-and-dot kernel (``quant.cl``) for up to
``mv_max_tokens`` rows of x (decode, short batches) and, on GPUs, a tiled kernel with local
memory for more (prefill; CPU devices run the first kernel over groups of tokens instead,
see ``programs.py``); both dequantize 32 weights at a time with ggml's float32 operations
and accumulate float32 dot products. Attention is flash-attention style over the F16 cache
(``ops.cl``), split over several work-groups for long decode contexts.

Arithmetic. Float32 throughout, as the CPU backend's "exact" arithmetic (weights dequantized
exactly, float32 dot products), with an F16 KV cache; so results agree with
``get_backend("cpu", arithmetic="exact")`` up to the order of float32 sums and the F16
rounding of keys and values. Not with the CPU's default "ggml" arithmetic, which also
rounds each activation row to 8 bits before the dot products.
"""

from __future__ import annotations

import logging
import math
import os
import warnings

import numpy as np

from picollama.backends.base import Backend, BackendError, KVCache, Weight
from picollama.backends.cuda import layout
from picollama.backends.opencl import programs
from picollama.backends.opencl.array import CLArray
from picollama.backends.opencl.device import DeviceInfo, select_device
from picollama.gguf.constants import GGMLType

__all__ = ["OpenCLBackend"]

log = logging.getLogger("picollama.opencl")

_EW_WG = 64  # work-items per work-group of the elementwise kernels
_RED_WG = 64  # ops.cl's RED_WG
_ATT_WG = 64  # ops.cl's ATT_WG
_ATT_MAXD = 256  # ops.cl's ATT_MAXD
_ATT_SPLIT = 512  # decode: keys per attention work-group before the range is split
_ATT_MAX_SPLITS = 64
_MEM_MARGIN = 64 << 20  # bytes of device memory kept free for the runtime and small buffers


def _import_pyopencl():
    try:
        import pyopencl as cl
        import pyopencl.tools  # noqa: F401  (the memory pool)
    except ImportError as err:
        raise BackendError(
            "the OpenCL backend needs PyOpenCL, and an OpenCL runtime (pip install "
            f"'picollama[opencl]' installs both, with PoCL for the CPU): {err}"
        ) from None
    return cl


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class _DeviceWeight:
    """A weight on the device: its field-major bytes and what the kernels need to read them."""

    __slots__ = ("buf", "qtype", "k", "m", "n_blocks", "nbytes")

    def __init__(self, buf, qtype: GGMLType, k: int, m: int, n_blocks: int, nbytes: int):
        self.buf = buf
        self.qtype = qtype
        self.k = k
        self.m = m
        self.n_blocks = n_blocks
        self.nbytes = nbytes


class OpenCLBackend(Backend):
    """Runs the op interface on an OpenCL device through PyOpenCL.

    ``device`` picks the device (an index, ``"platform:device"`` or a name; see
    ``device.py``). ``n_threads`` caps PoCL's CPU threads (it sets ``POCL_MAX_PTHREAD_COUNT``
    unless already set; PoCL reads it once per process, when the platforms are first listed),
    and is ignored by other devices. ``fp64`` (default: when the device has it) computes
    sums of squares and transcendentals in double, as the CPU backend; False forces the
    float32 fallback. ``mv_lanes`` sets the work-items per row of the matvec kernel (default
    1 on CPUs, 16 on GPUs).
    """

    name = "opencl"

    def __init__(
        self,
        n_threads: int | None = None,
        device: int | str | None = None,
        fp64: bool | None = None,
        mv_lanes: int | None = None,
    ):
        cl = _import_pyopencl()
        self.cl = cl
        if n_threads and n_threads > 0:
            os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", str(int(n_threads)))
        info = select_device(cl, device)
        self.info: DeviceInfo = info
        self.device_name = info.label
        if not info.little_endian:
            raise BackendError(f"{info.label} is big-endian; GGUF weights are little-endian")
        if info.max_work_group < max(_RED_WG, _ATT_WG):
            raise BackendError(
                f"{info.label} allows work-groups of {info.max_work_group} work-items; the "
                f"kernels need {max(_RED_WG, _ATT_WG)}"
            )
        if fp64 and not info.fp64:
            raise BackendError(f"{info.label} has no double precision (cl_khr_fp64)")
        self.fp64 = info.fp64 if fp64 is None else bool(fp64)
        try:
            self.shape = programs.kernel_shape(info.is_cpu, info.max_work_group, mv_lanes)
        except ValueError as err:
            raise BackendError(str(err)) from None
        self.n_threads = info.compute_units if info.is_cpu else 0
        try:
            self.ctx = cl.Context([info.device])
            self.queue = cl.CommandQueue(self.ctx)
        except cl.Error as err:
            raise BackendError(f"could not open {info.label}: {err}") from None
        # activations come from a pool: buffers go back to it when their arrays are dropped,
        # and the in-order queue runs a reused buffer's next kernel after its last reader
        self._pool = cl.tools.MemoryPool(cl.tools.ImmediateAllocator(self.queue))
        self._options = programs.build_options(self.fp64, info.fma)
        ops = self._build(programs.ops_source(), "the ops")
        i32, i64, f32 = np.int32, np.int64, np.float32
        self._k_rms = self._kernel(ops, "rms_norm", [None, i32, None, i32, None, i32, f32])
        self._k_rope = self._kernel(
            ops, "rope", [None, i32, None, i32, i32, None, i32, i32, i32, i32, f32, f32, i32]
        )
        self._k_store = self._kernel(
            ops, "store_kv", [None, i32, None, i32, None, None, i32, i32, i32, i32]
        )
        self._k_att = self._kernel(
            ops,
            "attention",
            [None, i32, None, None, i32, i32, i32, i32, i32, f32, i32, f32, i32, None, None],
        )
        self._k_comb = self._kernel(ops, "attn_combine", [None, None, i32, i32, i32])
        self._k_add = self._kernel(ops, "add", [None, i32, None, i32, None, i64, i64])
        self._k_mul = self._kernel(ops, "mul", [None, i32, None, i32, None, i64, i64])
        self._k_scale = self._kernel(ops, "scale", [None, i32, f32, None, i64])
        self._k_silu = self._kernel(ops, "silu_mul", [None, i32, None, i32, None, i64])
        self._k_gelu = self._kernel(ops, "gelu_mul", [None, i32, None, i32, None, i64])
        self._k_softcap = self._kernel(ops, "softcap", [None, i32, f32, None, i64])
        self._k_gather = self._kernel(ops, "gather_rows", [None, i32, None, None, i32, i32])
        self._quant: dict[GGMLType, tuple] = {}
        self._no_ints = self._empty((1,), np.int32)  # for an int array argument left unread
        self._pending: list = []  # (event, host array) of uploads not yet known to be done
        self._weight_bytes = 0
        self._kv_bytes = 0

    # -- programs ---------------------------------------------------------------------------

    def _build(self, source: str, what: str):
        cl = self.cl
        try:
            with warnings.catch_warnings():
                # a build that succeeds with notes in its log (PoCL's ABI notes, some
                # vendors' remarks) is not the user's concern; a failed build still raises
                warnings.simplefilter("ignore", cl.CompilerWarning)
                return cl.Program(self.ctx, source).build(options=self._options)
        except cl.Error as err:
            raise BackendError(
                f"the OpenCL kernels for {what} did not compile on {self.device_name}: {err}"
            ) from None

    @staticmethod
    def _kernel(program, name: str, arg_types: list):
        kernel = getattr(program, name)
        kernel.set_scalar_arg_dtypes(arg_types)
        return kernel

    def _quant_kernels(self, qtype: GGMLType):
        """(matvec, gemm, get_rows) of one type, built on first use."""
        kernels = self._quant.get(qtype)
        if kernels is None:
            program = self._build(programs.quant_source(qtype, self.shape), qtype.name)
            i32, i64 = np.int32, np.int64
            mm_args = [None, i64, i32, i32, None, i64, i32, None, i64]
            kernels = (
                self._kernel(program, "matvec", mm_args),
                self._kernel(program, "gemm", mm_args),
                self._kernel(program, "get_rows", [None, i64, i32, i32, None, i32, None]),
            )
            self._quant[qtype] = kernels
        return kernels

    # -- memory -----------------------------------------------------------------------------

    def _reserve(self, nbytes: int, what: str) -> None:
        """Raise ``BackendError`` unless ``nbytes`` more fit on the device."""
        info = self.info
        used = self._weight_bytes + self._kv_bytes + self._workspace_bytes()
        if nbytes > info.max_alloc:
            raise BackendError(
                f"the model does not fit on {self.device_name}: {what} needs one buffer of "
                f"{_mib(nbytes)}, larger than the device's largest of {_mib(info.max_alloc)}"
            )
        if used + nbytes + _MEM_MARGIN > info.global_mem:
            raise BackendError(
                f"the model does not fit on {self.device_name}: {what} needs {_mib(nbytes)} "
                f"but {_mib(max(0, info.global_mem - used))} of {_mib(info.global_mem)} are "
                f"free (weights loaded so far: {_mib(self._weight_bytes)}, KV cache: "
                f"{_mib(self._kv_bytes)})"
            )

    def _alloc(self, nbytes: int, what: str, read_only: bool = False):
        """A device buffer of its own (weights, caches), after checking that it fits."""
        cl = self.cl
        self._reserve(nbytes, what)
        flags = cl.mem_flags.READ_ONLY if read_only else cl.mem_flags.READ_WRITE
        try:
            return cl.Buffer(self.ctx, flags, max(nbytes, 4))
        except cl.Error as err:
            raise BackendError(
                f"the model does not fit on {self.device_name}: {what}: {err}"
            ) from None

    def _workspace_bytes(self) -> int:
        """Bytes of the activation pool (in use or held for reuse)."""
        return int(getattr(self._pool, "managed_bytes", 0) or 0)

    def weight(self, name: str, ggml_type: GGMLType, shape: tuple[int, ...], data) -> Weight:
        qtype, k, m, lay, raw = layout.check_weight(name, ggml_type, shape, data, "OpenCL")
        buf = self._alloc(lay.nbytes, f"tensor '{name}'", read_only=True)
        if len(lay.regions) == 1:
            host = np.ascontiguousarray(raw.view(np.uint8))
        else:  # regroup field by field (one host copy of this tensor, then freed)
            host = np.zeros(lay.nbytes, np.uint8)
            blocks = raw.view(np.uint8).reshape(lay.n_blocks, -1)
            nb = lay.n_blocks
            for dst, src, size in lay.regions:
                host[dst : dst + size * nb].reshape(nb, size)[...] = blocks[:, src : src + size]
        self._quant_kernels(qtype)  # compile now: a type the device can't build fails at load
        try:
            self.cl.enqueue_copy(self.queue, buf, host, is_blocking=True)
        except self.cl.Error as err:
            raise BackendError(
                f"the model does not fit on {self.device_name}: tensor '{name}': {err}"
            ) from None
        self._weight_bytes += lay.nbytes
        dev = _DeviceWeight(buf, qtype, k, m, lay.n_blocks, lay.nbytes)
        return Weight(name, qtype, tuple(int(s) for s in shape), dev)

    def from_host(self, a: np.ndarray) -> CLArray:
        a = np.asarray(a)
        if a.dtype.kind == "f":
            a = a.astype(np.float32, copy=False)
        elif a.dtype.kind in "iub":
            a = a.astype(np.int32, copy=False)
        a = np.ascontiguousarray(a)
        out = self._empty(a.shape, a.dtype)
        if a.size:
            self.cl.enqueue_copy(self.queue, out.buf, a, is_blocking=True)
        return out

    def to_host(self, x: CLArray) -> np.ndarray:
        out = np.empty(x.shape, x.dtype)
        if x.size:
            self.cl.enqueue_copy(
                self.queue, out, x.buf, src_offset=x.offset * x.itemsize, is_blocking=True
            )
        self._pending.clear()
        return out

    def new_kv_cache(
        self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int
    ) -> KVCache:
        if max(head_dim_k, head_dim_v) > _ATT_MAXD:
            raise BackendError(
                f"head dimension {max(head_dim_k, head_dim_v)} is larger than the OpenCL "
                f"attention kernel's limit of {_ATT_MAXD}"
            )
        k_bytes = n_ctx * n_kv_heads * head_dim_k * 2
        v_bytes = n_ctx * n_kv_heads * head_dim_v * 2
        total = n_layers * (k_bytes + v_bytes)
        self._reserve(total, f"a KV cache of {n_ctx} positions ({_mib(total)})")
        cache = KVCache(n_ctx, n_kv_heads, head_dim_k, head_dim_v)
        what = f"the KV cache of {n_ctx} positions"
        zero = np.zeros(1, np.uint16)
        for _ in range(n_layers):
            kbuf = self._alloc(k_bytes, what)
            self._kv_bytes += k_bytes
            vbuf = self._alloc(v_bytes, what)
            self._kv_bytes += v_bytes
            for buf, size in ((kbuf, k_bytes), (vbuf, v_bytes)):  # zeros, as the CPU's cache
                if size:
                    self.cl.enqueue_fill_buffer(self.queue, buf, zero, 0, size)
            cache.k.append(CLArray(kbuf, (n_ctx, n_kv_heads, head_dim_k), np.float16))
            cache.v.append(CLArray(vbuf, (n_ctx, n_kv_heads, head_dim_v), np.float16))
        report = self.memory_report()
        log.info(
            "opencl: %s: weights %s, KV cache %s (F16), workspace %s; device memory %s",
            self.device_name,
            _mib(report["weights"]),
            _mib(report["kv_cache"]),
            _mib(report["workspace"]),
            _mib(report["device_total"]),
        )
        return cache

    def memory_report(self) -> dict[str, int]:
        return {
            "weights": self._weight_bytes,
            "kv_cache": self._kv_bytes,
            "workspace": self._workspace_bytes(),
            "device_total": self.info.global_mem,
            "device_max_alloc": self.info.max_alloc,
        }

    def supports(self, op: str, ggml_type: GGMLType | None = None) -> bool:
        if ggml_type is not None:
            try:
                qtype = GGMLType(ggml_type)
            except ValueError:
                return False
            return op in ("matmul", "get_rows", "weight") and qtype in layout.SUPPORTED_TYPES
        return callable(getattr(self, op, None))

    def synchronize(self) -> None:
        self.queue.finish()
        self._pending.clear()

    def measure_bandwidth(self, n_bytes: int | None = None, repeats: int = 5) -> float:
        """Bytes/s of a device-to-device buffer copy (read + write), the best of ``repeats``.

        ``n_bytes`` (optional, default: 1 GiB, or less where the device's largest buffer or
        an eighth of its memory is smaller) is the size of the copied buffer. Timed by the
        device's own profiling events, so host overhead does not count. ``picollama-bench``
        takes this as the decode ceiling's bandwidth.
        """
        cl = self.cl
        if n_bytes is None:
            n_bytes = min(1 << 30, self.info.max_alloc, self.info.global_mem // 8)
        n_bytes = max(4, n_bytes // 4 * 4)
        props = cl.command_queue_properties.PROFILING_ENABLE
        queue = cl.CommandQueue(self.ctx, properties=props)
        src = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, n_bytes)
        dst = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, n_bytes)
        try:
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms up
                event = cl.enqueue_copy(queue, dst, src, byte_count=n_bytes)
                event.wait()
                best = min(best, max(event.profile.end - event.profile.start, 1) * 1e-9)
        finally:
            src.release()
            dst.release()
        return 2 * n_bytes / best

    # -- helpers ----------------------------------------------------------------------------

    def _empty(self, shape, dtype=np.float32) -> CLArray:
        dtype = np.dtype(dtype)
        n = math.prod(shape)
        try:
            buf = self._pool.allocate(max(n * dtype.itemsize, 4))
        except self.cl.Error as err:
            raise BackendError(
                f"out of device memory on {self.device_name} for an array of {tuple(shape)}: {err}"
            ) from None
        return CLArray(buf, shape, dtype)

    def _upload_i32(self, values) -> CLArray:
        """A small int32 array on the device (token ids, row indices, positions)."""
        host = np.ascontiguousarray(values, dtype=np.int32)
        out = self._empty(host.shape, np.int32)
        if host.size:
            event = self.cl.enqueue_copy(self.queue, out.buf, host, is_blocking=False)
            self._pending.append((event, host))  # keep the host array until the copy is done
        return out

    def _run(self, kernel, global_size, local_size, *args) -> None:
        kernel(self.queue, global_size, local_size, *args)

    @staticmethod
    def _grid(n: int, wg: int = _EW_WG) -> tuple[int]:
        return ((n + wg - 1) // wg * wg,)

    @staticmethod
    def _f32(x: CLArray, what: str) -> CLArray:
        if x.dtype != np.float32:
            raise BackendError(f"{what}: expected a float32 array, got {x.dtype}")
        return x

    # -- compute ----------------------------------------------------------------------------

    def matmul(self, x: CLArray, w: Weight) -> CLArray:
        dw: _DeviceWeight = w.data
        x = self._f32(x, "matmul")
        k = x.shape[-1]
        if k != dw.k:
            raise BackendError(f"matmul: x has {k} features but '{w.name}' takes {dw.k}")
        n = x.size // k if k else 0
        matvec, gemm, _ = self._quant_kernels(dw.qtype)
        y = self._empty((n, dw.m))
        if n == 0:
            return y
        sh = self.shape
        weight = (dw.buf, dw.n_blocks, dw.k, dw.m)
        if n <= sh.mv_max_tokens or not sh.tiled:
            rows_per_wg = sh.mv_wg // sh.mv_lpr
            grid = ((dw.m + rows_per_wg - 1) // rows_per_wg * sh.mv_wg,)
            for t0 in range(0, n, sh.mv_max_tokens):  # token groups (CPU devices)
                nt = min(sh.mv_max_tokens, n - t0)
                x_off = x.offset + t0 * k
                self._run(matvec, grid, (sh.mv_wg,), *weight, x.buf, x_off, nt, y.buf, t0 * dw.m)
        else:
            wi = sh.gemm_wm * sh.gemm_wn
            grid = ((dw.m + sh.gemm_m - 1) // sh.gemm_m * wi, (n + sh.gemm_n - 1) // sh.gemm_n)
            self._run(gemm, grid, (wi, 1), *weight, x.buf, x.offset, n, y.buf, 0)
        return y

    def get_rows(self, w: Weight, ids: np.ndarray) -> CLArray:
        dw: _DeviceWeight = w.data
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= dw.m):
            bad = ids[(ids < 0) | (ids >= dw.m)][0]
            raise BackendError(f"get_rows: row {bad} is outside '{w.name}' ({dw.m} rows)")
        _, _, get_rows = self._quant_kernels(dw.qtype)
        n = len(ids)
        out = self._empty((n, dw.k))
        if n:
            dev_ids = self._upload_i32(ids)
            cpr = dw.k // 32
            self._run(
                get_rows,
                self._grid(n * cpr),
                (_EW_WG,),
                dw.buf,
                dw.n_blocks,
                dw.k,
                dw.m,
                dev_ids.buf,
                n,
                out.buf,
            )
        return out

    def rms_norm(self, x: CLArray, weight: CLArray | None, eps: float) -> CLArray:
        x = self._f32(x, "rms_norm")
        d = x.shape[-1]
        rows = x.size // d if d else 0
        out = self._empty(x.shape)
        if rows == 0:
            return out
        if weight is not None and (weight.size != d or weight.offset):
            raise BackendError(f"rms_norm: weight of {weight.shape} for rows of {d}")
        w = weight if weight is not None else x  # not read without a weight
        self._run(
            self._k_rms,
            (rows * _RED_WG,),
            (_RED_WG,),
            x.buf,
            x.offset,
            w.buf,
            int(weight is not None),
            out.buf,
            d,
            eps,
        )
        return out

    def rope(self, x, positions, n_rot, freq_base, freq_scale=1.0, neox=False) -> CLArray:
        x = self._f32(x, "rope")
        n, n_heads, head_dim = x.shape
        if n_rot > head_dim or n_rot % 2:
            raise BackendError(f"rope: n_rot {n_rot} with head_dim {head_dim}")
        positions = np.asarray(positions).reshape(-1)
        if len(positions) != n:
            raise BackendError(f"rope: {len(positions)} positions for {n} tokens")
        # ggml's theta_scale, rounded to float32 as the CPU backend rounds it
        theta_scale = np.float32(np.float32(freq_base) ** (np.float32(-2.0) / np.float32(n_rot)))
        out = self._empty(x.shape)
        if n == 0:
            return out
        # one contiguous run of positions (a segment) goes as its first position
        pos0 = int(positions[0])
        contiguous = bool(np.array_equal(positions, np.arange(pos0, pos0 + n)))
        pos = self._no_ints if contiguous else self._upload_i32(positions)
        per_head = n_rot // 2 + head_dim - n_rot
        self._run(
            self._k_rope,
            self._grid(n * n_heads * per_head),
            (_EW_WG,),
            x.buf,
            x.offset,
            pos.buf,
            pos0,
            int(not contiguous),
            out.buf,
            n,
            n_heads,
            head_dim,
            n_rot,
            theta_scale,
            np.float32(freq_scale),
            int(bool(neox)),
        )
        return out

    def copy_kv(self, src: KVCache, dst: KVCache, start: int, end: int) -> None:
        """Buffer to buffer on the (in-order) queue, a layer's k and v rows at a time."""
        if src.geometry != dst.geometry:
            raise BackendError("copy_kv: the two KV caches differ in shape")
        if not 0 <= start <= end <= src.n_ctx:
            raise BackendError(f"copy_kv: positions {start}..{end} of {src.n_ctx}")
        if end == start:
            return
        for layer in range(src.n_layers):
            for a, b in ((src.k[layer], dst.k[layer]), (src.v[layer], dst.v[layer])):
                row = a.nbytes // a.shape[0]
                self.cl.enqueue_copy(
                    self.queue,
                    b.buf,
                    a.buf,
                    byte_count=(end - start) * row,
                    src_offset=a.offset * a.itemsize + start * row,
                    dst_offset=b.offset * b.itemsize + start * row,
                )

    def store_kv(self, cache: KVCache, layer: int, k: CLArray, v: CLArray, start: int) -> None:
        n = k.shape[0]
        if start + n > cache.n_ctx:
            raise BackendError(f"KV cache of {cache.n_ctx} positions overflows at {start + n}")
        kdim, vdim = k.size // max(n, 1), v.size // max(n, 1)
        if (
            kdim != cache.n_kv_heads * cache.head_dim_k
            or vdim != cache.n_kv_heads * cache.head_dim_v
            or v.shape[0] != n
        ):
            raise BackendError(f"store_kv: k {k.shape} / v {v.shape} do not fit the cache")
        if n == 0:
            return
        self._f32(k, "store_kv")
        self._f32(v, "store_kv")
        self._run(
            self._k_store,
            self._grid(n * (kdim + vdim)),
            (_EW_WG,),
            k.buf,
            k.offset,
            v.buf,
            v.offset,
            cache.k[layer].buf,
            cache.v[layer].buf,
            start,
            n,
            kdim,
            vdim,
        )

    def attention(self, q, cache, layer, start, scale, window=0, softcap=0.0) -> CLArray:
        q = self._f32(q, "attention")
        n, n_heads, hd = q.shape
        hdv = cache.head_dim_v
        if hd != cache.head_dim_k or n_heads % cache.n_kv_heads:
            raise BackendError(f"attention: q {q.shape} does not fit the cache")
        if start + n > cache.n_ctx:
            raise BackendError(f"attention: positions up to {start + n} past n_ctx {cache.n_ctx}")
        out = self._empty((n, n_heads * hdv))
        if n == 0:
            return out
        n_keys = start + 1 if window <= 0 else min(start + 1, window)
        n_splits = 1
        if n == 1:
            n_splits = min(_ATT_MAX_SPLITS, max(1, math.ceil(n_keys / _ATT_SPLIT)))
        chunk = math.ceil(n_keys / n_splits) if n == 1 else cache.n_ctx
        scale = np.float32(scale)
        if softcap > 0:
            scale = np.float32(scale / np.float32(softcap))  # ggml: tanh(s * scale / cap) * cap
        part = self._empty((n * n_heads * n_splits * (hdv + 2),)) if n_splits > 1 else out
        self._run(
            self._k_att,
            (n_heads * _ATT_WG, n, n_splits),
            (_ATT_WG, 1, 1),
            q.buf,
            q.offset,
            cache.k[layer].buf,
            cache.v[layer].buf,
            start,
            n_heads,
            cache.n_kv_heads,
            hd,
            hdv,
            scale,
            int(window),
            np.float32(softcap),
            chunk,
            out.buf,
            part.buf,
        )
        if n_splits > 1:
            self._run(
                self._k_comb,
                (n_heads * _EW_WG, n),
                (_EW_WG, 1),
                part.buf,
                out.buf,
                n_heads,
                hdv,
                n_splits,
            )
        return out

    def _binary(self, kernel, a: CLArray, b: CLArray, what: str) -> CLArray:
        self._f32(a, what)
        self._f32(b, what)
        if a.size % max(b.size, 1) or (b.size != a.size and b.size != a.shape[-1]):
            raise BackendError(f"{what}: shapes {a.shape} and {b.shape}")
        out = self._empty(a.shape)
        if a.size:
            self._run(
                kernel,
                self._grid(a.size),
                (_EW_WG,),
                a.buf,
                a.offset,
                b.buf,
                b.offset,
                out.buf,
                a.size,
                b.size,
            )
        return out

    def add(self, a, b) -> CLArray:
        return self._binary(self._k_add, a, b, "add")

    def mul(self, a, b) -> CLArray:
        return self._binary(self._k_mul, a, b, "mul")

    def _gated(self, kernel, gate: CLArray, up: CLArray, what: str) -> CLArray:
        self._f32(gate, what)
        self._f32(up, what)
        if gate.shape != up.shape:
            raise BackendError(f"{what}: shapes {gate.shape} and {up.shape}")
        out = self._empty(gate.shape)
        if gate.size:
            self._run(
                kernel,
                self._grid(gate.size),
                (_EW_WG,),
                gate.buf,
                gate.offset,
                up.buf,
                up.offset,
                out.buf,
                gate.size,
            )
        return out

    def silu_mul(self, gate, up) -> CLArray:
        return self._gated(self._k_silu, gate, up, "silu_mul")

    def gelu_mul(self, gate, up) -> CLArray:
        return self._gated(self._k_gelu, gate, up, "gelu_mul")

    def _unary(self, kernel, x: CLArray, value: float, what: str) -> CLArray:
        self._f32(x, what)
        out = self._empty(x.shape)
        if x.size:
            self._run(
                kernel,
                self._grid(x.size),
                (_EW_WG,),
                x.buf,
                x.offset,
                np.float32(value),
                out.buf,
                x.size,
            )
        return out

    def scale(self, x, s) -> CLArray:
        return self._unary(self._k_scale, x, s, "scale")

    def softcap(self, x, cap) -> CLArray:
        return self._unary(self._k_softcap, x, cap, "softcap")

    def concat(self, parts) -> CLArray:
        if len(parts) == 1:
            return parts[0]
        tail = parts[0].shape[1:]
        if any(p.shape[1:] != tail or p.dtype != parts[0].dtype for p in parts):
            raise BackendError(f"concat: shapes {[p.shape for p in parts]}")
        out = self._empty((sum(p.shape[0] for p in parts),) + tail, parts[0].dtype)
        at = 0
        for p in parts:
            if p.size:
                self.cl.enqueue_copy(
                    self.queue,
                    out.buf,
                    p.buf,
                    byte_count=p.nbytes,
                    src_offset=p.offset * p.itemsize,
                    dst_offset=at,
                )
            at += p.nbytes
        return out

    def take_rows(self, x, rows) -> CLArray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = x.shape[0]
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise BackendError(f"take_rows: rows {rows.tolist()} of an array of {n}")
        if len(rows) == n and np.array_equal(rows, np.arange(n)):
            return x
        self._f32(x, "take_rows")
        d = x.size // max(n, 1)
        out = self._empty((len(rows),) + tuple(x.shape[1:]))
        if out.size:
            dev_rows = self._upload_i32(rows)
            self._run(
                self._k_gather,
                self._grid(out.size),
                (_EW_WG,),
                x.buf,
                x.offset,
                dev_rows.buf,
                out.buf,
                len(rows),
                d,
            )
        return out
