"""Throughput of the CUDA backend on synthetic Llama-shaped models (pp512 / tg128).

    python -m picollama.backends.cuda.bench_synthetic [--models 135m-q4_k_m,8b-q4_k_m]
        [--dir DIR] [-p 512] [-n 128] [-r 3] [--arithmetic ggml|exact]
        [--llama-bench PATH/TO/llama-bench]  # llama.cpp's figures on the same files
    python -m picollama.backends.cuda.bench_synthetic --barrier  # a grid barrier alone
    python -m picollama.backends.cuda.bench_synthetic --trace --models 8b-q4_k_m  # warp timeline

Writes GGUF files with the shapes of SmolLM2-135M, Llama-3.2-1B and Llama-3-8B (random
weights drawn with fixed seeds, quantized like Q4_K_M: Q4_K, with Q6_K for ffn_down and the
output matrix; Q8_0; or Q4_1 with Q8_0 tied embeddings, as SmolLM2's Q4_1 file, for the CPU
server's benchmark on hosts the real file can't reach), then runs each in a fresh process: pp<N> is
tokens/s of one prompt batch of N tokens, tg<N> of N tokens decoded one at a time (CUDA
graphs), each the mean of -r runs after a warm-up; "pp<N> GPU-only" is N over the GPU's
own time for that batch (the host's dispatch hidden behind a spinning kernel), so that a
prompt figure bound by the host shows as such. The decode ceiling is the device's memory
bandwidth (a device-to-device copy, bytes read plus written) over the model file's bytes:
a token reads every weight once. With --llama-bench, llama.cpp's llama-bench (a CUDA build)
times the same files, flash attention off and on, and a second table sets its medians
beside ours (llama.cpp loads these files as they are).

Only the byte format matters for speed, so the blocks are random bytes with their scale
fields set to small finite fp16 values (quantizing 8B weights with the numpy reference
quantizer would take hours). Tensors whose rows are not a multiple of 256 fall back as in
llama.cpp (Q4_K -> Q5_0, Q6_K -> Q8_0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "SHAPES",
    "MIXES",
    "KERNEL_SHAPES",
    "write_model",
    "kernel_bench",
    "barrier_bench",
    "profile_step",
    "trace_step",
    "trace_report",
    "main",
]


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    n_vocab: int
    tied: bool
    rope_base: float


SHAPES = {
    "135m": Shape(576, 30, 9, 3, 64, 1536, 49152, True, 100000.0),  # SmolLM2-135M
    "1b": Shape(2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),  # Llama-3.2-1B
    "8b": Shape(4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),  # Llama-3-8B
}

# mix -> (default type, type of ffn_down / output / tied embeddings)
MIXES = {"q4_k_m": ("Q4_K", "Q6_K"), "q8_0": ("Q8_0", "Q8_0"), "q4_1": ("Q4_1", "Q4_1")}
# tied embeddings of another type than the mix's second (SmolLM2's Q4_1 file: Q8_0)
EMBEDDING_TYPES = {"q4_1": "Q8_0"}
FILE_TYPES = {"q4_k_m": 15, "q8_0": 7, "q4_1": 3}  # general.file_type, as llama-quantize writes
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # rows not a multiple of 256

# offsets of the fp16 scale fields that must hold finite values, per type
_SCALE_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2)}


def _random_tensor(rng, qtype_name: str, k: int, m: int) -> tuple[np.ndarray, int]:
    from picollama.gguf.constants import GGML_TYPES, GGMLType

    qtype = GGMLType[qtype_name]
    info = GGML_TYPES[qtype]
    n_blocks = m * k // info.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, info.type_size), dtype=np.uint8)
    # a small scale: weights of size ~1/sqrt(k), whatever the random codes are
    scale = np.array([1.0 / (np.sqrt(k) * 64.0)], dtype=np.float16).view(np.uint8)
    for off in _SCALE_FIELDS[qtype_name]:
        blocks[:, off : off + 2] = scale
    return blocks.reshape(m, -1), qtype


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 256))
    out, n = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def write_model(path: str, shape_name: str, mix: str, seed: int = 0) -> int:
    """Write a synthetic Llama-shaped model; returns the bytes of its tensors."""
    from picollama.gguf import GGUFWriter

    s = SHAPES[shape_name]
    main_type, big_type = MIXES[mix]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch="llama")
    w.add_uint32("general.file_type", FILE_TYPES[mix])
    w.add_uint32("llama.block_count", s.n_layers)
    w.add_uint32("llama.context_length", 8192)
    w.add_uint32("llama.embedding_length", s.n_embd)
    w.add_uint32("llama.feed_forward_length", s.n_ff)
    w.add_uint32("llama.attention.head_count", s.n_heads)
    w.add_uint32("llama.attention.head_count_kv", s.n_kv_heads)
    w.add_uint32("llama.attention.key_length", s.head_dim)
    w.add_uint32("llama.attention.value_length", s.head_dim)
    w.add_uint32("llama.rope.dimension_count", s.head_dim)
    w.add_float32("llama.rope.freq_base", s.rope_base)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", s.n_vocab)
    # GPT-2 byte tokens, then placeholders up to the vocabulary size
    tokens = _byte_tokens() + [f"<t{i}>" for i in range(256, s.n_vocab)]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", np.ones(s.n_vocab, dtype=np.int32))
    w.add_array("tokenizer.ggml.merges", ["Ġ Ġ"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 256)
    w.add_uint32("tokenizer.ggml.eos_token_id", 257)

    total = 0

    def matrix(name, k, m, qtype_name):
        nonlocal total
        if k % 256 and qtype_name in _FALLBACK:
            qtype_name = _FALLBACK[qtype_name]
        raw, qtype = _random_tensor(rng, qtype_name, k, m)
        w.add_tensor(name, raw, ggml_type=qtype, shape=(k, m))
        total += raw.nbytes

    def vector(name, n):
        nonlocal total
        v = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, v)
        total += v.nbytes

    d, hd = s.n_embd, s.head_dim
    embd_type = EMBEDDING_TYPES.get(mix, big_type) if s.tied else main_type
    matrix("token_embd.weight", d, s.n_vocab, embd_type)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", d)
        matrix(p + "attn_q.weight", d, s.n_heads * hd, main_type)
        matrix(p + "attn_k.weight", d, s.n_kv_heads * hd, main_type)
        matrix(p + "attn_v.weight", d, s.n_kv_heads * hd, main_type)
        matrix(p + "attn_output.weight", s.n_heads * hd, d, main_type)
        vector(p + "ffn_norm.weight", d)
        matrix(p + "ffn_gate.weight", d, s.n_ff, main_type)
        matrix(p + "ffn_up.weight", d, s.n_ff, main_type)
        matrix(p + "ffn_down.weight", s.n_ff, d, big_type)
    vector("output_norm.weight", d)
    if not s.tied:
        matrix("output.weight", d, s.n_vocab, big_type)
    w.write()
    return total


def _run_one(
    path: str,
    n_prompt: int,
    n_gen: int,
    reps: int,
    graphs: bool,
    arithmetic: str,
    profile: bool = False,
    dependent_launch: bool = True,
    defines: tuple[str, ...] = (),
    graph_copies: bool = True,
) -> dict:
    """Load one model on the CUDA backend and time pp/tg (runs in its own process). Each of
    ``defines`` ("NAME=VALUE") is prepended to every kernel source as a ``#define``;
    ``graph_copies`` is the backend's attribute of that name."""
    from picollama.backends.cuda import layout
    from picollama.backends.cuda.backend import CUDABackend
    from picollama.generation import Context
    from picollama.tools.bench import _run_pp, _run_tg

    if defines:
        os.environ[layout.DEFINES_ENV] = ",".join(defines)
    t0 = time.perf_counter()
    backend = CUDABackend(graphs=graphs, arithmetic=arithmetic, dependent_launch=dependent_launch)
    backend.graph_copies = graph_copies
    ctx = Context(path, n_ctx=max(n_prompt, n_gen), n_batch=n_prompt, backend=backend)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    result = {"load_s": load_s, "memory": backend.memory_report()}
    for name, fn, n in (("pp", _run_pp, n_prompt), ("tg", _run_tg, n_gen)):
        fn(ctx, min(n, 16), rng)  # warm-up: compiles kernels, records the decode graph
        runs = [fn(ctx, n, rng) for _ in range(reps)]
        result[f"{name}{n}"] = (
            float(np.mean(runs)),
            float(np.std(runs)),
            float(np.median(runs)),
        )
    result[f"pp{n_prompt}_gpu_ms"] = _prefill_gpu_ms(ctx, backend, n_prompt, rng)
    result["graph_stats"] = dict(backend.graph_stats)
    if profile and graphs:
        result["profile"] = profile_step(backend)
    result["bandwidth"] = backend.measure_bandwidth()
    result["device"] = backend.device_name
    return result


