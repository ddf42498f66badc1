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
// in a namespace of its own, with generic loads so that their QD::load reads a tile in
// shared memory) and this file after them (layout.ring_source).
//
// Arithmetic. Each row's dot is the one-token kernel's (matvec_q8_n1): lane l multiplies
// chunks l + 32 i in that order with QD::dot and the warp's lanes are summed by warp_sum,
// so where a stage gives a row one warp (RING rows 16, or 8 for gate + up) a row's value
// is that kernel's bit for bit; where a row is split over P warps (rows wider than a slot
// holds 16 of: ffn_down), each warp takes the lanes' iterations i = q (mod P) and the P
// sums are added in order (float32 reassociation). x is quantized with the same float
// operations; a normed phase takes the norm's sum of squares from the blocks of the phase
// that wrote x (ssq slots), as the linked one-token kernels do.

#ifndef RING_SLOTS
#define RING_SLOTS 4
#endif
#ifndef RING_SLOT_BYTES
#define RING_SLOT_BYTES (48 * 1024)
#endif
#ifndef RING_CAP
#define RING_CAP RING_SLOTS  // the most slots in flight (issued, not landed)
#endif
#define RING_WARPS 16  // consumer warps; one more warp produces
#define RING_THREADS (RING_WARPS * 32)
#define RING_XMAX 14336  // the widest x a phase reads
#define RING_MAX_PHASES 4
#define RING_ROPE_PAIRS 128
static_assert(q4k::QD::CPB == 4 && q6k::QD::CPB == 4, "ring.cu takes the pair forms: 4 chunks a block");


// MVQ_TRACE (bench_synthetic --trace): thread 0 of each block writes, a phase, the records
// of mmvq.cu's trace (the phase's first weight, the block and SM, then the times: phase
// begun, its x's wait done, x quantized, its first stage done, done; %globaltimer, ns)
#ifndef MVQ_TRACE
#define MVQ_TRACE 0
#endif
#if MVQ_TRACE
#define RING_TRACE_CAP 65536
__device__ unsigned long long ring_trace[RING_TRACE_CAP][7];
__device__ unsigned int ring_trace_n;
__device__ __forceinline__ u64 ring_gtimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define RING_TR(var) var = ring_gtimer()
#else
#define RING_TR(var)
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
    unsigned int* counters;  // RING_MAX_PHASES + 1, zero at entry; zero again at exit
};
// the host writes these as ctypes structures (ring.py): the same layout
static_assert(sizeof(RingWeight) == 72 && sizeof(RingPhase) == 352 && sizeof(RingArgs) == 1424,
              "ring.py's ctypes structures mirror these");


// warps that share a stage's output (ring.cu's ids 2..9: a block has 16 barriers)
__device__ __forceinline__ void group_sync(int id, int n_threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n_threads) : "memory");
}
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

// bytes of a stage's field f of one weight
__device__ __forceinline__ u32 ring_field_bytes(const RingWeight& w, int f, int bpr) {
    return (u32)w.rows * (u32)bpr * (u32)w.fsz[f];
}

