"""The CUDA backend: CuPy arrays, NVRTC-compiled kernels, weights kept quantized on the GPU.

Memory. Each weight is copied to the device once, in its quantized form (the file's bytes,
regrouped field by field as ``layout.py`` describes), and the KV cache is fp16 on the
device. Activations are float32 CuPy arrays. ``memory_report()`` gives the bytes of
weights, KV cache and workspace; a model that does not fit raises ``BackendError`` before
anything is half-loaded past the tensor that failed.

Compute. ``matmul`` runs a fused matrix-vector kernel for up to ``MV_MAX_TOKENS`` rows of x
(decode, speculative drafts, small batches); larger batches (prefill) dequantize tiles of
the weight and multiply them with cuBLAS (``_gemm``: fp16 on the tensor cores with float32
sums, or float32 throughout with "exact"). ``arithmetic`` picks the arithmetic, as the CPU
backend's option of that name does:
- "ggml" (default): as llama.cpp's CUDA backend computes it. For Q4_0, Q5_0, Q8_0, Q4_K
  and Q6_K (``layout.Q8DOT_TYPES``) x is quantized to int8 per run of 32 values inside the
  kernel and multiplied with the weight codes by dp4a (``mmvq.cu``); other types take the
  float kernel. Prefill: fp16 tiles times x in fp16 on the tensor cores.
- "exact": every type through the float kernel (``quant.cu``): exactly dequantized weights
  times float32 x, as the CPU backend's "exact" arithmetic; prefill through SGEMM.
Attention is flash-attention style (``ops.cu``): no score matrix, an online softmax over
tiles of 32 keys. One token with head_dim 64, 128 or 256 and groups of at most 8 query heads
per KV head takes ``attention_gqa_*``: a block per (KV head, split) does the whole group, so
K and V are read once, and the valid key range is split from the device-side position.
One-token kernels find their cache through a device table of pointers (``_cache_table``),
so that a decode graph is not tied to one cache.

Decode as a CUDA graph. A forward pass of one token of each of 1 to ``MV_MAX_TOKENS``
sequences (a lone decode, or the server's batch), run through ``forward_step``, runs the same
kernels with the same buffers every time; only the token ids, the positions and the caches
change. Those are the step's parameters (``_Params``: ids, positions and a table of the
caches' device pointers), which the kernels read from device memory. The first such pass is
run eagerly while every op and kernel launch is recorded; at its end the launches are
captured into a CUDA graph, one per (model, number of sequences, cache geometry), which
serves any caches of that geometry. On later passes each op only checks that it matches the
recording (same op, same weight, same shapes, its inputs the recorded buffers, the step's
own caches) and hands back the recorded output buffer; once the first ``store_kv`` (or
``attend_batch``) has fixed the positions, the parameters are copied to the device and the
whole graph is launched, so the GPU runs while Python walks through the rest of the model.
``to_host`` then reads back the logits. If an op does not match (another cache, another
shape), the step falls back to eager execution from that op on, after computing the ops
matched so far with their recorded launches. ``attend_batch`` writes and attends all of a
batch's rows in one launch each.

Whole steps. Walking the model's ops costs Python time (about 1.5 us an op) even when
every op only hands back a buffer, which bounds small models. So ``forward_step`` (the
optional hook of the op interface that ``BaseModel.forward`` calls) keys single-token steps
on (model, cache geometry, logit rows), and batched ones on (model, sequences, cache
geometry): once such a step has replayed its graph op by op, matching
the recording to the end, ``_TRUST_AFTER`` times at other positions, later steps with that
key skip the model's Python entirely: token id and position go to the device, the graph is
launched and the logits are read back. The contract this relies on is the one the graphs
already rely on: a model's single-token pass issues the same ops whatever the token and
the position (``graphs=False`` or ``whole_steps=False`` turn it off).

Logits for the sampler. Where every sequence's sampler needs only a row's largest logits
(``Segment.top_k``) and a step has at least ``_TOPK_MIN_ROWS`` rows, ``to_host_top`` reads
back each row's 128 largest as (id, logit) pairs (``top_k_logits``/``top_k_keys``: chunks
sorted in shared memory) instead of the rows; in a decode graph those are its last nodes.

Fusion. When the graph is captured (``_fuse``), RMS norms that only feed matvecs are folded
into them (the matvec normalizes x itself, and, with int8 activations, quantizes the
normalized values), residual adds into the matvec that produces their addend, and with
"ggml" arithmetic sibling matvecs of one x (Q, K, V) into one launch and the gate and up
matvecs with their SwiGLU/GeGLU into one launch; RoPE of q and k and the KV cache write go
into that Q/K/V launch (int8, one token; elsewhere into one kernel of their own). A Llama
layer runs 5 kernels instead of 16. With ``dependent_launch`` (sm_90 on) the graph's
kernels are launched as programmatic dependents (``_DependentLauncher``, on by default): each
is scheduled while the one before it finishes and waits for it inside.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import math
import time
import weakref
from dataclasses import dataclass

import numpy as np

from picollama.backends.base import (
    TOP_LOGITS,
    Backend,
    BackendError,
    KVCache,
    Weight,
    device_index,
    logits_top_k,
)
from picollama.backends.cuda import layout, ring
from picollama.gguf.constants import GGMLType

__all__ = ["CUDABackend", "MV_MAX_TOKENS", "WORKSPACE_BYTES", "ARITHMETICS"]

log = logging.getLogger("picollama.cuda")

MV_MAX_TOKENS = 8  # rows of x that take the fused matrix-vector kernel (quant.cu)
_MV_WARPS = 8  # warps per block of the matvec kernel (quant.cu)
_MVQ_WIDE_K = 8192  # one token, x at least this wide: matvec_q8_n1_wide (mmvq.cu)
_MVQ_SSQ_MAX = 256  # mmvq.cu's MVQ_SSQ_MAX: the most blocks a _SumSquares writer may have
_NULL = np.uint64(0)  # a null pointer argument
_MVQ_ROPE_PAIRS = 128  # matvec_q8_n1_rope: rotated pairs per head at most (mmvq.cu, s_cs)
_MV_PAD = 36  # floats of shared memory per chunk of 32 values of x (quant.cu)
_MV_SMEM_LIMIT = 200 << 10  # bytes of x in shared memory; more rows go through cuBLAS
WORKSPACE_BYTES = 256 << 20  # the prefill tiles of dequantized weight (float32 or fp16)
_ATT_MAXD = 256  # head_dim limit of the attention kernel (ops.cu)
_ATT_SPLIT = 512  # decode: keys per attention block before the range is split further
_ATT_MAX_SPLITS = 64
_ATT_SPLIT_KEYS = 128  # decode, GQA kernel: keys per split at least (a tile: one a thread)
_ATT_GROUPS = (1, 2, 3, 4, 6, 8)  # decode, GQA kernel: the group sizes built (ops.cu)
_ATT_TILES_MIN = 32  # prompt batches of at least this many rows: attention_tiles_* (ops.cu)
_ATT_TILE = 32  # queries and keys per tile of attention_tiles_* (FA_BQ, FA_BK)
_MEM_MARGIN = 64 << 20  # bytes kept free for cuBLAS, the CUDA context and small buffers
_EW_THREADS = 256  # threads per block of the elementwise kernels
# to_host_top: the largest logits of a row read back for the sampler (ops.cu, top_k_*),
# whatever it asks for up to that (so one decode graph serves every request): llama.cpp's
# default top-k of 40, plus a penalty window of 64 and banned tokens
_TOPK = 128
_TOPK_THREADS = 1024
_TOPK_CHUNK = 4096  # keys a block sorts (ops.cu, TOPK_CHUNK)
# Fewer rows read back whole: the select is latency-bound (one block a chunk of a row, 33 +
# 17 us for a 49k vocabulary on the H200, whatever the rows up to 8), about what one row's
# copy (6 us) and the host's own top-k scan and copy cost; from 2 rows on it saves time.
_TOPK_MIN_ROWS = 2
_MAX_CACHE_TABLES = 256  # sets of caches whose pointer tables are kept (attend_batch)
_MAX_GRAPH_MISSES = 4  # divergent replays before graphs are turned off
_TRUST_AFTER = 2  # clean op-by-op replays of a step's key before whole-step replay
ARITHMETICS = ("ggml", "exact")

# cuBLAS's enum values (cublas_api.h, library_types.h), for cublasGemmEx
_OP_N, _OP_T = 0, 1
_R_32F, _R_16F = 0, 2
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_HOST, _POINTER_MODE_DEVICE = 0, 1

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


def _check_features(k: int, w: Weight) -> None:
    if k != w.data.k:
        raise BackendError(f"matmul: x has {k} features but '{w.name}' takes {w.data.k}")


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


class _Kernels:
    """The kernels of one weight type (matvec_q8* only for ``layout.Q8DOT_TYPES``)."""

    __slots__ = (
        "matvec", "dequant", "dequant_h", "get_rows", "matvec_q8", "matvec_q8_n1", "matvec_q8_wide",
        "matvec_q8_rope", "matvec_q8_small", "mvq_warps", "mvq_small_warps", "matvec_q8_few",
        "module",
    )  # fmt: skip

    def __init__(self, matvec, dequant, dequant_h, get_rows):
        self.matvec = matvec
        self.dequant = dequant
        self.dequant_h = dequant_h
        self.get_rows = get_rows
        self.matvec_q8 = self.matvec_q8_n1 = self.matvec_q8_wide = self.matvec_q8_rope = None
        self.matvec_q8_small = None  # matvec_q8_n1 in smaller blocks (mmvq.cu), if built
        self.mvq_warps = 8  # warps per block of the matvec_q8 kernels (mmvq.cu's MVQ_WARPS)
        self.mvq_small_warps = 8  # the same of matvec_q8_small (MVQ_SMALL_WARPS)
        # rows of x at most -> the int8 kernel for them (matvec_q8_2, _4; matvec_q8 for 8)
        self.matvec_q8_few: dict[int, object] = {}
        self.module = None  # the RawModule they come from (its globals: diagnostic builds)


class _Launch:
    """One recorded kernel launch."""

    __slots__ = ("kernel", "grid", "block", "args", "shm")

    def __init__(self, kernel, grid, block, args, shm=0):
        self.kernel = kernel
        self.grid = grid
        self.block = block
        self.args = tuple(args)
        self.shm = shm

    def copy(self) -> _Launch:
        return _Launch(self.kernel, self.grid, self.block, self.args, self.shm)

    def run(self, pdl: _DependentLauncher | None = None) -> None:
        if pdl is not None and id(self.kernel) in pdl.kernels:
            pdl.launch(self.kernel, self.grid, self.block, self.args, self.shm, pdl.stream)
        else:
            self.kernel(self.grid, self.block, self.args, shared_mem=self.shm)


class _Matvec:
    """A matrix-vector launch by meaning (not by kernel arguments), so that ``_fuse`` can
    fold a norm, a residual add, a gated activation or sibling weights into it.

    ``weights`` (1 to 3 ``_DeviceWeight`` of one type and width, more than one only for
    the int8 kernel) each write ``ys[i] = x @ W_i^T`` (n rows); with ``norm_w`` x is first
    RMS-normalized and scaled by it; with ``resid``, ``ys[0] = resid + x @ W_0^T``; with
    ``act`` (1: SiLU, 2: GELU) the two weights are a gate and an up matrix and
    ``ys[0] = act(x @ W_0^T) * (x @ W_1^T)``. With ``rope`` (one token, int8 kernel; the
    weights are Q, K and V), ``ys[0]`` and ``ys[1]`` get q and k turned by RoPE and k and v
    also go to the KV cache (``_RopeStore``).
    """

    __slots__ = (
        "be", "q8", "weights", "ys", "x", "n", "k", "norm_w", "eps", "resid", "act", "rope",
        "ssq_out", "ssq_in",
    )  # fmt: skip

    def __init__(self, be, q8: bool, w, y, x, n: int):
        self.be = be
        self.q8 = q8
        self.weights = [w]
        self.ys = [y]
        self.x = x
        self.n = n
        self.k = w.k
        self.norm_w = None
        self.eps = 0.0
        self.resid = None
        self.act = 0
        self.rope = None
        self.ssq_out = None  # _SumSquares: this launch writes x's for the next (see _fuse)
        self.ssq_in = None  # _SumSquares: this launch's norm takes x's from it

    def copy(self) -> _Matvec:
        c = copy.copy(self)
        c.weights = list(self.weights)
        c.ys = list(self.ys)
        return c

    def run(self, pdl: _DependentLauncher | None = None) -> None:
        self.be._run_matvec(self, pdl)


class _RingLaunch:
    """A chain of one-token int8 matvecs run as the phases of one persistent launch
    (ring.cu, ring.py); its argument block and phase counters live on the device."""

    __slots__ = ("kernel", "grid", "args", "counters", "smem", "chain")

    def __init__(self, kernel, grid: int, args, counters, smem: int, chain: list):
        self.kernel = kernel
        self.grid = grid
        self.args = args  # device bytes of ring.RingArgs
        self.counters = counters
        self.smem = smem
        self.chain = chain

    def copy(self) -> _RingLaunch:
        return self

    def run(self, pdl: _DependentLauncher | None = None) -> None:
        grid, block = (self.grid,), (ring.THREADS,)
        if pdl is not None:  # the kernel calls pdl_wait() before its first x
            pdl.launch(self.kernel, grid, block, (self.args,), self.smem, pdl.stream)
        else:
            self.kernel(grid, block, (self.args,), shared_mem=self.smem)


@dataclass(frozen=True, eq=False)
class _RopeStore:
    """What a Q/K/V matvec needs to do rope(q), rope(k) and store_kv(k, v) itself."""

    pos: object  # device int32: the token's position
    start: object  # device int32: the cache row written
    kcs: object  # device uint64 (1,): the layer's fp16 caches (the step's parameters)
    vcs: object
    head_dim: int
    head_dim_v: int
    n_rot: int
    neox: bool
    n_ctx: int
    theta_scale: np.float32
    freq_scale: np.float32


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

    def __init__(self, first_weight, params: _Params, shape: tuple):
        self.first_weight = first_weight
        # shape: the caches' geometry, and whether the logits come back as rows' largest
        self.key = (id(first_weight), params.n, shape)
        self.params = params  # the step's parameters (params.n tokens)
        self.ops: list[_OpRecord] = []
        self.launches: list = []  # _Launch or _Matvec, in order
        self.refs: list = [first_weight]  # objects whose id() appears in the keys
        self.graph = None
        self.launch_at = -1  # the op after whose check the graph is launched
        self.n_graph_kernels = 0
        # the logits as the graph leaves them in pinned host memory (None: the graph copies
        # nothing; the step's parameters go up and the logits come back around it)
        self.host = None
        self.host_mem = None
        self.top = False  # its logits come back as each row's largest (to_host_top)


class _Step:
    """A decode step of one token of each of 1 to ``MV_MAX_TOKENS`` sequences of a model
    (the caches are the step's parameters), and how often its graph replayed cleanly op by
    op; after ``_TRUST_AFTER`` such replays it is replayed whole."""

    __slots__ = ("model", "trace", "clean")

    def __init__(self, model, trace):
        self.model = weakref.ref(model)
        self.trace = trace
        self.clean = 0

    def alive(self) -> bool:
        return self.model() is not None


class _Params:
    """A decode step's parameters on the device, copied up from pinned memory by the first
    node of its graph: the positions of its ``n`` tokens (one of each of n sequences), their
    ids, then the caches' pointer table, uint64 (n_layers, 2 (k, v), n), so that one graph
    serves any caches of its geometry."""

    def __init__(self, cp, n: int, n_layers: int):
        self.n = n
        n_i32 = 2 * n + (2 * n) % 4  # the table starts 16-byte aligned
        n_table = n_layers * 2 * n
        self.nbytes = 4 * n_i32 + 8 * n_table
        self.mem = cp.cuda.alloc_pinned_memory(self.nbytes)
        self.host_pos = np.frombuffer(self.mem, dtype=np.int32, count=n)
        self.host_ids = np.frombuffer(self.mem, dtype=np.int32, count=n, offset=4 * n)
        self.host_table = np.frombuffer(
            self.mem, dtype=np.uint64, count=n_table, offset=4 * n_i32
        ).reshape(n_layers, 2, n)
        self.dev = cp.zeros(self.nbytes, dtype=cp.uint8)
        self.pos = self.dev[: 4 * n].view(cp.int32)
        self.ids = self.dev[4 * n : 8 * n].view(cp.int32)
        self.table = self.dev[4 * n_i32 :].view(cp.uint64).reshape(self.host_table.shape)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute (cuda.h)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("n_attrs", ctypes.c_uint),
    ]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _DependentLauncher:
    """Kernel launches with programmatic stream serialization (cuLaunchKernelEx through
    ctypes; sm_90 on): the kernel may be scheduled before the one before it on the stream
    has finished, and waits for it in ``pdl_wait()`` (common.cuh). Only kernels that call
    ``pdl_wait()`` before touching memory may be launched so (``kernels``); inside a
    captured graph the dependency becomes a programmatic edge, so that a kernel's blocks
    are resident and start as soon as the one before finishes, instead of after a launch."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [
            ctypes.POINTER(_LaunchConfig),
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
        ]
        self._launch.restype = ctypes.c_int
        self._attr = _LaunchAttribute()
        self._attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed
        self.kernels: set[int] = set()  # id() of the RawKernels that call pdl_wait()
        self.stream = 0  # the backend's stream (handle)

    @staticmethod
    def _arg(a):
        if isinstance(a, np.int32):
            return ctypes.c_int32(int(a))
        if isinstance(a, np.int64):
            return ctypes.c_int64(int(a))
        if isinstance(a, np.float32):
            return ctypes.c_float(float(a))
        if isinstance(a, np.uint32):
            return ctypes.c_uint32(int(a))
        if isinstance(a, np.uint64):  # a null pointer
            return ctypes.c_uint64(int(a))
        if hasattr(a, "data") and hasattr(a.data, "ptr"):  # a CuPy array
            return ctypes.c_void_p(a.data.ptr)
        raise TypeError(f"kernel argument of type {type(a).__name__}")

    def launch(self, kernel, grid, block, args, shared_mem, stream_ptr) -> None:
        values = [self._arg(a) for a in args]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        cfg = _LaunchConfig()
        for i in range(3):
            cfg.grid[i] = int(grid[i]) if i < len(grid) else 1
            cfg.block[i] = int(block[i]) if i < len(block) else 1
        cfg.shared_mem = int(shared_mem)
        cfg.stream = stream_ptr
        cfg.attrs = ctypes.pointer(self._attr)
        cfg.n_attrs = 1
        err = self._launch(ctypes.byref(cfg), kernel.kernel.ptr, params, None)
        if err != 0:
            raise BackendError(f"cuLaunchKernelEx failed with CUDA error {err}")


