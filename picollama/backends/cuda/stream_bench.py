"""How fast one read stream from device memory can go, by the ways a kernel can load it.

    python -m picollama.backends.cuda.stream_bench [--mib 1024] [-r 5] [--quick]
        [--fresh | --ksplit | --bcast | --push | --burst | --phases]

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
- ``burst`` (``--burst``; printed first): how long a launch's first loads take when every
  warp sends its first units at once, as the matvecs' preload does, against the same loads
  after a steady stream; clock cycles turned into microseconds at the SM clock's rate,
  measured by a kernel that spins for a known number of cycles.
- Printed before it, each alone with its flag: ``fresh``, x read by every SM right after
  the launch that wrote it (float4 stores, or a 4-byte store a row as the matvecs write,
  with or without weights streamed between the rows) against x the host waited for;
  ``ksplit``, a matvec's weight read by
  columns (112 blocks of 128, as a split-K fold of ffn_down would read it) against the same
  bytes read whole; ``bcast``, x into every block's shared memory when every SM reads the
  same x, its own copy, or x once a cluster of four by multicast; ``push``, x for an SM with
  weights in flight, loaded by itself or brought into its shared memory by the other block
  of a cluster of two.

The question it answers: can the bulk-copy engine, fed like this, keep the memory as busy
as register loads do (and with how many bytes in flight a multiprocessor)? The matvec
kernels built on it (``MVQ_TMA``, ``MVQ_CP_TMA``, see NOTES.md) streamed at a third to a
half of the register kernels' rate.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

__all__ = [
    "STREAM_SRC",
    "burst_bench",
    "burst_cases",
    "bulk_cases",
    "ksplit_bench",
    "layer_8b",
    "main",
    "phase_bench",
    "phase_cases",
    "phase_plan",
    "stream_bench",
    "x_bcast_bench",
    "x_bcast_cases",
    "x_behind_bench",
    "x_fresh_bench",
    "x_fresh_cases",
    "x_pdl_bench",
    "x_pdl_cases",
    "x_push_bench",
    "x_push_cases",
]

STREAM_SRC = (
    (Path(__file__).parent / "bulk.cuh").read_text()
    + r"""
typedef unsigned char u8;

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
        bar_init_fence();
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
    bar_init_fence();
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

// x for a block whose warps have weights in flight, in clusters of two blocks (one an SM):
// rank 1's warps send `units` units of 2 KB ahead (into registers, as x_behind's mode 0) and
// then need 16 bytes a lane of x (in L2). mode 0: rank 1 loads its x itself (rank 0 loads
// its own too, with nothing ahead of it); mode 1: rank 0, with nothing in flight, loads rank
// 1's x and stores it into rank 1's shared memory (st.shared::cluster), each lane arriving
// on rank 1's barrier for that warp; mode 2: as 1, but rank 0 first sends its own units
// after the x load (x first, then weights, on the pushing SM). With `delay`, rank 0 spins
// that many cycles first, so that its x goes out behind the other SMs' units already in
// flight rather than beside them. lat[0 .. n): rank 1's cycles from its units issued to x
// in use; lat[n .. 2n): rank 0's from its x load's issue to x in use. The question: does x
// wait behind the weights of its own SM (then a neighbour with nothing in flight can bring
// it sooner) or behind everyone's?
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
}
__device__ __forceinline__ uint4 ld_cg16(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
extern "C" __global__ void __cluster_dims__(2, 1, 1)
x_push(const uint4* __restrict__ w, u64 w16, const uint4* __restrict__ x, int mode, int units,
       u64 delay, u32* lat, u32* out) {
    __shared__ __align__(16) uint4 xs[16 * 32];
    __shared__ __align__(8) u64 bar[16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const u32 rank = cluster_rank();
    const u64 n_gw = (u64)(gridDim.x >> 1) * W, gw = (u64)(blockIdx.x >> 1) * W + warp;
    if (lane == 0) bar_init(&bar[warp], 32);
    bar_init_fence();
    cluster_sync();
    auto unit_at = [&](int u) { return ((u * n_gw + gw + rank * 7919) * 128) % (w16 - 128); };
    uint4 r[4 * XB_UNITS];
#pragma unroll
    for (int i = 0; i < 4 * XB_UNITS; i++) r[i] = make_uint4(0, 0, 0, 0);
    const uint4* xp = x + gw * 32 + lane;
    u64 t0, t1;
    uint4 v;
    auto send_units = [&]() {
#pragma unroll
        for (int u = 0; u < XB_UNITS; u++)
            if (u < units)
#pragma unroll
                for (int q = 0; q < 4; q++) r[4 * u + q] = __ldg(w + unit_at(u) + 32 * q + lane);
    };
    if (rank == 0 && delay) {
        u64 s0, t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(s0)::"memory");
        do {
            asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
        } while (t - s0 < delay);
    }
    if (rank == 1 || mode == 0) {
        if (rank == 1) send_units();
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
        if (rank == 1 && mode != 0) {
            const u32 a = smem_u32(&bar[warp]);
            u32 done;
            WaitBound bound;
            do {
                bound.tick();
                asm volatile(
                    "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, "
                    "[%1], 0; selp.u32 %0, 1, 0, p; }"
                    : "=r"(done) : "r"(a) : "memory");
            } while (!done);
            v = xs[warp * 32 + lane];
        } else {
            v = ld_cg16(xp);
        }
    } else {  // rank 0 brings rank 1's x
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
        v = ld_cg16(xp + n_gw * 32);
        if (mode == 2) send_units();
        u32 dst, b;
        const u32 mine = smem_u32(&xs[warp * 32 + lane]);
        asm volatile("mapa.shared::cluster.u32 %0, %1, 1;" : "=r"(dst) : "r"(mine));
        asm volatile("mapa.shared::cluster.u32 %0, %1, 1;" : "=r"(b) : "r"(smem_u32(&bar[warp])));
        asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(b)
                     : "memory");
    }
    asm volatile("add.u32 %0, %0, 1;" : "+r"(v.x)::"memory");  // x in use
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
    u32 acc = fold(v);
#pragma unroll
    for (int i = 0; i < 4 * XB_UNITS; i++) acc ^= fold(r[i]);
    if (lane == 0) lat[(1 - rank) * n_gw + gw] = (u32)(t1 - t0);
    if (acc == 0x9e3779b9u) out[0] = acc;
    cluster_sync();  // rank 1's shared memory stays until every store into it is done
}