extern "C" __global__ void __launch_bounds__(RING_THREADS + 32, 1) matvec_ring(const RingArgs* __restrict__ args) {
    const RingArgs& a = *args;
    extern __shared__ __align__(128) u8 ring_smem[];
    u64* full = (u64*)ring_smem;
    u64* empty = full + RING_SLOTS;
    float* part = (float*)(ring_smem + 128);  // [2][16 rows][16 parts]
    float2* s_cs = (float2*)(part + 2 * 16 * 16);
    double* s_red = (double*)(s_cs + RING_ROPE_PAIRS);  // RING_WARPS
    signed char* sq = (signed char*)(s_red + RING_WARPS);
    float* sd = (float*)(sq + RING_XMAX);
    int* ss = (int*)(sd + RING_XMAX / 32);
    u8* slots = (u8*)(((unsigned long long)(ss + RING_XMAX / 16) + 127) & ~127ull);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    if (threadIdx.x == 0) {
        for (int s = 0; s < RING_SLOTS; s++) bar_init(&full[s], 1), bar_init(&empty[s], RING_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == RING_WARPS) {  // the producer: every phase's stages of this block, in order
        if (lane == 0) {
            u64 n = 0;
            for (int p = 0; p < a.n_phases; p++) {
                const RingPhase& ph = a.ph[p];
                const int bpr = ph.k / 256;
                for (int s = blockIdx.x; s < ph.n_stages; s += gridDim.x, n++) {
                    const int slot = (int)(n % RING_SLOTS);
                    if (n >= RING_SLOTS) bar_wait(&empty[slot], (u32)(n / RING_SLOTS - 1) & 1u);
                    if (RING_CAP < RING_SLOTS && n >= RING_CAP)
                        bar_wait(&full[(n - RING_CAP) % RING_SLOTS], (u32)((n - RING_CAP) / RING_SLOTS) & 1u);
                    int wi, r0;
                    ring_stage(ph, s, &wi, &r0);
                    const int nw = ph.kind == 1 ? 2 : 1;
                    u32 total = 0;
                    for (int j = 0; j < nw; j++)
                        for (int f = 0; f < 4; f++) total += ring_field_bytes(ph.w[wi + j], f, bpr);
                    bar_expect(&full[slot], total);
                    u8* dst = slots + (u64)slot * RING_SLOT_BYTES;
                    for (int j = 0; j < nw; j++) {
                        const RingWeight& w = ph.w[wi + j];
                        for (int f = 0; f < 4; f++) {
                            const u32 b = ring_field_bytes(w, f, bpr);
                            if (b == 0) continue;
                            bulk_copy(dst, w.f[f] + (u64)r0 * bpr * w.fsz[f], b, &full[slot]);
                            dst += b;
                        }
                    }
                }
            }
        }
        return;
    }

    // consumers
    u64 n = 0;  // stages consumed (the producer's count)
    int buf = 0;
#if MVQ_TRACE
    u64 tr[5] = {0, 0, 0, 0, 0};
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
            for (int i = threadIdx.x; i < (ph.n_rot >> 1); i += RING_THREADS) {
                float theta = p_f;
                for (int s = 0; s < i; s++) theta = __fmul_rn(theta, ph.theta_scale);
                const float angle = __fmul_rn(ph.freq_scale, theta);
                s_cs[i] = make_float2((float)cos((double)angle), (float)sin((double)angle));
            }
        }
        // x: the norm's scale from the writer's sums, then each run of 32 quantized as the
        // one-token kernels do (4 values a thread, 8 lanes a run), 4 rounds of loads at once
        float scale = 0.f;
        if (ph.norm_w != nullptr) {
            double v = 0.0;
            for (int i = lane; i < ph.ssq_n; i += 32) v += __ldcg(ph.ssq_in + i);
            v = warp_sum_d(v);
            const float mean = (float)(v / (double)k);
            scale = 1.0f / (float)sqrt((double)__fadd_rn(mean, ph.eps));
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
                float4 v = xv[r];
                if (ph.norm_w != nullptr) {
                    const float4 g = gv[r];
                    v.x = __fmul_rn(__fmul_rn(v.x, scale), g.x);
                    v.y = __fmul_rn(__fmul_rn(v.y, scale), g.y);
                    v.z = __fmul_rn(__fmul_rn(v.z, scale), g.z);
                    v.w = __fmul_rn(__fmul_rn(v.w, scale), g.w);
                }
                q4k::quantize4(v, i4, i4 < n4, sq, sd, ss);
            }
        }
        consumers_sync();
        RING_TR(tr[2]);
#if MVQ_TRACE
        tr[3] = 0;