def stream_steps(
    path: str, levels: tuple[int, ...], n_steps: int = 32, prompt: int = 32, profile=False
) -> list:
    """Decode steps of N sequences at once (the server's batches: one token of each of N
    sequences, each in its own cache, through ``forward_step``), in process: for each N of
    ``levels``, (N, median ms a step, aggregate tokens/s, graph_stats after it). Each
    sequence first takes a prompt of ``prompt`` random tokens; the steps feed random tokens
    (the step's cost does not depend on them); the first 4 steps of a level are warm-up.
    With ``profile``, each level's graph is also split by kernel (``profile_step``), last in
    its tuple."""
    from picollama.backends.cuda.backend import CUDABackend
    from picollama.gguf import GGUFReader
    from picollama.models import load_model
    from picollama.models.base import Segment

    backend = CUDABackend()
    rng = np.random.default_rng(0)
    out = []
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        n_vocab = model.args.n_vocab
        for n in levels:
            caches = [model.new_cache(prompt + n_steps + 8) for _ in range(n)]
            for cache in caches:
                model.forward(rng.integers(0, n_vocab, size=prompt), 0, cache)
            times = []
            for step in range(n_steps + 4):
                tokens = rng.integers(0, n_vocab, size=n)
                segs = [Segment(tokens[i : i + 1], prompt + step, c) for i, c in enumerate(caches)]
                t0 = time.perf_counter()
                backend.forward_step(model, segs)
                times.append(time.perf_counter() - t0)
            ms = float(np.median(times[4:])) * 1e3
            row = (n, ms, n / ms * 1e3, dict(backend.graph_stats))
            if profile:
                trace = next(
                    (t for t in backend._traces.values() if t.params.n == n and t.graph), None
                )
                row += (profile_step(backend, trace=trace) if trace is not None else [],)
            out.append(row)
            del caches
    return out


def _prefill_gpu_ms(ctx, backend, n: int, rng, reps: int = 3) -> float:
    """Milliseconds of GPU work in one prompt batch of ``n`` tokens, without the host's share:
    the backend's stream is held by a spinning kernel (~0.5 s) while the host enqueues the
    batch, so the span between an event after the spin and one after the batch holds no wait
    for the host (median of ``reps``). Where pp<n> is far under n over this time, the prompt
    throughput is the host's (Python dispatch), not the kernels'. An upper bound if the
    forward waits for the device midway or enqueues for longer than the spin."""
    import cupy as cp

    spin = cp.RawKernel(
        'extern "C" __global__ void spin(long long n) {\n'
        "    long long t0 = clock64();\n"
        "    while (clock64() - t0 < n) {}\n"
        "}\n",
        "spin",
    )
    stream = backend._stream
    times = []
    for _ in range(reps):
        tokens = rng.integers(0, ctx.n_vocab, size=n).tolist()
        ctx.reset()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        with stream:
            spin((1,), (1,), (np.int64(1 << 30),))
            start.record(stream)
        ctx.eval(tokens)
        with stream:
            stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def _llama_cpp(exe: str, path: str, n_prompt: int, n_gen: int, reps: int) -> dict:
    """llama.cpp's llama-bench on one file (all layers on the GPU, flash attention off and on):
    {(test, fa): median t/s, "build": its commit}. Medians, because its first sample of a
    test runs slow (seen on the H200: 24k against 55k t/s for the 135M's pp512)."""
    cmd = [exe, "-m", path, "-ngl", "99", "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-r", str(reps), "-fa", "off,on", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr.strip()[-600:]}")
    out: dict = {}
    for row in json.loads(proc.stdout):
        test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[(test, bool(row["flash_attn"]))] = float(np.median(row["samples_ts"]))
        out["build"] = f"{row['build_commit']} ({row['build_number']})"
    return out


