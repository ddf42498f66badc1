// The OpenCL backend's non-matmul ops: RMS norm, RoPE, KV cache writes, attention, gated
// activations and elementwise arithmetic. Activations are C-contiguous float32; the KV
// cache is F16, written with vstore_half_rte and read with vload_half (core OpenCL 1.2).
// Every array argument comes with its offset in elements (the model slices activations by
// rows, and a slice is a view into its parent's buffer).
//
// Where the CPU reference (picollama/backends/cpu/ops.py) fixes an order of float32
// operations, these kernels repeat it (FP_CONTRACT is off, see common.cl), and compute
// divisions, square roots, exp, tanh, cos and sin through double where the device has it
// (USE_FP64), so the two backends agree to the last bit or two.

#define RED_WG 64     // work-items of the row reductions (rms_norm)
#define ATT_WG 64     // work-items of an attention work-group: keys per tile
#define ATT_MAXD 256  // head_dim and head_dim_v at most this
#define ATT_DPW (ATT_MAXD / ATT_WG)  // output dims per work-item

// ------------------------------------------------------------------------------- RMS norm

// One work-group per row of d values: out = (x * (1 / sqrt(mean(x^2) + eps))) * w (w
// optional). Squares are float32, as the CPU's; their sum is double where the device has
// it (as ggml's CPU code), float32 otherwise.
__kernel __attribute__((reqd_work_group_size(RED_WG, 1, 1)))
void rms_norm(__global const float* x, int x_off, __global const float* w, int has_w,
              __global float* out, int d, float eps) {
    __local wide_t part[RED_WG];
    int lid = get_local_id(0);
    __global const float* xr = x + x_off + (i64)get_group_id(0) * d;
    __global float* orow = out + (i64)get_group_id(0) * d;
    wide_t acc = 0;
    for (int j = lid; j < d; j += RED_WG) {
        float v = xr[j];
        acc += (wide_t)(v * v);
    }
    part[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = RED_WG / 2; o > 0; o >>= 1) {
        if (lid < o) part[lid] += part[lid + o];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float mean = (float)(part[0] / (wide_t)d);
    float scale = F_DIV(1.0f, F_SQRT(mean + eps));
    for (int j = lid; j < d; j += RED_WG) {
        float v = xr[j] * scale;
        orow[j] = has_w ? v * w[j] : v;
    }
}

// ----------------------------------------------------------------------------------- RoPE

// x and out are (n, n_heads, head_dim). Work-item (t, h, i): for i < n_rot / 2 it turns
// pair i of head h of token t by pos * freq_scale * theta_scale^i, the power taken as ggml
// does (a float32 running product); pairs are (2i, 2i+1), or (i, i + n_rot/2) for NeoX.
// Work-items i >= n_rot / 2 copy one of the unrotated dims n_rot .. head_dim - 1.
// Positions are pos[t], or pos0 + t when pos is not given (one contiguous segment).
__kernel void rope(__global const float* x, int x_off, __global const int* pos, int pos0,
                   int use_pos, __global float* out, int n, int n_heads, int head_dim,
                   int n_rot, float theta_scale, float freq_scale, int neox) {
    int half_rot = n_rot / 2;
    int per_head = half_rot + head_dim - n_rot;
    i64 idx = get_global_id(0);
    if (idx >= (i64)n * n_heads * per_head) return;
    int i = (int)(idx % per_head);
    i64 head = idx / per_head;  // t * n_heads + h
    int t = (int)(head / n_heads);
    __global const float* xh = x + x_off + head * head_dim;
    __global float* oh = out + head * head_dim;
    if (i >= half_rot) {
        int j = n_rot + i - half_rot;
        oh[j] = xh[j];
        return;
    }
    int a = neox ? i : 2 * i;
    int b = neox ? i + half_rot : 2 * i + 1;
    float theta = (float)(use_pos ? pos[t] : pos0 + t);
    for (int s = 0; s < i; s++) theta = theta * theta_scale;
    float angle = freq_scale * theta;
    float c = F_COS(angle), sn = F_SIN(angle);
    float x0 = xh[a], x1 = xh[b];
    oh[a] = x0 * c - x1 * sn;
    oh[b] = x0 * sn + x1 * c;
}

// ------------------------------------------------------------------------------- KV cache

// Rows start .. start + n - 1 of the F16 caches get k (n, kdim) and v (n, vdim), rounded to
// nearest even (the host checks that they fit).
__kernel void store_kv(__global const float* k, int k_off, __global const float* v, int v_off,
                       __global half* kc, __global half* vc, int start, int n, int kdim,
                       int vdim) {
    i64 idx = get_global_id(0);
    i64 nk = (i64)n * kdim, nv = (i64)n * vdim;
    if (idx < nk) {
        vstore_half_rte(k[k_off + idx], (i64)start * kdim + idx, kc);
    } else if (idx < nk + nv) {
        vstore_half_rte(v[v_off + idx - nk], (i64)start * vdim + idx - nk, vc);
    }
}

// ------------------------------------------------------------------------------ attention

// Flash-attention style: no score matrix. Work-group (h, t, split) handles query head h of
// token t (position start + t) against the keys of its split of the causal (and sliding
// window) range, in tiles of ATT_WG keys: work-item j scores key j0 + j (its dot product a
// float32 chain over head_dim in order, as the CPU's), the tile's maximum updates the
// online-softmax state, and each work-item accumulates its output dims (lid + ATT_WG * i)
// over the tile's weighted values. With one split the work-group writes the normalized
// output (n, n_heads * hdv); with several it writes (max, sum, unnormalized output) to
// `part` for attn_combine. `scale` comes divided by softcap when softcap > 0, as in ggml:
// s = softcap * tanh(dot * scale / softcap).
__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention(__global const float* q, int q_off, __global const half* kc,
               __global const half* vc, int start, int n_heads, int n_kv_heads, int hd,
               int hdv, float scale, int window, float softcap, int chunk,
               __global float* out, __global float* part) {
    __local float sq[ATT_MAXD];
    __local float sp[ATT_WG];
    int h = get_group_id(0), t = get_group_id(1), split = get_group_id(2);
    int n_splits = get_num_groups(2);
    int lid = get_local_id(0);
    int pos = start + t;
    int lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    int s0 = lo + split * chunk;
    int s1 = min(pos + 1, s0 + chunk);  // causal: keys at positions <= pos
    int kvh = h / (n_heads / n_kv_heads);
    __global const float* qh = q + q_off + ((i64)t * n_heads + h) * hd;
    for (int d = lid; d < hd; d += ATT_WG) sq[d] = qh[d];
    barrier(CLK_LOCAL_MEM_FENCE);

    float m = NEG_INF, l = 0.0f;
    float acc[ATT_DPW];
    for (int i = 0; i < ATT_DPW; i++) acc[i] = 0.0f;
    i64 kstride = (i64)n_kv_heads * hd, vstride = (i64)n_kv_heads * hdv;
    for (int j0 = s0; j0 < s1; j0 += ATT_WG) {
        int j = j0 + lid;
        int count = min(ATT_WG, s1 - j0);
        float s = NEG_INF;
        if (j < s1) {
            __global const half* kr = kc + j * kstride + (i64)kvh * hd;
            float dot = 0.0f;
            if ((hd & 7) == 0) {
                for (int d = 0; d < hd; d += 8) {
                    float8 kv = vload_half8(0, kr + d);
                    dot = MAD(kv.s0, sq[d + 0], dot);
                    dot = MAD(kv.s1, sq[d + 1], dot);
                    dot = MAD(kv.s2, sq[d + 2], dot);
                    dot = MAD(kv.s3, sq[d + 3], dot);
                    dot = MAD(kv.s4, sq[d + 4], dot);
                    dot = MAD(kv.s5, sq[d + 5], dot);
                    dot = MAD(kv.s6, sq[d + 6], dot);
                    dot = MAD(kv.s7, sq[d + 7], dot);
                }
            } else {
                for (int d = 0; d < hd; d++) dot = MAD(vload_half(d, kr), sq[d], dot);
            }
            s = dot * scale;
            if (softcap > 0.0f) s = F_TANH(s) * softcap;
        }
        sp[lid] = s;
        barrier(CLK_LOCAL_MEM_FENCE);
        float tile_max = NEG_INF;
        for (int jj = 0; jj < count; jj++) tile_max = fmax(tile_max, sp[jj]);
        float m_new = fmax(m, tile_max);  // finite: key j0 is in range
        float corr = exp(m - m_new);      // 0 on the first tile (m = -inf)
        barrier(CLK_LOCAL_MEM_FENCE);     // every work-item has read the scores
        if (lid < count) sp[lid] = exp(s - m_new);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = 0; i < ATT_DPW; i++) acc[i] *= corr;
        float psum = 0.0f;
        for (int jj = 0; jj < count; jj++) {
            float p = sp[jj];
            psum += p;
            __global const half* vr = vc + (j0 + jj) * vstride + (i64)kvh * hdv;
            for (int i = 0; i < ATT_DPW; i++) {
                int d = lid + ATT_WG * i;
                if (d < hdv) acc[i] = MAD(p, vload_half(d, vr), acc[i]);
            }
        }
        l = l * corr + psum;
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);  // before the next tile's scores overwrite sp
    }
    i64 head = (i64)t * n_heads + h;
    if (n_splits == 1) {
        for (int i = 0; i < ATT_DPW; i++) {
            int d = lid + ATT_WG * i;
            if (d < hdv) out[head * hdv + d] = acc[i] / l;
        }
    } else {
        __global float* pp = part + (head * n_splits + split) * (hdv + 2);
        for (int i = 0; i < ATT_DPW; i++) {
            int d = lid + ATT_WG * i;
            if (d < hdv) pp[2 + d] = acc[i];
        }
        if (lid == 0) {
            pp[0] = m;
            pp[1] = l;  // 0 for an empty split
        }
    }
}

