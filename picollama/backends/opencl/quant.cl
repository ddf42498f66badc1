// Quantized matrix products and row lookup for one ggml type.
//
// The program is built once per type: layout.py prepends `#define QTYPE_<NAME>`, the type's
// field sizes (LAYOUT_SZ0..3), its block length and the kernel shape (MV_*, GEMM_*), and
// common.cl. Each type has one function, `deq32`, which decodes 32 consecutive weights (a
// "chunk") of a block into four float8, with ggml's float32 operations in ggml's order
// (FP_CONTRACT is off), so its results equal ggml's dequantize_row_* (and so
// picollama.quant) bit for bit. The three kernels are written once over it:
// - matvec: y = x W^T for up to MV_MAX_TOKENS rows of x (decode, short batches);
// - gemm: the same for any number of rows, through tiles in local memory (prefill);
// - get_rows: dequantized rows of an embedding table.
//
// Device layout ("field-major", shared with the CUDA backend; see cuda/layout.py): field f
// of every block is stored contiguously (field f of block b at region_f + b * SZf), each
// region starting on a 256-byte boundary, so fields are read with aligned vector loads.

#define NCHUNK (LAYOUT_BLOCK / 32)  // chunks of 32 weights per block

#define FIELD_ARGS __global const u8 *p0, __global const u8 *p1, __global const u8 *p2, \
                   __global const u8 *p3
#define FIELDS p0, p1, p2, p3

#define LD4(p) vload4(0, (__global const u32*)(p))  // 16 bytes, 4-byte aligned

// the field sizes layout.py passes in must be the ones the decoder below reads
#define CHECK_LAYOUT(block, s0, s1, s2, s3)                                              \
    (LAYOUT_BLOCK == (block) && LAYOUT_SZ0 == (s0) && LAYOUT_SZ1 == (s1) &&              \
     LAYOUT_SZ2 == (s2) && LAYOUT_SZ3 == (s3))

#if defined(QTYPE_IQ4_NL) || defined(QTYPE_IQ4_XS)
__constant float KVALUES_IQ4NL[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                      1.f,    13.f,   25.f,  38.f,  53.f,  69.f,  89.f,  113.f};

// 16 bytes of 4-bit codes: w[l] = table[low nibble of byte l], w[16 + l] = table[high one]
inline void iq4_codes(uint4 v, float d, float8* w) {
    u32 words[4] = {v.x, v.y, v.z, v.w};
    float t[32];
    for (int l = 0; l < 16; l++) {
        u32 byte = (words[l >> 2] >> (8 * (l & 3))) & 0xFFu;
        t[l] = KVALUES_IQ4NL[byte & 0xFu];
        t[l + 16] = KVALUES_IQ4NL[byte >> 4];
    }
    for (int i = 0; i < 4; i++) w[i] = d * vload8(i, t);
}
#endif

// ---------------------------------------------------------------- float types (32 per chunk)

#if defined(QTYPE_F32)
#if !CHECK_LAYOUT(32, 128, 0, 0, 0)
#error "quant.cl and layout.py disagree on F32"
#endif
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    __global const float* p = (__global const float*)(p0 + 128 * b);
    for (int i = 0; i < 4; i++) w[i] = vload8(i, p);
}

#elif defined(QTYPE_F16)
#if !CHECK_LAYOUT(32, 64, 0, 0, 0)
#error "quant.cl and layout.py disagree on F16"
#endif
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    __global const half* p = (__global const half*)(p0 + 64 * b);
    for (int i = 0; i < 4; i++) w[i] = vload_half8(i, p);
}

#elif defined(QTYPE_BF16)
#if !CHECK_LAYOUT(32, 64, 0, 0, 0)
#error "quant.cl and layout.py disagree on BF16"
#endif
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    __global const u16* p = (__global const u16*)(p0 + 64 * b);
    for (int i = 0; i < 4; i++) w[i] = as_float8(convert_uint8(vload8(i, p)) << 16);
}

// ------------------------------------------------------------------- legacy 32-weight blocks