L2_DEFEAT_BYTES = 256 << 20
KERNEL_SHAPES = (  # (type, k, m, gate+up fused)
    ("Q4_K", 4096, 14336, False),
    ("Q4_K", 4096, 14336, True),
    ("Q6_K", 14336, 4096, False),
    ("Q4_K", 4096, 4096, False),
    ("Q4_K", 4096, 1024, False),
    ("Q8_0", 576, 1536, False),
    ("Q5_0", 576, 1536, False),
    ("Q6_K", 4096, 128256, False),
)


def _launch_namer(backend):
    """A function from a recorded launch to its kind, e.g. "matvec_q8 Q4_K 6144x4096 3
    weight(s) +rope+store" or "attention_gqa_4_4"."""
    from picollama.backends.cuda.backend import _Matvec

    names = {id(getattr(backend, a)): a[3:] for a in dir(backend) if a.startswith("_k_")}
    names.update({id(k): f"attention_gqa_{d}_{g}" for (d, g), k in backend._k_att_gqa.items()})

    def name(launch) -> str:
        if hasattr(launch, "chain"):  # a persistent launch of several matvecs (ring.cu)
            return "ring: " + " -> ".join(name(mv) for mv in launch.chain)
        if not isinstance(launch, _Matvec):
            return names.get(id(launch.kernel), "get_rows")
        w = launch.weights[0]
        rows = sum(dw.m for dw in launch.weights) if not launch.act else w.m
        what = "gate+up+act" if launch.act else f"{len(launch.weights)} weight(s)"
        what += " +rope+store" if launch.rope is not None else ""
        kind = "matvec_q8" if launch.q8 else "matvec"
        return f"{kind} {w.qtype.name} {rows}x{w.k} {what}"

    return name


def trace_step(path: str, show: int = 10) -> list[str]:
    """A timeline of one decode step's one-token int8 matvecs, warp by warp: the kernels are
    built with MVQ_TRACE=1 (mmvq.cu), one step is replayed from its graph, and each warp's
    times (entry, the dependent-launch wait done, x quantized, its first unit multiplied,
    done; %globaltimer) are read back. Returns the report's lines: the first ``show``
    launches one by one, then each kind's medians over the step's launches of that kind,
    then each kind's prologue in four parts (``prologue_report``).
    The timer costs a little (an atomic a warp at its end), so read the spans as shares, not
    as the build's own times."""
    import cupy as cp

    from picollama.backends.cuda import layout
    from picollama.backends.cuda.backend import CUDABackend, _Matvec
    from picollama.generation import Context

    defines = [d for d in os.environ.get(layout.DEFINES_ENV, "").split(",") if d.strip()]
    os.environ[layout.DEFINES_ENV] = ",".join(defines + ["MVQ_TRACE=1"])
    backend = CUDABackend(graphs=True)
    ctx = Context(path, n_ctx=64, n_batch=16, backend=backend)
    rng = np.random.default_rng(0)
    ctx.eval(rng.integers(0, ctx.n_vocab, size=8).tolist())
    for tok in rng.integers(0, ctx.n_vocab, size=4).tolist():  # records, then replays
        ctx.eval([tok])
    # (module, its records, their counter, records at most, their width): mmvq.cu's (three
    # more columns: x's first round quantized, the next unit's loads issued, x's first
    # round's loads in registers), and ring.cu's
    # (a record a block and phase, its kinds named "ring: ...", two more columns: the
    # phase's waits for landed stages and for free slots)
    mods = [
        (k.module, "mvq_trace", "mvq_trace_n", 262144, 10)  # mmvq.cu's MVQ_TRACE_CAP
        for q, k in backend._quant_mods.items()
        if q in layout.Q8DOT_TYPES
    ]
    if backend._ring_mod is not None:
        mods.append((backend._ring_mod, "ring_trace", "ring_trace_n", 65536, 9))  # RING_TRACE_CAP
    counters = [cp.ndarray((1,), cp.uint32, memptr=m.get_global(n)) for m, _, n, _, _ in mods]
    for c in counters:
        c.fill(0)
    cp.cuda.runtime.deviceSynchronize()
    ctx.eval([int(rng.integers(0, ctx.n_vocab))])
    cp.cuda.runtime.deviceSynchronize()
    rows, prologues, waits = [], [], None
    for (m, records, _, cap, width), c in zip(mods, counters, strict=True):
        n = min(int(c.get()[0]), cap)
        rec = cp.ndarray((n, width), cp.uint64, memptr=m.get_global(records)).get()
        rows.append(rec[:, :7])
        if records == "ring_trace":
            waits = rec
        else:
            prologues.append(rec)
    trace = next(t for t in backend._traces.values() if t.graph is not None)
    name = _launch_namer(backend)
    launches = backend._fuse(trace) if backend.fuse else trace.launches
    kinds = {}
    for launch in launches:
        for mv, ringed in [(launch, False)] + [(c, True) for c in getattr(launch, "chain", ())]:
            if isinstance(mv, _Matvec):
                kinds[int(mv.weights[0].buf.data.ptr)] = ("ring: " if ringed else "") + name(mv)
    out = trace_report(np.concatenate(rows), kinds, show)
    out += prologue_report(np.concatenate(prologues), kinds)
    if waits is not None and len(waits):
        out += ring_wait_report(waits, kinds)
    return out


def _kind_of(ptr, kinds: dict[int, str]) -> str:
    """A launch's kind by its first weight's address (the address where it has none)."""
    return kinds.get(int(ptr), hex(int(ptr)))


def _kind_names(rec: np.ndarray, kinds: dict[int, str]) -> np.ndarray:
    """Each trace record's kind of launch (its first column: the first weight's address)."""
    return np.array([_kind_of(p, kinds) for p in rec[:, 0]])


