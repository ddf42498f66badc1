// The CUDA backend's non-matmul ops: RMS norm, RoPE, KV cache writes, attention, gated
// activations and elementwise arithmetic. Activations are C-contiguous float32; the KV
// cache is fp16 (stored as u16 bit patterns).
//
// Where the CPU reference (picollama/backends/cpu/ops.py) fixes an order of float32
// operations, these kernels repeat it with __fmul_rn/__fadd_rn (which the compiler never
// fuses into FMAs) and compute exp/tanh/cos/sin in double precision, as the CPU's
// math.exp etc. do, so the two backends agree to the last bit or two. Positions and the
// cache's start position are read from device memory, so a captured CUDA graph can be
// replayed at any position.

#define NEG_INF __int_as_float(0xff800000u)

// ------------------------------------------------------------------------------- RMS norm

// One block per row of d values: out = (x * (1 / sqrt(mean(x^2) + eps))) * w (w optional).
// The sum of squares is accumulated in double, as ggml's CPU code does.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int d, float eps, int has_w) {
    __shared__ double part[32];
    __shared__ float s_scale;
    const float* xr = x + (i64)blockIdx.x * d;
    float* orow = out + (i64)blockIdx.x * d;
    double acc = 0.0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        double v = (double)xr[j];
        acc += v * v;
    }
    block_rms_scale(acc, part, (blockDim.x + 31) >> 5, d, eps, &s_scale);
    float scale = s_scale;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float v = __fmul_rn(xr[j], scale);
        orow[j] = has_w ? __fmul_rn(v, w[j]) : v;
    }
}

// ----------------------------------------------------------------------------------- RoPE

// One head: pair i of the first n_rot dims turns by pos * freq_scale * theta_scale^i, the
// power taken as ggml does: a float32 running product. Pairs are (2i, 2i+1), or
// (i, i + n_rot/2) for NeoX. One thread per pair, so that every thread has one independent
// load. With `cache`, the rotated head is also written there in fp16 (store_kv's rounding).
__device__ __forceinline__ void rope_head(const float* __restrict__ xh, float* __restrict__ oh,
                                          u16* __restrict__ cache, float p, int head_dim,
                                          int n_rot, float theta_scale, float freq_scale,
                                          int neox) {
    int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int a = neox ? i : 2 * i;
        int b = neox ? i + half : 2 * i + 1;
        float x0 = xh[a], x1 = xh[b];
        const float2 cs = rope_cs(p, i, theta_scale, freq_scale);
        const float c = cs.x, sn = cs.y;
        float o0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        float o1 = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
        oh[a] = o0;
        oh[b] = o1;
        if (cache) {
            cache[a] = f2h(o0);
            cache[b] = f2h(o1);
        }
    }
    for (int j = n_rot + threadIdx.x; j < head_dim; j += blockDim.x) {
        float v = xh[j];
        oh[j] = v;
        if (cache) cache[j] = f2h(v);
    }
}

// Block (t, h): head h of token t at position pos[t]; x and out are (n, n_heads, head_dim).
extern "C" __global__ void rope(const float* __restrict__ x, const int* __restrict__ pos,
                                float* __restrict__ out, int n_heads, int head_dim, int n_rot,
                                float theta_scale, float freq_scale, int neox) {
    int t = blockIdx.x, h = blockIdx.y;
    i64 at = ((i64)t * n_heads + h) * head_dim;
    rope_head(x + at, out + at, nullptr, (float)pos[t], head_dim, n_rot, theta_scale,
              freq_scale, neox);
}

// RoPE of q and k and the KV cache write of k and v in one launch (decode graphs fuse
// rope, rope and store_kv into this; backend._fuse). Block (t, slot): slot < n_heads ropes q
// head `slot`; the next n_kv_heads slots rope k heads into k_out and the cache row
// start + t; the last n_kv_heads copy v heads into the cache. The caches are kcs[0] and
// vcs[0] (a graph's parameters: one graph serves every cache of its size). The same float32 operations
// and fp16 rounding as rope and store_kv.
extern "C" __global__ void rope_store(const float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, float* __restrict__ q_out,
                                      float* __restrict__ k_out, u16* const* __restrict__ kcs,
                                      u16* const* __restrict__ vcs, const int* __restrict__ pos,
                                      const int* __restrict__ start, int n_heads,
                                      int n_kv_heads, int head_dim, int head_dim_v, int n_rot,
                                      float theta_scale, float freq_scale, int neox,
                                      int n_ctx) {
    pdl_trigger_at(0, 1);
    pdl_wait();
    pdl_trigger_at(1, 1);
    int t = blockIdx.x, slot = blockIdx.y;
    int row = *start + t;
    u16* kc = kcs[0];
    u16* vc = vcs[0];
    float p = (float)pos[t];
    if (slot < n_heads) {
        i64 at = ((i64)t * n_heads + slot) * head_dim;
        rope_head(q + at, q_out + at, nullptr, p, head_dim, n_rot, theta_scale, freq_scale,
                  neox);
        return;
    }
    if (row >= n_ctx) return;  // the host checks the bound first
    slot -= n_heads;
    if (slot < n_kv_heads) {
        i64 at = ((i64)t * n_kv_heads + slot) * head_dim;
        u16* ch = kc + ((i64)row * n_kv_heads + slot) * head_dim;
        rope_head(k + at, k_out + at, ch, p, head_dim, n_rot, theta_scale, freq_scale, neox);
        return;
    }
    slot -= n_kv_heads;
    const float* vh = v + ((i64)t * n_kv_heads + slot) * head_dim_v;
    u16* ch = vc + ((i64)row * n_kv_heads + slot) * head_dim_v;
    for (int j = threadIdx.x; j < head_dim_v; j += blockDim.x) ch[j] = f2h(vh[j]);
}

// ------------------------------------------------------------------------------- KV cache

// Rows start .. start + n - 1 of the fp16 caches get k (n, kdim) and v (n, vdim), rounded to
// nearest even; rows past n_ctx are dropped (the host checks the bound first).
extern "C" __global__ void store_kv(const float* __restrict__ k, const float* __restrict__ v,
                                    u16* __restrict__ kc, u16* __restrict__ vc,
                                    const int* __restrict__ start, int n, int kdim, int vdim,
                                    int n_ctx) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    int s = *start;
    i64 nk = (i64)n * kdim, nv = (i64)n * vdim;
    if (idx < nk) {
        int t = (int)(idx / kdim), j = (int)(idx % kdim);
        if (s + t < n_ctx) kc[(i64)(s + t) * kdim + j] = f2h(k[idx]);
    } else if (idx < nk + nv) {
        i64 i2 = idx - nk;
        int t = (int)(i2 / vdim), j = (int)(i2 % vdim);
        if (s + t < n_ctx) vc[(i64)(s + t) * vdim + j] = f2h(v[i2]);
    }
}