// warp gw's unit of 3 KB of weights into r (6 x 16 bytes a lane), as a matvec's preload
__device__ __forceinline__ void load_unit3k(const uint4* __restrict__ w, u64 w16, u64 gw,
                                            int lane, uint4* r) {
#pragma unroll
    for (int v = 0; v < 6; v++) r[v] = __ldg(w + (gw * 192) % (w16 - 192) + 32 * v + lane);
}

// xw floats of x into xs, four 16-byte loads a thread in flight before their stores (ldcg:
// through L2 only)
__device__ __forceinline__ void x_to_shared(const float* x, int xw, float* xs, bool ldcg) {
    const float4* src = (const float4*)x;
    float4 v[4];
    const int n4 = xw / 4;
    for (int i0 = 0; i0 < n4; i0 += 4 * (int)blockDim.x) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = i0 + u * blockDim.x + threadIdx.x;
            if (i < n4) {
                if (ldcg) {
                    const uint4 q = ld_cg16(src + i);
                    v[u] = make_float4(__uint_as_float(q.x), __uint_as_float(q.y),
                                       __uint_as_float(q.z), __uint_as_float(q.w));
                } else {
                    v[u] = __ldg(src + i);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = i0 + u * blockDim.x + threadIdx.x;
            if (i < n4) ((float4*)xs)[i] = v[u];
        }
    }
}

// x into every block's shared memory, as each one-token matvec reads it after its wait: one
// block an SM, 16 warps, xw floats of x (in L2). Every warp first sends `units` units of
// 3 KB of weights (a preload in flight). x_bcast, mode 0: every block loads the same x
// (each line asked for by every SM at once), float4 a thread a round, all rounds in
// flight; mode 1: block b loads its own copy at x + b xw (no line shared). x_mcast
// (clusters of four): x read once a cluster, each block sending a quarter of it into all
// four blocks' shared memory by one multicast bulk copy. lat[block]: cycles from the
// block's start to all of x in its shared memory.
extern "C" __global__ void x_bcast(const uint4* __restrict__ w, u64 w16,
                                   const float* __restrict__ x, int xw, int mode, int units,
                                   u32* lat, u32* out) {
    extern __shared__ __align__(128) float xs[];  // xw floats
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const u64 gw = (u64)blockIdx.x * W + warp;
    uint4 r[6];
    for (int i = 0; i < 6; i++) r[i] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    u64 t0, t1;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
    if (units) load_unit3k(w, w16, gw, lane, r);
    x_to_shared(x + (mode == 1 ? (u64)blockIdx.x * xw : 0), xw, xs, false);
    __syncthreads();
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
    u32 acc = __float_as_uint(xs[(threadIdx.x * 7) % xw]);
    for (int i = 0; i < 6; i++) acc ^= fold(r[i]);
    if (threadIdx.x == 0) lat[blockIdx.x] = (u32)(t1 - t0);
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// rows gw, gw + the grid's warps, ... of x, each after the warp has read `units` units of 3
// KB of weights (the row's dot), lane 0 storing its 4 bytes: x[r] = stamp + r
__device__ __forceinline__ void write_x_rows(const uint4* __restrict__ w, u64 w16, float* x,
                                             int xw, int units, float stamp) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const u64 gw = (u64)blockIdx.x * W + warp, n_warps = (u64)gridDim.x * W;
    u32 acc = 0;
    for (u64 r = gw; r < (u64)xw; r += n_warps) {
        for (int u = 0; u < units; u++) {
            uint4 q[6];
            load_unit3k(w, w16, r * units + u, lane, q);
            for (int v = 0; v < 6; v++) acc ^= fold(q[v]);
        }
        if (lane == 0) x[r] = stamp + (float)r + (acc == 0x9e3779b9u ? 1.f : 0.f);
    }
}
// x as the kernel before a matvec leaves it, for x_bcast (mode 0) to read right after:
// how 0, float4 stores over a grid-stride loop (an elementwise kernel's way); how 1, a row a
// warp at a time (write_x_rows), as the matvecs write their outputs; how 2, as 1, each row
// after the warp has read `units` units of 3 KB of weights (the row's dot: the weights
// stream through L2 while x is written). x[i] = stamp + i, so a reader's values are known.
extern "C" __global__ void x_fresh_write(const uint4* __restrict__ w, u64 w16, float* x, int xw,
                                         int how, int units, float stamp, u32* out) {
    if (how == 0) {
        const u64 step = (u64)gridDim.x * blockDim.x;
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)xw / 4; i += step) {
            const float b = stamp + 4.f * (float)i;
            ((float4*)x)[i] = make_float4(b, b + 1.f, b + 2.f, b + 3.f);
        }
        return;
    }
    write_x_rows(w, w16, x, xw, how == 2 ? units : 0, stamp);
}

extern "C" __global__ void __cluster_dims__(4, 1, 1)
x_mcast(const uint4* __restrict__ w, u64 w16, const float* __restrict__ x, int xw, int mode,
        int units, u32* lat, u32* out) {
    extern __shared__ __align__(128) float xs[];  // xw floats
    __shared__ __align__(8) u64 bar;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const u64 gw = (u64)blockIdx.x * W + warp;
    const u32 rank = cluster_rank();
    const u32 q = (u32)xw;  // bytes a quarter: xw / 4 floats
    if (threadIdx.x == 0) {
        bar_init(&bar, 1);
        bar_init_fence();
        bar_expect(&bar, 4 * q);
    }
    cluster_sync();
    uint4 r[6];
    for (int i = 0; i < 6; i++) r[i] = make_uint4(0, 0, 0, 0);
    u64 t0, t1;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
    if (units) load_unit3k(w, w16, gw, lane, r);
    if (threadIdx.x == 0) {
        const unsigned short mask = 0xF;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1], %2, [%3], %4;"
            ::"r"(smem_u32((const char*)xs + rank * q)), "l"((const char*)x + rank * q), "r"(q),
              "r"(smem_u32(&bar)), "h"(mask)
            : "memory");
    }
    bar_wait(&bar, 0);
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
    u32 acc = __float_as_uint(xs[(threadIdx.x * 7) % xw]);
    for (int i = 0; i < 6; i++) acc ^= fold(r[i]);
    if (threadIdx.x == 0) lat[blockIdx.x] = (u32)(t1 - t0);
    if (acc == 0x9e3779b9u) out[0] = acc;
    cluster_sync();  // no block ends while a copy into it may still be on its way
}