def prologue_report(rec: np.ndarray, kinds: dict[int, str]) -> list[str]:
    """A launch's prologue in five parts, from mmvq.cu's records (columns 3-5: wait done, x
    quantized, first unit; 7: x's first round of loads quantized; 8: the next unit's loads
    issued in the pipe's first step; 9: the first round's loads in registers): medians over
    the warps of each kind's launches (us). The first part is x's loads in flight (behind
    the weights in flight), the second its first round's arithmetic; the fourth, a warp
    held up issuing loads; the fifth, the first unit's weights still on their way (or its
    dots)."""
    out = [
        "kind | wait->x's first loads in | ->first round quantized | ->x quantized"
        " | ->next unit's loads issued | ->first unit (us, medians)"
    ]
    t = rec.astype(np.float64)
    t[rec == 0] = np.nan  # a time not taken (no first round, no next unit)
    names = _kind_names(rec, kinds)
    for kind in dict.fromkeys(names.tolist()):
        r = t[names == kind]
        parts = (r[:, 9] - r[:, 3], r[:, 7] - r[:, 9], r[:, 4] - r[:, 7], r[:, 8] - r[:, 4],
                 r[:, 5] - r[:, 8])  # fmt: skip
        with warnings.catch_warnings():  # all-NaN parts (no warp had a next unit) stay NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            cols = " | ".join(f"{np.nanmedian(p) / 1000:6.2f}" for p in parts)
        out.append(f"{kind} | {cols}")
    return out


def ring_wait_report(rec: np.ndarray, kinds: dict[int, str]) -> list[str]:
    """ring.cu's records by kind of phase: medians over blocks and phases of the phase's
    time (x quantized -> done), warp 0's waits for its stages' bytes and the producer's
    waits for free slots (us). Consumers that wait get their bytes too slowly; a producer
    that waits while the consumers don't has consumers slower than the memory."""
    out = [
        "ring phase | phases | x quantized->done | warp 0 waited for bytes"
        " | producer waited for slots (us, medians)"
    ]
    names = _kind_names(rec, kinds)
    n_blocks = len(set((rec[:, 1] & 0xFFFFFF).tolist()))
    for kind in dict.fromkeys(names.tolist()):
        r = rec[names == kind].astype(np.float64)
        vals = (np.median(r[:, 6] - r[:, 4]), np.median(r[:, 7]), np.median(r[:, 8]))
        cols = " | ".join(f"{v / 1000:6.2f}" for v in vals)
        out.append(f"{kind} | {len(r) // n_blocks} | {cols}")
    return out


def trace_report(rec: np.ndarray, kinds: dict[int, str], show: int = 10) -> list[str]:
    """``trace_step``'s report from mmvq.cu's records (rows of: the launch's first weight
    address, block | warp << 16 | SM << 24, then the five times in ns, 0 for a time not
    taken) and the kinds of launch by first weight address."""
    with warnings.catch_warnings():  # medians of all-NaN columns (no first-unit times) are NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return _trace_lines(rec, kinds, show)


def _trace_lines(rec: np.ndarray, kinds: dict[int, str], show: int) -> list[str]:
    times = rec[:, 2:].astype(np.float64)
    t_base = times[:, 0].min()
    times = (times - t_base) / 1000.0  # us from the step's first warp
    times[rec[:, 5] == 0, 3] = np.nan  # warps without a unit
    order = sorted(set(rec[:, 0].tolist()), key=lambda p: times[rec[:, 0] == p, 0].min())
    out = [
        "us from the step's first warp; min/median/max over the launch's warps",
        "launch | warps | entry | wait done | x quantized | first unit | done | span",
    ]
    per_kind: dict[str, list[tuple[float, ...]]] = {}
    prev_end = None
    for i, ptr in enumerate(order):
        t = times[rec[:, 0] == ptr]
        kind = _kind_of(ptr, kinds)
        med = np.nanmedian(t, axis=0)
        gap = np.nan if prev_end is None else med[1] - prev_end
        per_kind.setdefault(kind, []).append(
            (
                med[1] - med[0],  # entry -> wait done
                med[2] - med[1],  # wait -> x quantized
                np.nanmedian(t[:, 3] - t[:, 2]),  # x quantized -> first unit
                np.nanmedian(t[:, 4] - t[:, 2]),  # x quantized -> done
                t[:, 4].max() - med[4],  # the last warp after the median one
                t[:, 4].max() - t[:, 0].min(),  # span
                gap,  # the previous launch's last warp -> this one's wait done (median)
            )
        )
        prev_end = t[:, 4].max()
        if i < show:
            cols = " | ".join(
                f"{np.nanmin(t[:, c]):6.1f}/{med[c]:6.1f}/{np.nanmax(t[:, c]):6.1f}"
                for c in range(5)
            )
            out.append(f"{i:3d} {kind} | {len(t)} | {cols} | {t[:, 4].max() - t[:, 0].min():5.1f}")
    out.append(
        "kind | launches | entry->wait | wait->x quantized | ->first unit | x quantized->done"
        " | last warp after median | span | previous launch's end->wait done (us, medians)"
    )
    for kind, vals in per_kind.items():
        v = np.nanmedian(np.array(vals), axis=0)
        out.append(f"{kind} | {len(vals)} | " + " | ".join(f"{x:5.2f}" for x in v))
    return out


def profile_step(backend, reps: int = 20, trace=None) -> list[tuple[str, int, float]]:
    """Where a decode step's GPU time goes, by leaving kernels out: the step's fused launches
    are captured into a graph whole and once without each kind of kernel; a kind's share is
    the whole graph's time minus the time of the graph without it (each timed over ``reps``
    replays; the outputs are garbage, the timing is not: no kernel's work depends on the
    values). Returns (kernel, launches per step, microseconds per step), largest first,
    and ("graph", launches, whole step) first of all. ``trace``: the step's recording
    (default: the first recorded)."""
    if trace is None:
        trace = next(t for t in backend._traces.values() if t.graph is not None)
    launches = backend._fuse(trace) if backend.fuse else trace.launches
    name = _launch_namer(backend)
    kinds = [name(launch) for launch in launches]
    backend._params = trace.params
    backend._upload_params()
    whole = _graph_us(backend, launches, reps)
    rows = [("graph", len(launches), whole)]
    for kind in dict.fromkeys(kinds):
        rest = [launch for launch, k in zip(launches, kinds, strict=True) if k != kind]
        rows.append((kind, kinds.count(kind), whole - _graph_us(backend, rest, reps)))
    return rows[:1] + sorted(rows[1:], key=lambda r: -r[2])