// Merge the splits' (max, sum, unnormalized output) of each (head, token) into out.
__kernel void attn_combine(__global const float* part, __global float* out, int n_heads,
                           int hdv, int n_splits) {
    int h = get_group_id(0), t = get_group_id(1);
    i64 head = (i64)t * n_heads + h;
    __global const float* pp = part + head * n_splits * (hdv + 2);
    float mx = NEG_INF;
    for (int s = 0; s < n_splits; s++) {
        if (pp[s * (hdv + 2) + 1] > 0.0f) mx = fmax(mx, pp[s * (hdv + 2)]);
    }
    float total = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        __global const float* ps = pp + s * (hdv + 2);
        if (ps[1] > 0.0f) total += ps[1] * exp(ps[0] - mx);
    }
    for (int d = get_local_id(0); d < hdv; d += get_local_size(0)) {
        float o = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            __global const float* ps = pp + s * (hdv + 2);
            if (ps[1] > 0.0f) o += ps[2 + d] * exp(ps[0] - mx);
        }
        out[head * hdv + d] = o / total;
    }
}

// ---------------------------------------------------------------------------- elementwise

// out = a + b and out = a * b, b repeating every nb elements (a row-broadcast vector)
__kernel void add(__global const float* a, int a_off, __global const float* b, int b_off,
                  __global float* out, i64 n, i64 nb) {
    i64 i = get_global_id(0);
    if (i < n) out[i] = a[a_off + i] + b[b_off + (nb == n ? i : i % nb)];
}

