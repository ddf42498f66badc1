// One token's layer matvecs as phases of one persistent launch: a "ring" kernel.
//
// Why (NOTES.md, run 34): with a launch a matvec, every launch's prologue (the wait for
// the kernel before, x read and quantized, the first weights' latency) and tail leave the
// memory idle for ~8 us of each of the 8B's ~130 launches a token. Here one block a
// multiprocessor stays resident through several matvecs (attn_output, gate + up, ffn_down
// and the next layer's Q/K/V + RoPE), and its producer warp streams the weights of all of
// them, stage after stage, into a ring of shared-memory slots by the bulk-copy engine
// (copies of whole row tiles: 4-48 KB), never waiting for anything but a free slot. While
// the consumers wait for a phase's x (written by every block in the phase before: a
// counter a phase, in place of a launch's dependent wait), the ring goes on filling with
// that phase's first stages, so the memory keeps streaming across the boundary.
//
// The source is built with Q4_K's and Q6_K's int8 matvec code (quant.cu and mmvq.cu, each
// in a namespace of its own, with weight loads from shared memory so that their QD::load
// reads a tile in a slot) and this file after them (layout.ring_source).
//
// Arithmetic. Each row's dot is the one-token kernel's (matvec_q8_n1): one warp takes
// the whole row, lane l multiplies chunks l + 32 i in that order with QD::dot and the
// lanes are summed by warp_sum, so a row's value is that kernel's bit for bit. x is
// quantized with the same float operations; a normed phase takes the norm's sum of
// squares from the blocks of the phase that wrote x (ssq slots), as the linked one-token
// kernels do (float64 sums over other sets of rows: the same float32 scale but for a
// last-bit tie).

// The ring: RING_SLOTS slots of RING_SLOT_BYTES, RING_SPG of them each consumer group's
// (its share, in order: a group's stages take its slots in turn, so that one can land
// while the group multiplies another). A phase whose stages do not fit a slot
// (RingPhase.whole) gives each group its share as one slot instead: the 8B's ffn_down, 4
// rows of Q6_K 14336 (46 KB), beside gate + up's 4 rows of each in 18 KB slots.
#ifndef RING_SLOTS
#define RING_SLOTS 4
#endif
#ifndef RING_SLOT_BYTES
#define RING_SLOT_BYTES (48 * 1024)
#endif
// RING_DYN (0: off): a phase's stages are handed out by a counter (each block's producer
// takes the next with an atomic add, RING_DYN of them in flight) instead of round robin by
// block, so that blocks which finish early take more and the phase ends together; the
// producer writes each slot's stage in s_stage, and a stage of -1 (one a group, no bytes)
// ends the phase for that group
#ifndef RING_DYN
#define RING_DYN 0
#endif
// RING_BCAP (0: off): at most this many of a phase's stages a block issued before its
// consumers have read and quantized the phase's x, whose loads from L2 otherwise queue
// behind every copy the ring has in flight (stream_bench --phases: best with one)
#ifndef RING_BCAP
#define RING_BCAP 0
#endif
#define RING_WARPS 16  // consumer warps; one more warp produces
#define RING_THREADS (RING_WARPS * 32)
// The consumers are RING_GROUPS groups of RING_GW warps, and a block's stage n of a phase
// goes to group n % RING_GROUPS: the groups work on different slots at once, so one stage's
// latencies (its wait, the warp sums, the outputs' stores) overlap the others' work
// instead of all 16 warps passing each stage together. A warp takes whole rows of its
// group's stage (at most RING_MAXD: a stage has at most 16 rows).
#ifndef RING_GROUPS
#define RING_GROUPS 4
#endif
#define RING_GW (RING_WARPS / RING_GROUPS)
#define RING_MAXD RING_GROUPS
static_assert(RING_WARPS % RING_GROUPS == 0 && RING_SLOTS % RING_GROUPS == 0,
              "groups of whole warps, each with whole slots");