def kernel_bench(
    reps: int = 64, shapes=KERNEL_SHAPES, arithmetics=("ggml", "ggml-wide", "exact")
) -> list[tuple[str, float, float]]:
    """(name, microseconds, GB/s of weight bytes) of single-token matvecs of 8B shapes, with
    int8 activations ("ggml"; "ggml-wide": every one through matvec_q8_n1_wide) and float
    activations ("exact"), and the fused gate+up+SiLU.
    Each is launched ``reps`` times back to back from a CUDA graph, as in a decode step,
    cycling through copies of the weight so that they are read from HBM, not from L2."""
    import cupy as cp

    from picollama.backends.cuda import backend as cuda_backend
    from picollama.backends.cuda import layout
    from picollama.backends.cuda.backend import CUDABackend, _Matvec
    from picollama.gguf.constants import GGMLType

    rng = np.random.default_rng(0)
    out = []
    wide_k = cuda_backend._MVQ_WIDE_K
    for arithmetic in arithmetics:
        cuda_backend._MVQ_WIDE_K = 1 if arithmetic == "ggml-wide" else wide_k
        be = CUDABackend(graphs=False, arithmetic=arithmetic.split("-")[0])
        for qtype_name, k, m, gated in shapes:
            qtype = GGMLType[qtype_name]
            q8 = arithmetic != "exact" and qtype in layout.Q8DOT_TYPES
            if gated and not q8:
                continue
            raws = [_random_tensor(rng, qtype_name, k, m)[0] for _ in range(2 if gated else 1)]
            nbytes = sum(raw.nbytes for raw in raws)
            # enough copies that the weights come from HBM, not from the 50 MB L2
            copies = max(1, min(64, -(-L2_DEFEAT_BYTES // nbytes)))
            x = be.from_host(rng.standard_normal((1, k)).astype(np.float32))
            y = be._empty((1, m))
            mvs = []
            for _ in range(copies):
                ws = [be.weight("w", qtype, (k, m), raw) for raw in raws]
                mv = _Matvec(be, q8, ws[0].data, y, x, 1)
                if gated:
                    mv.weights.append(ws[1].data)
                    mv.act = 1
                mvs.append(mv)
            stream = be._stream
            with stream:
                mvs[0].run()
                stream.begin_capture()
                for i in range(reps):
                    mvs[i % copies].run()
                graph = stream.end_capture()
                graph.launch(stream=stream)
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                graph.launch(stream=stream)
                stop.record(stream)
            stop.synchronize()
            us = cp.cuda.get_elapsed_time(start, stop) * 1000 / reps
            name = f"{qtype_name} {m}x{k}{' gate+up+silu' if gated else ''} {arithmetic}"
            out.append((name, us, nbytes / (us * 1e-6) / 1e9))
            del mvs, graph
    cuda_backend._MVQ_WIDE_K = wide_k
    return out


SWEEP_SHAPES = (
    ("Q4_K", 4096, 14336, True),
    ("Q6_K", 14336, 4096, False),
    ("Q4_K", 4096, 6144, False),
    ("Q4_K", 4096, 4096, False),
    ("Q5_0", 576, 1536, False),
)

# int8 matvec build variants for --sweep: (label, mmvq.cu macros)
_PAIRS = {"MVQ_Q4K_PAIR": 1, "MVQ_Q6K_PAIR": 1, "MVQ_UNROLL_Q6K_PAIR": 1}
MVQ_VARIANTS = (
    ("built in", {}),
    ("no pairs w8 b2", {"MVQ_WARPS": 8, "MVQ_MIN_BLOCKS": 2, "MVQ_Q4K_PAIR": 0, "MVQ_Q6K_PAIR": 0}),
    (
        "no pairs w16 b1",
        {"MVQ_WARPS": 16, "MVQ_MIN_BLOCKS": 1, "MVQ_Q4K_PAIR": 0, "MVQ_Q6K_PAIR": 0},
    ),
    ("pairs w8 b2", {"MVQ_WARPS": 8, "MVQ_MIN_BLOCKS": 2, **_PAIRS}),
    ("pairs w16 b1", {"MVQ_WARPS": 16, "MVQ_MIN_BLOCKS": 1, **_PAIRS}),
)


def mvq_sweep(reps: int = 64) -> list[tuple[str, str, float, float]]:
    """(variant, matvec, microseconds, GB/s) of the int8 matvecs of KERNEL_SHAPES built with
    each of MVQ_VARIANTS' macros."""
    from picollama.backends.cuda import layout

    saved = os.environ.get(layout.DEFINES_ENV)
    out = []
    try:
        for label, macros in MVQ_VARIANTS:
            os.environ[layout.DEFINES_ENV] = ",".join(f"{k}={v}" for k, v in macros.items())
            for name, us, gbs in kernel_bench(reps, SWEEP_SHAPES, arithmetics=("ggml",)):
                out.append((label, name, us, gbs))
    finally:
        if saved is None:
            os.environ.pop(layout.DEFINES_ENV, None)
        else:
            os.environ[layout.DEFINES_ENV] = saved
    return out


def attention_bench(
    reps: int = 50,
    heads: tuple[int, int, int] = (32, 8, 128),
    positions: tuple[int, ...] = (0, 127, 511, 4095),
) -> list[tuple[str, float]]:
    """(case, microseconds) of the decode attention kernel alone at several positions and KV
    splits; ``heads``: (query heads, KV heads, head_dim), by default the 8B shape's (the
    135M's: (9, 3, 64)), over a cache of 4096 positions."""
    import cupy as cp

    from picollama.backends.cuda.backend import CUDABackend, _Launch

    be = CUDABackend(graphs=False)
    rng = np.random.default_rng(0)
    n_ctx, (n_heads, n_kv, hd) = 4096, heads
    cache = be.new_kv_cache(1, n_ctx, n_kv, hd, hd)
    kv = be.from_host(rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32))
    be.store_kv(cache, 0, kv, kv, 0)
    q = be.from_host(rng.standard_normal((1, n_heads, hd)).astype(np.float32))
    table = be._cache_table([cache])[1][0]  # the kernels' (2, 1) cache pointers
    out = []
    for pos in positions:
        for splits in (1, 4, 16):
            chunk = -(-n_ctx // splits)
            res = be._empty((1, n_heads * hd))
            part = be._empty((n_heads * splits * (hd + 2),)) if splits > 1 else res
            start = be._upload_i32([pos])
            args = (
                q, table[0], table[1], start, np.int32(n_heads), np.int32(n_kv),
                np.int32(hd), np.int32(hd), np.float32(hd**-0.5), np.int32(0),
                np.float32(0.0), np.int32(chunk), res, part,
            )  # fmt: skip
            launches = [_Launch(be._k_att_dec, (n_heads, 1, splits), (128,), args)]
            if splits > 1:
                comb = (part, res, np.int32(n_heads), np.int32(hd), np.int32(splits))
                launches.append(_Launch(be._k_comb, (n_heads, 1), (128,), comb))
            out.append((f"attention pos {pos} splits {splits}", _graph_us(be, launches, reps)))
        for splits, min_keys in ((1, 1), (4, 128), (16, 32), (16, 64), (16, 128), (32, 64)):
            # the GQA kernel: a block per (KV head, split), splits of the valid range of at
            # least min_keys keys
            res = be._empty((1, n_heads * hd))
            part = be._empty((n_kv * splits * (n_heads // n_kv) * (hd + 2),))
            counter = cp.zeros((n_kv,), dtype=cp.int32)
            start = be._upload_i32([pos])
            args = (
                q, table[0], table[1], start, np.int32(n_heads), np.int32(n_kv),
                np.float32(hd**-0.5), np.int32(0), np.float32(0.0), np.int32(min_keys), res,
                part, counter, np.int32(be._pdl_at(n_kv * splits)),
            )  # fmt: skip
            kernel = be._gqa_kernel(n_heads, cache)
            launches = [_Launch(kernel, (n_kv, splits, 1), (128,), args)]
            us = _graph_us(be, launches, reps)
            out.append((f"attention_gqa pos {pos} splits {splits} min_keys {min_keys}", us))
    return out


_BARRIER_SRC = r"""
// A grid barrier (every block of the grid resident): bar[0] counts arrivals, bar[1] is a
// generation that the last arrival moves on after resetting bar[0]. FENCED: run 12's
// (__threadfence, atomicAdd, volatile spin); else release / acquire operations at GPU scope.
template <bool FENCED>
__device__ __forceinline__ void grid_barrier(int* bar, int n_blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (FENCED) {
            volatile int* vb = bar;
            const int gen = vb[1];
            __threadfence();
            if (atomicAdd(bar, 1) == n_blocks - 1) {
                atomicExch(bar, 0);
                __threadfence();
                atomicAdd(bar + 1, 1);
            } else {
                while (vb[1] == gen) {
                }
            }
            __threadfence();
        } else {
            int gen, old;
            asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(gen) : "l"(bar + 1) : "memory");
            asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;"
                         : "=r"(old) : "l"(bar) : "memory");
            if (old == n_blocks - 1) {
                asm volatile("st.relaxed.gpu.b32 [%0], 0;" ::"l"(bar) : "memory");
                asm volatile("st.release.gpu.b32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1)
                             : "memory");
            } else {
                int now;
                do {
                    asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(now) : "l"(bar + 1)
                                 : "memory");
                } while (now == gen);
            }
        }
    }
    __syncthreads();
}

extern "C" __global__ void barriers_fenced(int* bar, int n) {
    for (int i = 0; i < n; i++) grid_barrier<true>(bar, gridDim.x);
}

extern "C" __global__ void barriers_acq_rel(int* bar, int n) {
    for (int i = 0; i < n; i++) grid_barrier<false>(bar, gridDim.x);
}

// a launch that does nothing but wait for the one before (dependent launches) and let the
// next one in: the edge between two kernels of a decode graph
extern "C" __global__ void edge(int* bar, int n) {
    pdl_wait();
    pdl_trigger();
}
"""


def barrier_bench(n_barriers: int = 2000, reps: int = 5) -> list[tuple[str, float]]:
    """(case, microseconds) of one grid barrier alone, one block per SM of 16 (and 4) warps:
    a kernel of ``n_barriers`` barriers less a kernel of none, over ``n_barriers`` (median
    of ``reps``); and, for comparison, a launch edge: a graph of kernels that only wait for
    the one before, with dependent launches and without, per launch."""
    import cupy as cp

    from picollama.backends.cuda import layout
    from picollama.backends.cuda.backend import CUDABackend

    be = CUDABackend(graphs=False)
    mod = cp.RawModule(code=layout._read("common.cuh") + _BARRIER_SRC, options=("-std=c++17",))
    bar = cp.zeros((2,), dtype=cp.int32)
    stream = be._stream
    out = []

    def kernel_us(kernel, grid, threads, n) -> float:
        times = []
        with stream:
            for _ in range(reps + 1):
                t0, t1 = cp.cuda.Event(), cp.cuda.Event()
                t0.record(stream)
                kernel((grid,), (threads,), (bar, np.int32(n)))
                t1.record(stream)
                t1.synchronize()
                times.append(cp.cuda.get_elapsed_time(t0, t1) * 1000)
        return float(np.median(times[1:]))

    n_sm = be._n_sm
    for name in ("barriers_fenced", "barriers_acq_rel"):
        kernel = mod.get_function(name)
        for warps in (16, 4):
            empty = kernel_us(kernel, n_sm, 32 * warps, 0)
            full = kernel_us(kernel, n_sm, 32 * warps, n_barriers)
            label = f"{name[9:]}, {n_sm} blocks of {warps} warps"
            out.append((label, (full - empty) / n_barriers))
    edge = mod.get_function("edge")
    n_launch = 200
    for pdl in (be._pdl, None):
        with stream:
            stream.begin_capture()
            for _ in range(n_launch):
                if pdl is not None:
                    pdl.launch(edge, (n_sm,), (512,), (bar, np.int32(0)), 0, pdl.stream)
                else:
                    edge((n_sm,), (512,), (bar, np.int32(0)))
            graph = stream.end_capture()
            graph.launch(stream=stream)
            times = []
            for _ in range(reps):
                t0, t1 = cp.cuda.Event(), cp.cuda.Event()
                t0.record(stream)
                graph.launch(stream=stream)
                t1.record(stream)
                t1.synchronize()
                times.append(cp.cuda.get_elapsed_time(t0, t1) * 1000 / n_launch)
        kind = "dependent" if pdl is not None else "plain"
        out.append((f"launch edge in a graph ({kind} launches, {n_sm} x 16 warps)",
                    float(np.median(times))))  # fmt: skip
    return out


def _graph_us(be, launches, reps: int) -> float:
    """Microseconds per repetition of ``launches``, captured ``reps`` times into a graph."""
    import cupy as cp

    stream = be._stream
    with stream:
        stream.begin_capture()
        for _ in range(reps):
            for launch in launches:
                launch.run(be._pdl)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record(stream)
        graph.launch(stream=stream)
        t1.record(stream)
    t1.synchronize()
    return cp.cuda.get_elapsed_time(t0, t1) * 1000 / reps


def _model_path(directory: str, spec: str) -> str:
    """The synthetic file of ``spec`` ("135m-q4_k_m") in ``directory``, written (and the
    directory made) if missing."""
    shape_name, mix = spec.split("-", 1)
    path = os.path.join(directory, f"synth-{spec}.gguf")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        t0 = time.perf_counter()
        write_model(path, shape_name, mix, seed=zlib.crc32(spec.encode()))
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def _bench_file(args, spec: str, path: str, defines) -> dict | None:
    """One model file timed in a fresh process (``--run``) with the build ``defines``: its
    RESULT, or None (the failure printed)."""
    cmd = [sys.executable, "-m", "picollama.backends.cuda.bench_synthetic", "--run", path]
    cmd += ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions)]
    if args.no_graphs:
        cmd.append("--no-graphs")
    cmd += ["--arithmetic", args.arithmetic] + (["--profile"] if args.profile else [])
    cmd += ["--no-dependent-launch"] if args.no_dependent_launch else []
    cmd += ["--no-graph-copies"] if args.no_graph_copies else []
    for d in defines:
        cmd += ["--define", d]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{spec}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def ab_report(runs: list[tuple[str, str, float]], n_gen: int) -> list[str]:
    """``--ab``'s table from (build, model, tg median t/s) in the order they ran: each
    build's figures for a model in that order, their median, and each other build's median
    over the first's (above 1: faster than the first)."""
    builds = list(dict.fromkeys(b for b, _, _ in runs))
    models = list(dict.fromkeys(m for _, m, _ in runs))
    head = "| model | " + " | ".join(f"{b} tg{n_gen} | median" for b in builds)
    head += "".join(f" | {b} / {builds[0]}" for b in builds[1:]) + " |"
    lines = [head, "| --- |" + " ---: | ---: |" * len(builds) + " ---: |" * (len(builds) - 1)]
    for m in models:
        cells, medians = [], []
        for b in builds:
            figs = [t for bb, mm, t in runs if bb == b and mm == m]
            med = float(np.median(figs)) if figs else float("nan")
            medians.append(med)
            cells += [" / ".join(f"{t:.1f}" for t in figs) or "-", f"{med:.1f}"]
        cells += [f"{med / medians[0]:.3f}" for med in medians[1:]]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="135m-q4_k_m,135m-q8_0,1b-q4_k_m,8b-q4_k_m")
    p.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "picollama-synth"),
        help="where the synthetic GGUF files are written (default: the temp dir)",
    )
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--arithmetic", default="ggml", choices=("ggml", "exact"))
    p.add_argument(
        "--no-dependent-launch", action="store_true", help="graphs without programmatic launches"
    )
    p.add_argument(
        "--no-graph-copies",
        action="store_true",
        help="token id, position and logits copied around the decode graph, not inside it",
    )
    p.add_argument("--profile", action="store_true", help="time each kernel of a decode step")
    p.add_argument("--barrier", action="store_true", help="time a grid barrier alone and exit")
    p.add_argument(
        "--define",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="build the kernels with this macro (repeatable), e.g. PDL_TRIGGER=0",
    )
    p.add_argument(
        "--llama-bench",
        metavar="EXE",
        default=None,
        help="also time each file with llama.cpp's llama-bench (-ngl 99, -fa off and on)",
    )
    p.add_argument(
        "--streams",
        default=None,
        metavar="N,N,...",
        help="time decode steps of N sequences at once (the server's batches) and exit",
    )
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one model, in-process
    p.add_argument("--kernels", action="store_true", help="time single matvecs and exit")
    p.add_argument(
        "--write-only",
        action="store_true",
        help="write the --models files into --dir and exit (no GPU needed)",
    )
    p.add_argument("--sweep", action="store_true", help="time int8 matvec build variants")
    p.add_argument(
        "--ab",
        action="append",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="time the build of these macros (repeatable: several variants) against the "
        "--define build, taking turns for --rounds rounds, and print tg's medians and ratios",
    )
    p.add_argument("--rounds", type=int, default=2, help="--ab's rounds (default: 2)")
    p.add_argument(
        "--trace",
        action="store_true",
        help="a warp-by-warp timeline of one decode step's int8 matvecs (the first --models)",
    )
    args = p.parse_args(argv)

    if args.write_only:
        for spec in args.models.split(","):
            print(_model_path(args.dir, spec), flush=True)
        return 0

    if args.trace:
        if args.define:
            from picollama.backends.cuda import layout

            os.environ[layout.DEFINES_ENV] = ",".join(args.define)
        for line in trace_step(_model_path(args.dir, args.models.split(",")[0])):
            print(line, flush=True)
        return 0

    if args.ab:
        paths = {spec: _model_path(args.dir, spec) for spec in args.models.split(",")}
        builds = {"default": list(args.define)}
        for variant in args.ab:
            builds[variant] = list(args.define) + [d for d in variant.split(",") if d]
        runs = []
        for rnd in range(args.rounds):
            for label, defines in builds.items():
                for spec, path in paths.items():
                    res = _bench_file(args, spec, path, defines)
                    if res is None:
                        continue
                    tg = res[f"tg{args.n_gen}"][2]
                    runs.append((label, spec, tg))
                    print(f"round {rnd + 1} {label} {spec}: tg{args.n_gen} {tg:.1f} t/s "
                          f"({res['device']}, copy {res['bandwidth'] / 1e9:.0f} GB/s)",
                          flush=True)  # fmt: skip
        if not runs:
            print("--ab: no build ran (above: why)", flush=True)
            return 1
        print()
        for line in ab_report(runs, args.n_gen):
            print(line)
        return 0

    if args.sweep:
        for label, name, us, gbs in mvq_sweep():
            print(f"sweep {label:22s} {name:36s} {us:8.1f} us {gbs:7.0f} GB/s", flush=True)
        return 0

    if args.barrier:
        for label, us in barrier_bench():
            print(f"barrier {label}: {us:8.2f} us", flush=True)
        return 0

    if args.kernels:
        for name, us, gbs in kernel_bench():
            print(f"matvec {name}: {us:8.1f} us  {gbs:7.0f} GB/s (graph, back to back)")
        for heads, positions in (((32, 8, 128), (0, 127, 511, 4095)), ((9, 3, 64), (0, 31, 127))):
            for name, us in attention_bench(heads=heads, positions=positions):
                print(
                    f"{name} heads {heads}: {us:8.1f} us "
                    "(graph, back to back; with attn_combine if split)"
                )
        return 0

    if args.streams:
        levels = tuple(int(v) for v in args.streams.split(","))
        print("| model | sequences | ms a step | tokens/s | vs 1 sequence |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for spec in args.models.split(","):
            path = _model_path(args.dir, spec)
            rows = stream_steps(path, levels, profile=args.profile)
            one = next((row[2] for row in rows if row[0] == 1), None)
            for row in rows:
                n, ms, tps = row[:3]
                ratio = f"{tps / one:.2f}x" if one else "-"
                print(f"| {spec} | {n} | {ms:.2f} | {tps:.0f} | {ratio} |", flush=True)
            for row in rows if args.profile else ():
                for kname, count, us in row[4]:
                    print(f"  {row[0]} sequences: {us:8.1f} us  {count:4d} x  {kname}")
        return 0

    if args.run:
        res = _run_one(
            args.run,
            args.n_prompt,
            args.n_gen,
            args.repetitions,
            not args.no_graphs,
            args.arithmetic,
            args.profile,
            not args.no_dependent_launch,
            tuple(args.define),
            not args.no_graph_copies,
        )
        print("RESULT " + json.dumps(res))
        return 0

    rows = []
    peers: dict[str, dict] = {}
    for spec in args.models.split(","):
        path = _model_path(args.dir, spec)
        res = _bench_file(args, spec, path, args.define)
        if res is None:
            continue
        size = os.path.getsize(path)
        ceiling = res["bandwidth"] / size
        pp = res[f"pp{args.n_prompt}"]
        tg = res[f"tg{args.n_gen}"]
        rows.append((spec, size, pp, tg, res["bandwidth"], ceiling, res))
        if args.llama_bench:
            try:
                peers[spec] = _llama_cpp(
                    args.llama_bench, path, args.n_prompt, args.n_gen, args.repetitions
                )
            except (OSError, RuntimeError, ValueError, KeyError) as err:
                print(f"{spec}: llama-bench: {err}", flush=True)
        profile = res.pop("profile", None)
        print(f"{spec}: {json.dumps(res)}", flush=True)
        if profile:
            total = sum(us for _, _, us in profile[1:])
            print(f"{spec} decode step by kernel (graph of the step {profile[0][2]:.0f} us, "
                  f"{profile[0][1]} kernels, less the graph without each kind; the kinds' "
                  f"sum {total:.0f} us; tg step {1e6 / tg[0]:.0f} us):")  # fmt: skip
            for kname, count, us in profile[1:]:
                print(f"  {us:8.1f} us  {count:4d} x  {kname}")

    print()
    npp, ntg = args.n_prompt, args.n_gen
    print(
        f"| model | file | pp{npp} t/s | pp{npp} GPU-only t/s | tg{ntg} t/s | tg median | "
        "ceiling t/s | tg median / ceiling |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for spec, size, pp, tg, _bw, ceiling, res in rows:
        gpu = npp / (res[f"pp{npp}_gpu_ms"] * 1e-3)
        print(
            f"| {spec} | {size / 2**20:.0f} MiB | {pp[0]:.0f} ± {pp[1]:.0f} | {gpu:.0f} | "
            f"{tg[0]:.1f} ± {tg[1]:.1f} | {tg[2]:.1f} | {ceiling:.0f} | {tg[2] / ceiling:.1%} |"
        )
    if peers:
        build = next(iter(peers.values()))["build"]
        print(f"\nllama.cpp {build}, llama-bench -ngl 99, medians of -r {args.repetitions}:\n")
        print(
            f"| model | llama.cpp pp{npp} | with -fa | ours pp{npp} median | "
            f"llama.cpp tg{ntg} | with -fa | ours tg{ntg} median | ours / best llama.cpp tg |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for spec, _size, pp, tg, _bw, _ceiling, _res in rows:
            lc = peers.get(spec)
            if lc is None:
                continue
            best = max(lc[(f"tg{ntg}", False)], lc[(f"tg{ntg}", True)])
            print(
                f"| {spec} | {lc[(f'pp{npp}', False)]:.0f} | {lc[(f'pp{npp}', True)]:.0f} | "
                f"{pp[2]:.0f} | {lc[(f'tg{ntg}', False)]:.1f} | {lc[(f'tg{ntg}', True)]:.1f} | "
                f"{tg[2]:.1f} | {tg[2] / best:.2f} |"
            )
    if rows:
        dev = rows[0][6]["device"]
        print(f"\n{dev}; device bandwidth {rows[0][4] / 1e9:.0f} GB/s (copy, read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