#elif defined(QTYPE_Q4_0) || defined(QTYPE_IQ4_NL)
#if !CHECK_LAYOUT(32, 2, 16, 0, 0)
#error "quant.cl and layout.py disagree on Q4_0 / IQ4_NL"
#endif
// d | qs[16]: weight l in the low nibble of qs[l], weight l + 16 in the high one
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    float d = vload_half(b, (__global const half*)p0);
    uint4 v = LD4(p1 + 16 * b);
#if defined(QTYPE_Q4_0)
    uint4 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
    w[0] = (bytes8(lo.s01) - 8.0f) * d;  // ggml: (q - 8) * d
    w[1] = (bytes8(lo.s23) - 8.0f) * d;
    w[2] = (bytes8(hi.s01) - 8.0f) * d;
    w[3] = (bytes8(hi.s23) - 8.0f) * d;
#else
    iq4_codes(v, d, w);
#endif
}

#elif defined(QTYPE_Q4_1)
#if !CHECK_LAYOUT(32, 4, 16, 0, 0)
#error "quant.cl and layout.py disagree on Q4_1"
#endif
// (d, m) | qs[16]; w = q * d + m
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    float d = vload_half(2 * b, (__global const half*)p0);
    float m = vload_half(2 * b + 1, (__global const half*)p0);
    uint4 v = LD4(p1 + 16 * b);
    uint4 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
    w[0] = bytes8(lo.s01) * d + m;
    w[1] = bytes8(lo.s23) * d + m;
    w[2] = bytes8(hi.s01) * d + m;
    w[3] = bytes8(hi.s23) * d + m;
}

#elif defined(QTYPE_Q5_0) || defined(QTYPE_Q5_1)
#if defined(QTYPE_Q5_0) && !CHECK_LAYOUT(32, 2, 4, 16, 0)
#error "quant.cl and layout.py disagree on Q5_0"
#endif
#if defined(QTYPE_Q5_1) && !CHECK_LAYOUT(32, 4, 4, 16, 0)
#error "quant.cl and layout.py disagree on Q5_1"
#endif
// Q5_0: d | qh | qs[16]; w = (q - 16) * d.  Q5_1: (d, m) | qh | qs[16]; w = q * d + m.
// Bit l of qh is bit 4 of weight l.
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    u32 qh = ((__global const u32*)p1)[b];
    uint4 v = LD4(p2 + 16 * b);
    uint4 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
    uint2 nib[4] = {lo.s01, lo.s23, hi.s01, hi.s23};
    const uint8 shifts = (uint8)(0, 1, 2, 3, 4, 5, 6, 7);
#if defined(QTYPE_Q5_0)
    float d = vload_half(b, (__global const half*)p0);
#else
    float d = vload_half(2 * b, (__global const half*)p0);
    float m = vload_half(2 * b + 1, (__global const half*)p0);
#endif
    for (int i = 0; i < 4; i++) {
        uint8 high = (((uint8)(qh) >> (shifts + (uint8)(8 * i))) & 1u) << 4;
        float8 q = convert_float8(convert_uint8(as_uchar8(nib[i])) | high);
#if defined(QTYPE_Q5_0)
        w[i] = (q - 16.0f) * d;
#else
        w[i] = q * d + m;
#endif
    }
}

#elif defined(QTYPE_Q8_0) || defined(QTYPE_Q8_1)
#if defined(QTYPE_Q8_0) && !CHECK_LAYOUT(32, 2, 32, 0, 0)
#error "quant.cl and layout.py disagree on Q8_0"
#endif
#if defined(QTYPE_Q8_1) && !CHECK_LAYOUT(32, 4, 32, 0, 0)
#error "quant.cl and layout.py disagree on Q8_1"
#endif
// d (Q8_1: d, s) | qs[32] (int8); w = q * d
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    float d = vload_half(b * (LAYOUT_SZ0 / 2), (__global const half*)p0);
    uint4 v0 = LD4(p1 + 32 * b), v1 = LD4(p1 + 32 * b + 16);
    w[0] = sbytes8(v0.s01) * d;
    w[1] = sbytes8(v0.s23) * d;
    w[2] = sbytes8(v1.s01) * d;
    w[3] = sbytes8(v1.s23) * d;
}