// A matvec's columns split over the blocks, as a split-K fold of ffn_down into the launch
// that makes its input would read it: a Q4_K weight of `rows` rows of nsb blocks, field-major
// as the device keeps it (d, dmin and scales 16 bytes a block, then the codes 128 bytes a
// block, from the next 256-byte boundary); block s takes half s % 2 of column block s / 2
// of every row (the block's 16 bytes of scales and 64 of its codes), one row a thread at a
// time, two in flight; ~the int8 dot's dp4a a 16 bytes. mode 0: each row's sum goes
// nowhere; 1: it is added into acc[row] by a 64-bit integer atomic (red.global.add.u64),
// as the fold would add its partial sums (integers: the same total in any order).
extern "C" __global__ void ksplit(const u8* __restrict__ w, int rows, int nsb, int mode,
                                  u64* acc, u32* out) {
    const int sb = blockIdx.x >> 1, half = blockIdx.x & 1;
    const u8* qs = w + (((u64)rows * nsb * 16 + 255) & ~255ull);
    u32 x = 0;
    for (int r0 = threadIdx.x; r0 < rows; r0 += 2 * blockDim.x) {
        uint4 a[2][5];
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const int r = min(r0 + t * (int)blockDim.x, rows - 1);
            const u64 blk = (u64)r * nsb + sb;
            const uint4* codes = (const uint4*)(qs + blk * 128 + half * 64);
            a[t][0] = __ldg((const uint4*)(w + blk * 16));
#pragma unroll
            for (int v = 0; v < 4; v++) a[t][1 + v] = __ldg(codes + v);
        }
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const int r = r0 + t * (int)blockDim.x;
            int sum = (int)a[t][0].x;
#pragma unroll
            for (int v = 1; v < 5; v++) {
                const uint4 q = a[t][v];
                const u32 wv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    sum = __dp4a((int)(wv[e] & 0x0F0F0F0Fu), 0x01010101, sum);
                    sum = __dp4a((int)((wv[e] >> 4) & 0x0F0F0F0Fu), 0x01020304, sum);
                }
            }
            if (r < rows) {
                const u64 add = (u64)(long long)sum;
                if (mode)
                    asm volatile("red.global.add.u64 [%0], %1;" ::"l"(acc + r), "l"(add)
                                 : "memory");
                else
                    x ^= (u32)sum;
            }
        }
    }
    if (x == 0x9e3779b9u) out[0] = x;
}

// A launch's first loads, as a decode matvec's preload sends them: each warp sends `units`
// units of 3 KB (6 x 16 bytes a lane) at once and waits for all of them; lat[warp]: clock
// cycles from the first load's issue to the last unit's bytes in use. With `steady` > 0 the
// warp first streams that many units one after another (the memory already busy with
// this launch's loads), and the units timed come after them. Every launch reads a region
// of its own (base16: no byte of it in L2).
#define BURST_UNITS 2
// one thread spins for `cycles` clock cycles: timed by events, the SM clock's rate
extern "C" __global__ void spin(u64 cycles, u32* out) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
    do {
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    } while (t - t0 < cycles);
    if (t == 0) out[0] = 1;
}

extern "C" __global__ void burst(const uint4* __restrict__ w, u64 w16, u64 base16, int units,
                                 int steady, u32* lat, u32* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const u64 gw = (u64)blockIdx.x * W + warp, n_gw = (u64)gridDim.x * W;
    auto unit_at = [&](int u) { return (base16 + ((u64)u * n_gw + gw) * 192) % (w16 - 192); };
    u32 acc = 0;
    for (int u = 0; u < steady; u++) {
        const uint4* p = w + unit_at(u) + lane;
#pragma unroll
        for (int v = 0; v < 6; v++) acc ^= fold(__ldg(p + 32 * v));
    }
    uint4 r[6 * BURST_UNITS];
    u64 t0, t1;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
#pragma unroll
    for (int u = 0; u < BURST_UNITS; u++) {
        const uint4* p = w + unit_at(steady + u) + lane;
#pragma unroll
        for (int v = 0; v < 6; v++)
            r[6 * u + v] = u < units ? __ldg(p + 32 * v) : make_uint4(0, 0, 0, 0);
    }
    u32 got = 0;
#pragma unroll
    for (int i = 0; i < 6 * BURST_UNITS; i++) got ^= fold(r[i]);
    asm volatile("add.u32 %0, %0, 1;" : "+r"(got)::"memory");  // the bytes in use
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
    if (lane == 0) lat[gw] = (u32)(t1 - t0);
    if ((acc ^ got) == 0x9e3779b9u) out[0] = acc;
}