#define RING_SPG (RING_SLOTS / RING_GROUPS)  // slots a group
// a full and an empty barrier for each slot, then for each group's whole share
#define RING_BARS (RING_SLOTS + RING_GROUPS)
#define RING_HEAD 256  // bytes of shared memory before the RoPE table: the barriers
static_assert(2 * RING_BARS * 8 <= RING_HEAD, "the barriers fit the head");
#define RING_XMAX 14336  // the widest x a phase reads
#define RING_MAX_PHASES 4
#define RING_NEXT (RING_MAX_PHASES + 1)
#define RING_ROPE_PAIRS 128
static_assert(q4k::QD::CPB == 4 && q6k::QD::CPB == 4, "ring.cu takes the pair forms: 4 chunks a block");


// MVQ_TRACE (bench_synthetic --trace): thread 0 of each block writes, a phase, the records
// of mmvq.cu's trace (the phase's first weight, the block and SM, then the times: phase
// begun, its x's wait done, x quantized, its first stage done, done; %globaltimer, ns),
// then two sums of waits in the phase (ns): warp 0's for its stages' bytes to land, and
// the producer's for free slots (which of the two waits on the other)
#ifndef MVQ_TRACE
#define MVQ_TRACE 0
#endif
#if MVQ_TRACE
#define RING_TRACE_CAP 65536
__device__ unsigned long long ring_trace[RING_TRACE_CAP][9];
__device__ unsigned int ring_trace_n;
__device__ __forceinline__ u64 ring_gtimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define RING_TR(var) var = ring_gtimer()
#define RING_WAIT(sum, call)            \
    do {                                \
        const u64 t_ = ring_gtimer();   \
        call;                           \
        sum += ring_gtimer() - t_;      \
    } while (0)
#else
#define RING_TR(var)
#define RING_WAIT(sum, call) call
#endif

struct RingWeight {
    const u8* f[4];  // the device layout's fields
    int fsz[4];      // bytes of a block in each field (0 past the type's fields)
    int qtype;       // 0: Q4_K, 1: Q6_K
    int m;           // rows
    int rows;        // rows a stage (a power of two dividing m; for gate + up, each)
    float* y;
};

struct RingPhase {
    RingWeight w[3];
    int n_w;
    int kind;  // 0: rows, y0 = W0 x (+ resid); 1: y0 = act(W0 x) * (W1 x); 2: Q, K, V + RoPE
    int k, act, n_stages;
    int whole;  // 1: a stage takes a group's whole share of the ring (RING_SPG slots)
    const float* x;
    const float* norm_w;  // with ssq_in: x RMS-normalized and scaled by it
    float eps;
    const double* ssq_in;  // the norm's sum of squares: ssq_n block sums of x's writer
    int ssq_n;
    const float* resid;
    double* ssq_out;  // kind 0: each block's sum of y's squares, for the next phase's norm
    // kind 2: rope and the KV cache write, as matvec_q8_n1_rope (RopeArgs)
    const int* pos;
    const int* start;
    u16* const* kcs;
    u16* const* vcs;
    int head_dim, head_dim_v, n_rot, n_ctx;
    float theta_scale, freq_scale;
};

struct RingArgs {
    RingPhase ph[RING_MAX_PHASES];
    int n_phases;
    // 2 RING_MAX_PHASES + 1, zero at entry and again at exit: [p] blocks done with phase
    // p - 1, [RING_MAX_PHASES] blocks done, [RING_NEXT + p] phase p's next stage (RING_DYN)
    unsigned int* counters;
};
// the host writes these as ctypes structures (ring.py): the same layout
static_assert(sizeof(RingWeight) == 72 && sizeof(RingPhase) == 352 && sizeof(RingArgs) == 1424,
              "ring.py's ctypes structures mirror these");