// ---------------------------------------------------------------- k-quants (256 per block)

#elif defined(QTYPE_Q2_K)
#if !CHECK_LAYOUT(256, 16, 64, 4, 0)
#error "quant.cl and layout.py disagree on Q2_K"
#endif
// scales[16] | qs[64] | (d, dmin); weight 128h + 32k + 16g + l is chunk c = 4h + k:
// q = (qs[32h + 16g + l] >> 2k) & 3, scale byte s = scales[2c + g]: w = d*(s&15)*q - dmin*(s>>4)
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    int h = c >> 2, k = c & 3;
    float d = vload_half(2 * b, (__global const half*)p2);
    float dmin = vload_half(2 * b + 1, (__global const half*)p2);
    for (int g = 0; g < 2; g++) {
        u32 s = p0[16 * b + 2 * c + g];
        float sc = d * (float)(s & 0xFu);
        float mn = dmin * (float)(s >> 4);
        uint4 q = (LD4(p1 + 64 * b + 32 * h + 16 * g) >> (u32)(2 * k)) & 0x03030303u;
        w[2 * g] = sc * bytes8(q.s01) - mn;
        w[2 * g + 1] = sc * bytes8(q.s23) - mn;
    }
}

#elif defined(QTYPE_Q3_K)
#if !CHECK_LAYOUT(256, 32, 64, 12, 2)
#error "quant.cl and layout.py disagree on Q3_K"
#endif
// hmask[32] | qs[64] | scales[12] | d; weight 128h + 32k + 16g + l (chunk 4h + k):
// q = ((qs[32h + 16g + l] >> 2k) & 3) - 4 * !(bit 4h + k of hmask[16g + l]),
// 6-bit scale s = 8h + 2k + g; w = d * (scale - 32) * q
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    int h = c >> 2, k = c & 3;
    float d = vload_half(b, (__global const half*)p3);
    __global const u32* sp = (__global const u32*)(p2 + 12 * b);
    u32 s0 = sp[0], s1 = sp[1], s2 = sp[2];
    for (int g = 0; g < 2; g++) {
        int s = 2 * c + g;
        u32 low = s < 8 ? (byte12(s0, s1, s2, s) & 0xFu) : (byte12(s0, s1, s2, s - 8) >> 4);
        u32 high = (byte12(s0, s1, s2, 8 + (s & 3)) >> (2 * (s >> 2))) & 3u;
        float sc = d * (float)((int)(low | (high << 4)) - 32);
        uint4 vq = LD4(p1 + 64 * b + 32 * h + 16 * g);
        uint4 vh = LD4(p0 + 32 * b + 16 * g);
        uint4 q = ((vq >> (u32)(2 * k)) & 0x03030303u) +
                  (((vh >> (u32)(4 * h + k)) & 0x01010101u) << 2);  // q + 4 * hbit
        w[2 * g] = sc * (bytes8(q.s01) - 4.0f);
        w[2 * g + 1] = sc * (bytes8(q.s23) - 4.0f);
    }
}

#elif defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
#if defined(QTYPE_Q4_K) && !CHECK_LAYOUT(256, 16, 128, 0, 0)
#error "quant.cl and layout.py disagree on Q4_K"
#endif
#if defined(QTYPE_Q5_K) && !CHECK_LAYOUT(256, 16, 32, 128, 0)
#error "quant.cl and layout.py disagree on Q5_K"
#endif
// (d, dmin) and scales[12] (6-bit scales and mins) as one 16-byte field | [Q5_K: qh[32]] |
// qs[128]; chunk j: low nibbles of qs[32(j/2) + l] for even j, high for odd (Q5_K: bit j
// of qh[l] is bit 4); w = d * sc * q - dmin * m
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    int j = c;
    float d = vload_half(8 * b, (__global const half*)p0);
    float dmin = vload_half(8 * b + 1, (__global const half*)p0);
    __global const u32* sp = (__global const u32*)(p0 + 16 * b + 4);
    u32 s0 = sp[0], s1 = sp[1], s2 = sp[2];
    u32 s, m;
    if (j < 4) {
        s = byte12(s0, s1, s2, j) & 63u;
        m = byte12(s0, s1, s2, j + 4) & 63u;
    } else {
        s = (byte12(s0, s1, s2, j + 4) & 0xFu) | ((byte12(s0, s1, s2, j - 4) >> 6) << 4);
        m = (byte12(s0, s1, s2, j + 4) >> 4) | ((byte12(s0, s1, s2, j) >> 6) << 4);
    }
    float sc = d * (float)s;
    float mn = dmin * (float)m;
    u32 shift = 4 * (j & 1);
