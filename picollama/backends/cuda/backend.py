"""The CUDA backend: CuPy arrays, NVRTC-compiled kernels, weights kept quantized on the GPU.

Memory. Each weight is copied to the device once, in its quantized form (the file's bytes,
regrouped field by field as ``layout.py`` describes), and the KV cache is fp16 on the
device. Activations are float32 CuPy arrays. ``memory_report()`` gives the bytes of
weights, KV cache and workspace; a model that does not fit raises ``BackendError`` before
anything is half-loaded past the tensor that failed.

Compute. ``matmul`` runs a fused dequantize-and-dot kernel (``quant.cu``) for up to
``MV_MAX_TOKENS`` rows of x (decode, speculative drafts, small batches); larger batches
(prefill) dequantize tiles of the weight to float32 and multiply them with cuBLAS SGEMM.
Attention is flash-attention style (``ops.cu``): no score matrix, an online softmax over
tiles of 32 keys, split over several blocks for decode.

Decode as a CUDA graph. A forward pass of one token runs the same kernels with the same
buffers every time; only the token id and the position change. The first such pass is run
eagerly while every op and kernel launch is recorded (the kernels read the token id and the
position from a small device buffer); at its end the launches are captured into a CUDA
graph. On later passes each op only checks that it matches the recording (same op, same
weight, same cache, same shapes, its inputs the recorded buffers) and hands back the
recorded output buffer; once the first ``store_kv`` has named the cache, the id and
position are copied to the device and the whole graph is launched, so the GPU runs while
Python walks through the rest of the model. ``to_host`` then reads back the logits. If an
op does not match (another cache, another shape), the step falls back to eager execution
from that op on, after computing the ops matched so far with their recorded launches.
When the graph is captured, RMS norms that only feed matvecs, and residual adds of a
matvec's output, are folded into the matvec kernels (``_fuse``), which cuts the kernels of
a Llama layer from 16 to 12.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from picollama.backends.base import Backend, BackendError, KVCache, Weight
from picollama.backends.cuda import layout
from picollama.gguf.constants import GGMLType

__all__ = ["CUDABackend", "MV_MAX_TOKENS", "WORKSPACE_FLOATS"]

log = logging.getLogger("picollama.cuda")

MV_MAX_TOKENS = 8  # rows of x that take the fused matrix-vector kernel (quant.cu)
_MV_WARPS = 8  # warps per block of the matvec kernel (quant.cu)
_MV_PAD = 36  # floats of shared memory per chunk of 32 values of x (quant.cu)
_MV_SMEM_LIMIT = 200 << 10  # bytes of x in shared memory; more rows go through cuBLAS
WORKSPACE_FLOATS = 1 << 26  # 256 MiB of float32 for the prefill tiles of dequantized weight
_ATT_MAXD = 256  # head_dim limit of the attention kernel (ops.cu)
_ATT_SPLIT = 512  # decode: keys per attention block before the range is split further
_ATT_MAX_SPLITS = 64
_MEM_MARGIN = 64 << 20  # bytes kept free for cuBLAS, the CUDA context and small buffers
_EW_THREADS = 256  # threads per block of the elementwise kernels
_MAX_GRAPH_MISSES = 4  # divergent replays before graphs are turned off

# modes of the backend while a forward pass runs
_EAGER, _RECORD, _REPLAY = 0, 1, 2


def _import_cupy():
    try:
        import cupy
    except ImportError as err:
        raise BackendError(
            "the CUDA backend needs CuPy (pip install 'picollama[cuda]', or cupy-cuda12x / "
            f"cupy-cuda13x to match your CUDA driver): {err}"
        ) from None
    return cupy


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class _DeviceWeight:
    """A weight on the device: its field-major bytes and what the kernels need to read them."""

    buf: object  # cupy uint8 array
    qtype: GGMLType
    k: int
    m: int
    n_blocks: int
    lpr: int  # lanes of a warp per row in the matvec kernel


class _OpRecord:
    """One op of a recorded decode step."""

    __slots__ = ("key", "inputs", "out", "launch_start")

    def __init__(self, key, inputs, out, launch_start):
        self.key = key
        self.inputs = inputs  # ((root array, shape), ...)
        self.out = out
        self.launch_start = launch_start  # index of the op's first kernel launch


class _Trace:
    """A recorded decode step: its ops, their kernel launches and the captured graph."""

    def __init__(self, first_weight):
        self.first_weight = first_weight
        self.ops: list[_OpRecord] = []
        self.launches: list[tuple] = []  # (kernel, grid, block, args, shared_mem)
        self.refs: list = [first_weight]  # objects whose id() appears in the keys
        self.graph = None
        self.launch_at = -1  # the op after whose check the graph is launched
        self.n_graph_kernels = 0


def _root(a):
    base = a.base
    return a if base is None else base


class CUDABackend(Backend):
    """Runs the op interface on an NVIDIA GPU through CuPy.

    ``device`` picks the GPU (default 0). ``graphs`` (default True) captures single-token
    forward passes as CUDA graphs; ``fuse`` (default True) folds RMS norms and residual
    adds into the matvecs of those graphs. ``n_threads`` is accepted for symmetry with the
    CPU backend and ignored.
    """

    name = "cuda"

    def __init__(
        self, n_threads: int | None = None, device: int = 0, graphs: bool = True, fuse: bool = True
    ):
        cp = _import_cupy()
        self.cp = cp
        try:
            n_devices = cp.cuda.runtime.getDeviceCount()
        except cp.cuda.runtime.CUDARuntimeError as err:
            raise BackendError(f"the CUDA backend found no usable GPU: {err}") from None
        if n_devices == 0:
            raise BackendError("the CUDA backend found no GPU")
        if not 0 <= device < n_devices:
            raise BackendError(f"CUDA device {device} does not exist ({n_devices} found)")
        self.device_id = device
        self._device = cp.cuda.Device(device)
        self._device.use()
        props = cp.cuda.runtime.getDeviceProperties(device)
        name = props["name"]
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self._n_sm = int(props["multiProcessorCount"])
        self._smem_optin = int(props.get("sharedMemPerBlockOptin", 48 << 10))
        self._smem_per_sm = int(props.get("sharedMemPerMultiprocessor", 228 << 10))
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._pool = cp.get_default_memory_pool()
        try:
            with self._stream:
                self._ops = cp.RawModule(code=layout.ops_source(), options=("-std=c++17",))
                self._k_rms = self._ops.get_function("rms_norm")
                self._k_rope = self._ops.get_function("rope")
                self._k_store = self._ops.get_function("store_kv")
                self._k_att = self._ops.get_function("attention")
                self._k_comb = self._ops.get_function("attn_combine")
                self._k_add = self._ops.get_function("add")
                self._k_mul = self._ops.get_function("mul")
                self._k_scale = self._ops.get_function("scale")
                self._k_silu = self._ops.get_function("silu_mul")
                self._k_gelu = self._ops.get_function("gelu_mul")
                self._k_softcap = self._ops.get_function("softcap")
                self._k_gather = self._ops.get_function("gather_rows")
                # a decode step's token id and position (params[0] = position, [1] = id)
                self._params_dev = cp.zeros(2, dtype=cp.int32)
        except cp.cuda.compiler.CompileException as err:
            raise BackendError(f"the CUDA kernels did not compile: {err}") from None
        self._quant_mods: dict[GGMLType, tuple] = {}
        self._params_mem = cp.cuda.alloc_pinned_memory(8)
        self._params_host = np.frombuffer(self._params_mem, dtype=np.int32, count=2)
        self._readback_mem = None
        self._readback_size = 0
        self._workspace = None
        self._weight_bytes = 0
        self._kv_bytes = 0
        # decode graphs
        self.graphs = bool(graphs)
        self.fuse = bool(fuse)
        self._mode = _EAGER
        self._trace: _Trace | None = None
        self._traces: dict[int, _Trace] = {}
        self._op_i = 0
        self._launched = False
        self._step_pos: int | None = None
        self._misses = 0
        # host_s: Python time of replayed steps up to the logits read-back; wait_s: the
        # wait for the GPU there (both summed over steps)
        self.graph_stats = {
            "recorded": 0,
            "replayed": 0,
            "fallbacks": 0,
            "kernels": 0,
            "host_s": 0.0,
            "wait_s": 0.0,
        }
        self._step_t0 = 0.0
        # eager mode: device copies of host index arrays, reused within one forward pass
        self._dev_pos_src = None
        self._dev_pos = None
        self._dev_starts: dict[int, object] = {}

    # -- kernels ----------------------------------------------------------------------------

    def _quant_kernels(self, qtype: GGMLType):
        """(matvec, dequant, get_rows) of one type, compiled on first use."""
        mods = self._quant_mods.get(qtype)
        if mods is None:
            cp = self.cp
            try:
                with self._stream:
                    mod = cp.RawModule(code=layout.quant_source(qtype), options=("-std=c++17",))
                    mods = (
                        mod.get_function("matvec"),
                        mod.get_function("dequant"),
                        mod.get_function("get_rows"),
                    )
                    # x is staged in dynamic shared memory: allow more than 48 KiB
                    mods[0].max_dynamic_shared_size_bytes = min(
                        _MV_SMEM_LIMIT, self._smem_optin - 1024
                    )
            except cp.cuda.compiler.CompileException as err:
                raise BackendError(
                    f"the CUDA kernels for {qtype.name} did not compile: {err}"
                ) from None
            self._quant_mods[qtype] = mods
        return mods

    def _launch(self, kernel, grid, block, args, shared_mem=0):
        """Launch on the backend's stream (the caller holds ``with self._stream``)."""
        if self._mode == _RECORD:
            self._trace.launches.append([kernel, grid, block, list(args), shared_mem])
        kernel(grid, block, args, shared_mem=shared_mem)

    # -- memory -----------------------------------------------------------------------------

    def _reserve(self, nbytes: int, what: str) -> None:
        """Raise ``BackendError`` unless ``nbytes`` more fit on the device."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        free += self._pool.free_bytes()
        if nbytes + _MEM_MARGIN > free:
            raise BackendError(
                f"the model does not fit on {self.device_name}: {what} needs {_mib(nbytes)} "
                f"but {_mib(free)} of {_mib(total)} are free (weights loaded so far: "
                f"{_mib(self._weight_bytes)}, KV cache: {_mib(self._kv_bytes)})"
            )

    def weight(self, name: str, ggml_type: GGMLType, shape: tuple[int, ...], data) -> Weight:
        try:
            qtype = GGMLType(ggml_type)
        except ValueError:
            raise BackendError(f"tensor '{name}': unknown ggml type {ggml_type}") from None
        if qtype not in layout.SUPPORTED_TYPES:
            raise BackendError(
                f"tensor '{name}': type {qtype.name} is not supported by the CUDA backend"
            )
        k = int(shape[0])
        m = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        block = layout.chunk_block(qtype)
        if k % block:
            raise BackendError(
                f"tensor '{name}': rows of {k} weights are not a multiple of {block}, "
                "which the CUDA kernels need"
            )
        lay = layout.device_layout(qtype, k, m)
        block_bytes = layout.ggml_block_bytes(qtype)
        raw = np.asarray(data).reshape(-1)
        if raw.nbytes != lay.n_blocks * block_bytes:
            raise BackendError(
                f"tensor '{name}': {raw.nbytes} bytes of data for a {qtype.name} weight of "
                f"{k} x {m} (expected {lay.n_blocks * block_bytes})"
            )
        self._reserve(lay.nbytes + raw.nbytes, f"tensor '{name}'")
        cp = self.cp
        try:
            with self._stream:
                staged = cp.asarray(raw.reshape(lay.n_blocks, block_bytes))
                if len(lay.regions) == 1:
                    buf = staged.reshape(-1)
                else:
                    buf = cp.empty(lay.nbytes, dtype=cp.uint8)
                    nb = lay.n_blocks
                    for dst, src, size in lay.regions:
                        buf[dst : dst + size * nb].reshape(nb, size)[...] = staged[
                            :, src : src + size
                        ]
                    del staged
                self._stream.synchronize()
        except cp.cuda.memory.OutOfMemoryError as err:
            raise BackendError(
                f"the model does not fit on {self.device_name}: tensor '{name}': {err}"
            ) from None
        cpr = k // 32
        lpr = 1 << (min(32, cpr).bit_length() - 1)
        self._weight_bytes += lay.nbytes
        dev = _DeviceWeight(buf, qtype, k, m, lay.n_blocks, lpr)
        return Weight(name, qtype, tuple(int(s) for s in shape), dev)

    def from_host(self, a: np.ndarray):
        with self._stream:
            return self.cp.asarray(np.ascontiguousarray(a))

    def to_host(self, x) -> np.ndarray:
        if self._mode != _EAGER:
            return self._to_host_step(x)
        return self._read_back(x)

    def _read_back(self, x) -> np.ndarray:
        """Copy a device array to a fresh host array through a pinned buffer."""
        cp = self.cp
        x = self._contig(x)
        nbytes = x.nbytes
        if nbytes > self._readback_size:
            self._readback_mem = cp.cuda.alloc_pinned_memory(nbytes)
            self._readback_size = nbytes
        if nbytes:
            cp.cuda.runtime.memcpyAsync(
                self._readback_mem.ptr,
                x.data.ptr,
                nbytes,
                cp.cuda.runtime.memcpyDeviceToHost,
                self._stream.ptr,
            )
        self._stream.synchronize()
        host = np.frombuffer(self._readback_mem, dtype=x.dtype, count=x.size)
        return host.reshape(x.shape).copy()

    def new_kv_cache(
        self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim_k: int, head_dim_v: int
    ) -> KVCache:
        if max(head_dim_k, head_dim_v) > _ATT_MAXD:
            raise BackendError(
                f"head dimension {max(head_dim_k, head_dim_v)} is larger than the CUDA "
                f"attention kernel's limit of {_ATT_MAXD}"
            )
        per_layer = n_ctx * n_kv_heads * (head_dim_k + head_dim_v) * 2
        self._reserve(n_layers * per_layer, f"a KV cache of {n_ctx} positions")
        cp = self.cp
        cache = KVCache(n_ctx, n_kv_heads, head_dim_k, head_dim_v)
        try:
            with self._stream:
                for _ in range(n_layers):
                    cache.k.append(cp.zeros((n_ctx, n_kv_heads, head_dim_k), dtype=cp.float16))
                    cache.v.append(cp.zeros((n_ctx, n_kv_heads, head_dim_v), dtype=cp.float16))
        except cp.cuda.memory.OutOfMemoryError as err:
            raise BackendError(
                f"the KV cache of {n_ctx} positions does not fit on {self.device_name}: {err}"
            ) from None
        self._kv_bytes += n_layers * per_layer
        report = self.memory_report()
        log.info(
            "cuda: %s: weights %s, KV cache %s (fp16), workspace %s; %s free of %s",
            self.device_name,
            _mib(report["weights"]),
            _mib(report["kv_cache"]),
            _mib(report["workspace"]),
            _mib(report["device_free"]),
            _mib(report["device_total"]),
        )
        return cache

    def memory_report(self) -> dict[str, int]:
        free, total = self.cp.cuda.runtime.memGetInfo()
        workspace = 0 if self._workspace is None else int(self._workspace.nbytes)
        return {
            "weights": self._weight_bytes,
            "kv_cache": self._kv_bytes,
            "workspace": workspace,
            "device_free": int(free),
            "device_total": int(total),
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
        self._stream.synchronize()

    def measure_bandwidth(self, n_bytes: int = 1 << 30, repeats: int = 5) -> float:
        """Bytes/s of a device-to-device copy (read + write), the best of ``repeats``."""
        cp = self.cp
        with self._stream:
            src = cp.ones(n_bytes // 4, dtype=cp.float32)
            dst = cp.empty_like(src)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms up
                start.record(self._stream)
                cp.cuda.runtime.memcpyAsync(
                    dst.data.ptr,
                    src.data.ptr,
                    src.nbytes,
                    cp.cuda.runtime.memcpyDeviceToDevice,
                    self._stream.ptr,
                )
                stop.record(self._stream)
                stop.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1000.0)
            del src, dst
        return 2 * (n_bytes // 4 * 4) / best

    def clear_graphs(self) -> None:
        """Forget the recorded decode graphs (and the buffers and weights they hold)."""
        self._end_step()
        self._traces.clear()

    # -- helpers ----------------------------------------------------------------------------

    def _contig(self, x):
        if x.flags.c_contiguous:
            return x
        if self._mode == _RECORD:
            self._abort_record()
        with self._stream:
            return self.cp.ascontiguousarray(x)

    def _empty(self, shape, dtype=None):
        return self.cp.empty(shape, dtype=self.cp.float32 if dtype is None else dtype)

    def _upload_i32(self, values) -> object:
        return self.cp.asarray(np.ascontiguousarray(values, dtype=np.int32))

    def _dev_positions(self, positions: np.ndarray):
        """Positions as a device int32 array (the step's parameter buffer in a decode step)."""
        if self._mode != _EAGER:
            return self._params_dev[0:1]
        if self._dev_pos_src is not positions:
            self._dev_pos = self._upload_i32(positions)
            self._dev_pos_src = positions
        return self._dev_pos

    def _dev_start(self, start: int):
        if self._mode != _EAGER:
            return self._params_dev[0:1]
        dev = self._dev_starts.get(start)
        if dev is None:
            dev = self._dev_starts[start] = self._upload_i32([start])
        return dev

    def _upload_params(self) -> None:
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(
            self._params_dev.data.ptr,
            self._params_mem.ptr,
            8,
            cp.cuda.runtime.memcpyHostToDevice,
            self._stream.ptr,
        )

    def _grid1(self, n: int) -> tuple[int]:
        return ((n + _EW_THREADS - 1) // _EW_THREADS,)

    # -- decode graphs ----------------------------------------------------------------------

    def _begin_step(self, w: Weight, ids: np.ndarray) -> None:
        """Called by get_rows, the first op of every forward pass."""
        self._end_step()
        self._dev_pos_src = None
        self._dev_starts = {}
        if not (self.graphs and len(ids) == 1):
            return
        self._params_host[1] = int(ids[0])
        self._step_pos = None
        trace = self._traces.get(id(w))
        if trace is not None and trace.graph is not None:
            self._mode, self._trace = _REPLAY, trace
            self._op_i = 0
            self._launched = False
            self._step_t0 = time.perf_counter()
        else:
            self._mode, self._trace = _RECORD, _Trace(w)
            with self._stream:
                self._upload_params()

    def _end_step(self) -> None:
        """Leave a step that did not reach to_host (an exception in the model, say)."""
        if self._mode == _REPLAY and self._launched:
            self._stream.synchronize()
        self._mode, self._trace = _EAGER, None

    def _abort_record(self) -> None:
        """Stop recording this step (it runs on eagerly; nothing is captured)."""
        self._mode, self._trace = _EAGER, None

    def _bind_pos(self, pos: int) -> None:
        """The step's position (from rope, store_kv or attention); one per decode step."""
        if self._step_pos is None:
            self._step_pos = pos
            self._params_host[0] = pos
            if self._mode == _RECORD:
                with self._stream:
                    self._upload_params()
        elif pos != self._step_pos:
            if self._mode == _RECORD:
                self._abort_record()
            else:
                self._diverge()

    def _dispatch(self, key, inputs, run):
        """Run an op, record it, or hand back its recorded output (see the module doc)."""
        mode = self._mode
        if mode == _REPLAY:
            trace = self._trace
            i = self._op_i
            if i < len(trace.ops):
                rec = trace.ops[i]
                if rec.key == key and len(rec.inputs) == len(inputs):
                    same = True
                    for a, (root, shape) in zip(inputs, rec.inputs, strict=True):
                        if _root(a) is not root or a.shape != shape:
                            same = False
                            break
                    if same:
                        self._op_i = i + 1
                        if i == trace.launch_at and not self._launched:
                            self._launch_graph()
                        return rec.out
            self._diverge()
            return run()
        if mode == _RECORD:
            trace = self._trace
            start = len(trace.launches)
            out = run()
            if self._mode == _RECORD:  # run() may have aborted the recording
                recorded = tuple((_root(a), a.shape) for a in inputs)
                trace.ops.append(_OpRecord(key, recorded, out, start))
            return out
        return run()

    def _launch_graph(self) -> None:
        with self._stream:
            self._upload_params()
            self._trace.graph.launch(stream=self._stream)
        self._launched = True

    def _diverge(self) -> None:
        """A replayed step that does not match its recording: finish it eagerly.

        The ops matched so far are computed again with their recorded, unfused launches
        (their outputs are in the model's hands, and a fused graph leaves some of them
        unwritten); from the mismatching op on, the step runs eagerly.
        """
        trace = self._trace
        if self._launched:
            self._stream.synchronize()
        i = self._op_i
        n = trace.ops[i].launch_start if i < len(trace.ops) else len(trace.launches)
        with self._stream:
            self._upload_params()
            for kernel, grid, block, args, shm in trace.launches[:n]:
                kernel(grid, block, tuple(args), shared_mem=shm)
        self._traces.pop(id(trace.first_weight), None)
        self.graph_stats["fallbacks"] += 1
        self._misses += 1
        if self._misses >= _MAX_GRAPH_MISSES:
            log.info("cuda: decode steps keep differing from their graphs; graphs turned off")
            self.graphs = False
        self._mode, self._trace = _EAGER, None

    def _to_host_step(self, x) -> np.ndarray:
        mode, trace = self._mode, self._trace
        key = ("to_host", x.shape)
        if mode == _REPLAY:
            out = self._dispatch(key, (x,), lambda: None)
            if self._mode == _REPLAY:
                if not self._launched:
                    self._launch_graph()
                t1 = time.perf_counter()
                host = self._read_back(out)
                stats = self.graph_stats
                stats["host_s"] += t1 - self._step_t0
                stats["wait_s"] += time.perf_counter() - t1
                stats["replayed"] += 1
                self._mode, self._trace = _EAGER, None
                return host
            return self._read_back(x)  # diverged: eager from here
        # recording: read back, then capture the step's launches into a graph
        x = self._contig(x)
        if self._mode != _RECORD:  # _contig had to copy: nothing to capture
            return self._read_back(x)
        host = self._read_back(x)
        trace.ops.append(_OpRecord(key, ((_root(x), x.shape),), x, len(trace.launches)))
        self._mode, self._trace = _EAGER, None
        self._capture(trace)
        return host

    def _capture(self, trace: _Trace) -> None:
        launch_at = len(trace.ops) - 1
        for i, rec in enumerate(trace.ops):
            if rec.key[0] == "store_kv":
                launch_at = i
                break
        trace.launch_at = launch_at
        cp = self.cp
        stream = self._stream
        launches = self._fuse(trace) if self.fuse else trace.launches
        trace.n_graph_kernels = len(launches)
        try:
            with stream:
                stream.begin_capture()
                try:
                    for kernel, grid, block, args, shm in launches:
                        kernel(grid, block, tuple(args), shared_mem=shm)
                finally:
                    graph = stream.end_capture()
            trace.graph = graph
        except (
            cp.cuda.runtime.CUDARuntimeError,
            cp.cuda.driver.CUDADriverError,
            AttributeError,  # a CuPy without stream capture
        ) as err:
            log.warning("cuda: capturing a decode step failed (%s); graphs turned off", err)
            self.graphs = False
            return
        self._traces[id(trace.first_weight)] = trace
        self.graph_stats["recorded"] += 1
        self.graph_stats["kernels"] = trace.n_graph_kernels

    def _fuse(self, trace: _Trace) -> list:
        """The step's launches with RMS norms and residual adds folded into the matvecs.

        - An rms_norm whose output only feeds matvecs: each matvec normalizes its own copy
          of x in shared memory (quant.cu), and the norm's launch goes.
        - An add of a matvec's output (used nowhere else) to a same-sized array computed
          before that matvec: the matvec writes the sum into the add's output buffer.
        Both compute the same float32 operations as the kernels they replace. The recorded
        launches are left as they were (a divergent replay reruns them).
        """
        ops = trace.ops
        bounds = [rec.launch_start for rec in ops] + [len(trace.launches)]
        launches = [[k, g, b, list(a), m] for k, g, b, a, m in trace.launches]
        producer, consumers = {}, {}
        for i, rec in enumerate(ops):
            if rec.out is not None and hasattr(rec.out, "data"):
                producer.setdefault(id(_root(rec.out)), i)  # ops like take_rows pass x on
            for root, _shape in rec.inputs:
                consumers.setdefault(id(root), []).append(i)

        def only_launch(i, kernel_ids):
            if bounds[i + 1] - bounds[i] != 1:
                return None
            launch = launches[bounds[i]]
            return launch if id(launch[0]) in kernel_ids else None

        matvecs = {id(mods[0]) for mods in self._quant_mods.values()}
        dropped = set()
        for i, rec in enumerate(ops):
            if rec.key[0] == "rms_norm" and not rec.key[3]:  # has a weight
                norm = only_launch(i, {id(self._k_rms)})
                users = consumers.get(id(_root(rec.out)), [])
                if norm is None or not users:
                    continue
                targets = [only_launch(j, matvecs) for j in users]
                h_ptr, h_size = rec.out.data.ptr, rec.out.size
                if all(
                    t is not None
                    and t[3][4].data.ptr == h_ptr
                    and t[3][4].size == h_size
                    and int(t[3][2]) == int(norm[3][3])  # k == the norm's row length
                    and int(t[3][10]) == 0
                    for t in targets
                ):
                    for t in targets:
                        t[3][4], t[3][8], t[3][9], t[3][10] = (
                            norm[3][0],
                            norm[3][1],
                            norm[3][4],
                            np.int32(1),
                        )
                    dropped.add(bounds[i])
            elif rec.key[0] == "add" and rec.key[1] == rec.key[2]:
                add = only_launch(i, {id(self._k_add)})
                if add is None:
                    continue
                a, b, out = add[3][0], add[3][1], add[3][2]
                for mine, other in ((b, a), (a, b)):
                    j = producer.get(id(_root(mine)))
                    if j is None or consumers.get(id(_root(mine))) != [i]:
                        continue
                    mv = only_launch(j, matvecs)
                    if mv is None or int(mv[3][12]) != 0:
                        continue
                    if mv[3][6].data.ptr != mine.data.ptr or mv[3][6].size != mine.size:
                        continue
                    if producer.get(id(_root(other)), -1) >= j:
                        continue  # the residual is computed after the matvec
                    mv[3][6], mv[3][11], mv[3][12] = out, other, np.int32(1)
                    dropped.add(bounds[i])
                    break
        return [launch for idx, launch in enumerate(launches) if idx not in dropped]

    # -- compute ----------------------------------------------------------------------------

    def matmul(self, x, w: Weight):
        if self._mode == _EAGER:
            return self._matmul(x, w)
        self._trace_ref(w)
        return self._dispatch(("matmul", id(w), x.shape), (x,), lambda: self._matmul(x, w))

    def _trace_ref(self, obj) -> None:
        if self._mode == _RECORD:
            self._trace.refs.append(obj)

    def _matmul(self, x, w: Weight):
        dw: _DeviceWeight = w.data
        x2 = self._contig(x.reshape(-1, x.shape[-1]))
        n, k = x2.shape
        if k != dw.k:
            raise BackendError(f"matmul: x has {k} features but '{w.name}' takes {dw.k}")
        matvec, dequant, _ = self._quant_kernels(dw.qtype)
        with self._stream:
            y = self._empty((n, dw.m))
            if n == 0:
                return y
            smem = n * (k // 32) * (_MV_PAD + 2) * 4  # padded x, then its half-chunk sums
            if n <= MV_MAX_TOKENS and smem <= min(_MV_SMEM_LIMIT, self._smem_optin - 1024):
                # one wave of blocks: each stages x once and then walks through many rows
                rows_per_block = _MV_WARPS * (32 // dw.lpr)
                regs = max(1, int(getattr(matvec, "num_regs", 80)))
                per_sm = min(
                    2048 // (_MV_WARPS * 32),
                    65536 // (regs * _MV_WARPS * 32),
                    self._smem_per_sm // max(smem + 1024, 1),
                )
                n_blocks = min(
                    (dw.m + rows_per_block - 1) // rows_per_block, self._n_sm * max(1, per_sm)
                )
                args = (
                    dw.buf,
                    np.int64(dw.n_blocks),
                    np.int32(k),
                    np.int32(dw.m),
                    x2,
                    np.int32(n),
                    y,
                    np.int32(dw.lpr),
                    x2,  # norm weight: none (a graph may fuse an RMS norm here)
                    np.float32(0.0),
                    np.int32(0),
                    y,  # residual: none (a graph may fuse the residual add here)
                    np.int32(0),
                )
                self._launch(matvec, (n_blocks,), (_MV_WARPS * 32,), args, smem)
            else:
                if self._mode == _RECORD:
                    self._abort_record()
                self._gemm(x2, dw, dequant, y)
        return y

    def _gemm(self, x, dw: _DeviceWeight, dequant, y) -> None:
        """y = x @ W.T through float32 tiles of W and cuBLAS (prefill)."""
        cp = self.cp
        k, m = dw.k, dw.m
        tile_rows = max(1, min(m, WORKSPACE_FLOATS // k))
        need = tile_rows * k
        if self._workspace is None or self._workspace.size < need:
            self._workspace = None
            self._reserve(need * 4, "the prefill workspace")
            self._workspace = cp.empty(need, dtype=cp.float32)
        cpr = k // 32
        for r0 in range(0, m, tile_rows):
            nr = min(tile_rows, m - r0)
            wt = self._workspace[: nr * k].reshape(nr, k)
            args = (dw.buf, np.int64(dw.n_blocks), np.int32(k), np.int32(r0), np.int32(nr), wt)
            self._launch(dequant, self._grid1(nr * cpr), (_EW_THREADS,), args)
            if nr == m:
                cp.matmul(x, wt.T, out=y)
            else:
                y[:, r0 : r0 + nr] = cp.matmul(x, wt.T)

    def get_rows(self, w: Weight, ids: np.ndarray):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= w.m):
            bad = ids[(ids < 0) | (ids >= w.m)][0]
            raise BackendError(f"get_rows: row {bad} is outside '{w.name}' ({w.m} rows)")
        self._begin_step(w, ids)
        if self._mode == _EAGER:
            return self._get_rows(w, ids)
        return self._dispatch(("get_rows", id(w), len(ids)), (), lambda: self._get_rows(w, ids))

    def _get_rows(self, w: Weight, ids: np.ndarray):
        dw: _DeviceWeight = w.data
        _, _, get_rows = self._quant_kernels(dw.qtype)
        n = len(ids)
        with self._stream:
            out = self._empty((n, dw.k))
            if n == 0:
                return out
            dev_ids = self._params_dev[1:2] if self._mode != _EAGER else self._upload_i32(ids)
            args = (
                dw.buf,
                np.int64(dw.n_blocks),
                np.int32(dw.k),
                np.int32(dw.m),
                dev_ids,
                np.int32(n),
                out,
            )
            self._launch(get_rows, self._grid1(n * (dw.k // 32)), (_EW_THREADS,), args)
        return out

    def rms_norm(self, x, weight, eps):
        if self._mode == _EAGER:
            return self._rms_norm(x, weight, eps)
        inputs = (x,) if weight is None else (x, weight)
        key = ("rms_norm", x.shape, float(eps), weight is None)
        return self._dispatch(key, inputs, lambda: self._rms_norm(x, weight, eps))

    def _rms_norm(self, x, weight, eps):
        x = self._contig(x)
        d = x.shape[-1]
        rows = x.size // d if d else 0
        with self._stream:
            out = self._empty(x.shape)
            if rows == 0:
                return out
            if weight is not None and weight.size != d:
                raise BackendError(f"rms_norm: weight of {weight.size} for rows of {d}")
            w = weight if weight is not None else x
            args = (x, w, out, np.int32(d), np.float32(eps), np.int32(weight is not None))
            self._launch(self._k_rms, (rows,), (128 if d <= 1024 else 256,), args)
        return out

    def rope(self, x, positions, n_rot, freq_base, freq_scale=1.0, neox=False):
        positions = np.asarray(positions)
        if self._mode == _EAGER:
            return self._rope(x, positions, n_rot, freq_base, freq_scale, neox)
        if len(positions) != 1:
            if self._mode == _RECORD:
                self._abort_record()
            else:
                self._diverge()
            return self._rope(x, positions, n_rot, freq_base, freq_scale, neox)
        self._bind_pos(int(positions[0]))
        key = ("rope", x.shape, int(n_rot), float(freq_base), float(freq_scale), bool(neox))
        return self._dispatch(
            key, (x,), lambda: self._rope(x, positions, n_rot, freq_base, freq_scale, neox)
        )

    def _rope(self, x, positions, n_rot, freq_base, freq_scale, neox):
        x = self._contig(x)
        n, n_heads, head_dim = x.shape
        if n_rot > head_dim or n_rot % 2:
            raise BackendError(f"rope: n_rot {n_rot} with head_dim {head_dim}")
        # ggml's theta_scale, rounded to float32 as the CPU backend rounds it
        theta_scale = np.float32(np.float32(freq_base) ** (np.float32(-2.0) / np.float32(n_rot)))
        with self._stream:
            out = self._empty(x.shape)
            if n == 0:
                return out
            pos = self._dev_positions(positions)
            args = (
                x,
                pos,
                out,
                np.int32(n_heads),
                np.int32(head_dim),
                np.int32(n_rot),
                theta_scale,
                np.float32(freq_scale),
                np.int32(bool(neox)),
            )
            threads = min(256, max(32, (n_rot // 2 + 31) // 32 * 32))
            self._launch(self._k_rope, (n, n_heads), (threads,), args)
        return out

    def store_kv(self, cache: KVCache, layer: int, k, v, start: int) -> None:
        n = k.shape[0]
        if start + n > cache.n_ctx:
            raise BackendError(f"KV cache of {cache.n_ctx} positions overflows at {start + n}")
        if self._mode == _EAGER:
            self._store_kv(cache, layer, k, v, start)
            return
        self._bind_pos(int(start))
        if self._mode == _EAGER:
            self._store_kv(cache, layer, k, v, start)
            return
        self._trace_ref(cache)
        key = ("store_kv", id(cache), layer, k.shape, v.shape)
        self._dispatch(key, (k, v), lambda: self._store_kv(cache, layer, k, v, start))

    def _store_kv(self, cache, layer, k, v, start):
        k = self._contig(k)
        v = self._contig(v)
        n = k.shape[0]
        kdim, vdim = k.size // max(n, 1), v.size // max(n, 1)
        if (
            kdim != cache.n_kv_heads * cache.head_dim_k
            or vdim != cache.n_kv_heads * cache.head_dim_v
        ):
            raise BackendError(f"store_kv: k {k.shape} / v {v.shape} do not fit the cache")
        if n == 0:
            return
        with self._stream:
            args = (
                k,
                v,
                cache.k[layer],
                cache.v[layer],
                self._dev_start(start),
                np.int32(n),
                np.int32(kdim),
                np.int32(vdim),
                np.int32(cache.n_ctx),
            )
            self._launch(self._k_store, self._grid1(n * (kdim + vdim)), (_EW_THREADS,), args)

    def attention(self, q, cache, layer, start, scale, window=0, softcap=0.0):
        if self._mode == _EAGER:
            return self._attention(q, cache, layer, start, scale, window, softcap)
        self._bind_pos(int(start))
        if self._mode == _EAGER:
            return self._attention(q, cache, layer, start, scale, window, softcap)
        self._trace_ref(cache)
        key = ("attention", id(cache), layer, q.shape, float(scale), int(window), float(softcap))
        return self._dispatch(
            key, (q,), lambda: self._attention(q, cache, layer, start, scale, window, softcap)
        )

    def _attention(self, q, cache, layer, start, scale, window, softcap):
        q = self._contig(q)
        n, n_heads, hd = q.shape
        hdv = cache.head_dim_v
        if hd != cache.head_dim_k or n_heads % cache.n_kv_heads:
            raise BackendError(f"attention: q {q.shape} does not fit the cache")
        if start + n > cache.n_ctx:
            raise BackendError(f"attention: positions up to {start + n} past n_ctx {cache.n_ctx}")
        if n == 1:
            n_splits = min(_ATT_MAX_SPLITS, max(1, math.ceil(cache.n_ctx / _ATT_SPLIT)))
        else:
            n_splits = 1
        chunk = math.ceil(cache.n_ctx / n_splits)
        with self._stream:
            out = self._empty((n, n_heads * hdv))
            if n == 0:
                return out
            part = self._empty((n * n_heads * n_splits * (hdv + 2),)) if n_splits > 1 else out
            args = (
                q,
                cache.k[layer],
                cache.v[layer],
                self._dev_start(start),
                np.int32(n_heads),
                np.int32(cache.n_kv_heads),
                np.int32(hd),
                np.int32(hdv),
                np.float32(scale),
                np.int32(window),
                np.float32(softcap),
                np.int32(chunk),
                out,
                part,
            )
            self._launch(self._k_att, (n_heads, n, n_splits), (128,), args)
            if n_splits > 1:
                args = (part, out, np.int32(n_heads), np.int32(hdv), np.int32(n_splits))
                self._launch(self._k_comb, (n_heads, n), (128,), args)
        return out

    def _binary(self, name, kernel, a, b):
        if self._mode == _EAGER:
            return self._binary_run(kernel, a, b)
        return self._dispatch(
            (name, a.shape, b.shape), (a, b), lambda: self._binary_run(kernel, a, b)
        )

    def _binary_run(self, kernel, a, b):
        a = self._contig(a)
        b = self._contig(b)
        if a.size % max(b.size, 1) or (b.size != a.size and b.size != a.shape[-1]):
            raise BackendError(f"elementwise op: shapes {a.shape} and {b.shape}")
        with self._stream:
            out = self._empty(a.shape)
            if a.size:
                args = (a, b, out, np.int64(a.size), np.int64(b.size))
                self._launch(kernel, self._grid1(a.size), (_EW_THREADS,), args)
        return out

    def add(self, a, b):
        return self._binary("add", self._k_add, a, b)

    def mul(self, a, b):
        return self._binary("mul", self._k_mul, a, b)

    def silu_mul(self, gate, up):
        return self._gated("silu_mul", self._k_silu, gate, up)

    def gelu_mul(self, gate, up):
        return self._gated("gelu_mul", self._k_gelu, gate, up)

    def _gated(self, name, kernel, gate, up):
        if self._mode == _EAGER:
            return self._gated_run(kernel, gate, up)
        return self._dispatch(
            (name, gate.shape, up.shape), (gate, up), lambda: self._gated_run(kernel, gate, up)
        )

    def _gated_run(self, kernel, gate, up):
        gate = self._contig(gate)
        up = self._contig(up)
        if gate.shape != up.shape:
            raise BackendError(f"gated activation: shapes {gate.shape} and {up.shape}")
        with self._stream:
            out = self._empty(gate.shape)
            if gate.size:
                args = (gate, up, out, np.int64(gate.size))
                self._launch(kernel, self._grid1(gate.size), (_EW_THREADS,), args)
        return out

    def scale(self, x, s):
        return self._unary("scale", self._k_scale, x, float(s))

    def softcap(self, x, cap):
        return self._unary("softcap", self._k_softcap, x, float(cap))

    def _unary(self, name, kernel, x, value):
        if self._mode == _EAGER:
            return self._unary_run(kernel, x, value)
        return self._dispatch(
            (name, x.shape, value), (x,), lambda: self._unary_run(kernel, x, value)
        )

    def _unary_run(self, kernel, x, value):
        x = self._contig(x)
        with self._stream:
            out = self._empty(x.shape)
            if x.size:
                args = (x, np.float32(value), out, np.int64(x.size))
                self._launch(kernel, self._grid1(x.size), (_EW_THREADS,), args)
        return out

    def concat(self, parts):
        if len(parts) == 1:
            return parts[0]
        if self._mode == _RECORD:
            self._abort_record()
        elif self._mode == _REPLAY:
            self._diverge()
        with self._stream:
            return self.cp.concatenate([self._contig(p) for p in parts], axis=0)

    def take_rows(self, x, rows):
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = x.shape[0]
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise BackendError(f"take_rows: rows {rows.tolist()} of an array of {n}")
        if len(rows) == n and np.array_equal(rows, np.arange(n)):
            if self._mode == _EAGER:
                return x
            return self._dispatch(("take_rows", x.shape, "all"), (x,), lambda: x)
        if self._mode == _RECORD:
            self._abort_record()
        elif self._mode == _REPLAY:
            self._diverge()
        x = self._contig(x)
        d = x.size // max(n, 1)
        with self._stream:
            out = self._empty((len(rows),) + tuple(x.shape[1:]))
            if out.size:
                args = (x, self._upload_i32(rows), out, np.int32(len(rows)), np.int32(d))
                self._launch(self._k_gather, self._grid1(out.size), (_EW_THREADS,), args)
        return out