__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(RING_THREADS) : "memory"); }
__device__ __forceinline__ unsigned int ld_acquire_u32(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// data written by other blocks of this launch: through L2 only (L1 is not coherent)
__device__ __forceinline__ float4 ld_cg4(const float* p) { return __ldcg((const float4*)p); }

// the weight and first row of stage s of a phase (stages: weight 0's, then 1's, then 2's;
// gate + up: one stage is `rows` rows of each)
__device__ __forceinline__ void ring_stage(const RingPhase& ph, int s, int* wi, int* r0) {
    if (ph.kind == 1) {
        *wi = 0, *r0 = s * ph.w[0].rows;
        return;
    }
#pragma unroll
    for (int w = 0; w < 3; w++) {
        const int ns = ph.w[w].m / ph.w[w].rows;
        if (w == ph.n_w - 1 || s < ns) {
            *wi = w, *r0 = s * ph.w[w].rows;
            return;
        }
        s -= ns;
    }
}

// acc[d] += row d . x for a warp's nd rows of a stage in a slot: rows il + d of fields f
// for d < h, then rows il + d - h of the same fields moved by `up` bytes (gate's, then
// up's: gate + up take one type). Lane l takes chunks l + 32 i
// in that order, as matvec_q8_n1 does, so each row's sum is that kernel's bit for bit;
// rows are taken two at a time, both chunks loaded before either is used (more would
// spill: a block of 17 warps has 96 registers a thread).
template <int ND, class QD, class F, class X>
__device__ __forceinline__ void ring_rows(float (&acc)[RING_MAXD], const F& f, u32 up, int il, int h,
                                          int cpr, int lane, const X& x) {
    for (int c = lane; c < cpr; c += 32) {
#pragma unroll
        for (int d0 = 0; d0 < ND; d0 += 2) {
            typename QD::Raw raw[2];
#pragma unroll
            for (int e = 0; e < 2 && d0 + e < ND; e++) {
                const int d = d0 + e;
                const u32 o = d < h ? 0u : up;
                raw[e] = QD::load(F{f.p0 + o, f.p1 + o, f.p2 + o, f.p3 + o},
                                  (u32)((d < h ? il + d : il + d - h) * cpr + c));
            }
#pragma unroll
            for (int e = 0; e < 2 && d0 + e < ND; e++) acc[d0 + e] += QD::dot(raw[e], c, x);
        }
    }
}
// the warp's row count (a power of two up to RING_MAXD) as a constant: with no test of
// it in the loop, the rows' dots at one chunk share their loads of x
template <class QD, class F, class X>
__device__ __forceinline__ void ring_rows_n(float (&acc)[RING_MAXD], const F& f, u32 up, int il,
                                            int h, int nd, int cpr, int lane, const X& x) {
    if constexpr (RING_MAXD >= 8)
        if (nd == 8) return ring_rows<8, QD>(acc, f, up, il, h, cpr, lane, x);
    if constexpr (RING_MAXD >= 4)
        if (nd == 4) return ring_rows<4, QD>(acc, f, up, il, h, cpr, lane, x);
    if constexpr (RING_MAXD >= 2)
        if (nd == 2) return ring_rows<2, QD>(acc, f, up, il, h, cpr, lane, x);
    ring_rows<1, QD>(acc, f, up, il, h, cpr, lane, x);
}

// bytes of a stage's field f of one weight
__device__ __forceinline__ u32 ring_field_bytes(const RingWeight& w, int f, int bpr) {
    return (u32)w.rows * (u32)bpr * (u32)w.fsz[f];
}

extern "C" __global__ void __launch_bounds__(RING_THREADS + 32, 1) matvec_ring(const RingArgs* __restrict__ args) {
    const RingArgs& a = *args;
    extern __shared__ __align__(128) u8 ring_smem[];
    u64* full = (u64*)ring_smem;
    u64* empty = full + RING_BARS;
    float2* s_cs = (float2*)(ring_smem + RING_HEAD);
    double* s_red = (double*)(s_cs + RING_ROPE_PAIRS);  // RING_WARPS
    signed char* sq = (signed char*)(s_red + RING_WARPS);
    float* sd = (float*)(sq + RING_XMAX);
    int* ss = (int*)(sd + RING_XMAX / 32);
    u8* slots = (u8*)(((unsigned long long)(ss + RING_XMAX / 16) + 127) & ~127ull);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = warp / RING_GW, wg = warp % RING_GW;  // the warp's group, its place there

#if RING_BCAP
    __shared__ int s_xready;  // the last phase whose x the consumers have quantized
#endif
    if (threadIdx.x == 0) {
        for (int b = 0; b < RING_BARS; b++) bar_init(&full[b], 1), bar_init(&empty[b], RING_GW);
        bar_init_fence();
#if RING_BCAP
        s_xready = -1;
#endif
    }
    __syncthreads();

#if MVQ_TRACE
    __shared__ u64 s_pwait[RING_MAX_PHASES];  // the producer's waits a phase
#endif
#if RING_DYN
    __shared__ int s_stage[RING_BARS];  // each slot's stage, -1: the phase's end
#endif
    // barrier b's bytes: slot b, or (b >= RING_SLOTS) group b - RING_SLOTS's whole share
    auto slot_at = [&](int b) -> u8* {
        return slots + (u64)(b < RING_SLOTS ? b : (b - RING_SLOTS) * RING_SPG) * RING_SLOT_BYTES;
    };
    if (warp == RING_WARPS) {  // the producer: every phase's stages of this block, in order
        if (lane == 0) {
            // each group's fills so far: of its slots (in turn), of its whole share
            u32 us[RING_GROUPS], ub[RING_GROUPS];
            for (int g = 0; g < RING_GROUPS; g++) us[g] = ub[g] = 0;
            for (int p = 0; p < a.n_phases; p++) {
                const RingPhase& ph = a.ph[p];
                const int bpr = ph.k / 256;
                const bool whole = ph.whole != 0;
                u64 pw = 0;  // (MVQ_TRACE) the waits for free bytes
                (void)pw;
                int issued = 0;  // (RING_BCAP) this phase's stages so far
                (void)issued;
                // group g's next barrier, once the consumers are done with every earlier
                // fill of its bytes (a wait on a phase that has completed returns at once)
                auto claim = [&](int g) -> int {
                    const u32 nb = ub[g], ns = us[g];
                    if (whole) {
                        if (nb > 0) RING_WAIT(pw, bar_wait(&empty[RING_SLOTS + g], (nb - 1) & 1u));
                        for (u32 i = 1; i <= RING_SPG && i <= ns; i++) {  // its slots' last fills
                            const u32 f = ns - i;
                            RING_WAIT(pw, bar_wait(&empty[g * RING_SPG + f % RING_SPG], (f / RING_SPG) & 1u));
                        }
                        ub[g] = nb + 1;
                        return RING_SLOTS + g;
                    }
                    const int b = g * RING_SPG + (int)(ns % RING_SPG);
                    if (ns >= RING_SPG) RING_WAIT(pw, bar_wait(&empty[b], (ns / RING_SPG - 1) & 1u));
                    if (nb > 0) RING_WAIT(pw, bar_wait(&empty[RING_SLOTS + g], (nb - 1) & 1u));
                    us[g] = ns + 1;
                    return b;
                };
                // the block's j-th stage of the phase, s, to group j % RING_GROUPS (s < 0:
                // that group's end of the phase, RING_DYN)
                auto issue = [&](int j, int s) {
                    const int b = claim(j % RING_GROUPS);
#if RING_DYN
                    s_stage[b] = s;
                    if (s < 0) {
                        bar_arrive(&full[b]);  // (its release makes s_stage visible)
                        return;
                    }
#endif
#if RING_BCAP
                    if (issued++ == RING_BCAP) {
                        WaitBound bound;
                        RING_WAIT(pw, while (*(volatile int*)&s_xready < p) bound.tick());
                    }
#endif
                    int wi, r0;
                    ring_stage(ph, s, &wi, &r0);
                    const int nw = ph.kind == 1 ? 2 : 1;
                    u32 total = 0;
                    for (int jw = 0; jw < nw; jw++)
                        for (int f = 0; f < 4; f++) total += ring_field_bytes(ph.w[wi + jw], f, bpr);
                    bar_expect(&full[b], total);
                    u8* dst = slot_at(b);
                    for (int jw = 0; jw < nw; jw++) {
                        const RingWeight& w = ph.w[wi + jw];
                        for (int f = 0; f < 4; f++) {
                            const u32 nbytes = ring_field_bytes(w, f, bpr);
                            if (nbytes == 0) continue;
                            bulk_copy(dst, w.f[f] + (u64)r0 * bpr * w.fsz[f], nbytes, &full[b]);
                            dst += nbytes;
                        }
                    }
                };
                int j = 0;
#if RING_DYN
                // RING_DYN stages taken ahead: stage q[u] is used RING_DYN stages after its
                // atomic went out (the counter only grows: the first one past the end ends
                // the phase)
                unsigned int* next = a.counters + RING_NEXT + p;
                int q[RING_DYN];
#pragma unroll
                for (int u = 0; u < RING_DYN; u++) q[u] = (int)atomicAdd(next, 1u);
                for (bool more = true; more;) {
#pragma unroll
                    for (int u = 0; u < RING_DYN; u++) {
                        if (!more) break;
                        const int s = q[u];
                        if (s >= ph.n_stages) {
                            more = false;
                            break;
                        }
                        q[u] = (int)atomicAdd(next, 1u);
                        issue(j++, s);
                    }
                }
                for (int g = 0; g < RING_GROUPS; g++) issue(j++, -1);
#else
                for (int s = blockIdx.x; s < ph.n_stages; s += gridDim.x) issue(j++, s);
#endif
#if MVQ_TRACE
                *(volatile u64*)&s_pwait[p] = pw;  // read after the phase's last stage landed
#endif
            }
        }
        return;
    }

    // consumers
    // the group's fills taken: of its slots (in turn), of its whole share (the producer's
    // us[grp], ub[grp])
    u32 us = 0, ub = 0;
#if MVQ_TRACE
    u64 tr[5] = {0, 0, 0, 0, 0};
    u64 cwait = 0;
#endif
    for (int p = 0; p < a.n_phases; p++) {
        const RingPhase& ph = a.ph[p];
        const int k = ph.k, bpr = k / 256, cpr = bpr * 4;  // 4 chunks a block (the pair forms)
        RING_TR(tr[0]);
        if (p == 0) {
            pdl_wait();
        } else {
            if (threadIdx.x == 0) {  // (bulk.cuh: a count that never comes traps)
                WaitBound bound;
                while (ld_acquire_u32(a.counters + p) < gridDim.x) bound.tick();
            }
            consumers_sync();
        }
        RING_TR(tr[1]);
        if (p == a.n_phases - 1) pdl_trigger();
        if (ph.kind == 2) {  // RoPE's angles, rope_head's float32 operations (ops.cu)
            const float p_f = (float)*ph.pos;
            for (int i = threadIdx.x; i < (ph.n_rot >> 1); i += RING_THREADS)
                s_cs[i] = rope_cs(p_f, i, ph.theta_scale, ph.freq_scale);
        }
        // x: the norm's scale from the writer's sums, then each run of 32 quantized as the
        // one-token kernels do (4 values a thread, 8 lanes a run), 4 rounds of loads at once
        float scale = 0.f;
        if (ph.norm_w != nullptr) {
            double v = 0.0;
            for (int i = lane; i < ph.ssq_n; i += 32) v += __ldcg(ph.ssq_in + i);
            scale = rms_scale(warp_sum_d(v), k, ph.eps);
        }
        const int n4 = k / 4;
        for (int base0 = 0; base0 < n4; base0 += 4 * RING_THREADS) {
            float4 xv[4], gv[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int i4 = base0 + r * RING_THREADS + threadIdx.x;
                xv[r] = gv[r] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (i4 < n4) xv[r] = ld_cg4(ph.x + 4 * i4);
                if (i4 < n4 && ph.norm_w != nullptr) gv[r] = __ldg((const float4*)(ph.norm_w + 4 * i4));
            }
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int i4 = base0 + r * RING_THREADS + threadIdx.x;
                const float4 v = ph.norm_w != nullptr ? norm4(xv[r], scale, gv[r]) : xv[r];
                q4k::quantize4(v, i4, i4 < n4, sq, sd, ss);
            }
        }
        consumers_sync();
#if RING_BCAP
        if (threadIdx.x == 0) *(volatile int*)&s_xready = p;
#endif
        RING_TR(tr[2]);
#if MVQ_TRACE
        tr[3] = 0;
        cwait = 0;
#endif
        const q4k::XQ x4 = {sq, sd, ss};
        const q6k::XQ x6 = {sq, sd, ss};

        u16* kcw = nullptr;
        u16* vcw = nullptr;
        int crow = 0;
        if (ph.kind == 2) crow = *ph.start, kcw = *ph.kcs, vcw = *ph.vcs;
        double ssq_acc = 0.0;  // the squares of the rows this lane finishes
        // stage s in a slot that has landed
        auto run_stage = [&](int s, int slot) {
            int wi, r0;
            ring_stage(ph, s, &wi, &r0);
            const RingWeight& w = ph.w[wi];
            const int per = w.rows / RING_GW;  // rows of weight wi a warp takes
            const int nd = ph.kind == 1 ? 2 * per : per;
            const int il = wg * per;  // its first row in the stage (gate's and up's alike)
            // the slot's fields: weight wi's, then (gate + up) weight 1's, `up` bytes on
            const u8* fa[4];
            const u8* at = slot_at(slot);
#pragma unroll
            for (int f = 0; f < 4; f++) fa[f] = at, at += ring_field_bytes(w, f, bpr);
            const u32 up = (u32)(at - fa[0]);
            // the residuals of this warp's rows (used after the dots)
            float rv = 0.f;
            if (ph.kind == 0 && ph.resid != nullptr && lane < nd) rv = __ldcg(ph.resid + r0 + il + lane);
            float acc[RING_MAXD];
#pragma unroll
            for (int d = 0; d < RING_MAXD; d++) acc[d] = 0.f;
            if (w.qtype == 0)
                ring_rows_n<q4k::QD>(acc, q4k::Fields{fa[0], fa[1], fa[2], fa[3]}, up, il, per, nd, cpr, lane, x4);
            else
                ring_rows_n<q6k::QD>(acc, q6k::Fields{fa[0], fa[1], fa[2], fa[3]}, up, il, per, nd, cpr, lane, x6);
            // every lane gets every row's sum; lane e finishes output e of the warp
            float v0 = 0.f, v1 = 0.f;
#pragma unroll
            for (int d = 0; d < RING_MAXD; d++) {
                if (d < nd) {
                    const float v = warp_sum(acc[d]);
                    if (ph.kind == 2 ? d == 2 * lane : d == lane) v0 = v;
                    if (ph.kind == 2 ? d == 2 * lane + 1 : d == lane + per) v1 = v;
                }
            }
            __syncwarp();
            if (lane == 0) bar_arrive(&empty[slot]);
            const int r = r0 + il;  // the warp's first output row
            if (ph.kind == 0) {
                if (lane < nd) {
                    const float y = ph.resid != nullptr ? __fadd_rn(rv, v0) : v0;
                    w.y[r + lane] = y;
                    ssq_acc += (double)y * y;
                }
            } else if (ph.kind == 1) {  // v0: the gate row, v1: its up row
                if (lane < per) ph.w[0].y[r + lane] = ph.act == 1 ? silu_mul1(v0, v1) : gelu_mul1(v0, v1);
            } else if (2 * lane < nd) {  // rows ra, ra + 1: RoPE's pair (2 i, 2 i + 1)
                const int ra = r + 2 * lane;
                const int hd = wi == 2 ? ph.head_dim_v : ph.head_dim;
                const int i = (ra % hd) >> 1;
                float o0 = v0, o1 = v1;
                if (wi < 2 && i < (ph.n_rot >> 1)) {
                    const float2 cs = s_cs[i];
                    o0 = __fsub_rn(__fmul_rn(v0, cs.x), __fmul_rn(v1, cs.y));
                    o1 = __fadd_rn(__fmul_rn(v0, cs.y), __fmul_rn(v1, cs.x));
                }
                w.y[ra] = o0;
                w.y[ra + 1] = o1;
                if (wi > 0 && crow < ph.n_ctx) {
                    u16* c = (wi == 1 ? kcw : vcw) + (i64)crow * w.m;
                    c[ra] = f2h(o0);
                    c[ra + 1] = f2h(o1);
                }
            }
#if MVQ_TRACE
            if (tr[3] == 0) tr[3] = ring_gtimer();
#endif
        };
        // the group's next barrier and the parity of its fill (the producer's claim)
        auto take = [&](u32* parity) -> int {
            if (ph.whole) {
                *parity = ub++ & 1u;
                return RING_SLOTS + grp;
            }
            *parity = (us / RING_SPG) & 1u;
            return grp * RING_SPG + (int)(us++ % RING_SPG);
        };
#if RING_DYN
        // the group's stages in the producer's order until its end of the phase
        for (;;) {
            u32 par;
            const int b = take(&par);
            RING_WAIT(cwait, bar_wait(&full[b], par));
            const int s = *(volatile int*)&s_stage[b];
            if (s < 0) {
                __syncwarp();
                if (lane == 0) bar_arrive(&empty[b]);
                break;
            }
            run_stage(s, b);
        }
#else
        // the block's j-th stage of the phase goes to group j % RING_GROUPS
        for (int s = blockIdx.x, j = 0; s < ph.n_stages; s += gridDim.x, j++) {
            if (j % RING_GROUPS != grp) continue;
            u32 par;
            const int b = take(&par);
            RING_WAIT(cwait, bar_wait(&full[b], par));
            run_stage(s, b);
        }
#endif
        // every thread's outputs visible device-wide before the block counts itself done;
        // the block's sum of squares (its warps' in order) for the next phase's norm
        if (p + 1 < a.n_phases) __threadfence();
        ssq_acc = warp_sum_d(ssq_acc);
        if (lane == 0) s_red[warp] = ssq_acc;
        consumers_sync();
        if (threadIdx.x == 0 && ph.kind == 0 && ph.ssq_out != nullptr) {
            double v = 0.0;
            for (int w = 0; w < RING_WARPS; w++) v += s_red[w];
            ph.ssq_out[blockIdx.x] = v;
        }
        if (threadIdx.x == 0 && p + 1 < a.n_phases) {
            __threadfence();
            atomicAdd(a.counters + p + 1, 1u);
        }
#if MVQ_TRACE
        if (threadIdx.x == 0) {
            unsigned int smid;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
            const unsigned int at = atomicAdd(&ring_trace_n, 1u);
            if (at < RING_TRACE_CAP) {
                u64* r = ring_trace[at];
                r[0] = (u64)ph.w[0].f[0];
                r[1] = blockIdx.x | ((u64)smid << 24);
                r[2] = tr[0], r[3] = tr[1], r[4] = tr[2], r[5] = tr[3], r[6] = ring_gtimer();
                r[7] = cwait, r[8] = *(volatile u64*)&s_pwait[p];
            }
        }
#endif
    }
    // the last block out sets the counters back to zero for the next replay
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(a.counters + RING_MAX_PHASES, 1u) == gridDim.x - 1) {
            for (int i = 0; i < RING_NEXT + RING_MAX_PHASES; i++) a.counters[i] = 0;
            __threadfence();
        }
    }
}