#if defined(QTYPE_Q4_K)
    __global const u8* qp = p1 + 128 * b + 32 * (j >> 1);
#else
    __global const u8* qp = p2 + 128 * b + 32 * (j >> 1);
    __global const u8* hp = p1 + 32 * b;
#endif
    for (int i = 0; i < 2; i++) {
        uint4 q = (LD4(qp + 16 * i) >> shift) & 0x0F0F0F0Fu;
#if defined(QTYPE_Q5_K)
        q |= ((LD4(hp + 16 * i) >> (u32)j) & 0x01010101u) << 4;
#endif
        w[2 * i] = sc * bytes8(q.s01) - mn;
        w[2 * i + 1] = sc * bytes8(q.s23) - mn;
    }
}

#elif defined(QTYPE_Q6_K)
#if !CHECK_LAYOUT(256, 128, 64, 16, 2)
#error "quant.cl and layout.py disagree on Q6_K"
#endif
// ql[128] | qh[64] | scales[16] (int8) | d; weight 128h + 32k + l (chunk 4h + k): low 4 bits
// in ql[64h + 32(k%2) + l] (low nibble for k < 2), top 2 bits at bit 2k of qh[32h + l];
// scale 8h + 2k + l/16; w = d * sc * (q - 32)
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    int h = c >> 2, k = c & 3;
    float d = vload_half(b, (__global const half*)p3);
    __global const u8* lp = p0 + 128 * b + 64 * h + 32 * (k & 1);
    __global const u8* hp = p1 + 64 * b + 32 * h;
    u32 lshift = k < 2 ? 0 : 4;
    for (int i = 0; i < 2; i++) {
        float sc = d * (float)((__global const char*)p2)[16 * b + 8 * h + 2 * k + i];
        uint4 lo = (LD4(lp + 16 * i) >> lshift) & 0x0F0F0F0Fu;
        uint4 hi = ((LD4(hp + 16 * i) >> (u32)(2 * k)) & 0x03030303u) << 4;
        uint4 q = lo | hi;
        w[2 * i] = sc * (bytes8(q.s01) - 32.0f);
        w[2 * i + 1] = sc * (bytes8(q.s23) - 32.0f);
    }
}

#elif defined(QTYPE_Q8_K)
#if !CHECK_LAYOUT(256, 4, 256, 0, 0)
#error "quant.cl and layout.py disagree on Q8_K"
#endif
// d (float32) | qs[256] (int8); bsums are not uploaded. w = d * q
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    float d = ((__global const float*)p0)[b];
    uint4 v0 = LD4(p1 + 256 * b + 32 * c), v1 = LD4(p1 + 256 * b + 32 * c + 16);
    w[0] = d * sbytes8(v0.s01);
    w[1] = d * sbytes8(v0.s23);
    w[2] = d * sbytes8(v1.s01);
    w[3] = d * sbytes8(v1.s23);
}

#elif defined(QTYPE_IQ4_XS)
#if !CHECK_LAYOUT(256, 2, 2, 4, 128)
#error "quant.cl and layout.py disagree on IQ4_XS"
#endif
// d | scales_h (u16) | scales_l[4] | qs[128]; sub-block j: 6-bit scale
// ((scales_l[j/2] >> 4(j%2)) & 15) | ((scales_h >> 2j) & 3) << 4, minus 32; w = d * ls * code
inline void deq32(FIELD_ARGS, i64 b, int c, float8* w) {
    int j = c;
    float d = vload_half(b, (__global const half*)p0);
    u32 sh = ((__global const u16*)p1)[b];
    u32 sl = p2[4 * b + (j >> 1)];
    u32 ls = ((sl >> (4 * (j & 1))) & 0xFu) | (((sh >> (2 * j)) & 3u) << 4);
    iq4_codes(LD4(p3 + 128 * b + 16 * j), d * (float)((int)ls - 32), w);
}