// One row of k and v into each of n caches: row t at starts[t] of kcs[t] / vcs[t] (decode
// steps: a token of one sequence, or of each of several; the caches' pointers are the
// step's parameters). Rows past n_ctx are dropped (the host checks the starts first).
extern "C" __global__ void store_kv_rows(const float* __restrict__ k,
                                         const float* __restrict__ v, u16* const* __restrict__ kcs,
                                         u16* const* __restrict__ vcs,
                                         const int* __restrict__ starts, int n, int kdim,
                                         int vdim, int n_ctx) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 nk = (i64)n * kdim, nv = (i64)n * vdim;
    if (idx < nk) {
        int t = (int)(idx / kdim), j = (int)(idx % kdim);
        if (starts[t] < n_ctx) kcs[t][(i64)starts[t] * kdim + j] = f2h(k[idx]);
    } else if (idx < nk + nv) {
        i64 i2 = idx - nk;
        int t = (int)(i2 / vdim), j = (int)(i2 % vdim);
        if (starts[t] < n_ctx) vcs[t][(i64)starts[t] * vdim + j] = f2h(v[i2]);
    }
}

// ------------------------------------------------------------------------------ attention

// The first key position a query at pos attends to: 0, or pos - window + 1 with a sliding
// window of that many positions.
__device__ __forceinline__ int window_lo(int pos, int window) {
    return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
}

#define ATT_WARPS 4
#define ATT_MAXD 256  // head_dim and head_dim_v at most this
#define ATT_DPL (ATT_MAXD / 32)

// Flash-attention style: no score matrix. Block (h, t, split) handles query head h of token
// t (position start + t) against the keys of its split of the causal (and sliding-window)
// range. Each warp takes tiles of 32 keys: lane j scores key j0 + j (a whole dot product
// over head_dim, so the 32 keys' loads are in flight together), the tile's softmax weights
// update the warp's online-softmax state, and then each lane accumulates its dims of the
// weighted values (lane + 32 i), the weights broadcast by shuffles. The warps' states are
// merged in shared memory. With one split the block writes the normalized output
// (n, n_heads * hdv); with several it writes (max, sum, unnormalized output) to `part`
// for attn_combine.
template <bool DECODE>
__device__ __forceinline__ void attention_body(
    const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int* __restrict__ start_ptr, int n_heads, int n_kv_heads, int hd, int hdv,
    float scale, int window, float softcap, int chunk, float* __restrict__ out,
    float* __restrict__ part) {
    __shared__ float sq[ATT_MAXD];
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][ATT_MAXD];
    int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int pos = *start_ptr + t;
    int lo = window_lo(pos, window);
    int hi = pos + 1;  // causal: keys at positions <= pos
    int s0 = lo + split * chunk;
    int s1 = min(hi, s0 + chunk);
    int kvh = h / (n_heads / n_kv_heads);
    const float* qh = q + ((i64)t * n_heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) sq[d] = qh[d];
    __syncthreads();

    float m = NEG_INF, l = 0.f;
    float acc[ATT_DPL];
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++) acc[i] = 0.f;
    i64 kstride = (i64)n_kv_heads * hd, vstride = (i64)n_kv_heads * hdv;
    bool vec = (hd & 7) == 0;  // rows of 16-byte multiples: vector loads
    for (int j0 = s0 + 32 * warp; j0 < s1; j0 += 32 * ATT_WARPS) {
        int j = j0 + lane;
        float s = NEG_INF;
        if (j < s1) {
            const u16* kr = kc + j * kstride + (i64)kvh * hd;
            float dot = 0.f;
            if (vec && DECODE) {
#pragma unroll 16
                for (int d = 0; d < hd; d += 8) {
                    uint4 v = __ldg((const uint4*)(kr + d));
                    u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        dot = fmaf(sq[d + 2 * e], h2f((u16)(w4[e] & 0xFFFFu)), dot);
                        dot = fmaf(sq[d + 2 * e + 1], h2f((u16)(w4[e] >> 16)), dot);
                    }
                }
            } else if (vec) {
#pragma unroll 8
                for (int d = 0; d < hd; d += 8) {
                    uint4 v = __ldg((const uint4*)(kr + d));
                    u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        dot = fmaf(sq[d + 2 * e], h2f((u16)(w4[e] & 0xFFFFu)), dot);
                        dot = fmaf(sq[d + 2 * e + 1], h2f((u16)(w4[e] >> 16)), dot);
                    }
                }
            } else {
                for (int d = 0; d < hd; d++) dot = fmaf(sq[d], h2f(kr[d]), dot);
            }
            s = dot * scale;
            if (softcap > 0.f) s = (float)((double)softcap * tanh((double)(s / softcap)));
        }
        float m_new = fmaxf(m, warp_max(s));  // finite: key j0 is in range
        float corr = expf(m - m_new);
        float p = j < s1 ? expf(s - m_new) : 0.f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATT_DPL; i++) acc[i] *= corr;
        if (DECODE) {
            // Keys past the range have p = 0 and read the last row in range instead
            // (adding 0 * v leaves acc as it was): no branch, so that the loads of 8 keys
            // are issued before the first is used.
            int last = s1 - 1;
#pragma unroll
            for (int jb = 0; jb < 32; jb += 8) {
                u16 vv[8][ATT_DPL];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const u16* vr = vc + (i64)min(j0 + jb + u, last) * vstride + (i64)kvh * hdv;
#pragma unroll
                    for (int i = 0; i < ATT_DPL; i++) {
                        int d = lane + 32 * i;
                        vv[u][i] = d < hdv ? __ldg(vr + d) : (u16)0;
                    }
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    float pj = __shfl_sync(0xffffffffu, p, jb + u);
#pragma unroll
                    for (int i = 0; i < ATT_DPL; i++) acc[i] = fmaf(pj, h2f(vv[u][i]), acc[i]);
                }
            }
        } else {
            int count = min(32, s1 - j0);
            // unrolled, so that the value rows' loads are in flight together
#pragma unroll 8
            for (int jj = 0; jj < 32; jj++) {
                float pj = __shfl_sync(0xffffffffu, p, jj);
                if (jj < count) {
                    const u16* vr = vc + (i64)(j0 + jj) * vstride + (i64)kvh * hdv;
#pragma unroll
                    for (int i = 0; i < ATT_DPL; i++) {
                        int d = lane + 32 * i;
                        if (d < hdv) acc[i] = fmaf(pj, h2f(vr[d]), acc[i]);
                    }
                }
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++) {
        int d = lane + 32 * i;
        if (d < hdv) sacc[warp][d] = acc[i];
    }
    __syncthreads();
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) mx = fmaxf(mx, sm[w]);
    float wt[ATT_WARPS];
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = sm[w] > NEG_INF ? expf(sm[w] - mx) : 0.f;
        total += sl[w] * wt[w];
    }
    i64 head = (i64)t * n_heads + h;
    float* pp = part + (head * n_splits + split) * (hdv + 2);
    for (int d = threadIdx.x; d < hdv; d += blockDim.x) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += sacc[w][d] * wt[w];
        if (n_splits == 1) {
            out[head * hdv + d] = o / total;
        } else {
            pp[2 + d] = o;
        }
    }
    if (n_splits > 1 && threadIdx.x == 0) {
        pp[0] = mx;
        pp[1] = total;
    }
}