class _SumSquares:
    """A decode graph's link between a one-token int8 matvec that writes the residual stream
    x (``resid``) and the normed one that reads it next: the writer's blocks leave their
    partial sums of x's squares in ``buf`` (float64, one a block, ``n`` of them once the
    writer has been launched; 0 where its grid was too big), and the reader adds them in a
    fixed order instead of reading x once more for its norm (mmvq.cu, ssq_out / ssq_in)."""

    def __init__(self, buf):
        self.buf = buf
        self.n = 0


def _ssq_args(mv: _Matvec) -> list:
    """An int8 matvec's ssq_out, ssq_in and ssq_n arguments: its _SumSquares links where
    they hold sums (the writer sets ``n`` when it is launched), else null pointers. (The
    kernels read ssq_in only for one normed token, and not in the wide-x kernel.)"""
    out, link = mv.ssq_out, mv.ssq_in
    out_buf = out.buf if out is not None and out.n else _NULL
    if link is None or not link.n:
        return [out_buf, _NULL, np.int32(0)]
    return [out_buf, link.buf, np.int32(link.n)]


def _root(a):
    base = a.base
    return a if base is None else base


def _as_top(a: np.ndarray) -> np.ndarray:
    """The (rows, K, 2) int32 pairs of ``_top_k`` read back, as (rows, K) ``TOP_LOGITS``."""
    return a if a.dtype == TOP_LOGITS else a.view(TOP_LOGITS).reshape(a.shape[:2])