#endif
        const q4k::XQ x4 = {sq, sd, ss};
        const q6k::XQ x6 = {sq, sd, ss};

        u16* kcw = nullptr;
        u16* vcw = nullptr;
        int crow = 0;
        if (ph.kind == 2) crow = *ph.start, kcw = *ph.kcs, vcw = *ph.vcs;
        double ssq_acc = 0.0;  // lane 0 of a warp that finishes rows: their squares
        int prev_nr = 0;       // the last stage's rows (its groups of warps)
        for (int s = blockIdx.x; s < ph.n_stages; s += gridDim.x, n++, buf ^= 1) {
            const int slot = (int)(n % RING_SLOTS);
            int wi, r0;
            ring_stage(ph, s, &wi, &r0);
            const int R = ph.w[wi].rows;
            const int nr = ph.kind == 1 ? 2 * R : R;  // rows of the stage
            const int P = RING_WARPS / nr;            // warps a row
            const int row = warp % nr, q = warp / nr;
            const int j = ph.kind == 1 ? row / R : 0;  // gate or up
            const RingWeight& w = ph.w[wi + j];
            // the stage's fields of weight wi + j in the slot (the producer's order)
            const u8* at0 = slots + (u64)slot * RING_SLOT_BYTES;
            if (j == 1)
#pragma unroll
                for (int f = 0; f < 4; f++) at0 += ring_field_bytes(ph.w[wi], f, bpr);
            const u8* fp[4];
#pragma unroll
            for (int f = 0; f < 4; f++) fp[f] = at0, at0 += ring_field_bytes(w, f, bpr);
            const int il = row % R;
            bar_wait(&full[slot], (u32)(n / RING_SLOTS) & 1u);
            float acc = 0.f;
            if (w.qtype == 0) {
                const q4k::Fields f = {fp[0], fp[1], fp[2], fp[3]};
                for (int c = lane + 32 * q; c < cpr; c += 32 * P)
                    acc += q4k::QD::dot(q4k::QD::load(f, (u32)(il * cpr + c)), c, x4);
            } else {
                const q6k::Fields f = {fp[0], fp[1], fp[2], fp[3]};
                for (int c = lane + 32 * q; c < cpr; c += 32 * P)
                    acc += q6k::QD::dot(q6k::QD::load(f, (u32)(il * cpr + c)), c, x6);
            }
            acc = warp_sum(acc);
            __syncwarp();
            if (lane == 0) bar_arrive(&empty[slot]);
            // Who finishes the stage's outputs: where a warp has its row alone (rows, P 1)
            // its lane 0, as matvec_q8_n1 does, with no barrier; else the warps that share an
            // output (a row's P parts; gate and up; a RoPE pair) meet at a named barrier of
            // their own and the first of them finishes it, while the other groups go on.
            const int pair = ph.kind == 0 ? 1 : 2;  // rows an output takes
            if (pair * P > 1) {
                // groups other than the last stage's: wait until all have read their sums
                if (prev_nr && nr != prev_nr) consumers_sync();
                prev_nr = nr;
                if (lane == 0) part[(buf * 16 + row) * 16 + q] = acc;
                const int g = ph.kind == 0 ? row : (ph.kind == 1 ? row % R : row >> 1);
                group_sync(2 + g, 32 * pair * P);
            }
            const bool lead = q == 0 && (ph.kind == 0 || (ph.kind == 1 ? row < R : (row & 1) == 0));
            if (lead && lane == 0) {
                const float* pr = part + (buf * 16 + row) * 16;  // this row's parts, then the next rows'
                auto sum = [&](const float* r) {
                    float v = r[0];
                    for (int i = 1; i < P; i++) v += r[i];
                    return v;
                };
                if (ph.kind == 0) {
                    float v = P == 1 ? acc : sum(pr);
                    const int r = r0 + row;
                    if (ph.resid != nullptr) v = __fadd_rn(__ldcg(ph.resid + r), v);
                    w.y[r] = v;
                    ssq_acc += (double)v * v;
                } else if (ph.kind == 1) {  // row: the gate row, row + R its up row
                    const float g = sum(pr), u = sum(pr + R * 16);
                    ph.w[0].y[r0 + row] = ph.act == 1 ? silu_mul1(g, u) : gelu_mul1(g, u);
                } else {
                    float o0 = sum(pr), o1 = sum(pr + 16);
                    const int ra = r0 + row;  // rows ra, ra + 1: RoPE's pair (2 i, 2 i + 1)
                    const int hd = wi == 2 ? ph.head_dim_v : ph.head_dim;
                    const int i = (ra % hd) >> 1;
                    if (wi < 2 && i < (ph.n_rot >> 1)) {
                        const float2 cs = s_cs[i];
                        const float x0v = o0, x1v = o1;
                        o0 = __fsub_rn(__fmul_rn(x0v, cs.x), __fmul_rn(x1v, cs.y));
                        o1 = __fadd_rn(__fmul_rn(x0v, cs.y), __fmul_rn(x1v, cs.x));
                    }
                    ph.w[wi].y[ra] = o0;
                    ph.w[wi].y[ra + 1] = o1;
                    if (wi > 0 && crow < ph.n_ctx) {
                        const int m = ph.w[wi].m;
                        u16* c = wi == 1 ? kcw + (i64)crow * m : vcw + (i64)crow * m;
                        c[ra] = f2h(o0);
                        c[ra + 1] = f2h(o1);
                    }
                }
            }
#if MVQ_TRACE
            if (tr[3] == 0) tr[3] = ring_gtimer();
#endif
        }
        // every thread's outputs visible device-wide before the block counts itself done;
        // the block's sum of squares (its warps' in order) for the next phase's norm
        if (p + 1 < a.n_phases) __threadfence();
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
            }
        }
#endif
    }
    // the last block out sets the counters back to zero for the next replay
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(a.counters + RING_MAX_PHASES, 1u) == gridDim.x - 1) {
            for (int p = 0; p <= RING_MAX_PHASES; p++) a.counters[p] = 0;
            __threadfence();
        }
    }
}