#define ATT_PARAMS                                                                         \
    const float *__restrict__ q, const u16 *__restrict__ kc, const u16 *__restrict__ vc,     \
        const int *__restrict__ start_ptr, int n_heads, int n_kv_heads, int hd, int hdv,    \
        float scale, int window, float softcap, int chunk, float *__restrict__ out,         \
        float *__restrict__ part
#define ATT_ARGS \
    q, kc, vc, start_ptr, n_heads, n_kv_heads, hd, hdv, scale, window, softcap, chunk, out, part

// prefill and batches (many blocks: few registers), and single-token decode (few blocks:
// value loads of 8 keys batched, which takes more registers; ~1/5 faster in decode, but
// ~1/10 slower prefill when used there, measured on the H200)
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attention(ATT_PARAMS) {
    attention_body<false>(ATT_ARGS);
}

// (the caches at kcs[0] and vcs[0]: a decode graph's parameters)
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_decode(const float* __restrict__ q, const u16* const* __restrict__ kcs,
                     const u16* const* __restrict__ vcs, const int* __restrict__ start_ptr,
                     int n_heads, int n_kv_heads, int hd, int hdv, float scale, int window,
                     float softcap, int chunk, float* __restrict__ out,
                     float* __restrict__ part) {
    attention_body<true>(q, kcs[0], vcs[0], start_ptr, n_heads, n_kv_heads, hd, hdv, scale,
                         window, softcap, chunk, out, part);
}

// Prompt batches: tiles of queries against tiles of keys in shared memory. Block (h, tile)
// takes the queries t0 .. t0 + 31 of head h; each tile of 32 keys (and their values) is
// converted to float32 into shared memory once and used by all 32 queries, where
// attention_body reads every key once per query. Thread (rg = tid / 8, cg = tid % 8) holds
// the scores of rows rg and rg + 16 at keys cg + 8 i (i < 4) and the outputs of those rows
// at dims cg + 8 i (i < DV); a row's 8 threads are consecutive lanes of one warp, so its
// online-softmax state (kept by each of them alike) needs only shuffles. No score matrix
// beyond the 32 x 32 tile. Rows are padded to odd lengths (hd + 1, 33) so that the threads
// reading one column of a tile hit distinct banks. hd and hdv even (u32 loads of the fp16
// cache), at most 8 * DV.
#define FA_BQ 32
#define FA_BK 32
#define FA_THREADS 128