def _mv_smem(n: int, k: int) -> int:
    """Shared memory of the float matvec (quant.cu): padded x, then its half-chunk sums."""
    return n * (k // 32) * (_MV_PAD + 2) * 4


def _q8_smem(n: int, k: int) -> int:
    """Shared memory of the int8 matvec (mmvq.cu): codes, scales and half sums of x."""
    return n * k + n * (k // 32) * 4 + n * (k // 16) * 4


class CUDABackend(Backend):
    """Runs the op interface on an NVIDIA GPU through CuPy.

    ``device`` picks the GPU (default 0). ``arithmetic`` is "ggml" (default: int8
    activations and dp4a for the common quant types, as llama.cpp's CUDA backend) or
    "exact" (float32 activations, exactly dequantized weights). ``graphs`` (default True)
    captures single-token forward passes as CUDA graphs, and ``whole_steps`` (default True)
    replays a proven step without walking the model (module doc); ``fuse`` (default True)
    fuses the kernels of those graphs, and ``dependent_launch`` (default True; used on
    sm_90 and newer) lets each kernel of a graph be scheduled while the one before it
    finishes (``_DependentLauncher``; on the H200 5% faster on the 8B shape and 30% on the
    135M one since its kernels trigger after their wait, run 10). ``n_threads`` is
    accepted for symmetry with the CPU backend and ignored.
    """

    name = "cuda"

    def __init__(
        self,
        n_threads: int | None = None,
        device: int = 0,
        graphs: bool = True,
        fuse: bool = True,
        arithmetic: str = "ggml",
        whole_steps: bool = True,
        dependent_launch: bool = True,
    ):
        if arithmetic not in ARITHMETICS:
            raise BackendError(f"unknown CUDA arithmetic '{arithmetic}' (ggml or exact)")
        self.arithmetic = arithmetic
        device = device_index(device)
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise BackendError(f"the CUDA backend's device is a GPU index, not {device!r}")
        device = int(device)
        cp = _import_cupy()
        self.cp = cp
        from cupy_backends.cuda.libs import cublas

        self._cublas = cublas
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
        self._k_ring = None  # ring.cu's kernel, compiled on first use
        self._ring_mod = None
        self._smem_optin = int(props.get("sharedMemPerBlockOptin", 48 << 10))
        self._smem_per_sm = int(props.get("sharedMemPerMultiprocessor", 228 << 10))
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._pool = cp.get_default_memory_pool()
        try:
            with self._stream:
                self._ops = cp.RawModule(code=layout.ops_source(), options=("-std=c++17",))
                self._k_rms = self._ops.get_function("rms_norm")
                self._k_rope = self._ops.get_function("rope")
                self._k_rope_store = self._ops.get_function("rope_store")
                self._k_store = self._ops.get_function("store_kv")
                self._k_att = self._ops.get_function("attention")
                self._k_att_dec = self._ops.get_function("attention_decode")
                self._k_comb = self._ops.get_function("attn_combine")
                self._k_att_tiles = {
                    dv: self._ops.get_function(f"attention_tiles_{dv}") for dv in (16, 32)
                }
                for kernel in self._k_att_tiles.values():
                    kernel.max_dynamic_shared_size_bytes = self._smem_optin - 1024
                self._k_att_gqa = {
                    (dpl, gb): self._ops.get_function(f"attention_gqa_{dpl}_{gb}")
                    for dpl in (2, 4, 8)
                    for gb in _ATT_GROUPS
                }
                self._k_store_rows = self._ops.get_function("store_kv_rows")
                self._k_add = self._ops.get_function("add")
                self._k_mul = self._ops.get_function("mul")
                self._k_scale = self._ops.get_function("scale")
                self._k_silu = self._ops.get_function("silu_mul")
                self._k_gelu = self._ops.get_function("gelu_mul")
                self._k_softcap = self._ops.get_function("softcap")
                self._k_gather = self._ops.get_function("gather_rows")
                self._k_topk = self._ops.get_function("top_k_logits")
                self._k_topk_keys = self._ops.get_function("top_k_keys")
                self._k_absmax = self._ops.get_function("absmax")
                self._k_to_half = self._ops.get_function("to_half_scaled")
                # cuBLAS's alpha and beta for the float32 GEMM, read from the device (the
                # fp16 GEMM's come from to_half_scaled)
                self._gemm_scal = cp.asarray(np.array([1.0, 0.0], dtype=np.float32))
        except cp.cuda.compiler.CompileException as err:
            raise BackendError(f"the CUDA kernels did not compile: {err}") from None
        self._quant_mods: dict[GGMLType, _Kernels] = {}
        self._params: _Params | None = None  # the current decode step's
        self._params_n: dict[tuple[int, int], _Params] = {}  # (tokens, layers) -> _Params
        self._multi = None  # forward_step's segments, one token each, while they run
        self._readback_mem = None
        self._readback_size = 0
        self._workspace = None
        self._weight_bytes = 0
        self._kv_bytes = 0
        # decode graphs
        self.graphs = bool(graphs)
        self.fuse = bool(fuse)
        self.whole_steps = bool(whole_steps)
        self._mode = _EAGER
        self._trace: _Trace | None = None
        # (id(first weight), tokens, cache geometry) -> _Trace
        self._traces: dict[tuple, _Trace] = {}
        self._op_i = 0
        self._launched = False
        self._step_pos: tuple | None = None  # a decode step's positions and caches
        self._step_caches: list = []
        self._misses = 0
        # whole-step replay: (id(model), tokens, cache geometry, logit rows) -> _Step
        self._steps: dict[tuple, _Step] = {}
        self._n_launches = 0  # kernel launches and device copies so far (eager or recorded)
        self._clean = None  # (trace, host logits, launches) of a step replayed to the end
        # replayed: steps run from a graph (whole: of those, without walking the model);
        # host_s: Python time of replayed steps up to the logits read-back; wait_s: the
        # wait for the GPU there (both summed over steps)
        self.graph_stats = {
            "recorded": 0,
            "replayed": 0,
            "whole": 0,
            "fallbacks": 0,
            "kernels": 0,
            "ring": 0,  # persistent launches of several matvecs (ring.cu) in the last graph
            "host_s": 0.0,
            "wait_s": 0.0,
        }
        self._step_t0 = 0.0
        self._pdl = None
        if dependent_launch and int(props.get("major", 0)) >= 9:
            try:
                self._pdl = _DependentLauncher()
            except (OSError, AttributeError) as err:  # no libcuda.so.1 or too old a driver
                log.info("cuda: programmatic dependent launch unavailable (%s)", err)
        if self._pdl is not None:
            self._pdl.stream = self._stream.ptr
            self._pdl.kernels = {id(k) for k in self._k_att_gqa.values()}
            self._pdl.kernels.add(id(self._k_rope_store))
        self.graph_stats["dependent_launch"] = self._pdl is not None
        # decode graphs begin with the copy of token id and position to the device and end
        # with the logits' copy to pinned host memory (False: both as separate calls around
        # the graph, as before run 11; for comparisons)
        self.graph_copies = True
        # eager mode: device copies of host index arrays, reused within one forward pass
        self._dev_pos_src = None
        self._dev_pos = None
        self._dev_starts: dict[int, object] = {}
        # several sequences' decode steps: their caches' device pointers (_cache_table)
        self._cache_tables: dict[tuple, tuple] = {}

    # -- kernels ----------------------------------------------------------------------------

    def _quant_kernels(self, qtype: GGMLType) -> _Kernels:
        """The kernels of one weight type, compiled on first use."""
        kernels = self._quant_mods.get(qtype)
        if kernels is None:
            cp = self.cp
            try:
                with self._stream:
                    mod = cp.RawModule(code=layout.quant_source(qtype), options=("-std=c++17",))
                    kernels = _Kernels(
                        mod.get_function("matvec"),
                        mod.get_function("dequant"),
                        mod.get_function("dequant_h"),
                        mod.get_function("get_rows"),
                    )
                    kernels.module = mod
                    if qtype in layout.Q8DOT_TYPES:
                        kernels.matvec_q8 = mod.get_function("matvec_q8")
                        kernels.matvec_q8_n1 = mod.get_function("matvec_q8_n1")
                        kernels.matvec_q8_wide = mod.get_function("matvec_q8_n1_wide")
                        kernels.matvec_q8_rope = mod.get_function("matvec_q8_n1_rope")
                        kernels.matvec_q8_few = {
                            2: mod.get_function("matvec_q8_2"),
                            4: mod.get_function("matvec_q8_4"),
                            MV_MAX_TOKENS: kernels.matvec_q8,
                        }
                        # __launch_bounds__(MVQ_WARPS * 32) caps this at the block size
                        kernels.mvq_warps = kernels.matvec_q8_n1.max_threads_per_block // 32
                        try:  # built only where its blocks are the smaller (Q4_K, Q6_K)
                            small = mod.get_function("matvec_q8_n1_small")
                        except cp.cuda.driver.CUDADriverError:
                            small = None
                        if small is not None:
                            kernels.matvec_q8_small = small
                            kernels.mvq_small_warps = small.max_threads_per_block // 32
                    # x is staged in dynamic shared memory: allow more than 48 KiB
                    for kernel in (
                        kernels.matvec,
                        *kernels.matvec_q8_few.values(),
                        kernels.matvec_q8_n1,
                        kernels.matvec_q8_wide,
                        kernels.matvec_q8_rope,
                        kernels.matvec_q8_small,
                    ):
                        if kernel is not None:
                            kernel.max_dynamic_shared_size_bytes = self._mv_smem_limit()
            except cp.cuda.compiler.CompileException as err:
                raise BackendError(
                    f"the CUDA kernels for {qtype.name} did not compile: {err}"
                ) from None
            self._quant_mods[qtype] = kernels
        return kernels

    def _mv_smem_limit(self) -> int:
        return min(_MV_SMEM_LIMIT, self._smem_optin - 1024)

    def _launch(self, kernel, grid, block, args, shared_mem=0):
        """Launch on the backend's stream (the caller holds ``with self._stream``)."""
        launch = _Launch(kernel, grid, block, args, shared_mem)
        if self._mode == _RECORD:
            self._trace.launches.append(launch)
        self._n_launches += 1
        launch.run()

    def _launch_mv(self, mv: _Matvec) -> None:
        if self._mode == _RECORD:
            self._trace.launches.append(mv)
        self._n_launches += 1
        mv.run()

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
        qtype, k, m, lay, raw = layout.check_weight(name, ggml_type, shape, data, "CUDA")
        self._reserve(lay.nbytes + raw.nbytes, f"tensor '{name}'")
        cp = self.cp
        try:
            with self._stream:
                staged = cp.asarray(raw.reshape(lay.n_blocks, -1))
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

    def to_host_top(self, x, k: int) -> np.ndarray:
        """Each row's ``_TOPK`` largest logits (``_top_k``), for samplers that need at most
        that many: 1 KB a row read back instead of the row (196 KB for a vocabulary of 49k),
        and the host's own top-k pass saved; whole rows where more are needed, or for fewer
        than ``_TOPK_MIN_ROWS`` rows."""
        if not 0 < k <= _TOPK or x.ndim != 2 or x.shape[0] < max(_TOPK_MIN_ROWS, 1):
            return self.to_host(x)
        if self._mode == _EAGER:
            return _as_top(self._read_back(self._top_k(x)))
        pairs = self._dispatch(("top_k", x.shape), (x,), lambda: self._top_k(x))
        return _as_top(self.to_host(pairs))

    def _top_k(self, x):
        """(rows, K, 2) int32 on the device: each row's K largest as (id, logit bits), by
        levels of chunks sorted in shared memory (ops.cu, top_k_logits / top_k_keys)."""
        cp = self.cp
        x = self._contig(x)
        rows, n = x.shape
        kk = min(_TOPK, n)
        with self._stream:
            pairs = cp.empty((rows, kk, 2), dtype=cp.int32)
            keys, m = None, n
            while True:
                chunks = -(-m // _TOPK_CHUNK)
                final = chunks == 1
                # a level writes the next level's keys, or the pairs from the one chunk left
                out = pairs if final else cp.empty((rows, chunks * kk), dtype=cp.uint64)
                head = (np.int32(m), np.int32(kk), np.int32(final), out)
                if keys is None:
                    kernel, args = self._k_topk, (x, *head, pairs)
                else:
                    kernel, args = self._k_topk_keys, (keys, *head, x, np.int32(n), pairs)
                self._launch(kernel, (chunks, rows), (_TOPK_THREADS,), args)
                if final:
                    return pairs
                keys, m = out, chunks * kk

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
        self._steps.clear()

    # -- whole steps ------------------------------------------------------------------------

    def forward_step(self, model, segments: list) -> list[np.ndarray]:
        """``model.forward_batch(segments)``, or the replay of a proven decode step.

        One token of each of 1 to ``MV_MAX_TOKENS`` sequences (a lone decode, the server's
        batches) is keyed on (model, number of sequences, the caches' geometry, logit rows),
        whatever the caches, whose device pointers are the step's parameters. Such a step
        runs through the model (recording, or replaying the graph op by op with every
        check); when a pass matched its recording to the end and nothing ran after the
        logits' read-back, the key counts one clean replay. After ``_TRUST_AFTER`` of them,
        steps of that key only set the token ids, positions and caches, launch the graph
        and read back the logits (see the module doc for the contract).
        """
        n = len(segments)
        if (
            not self.graphs
            or not 1 <= n <= MV_MAX_TOKENS
            or any(len(seg.tokens) != 1 for seg in segments)
        ):
            return model.forward_batch(segments)
        seg = segments[0]
        shape = seg.cache.geometry
        rows_key = None
        if n == 1 and seg.logit_rows is not None:
            rows_key = tuple(np.asarray(seg.logit_rows).reshape(-1).tolist())
        elif any(s.logit_rows is not None or s.cache.geometry != shape for s in segments):
            return model.forward_batch(segments)  # eager
        key = (id(model), n, shape, rows_key, self._top_step(segments))
        if not self.whole_steps:
            return self._forward_traced(model, segments)
        step = self._steps.get(key)
        if step is not None and step.model() is not model:
            step = None  # an id reused by a new model
        if (
            step is not None
            and step.clean >= _TRUST_AFTER
            and self._traces.get(step.trace.key) is step.trace
        ):
            return self._replay_whole(step.trace, segments)
        self._clean = None
        out = self._forward_traced(model, segments)
        clean, self._clean = self._clean, None
        if clean is None or clean[2] != self._n_launches or len(out) != n:
            return out
        trace, host, _ = clean
        root = _root(host)
        if any(o.base is not root for o in out) or sum(len(o) for o in out) != len(host):
            return out  # the model did more than return the read-back logits
        if step is None or step.trace is not trace:
            self._steps = {k: v for k, v in self._steps.items() if v.alive()}
            step = self._steps[key] = _Step(model, trace)
        step.clean += 1
        return out

    @staticmethod
    def _top_step(segments: list) -> bool:
        """Whether a step's logits come back as each row's largest (``to_host_top``)."""
        return 0 < logits_top_k(segments) <= _TOPK and len(segments) >= _TOPK_MIN_ROWS

    def _forward_traced(self, model, segments: list) -> list[np.ndarray]:
        """``model.forward_batch``, with its one-token segments known to ``_begin_step`` (so
        that their step is recorded or replayed as a graph)."""
        self._multi = segments
        try:
            return model.forward_batch(segments)
        finally:
            self._multi = None

    def _replay_whole(self, trace: _Trace, segments: list) -> list[np.ndarray]:
        """One decode step from its graph: the logits (1 row per logit row) on the host."""
        w = trace.first_weight
        for seg in segments:
            token, start, cache = int(seg.tokens[0]), int(seg.start), seg.cache
            if not 0 <= token < w.m:
                raise BackendError(f"get_rows: row {token} is outside '{w.name}' ({w.m} rows)")
            if start + 1 > cache.n_ctx:
                raise BackendError(f"KV cache of {cache.n_ctx} positions overflows at {start + 1}")
        self._end_step()
        t0 = time.perf_counter()
        p = self._params = trace.params
        self._set_params(p, segments)
        with self._stream:
            if trace.host is None:
                self._upload_params()
            trace.graph.launch(stream=self._stream)
        t1 = time.perf_counter()
        host = self._graph_logits(trace, trace.ops[-1].out)
        stats = self.graph_stats
        stats["host_s"] += t1 - t0
        stats["wait_s"] += time.perf_counter() - t1
        stats["replayed"] += 1
        stats["whole"] += 1
        return [host] if p.n == 1 else [host[i : i + 1] for i in range(p.n)]

    def _set_params(self, p: _Params, segments: list) -> None:
        """Token ids, positions and cache pointers of a decode step."""
        p.host_pos[:] = [seg.start for seg in segments]
        p.host_ids[:] = [int(seg.tokens[0]) for seg in segments]
        p.host_table[...] = self._cache_table([seg.cache for seg in segments])[0]

    def _params_for(self, n: int, n_layers: int) -> _Params:
        p = self._params_n.get((n, n_layers))
        if p is None:
            with self._stream:
                p = self._params_n[(n, n_layers)] = _Params(self.cp, n, n_layers)
        return p

    # -- helpers ----------------------------------------------------------------------------

    def _contig(self, x):
        if x.flags.c_contiguous:
            return x
        if self._mode == _RECORD:
            self._abort_record()
        self._n_launches += 1
        with self._stream:
            return self.cp.ascontiguousarray(x)

    def _empty(self, shape, dtype=None):
        return self.cp.empty(shape, dtype=self.cp.float32 if dtype is None else dtype)

    def _upload_i32(self, values) -> object:
        return self.cp.asarray(np.ascontiguousarray(values, dtype=np.int32))

    def _dev_positions(self, positions: np.ndarray):
        """Positions as a device int32 array (the step's parameter buffer in a decode step)."""
        if self._mode != _EAGER:
            return self._params.pos
        if self._dev_pos_src is not positions:
            self._dev_pos = self._upload_i32(positions)
            self._dev_pos_src = positions
        return self._dev_pos

    def _dev_start(self, start: int):
        if self._mode != _EAGER:
            return self._params.pos[0:1]  # one token (else _bind_positions left the graph)
        dev = self._dev_starts.get(start)
        if dev is None:
            dev = self._dev_starts[start] = self._upload_i32([start])
        return dev

    def _upload_params(self) -> None:
        cp = self.cp
        p = self._params
        cp.cuda.runtime.memcpyAsync(
            p.dev.data.ptr,
            p.mem.ptr,
            p.nbytes,
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
        n, multi = len(ids), self._multi
        if not (self.graphs and multi is not None and len(multi) == n):
            return  # graphs are for forward_step's decode steps
        cache = multi[0].cache
        p = self._params = self._params_for(n, cache.n_layers)
        self._set_params(p, multi)
        self._step_pos = tuple(int(seg.start) for seg in multi)
        self._step_caches = [seg.cache for seg in multi]
        shape = (cache.geometry, self._top_step(multi))
        trace = self._traces.get((id(w), n, shape))
        if trace is not None and trace.graph is not None and trace.params is p:
            self._mode, self._trace = _REPLAY, trace
            self._op_i = 0
            self._launched = False
            self._step_t0 = time.perf_counter()
        else:
            self._mode, self._trace = _RECORD, _Trace(w, p, shape)
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

    def _bind_positions(self, positions, caches=None) -> None:
        """Check the positions (rope, store_kv, attention, attend_batch: one per token) and
        the caches an op is given against the step's parameters. An op of others leaves the
        graph: the step goes on eagerly."""
        mine = self._step_caches
        if tuple(int(p) for p in positions) == self._step_pos and (
            caches is None
            or (len(caches) == len(mine) and all(a is b for a, b in zip(caches, mine, strict=True)))
        ):
            return
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
        trace = self._trace
        with self._stream:
            if trace.host is None:  # else the graph's first node copies them
                self._upload_params()
            trace.graph.launch(stream=self._stream)
        self._launched = True

    def _graph_logits(self, trace: _Trace, out) -> np.ndarray:
        """The logits ``out`` of a step whose graph was launched, as a fresh host array."""
        if trace.host is None or out is not trace.ops[-1].out:
            return self._read_back(out)
        self._stream.synchronize()  # the graph's last node copied them to trace.host
        host = trace.host.copy()
        return _as_top(host) if trace.top else host

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
            for launch in trace.launches[:n]:
                launch.run()
        self._traces.pop(trace.key, None)
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
                host = self._graph_logits(trace, out)
                stats = self.graph_stats
                stats["host_s"] += t1 - self._step_t0
                stats["wait_s"] += time.perf_counter() - t1
                stats["replayed"] += 1
                self._mode, self._trace = _EAGER, None
                if self._op_i == len(trace.ops):  # every recorded op matched
                    self._clean = (trace, host, self._n_launches)
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
            if rec.key[0] in ("store_kv", "attend_batch"):
                launch_at = i
                break
        trace.launch_at = launch_at
        trace.top = len(trace.ops) > 1 and trace.ops[-2].key[0] == "top_k"
        cp = self.cp
        stream = self._stream
        launches = self._fuse(trace) if self.fuse else trace.launches
        trace.n_graph_kernels = len(launches)
        # the graph's own copies: token id and position up first (the kernels read them
        # from the step's _Params), the logits down last, into pinned memory of the trace's own;
        # on the H200 each copy as a call of its own cost host time between steps (run 11)
        logits = trace.ops[-1].out  # to_host's input, contiguous
        host_mem = None
        if self.graph_copies:
            host_mem = cp.cuda.alloc_pinned_memory(max(1, logits.nbytes))
        errors = (
            cp.cuda.runtime.CUDARuntimeError,
            cp.cuda.driver.CUDADriverError,
            AttributeError,  # a CuPy without stream capture
            BackendError,  # cuLaunchKernelEx refused a dependent launch
            TypeError,  # an argument _DependentLauncher cannot pass
        )
        while True:
            pdl = self._pdl
            try:
                with stream:
                    stream.begin_capture()
                    try:
                        if host_mem is not None:
                            self._upload_params()
                        for launch in launches:
                            launch.run(pdl)
                        if host_mem is not None and logits.nbytes:
                            cp.cuda.runtime.memcpyAsync(
                                host_mem.ptr,
                                logits.data.ptr,
                                logits.nbytes,
                                cp.cuda.runtime.memcpyDeviceToHost,
                                stream.ptr,
                            )
                    finally:
                        graph = stream.end_capture()
                trace.graph = graph
                break
            except errors as err:
                if pdl is not None:  # once more with plain launches
                    log.warning("cuda: dependent launches failed (%s); plain launches", err)
                    self._pdl = None
                    self.graph_stats["dependent_launch"] = False
                    continue
                log.warning("cuda: capturing a decode step failed (%s); graphs turned off", err)
                self.graphs = False
                return
        if host_mem is not None:
            trace.host_mem = host_mem
            host = np.frombuffer(host_mem, dtype=logits.dtype, count=logits.size)
            trace.host = host.reshape(logits.shape)
        self._traces[trace.key] = trace
        self.graph_stats["recorded"] += 1
        self.graph_stats["kernels"] = trace.n_graph_kernels
        self.graph_stats["ring"] = sum(isinstance(x, _RingLaunch) for x in launches)

    def _fuse(self, trace: _Trace) -> list:
        """The step's launches with small kernels folded into bigger ones.

        - An rms_norm whose output only feeds matvecs: each matvec normalizes its own copy
          of x in shared memory, and the norm's launch goes.
        - An add of a matvec's output (used nowhere else) to a same-sized array computed
          before that matvec: the matvec writes the sum into the add's output buffer.
        - int8 matvecs (arithmetic "ggml"): a SiLU/GELU product of two matvecs of one x
          (gate, up) becomes one launch that writes the product; consecutive matvecs of one
          x and one weight type (Q, K, V) become one launch.
        - rope(q), rope(k) and the store_kv of that k: one rope_store launch, where rope(q)
          was (k's input and v must be computed by then, and nothing in between may touch
          the KV cache).
        - A one-token residual matvec and the normed matvecs right after it that read its
          output: the writer's blocks leave their sums of squares for the readers' norm
          (``_link_sum_squares``; ``PICOLLAMA_CUDA_DEFINES=MVQ_SSQ=0`` turns it off).
        Each computes the same float32 operations as the kernels it replaces (the norm's
        float64 sum of squares aside, which is added in another order). The recorded
        launches are left as they were (a divergent replay reruns them).
        """
        ops = trace.ops
        bounds = [rec.launch_start for rec in ops] + [len(trace.launches)]
        launches = [launch.copy() for launch in trace.launches]
        producer, consumers = {}, {}
        for i, rec in enumerate(ops):
            if rec.out is not None and hasattr(rec.out, "data"):
                producer.setdefault(id(_root(rec.out)), i)  # ops like take_rows pass x on
            for root, _shape in rec.inputs:
                consumers.setdefault(id(root), []).append(i)
        dropped = set()

        def only(i, kind):
            """Op i's launch if it has exactly one, of ``kind`` (a kernel or _Matvec)."""
            if i < 0 or i >= len(ops) or bounds[i + 1] - bounds[i] != 1 or bounds[i] in dropped:
                return None
            launch = launches[bounds[i]]
            if kind is _Matvec:
                return launch if isinstance(launch, _Matvec) else None
            return launch if isinstance(launch, _Launch) and launch.kernel is kind else None

        def same(a, b) -> bool:
            return a.data.ptr == b.data.ptr and a.size == b.size

        def uses(arr) -> list:
            return consumers.get(id(_root(arr)), [])

        def made_at(arr) -> int:
            return producer.get(id(_root(arr)), -1)

        # norms into matvecs, residual adds into the matvec of their addend
        for i, rec in enumerate(ops):
            if rec.key[0] == "rms_norm" and not rec.key[3]:  # has a weight
                norm = only(i, self._k_rms)
                users = uses(rec.out)
                if norm is None or not users:
                    continue
                x_in, w_in, out, d, eps = norm.args[:5]
                targets = [only(j, _Matvec) for j in users]
                if all(
                    t is not None and same(t.x, out) and t.k == int(d) and t.norm_w is None
                    for t in targets
                ):
                    for t in targets:
                        t.x, t.norm_w, t.eps = x_in, w_in, float(eps)
                    dropped.add(bounds[i])
            elif rec.key[0] == "add" and rec.key[1] == rec.key[2]:
                add = only(i, self._k_add)
                if add is None:
                    continue
                a, b, out = add.args[:3]
                for mine, other in ((b, a), (a, b)):
                    j = made_at(mine)
                    if j < 0 or uses(mine) != [i]:
                        continue
                    mv = only(j, _Matvec)
                    if mv is None or mv.resid is not None or mv.act or len(mv.ys) != 1:
                        continue
                    if not same(mv.ys[0], mine) or made_at(other) >= j:
                        continue
                    mv.ys[0], mv.resid = out, other
                    dropped.add(bounds[i])
                    break

        def siblings(a: _Matvec, b: _Matvec) -> bool:
            """b (one weight) can join a: int8 matvecs of one x, weight type and width."""
            return (
                a.q8
                and b.q8
                and len(b.weights) == 1
                and not a.act
                and not b.act
                and a.resid is None
                and b.resid is None
                and a.weights[0].qtype == b.weights[0].qtype
                and a.k == b.k
                and a.n == b.n
                and same(a.x, b.x)
                and (a.norm_w is None) == (b.norm_w is None)
                and (a.norm_w is None or same(a.norm_w, b.norm_w))
                and a.eps == b.eps
            )

        # gate, up and their gated activation
        acts = {"silu_mul": (self._k_silu, 1), "gelu_mul": (self._k_gelu, 2)}
        for g, rec in enumerate(ops):
            if rec.key[0] not in acts:
                continue
            kernel, act = acts[rec.key[0]]
            launch = only(g, kernel)
            if launch is None:
                continue
            gate, up, out = launch.args[:3]
            jg, ju = made_at(gate), made_at(up)
            mg, mu = only(jg, _Matvec), only(ju, _Matvec)
            if mg is None or mu is None or jg >= ju or len(mg.weights) != 1:
                continue
            if not siblings(mg, mu):
                continue
            if uses(gate) != [g] or uses(up) != [g]:
                continue
            if not (same(mg.ys[0], gate) and same(mu.ys[0], up)):
                continue
            if mg.weights[0].m != mu.weights[0].m:
                continue
            mg.weights.append(mu.weights[0])
            mg.ys = [out]
            mg.act = act
            dropped.add(bounds[ju])
            dropped.add(bounds[g])

        # consecutive matvecs of one x (Q, K, V)
        j = 0
        while j < len(ops):
            first = only(j, _Matvec)
            if first is None:
                j += 1
                continue
            nxt = j + 1
            while len(first.weights) < 3 and nxt < len(ops):
                other = only(nxt, _Matvec)
                if other is None or not siblings(first, other):
                    break
                first.weights.append(other.weights[0])
                first.ys.append(other.ys[0])
                dropped.add(bounds[nxt])
                nxt += 1
            j = nxt

        # rope(q), rope(k) and store_kv(k, v) into the Q/K/V matvec (one token, int8)
        for iq, rec in enumerate(ops):
            if rec.key[0] != "rope":
                continue
            ik = iq + 1
            rq, rk = only(iq, self._k_rope), only(ik, self._k_rope)
            if rq is None or rk is None:
                continue
            q_in, pos, q_out, n_heads, head_dim, n_rot, theta_scale, freq_scale, neox = rq.args
            k_in, pos_k, k_out, n_kv = rk.args[:4]
            if not same(pos, pos_k) or int(rq.grid[0]) != 1 or int(rk.grid[0]) != 1:
                continue
            if tuple(float(a) for a in rq.args[4:]) != tuple(float(a) for a in rk.args[4:]):
                continue
            j = made_at(q_in)
            mv = only(j, _Matvec)
            if mv is None or not mv.q8 or mv.n != 1 or len(mv.weights) != 3:
                continue
            if mv.act or mv.resid is not None or mv.rope is not None:
                continue
            if not (same(mv.ys[0], q_in) and same(mv.ys[1], k_in)):
                continue
            if uses(q_in) != [iq] or uses(k_in) != [ik]:
                continue
            stores = [s_ for s_ in uses(k_out) if ops[s_].key[0] == "store_kv"]
            if len(stores) != 1:
                continue
            s_ = stores[0]
            st = only(s_, self._k_store_rows)
            if st is None:
                continue
            k_st, v, kcs, vcs, start, n, kdim, vdim, n_ctx = st.args
            if not same(k_st, k_out) or not same(v, mv.ys[2]) or int(n) != 1:
                continue
            m_q, m_k, m_v = (dw.m for dw in mv.weights)
            hd, n_kv_i = int(head_dim), int(n_kv)
            if m_q != int(n_heads) * hd or m_k != n_kv_i * hd or int(kdim) != m_k:
                continue
            if int(vdim) != m_v or m_v % n_kv_i or (m_v // n_kv_i) % 2 or hd % 2:
                continue
            if int(n_rot) > 2 * _MVQ_ROPE_PAIRS:  # the kernel's table of angles
                continue
            # the cache is written at the matvec now: nothing in between may read or write it
            if any(ops[i].key[0] in ("store_kv", "attention") for i in range(j + 1, s_)):
                continue
            mv.ys = [q_out, k_out, mv.ys[2]]
            mv.rope = _RopeStore(
                pos, start, kcs, vcs, hd, m_v // n_kv_i, int(n_rot), bool(int(neox)),
                int(n_ctx), np.float32(theta_scale), np.float32(freq_scale),
            )  # fmt: skip
            dropped.update((bounds[iq], bounds[ik], bounds[s_]))

        # rope(q), rope(k), store_kv(k, v) in one kernel, where the above did not apply
        for iq, rec in enumerate(ops):
            if rec.key[0] != "rope":
                continue
            ik = iq + 1
            rq, rk = only(iq, self._k_rope), only(ik, self._k_rope)
            if rq is None or rk is None:
                continue
            q_in, pos, q_out, n_heads, head_dim, n_rot, theta_scale, freq_scale, neox = rq.args
            k_in, pos_k, k_out, n_kv = rk.args[:4]
            if not same(pos, pos_k) or rq.grid[0] != rk.grid[0]:
                continue
            if tuple(float(a) for a in rq.args[4:]) != tuple(float(a) for a in rk.args[4:]):
                continue
            stores = [s_ for s_ in uses(k_out) if ops[s_].key[0] == "store_kv"]
            if len(stores) != 1:
                continue
            s_ = stores[0]
            st = only(s_, self._k_store_rows)
            if st is None:
                continue
            k_st, v, kcs, vcs, start, n, kdim, vdim, n_ctx = st.args
            n_tok, n_kv_i, hd = int(rq.grid[0]), int(n_kv), int(head_dim)
            if not same(k_st, k_out) or int(n) != n_tok or int(kdim) != n_kv_i * hd:
                continue
            if int(vdim) % n_kv_i or made_at(v) >= iq or made_at(k_in) >= iq:
                continue
            if any(ops[i].key[0] in ("store_kv", "attention") for i in range(iq + 1, s_)):
                continue
            hdv = int(vdim) // n_kv_i
            widest = max(int(n_rot) // 2, hdv, hd - int(n_rot))
            threads = min(256, max(32, (widest + 31) // 32 * 32))
            args = (
                q_in, k_in, v, q_out, k_out, kcs, vcs, pos, start, n_heads, n_kv, head_dim,
                np.int32(hdv), n_rot, theta_scale, freq_scale, neox, n_ctx,
            )  # fmt: skip
            grid = (n_tok, int(n_heads) + 2 * n_kv_i)
            launches[bounds[iq]] = _Launch(self._k_rope_store, grid, (threads,), args)
            dropped.add(bounds[ik])
            dropped.add(bounds[s_])
        kept = [launch for idx, launch in enumerate(launches) if idx not in dropped]
        if layout.define_value("MVQ_SSQ", 1):
            self._link_sum_squares(kept, trace)
            if layout.define_value("RING", 0):
                kept = self._ring_chains(kept, trace)
        return kept

    def _ring_kernel(self):
        """ring.cu's matvec_ring (compiled on first use), or None where a block's shared
        memory cannot hold its ring."""
        if self._k_ring is None:
            if ring.ring_smem() > self._smem_optin:
                return None
            try:
                with self._stream:
                    mod = self.cp.RawModule(code=layout.ring_source(), options=("-std=c++17",))
                    self._k_ring = mod.get_function("matvec_ring")
                    self._ring_mod = mod  # its globals: the trace build's records
                    self._k_ring.max_dynamic_shared_size_bytes = ring.ring_smem()
            except self.cp.cuda.compiler.CompileException as err:
                raise BackendError(f"the CUDA ring kernel did not compile: {err}") from None
        return self._k_ring

    def _ring_chains(self, launches: list, trace: _Trace) -> list:
        """Chains of one-token matvecs (ring.chain_at) as one persistent launch each."""
        kernel = self._ring_kernel()
        if kernel is None:
            return launches
        out, i = [], 0
        while i < len(launches):
            chain = ring.chain_at(launches, i, _Matvec)
            if not chain:
                out.append(launches[i])
                i += 1
                continue
            cp = self.cp
            with self._stream:  # ordered before the graph's launches on this stream
                counters = cp.zeros((ring.N_COUNTERS,), dtype=cp.uint32)
                args = ring.build_args(chain, counters, self._n_sm)
                buf = cp.asarray(ring.args_bytes(args))
            launch = _RingLaunch(kernel, self._n_sm, buf, counters, ring.ring_smem(), chain)
            trace.refs.append(launch)
            out.append(launch)
            i += len(chain)
        return out

    def _link_sum_squares(self, launches: list, trace: _Trace) -> None:
        """Each one-token int8 matvec that writes x with a residual (one weight) hands its
        blocks' sums of squares to the normed int8 matvecs that read that x right after it
        (the launches that follow it directly: nothing in between can write x again), so
        that their prologue reads x once, with the sums, instead of a round trip and a block
        barrier for the norm first. 135M decode +2.1-2.3% on an H100, the 8B a tie
        (NOTES.md, run 33)."""

        def reads(m, y) -> bool:
            return (
                isinstance(m, _Matvec) and m.q8 and m.n == 1 and m.norm_w is not None
                and m.k < _MVQ_WIDE_K and m.x.data.ptr == y.data.ptr and m.x.size == y.size
            )  # fmt: skip

        for i, writer in enumerate(launches):
            if not isinstance(writer, _Matvec) or not writer.q8 or writer.n != 1:
                continue
            if writer.resid is None or len(writer.weights) != 1 or writer.act or writer.rope:
                continue
            readers = []
            for later in launches[i + 1 :]:
                if not reads(later, writer.ys[0]):
                    break
                readers.append(later)
            if not readers:
                continue
            link = _SumSquares(self.cp.zeros((_MVQ_SSQ_MAX,), dtype=self.cp.float64))
            trace.refs.append(link.buf)
            writer.ssq_out = link
            for r in readers:
                r.ssq_in = link

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
        _check_features(k, w)
        kernels = self._quant_kernels(dw.qtype)
        with self._stream:
            y = self._empty((n, dw.m))
            if n == 0:
                return y
            if n <= MV_MAX_TOKENS:
                q8 = self.arithmetic == "ggml" and kernels.matvec_q8 is not None
                if q8 and _q8_smem(n, k) > self._mv_smem_limit():
                    q8 = False
                if q8 or _mv_smem(n, k) <= self._mv_smem_limit():
                    self._launch_mv(_Matvec(self, q8, dw, y, x2, n))
                    return y
            if self._mode == _RECORD:
                self._abort_record()
            self._gemm(self._gemm_input(x2), dw, kernels, y)
        return y

    def matmul_many(self, x, ws):
        """A prompt batch's projections of one x (Q, K, V; gate, up) convert x for cuBLAS
        once; anything else as ``matmul`` one by one."""
        n = math.prod(x.shape[:-1])
        if self._mode != _EAGER or n <= MV_MAX_TOKENS or len(ws) < 2:
            return super().matmul_many(x, ws)
        x2 = self._contig(x.reshape(n, x.shape[-1]))
        for w in ws:
            _check_features(x2.shape[1], w)
        with self._stream:
            xin = self._gemm_input(x2)
            ys = []
            for w in ws:
                ys.append(self._empty((n, w.data.m)))
                self._gemm(xin, w.data, self._quant_kernels(w.data.qtype), ys[-1])
        return ys

    def _run_matvec(self, mv: _Matvec, pdl: _DependentLauncher | None = None) -> None:
        """Launch ``mv`` (on the backend's stream) with a grid of one wave of blocks: each
        block stages x in shared memory once and then walks through many rows."""
        dw0: _DeviceWeight = mv.weights[0]
        kernels = self._quant_kernels(dw0.qtype)
        n, k = mv.n, mv.k
        norm = mv.norm_w is not None
        has_resid = mv.resid is not None
        if mv.q8:
            if n > 1:
                kernel = kernels.matvec_q8_few[next(t for t in (2, 4, MV_MAX_TOKENS) if n <= t)]
            elif mv.rope is not None:
                kernel = kernels.matvec_q8_rope
            else:
                kernel = kernels.matvec_q8_wide if k >= _MVQ_WIDE_K else kernels.matvec_q8_n1
            smem = _q8_smem(n, k)
            args = []
            for i in range(3):
                if i < len(mv.weights):
                    dw = mv.weights[i]
                    m = dw.m
                else:
                    dw, m = dw0, 0
                y = mv.ys[i] if i < len(mv.ys) else mv.ys[0]
                args += [dw.buf, np.int64(dw.n_blocks), np.int32(m), y]
            args += [
                np.int32(k),
                mv.x,
                np.int32(n),
                mv.norm_w if norm else mv.x,
                np.float32(mv.eps),
                np.int32(norm),
                mv.resid if has_resid else mv.ys[0],
                np.int32(has_resid),
                np.int32(mv.act),
            ]
            rs = mv.rope
            if rs is None:  # the kernel reads none of these
                args += [mv.x, mv.x, mv.x, mv.x] + [np.int32(0)] * 5 + [np.float32(0)] * 2
            else:
                args += [rs.pos, rs.start, rs.kcs, rs.vcs, np.int32(rs.head_dim)]
                args += [np.int32(rs.head_dim_v), np.int32(rs.n_rot), np.int32(rs.neox)]
                args += [np.int32(rs.n_ctx), np.float32(rs.theta_scale)]
                args += [np.float32(rs.freq_scale)]
            rows = dw0.m if mv.act else sum(dw.m for dw in mv.weights)
            warps = kernels.mvq_warps
            per_warp = 1 if mv.act else 2  # a warp's rows at a time (gate and up: one)
            small = kernels.matvec_q8_small
            if (
                kernel is kernels.matvec_q8_n1
                and small is not None
                and 2 * -(-rows // (kernels.mvq_small_warps * per_warp)) <= self._n_sm
            ):
                # few rows: smaller blocks on more SMs, as long as they leave half the SMs
                # idle (so the trigger point stays the same, _pdl_at). The 135M's ffn_down:
                # 18 blocks of 16 warps -> 36 of 8; none of the 8B's matvecs.
                kernel, warps = small, kernels.mvq_small_warps
            rows_per_block = warps * per_warp
            threads = warps * 32
        else:
            assert len(mv.weights) == 1 and not mv.act, "the float matvec takes one weight"
            kernel = kernels.matvec
            smem = _mv_smem(n, k)
            args = [
                dw0.buf,
                np.int64(dw0.n_blocks),
                np.int32(k),
                np.int32(dw0.m),
                mv.x,
                np.int32(n),
                mv.ys[0],
                np.int32(dw0.lpr),
                mv.norm_w if norm else mv.x,
                np.float32(mv.eps),
                np.int32(norm),
                mv.resid if has_resid else mv.ys[0],
                np.int32(has_resid),
            ]
            rows = dw0.m
            rows_per_block = _MV_WARPS * (32 // dw0.lpr)
            threads = _MV_WARPS * 32
        regs = max(1, int(getattr(kernel, "num_regs", 80)))
        per_sm = min(
            2048 // threads,
            65536 // (regs * threads),
            self._smem_per_sm // max(smem + 1024, 1),
        )
        n_blocks = min((rows + rows_per_block - 1) // rows_per_block, self._n_sm * max(1, per_sm))
        grid = (max(1, n_blocks),)
        if mv.q8:
            if mv.ssq_out is not None:  # the blocks' partial sums, for the reader after this
                mv.ssq_out.n = n_blocks if n == 1 and n_blocks <= _MVQ_SSQ_MAX else 0
            args += _ssq_args(mv)
            args.append(np.int32(self._pdl_at(n_blocks, max(1, per_sm))))
        if pdl is not None and mv.q8:  # the int8 kernels call pdl_wait()
            pdl.launch(kernel, grid, (threads,), args, smem, pdl.stream)
        else:
            kernel(grid, (threads,), tuple(args), shared_mem=smem)

    def _gemm_input(self, x) -> tuple:
        """x as ``_gemm`` takes it: (rows, the device array cuBLAS reads, its cuBLAS type,
        cuBLAS's alpha and beta on the device).

        Arithmetic "exact": x itself, float32 (SGEMM), alpha 1. "ggml": x in fp16 for the
        tensor cores, as llama.cpp's cuBLAS path multiplies in fp16 (its own prompt kernels
        use int8 x), so each value is rounded to 11 significant bits. x is divided by a power
        of two s first, so that none of it overflows fp16 (s = 1 unless max|x| >= 2^15), and
        alpha = s (set on the device by ``to_half_scaled``) multiplies the product back.
        """
        n, k = x.shape
        if self.arithmetic == "exact":
            return n, x, _R_32F, self._gemm_scal
        cp = self.cp
        xh = cp.empty(n * k, dtype=cp.uint16)
        amax = cp.zeros(1, dtype=cp.uint32)  # max|x|, as the bits of a float
        ab = cp.empty(2, dtype=cp.float32)
        blocks = min(-(-(n * k) // _EW_THREADS), 4 * self._n_sm)
        self._launch(self._k_absmax, (blocks,), (_EW_THREADS,), (x, np.int64(n * k), amax))
        args = (x, np.int64(n * k), amax, xh, ab)
        self._launch(self._k_to_half, self._grid1(n * k), (_EW_THREADS,), args)
        return n, xh, _R_16F, ab

    def _gemm(self, xin: tuple, dw: _DeviceWeight, kernels: _Kernels, y) -> None:
        """y = x @ W.T for a batch of rows (prefill), x from ``_gemm_input``: W dequantized
        into the workspace tile by tile (float32 or fp16, as x), each tile times x by cuBLAS
        (cublasGemmEx, float32 sums), written into its columns of y."""
        cp = self.cp
        n, xdev, in_type, ab = xin
        k, m = dw.k, dw.m
        size = 4 if in_type == _R_32F else 2
        dequant = kernels.dequant if in_type == _R_32F else kernels.dequant_h
        tile_rows = max(1, min(m, WORKSPACE_BYTES // (size * k)))
        need = tile_rows * k * size
        if self._workspace is None or self._workspace.nbytes < need:
            self._workspace = None
            self._reserve(need, "the prefill workspace")
            self._workspace = cp.empty(need, dtype=cp.uint8)
        wt = self._workspace
        cublas = self._cublas
        handle = cp.cuda.device.get_cublas_handle()
        cpr = k // 32
        cublas.setPointerMode(handle, _POINTER_MODE_DEVICE)
        try:
            for r0 in range(0, m, tile_rows):
                nr = min(tile_rows, m - r0)
                args = (dw.buf, np.int64(dw.n_blocks), np.int32(k), np.int32(r0), np.int32(nr), wt)
                self._launch(dequant, self._grid1(nr * cpr), (_EW_THREADS,), args)
                # column-major terms: y.T[r0:r0 + nr, :] = tile (k x nr, transposed) @ x.T
                cublas.gemmEx(
                    handle, _OP_T, _OP_N, nr, n, k,
                    ab.data.ptr, wt.data.ptr, in_type, k, xdev.data.ptr, in_type, k,
                    ab.data.ptr + 4, y.data.ptr + 4 * r0, _R_32F, m,
                    _COMPUTE_32F, _GEMM_DEFAULT,
                )  # fmt: skip
                self._n_launches += 1
        finally:
            cublas.setPointerMode(handle, _POINTER_MODE_HOST)

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
        get_rows = self._quant_kernels(dw.qtype).get_rows
        n = len(ids)
        with self._stream:
            out = self._empty((n, dw.k))
            if n == 0:
                return out
            dev_ids = self._params.ids if self._mode != _EAGER else self._upload_i32(ids)
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
        self._bind_positions(positions)
        if self._mode == _EAGER:
            return self._rope(x, positions, n_rot, freq_base, freq_scale, neox)
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
        if self._mode != _EAGER:
            self._bind_positions((start,), (cache,))
        if self._mode == _EAGER:
            self._store_kv(cache, layer, k, v, start)
            return
        # a decode graph: the cache is the step's parameter (one graph for all caches)
        key = ("store_kv", layer, k.shape, v.shape)
        self._dispatch(
            key,
            (k, v),
            lambda: self._store_rows(
                k, v, cache, self._kv_table(cache, layer), self._dev_start(start)
            ),
        )

    def _kv_rows(self, cache, k, v) -> tuple:
        """k and v contiguous, with their rows' widths, checked against the cache."""
        k, v = self._contig(k), self._contig(v)
        n = k.shape[0]
        kdim, vdim = k.size // max(n, 1), v.size // max(n, 1)
        if (
            kdim != cache.n_kv_heads * cache.head_dim_k
            or vdim != cache.n_kv_heads * cache.head_dim_v
        ):
            raise BackendError(f"store_kv: k {k.shape} / v {v.shape} do not fit the cache")
        return k, v, n, kdim, vdim

    def _store_kv(self, cache, layer, k, v, start):
        k, v, n, kdim, vdim = self._kv_rows(cache, k, v)
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
        if self._mode != _EAGER:
            self._bind_positions((start,), (cache,))
        if self._mode == _EAGER:
            return self._attention(q, cache, layer, start, scale, window, softcap)
        key = ("attention", layer, q.shape, float(scale), int(window), float(softcap))
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
        if n == 1:  # the cache through its pointer table (a decode graph's parameter)
            table = self._kv_table(cache, layer)
            kernel = self._gqa_kernel(n_heads, cache)
            if kernel is not None:
                starts = self._dev_start(start)
                return self._attend_gqa(kernel, q, cache, table, starts, scale, window, softcap)
        smem = 4 * (2 * _ATT_TILE * (hd + 1) + _ATT_TILE * hdv + _ATT_TILE * (_ATT_TILE + 1))
        if (
            n >= _ATT_TILES_MIN
            and hd % 2 == 0
            and hdv % 2 == 0
            and hdv <= _ATT_MAXD
            and smem <= self._smem_optin - 1024
        ):
            with self._stream:
                out = self._empty((n, n_heads * hdv))
                args = (
                    q, cache.k[layer], cache.v[layer], self._dev_start(start), np.int32(n),
                    np.int32(n_heads), np.int32(cache.n_kv_heads), np.int32(hd), np.int32(hdv),
                    np.float32(scale), np.int32(window), np.float32(softcap), out,
                )  # fmt: skip
                kernel = self._k_att_tiles[16 if hdv <= 128 else 32]
                grid = (n_heads, -(-n // _ATT_TILE))
                self._launch(kernel, grid, (128,), args, shared_mem=smem)
            return out
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
                table[0] if n == 1 else cache.k[layer],  # attention_decode: pointer tables
                table[1] if n == 1 else cache.v[layer],
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
            kernel = self._k_att_dec if n == 1 else self._k_att
            self._launch(kernel, (n_heads, n, n_splits), (128,), args)
            if n_splits > 1:
                args = (part, out, np.int32(n_heads), np.int32(hdv), np.int32(n_splits))
                self._launch(self._k_comb, (n_heads, n), (128,), args)
        return out

    def copy_kv(self, src: KVCache, dst: KVCache, start: int, end: int) -> None:
        """On the backend's stream: a copy on CuPy's default stream would not be ordered
        with the kernels (ours is non-blocking), so the next step could read the rows
        before they arrive."""
        with self._stream:
            super().copy_kv(src, dst, start, end)

    def attend_batch(self, batch, layer, q, k, v, scale, window=0, softcap=0.0):
        """One token of each of several sequences (the server's decode step): every k/v row
        into its cache in one launch (``store_kv_rows``) and the rows' attention in another
        (``attention_gqa_*``), each row exactly as it is computed alone. The caches must
        agree in geometry (so each row gets the splits it gets alone); anything else goes
        segment by segment. In a decode graph the caches' pointers and positions are the
        step's parameters (``_Params``)."""
        segs = batch.segments
        n = len(segs)
        c0 = segs[0].cache
        shape = c0.geometry
        kernel = self._gqa_kernel(q.shape[1], c0) if q.ndim == 3 else None
        if (
            n < 2
            or len(batch) != n
            or kernel is None
            or any(s.cache.geometry != shape for s in segs)
        ):
            return super().attend_batch(batch, layer, q, k, v, scale, window, softcap)
        for seg in segs:
            if seg.start + 1 > seg.cache.n_ctx:
                raise BackendError(
                    f"KV cache of {seg.cache.n_ctx} positions overflows at {seg.start + 1}"
                )
        if self._mode != _EAGER:
            self._bind_positions(batch.positions, [s.cache for s in segs])
        if self._mode == _EAGER:
            table = self._cache_table([s.cache for s in segs])[1]
            return self._attend_rows(
                kernel, q, k, v, c0, table[layer], self._dev_positions(batch.positions),
                scale, window, softcap,
            )  # fmt: skip
        p = self._params
        key = ("attend_batch", layer, q.shape, k.shape, v.shape, float(scale), int(window))
        key += (float(softcap), shape)
        return self._dispatch(
            key,
            (q, k, v),
            lambda: self._attend_rows(
                kernel, q, k, v, c0, p.table[layer], p.pos, scale, window, softcap
            ),
        )

    def _attend_rows(self, kernel, q, k, v, c0, table, starts, scale, window, softcap):
        """``attend_batch``'s two launches; ``table``: the layer's (2, n) cache pointers."""
        q = self._contig(q)
        n, _n_heads, hd = q.shape
        if hd != c0.head_dim_k:
            raise BackendError(f"attention: q {q.shape} does not fit the caches")
        self._store_rows(k, v, c0, table, starts)
        return self._attend_gqa(kernel, q, c0, table, starts, scale, window, softcap)

    def _store_rows(self, k, v, cache, table, starts) -> None:
        """Row t of k and v into the cache at ``table[:, t]`` (the layer's (2, n) device
        pointers), at position ``starts[t]`` (one launch of ``store_kv_rows``); every cache
        of ``cache``'s geometry."""
        k, v, n, kdim, vdim = self._kv_rows(cache, k, v)
        with self._stream:
            args = (
                k, v, table[0], table[1], starts, np.int32(n), np.int32(kdim), np.int32(vdim),
                np.int32(cache.n_ctx),
            )  # fmt: skip
            self._launch(self._k_store_rows, self._grid1(n * (kdim + vdim)), (_EW_THREADS,), args)

    def _attend_gqa(self, kernel, q, cache, table, starts, scale, window, softcap):
        """Row t of q (one token) against the cache at ``table[:, t]``, position
        ``starts[t]``: a block per (KV head, split, row) over the whole GQA group (ops.cu)."""
        n, n_heads, hd = q.shape
        n_kv = cache.n_kv_heads
        group = n_heads // n_kv
        n_splits = self._gqa_splits(cache)
        with self._stream:
            out = self._empty((n, n_heads * hd))
            part = self._empty((n * n_kv * n_splits * group * (hd + 2),)) if n_splits > 1 else out
            counter = self.cp.zeros((n * n_kv,), dtype=self.cp.int32)
            args = (
                q, table[0], table[1], starts, np.int32(n_heads), np.int32(n_kv),
                np.float32(scale), np.int32(window), np.float32(softcap),
                np.int32(_ATT_SPLIT_KEYS), out, part, counter,
                np.int32(self._pdl_at(n * n_kv * n_splits)),
            )  # fmt: skip
            self._launch(kernel, (n_kv, n_splits, n), (128,), args)
        return out

    def _kv_table(self, cache: KVCache, layer: int):
        """The device pointers (2 (k, v), 1) of one cache's layer: the step's parameters in
        a decode graph, else the cache's own table."""
        if self._mode != _EAGER:
            return self._params.table[layer]
        return self._cache_table([cache])[1][layer]

    def _cache_table(self, caches: list) -> tuple:
        """The device pointers of ``caches``' layers, uint64 (n_layers, 2 (k, v), len(caches)),
        on the host and on the device; made once per set of caches."""
        key = tuple((id(c), c.k[0].data.ptr) for c in caches)
        hit = self._cache_tables.get(key)
        if hit is not None and all(ref() is c for ref, c in zip(hit[0], caches, strict=True)):
            return hit[1]
        if len(self._cache_tables) >= _MAX_CACHE_TABLES:
            self._cache_tables = {
                k: v for k, v in self._cache_tables.items() if all(r() is not None for r in v[0])
            }
            if len(self._cache_tables) >= _MAX_CACHE_TABLES:
                self._cache_tables.clear()
        host = np.array(
            [
                [[c.k[il].data.ptr for c in caches], [c.v[il].data.ptr for c in caches]]
                for il in range(caches[0].n_layers)
            ],
            dtype=np.uint64,
        )
        with self._stream:
            dev = self.cp.asarray(host)
        self._cache_tables[key] = ([weakref.ref(c) for c in caches], (host, dev))
        return host, dev

    def _gqa_kernel(self, n_heads: int, cache: KVCache):
        """The decode attention kernel for whole GQA groups (ops.cu), or None where its
        shapes don't fit: head_dim 64, 128 or 256 for keys and values, groups of <= 8."""
        hd, group = cache.head_dim_k, n_heads // cache.n_kv_heads
        if hd != cache.head_dim_v or hd not in (64, 128, 256) or not 1 <= group <= 8:
            return None
        return self._k_att_gqa[(hd // 32, min(g for g in _ATT_GROUPS if g >= group))]

    def _pdl_at(self, n_blocks: int, per_sm: int = 1) -> int:
        """Where a kernel of ``n_blocks`` blocks, ``per_sm`` of which fit an SM, lets its
        dependents launch (common.cuh, pdl_trigger_at): right after its own wait when it
        leaves at least half the SMs idle for the next kernel's blocks to wait on, or, for
        kernels of several blocks an SM, free block slots (a grid short of a full wave: the
        135M shape's gate+up, 192 blocks of 8 warps in 264 slots); else when its main work is
        done. Measured on the H200: the first everywhere made the 135M shape 10% faster than
        the second and the 8B 2.5% slower (run 10); the partial-wave case (run 13) was
        tried because every launch triggering early looked 5% faster on the 135M in two
        runs, which a third did not bear out: its own effect is within the spread."""
        if 2 * n_blocks <= self._n_sm:
            return 1
        return 1 if per_sm > 1 and n_blocks < per_sm * self._n_sm else 2

    def _gqa_splits(self, cache: KVCache) -> int:
        """Splits of the valid key range for decode: about one block per SM over the KV
        heads, at most one per tile of positions of the cache (the kernel uses as many as
        the current range fills with tiles)."""
        per_sm = max(1, self._n_sm // cache.n_kv_heads)
        return max(1, min(_ATT_MAX_SPLITS, per_sm, cache.n_ctx // _ATT_SPLIT_KEYS))

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
        self._n_launches += 1
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
