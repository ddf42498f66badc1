"""How fast one read stream from device memory can go, by the ways a kernel can load it.

    python -m picollama.backends.cuda.stream_bench [--mib 1024] [-r 5] [--quick]

Each case reads a buffer much larger than L2 once and reduces it (so that no load is
dead), timed by events, median of ``-r`` launches; the figure is GB/s of bytes read.

- ``ldg``: every thread loads 16 bytes at a time into registers, four loads in flight
  (the register kernels' way), over a grid of ``blocks`` a multiprocessor.
- ``bulk``: a ring of ``stages`` shared-memory stages of ``stage`` bytes a block, filled by
  ``cp.async.bulk`` (the bulk-copy engine; completion counted on one mbarrier a stage) from
  one producer warp; a stage is ``pieces`` copies, issued by ``issuers`` lanes of that warp,
  from one contiguous run (``run``) or from ``pieces`` places far apart (``scat``: a
  matrix's rows or fields); 8 consumer warps read each stage from shared memory and free
  its slot, or (``consumers 0``) the producer reuses a slot once its copies have landed.

The question it answers: can the bulk-copy engine, fed like this, keep the memory as busy
as register loads do (and with how many bytes in flight a multiprocessor)? The matvec
kernels built on it (``MVQ_TMA``, ``MVQ_CP_TMA``, see NOTES.md) streamed at a third to a
half of the register kernels' rate.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

__all__ = ["STREAM_SRC", "bulk_cases", "stream_bench", "x_behind_bench", "main"]

STREAM_SRC = r"""
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// every thread 16 bytes a load, four loads in flight
extern "C" __global__ void stream_ldg(const uint4* __restrict__ src, u64 n16, u32* out) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = __ldg(src + i), b = __ldg(src + i + stride);
        const uint4 c = __ldg(src + i + 2 * stride), d = __ldg(src + i + 3 * stride);
        acc ^= fold(a) ^ fold(b) ^ fold(c) ^ fold(d);
    }
    for (; i < n16; i += stride) acc ^= fold(__ldg(src + i));
    if (acc == 0x9e3779b9u) out[0] = acc;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    const u32 a = smem_u32(bar);
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}

