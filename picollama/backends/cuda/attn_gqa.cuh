// Decode attention by KV head (attention_gqa_body), included by ops.cu's module and by the
// int8 matvec modules (mmvq.cu: attention fused with the attn_output matvec).

#ifndef NEG_INF
#define NEG_INF __int_as_float(0xff800000u)
#endif

// ------------------------------------------------------------------ decode attention, GQA
//
// One token, one block per (KV head, split). The block does the whole group of
// G = n_heads / n_kv_heads query heads, so each key and value row is read once for the
// group. Lanes run across head_dim (lane holds dims DPL * lane .. DPL * lane + DPL - 1, so a
// row is one coalesced load of 2 * HD bytes); the block's 4 warps take keys in turn, two at a
// time so that four rows are in flight per warp. The valid range [lo, pos] (pos read from the
// device: a captured graph replays at any position) is cut into equal parts of at least
// min_keys keys, at most max_splits of them (ops.cu's kernels: gridDim.y; the blocks of
// unused splits return at once).
// With one split the block
// writes the normalized output; with several each block writes (max, sum, unnormalized
// output) per head to `part`, and the last block of its KV head to finish (a counter per KV
// head, which that block resets to 0) merges them into out: no second launch.

#define ATD_WARPS 4

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

// Two keys (scores of the GB heads, one online softmax update for both, weighted values)
// for one warp; the second only with `two`. Heads past G (GB > G) compute on a copy of the
// last head's query and are never written: no branch splits the shuffle chains of the heads,
// so that the compiler interleaves them.
template <int DPL, int GB>
__device__ __forceinline__ void gqa_key2(const float (&qr)[GB][DPL], const float* k1,
                                         const float* v1, const float* k2, const float* v2,
                                         bool two, float scale, float softcap, float (&m)[GB],
                                         float (&l)[GB], float (&acc)[GB][DPL]) {
    float s1[GB], s2[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        float d1 = 0.f, d2 = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            d1 = fmaf(qr[g][i], k1[i], d1);
            d2 = fmaf(qr[g][i], k2[i], d2);
        }
        s1[g] = d1;
        s2[g] = d2;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int g = 0; g < GB; g++) {
            s1[g] += __shfl_xor_sync(0xffffffffu, s1[g], o);
            s2[g] += __shfl_xor_sync(0xffffffffu, s2[g], o);
        }
    }
#pragma unroll
    for (int g = 0; g < GB; g++) {
        float a = s1[g] * scale, b = s2[g] * scale;
        if (softcap > 0.f) {
            a = (float)((double)softcap * tanh((double)(a / softcap)));
            b = (float)((double)softcap * tanh((double)(b / softcap)));
        }
        const float m_new = fmaxf(m[g], two ? fmaxf(a, b) : a);
        const float corr = expf(m[g] - m_new);  // 0 for the first key (m = -inf)
        const float p1 = expf(a - m_new);
        const float p2 = two ? expf(b - m_new) : 0.f;
        l[g] = fmaf(l[g], corr, p1) + p2;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            acc[g][i] = fmaf(p2, v2[i], fmaf(p1, v1[i], acc[g][i] * corr));
        }
        m[g] = m_new;
    }
}

// Split partials: out (n_kv, n_splits, G, HD) unnormalized outputs, then (n_kv, n_splits, G)
// pairs (max, sum), all in `part` (n_kv * n_splits * G * (HD + 2) floats).
template <int DPL, int GB>
__device__ __forceinline__ void attention_gqa_body(
    const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int* __restrict__ start_ptr, int n_heads, int n_kv_heads, float scale, int window,
    float softcap, int min_keys, float* __restrict__ out, float* __restrict__ part,
    int* __restrict__ counter, int pdl_at, int max_splits) {
    constexpr int HD = 32 * DPL;
    __shared__ float sm[ATD_WARPS][GB], sl[ATD_WARPS][GB];
    __shared__ float sacc[ATD_WARPS][GB][HD];
    __shared__ int s_last;
    pdl_trigger_at(0, pdl_at);
    pdl_wait();
    pdl_trigger_at(1, pdl_at);
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = n_heads / n_kv_heads;  // at most GB (the host checks)
    // the queries' loads go out with the position's (they don't depend on it)
    float qr[GB][DPL], acc[GB][DPL], m[GB], l[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
        const float* qh = q + (i64)(kvh * G + min(g, G - 1)) * HD + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            qr[g][i] = qh[i];
            acc[g][i] = 0.f;
        }
    }
    const int pos = *start_ptr;
    const int lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    const int len = pos + 1 - lo;
    // only as many splits as the range needs (min_keys each): short ranges skip the merge
    const int n_splits = max(1, min(max_splits, len / min_keys));
    if (split >= n_splits) return;
    const int s0 = lo + (int)((i64)len * split / n_splits);
    const int s1 = lo + (int)((i64)len * (split + 1) / n_splits);

    const i64 stride = (i64)n_kv_heads * HD;
    const u16* kb = kc + (i64)kvh * HD + lane * DPL;
    const u16* vb = vc + (i64)kvh * HD + lane * DPL;
    // KPI keys per warp at a time (their rows' loads in flight together), in pairs; keys past
    // the end read the last row in range and count for nothing
    constexpr int KPI = DPL * GB <= 16 ? 4 : 2;
    for (int j = s0 + warp; j < s1; j += KPI * ATD_WARPS) {
        float kf[KPI][DPL], vf[KPI][DPL];
#pragma unroll
        for (int u = 0; u < KPI; u++) {
            const int jr = min(j + u * ATD_WARPS, s1 - 1);
            load_halves<DPL>(kb + jr * stride, kf[u]);
            load_halves<DPL>(vb + jr * stride, vf[u]);
        }
#pragma unroll
        for (int u = 0; u < KPI; u += 2) {
            if (j + u * ATD_WARPS < s1) {
                gqa_key2<DPL, GB>(qr, kf[u], vf[u], kf[u + 1], vf[u + 1],
                                  j + (u + 1) * ATD_WARPS < s1, scale, softcap, m, l, acc);
            }
        }
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
            out[(i64)(kvh * G + g) * HD + d] = o / total;
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
        *((float4*)(out + (i64)(kvh * G + g) * HD) + d4) = r;
    }
    if (threadIdx.x == 0) counter[kvh] = 0;  // ready for the next launch (graph replays)
}