template <int DV>
__device__ __forceinline__ void attention_tiles_body(
    const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int* __restrict__ start_ptr, int n, int n_heads, int n_kv_heads, int hd, int hdv,
    float scale, int window, float softcap, float* __restrict__ out) {
    extern __shared__ float fa_smem[];
    const int qs = hd + 1, ps = FA_BK + 1;
    float* Qs = fa_smem;           // [FA_BQ][hd + 1]
    float* Ks = Qs + FA_BQ * qs;   // [FA_BK][hd + 1]
    float* Vs = Ks + FA_BK * qs;   // [FA_BK][hdv]
    float* Ps = Vs + FA_BK * hdv;  // [FA_BQ][FA_BK + 1]
    const int h = blockIdx.x;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FA_BQ;  // the longest key ranges first
    const int tid = threadIdx.x, rg = tid >> 3, cg = tid & 7;
    const int start = *start_ptr;
    const int kvh = h / (n_heads / n_kv_heads);
    const i64 kstride = (i64)n_kv_heads * hd, vstride = (i64)n_kv_heads * hdv;
    const int nq = min(FA_BQ, n - t0);
    for (int idx = tid; idx < FA_BQ * hd; idx += FA_THREADS) {
        int r = idx / hd, d = idx - r * hd;
        Qs[r * qs + d] = r < nq ? q[((i64)(t0 + r) * n_heads + h) * hd + d] : 0.f;
    }
    // keys from the first query's window start to the last query's position
    const int first = start + t0, last = start + t0 + nq - 1;
    const int lo = window_lo(first, window);
    const int hi = last + 1;
    int rpos[2], rlo[2];
    float m[2], l[2], acc[2][DV];
#pragma unroll
    for (int a = 0; a < 2; a++) {
        rpos[a] = first + rg + 16 * a;
        rlo[a] = window_lo(rpos[a], window);
        m[a] = NEG_INF;
        l[a] = 0.f;
#pragma unroll
        for (int i = 0; i < DV; i++) acc[a][i] = 0.f;
    }
    const int hd2 = hd >> 1, hdv2 = hdv >> 1;
    for (int j0 = lo; j0 < hi; j0 += FA_BK) {
        const int nk = min(FA_BK, hi - j0);
        __syncthreads();  // Q is written; the last tile's K, V and P are used up
        for (int idx = tid; idx < FA_BK * hd2; idx += FA_THREADS) {
            int c = idx / hd2, d = 2 * (idx - c * hd2);
            u32 w = c < nk ? *(const u32*)(kc + (i64)(j0 + c) * kstride + (i64)kvh * hd + d) : 0u;
            Ks[c * qs + d] = h2f((u16)(w & 0xFFFFu));
            Ks[c * qs + d + 1] = h2f((u16)(w >> 16));
        }
        for (int idx = tid; idx < FA_BK * hdv2; idx += FA_THREADS) {
            int c = idx / hdv2, d = 2 * (idx - c * hdv2);
            u32 w = c < nk ? *(const u32*)(vc + (i64)(j0 + c) * vstride + (i64)kvh * hdv + d) : 0u;
            Vs[c * hdv + d] = h2f((u16)(w & 0xFFFFu));
            Vs[c * hdv + d + 1] = h2f((u16)(w >> 16));
        }
        __syncthreads();
        float sc[2][4];
#pragma unroll
        for (int i = 0; i < 4; i++) sc[0][i] = sc[1][i] = 0.f;
        const float* q0 = Qs + rg * qs;
        const float* q1 = Qs + (rg + 16) * qs;
#pragma unroll 4
        for (int d = 0; d < hd; d++) {
            float a0 = q0[d], a1 = q1[d];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float kv = Ks[(cg + 8 * i) * qs + d];
                sc[0][i] = fmaf(a0, kv, sc[0][i]);
                sc[1][i] = fmaf(a1, kv, sc[1][i]);
            }
        }
#pragma unroll
        for (int a = 0; a < 2; a++) {
            float mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int c = cg + 8 * i, j = j0 + c;
                float v = sc[a][i] * scale;
                if (softcap > 0.f) v = (float)((double)softcap * tanh((double)(v / softcap)));
                v = (c < nk && j <= rpos[a] && j >= rlo[a]) ? v : NEG_INF;
                sc[a][i] = v;
                mx = fmaxf(mx, v);
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[a], mx);
            const float corr = m_new == NEG_INF ? 1.f : expf(m[a] - m_new);
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float p = sc[a][i] == NEG_INF ? 0.f : expf(sc[a][i] - m_new);
                Ps[(rg + 16 * a) * ps + cg + 8 * i] = p;
                sum += p;
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[a] = l[a] * corr + sum;
            m[a] = m_new;
#pragma unroll
            for (int i = 0; i < DV; i++) acc[a][i] *= corr;
        }
        __syncwarp();  // a row's P is written by the lanes of the warp that reads it
        const float* p0 = Ps + rg * ps;
        const float* p1 = Ps + (rg + 16) * ps;
        for (int c = 0; c < nk; c++) {
            const float w0 = p0[c], w1 = p1[c];
            const float* vr = Vs + c * hdv + cg;
#pragma unroll
            for (int i = 0; i < DV; i++) {
                if (cg + 8 * i < hdv) {
                    float v = vr[8 * i];
                    acc[0][i] = fmaf(w0, v, acc[0][i]);
                    acc[1][i] = fmaf(w1, v, acc[1][i]);
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 2; a++) {
        int r = rg + 16 * a;
        if (r < nq) {
            float* o = out + ((i64)(t0 + r) * n_heads + h) * hdv;
#pragma unroll
            for (int i = 0; i < DV; i++)
                if (cg + 8 * i < hdv) o[cg + 8 * i] = acc[a][i] / l[a];
        }
    }
}

#define FA_PARAMS                                                                          \
    const float *__restrict__ q, const u16 *__restrict__ kc, const u16 *__restrict__ vc,     \
        const int *__restrict__ start_ptr, int n, int n_heads, int n_kv_heads, int hd,      \
        int hdv, float scale, int window, float softcap, float *__restrict__ out
#define FA_ARGS q, kc, vc, start_ptr, n, n_heads, n_kv_heads, hd, hdv, scale, window, softcap, out

// head dims up to 128 and up to 256
extern "C" __global__ void __launch_bounds__(FA_THREADS) attention_tiles_16(FA_PARAMS) {
    attention_tiles_body<16>(FA_ARGS);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) attention_tiles_32(FA_PARAMS) {
    attention_tiles_body<32>(FA_ARGS);
}

// Merge the splits' (max, sum, unnormalized output) of each (token, head) into out.
extern "C" __global__ void attn_combine(const float* __restrict__ part, float* __restrict__ out,
                                        int n_heads, int hdv, int n_splits) {
    int h = blockIdx.x, t = blockIdx.y;
    i64 head = (i64)t * n_heads + h;
    const float* pp = part + head * n_splits * (hdv + 2);
    float mx = NEG_INF;
    for (int s = 0; s < n_splits; s++) {
        if (pp[s * (hdv + 2) + 1] > 0.f) mx = fmaxf(mx, pp[s * (hdv + 2)]);
    }
    float total = 0.f;
    for (int s = 0; s < n_splits; s++) {
        const float* ps = pp + s * (hdv + 2);
        if (ps[1] > 0.f) total += ps[1] * expf(ps[0] - mx);
    }
    for (int d = threadIdx.x; d < hdv; d += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < n_splits; s++) {
            const float* ps = pp + s * (hdv + 2);
            if (ps[1] > 0.f) o += ps[2 + d] * expf(ps[0] - mx);
        }
        out[head * hdv + d] = o / total;
    }
}

// ------------------------------------------------------------------ decode attention, GQA
//
// One token, one block per (KV head, split). The block does the whole group of
// G = n_heads / n_kv_heads query heads, so each key and value row is read once for the
// group. The valid range [lo, pos] (pos read from the device: a captured graph replays at
// any position) is cut into equal parts of at least min_keys keys, at most gridDim.y of them
// (the blocks of unused splits return at once). A block takes its part in tiles of
// ATD_KEYS keys, one key a thread:
//  - scores: each thread takes the whole dot of its key's row with the G queries (the
//    queries in shared memory, read by every thread at once: a broadcast), so no shuffles
//    sit on a key's chain and a tile's rows are all in flight together;
//  - softmax: each warp keeps an online softmax over its own 32 keys of every tile: the
//    tile's maximum of each head (shuffles) updates the warp's running maximum, and each
//    lane writes its key's weights exp(s - max) to the warp's part of shared memory;
//  - values: lanes run across head_dim (lane holds dims DPL * lane .. + DPL - 1, so a value
//    row is one coalesced load) over the warp's keys, the weights read from shared memory.
//  No barrier of the block inside the tiles: the warps meet only for the queries and for
//  the merge of their states at the end.
// With one split the block writes the normalized output; with several each block writes
// (max, sum, unnormalized output) per head to `part`, and the last block of its KV head to
// finish (a counter per KV head, which that block resets to 0) merges them into out: no
// second launch.
// With dependent launches the position and the rows of the keys before it were written
// before the launch before this one began (the step's first copy; earlier steps), so each
// thread's first key row is loaded, and its warp's first value rows prefetched into L1,
// before the wait (ATT_PRELOAD); only the current position's row and the queries come from
// the Q/K/V launch this one waits for. (Run 19 replaced a warp per key, whose shuffle
// reductions made each key a chain of ~300 cycles, with this.)

#define ATD_WARPS 4
#define ATD_KEYS (ATD_WARPS * 32)  // keys of a tile: one a thread

template <int DPL>
__device__ __forceinline__ void load_halves(const u16* __restrict__ p, float* f) {
    if constexpr (DPL == 2) {
        u32 w = __ldg((const u32*)p);
        f[0] = h2f((u16)(w & 0xFFFFu));
        f[1] = h2f((u16)(w >> 16));
    } else if constexpr (DPL == 4) {
        uint2 w = __ldg((const uint2*)p);
        u32 w4[2] = {w.x, w.y};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            f[2 * e] = h2f((u16)(w4[e] & 0xFFFFu));
            f[2 * e + 1] = h2f((u16)(w4[e] >> 16));
        }
    } else {
        uint4 w = __ldg((const uint4*)p);
        u32 w4[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            f[2 * e] = h2f((u16)(w4[e] & 0xFFFFu));
            f[2 * e + 1] = h2f((u16)(w4[e] >> 16));
        }
    }
}