// The buffer is n_chunks chunks of stage_bytes; the block takes chunks blockIdx.x + gridDim.x i.
// A chunk is `pieces` pieces; with scatter, piece p of chunk t lies at (p n_chunks + t) piece
// bytes (the pieces of one chunk far apart), else at t stage_bytes + p piece bytes.
// Warp C = blockDim.x / 32 - 1 produces; warps 0 .. C-1 consume (C = 0: the producer waits
// for each slot's copies before refilling it).
extern "C" __global__ void stream_bulk(const u8* __restrict__ src, u64 n_chunks, int stage_bytes,
                                       int n_stages, int pieces, int issuers, int scatter,
                                       u32* out) {
    extern __shared__ __align__(128) u8 smem[];
    u64* full = (u64*)smem;
    u64* empty = full + n_stages;
    u8* ring = smem + ((16 * n_stages + 127) & ~127);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int C = (int)(blockDim.x >> 5) - 1;
    const u64 my = blockIdx.x < n_chunks ? (n_chunks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const u32 piece = (u32)(stage_bytes / pieces);
    if (threadIdx.x == 0) {
        for (int s = 0; s < n_stages; s++) bar_init(&full[s], 1), bar_init(&empty[s], C ? C : 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == C) {
        for (u64 i = 0; i < my; i++) {
            const int s = (int)(i % n_stages);
            const u32 reuse = (u32)(i / n_stages - 1) & 1u;
            if (i >= (u64)n_stages) bar_wait(C ? &empty[s] : &full[s], reuse);
            if (lane == 0) bar_expect(&full[s], (u32)stage_bytes);
            __syncwarp();
            const u64 t = blockIdx.x + i * gridDim.x;
            u8* dst = ring + (u64)s * stage_bytes;
            if (lane < issuers) {
                for (int p = lane; p < pieces; p += issuers) {
                    const u64 at = scatter ? ((u64)p * n_chunks + t) * piece
                                           : t * stage_bytes + (u64)p * piece;
                    bulk_copy(dst + (u64)p * piece, src + at, piece, &full[s]);
                }
            }
        }
        if (!C)  // the last copies land before the block ends
            for (u64 i = my > (u64)n_stages ? my - n_stages : 0; i < my; i++)
                bar_wait(&full[i % n_stages], (u32)(i / n_stages) & 1u);
        return;
    }
    u32 acc = 0;
    const int n16 = stage_bytes / 16;
    for (u64 i = 0; i < my; i++) {
        const int s = (int)(i % n_stages);
        bar_wait(&full[s], (u32)(i / n_stages) & 1u);
        const uint4* st = (const uint4*)(ring + (u64)s * stage_bytes);
        for (int j = warp * 32 + lane; j < n16; j += C * 32) acc ^= fold(st[j]);
        __syncwarp();
        if (lane == 0) bar_arrive(&empty[s]);
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// How long one warp's load of x (4 bytes a lane, resident in L2) takes right after the
// warp sent `units` units of weights (2 KB each, 4 x 16 bytes a lane) ahead of it: into
// registers (mode 0), into shared memory by one bulk copy a unit (mode 1), or none (2).
// lat[warp]: clock cycles from the x load's issue to its value in use.
#define XB_UNITS 4
extern "C" __global__ void x_behind(const uint4* __restrict__ w, u64 w16,
                                    const float* __restrict__ x, int mode, int units, u32* lat,
                                    u32* out) {
    extern __shared__ __align__(128) u8 smem[];
    u64* bar = (u64*)smem;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    u8* buf = smem + 128 + (u64)warp * XB_UNITS * 2048;
    const u64 gw = (u64)blockIdx.x * W + warp, n_gw = (u64)gridDim.x * W;
    if (lane == 0) bar_init(&bar[warp], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    uint4 r[4 * XB_UNITS];
#pragma unroll
    for (int i = 0; i < 4 * XB_UNITS; i++) r[i] = make_uint4(0, 0, 0, 0);
    auto unit_at = [&](int u) { return ((u * n_gw + gw) * 128) % (w16 - 128); };
    if (mode == 0) {
#pragma unroll
        for (int u = 0; u < XB_UNITS; u++)
            if (u < units)
#pragma unroll
                for (int v = 0; v < 4; v++) r[4 * u + v] = __ldg(w + unit_at(u) + 32 * v + lane);
    } else if (mode == 1 && lane == 0) {
        bar_expect(&bar[warp], (u32)units * 2048);
        for (int u = 0; u < units; u++) bulk_copy(buf + u * 2048, w + unit_at(u), 2048, &bar[warp]);
    }
    __syncwarp();
    u64 t0, t1;
    u32 xi;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(xi) : "l"(x + gw * 32 + lane) : "memory");
    asm volatile("add.u32 %0, %0, 1;" : "+r"(xi)::"memory");
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
    u32 acc = xi;
    if (mode == 1 && units > 0) {
        bar_wait(&bar[warp], 0);
        for (int i = lane; i < units * 128; i += 32) acc ^= fold(((const uint4*)buf)[i]);
    }
#pragma unroll
    for (int i = 0; i < 4 * XB_UNITS; i++) acc ^= fold(r[i]);
    if (lane == 0) lat[gw] = (u32)(t1 - t0);
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def bulk_cases(quick: bool = False) -> list[dict]:
    """The bulk-copy configurations to time (a ring of at most ~200 KB a multiprocessor)."""
    cases = []
    for blocks in (1, 2):
        for consumers in (8, 0):
            for stage_kb in (4, 16, 32) if quick else (4, 8, 16, 32):
                for stages in (2, 4, 8):
                    if blocks * stages * stage_kb > 200:
                        continue
                    for pieces, issuers, scatter in (
                        (1, 1, 0), (8, 1, 1), (8, 8, 1), (32, 1, 1), (32, 32, 1),
                    ):  # fmt: skip
                        if stage_kb * 1024 // pieces < 128:
                            continue
                        if quick and consumers == 0 and pieces > 1:
                            continue
                        cases.append(dict(blocks=blocks, consumers=consumers, stage_kb=stage_kb,
                                          stages=stages, pieces=pieces, issuers=issuers,
                                          scatter=scatter))  # fmt: skip
    return cases


def _setup(mib: int):
    """(cupy, the module of STREAM_SRC, SMs, shared memory a block at most, a buffer of mib
    MiB of random bytes, a 4-byte output) on the current device."""
    import cupy as cp

    attributes = cp.cuda.Device().attributes
    mod = cp.RawModule(code=STREAM_SRC, options=("-std=c++17",))
    buf = cp.random.randint(0, 255, size=mib << 20, dtype=cp.uint8)
    out = cp.zeros((1,), dtype=cp.uint32)
    n_sm, optin = attributes["MultiProcessorCount"], attributes["MaxSharedMemoryPerBlockOptin"]
    return cp, mod, n_sm, optin, buf, out


def stream_bench(mib: int = 1024, reps: int = 5, quick: bool = False):
    """Yield (label, GB/s, KB in flight a multiprocessor or None) for each case."""
    cp, mod, n_sm, optin, buf, out = _setup(mib)
    k_ldg, k_bulk = mod.get_function("stream_ldg"), mod.get_function("stream_bulk")
    k_bulk.max_dynamic_shared_size_bytes = optin
    n_bytes = buf.size
    copy_src, copy_dst = buf[: n_bytes // 2], cp.empty(n_bytes // 2, dtype=cp.uint8)

    def gbs(kernel, grid=0, threads=0, args=(), smem=0) -> float:
        """GB/s of n_bytes by kernel((grid,), (threads,), args), or a copy with no kernel"""
        times = []
        for _ in range(reps + 1):
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record()
            if kernel is None:
                copy_dst[...] = copy_src
            else:
                kernel((grid,), (threads,), args, shared_mem=smem)
            t1.record()
            t1.synchronize()
            times.append(cp.cuda.get_elapsed_time(t0, t1) / 1e3)
        return n_bytes / float(np.median(times[1:])) / 1e9

    yield "device copy (read + written)", gbs(None), None
    for blocks in (1, 2, 4):
        for threads in (256, 512, 1024):
            if blocks * threads > 2048:
                continue
            args = (buf, np.uint64(n_bytes // 16), out)
            grid = blocks * n_sm
            rate = gbs(k_ldg, grid, threads, args)
            yield f"ldg {blocks} blocks x {threads // 32} warps", rate, blocks * threads * 64 / 1024
    for c in bulk_cases(quick):
        stage = c["stage_kb"] * 1024
        smem = ((16 * c["stages"] + 127) & ~127) + c["stages"] * stage
        if smem * c["blocks"] > optin or smem > optin:
            continue
        n_chunks = n_bytes // stage
        threads = 32 * (c["consumers"] + 1)
        ints = [stage, c["stages"], c["pieces"], c["issuers"], c["scatter"]]
        args = (buf, np.uint64(n_chunks), *map(np.int32, ints), out)
        grid = c["blocks"] * n_sm
        rate = gbs(k_bulk, grid, threads, args, smem)
        label = (f"bulk {c['blocks']} blocks, consumers {c['consumers']}, {c['stages']} x "
                 f"{c['stage_kb']} KB, {c['pieces']} pieces by {c['issuers']} lanes "
                 f"{'scat' if c['scatter'] else 'run'}")  # fmt: skip
        yield label, rate, c["blocks"] * c["stages"] * c["stage_kb"]


def x_behind_bench(mib: int = 1024):
    """Yield (label, median, 90th percentile) clock cycles of a warp's x load (in L2) issued
    right after that warp sent 0-4 units of 2 KB of weights ahead of it, into registers or by
    bulk copies, with 16 warps a block and 1 or 2 blocks a multiprocessor."""
    cp, mod, n_sm, _, w, out = _setup(mib)
    kernel = mod.get_function("x_behind")
    n_bytes = w.size
    warps = 16
    smem = 128 + warps * 4 * 2048
    kernel.max_dynamic_shared_size_bytes = smem
    for blocks in (1, 2):
        grid = blocks * n_sm
        x = cp.ones((grid * warps * 32,), dtype=cp.float32)
        lat = cp.zeros((grid * warps,), dtype=cp.uint32)
        for mode, name in ((2, "nothing"), (0, "registers"), (1, "bulk copies")):
            for units in (0,) if mode == 2 else (1, 2, 4):
                x += 1  # x written just before, as a producer kernel leaves it: in L2
                args = (w, np.uint64(n_bytes // 16), x, np.int32(mode), np.int32(units), lat, out)
                kernel((grid,), (32 * warps,), args, shared_mem=smem)
                cp.cuda.runtime.deviceSynchronize()
                c = cp.asnumpy(lat)
                label = f"{blocks} x 16 warps an SM, {units} units a warp ahead in {name}"
                yield label, float(np.median(c)), float(np.percentile(c, 90))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m picollama.backends.cuda.stream_bench",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--mib", type=int, default=1024, help="buffer size (MiB); default 1024")
    p.add_argument("-r", "--reps", type=int, default=5, help="launches a case (median)")
    p.add_argument("--quick", action="store_true", help="fewer bulk-copy cases")
    args = p.parse_args(argv)
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("stream_bench needs CuPy and an NVIDIA GPU", file=sys.stderr)
        return 2
    for label, med, p90 in x_behind_bench(args.mib):
        print(f"x load: {med:7.0f} cycles median, {p90:7.0f} p90  {label}", flush=True)
    for label, rate, kb in stream_bench(args.mib, args.reps, args.quick):
        flight = f"{kb:6.0f} KB an SM" if kb is not None else ""
        print(f"{rate:8.0f} GB/s  {flight:>14}  {label}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