// A persistent launch that streams a sequence of phases (a decode step's matvecs) through
// one ring a block, the producer warp never waiting on anything but free slots: while the
// consumers wait for phase p's x, the ring fills with phase p's first stages. Phase p is
// n_chunk[p] chunks of stage_bytes at src + base[p]; block b takes chunks b + gridDim.x i.
// mode 0: phases back to back, no x; 1: before its first chunk the consumers load x
// (xw[p] floats, their sum of squares reduced across the block, int8 codes into shared
// memory) and after its last they write their share of the next x; 2: as 1, and phase
// p > 0 first waits until every block has counted phase p - 1 done (a grid-wide flag in
// place of a launch's dependent wait). work: rounds of 4 dp4a a 16 bytes consumed.
// cap: the producer keeps at most cap stages in flight (issued, not landed), however many
// slots are free, so that x's loads queue behind at most cap stages. x is loaded in one
// round (15 warps hold 16384 values); passes 2 reduces its sum of squares across the block
// (a barrier) before the codes, 1 takes the sum as given (as MVQ_SSQ does).
#define PR_XMAX 16384
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void consumers_sync(int n_threads) {
    asm volatile("bar.sync 1, %0;" ::"r"(n_threads) : "memory");
}
extern "C" __global__ void phase_ring(const u8* __restrict__ src, const u64* __restrict__ base,
                                      const u32* __restrict__ n_chunk, const u32* __restrict__ xw,
                                      int n_phases, int stage_bytes, int n_stages, int mode,
                                      int work, int cap, int passes, float* xbuf,
                                      u32* counters, u32* out) {
    extern __shared__ __align__(128) u8 smem[];
    u64* full = (u64*)smem;
    u64* empty = full + n_stages;
    float* red = (float*)(smem + 16 * n_stages);  // 32 floats
    signed char* xq = (signed char*)(smem + ((16 * n_stages + 128 + 127) & ~127));
    u8* ring = (u8*)xq + PR_XMAX;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int C = (int)(blockDim.x >> 5) - 1, n_cons = 32 * C;
    if (threadIdx.x == 0) {
        for (int s = 0; s < n_stages; s++) bar_init(&full[s], 1), bar_init(&empty[s], C);
        bar_init_fence();
    }
    __syncthreads();
    if (warp == C) {
        u64 k = 0;
        for (int p = 0; p < n_phases; p++) {
            const u8* ph = src + base[p];
            for (u32 t = blockIdx.x; t < n_chunk[p]; t += gridDim.x, k++) {
                const int s = (int)(k % n_stages);
                if (k >= (u64)n_stages) bar_wait(&empty[s], (u32)(k / n_stages - 1) & 1u);
                if (cap < n_stages && k >= (u64)cap)  // stage k - cap has landed
                    bar_wait(&full[(k - cap) % n_stages], (u32)((k - cap) / n_stages) & 1u);
                if (lane == 0) {
                    bar_expect(&full[s], (u32)stage_bytes);
                    bulk_copy(ring + (u64)s * stage_bytes, ph + (u64)t * stage_bytes,
                              (u32)stage_bytes, &full[s]);
                }
                __syncwarp();
            }
        }
        return;
    }
    const int tid = threadIdx.x, n16 = stage_bytes / 16;
    const int* xi = (const int*)xq;
    int acc = 0;
    u64 k = 0;
    for (int p = 0; p < n_phases; p++) {
        if (mode >= 2 && p > 0) {
            if (tid == 0) {
                long long spins = 0;
                while (ld_acquire(counters + p) < gridDim.x && ++spins < (1ll << 26)) {
                }
                if (spins >= (1ll << 26)) atomicExch(out + 1, 1u);  // a flag that never came
            }
            consumers_sync(n_cons);
        }
        if (mode >= 1) {  // x: loaded in one round, the block's sum of squares, int8 codes
            const float4* x4 = (const float4*)(xbuf + (u64)p * PR_XMAX);
            const int n4 = (int)xw[p] / 4;
            float4 v[PR_XMAX / 4 / 480 + 1];
#pragma unroll
            for (int r = 0; r < PR_XMAX / 4 / 480 + 1; r++) {
                const int j = tid + r * n_cons;
                v[r] = j < n4 ? x4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            float total = (float)xw[p];  // passes 1: the sum given (MVQ_SSQ's way)
            if (passes > 1) {
                float ss = 0.f;
#pragma unroll
                for (int r = 0; r < PR_XMAX / 4 / 480 + 1; r++)
                    ss += v[r].x * v[r].x + v[r].y * v[r].y + v[r].z * v[r].z + v[r].w * v[r].w;
                for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                if (lane == 0) red[warp] = ss;
                consumers_sync(n_cons);
                total = 0.f;
                for (int w = 0; w < C; w++) total += red[w];
            }
            const float scale = 64.f * rsqrtf(total / (float)xw[p] + 1e-6f);
#pragma unroll
            for (int r = 0; r < PR_XMAX / 4 / 480 + 1; r++) {
                const int j = tid + r * n_cons;
                if (j < n4)
                    ((char4*)xq)[j] = make_char4(
                        (signed char)(v[r].x * scale), (signed char)(v[r].y * scale),
                        (signed char)(v[r].z * scale), (signed char)(v[r].w * scale));
            }
            consumers_sync(n_cons);
        }
        for (u32 t = blockIdx.x; t < n_chunk[p]; t += gridDim.x, k++) {
            const int s = (int)(k % n_stages);
            bar_wait(&full[s], (u32)(k / n_stages) & 1u);
            const uint4* st = (const uint4*)(ring + (u64)s * stage_bytes);
            for (int j = tid; j < n16; j += n_cons) {
                const uint4 w = st[j];
                int xv = xi[j & 1023];
                for (int r = 0; r < work; r++) {
                    acc = __dp4a((int)w.x, xv, acc);
                    acc = __dp4a((int)w.y, xv, acc);
                    acc = __dp4a((int)w.z, xv, acc);
                    acc = __dp4a((int)w.w, xv, acc);
                    xv ^= acc;
                }
            }
            __syncwarp();
            if (lane == 0) bar_arrive(&empty[s]);
        }
        if (mode >= 1 && p + 1 < n_phases) {  // this block's share of the next x
            float* nx = xbuf + (u64)(p + 1) * PR_XMAX;
            for (int j = blockIdx.x * n_cons + tid; j < (int)xw[p + 1]; j += gridDim.x * n_cons)
                nx[j] = 1.f + (float)(acc & 7);
            consumers_sync(n_cons);
            if (tid == 0) {
                __threadfence();
                atomicAdd(counters + p + 1, 1u);
            }
        }
    }
    if (acc == 0x7fffffff) out[0] = (u32)acc;
}

// x after a launch's wait, as the one-token matvecs read it (the question: does the
// dependent-launch wait itself make x slow to come?). x_pdl_write writes x as the matvecs
// do (a row a warp, lane 0's 4-byte store, after `units` units of 3 KB of weights a row),
// lets its dependents in at entry, and at its end counts each block done on *count (after
// a fence: a release). x_pdl_read: one block an SM, 16 warps; every warp first sends
// `units` units of 3 KB (a preload; with `landed` it waits for them before its wait, so
// its SM has nothing in flight), then waits: wait 0 by griddepcontrol.wait (a no-op
// without the dependent-launch attribute: the plain launch after the writer), 1 by
// spinning on *count until it reaches `target` (an acquire); then loads x (every SM the
// same xw floats, all of a thread's loads in flight; ldcg 1: through L2 only) into shared
// memory, checked against the writer's stamp. lat[2 b]: globaltimer ns from the wait's
// end to x in shared memory, lat[2 b + 1]: clock cycles for the same; tw[b]: the wait's
// end (globaltimer); we[b]: writer block b's end.
__device__ __forceinline__ u64 gtimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
extern "C" __global__ void x_pdl_write(const uint4* __restrict__ w, u64 w16, float* x, int xw,
                                       int units, float stamp, u32* count, u64* we, u32* out) {
    asm volatile("griddepcontrol.launch_dependents;" :::);
    write_x_rows(w, w16, x, xw, units, stamp);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(count, 1u);
        we[blockIdx.x] = gtimer();
    }
}
extern "C" __global__ void x_pdl_read(const uint4* __restrict__ w, u64 w16,
                                      const float* __restrict__ x, int xw, int units, int landed,
                                      int wait, int ldcg, const u32* count, u32 target,
                                      float stamp, u64* lat, u64* tw, u32* out) {
    extern __shared__ __align__(128) float xs[];  // xw floats
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const u64 gw = (u64)blockIdx.x * W + warp;
    uint4 r[6];
    for (int i = 0; i < 6; i++) r[i] = make_uint4(0, 0, 0, 0);
    u32 acc = 0;
    if (units) load_unit3k(w, w16, gw, lane, r);
    if (landed) {  // use them now: the warp stalls until they are in
        for (int i = 0; i < 6; i++) acc ^= fold(r[i]);
        if (acc == 0x9e3779b9u) out[0] = acc;
    }
    if (wait == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        long long spins = 0;
        while (ld_acquire(count) < target && ++spins < (1ll << 26)) {
        }
        if (spins >= (1ll << 26)) atomicExch(out + 1, 1u);  // the count never came
    }
    const u64 g0 = gtimer();
    u64 c0;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c0)::"memory");
    x_to_shared(x, xw, xs, ldcg);
    __syncthreads();
    const u64 g1 = gtimer();
    u64 c1;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c1)::"memory");
    for (int i = 0; i < 6; i++) acc ^= fold(r[i]);
    const int j = (threadIdx.x * 7) % xw;
    if (xs[j] != stamp + (float)j) atomicExch(out + 2, 1u);  // x not yet the writer's
    if (threadIdx.x == 0) {
        lat[2 * blockIdx.x] = g1 - g0;
        lat[2 * blockIdx.x + 1] = c1 - c0;
        tw[blockIdx.x] = g0;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""
)


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