// A lane's DPL halves of a value row as loaded (one load), and as floats (ATT_VPRE)
template <int DPL>
struct VRaw {
    u32 w[DPL / 2];
};

template <int DPL>
__device__ __forceinline__ VRaw<DPL> load_vraw(const u16* __restrict__ p) {
    VRaw<DPL> r;
    if constexpr (DPL == 2) {
        r.w[0] = __ldg((const u32*)p);
    } else if constexpr (DPL == 4) {
        const uint2 w = __ldg((const uint2*)p);
        r.w[0] = w.x, r.w[1] = w.y;
    } else {
        const uint4 w = __ldg((const uint4*)p);
        r.w[0] = w.x, r.w[1] = w.y, r.w[2] = w.z, r.w[3] = w.w;
    }
    return r;
}

template <int DPL>
__device__ __forceinline__ void halves(const VRaw<DPL>& r, float* f) {
#pragma unroll
    for (int e = 0; e < DPL / 2; e++) {
        f[2 * e] = h2f((u16)(r.w[e] & 0xFFFFu));
        f[2 * e + 1] = h2f((u16)(r.w[e] >> 16));
    }
}

__device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// ATT_PRELOAD: each thread's first key row before the dependent-launch wait, and its warp's
// first value rows into L1 (run 13, H200, with the earlier warp-per-key loop: 135M Q4_K_M
// 1313 -> 1401 and 1399 -> 1460 t/s on two machines; 0: every load after it)
#ifndef ATT_PRELOAD
#define ATT_PRELOAD 1
#endif
#ifndef ATT_FAKE
#define ATT_FAKE 0
#endif
// ATT_VPRE: each lane's dims of its warp's value rows of the first tile in registers, loaded
// with the key rows (before the wait for rows before the position), so that the value phase
// of a short range waits on no load: all 32 rows at head_dim 64, the first 16 at 128 (32
// registers a lane; more spill), none at 256. Without it (the default) every value row is
// prefetched into L1 by its key's thread and loaded 8 at a time. Off until timed.
#ifndef ATT_VPRE
#define ATT_VPRE 0
#endif
// ATT_HEADS: a range short enough for one split (fewer than 2 * min_keys keys) leaves the
// grid's other split blocks idle while each of the KV heads' blocks scores every key with
// all G heads of its group (a thread's dot is G * head_dim FMAs). With ATT_HEADS=1 those
// blocks take one query head each instead (when the grid has at least G splits): the key
// and value rows are read G times (from L2: a short range), each thread's dot and value
// sums shrink G-fold, and G times as many multiprocessors share the work. Long ranges keep
// the splits over keys. The kernel runs the body twice, as the group (BY_HEAD false) and as
// one head (true): each instance returns at once from the other's blocks. Head dims 64 and
// 128 (at 256 the two instances' shared memory exceeds 48 KB). Off until timed.
#ifndef ATT_HEADS
#define ATT_HEADS 0
#endif
// (both options are #if blocks, so that the default build's source is the one timed)