#else
#error "quant.cl: define one QTYPE_<NAME>"
#endif

// the four fields of a weight of nb_total blocks (layout.py's regions)
#define ALIGN256(v) (((v) + 255) & ~(i64)255)
#define MAKE_FIELDS(base, nb)                                                          \
    __global const u8* p0 = (base);                                                    \
    __global const u8* p1 = p0 + ALIGN256((i64)LAYOUT_SZ0 * (nb));                     \
    __global const u8* p2 = p1 + ALIGN256((i64)LAYOUT_SZ1 * (nb));                     \
    __global const u8* p3 = p2 + ALIGN256((i64)LAYOUT_SZ2 * (nb));

// ------------------------------------------------------------------------ matrix-vector

// y[t, r] = sum_j x[t, j] W[r, j] for t < n <= MV_MAX_TOKENS (decode and short batches).
//
// A work-group of MV_WG work-items handles MV_WG / MV_LPR rows: MV_LPR work-items per row,
// each taking every MV_LPR-th chunk of 32 weights, which it dequantizes once and multiplies
// with the chunk of every token's x. The lanes' partial sums are then added in local memory.
// MV_LPR = 1 (CPU devices) needs no local memory and no barrier: each work-item walks a
// whole row, its chunk arithmetic in 8-wide vectors.
__kernel __attribute__((reqd_work_group_size(MV_WG, 1, 1)))
void matvec(__global const u8* base, i64 nb_total, int k, int m,
            __global const float* x, i64 x_off, int n, __global float* y, i64 y_off) {
    MAKE_FIELDS(base, nb_total)
    x += x_off;
    y += y_off;
    int lid = get_local_id(0);
    int row = get_group_id(0) * (MV_WG / MV_LPR) + lid / MV_LPR;
    int lane = lid % MV_LPR;
    int cpr = k / 32, bpr = k / LAYOUT_BLOCK;
    float acc[MV_MAX_TOKENS];
    for (int t = 0; t < MV_MAX_TOKENS; t++) acc[t] = 0.0f;
    if (row < m) {
        for (int ch = lane; ch < cpr; ch += MV_LPR) {
            float8 w[4];
            deq32(FIELDS, (i64)row * bpr + ch / NCHUNK, ch % NCHUNK, w);
            for (int t = 0; t < MV_MAX_TOKENS; t++) {
                if (t < n) {
                    __global const float* xp = x + (i64)t * k + 32 * ch;
                    float8 s = w[0] * vload8(0, xp);
                    s = MAD(w[1], vload8(1, xp), s);
                    s = MAD(w[2], vload8(2, xp), s);
                    s = MAD(w[3], vload8(3, xp), s);
                    acc[t] += hsum8(s);
                }
            }
        }
    }
#if MV_LPR == 1
    if (row < m) {
        for (int t = 0; t < n; t++) y[(i64)t * m + row] = acc[t];
    }
#else
    __local float red[MV_WG];
    for (int t = 0; t < n; t++) {
        red[lid] = acc[t];
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int o = MV_LPR / 2; o > 0; o >>= 1) {
            if (lane < o) red[lid] += red[lid + o];
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        if (lane == 0 && row < m) y[(i64)t * m + row] = red[lid];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
#endif
}

// ------------------------------------------------------------------ matrix-matrix (tiles)

// y = x W^T for any n (prefill). A work-group computes a tile of GEMM_M rows of W by
// GEMM_N tokens; per chunk of 32 along k, the first GEMM_M work-items dequantize one row's
// chunk each into local memory, all of them stage the tokens' x, and each work-item then
// accumulates its (GEMM_M / GEMM_WM) x (GEMM_N / GEMM_WN) outputs, strided so that
// neighbouring work-items read neighbouring local rows.
#define GEMM_WI (GEMM_WM * GEMM_WN)
#define GEMM_RM (GEMM_M / GEMM_WM)
#define GEMM_RN (GEMM_N / GEMM_WN)

__kernel __attribute__((reqd_work_group_size(GEMM_WI, 1, 1)))
void gemm(__global const u8* base, i64 nb_total, int k, int m,
          __global const float* x, i64 x_off, int n, __global float* y, i64 y_off) {
    MAKE_FIELDS(base, nb_total)
    x += x_off;
    y += y_off;
    __local float ws[GEMM_M][33];  // padded: a work-item's row apart from its neighbours'
    __local float xs[GEMM_N][33];
    int lid = get_local_id(0);
    int tm = lid % GEMM_WM, tn = lid / GEMM_WM;
    int row0 = get_group_id(0) * GEMM_M, tok0 = get_group_id(1) * GEMM_N;
    int cpr = k / 32, bpr = k / LAYOUT_BLOCK;
    float acc[GEMM_RM][GEMM_RN];
    for (int i = 0; i < GEMM_RM; i++)
        for (int u = 0; u < GEMM_RN; u++) acc[i][u] = 0.0f;
    for (int ch = 0; ch < cpr; ch++) {
        for (int r = lid; r < GEMM_M; r += GEMM_WI) {
            float8 w[4] = {(float8)(0.0f), (float8)(0.0f), (float8)(0.0f), (float8)(0.0f)};
            if (row0 + r < m) deq32(FIELDS, (i64)(row0 + r) * bpr + ch / NCHUNK, ch % NCHUNK, w);
            for (int i = 0; i < 4; i++) {
                float8 v = w[i];
                ws[r][8 * i + 0] = v.s0;
                ws[r][8 * i + 1] = v.s1;
                ws[r][8 * i + 2] = v.s2;
                ws[r][8 * i + 3] = v.s3;
                ws[r][8 * i + 4] = v.s4;
                ws[r][8 * i + 5] = v.s5;
                ws[r][8 * i + 6] = v.s6;
                ws[r][8 * i + 7] = v.s7;
            }
        }
        for (int i = lid; i < GEMM_N * 32; i += GEMM_WI) {
            int t = i / 32, j = i % 32;
            xs[t][j] = tok0 + t < n ? x[(i64)(tok0 + t) * k + 32 * ch + j] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int j = 0; j < 32; j++) {
            float a[GEMM_RM], bv[GEMM_RN];
            for (int i = 0; i < GEMM_RM; i++) a[i] = ws[tm + GEMM_WM * i][j];
            for (int u = 0; u < GEMM_RN; u++) bv[u] = xs[tn + GEMM_WN * u][j];
            for (int i = 0; i < GEMM_RM; i++)
                for (int u = 0; u < GEMM_RN; u++) acc[i][u] = MAD(a[i], bv[u], acc[i][u]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int i = 0; i < GEMM_RM; i++) {
        int r = row0 + tm + GEMM_WM * i;
        for (int u = 0; u < GEMM_RN; u++) {
            int t = tok0 + tn + GEMM_WN * u;
            if (r < m && t < n) y[(i64)t * m + r] = acc[i][u];
        }
    }
}

// ----------------------------------------------------------------------------- get_rows

// out[i, :] = dequantized row ids[i] (an embedding lookup), one work-item per chunk of 32.
// ids are checked on the host and clamped here, so a bad id never reads outside the weight.
__kernel void get_rows(__global const u8* base, i64 nb_total, int k, int m,
                       __global const int* ids, int n, __global float* out) {
    MAKE_FIELDS(base, nb_total)
    int cpr = k / 32, bpr = k / LAYOUT_BLOCK;
    i64 idx = get_global_id(0);
    if (idx >= (i64)n * cpr) return;
    int i = (int)(idx / cpr), ch = (int)(idx % cpr);
    int row = clamp(ids[i], 0, m - 1);
    float8 w[4];
    deq32(FIELDS, (i64)row * bpr + ch / NCHUNK, ch % NCHUNK, w);
    __global float* op = out + (i64)i * k + 32 * ch;
    for (int j = 0; j < 4; j++) vstore8(w[j], j, op);
}