def _sm_ghz(cp, mod, out) -> float:
    """The SM clock's rate now (GHz): a kernel that spins for a known number of cycles,
    timed by events."""
    cycles = 20_000_000  # ~10 ms
    spin = partial(mod.get_function("spin"), (1,), (1,), (np.uint64(cycles), out))
    return cycles / _median_s(cp, spin, 3) / 1e9


def _median_s(cp, run, reps: int, setup=None) -> float:
    """Median seconds of ``reps`` calls of run(), each timed by events on the device, after
    one untimed call; setup(), if given, runs before each call, untimed."""
    times = []
    for _ in range(reps + 1):
        if setup is not None:
            setup()
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record()
        run()
        t1.record()
        t1.synchronize()
        times.append(cp.cuda.get_elapsed_time(t0, t1) / 1e3)
    return float(np.median(times[1:]))


def stream_bench(mib: int = 1024, reps: int = 5, quick: bool = False):
    """Yield (label, GB/s, KB in flight a multiprocessor or None) for each case."""
    cp, mod, n_sm, optin, buf, out = _setup(mib)
    k_ldg, k_bulk = mod.get_function("stream_ldg"), mod.get_function("stream_bulk")
    k_bulk.max_dynamic_shared_size_bytes = optin
    n_bytes = buf.size
    copy_src, copy_dst = buf[: n_bytes // 2], cp.empty(n_bytes // 2, dtype=cp.uint8)

    def gbs(kernel, grid=0, threads=0, args=(), smem=0) -> float:
        """GB/s of n_bytes by kernel((grid,), (threads,), args), or a copy with no kernel"""

        def run():
            if kernel is None:
                copy_dst[...] = copy_src
            else:
                kernel((grid,), (threads,), args, shared_mem=smem)

        return n_bytes / _median_s(cp, run, reps) / 1e9

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


def x_push_cases() -> list[dict]:
    """x_push_bench's cases: how rank 1 of a cluster of two gets its x, and the units of
    weights its warps have in flight ahead of it."""
    return [
        {"mode": mode, "units": units, "delay": delay}
        for mode in (0, 1, 2)
        for units in (1, 2, 4)
        for delay in ((0, 1000, 3000) if mode == 0 else (0,))
    ]


def x_push_bench(mib: int = 1024):
    """Yield (label, median, 90th percentile) clock cycles until a warp whose SM has weights
    in flight has its x: loaded itself, or brought into its shared memory by the other block
    of its cluster of two, which has nothing in flight (or sends its own weights after x);
    and the bringing block's own x load (its SM's x with nothing ahead of it)."""
    cp, mod, n_sm, _, w, out = _setup(mib)
    kernel = mod.get_function("x_push")
    warps, grid = 16, n_sm // 2 * 2
    x = cp.ones((grid * warps * 32 * 4,), dtype=cp.float32)
    lat = cp.zeros((grid * warps,), dtype=cp.uint32)
    n = grid // 2 * warps
    how = (
        "loads its own x",
        "gets x from an idle neighbour",
        "gets x from a neighbour (x, then its units)",
    )
    for c in x_push_cases():
        x += 1  # written just before, as a producer kernel leaves it: in L2
        ints = (np.int32(c["mode"]), np.int32(c["units"]), np.uint64(c["delay"]))
        args = (w, np.uint64(w.size // 16), x, *ints, lat, out)
        kernel((grid,), (32 * warps,), args)
        cp.cuda.runtime.deviceSynchronize()
        got = cp.asnumpy(lat).astype(np.float64)
        ahead = f"{c['units']} units a warp ahead"
        yield (
            f"rank 1 ({ahead}) {how[c['mode']]}",
            float(np.median(got[:n])),
            float(np.percentile(got[:n], 90)),
        )
        mine = "its own x, nothing ahead" if c["mode"] == 0 else "rank 1's x"
        if c["delay"]:
            mine += f", {c['delay']} cycles after rank 1's units went out"
        if c["mode"] == 2:
            mine += f", its {c['units']} units after"
        yield f"  rank 0 loads {mine}", float(np.median(got[n:])), float(np.percentile(got[n:], 90))


def x_bcast_cases() -> list[dict]:
    """x_bcast_bench's cases: x's width (the 8B's 4096 and 14336), how the blocks get it,
    and whether a unit of weights a warp is in flight ahead of it."""
    return [
        {"xw": xw, "mode": mode, "units": units}
        for xw in (4096, 14336)
        for units in (0, 1)
        for mode in (0, 1, 2)
    ]


def x_bcast_bench(mib: int = 1024):
    """Yield (label, median, 90th percentile) microseconds until a block has all of x in its
    shared memory: every SM loading the same x, each its own copy, or x read once by each
    cluster of four and multicast into its blocks."""
    cp, mod, n_sm, _, w, out = _setup(mib)
    kernels = {0: mod.get_function("x_bcast"), 1: mod.get_function("x_bcast"),
               2: mod.get_function("x_mcast")}  # fmt: skip
    ghz = _sm_ghz(cp, mod, out)
    grid = n_sm // 4 * 4
    lat = cp.zeros((grid,), dtype=cp.uint32)
    widest = max(c["xw"] for c in x_bcast_cases()) * 4
    for kernel in kernels.values():
        kernel.max_dynamic_shared_size_bytes = widest
    how = ("every SM the same x", "each SM its own copy", "once a cluster of 4, multicast")
    for c in x_bcast_cases():
        x = cp.ones((grid * c["xw"],), dtype=cp.float32)
        samples = []
        for _ in range(3):
            x += 1  # written just before, as a producer kernel leaves it: in L2
            args = (w, np.uint64(w.size // 16), x, *map(np.int32, (c["xw"], c["mode"], c["units"])))
            kernels[c["mode"]]((grid,), (512,), (*args, lat, out), shared_mem=c["xw"] * 4)
            cp.cuda.runtime.deviceSynchronize()
            samples.append(cp.asnumpy(lat).astype(np.float64) / ghz / 1e3)
        us = np.concatenate(samples)
        ahead = ", a unit a warp in flight" if c["units"] else ""
        label = f"x of {c['xw']} floats, {how[c['mode']]}{ahead}"
        yield label, float(np.median(us)), float(np.percentile(us, 90))


def x_fresh_cases() -> list[dict]:
    """x_fresh_bench's cases: how x was written (x_fresh_write's ``how``), with how many
    units of 3 KB of weights a row, and whether the host waited between writer and reader."""
    return [
        {"how": 0, "units": 0, "sync": True},
        {"how": 0, "units": 0, "sync": False},
        {"how": 1, "units": 0, "sync": False},
        {"how": 2, "units": 1, "sync": False},
        {"how": 2, "units": 8, "sync": False},
        {"how": 1, "units": 0, "sync": True},
    ]


def x_fresh_bench(mib: int = 1024):
    """Yield (label, median, 90th percentile) microseconds until a block has x (4096
    floats, every SM the same x: x_bcast's mode 0) in its shared memory, launched right
    after the kernel that wrote x: by float4 stores, by one 4-byte store a row as the
    matvecs write, or so after streaming weights for each row. The question: is an x the
    launch before has just written slower to read than one written long before (the
    matvecs' x takes ~2 us a round trip after their wait, NOTES run 39; x_bcast's 0.4)?"""
    cp, mod, n_sm, _, w, out = _setup(mib)
    write, read = mod.get_function("x_fresh_write"), mod.get_function("x_bcast")
    ghz = _sm_ghz(cp, mod, out)
    xw = 4096
    read.max_dynamic_shared_size_bytes = xw * 4
    x = cp.zeros((xw,), dtype=cp.float32)
    lat = cp.zeros((n_sm,), dtype=cp.uint32)
    how = ("float4 stores", "a 4-byte store a row", "a 4-byte store a row after {u} units of 3 KB")
    w16 = np.uint64(w.size // 16)
    for c in x_fresh_cases():
        samples = []
        for rep in range(4):
            stamp = np.float32(1000.0 * (rep + 1))
            args = (w, w16, x, np.int32(xw), np.int32(c["how"]), np.int32(c["units"]), stamp, out)
            write((n_sm,), (512,), args)
            if c["sync"]:
                cp.cuda.runtime.deviceSynchronize()
            read((n_sm,), (512,), (w, w16, x, np.int32(xw), np.int32(0), np.int32(0), lat, out),
                 shared_mem=xw * 4)  # fmt: skip
            cp.cuda.runtime.deviceSynchronize()
            want = float(stamp) + np.arange(xw, dtype=np.float32)
            if not np.array_equal(cp.asnumpy(x), want):
                raise RuntimeError(f"x_fresh_write ({c}) did not write x")
            if rep:  # the first is a warm-up
                samples.append(cp.asnumpy(lat).astype(np.float64) / ghz / 1e3)
        us = np.concatenate(samples)
        label = f"x written by {how[c['how']].format(u=c['units'])}, " + (
            "the host waiting between" if c["sync"] else "read by the next launch"
        )
        yield label, float(np.median(us)), float(np.percentile(us, 90))


def x_pdl_cases() -> list[dict]:
    """x_pdl_bench's cases: how the reader waits for the writer (plain: a launch after it;
    pdl: the dependent-launch wait; count: a spin on the writer's block count), whether a
    unit of weights a warp is in flight at the wait (``units``) or has landed before it
    (``landed``), and whether x comes through L2 only (``ldcg``)."""
    return [
        {"wait": "plain", "units": 0, "landed": 0, "ldcg": 0},
        {"wait": "pdl", "units": 0, "landed": 0, "ldcg": 0},
        {"wait": "pdl", "units": 1, "landed": 0, "ldcg": 0},
        {"wait": "pdl", "units": 1, "landed": 1, "ldcg": 0},
        {"wait": "pdl", "units": 0, "landed": 0, "ldcg": 1},
        {"wait": "count", "units": 0, "landed": 0, "ldcg": 1},
        {"wait": "count", "units": 1, "landed": 1, "ldcg": 1},
        {"wait": "count", "units": 1, "landed": 0, "ldcg": 1},
    ]


def x_pdl_bench(mib: int = 1024, reps: int = 5):
    """Yield (label, median, 90th percentile) microseconds from the end of a reader's wait
    to x (4096 floats, every SM the same) in its shared memory, the reader launched right
    after x_pdl_write (8 units of 3 KB of weights a row, 100 MB, then the row's value: the
    matvecs' way), by globaltimer, then the same by clock cycles; and the median from the
    writer's last block's end to the reader's wait done. The trace's first round of x takes
    1.5-2.8 us after the kernels' dependent-launch wait (NOTES run 40) where x_fresh's x,
    read by a plain launch, takes 0.4: is it the wait?"""
    from picollama.backends.cuda.backend import _DependentLauncher

    cp, mod, n_sm, _, w, _ = _setup(mib)
    write, read = mod.get_function("x_pdl_write"), mod.get_function("x_pdl_read")
    ghz = _sm_ghz(cp, mod, cp.zeros((1,), dtype=cp.uint32))
    xw, units_w = 4096, 8
    read.max_dynamic_shared_size_bytes = xw * 4
    x = cp.zeros((xw,), dtype=cp.float32)
    count = cp.zeros((1,), dtype=cp.uint32)
    out = cp.zeros((3,), dtype=cp.uint32)
    lat = cp.zeros((2 * n_sm,), dtype=cp.uint64)
    tw, we = cp.zeros((n_sm,), dtype=cp.uint64), cp.zeros((n_sm,), dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)
    pdl = _DependentLauncher()
    pdl.stream = stream.ptr
    w16 = np.uint64(w.size // 16)
    launches = 0
    for c in x_pdl_cases():
        ns, cyc, gap = [], [], []
        for rep in range(reps + 1):
            stamp = np.float32(1000.0 * (rep + 1))
            wargs = (w, w16, x, np.int32(xw), np.int32(units_w), stamp, count, we, out)
            launches += 1
            target = np.uint32(launches * n_sm)
            rargs = (w, w16, x, *map(np.int32, (xw, c["units"], c["landed"])),
                     np.int32(c["wait"] == "count"), np.int32(c["ldcg"]), count, target,
                     stamp, lat, tw, out)  # fmt: skip
            with stream:
                write((n_sm,), (512,), wargs)
                if c["wait"] != "plain":  # count: resident early, its own wait
                    pdl.launch(read, (n_sm,), (512,), rargs, xw * 4, stream.ptr)
                else:
                    read((n_sm,), (512,), rargs, shared_mem=xw * 4)
            stream.synchronize()
            flags = cp.asnumpy(out)
            if flags[1] or flags[2]:
                raise RuntimeError(
                    f"x_pdl_read ({c}): "
                    + ("the count never came" if flags[1] else "x read before the writer's")
                )
            if rep:  # the first is a warm-up
                got = cp.asnumpy(lat).reshape(n_sm, 2).astype(np.float64)
                ns.append(got[:, 0] / 1e3)
                cyc.append(got[:, 1] / ghz / 1e3)
                gap.append(
                    float(
                        np.median(cp.asnumpy(tw).astype(np.int64))
                        - cp.asnumpy(we).astype(np.int64).max()
                    )
                    / 1e3
                )
        what = {"plain": "a plain launch after the writer", "pdl": "the dependent-launch wait",
                "count": "a spin on the writer's block count"}[c["wait"]]  # fmt: skip
        if c["units"]:
            what += ", a unit a warp " + ("landed before it" if c["landed"] else "in flight")
        if c["ldcg"]:
            what += ", x through L2 only"
        t, k = np.concatenate(ns), np.concatenate(cyc)
        ends = f"writer's end -> wait done {np.median(gap):5.2f} us"
        label = f"{what} ({ends}; by clock {np.median(k):5.2f} us)"
        yield label, float(np.median(t)), float(np.percentile(t, 90))


def ksplit_bench(mib: int = 1024, reps: int = 5):
    """Yield (label, us a pass, GB/s of the weight's bytes) for the 8B's ffn_down shape in
    Q4_K (4096 rows of 14336) read by columns, 112 blocks of 128 columns (``ksplit``), with and
    without the rows' atomic adds, beside the same bytes streamed whole (``stream_ldg``).
    A timing is one pass over each of the copies of the weight the buffer holds, launched
    back to back (none of it in L2, the device never waiting for the host)."""
    cp, mod, n_sm, _, buf, out = _setup(mib)
    kernel, ldg = mod.get_function("ksplit"), mod.get_function("stream_ldg")
    rows, nsb = 4096, 14336 // 256
    nbytes = ((rows * nsb * 16 + 255) & ~255) + rows * nsb * 128
    stride = (nbytes + (1 << 20)) & ~((1 << 20) - 1)
    copies = [buf[i * stride :] for i in range(max(1, buf.size // stride))]
    acc = cp.zeros((rows,), dtype=cp.uint64)

    def per_pass(launch) -> float:
        def run():
            for w in copies:
                launch(w)

        return _median_s(cp, run, reps) / len(copies)

    n16 = np.uint64(nbytes // 16)
    seconds = per_pass(lambda w: ldg((n_sm,), (512,), (w, n16, out)))
    yield "the weight streamed whole (ldg, a block an SM)", seconds * 1e6, nbytes / seconds / 1e9
    for mode, what in ((0, "no atomics"), (1, "a 64-bit atomic add a row")):
        args = (np.int32(rows), np.int32(nsb), np.int32(mode), acc, out)
        seconds = per_pass(lambda w, a=args: kernel((2 * nsb,), (512,), (w, *a)))
        label = f"by columns, {2 * nsb} blocks of 128, {what}"
        yield label, seconds * 1e6, nbytes / seconds / 1e9


def burst_cases() -> list[dict]:
    """burst_bench's cases: warps a block (one block an SM), units a warp at once, units
    streamed before them."""
    return [
        {"warps": warps, "units": units, "steady": steady}
        for steady in (0, 8)
        for warps in (4, 8, 16)
        for units in (1, 2)
    ]


def burst_bench(mib: int = 1024):
    """Yield (label, median, 90th percentile) microseconds from a warp's first load to its
    units' bytes in use, for a launch whose warps all send their first units at once (as
    the matvecs' preload does) and for units after a steady stream: how long a launch's
    first unit takes, and whether that grows with the bytes the burst asks for."""
    cp, mod, n_sm, _, w, out = _setup(mib)
    kernel = mod.get_function("burst")
    ghz = _sm_ghz(cp, mod, out)
    w16 = w.size // 16
    region = (64 << 20) // 16  # each launch 64 MiB further on: nothing of it in L2
    launch = 0
    for c in burst_cases():
        grid, threads = n_sm, 32 * c["warps"]
        lat = cp.zeros((grid * c["warps"],), dtype=cp.uint32)
        samples = []
        for _ in range(3):
            launch += 1
            base = np.uint64((launch * region) % w16)
            args = (w, np.uint64(w16), base, np.int32(c["units"]), np.int32(c["steady"]), lat, out)
            kernel((grid,), (threads,), args)
            cp.cuda.runtime.deviceSynchronize()
            samples.append(cp.asnumpy(lat).astype(np.float64) / ghz / 1e3)
        us = np.concatenate(samples)
        kb = c["warps"] * c["units"] * 3
        when = "after 8 units streamed" if c["steady"] else "at the launch's start"
        label = f"{c['warps']:2d} warps x {c['units']} units of 3 KB ({kb} KB an SM), {when}"
        yield label, float(np.median(us)), float(np.percentile(us, 90))


# One Llama-8B layer in Q4_K_M as the decode step meets it: (weight bytes, x width) a
# phase. Q/K/V (Q4_K 6144 x 4096), the attention (no weights: a grid-wide hop, q's 4096
# values), attn_output (Q4_K 4096 x 4096), gate + up (Q4_K 2 x 14336 x 4096), ffn_down
# (4096 x 14336, Q6_K or Q4_K by layer; here every other one).
def layer_8b(index: int) -> list[tuple[int, int]]:
    q4k = 144 / 256
    down = 210 / 256 if index % 2 == 0 else q4k
    return [
        (int(6144 * 4096 * q4k), 4096),
        (0, 4096),
        (int(4096 * 4096 * q4k), 4096),
        (int(2 * 14336 * 4096 * q4k), 4096),
        (int(4096 * 14336 * down), 14336),
    ]


def phase_cases(quick: bool = False) -> list[dict]:
    """The ring shapes, in-flight caps and modes ``phase_bench`` times (rings of at most
    192 KB): first the unbounded ring without x (the stream's rate through the ring) and
    with x, then caps on the stages in flight."""
    cases = []
    base = dict(work=6, consumers=15, passes=2, mode=2)
    for stage_kb, stages, caps in ((16, 12, (12, 2, 3, 4, 6)), (32, 6, (6, 1, 2, 3))):
        if quick and stage_kb != 32:
            continue
        for cap in caps[:2] if quick else caps:
            for passes in (2, 1):
                modes = (0, 1, 2) if cap == stages and passes == 2 else (2,)
                for mode in modes:
                    cases.append({**base, "stage_kb": stage_kb, "stages": stages, "cap": cap,
                                  "passes": passes, "mode": mode})  # fmt: skip
    return cases


def phase_plan(layers: int, stage: int, region: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(byte offset, chunks, x width) a phase for ``layers`` 8B layers, each phase's weights
    whole stages laid one after another and wrapped within ``region`` bytes."""
    phases = [ph for i in range(layers) for ph in layer_8b(i)]
    base, chunks, widths, at = [], [], [], 0
    for nbytes, width in phases:
        n = -(-nbytes // stage)
        if at + n * stage > region:
            at = 0
        base.append(at)
        chunks.append(n)
        widths.append(width)
        at += n * stage
    return (np.array(base, np.uint64), np.array(chunks, np.uint32), np.array(widths, np.uint32))


def phase_bench(mib: int = 1024, layers: int = 32, reps: int = 5, quick: bool = False):
    """Yield (label, GB/s of weights, the flag timeouts seen) for each of ``phase_cases``:
    a persistent launch streaming ``layers`` 8B layers' matvecs through a ring a block,
    with or without each phase's x and the grid-wide wait for it (mode 2)."""
    cp, mod, n_sm, optin, buf, out = _setup(mib)
    kernel = mod.get_function("phase_ring")
    kernel.max_dynamic_shared_size_bytes = optin
    out2 = cp.zeros((2,), dtype=cp.uint32)
    ldg = mod.get_function("stream_ldg")
    seconds = _median_s(
        cp, lambda: ldg((n_sm,), (512,), (buf, np.uint64(buf.size // 16), out2)), reps
    )
    yield "ldg 1 block x 16 warps (the stream alone, for reference)", buf.size / seconds / 1e9, 0
    for c in phase_cases(quick):
        stage = c["stage_kb"] * 1024
        smem = ((16 * c["stages"] + 128 + 127) & ~127) + 16384 + c["stages"] * stage
        if smem > optin:
            continue
        base, chunks, widths = phase_plan(layers, stage, buf.size)
        n_ph = len(chunks)
        d_base, d_chunks, d_widths = cp.asarray(base), cp.asarray(chunks), cp.asarray(widths)
        xbuf = cp.ones((n_ph + 1) * 16384, dtype=cp.float32)
        counters = cp.zeros(n_ph + 1, dtype=cp.uint32)
        ints = [n_ph, stage, c["stages"], c["mode"], c["work"], c["cap"], c["passes"]]
        args = (buf, d_base, d_chunks, d_widths, *map(np.int32, ints), xbuf, counters, out2)
        threads = 32 * (c["consumers"] + 1)
        run = partial(kernel, (n_sm,), (threads,), args, shared_mem=smem)
        seconds = _median_s(cp, run, reps, setup=partial(counters.fill, 0))
        rate = int(chunks.sum()) * stage / seconds / 1e9
        timeouts = int(out2[1].get())
        label = (f"phases {c['stages']} x {c['stage_kb']} KB, at most {c['cap']} in flight, "
                 f"work {c['work']}, {('no x', 'x, no wait', 'x + grid wait')[c['mode']]}, "
                 f"x read {c['passes']}x")  # fmt: skip
        yield label, rate, timeouts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m picollama.backends.cuda.stream_bench",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--mib", type=int, default=1024, help="buffer size (MiB); default 1024")
    p.add_argument("-r", "--reps", type=int, default=5, help="launches a case (median)")
    p.add_argument("--quick", action="store_true", help="fewer bulk-copy cases")
    # each of these: that section only (several: those); none: every section
    p.add_argument("--phases", action="store_true", help="the phase ring (8B layers)")
    p.add_argument("--burst", action="store_true", help="a launch's first loads")
    p.add_argument("--push", action="store_true", help="x brought by a cluster neighbour")
    p.add_argument("--bcast", action="store_true", help="x read by every SM at once")
    p.add_argument("--ksplit", action="store_true", help="a weight read by columns")
    p.add_argument("--fresh", action="store_true", help="x just written by the launch before")
    p.add_argument("--pdl", action="store_true", help="x after the dependent-launch wait")
    args = p.parse_args(argv)
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("stream_bench needs CuPy and an NVIDIA GPU", file=sys.stderr)
        return 2
    only = {
        f
        for f in ("pdl", "fresh", "ksplit", "bcast", "push", "burst", "phases")
        if getattr(args, f)
    }

    def ring_rows():
        for label, rate, timeouts in phase_bench(args.mib, reps=args.reps, quick=args.quick):
            yield label, rate, " (a flag timed out)" if timeouts else ""

    def stream_rows():
        for label, rate, kb in stream_bench(args.mib, args.reps, args.quick):
            yield label, rate, f"{kb:6.0f} KB an SM" if kb is not None else ""

    # (flag, rows, the format of a row): with no flag every section, in this order
    sections = [
        ("pdl", lambda: x_pdl_bench(args.mib, args.reps),
         "x in shared memory: {1:6.2f} us median, {2:6.2f} p90  {0}"),
        ("fresh", lambda: x_fresh_bench(args.mib),
         "x in shared memory: {1:6.2f} us median, {2:6.2f} p90  {0}"),
        ("ksplit", lambda: ksplit_bench(args.mib, args.reps), "{1:8.1f} us  {2:6.0f} GB/s  {0}"),
        ("bcast", lambda: x_bcast_bench(args.mib),
         "x in shared memory: {1:6.2f} us median, {2:6.2f} p90  {0}"),
        ("push", lambda: x_push_bench(args.mib), "x: {1:7.0f} cycles median, {2:7.0f} p90  {0}"),
        ("burst", lambda: burst_bench(args.mib),
         "first units: {1:6.2f} us median, {2:6.2f} p90  {0}"),
        ("phases", ring_rows, "{1:8.0f} GB/s  {0}{2}"),
        ("", lambda: x_behind_bench(args.mib), "x load: {1:7.0f} cycles median, {2:7.0f} p90  {0}"),
        ("", stream_rows, "{1:8.0f} GB/s  {2:>14}  {0}"),
    ]  # fmt: skip
    for flag, rows, fmt in sections:
        if only and flag not in only:
            continue
        for row in rows():
            print(fmt.format(*row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