// Split partials: out (n_kv, n_splits, G, HD) unnormalized outputs, then (n_kv, n_splits, G)
// pairs (max, sum), all in `part` (n_kv * n_splits * G * (HD + 2) floats).
template <int DPL, int GB, bool BY_HEAD = false>
__device__ __forceinline__ void attention_gqa_body(
    const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int* __restrict__ start_ptr, int n_heads, int n_kv_heads, float scale, int window,
    float softcap, int min_keys, float* __restrict__ out, float* __restrict__ part,
    int* __restrict__ counter, int pdl_at) {
    constexpr int HD = 32 * DPL;
    constexpr int KCH = HD / 8;                // 16-byte pieces of a key row
    constexpr int KB = KCH < 16 ? KCH : 16;    // pieces a batch of loads (the first: preloaded)
    __shared__ float sm[ATD_WARPS][GB], sl[ATD_WARPS][GB];
    __shared__ float sacc[ATD_WARPS][GB][HD];
    __shared__ __align__(16) float sq[GB][HD];  // the group's queries
    __shared__ float sp[GB][ATD_KEYS];          // a tile's weights (each warp its 32 keys')
    __shared__ int s_last;
    pdl_trigger_at(0, pdl_at);
#if !ATT_PRELOAD
    pdl_wait();
    pdl_trigger_at(1, pdl_at);
#endif
#if ATT_HEADS
    const int kvh = blockIdx.x;
    int split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = threadIdx.x;
    int G = n_heads / n_kv_heads;  // at most GB (the host checks)
#else
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = threadIdx.x;
    const int G = n_heads / n_kv_heads;  // at most GB (the host checks)
#endif
    // the position was copied to the device before the graph's first kernel: it may be read
    // before the wait, and so may every cache row before it (written by earlier steps)
    const int pos = *start_ptr;
    const int lo = window_lo(pos, window);
    const int len = pos + 1 - lo;
    // only as many splits as the range needs (min_keys each): short ranges skip the merge
    const int n_splits = max(1, min((int)gridDim.y, len / min_keys));
#if ATT_HEADS
    int h0 = kvh * G;  // the block's first query head
    if constexpr (DPL <= 4) {
        const bool by_head = n_splits == 1 && G > 1 && (int)gridDim.y >= G;
        if (by_head != BY_HEAD) return;  // the other instance's block
        if (BY_HEAD) {
            if (split >= G) return;
            h0 += split;
            G = 1;
            split = 0;
        }
    }
#define ATT_H0 h0
#else
#define ATT_H0 (kvh * G)
#endif
    if (split >= n_splits) return;
    const int s0 = lo + (int)((i64)len * split / n_splits);
    const int s1 = lo + (int)((i64)len * (split + 1) / n_splits);

    const i64 stride = (i64)n_kv_heads * HD;
    const u16* kh = kc + (i64)kvh * HD;  // the KV head's key row at position 0
    const u16* vh = vc + (i64)kvh * HD;  // and its value row
    const u16* vb = vh + lane * DPL;     // this lane's dims of a value row
    // this thread's key of the first tile (past the end: the last row, counted for nothing):
    // its key row into registers and, with `values`, its value row's lines into L1, which
    // its warp reads in the value phase
    const int jf = s0 + t, jr0 = jf < s1 ? jf : s1 - 1;
    uint4 kpre[KB];
#if ATT_VPRE
    // the first tile's value rows a lane holds in registers (32 or 64 registers)
    constexpr int VPR = DPL == 2 ? 32 : (DPL == 4 ? 16 : 0);
#else
    constexpr int VPR = 0;
#endif
    auto load_first = [&](bool values) {
        const uint4* kr = (const uint4*)(kh + jr0 * stride);
#pragma unroll
        for (int c = 0; c < KB; c++) kpre[c] = __ldg(kr + c);
        if (VPR < 32 && values) {
#pragma unroll
            for (int c = 0; c < HD / 64; c++) prefetch_l1(vh + jr0 * stride + 64 * c);
        }
    };
#if ATT_VPRE
    // the lane's dims of the warp's value rows of the first tile (past the end: the last
    // row, weighted 0), those before the position (early) or at it
    VRaw<DPL> vpre[VPR > 0 ? VPR : 1];
    const int jv = s0 + 32 * warp;  // the warp's first key of the first tile
    auto load_values = [&](bool early_rows) {
        if constexpr (VPR > 0) {
            if (jv < s1) {
#pragma unroll
                for (int i = 0; i < VPR; i++) {
                    const int jr = min(jv + i, s1 - 1);
                    if ((jr < pos) == early_rows) vpre[i] = load_vraw<DPL>(vb + jr * stride);
                }
            }
        }
    };
#endif
    // rows before the position before the wait; the current position's rows are the Q/K/V
    // launch's: after it, but before the queries' barrier, so that their latencies overlap
    const bool early = ATT_PRELOAD && jf < s1 && jf < pos;
    if (early) load_first(true);
#if ATT_VPRE
    if (ATT_PRELOAD) load_values(true);
#endif
#if ATT_PRELOAD
    pdl_wait();
    pdl_trigger_at(1, pdl_at);
#endif
    if (!early) load_first(jf == pos);
#if ATT_VPRE
    if (!ATT_PRELOAD) load_values(true);
    load_values(false);
#endif
#if ATT_FAKE
    // a diagnostic bound (bench_synthetic --define ATT_FAKE=1): zeros out, no keys taken
    for (int e = t; e < G * HD; e += ATD_KEYS) out[(i64)ATT_H0 * HD + e] = 0.f;
    return;
#endif
    // the queries (written by the launch before); heads past G take the last head's query
    for (int e = t; e < GB * (HD / 4); e += ATD_KEYS) {
        const int g = e / (HD / 4), d4 = e - g * (HD / 4);
        const float4* qh = (const float4*)(q + (i64)(ATT_H0 + min(g, G - 1)) * HD);
        ((float4*)sq[g])[d4] = qh[d4];
    }
    __syncthreads();

    // Each warp's online softmax over its own keys (32 of each tile): its running maximum,
    // sums and outputs; the warps are merged at the end.
    float m[GB], l[GB], acc[GB][DPL];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.f;
    }
    for (int j0 = s0; j0 < s1; j0 += ATD_KEYS) {
        const int jw = j0 + 32 * warp;    // the warp's first key of the tile
        const int nk = min(32, s1 - jw);  // its keys there (warp-uniform; <= 0: none)
        if (nk <= 0) continue;
        // scores: this lane's key against the group's queries
        const bool valid = lane < nk;
        const uint4* kr = (const uint4*)(kh + (valid ? jw + lane : s1 - 1) * stride);
        float s[GB];
#pragma unroll
        for (int g = 0; g < GB; g++) s[g] = 0.f;
#pragma unroll
        for (int cb = 0; cb < KCH; cb += KB) {
            uint4 kw[KB];
#pragma unroll
            for (int c = 0; c < KB; c++) kw[c] = (cb == 0 && j0 == s0) ? kpre[c] : __ldg(kr + cb + c);
#pragma unroll
            for (int c = 0; c < KB; c++) {
                const u32 w4[4] = {kw[c].x, kw[c].y, kw[c].z, kw[c].w};
                float kf[8];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    kf[2 * e] = h2f((u16)(w4[e] & 0xFFFFu));
                    kf[2 * e + 1] = h2f((u16)(w4[e] >> 16));
                }
#pragma unroll
                for (int g = 0; g < GB; g++) {
                    const float4 qa = ((const float4*)sq[g])[2 * (cb + c)];
                    const float4 qb = ((const float4*)sq[g])[2 * (cb + c) + 1];
                    s[g] = fmaf(qa.x, kf[0], s[g]);
                    s[g] = fmaf(qa.y, kf[1], s[g]);
                    s[g] = fmaf(qa.z, kf[2], s[g]);
                    s[g] = fmaf(qa.w, kf[3], s[g]);
                    s[g] = fmaf(qb.x, kf[4], s[g]);
                    s[g] = fmaf(qb.y, kf[5], s[g]);
                    s[g] = fmaf(qb.z, kf[6], s[g]);
                    s[g] = fmaf(qb.w, kf[7], s[g]);
                }
            }
        }
        float tm[GB];
#pragma unroll
        for (int g = 0; g < GB; g++) {
            float a = s[g] * scale;
            if (softcap > 0.f) a = (float)((double)softcap * tanh((double)(a / softcap)));
            s[g] = valid ? a : NEG_INF;
            tm[g] = s[g];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int g = 0; g < GB; g++) tm[g] = fmaxf(tm[g], __shfl_xor_sync(0xffffffffu, tm[g], o));
        }
        // the warp's new maximum, this key's weights, the sums so far rescaled
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const float mx = fmaxf(m[g], tm[g]);
            const float corr = expf(m[g] - mx);  // 0 for the warp's first keys (m = -inf)
            m[g] = mx;
            sp[g][t] = valid ? expf(s[g] - mx) : 0.f;
            l[g] *= corr;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= corr;
        }
        __syncwarp();
        // values: the warp's keys, 8 rows in flight at a time
#pragma unroll
        for (int i0 = 0; i0 < 32; i0 += 8) {
            if (i0 < nk) {
                float vf[8][DPL];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int jr = jw + min(i0 + u, nk - 1);
#if ATT_VPRE
                    if (i0 + u < VPR && j0 == s0) {
                        halves<DPL>(vpre[i0 + u], vf[u]);
                        continue;
                    }
#endif
                    load_halves<DPL>(vb + jr * stride, vf[u]);
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    if (i0 + u < nk) {
#pragma unroll
                        for (int g = 0; g < GB; g++) {
                            const float p = sp[g][32 * warp + i0 + u];
                            l[g] += p;
#pragma unroll
                            for (int i = 0; i < DPL; i++) acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
                        }
                    }
                }
            }
        }
        __syncwarp();  // the warp's next tile writes its weights
    }
    pdl_trigger_at(2, pdl_at);

    // merge the warps' states