__kernel void mul(__global const float* a, int a_off, __global const float* b, int b_off,
                  __global float* out, i64 n, i64 nb) {
    i64 i = get_global_id(0);
    if (i < n) out[i] = a[a_off + i] * b[b_off + (nb == n ? i : i % nb)];
}

__kernel void scale(__global const float* x, int x_off, float s, __global float* out, i64 n) {
    i64 i = get_global_id(0);
    if (i < n) out[i] = x[x_off + i] * s;
}

// silu(g) * u = g / (1 + exp(-g)) * u, in the CPU's order of float32 operations
__kernel void silu_mul(__global const float* g, int g_off, __global const float* u, int u_off,
                       __global float* out, i64 n) {
    i64 i = get_global_id(0);
    if (i < n) {
        float x = g[g_off + i];
        float e = F_EXP(-x);
        out[i] = F_DIV(x, 1.0f + e) * u[u_off + i];
    }
}

// gelu(g) * u with ggml's tanh approximation, in the CPU's order of float32 operations
__kernel void gelu_mul(__global const float* g, int g_off, __global const float* u, int u_off,
                       __global float* out, i64 n) {
    i64 i = get_global_id(0);
    if (i < n) {
        const float coef_a = 0.044715f;
        const float sqrt_2_over_pi = 0.79788456080286535587989211986876f;
        float x = g[g_off + i];
        float inner = sqrt_2_over_pi * x * (1.0f + coef_a * x * x);
        out[i] = 0.5f * x * (1.0f + F_TANH(inner)) * u[u_off + i];
    }
}

// cap * tanh(x / cap)
__kernel void softcap(__global const float* x, int x_off, float cap, __global float* out,
                      i64 n) {
    i64 i = get_global_id(0);
    if (i < n) out[i] = F_TANH(F_DIV(x[x_off + i], cap)) * cap;
}

// out[i, :] = x[rows[i], :] for rows of d floats
__kernel void gather_rows(__global const float* x, int x_off, __global const int* rows,
                          __global float* out, int n, int d) {
    i64 idx = get_global_id(0);
    if (idx < (i64)n * d) {
        int i = (int)(idx / d), j = (int)(idx % d);
        out[idx] = x[x_off + (i64)rows[i] * d + j];
    }
}