#pragma unroll
    for (int g = 0; g < GB; g++) {
        if (lane == 0) {
            sm[warp][g] = m[g];
            sl[warp][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < DPL; i++) sacc[warp][g][lane * DPL + i] = acc[g][i];
    }
    __syncthreads();
    float* part_ml = part + (i64)gridDim.x * n_splits * G * HD;
    for (int e = threadIdx.x; e < G * HD; e += blockDim.x) {
        const int g = e / HD, d = e % HD;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATD_WARPS; w++) mx = fmaxf(mx, sm[w][g]);
        float total = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < ATD_WARPS; w++) {
            float wt = sm[w][g] > NEG_INF ? expf(sm[w][g] - mx) : 0.f;
            total = fmaf(sl[w][g], wt, total);
            o = fmaf(sacc[w][g][d], wt, o);
        }
        if (n_splits == 1) {
            out[(i64)(ATT_H0 + g) * HD + d] = o / total;
        } else {
            const i64 row = (i64)(kvh * n_splits + split) * G + g;
            part[row * HD + d] = o;
            if (d == 0) {
                part_ml[2 * row] = mx;
                part_ml[2 * row + 1] = total;
            }
        }
    }
    if (n_splits == 1) return;

    // the last block of this KV head merges the splits
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counter + kvh, 1) == n_splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // Each thread takes 4 dims of a head and loads, 16 splits at a time, their maxima, sums
    // and outputs at once (one round trip for up to 16 splits), merging batches online.
    const int hd4 = HD / 4;
    for (int e = threadIdx.x; e < G * hd4; e += blockDim.x) {
        const int g = e / hd4, d4 = e - g * hd4;
        float mx = NEG_INF, total = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int sb = 0; sb < n_splits; sb += 16) {
            float ms[16], ls[16];
            float4 os[16];
#pragma unroll
            for (int u = 0; u < 16; u++) {
                const i64 row = (i64)(kvh * n_splits + min(sb + u, n_splits - 1)) * G + g;
                ms[u] = __ldcg(part_ml + 2 * row);  // finite: every split has keys
                ls[u] = __ldcg(part_ml + 2 * row + 1);
                os[u] = __ldcg((const float4*)(part + row * HD) + d4);
            }
            float mb = mx;
#pragma unroll
            for (int u = 0; u < 16; u++) {
                if (sb + u < n_splits) mb = fmaxf(mb, ms[u]);
            }
            const float corr = expf(mx - mb);  // 0 for the first batch (mx = -inf)
            total *= corr;
            o.x *= corr;
            o.y *= corr;
            o.z *= corr;
            o.w *= corr;
#pragma unroll
            for (int u = 0; u < 16; u++) {
                if (sb + u < n_splits) {
                    const float w = expf(ms[u] - mb);
                    total = fmaf(ls[u], w, total);
                    o.x = fmaf(os[u].x, w, o.x);
                    o.y = fmaf(os[u].y, w, o.y);
                    o.z = fmaf(os[u].z, w, o.z);
                    o.w = fmaf(os[u].w, w, o.w);
                }
            }
            mx = mb;
        }
        float4 r = make_float4(o.x / total, o.y / total, o.z / total, o.w / total);
        *((float4*)(out + (i64)(ATT_H0 + g) * HD) + d4) = r;
    }
    if (threadIdx.x == 0) counter[kvh] = 0;  // ready for the next launch (graph replays)
#undef ATT_H0
}

#if ATT_HEADS
#define ATD_BY_HEAD(DPL, GB)                                                               \
    if (GB > 1 && DPL <= 4)                                                                \
        attention_gqa_body<DPL, 1, true>(q + z * row, kcs[z], vcs[z], starts + z, n_heads, \
                                         n_kv_heads, scale, window, softcap, min_keys,     \
                                         out + z * row, part + z * part_row,               \
                                         counter + z * n_kv_heads, pdl_at);
#else
#define ATD_BY_HEAD(DPL, GB)
#endif

// attention_gqa_<DPL>_<GB>: head_dim 32 * DPL (64, 128, 256), groups of at most GB heads,
// one token of each of gridDim.z sequences (1 for a lone sequence's decode): row z of
// q and out, its cache at kcs[z] / vcs[z], its position starts[z], its own split partials
// and counters (so each row gets exactly what it gets alone)
#define ATD_KERNELS(DPL, GB)                                                              \
    extern "C" __global__ void __launch_bounds__(ATD_WARPS * 32)                           \
        attention_gqa_##DPL##_##GB(                                                        \
            const float *__restrict__ q, const u16 *const *__restrict__ kcs,                \
            const u16 *const *__restrict__ vcs, const int *__restrict__ starts, int n_heads, \
            int n_kv_heads, float scale, int window, float softcap, int min_keys,           \
            float *__restrict__ out, float *__restrict__ part, int *__restrict__ counter,   \
            int pdl_at) {                                                                  \
        const int z = blockIdx.z;                                                          \
        const i64 row = (i64)n_heads * 32 * DPL;                                           \
        const i64 part_row = (i64)gridDim.x * gridDim.y * (n_heads / n_kv_heads) *         \
                             (32 * DPL + 2);                                               \
        attention_gqa_body<DPL, GB>(q + z * row, kcs[z], vcs[z], starts + z, n_heads,      \
                                    n_kv_heads, scale, window, softcap, min_keys,          \
                                    out + z * row, part + z * part_row,                    \
                                    counter + z * n_kv_heads, pdl_at);                     \
        ATD_BY_HEAD(DPL, GB)                                                               \
    }
// groups of 3 and 6 heads (SmolLM2-135M, Qwen2.5-1.5B) get their own: every head a thread
// scores costs its dot, so rounding a group up to 4 or 8 would waste a quarter of them
ATD_KERNELS(2, 1)
ATD_KERNELS(2, 2)
ATD_KERNELS(2, 3)
ATD_KERNELS(2, 4)
ATD_KERNELS(2, 6)
ATD_KERNELS(2, 8)
ATD_KERNELS(4, 1)
ATD_KERNELS(4, 2)
ATD_KERNELS(4, 3)
ATD_KERNELS(4, 4)
ATD_KERNELS(4, 6)
ATD_KERNELS(4, 8)
ATD_KERNELS(8, 1)
ATD_KERNELS(8, 2)
ATD_KERNELS(8, 3)
ATD_KERNELS(8, 4)
ATD_KERNELS(8, 6)
ATD_KERNELS(8, 8)

// ---------------------------------------------------------------------------- elementwise

// out = a + b and out = a * b, b repeating every nb elements (a row-broadcast vector)
extern "C" __global__ void add(const float* __restrict__ a, const float* __restrict__ b,
                               float* __restrict__ out, i64 n, i64 nb) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fadd_rn(a[i], b[nb == n ? i : i % nb]);
}

extern "C" __global__ void mul(const float* __restrict__ a, const float* __restrict__ b,
                               float* __restrict__ out, i64 n, i64 nb) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fmul_rn(a[i], b[nb == n ? i : i % nb]);
}

extern "C" __global__ void scale(const float* __restrict__ x, float s, float* __restrict__ out,
                                 i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fmul_rn(x[i], s);
}

// silu(g) * u and gelu(g) * u (common.cuh: the float32 steps of the CPU backend and ggml)
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu_mul1(g[i], u[i]);
}

extern "C" __global__ void gelu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_mul1(g[i], u[i]);
}

// cap * tanh(x / cap)
extern "C" __global__ void softcap(const float* __restrict__ x, float cap,
                                   float* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fmul_rn((float)tanh((double)__fdiv_rn(x[i], cap)), cap);
}

// out[i, :] = x[rows[i], :] for rows of d floats
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ rows,
                                       float* __restrict__ out, int n, int d) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (i64)n * d) {
        int i = (int)(idx / d), j = (int)(idx % d);
        out[idx] = x[(i64)rows[i] * d + j];
    }
}

// ------------------------------------------------------------------------------ sampling

// The k largest of each row of x (rows, n_vocab), largest first, equal logits by lower id first
// (the host's top_logits), NaN below every number, -0.0 as 0.0. Each logit becomes a 64-bit
// key, its float order in the high half and the inverted id in the low half, so that one
// unsigned comparison orders (logit descending, id ascending) and every key is distinct. A
// level sorts chunks of up to TOPK_CHUNK keys of a row in shared memory (bitonic, one block
// per chunk) and keeps each chunk's k largest; the host runs levels until one chunk is left
// (a 49k vocabulary: 12 chunks, then one of 1536 keys), whose k largest are written as
// (id, logit bits) pairs. The sampler reads back these k pairs instead of the row. A block's
// 1024 threads compare 2048 pairs a stage: TOPK_CHUNK is 4096.
#define TOPK_THREADS 1024
#define TOPK_CHUNK 4096
typedef unsigned long long u64;

__device__ __forceinline__ u64 topk_key(float v, int id) {
    unsigned int o = 0u;  // NaN: below every number
    if (v == v) {
        if (v == 0.0f) v = 0.0f;
        const unsigned int u = __float_as_uint(v);
        o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((u64)o << 32) | (u64)(0xFFFFFFFFu - (unsigned int)id);
}

// One chunk: keys of x (first level: logits; later: the last level's keys), padded with 0
// (below every key), sorted descending; its k largest to keys_out, or (final, one chunk) as
// pairs of the ids and the logits' bits.
__device__ __forceinline__ void topk_chunk(u64* s, int count, int k, int final,
                                           u64* __restrict__ keys_out,
                                           const float* __restrict__ xrow,
                                           int* __restrict__ pairs) {
    int size = 2;
    while (size < count) size <<= 1;
    for (int i = count + threadIdx.x; i < size; i += blockDim.x) s[i] = 0ull;
    // warp w compares pairs 64 w .. 64 w + 63, which for strides up to 64 lie in its own
    // 128 keys: those stages wait for the warp alone, the others for the block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bool was_local = false;
    for (int span = 2; span <= size; span <<= 1) {
        for (int stride = span >> 1; stride > 0; stride >>= 1) {
            const bool local = stride <= 64;
            if (local && was_local) {
                __syncwarp();
            } else {
                __syncthreads();
            }
            was_local = local;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int t = warp * 64 + h * 32 + lane;
                if (t < size / 2) {
                    const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                    const bool desc = (i & span) == 0;
                    const u64 a = s[i], b = s[j];
                    if ((a < b) == desc) {
                        s[i] = b;
                        s[j] = a;
                    }
                }
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        if (final) {
            const int id = (int)(0xFFFFFFFFu - (unsigned int)(s[i] & 0xFFFFFFFFull));
            pairs[2 * i] = id;
            pairs[2 * i + 1] = __float_as_int(xrow[id]);
        } else {
            keys_out[i] = s[i];
        }
    }
}

// First level: block (c, r) takes logits c * TOPK_CHUNK .. of row r.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    top_k_logits(const float* __restrict__ x, int n, int k, int final, u64* __restrict__ keys_out,
                 int* __restrict__ pairs) {
    __shared__ u64 s[TOPK_CHUNK];
    const int c = blockIdx.x, r = blockIdx.y;
    const float* xrow = x + (i64)r * n;
    const int at = c * TOPK_CHUNK, count = min(TOPK_CHUNK, n - at);
    for (int i = threadIdx.x; i < count; i += blockDim.x) s[i] = topk_key(xrow[at + i], at + i);
    topk_chunk(s, count, k, final, keys_out + ((i64)r * gridDim.x + c) * k, xrow,
               pairs + (i64)r * k * 2);
}

// Later levels: block (c, r) takes keys c * TOPK_CHUNK .. of the m keys of row r.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    top_k_keys(const u64* __restrict__ keys_in, int m, int k, int final,
               u64* __restrict__ keys_out, const float* __restrict__ x, int n,
               int* __restrict__ pairs) {
    __shared__ u64 s[TOPK_CHUNK];
    const int c = blockIdx.x, r = blockIdx.y;
    const u64* in = keys_in + (i64)r * m;
    const int at = c * TOPK_CHUNK, count = min(TOPK_CHUNK, m - at);
    for (int i = threadIdx.x; i < count; i += blockDim.x) s[i] = in[at + i];
    topk_chunk(s, count, k, final, keys_out + ((i64)r * gridDim.x + c) * k, x + (i64)r * n,
               pairs + (i64)r * k * 2);
}

// ---------------------------------------------------------------------------- fp16 GEMM input

// *amax = max |x| over n values, as the bits of a non-negative float (the caller zeroes it;
// non-negative floats order as their bits, so an integer atomicMax takes the float maximum).
extern "C" __global__ void absmax(const float* __restrict__ x, i64 n, u32* __restrict__ amax) {
    float m = 0.f;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        m = fmaxf(m, fabsf(x[i]));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) atomicMax(amax, __float_as_uint(m));
}

// xh = x / s in fp16, s = 2^e the smallest power of two with max|x| / s < 2^15 (s = 1 below
// 2^15), so that no value overflows fp16's 65504; dividing by a power of two is exact. Then
// ab = {s, 0}: cuBLAS's alpha and beta, read from the device, so the product of the scaled
// values is scaled back without the host knowing s.
extern "C" __global__ void to_half_scaled(const float* __restrict__ x, i64 n,
                                          const u32* __restrict__ amax, u16* __restrict__ xh,
                                          float* __restrict__ ab) {
    int e = (int)((*amax >> 23) & 0xFFu) - 127;  // floor(log2 max|x|); 128 for inf or NaN
    int s = e >= 15 ? e - 14 : 0;                // max|x| < 2^(e + 1) = 2^(s + 15)
    float inv = __uint_as_float((u32)(127 - s) << 23);
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) xh[i] = f2h(__fmul_rn(x[i], inv));
    if (i == 0) {
        ab[0] = __uint_as_float((u32)(127 + s) << 23);
        ab[1] = 0.f;
    }
}
