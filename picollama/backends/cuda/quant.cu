// Quantized matrix-vector products, dequantization and row lookup for one ggml type.
//
// The module is compiled once per type: layout.py prepends `#define QTYPE_<NAME>` and the
// type's field sizes (and common.cuh), which selects the type's struct `Q` below. Each
// struct has one function, `qchunk`, which decodes 32 consecutive weights of a block as
// w[i] = sc[i / 16] * q[i] - mn[i / 16]: the codes q as exact small floats, and the scale
// and min of each half (the k-quants' sub-blocks of 16 have their own; most types repeat
// one). Everything else is written once over it:
// - deq32 (get_rows, prefill tiles) evaluates that formula with __fmul_rn/__fsub_rn, which
//   the compiler never fuses into FMAs, so it is bit-exact with ggml's dequantize_row_*
//   (and so with picollama.quant): the same float32 operations in the same order.
// - matvec factors it: sum_i w_i x_i = sc * sum_i q_i x_i - mn * sum_i x_i per half, which
//   saves two float operations per weight (the sums differ from the exact dot product
//   only by float32 rounding).
//
// Device layout ("field-major"): a weight's blocks are stored as the type's fields, each
// field of all blocks contiguous (field f of block b at region_f + b * SZf), each region
// starting on a 256-byte boundary. The bytes are the file's bytes, only regrouped, so
// every field is read with aligned vector loads (ggml's blocks are 18, 34, 110, 210 ...
// bytes long, which would force byte loads). layout.py computes the same regions.

struct Fields {
    const u8* p0;
    const u8* p1;
    const u8* p2;
    const u8* p3;
};

__device__ __forceinline__ i64 align256(i64 v) { return (v + 255) & ~(i64)255; }

// byte i (0..11) of three little-endian words
__device__ __forceinline__ u32 byte12(u32 a, u32 b, u32 c, int i) {
    u32 w = i < 4 ? a : (i < 8 ? b : c);
    return byte_of(w, i & 3);
}

// the 16 bytes of a uint4 as four words
#define WORDS4(v) {(v).x, (v).y, (v).z, (v).w}

#if defined(QTYPE_IQ4_NL) || defined(QTYPE_IQ4_XS)
__device__ const float KVALUES_IQ4NL[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f,
                                            -22.f,  -10.f,  1.f,   13.f,  25.f,  38.f,
                                            53.f,   69.f,   89.f,  113.f};
#endif

// ---------------------------------------------------------------- float types (32 per block)

#if defined(QTYPE_F32)
struct Q {  // 32 floats per "block" of 128 bytes
    static constexpr int BLOCK = 32, SZ0 = 128, SZ1 = 0, SZ2 = 0, SZ3 = 0;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        const float4* p = (const float4*)(f.p0 + 128 * b);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = __ldg(p + i);
            q[4 * i] = v.x; q[4 * i + 1] = v.y; q[4 * i + 2] = v.z; q[4 * i + 3] = v.w;
        }
        sc[0] = sc[1] = 1.0f;
        mn[0] = mn[1] = 0.0f;
    }
};
#elif defined(QTYPE_F16) || defined(QTYPE_BF16)
struct Q {  // 32 halves per "block" of 64 bytes
    static constexpr int BLOCK = 32, SZ0 = 64, SZ1 = 0, SZ2 = 0, SZ3 = 0;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 v = ld_u128(f.p0 + 64 * b + 16 * i);
            u32 w[4] = WORDS4(v);
#pragma unroll
            for (int j = 0; j < 4; j++) {
#if defined(QTYPE_F16)
                q[8 * i + 2 * j] = h2f((u16)(w[j] & 0xFFFFu));
                q[8 * i + 2 * j + 1] = h2f((u16)(w[j] >> 16));
#else
                q[8 * i + 2 * j] = bf2f((u16)(w[j] & 0xFFFFu));
                q[8 * i + 2 * j + 1] = bf2f((u16)(w[j] >> 16));
#endif
            }
        }
        sc[0] = sc[1] = 1.0f;
        mn[0] = mn[1] = 0.0f;
    }
};

// ------------------------------------------------------------------- legacy 32-weight blocks

#elif defined(QTYPE_Q4_0) || defined(QTYPE_IQ4_NL)
struct Q {  // d, qs[16]: weight j in the low nibble of qs[j], weight j + 16 in the high one
    static constexpr int BLOCK = 32, SZ0 = 2, SZ1 = 16, SZ2 = 0, SZ3 = 0;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        float d = h2f(ld_u16(f.p0 + 2 * b));
        uint4 v = ld_u128(f.p1 + 16 * b);
        u32 w[4] = WORDS4(v);
#if defined(QTYPE_Q4_0)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bytes4(w[i] & 0x0F0F0F0Fu, 8388616.0f, q + 4 * i);  // q - 8
            bytes4((w[i] >> 4) & 0x0F0F0F0Fu, 8388616.0f, q + 16 + 4 * i);
        }
#else
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u32 byte = byte_of(w[j >> 2], j & 3);
            q[j] = KVALUES_IQ4NL[byte & 0xFu];
            q[j + 16] = KVALUES_IQ4NL[byte >> 4];
        }
#endif
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = 0.0f;
    }
};
#elif defined(QTYPE_Q4_1)
struct Q {  // (d, m), qs[16]; w = q * d + m
    static constexpr int BLOCK = 32, SZ0 = 4, SZ1 = 16, SZ2 = 0, SZ3 = 0;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        u32 dm = ld_u32(f.p0 + 4 * b);
        float d = h2f((u16)(dm & 0xFFFFu)), m = h2f((u16)(dm >> 16));
        uint4 v = ld_u128(f.p1 + 16 * b);
        u32 w[4] = WORDS4(v);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u32 byte = byte_of(w[j >> 2], j & 3);
            q[j] = u2f(byte & 0xFu);
            q[j + 16] = u2f(byte >> 4);
        }
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = -m;
    }
};
#elif defined(QTYPE_Q5_0) || defined(QTYPE_Q5_1)
// Q5_0: d, qh (bit j: bit 4 of weight j), qs[16]; w = (q - 16) * d
// Q5_1: (d, m), qh, qs[16]; w = q * d + m
struct Q {
#if defined(QTYPE_Q5_0)
    static constexpr int BLOCK = 32, SZ0 = 2, SZ1 = 4, SZ2 = 16, SZ3 = 0;
    static constexpr bool HAS_MIN = false;
#else
    static constexpr int BLOCK = 32, SZ0 = 4, SZ1 = 4, SZ2 = 16, SZ3 = 0;
    static constexpr bool HAS_MIN = true;
#endif
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
#if defined(QTYPE_Q5_0)
        float d = h2f(ld_u16(f.p0 + 2 * b));
        float off = 8388624.0f;  // 2^23 + 16
        mn[0] = mn[1] = 0.0f;
#else
        u32 dm = ld_u32(f.p0 + 4 * b);
        float d = h2f((u16)(dm & 0xFFFFu));
        float off = 8388608.0f;
        mn[0] = mn[1] = -h2f((u16)(dm >> 16));
#endif
        u32 qh = ld_u32(f.p1 + 4 * b);
        uint4 v = ld_u128(f.p2 + 16 * b);
        u32 w[4] = WORDS4(v);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u32 byte = byte_of(w[j >> 2], j & 3);
            u32 lo = (byte & 0xFu) | (((qh >> j) & 1u) << 4);
            u32 hi = (byte >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            q[j] = u2f_off(lo, off);
            q[j + 16] = u2f_off(hi, off);
        }
        sc[0] = sc[1] = d;
    }
};
#elif defined(QTYPE_Q8_0) || defined(QTYPE_Q8_1)
struct Q {  // d (Q8_1: d, s), qs[32] (int8); w = q * d
#if defined(QTYPE_Q8_0)
    static constexpr int BLOCK = 32, SZ0 = 2, SZ1 = 32, SZ2 = 0, SZ3 = 0;
#else
    static constexpr int BLOCK = 32, SZ0 = 4, SZ1 = 32, SZ2 = 0, SZ3 = 0;
#endif
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        float d = h2f(ld_u16(f.p0 + SZ0 * b));
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 v = ld_u128(f.p1 + 32 * b + 16 * i);
            u32 w[4] = WORDS4(v);
#pragma unroll
            for (int j = 0; j < 4; j++) bytes4(w[j] ^ 0x80808080u, 8388736.0f, q + 16 * i + 4 * j);
        }
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = 0.0f;
    }
};

// ---------------------------------------------------------------- k-quants (256 per block)

#elif defined(QTYPE_Q2_K)
struct Q {  // scales[16], qs[64], (d, dmin); weight 128h + 32k + 16g + l = chunk 4h + k
    static constexpr int BLOCK = 256, SZ0 = 16, SZ1 = 64, SZ2 = 4, SZ3 = 0;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        int h = c >> 2, k = c & 3;
        u32 dm = ld_u32(f.p2 + 4 * b);
        float d = h2f((u16)(dm & 0xFFFFu)), dmin = h2f((u16)(dm >> 16));
        u32 sc2 = ld_u16(f.p0 + 16 * b + 2 * c);  // scales 2c (g = 0) and 2c + 1 (g = 1)
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 s = byte_of(sc2, g);
            sc[g] = __fmul_rn(d, u2f(s & 0xFu));
            mn[g] = __fmul_rn(dmin, u2f(s >> 4));
            uint4 v = ld_u128(f.p1 + 64 * b + 32 * h + 16 * g);
            u32 w[4] = WORDS4(v);
#pragma unroll
            for (int l = 0; l < 16; l++) {
                q[16 * g + l] = u2f((byte_of(w[l >> 2], l & 3) >> (2 * k)) & 3u);
            }
        }
    }
};
#elif defined(QTYPE_Q3_K)
struct Q {  // hmask[32], qs[64], scales[12], d; w = d * (sc - 32) * (q - 4 * !hbit)
    static constexpr int BLOCK = 256, SZ0 = 32, SZ1 = 64, SZ2 = 12, SZ3 = 2;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        int h = c >> 2, k = c & 3;
        float d = h2f(ld_u16(f.p3 + 2 * b));
        const u8* sp = f.p2 + 12 * b;
        u32 s0 = ld_u32(sp), s1 = ld_u32(sp + 4), s2 = ld_u32(sp + 8);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            int s = 2 * c + g;  // = 8h + 2k + g
            u32 low = s < 8 ? (byte12(s0, s1, s2, s) & 0xFu) : (byte12(s0, s1, s2, s - 8) >> 4);
            u32 high = (byte12(s0, s1, s2, 8 + (s & 3)) >> (2 * (s >> 2))) & 3u;
            sc[g] = __fmul_rn(d, (float)((int)(low | (high << 4)) - 32));
            mn[g] = 0.0f;
            uint4 vq = ld_u128(f.p1 + 64 * b + 32 * h + 16 * g);
            uint4 vh = ld_u128(f.p0 + 32 * b + 16 * g);
            u32 w[4] = WORDS4(vq);
            u32 hm[4] = WORDS4(vh);
#pragma unroll
            for (int l = 0; l < 16; l++) {
                u32 q2 = (byte_of(w[l >> 2], l & 3) >> (2 * k)) & 3u;
                u32 hb = (byte_of(hm[l >> 2], l & 3) >> (4 * h + k)) & 1u;
                q[16 * g + l] = u2f_off(q2 + 4u * hb, 8388612.0f);  // q2 - 4 * !hb
            }
        }
    }
};
#elif defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
// (d, dmin) and scales[12] (6-bit scales and mins) as one 16-byte field, [Q5_K: qh[32]],
// qs[128]; sub-block j (= chunk) of 32: low nibbles of qs[32*(j/2) ...] for even j, high
// for odd.
struct Q {
#if defined(QTYPE_Q4_K)
    static constexpr int BLOCK = 256, SZ0 = 16, SZ1 = 128, SZ2 = 0, SZ3 = 0;
#else
    static constexpr int BLOCK = 256, SZ0 = 16, SZ1 = 32, SZ2 = 128, SZ3 = 0;
#endif
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        int j = c;
        uint4 hd = ld_u128(f.p0 + 16 * b);
        u32 dm = hd.x, s0 = hd.y, s1 = hd.z, s2 = hd.w;
        float d = h2f((u16)(dm & 0xFFFFu)), dmin = h2f((u16)(dm >> 16));
        u32 s, m;
        if (j < 4) {
            s = byte12(s0, s1, s2, j) & 63u;
            m = byte12(s0, s1, s2, j + 4) & 63u;
        } else {
            s = (byte12(s0, s1, s2, j + 4) & 0xFu) | ((byte12(s0, s1, s2, j - 4) >> 6) << 4);
            m = (byte12(s0, s1, s2, j + 4) >> 4) | ((byte12(s0, s1, s2, j) >> 6) << 4);
        }
        sc[0] = sc[1] = __fmul_rn(d, u2f(s));
        mn[0] = mn[1] = __fmul_rn(dmin, u2f(m));
        int shift = 4 * (j & 1);
#if defined(QTYPE_Q4_K)
        const u8* qp = f.p1 + 128 * b + 32 * (j >> 1);
#else
        const u8* qp = f.p2 + 128 * b + 32 * (j >> 1);
        const u8* hp = f.p1 + 32 * b;
#endif
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 v = ld_u128(qp + 16 * i);
            u32 w[4] = WORDS4(v);
#if defined(QTYPE_Q5_K)
            uint4 vh = ld_u128(hp + 16 * i);
            u32 qh[4] = WORDS4(vh);
#endif
#pragma unroll
            for (int e = 0; e < 4; e++) {
                u32 qv = (w[e] >> shift) & 0x0F0F0F0Fu;
#if defined(QTYPE_Q5_K)
                qv |= ((qh[e] >> j) & 0x01010101u) << 4;
#endif
                bytes4(qv, 8388608.0f, q + 16 * i + 4 * e);
            }
        }
    }
};
#elif defined(QTYPE_Q6_K)
// ql[128], qh[64], scales[16] (int8), d; weight 128h + 32k + l (chunk 4h + k): low 4 bits
// in ql[64h + 32(k%2) + l] (low nibble for k < 2), top 2 bits at bit 2k of qh[32h + l];
// scale 8h + 2k + l/16; w = d * sc * (q - 32)
struct Q {
    static constexpr int BLOCK = 256, SZ0 = 128, SZ1 = 64, SZ2 = 16, SZ3 = 2;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        int h = c >> 2, k = c & 3;
        float d = h2f(ld_u16(f.p3 + 2 * b));
        u32 sc2 = ld_u16(f.p2 + 16 * b + 8 * h + 2 * k);
        const u8* lp = f.p0 + 128 * b + 64 * h + 32 * (k & 1);
        const u8* hp = f.p1 + 64 * b + 32 * h;
        int lshift = k < 2 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            sc[i] = __fmul_rn(d, (float)(int)(signed char)(u8)byte_of(sc2, i));
            mn[i] = 0.0f;
            uint4 vl = ld_u128(lp + 16 * i);
            uint4 vh = ld_u128(hp + 16 * i);
            u32 ql[4] = WORDS4(vl);
            u32 qh[4] = WORDS4(vh);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                u32 lo = (ql[e] >> lshift) & 0x0F0F0F0Fu;
                u32 hi = ((qh[e] >> (2 * k)) & 0x03030303u) << 4;
                bytes4(lo | hi, 8388640.0f, q + 16 * i + 4 * e);  // q - 32
            }
        }
    }
};
#elif defined(QTYPE_Q8_K)
struct Q {  // d (float32), qs[256] (int8); bsums are not uploaded
    static constexpr int BLOCK = 256, SZ0 = 4, SZ1 = 256, SZ2 = 0, SZ3 = 0;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        float d = __uint_as_float(ld_u32(f.p0 + 4 * b));
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 v = ld_u128(f.p1 + 256 * b + 32 * c + 16 * i);
            u32 w[4] = WORDS4(v);
#pragma unroll
            for (int j = 0; j < 16; j++) {
                u32 byte = byte_of(w[j >> 2], j & 3) ^ 0x80u;
                q[16 * i + j] = u2f_off(byte, 8388736.0f);
            }
        }
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = 0.0f;
    }
};
#elif defined(QTYPE_IQ4_XS)
// d, scales_h (u16), scales_l[4], qs[128]; sub-block j: scale ((scales_l[j/2] >> 4(j%2)) & 15)
// | ((scales_h >> 2j) & 3) << 4, minus 32; codes of qs[16j + l]: low nibble weight l, high
// nibble weight 16 + l
struct Q {
    static constexpr int BLOCK = 256, SZ0 = 2, SZ1 = 2, SZ2 = 4, SZ3 = 128;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void qchunk(const Fields& f, i64 b, int c, float* q,
                                                  float* sc, float* mn) {
        int j = c;
        float d = h2f(ld_u16(f.p0 + 2 * b));
        u32 sh = ld_u16(f.p1 + 2 * b);
        u32 sl = ld_u32(f.p2 + 4 * b);
        u32 ls = ((byte_of(sl, j >> 1) >> (4 * (j & 1))) & 0xFu) | (((sh >> (2 * j)) & 3u) << 4);
        sc[0] = sc[1] = __fmul_rn(d, (float)((int)ls - 32));
        mn[0] = mn[1] = 0.0f;
        uint4 v = ld_u128(f.p3 + 128 * b + 16 * j);
        u32 w[4] = WORDS4(v);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            u32 byte = byte_of(w[l >> 2], l & 3);
            q[l] = KVALUES_IQ4NL[byte & 0xFu];
            q[16 + l] = KVALUES_IQ4NL[byte >> 4];
        }
    }
};
#else
#error "quant.cu: define one QTYPE_<NAME>"
#endif

// layout.py prepends its field sizes for this type; the two must agree
static_assert(Q::BLOCK == LAYOUT_BLOCK && Q::SZ0 == LAYOUT_SZ0 && Q::SZ1 == LAYOUT_SZ1 &&
                  Q::SZ2 == LAYOUT_SZ2 && Q::SZ3 == LAYOUT_SZ3,
              "quant.cu and layout.py disagree on this type's fields");

static constexpr int NCHUNK = Q::BLOCK / 32;  // chunks of 32 weights per block

__device__ __forceinline__ Fields make_fields(const u8* base, i64 nb) {
    Fields f;
    i64 off = 0;
    f.p0 = base;
    off += align256((i64)Q::SZ0 * nb);
    f.p1 = base + off;
    off += align256((i64)Q::SZ1 * nb);
    f.p2 = base + off;
    off += align256((i64)Q::SZ2 * nb);
    f.p3 = base + off;
    return f;
}

// 32 dequantized weights, bit-exact with ggml: w = sc * q - mn in float32, unfused.
__device__ __forceinline__ void deq32(const Fields& f, i64 b, int c, float* w) {
    float q[32], sc[2], mn[2];
    Q::qchunk(f, b, c, q, sc, mn);
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = __fsub_rn(__fmul_rn(sc[i >> 4], q[i]), mn[i >> 4]);
}

#define MV_MAX_TOKENS 8
#define MV_WARPS 8
#define MV_PAD 36  // floats per chunk of 32 in shared memory: 4 of padding, no bank conflicts
// after the padded x: the sums of each half chunk (16 values) of x, for types with a min

#ifndef RING_BUILD  // ring.cu builds the code above without the kernels
// y[t, r] = sum_j x[t, j] * W[r, j] for t < n <= MV_MAX_TOKENS (decode and short batches).
//
// The block first copies x into shared memory, each chunk of 32 values padded to 36 floats
// so that the lanes' 16-byte reads of different chunks fall in different banks. Each row is
// then handled by `lpr` lanes (a power of two <= 32) of one warp, each lane taking every
// lpr-th chunk of 32 weights; warps step through the rows with a grid-wide stride.
//
// Fusions, used by the decode graphs (backend.py): with `norm`, x is first RMS-normalized
// per token and multiplied by norm_w, exactly as the rms_norm kernel does it; with
// `has_resid`, y = resid + x W^T (the residual add, one float32 addition as in `add`).
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
matvec(const u8* __restrict__ base, i64 nb_total, int k, int m, const float* __restrict__ x,
       int n, float* __restrict__ y, int lpr, const float* __restrict__ norm_w, float eps,
       int norm, const float* __restrict__ resid, int has_resid) {
    extern __shared__ float4 sx4[];
    float* sx = (float*)sx4;
    __shared__ double red[MV_WARPS];
    __shared__ float s_scale[MV_MAX_TOKENS];
    Fields f = make_fields(base, nb_total);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int cpr = k / 32, bpr = k / Q::BLOCK;
    int stride_t = cpr * MV_PAD;

    for (int t = 0; t < n; t++) {
        const float* xt = x + (i64)t * k;
        double ss = 0.0;
#pragma unroll 4
        for (int i = threadIdx.x * 4; i < k; i += MV_WARPS * 32 * 4) {
            float4 v = __ldg((const float4*)(xt + i));
            *(float4*)(sx + t * stride_t + (i >> 5) * MV_PAD + (i & 31)) = v;
            if (norm) {
                ss += (double)v.x * v.x + (double)v.y * v.y;
                ss += (double)v.z * v.z + (double)v.w * v.w;
            }
        }
        if (norm) block_rms_scale(ss, red, MV_WARPS, k, eps, &s_scale[t]);
    }
    __syncthreads();
    if (norm) {
        for (int i = threadIdx.x; i < n * k; i += MV_WARPS * 32) {
            int t = i / k, j = i % k;
            float* p = sx + t * stride_t + (j >> 5) * MV_PAD + (j & 31);
            *p = __fmul_rn(__fmul_rn(*p, s_scale[t]), norm_w[j]);
        }
        __syncthreads();
    }
    float* xsum = sx + n * stride_t;  // (n, cpr, 2)
    if (Q::HAS_MIN) {
        for (int i = threadIdx.x; i < n * cpr * 2; i += MV_WARPS * 32) {
            int t = i / (cpr * 2), r = i % (cpr * 2);
            const float* p = sx + t * stride_t + (r >> 1) * MV_PAD + 16 * (r & 1);
            float v = 0.f;
#pragma unroll
            for (int e = 0; e < 16; e++) v += p[e];
            xsum[i] = v;
        }
        __syncthreads();
    }

    int rows_per_warp = 32 / lpr;
    int sub = lane / lpr, sl = lane % lpr;
    for (int row0 = (blockIdx.x * MV_WARPS + warp) * rows_per_warp; row0 < m;
         row0 += gridDim.x * MV_WARPS * rows_per_warp) {
        int row = row0 + sub;
        float acc[MV_MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < MV_MAX_TOKENS; t++) acc[t] = 0.f;
        if (row < m) {
            for (int ch = sl; ch < cpr; ch += lpr) {
                float q[32], sc[2], mn[2];
                Q::qchunk(f, (i64)row * bpr + ch / NCHUNK, ch % NCHUNK, q, sc, mn);
#pragma unroll
                for (int t = 0; t < MV_MAX_TOKENS; t++) {
                    if (t < n) {
                        const float4* xp = (const float4*)(sx + t * stride_t + ch * MV_PAD);
                        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;  // two chains per half
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            float4 v = xp[i];
                            s0 = fmaf(q[4 * i], v.x, s0);
                            s2 = fmaf(q[4 * i + 1], v.y, s2);
                            s0 = fmaf(q[4 * i + 2], v.z, s0);
                            s2 = fmaf(q[4 * i + 3], v.w, s2);
                        }
#pragma unroll
                        for (int i = 4; i < 8; i++) {
                            float4 v = xp[i];
                            s1 = fmaf(q[4 * i], v.x, s1);
                            s3 = fmaf(q[4 * i + 1], v.y, s3);
                            s1 = fmaf(q[4 * i + 2], v.z, s1);
                            s3 = fmaf(q[4 * i + 3], v.w, s3);
                        }
                        float part = fmaf(sc[0], s0 + s2, sc[1] * (s1 + s3));
                        if (Q::HAS_MIN) {
                            const float* xs = xsum + (t * cpr + ch) * 2;
                            part -= fmaf(mn[0], xs[0], mn[1] * xs[1]);
                        }
                        acc[t] += part;
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MV_MAX_TOKENS; t++) {
            if (t < n) {
                float v = acc[t];
                for (int o = lpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (row < m && sl == 0) {
                    i64 at = (i64)t * m + row;
                    y[at] = has_resid ? __fadd_rn(resid[at], v) : v;
                }
            }
        }
    }
}

// Prefill tiles for cuBLAS: the chunk of 32 weights that this thread dequantizes in the
// tile of rows row0 .. row0 + nrows - 1, and where it starts in the tile (*at); false for a
// thread past the tile's end.
__device__ __forceinline__ bool tile_chunk(const u8* __restrict__ base, i64 nb_total, int k,
                                           int row0, int nrows, float* w, i64* at) {
    Fields f = make_fields(base, nb_total);
    int cpr = k / 32, bpr = k / Q::BLOCK;
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)nrows * cpr) return false;
    int r = (int)(idx / cpr), ch = (int)(idx % cpr);
    deq32(f, (i64)(row0 + r) * bpr + ch / NCHUNK, ch % NCHUNK, w);
    *at = (i64)r * k + 32 * ch;
    return true;
}

// out[r, :] = dequantized row row0 + r, for r < nrows, in float32.
extern "C" __global__ void dequant(const u8* __restrict__ base, i64 nb_total, int k, int row0,
                                   int nrows, float* __restrict__ out) {
    float w[32];
    i64 at;
    if (!tile_chunk(base, nb_total, k, row0, nrows, w, &at)) return;
    float4* op = (float4*)(out + at);
#pragma unroll
    for (int i = 0; i < 8; i++) op[i] = make_float4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
}

// The same tiles in fp16 (prefill with arithmetic "ggml": cuBLAS on the tensor cores). Each
// float32 weight of deq32 is rounded to the nearest fp16, 8 to a 16-byte store.
extern "C" __global__ void dequant_h(const u8* __restrict__ base, i64 nb_total, int k, int row0,
                                     int nrows, u16* __restrict__ out) {
    float w[32];
    i64 at;
    if (!tile_chunk(base, nb_total, k, row0, nrows, w, &at)) return;
    uint4* op = (uint4*)(out + at);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float* v = w + 8 * i;
        op[i] = make_uint4(f2h(v[0]) | ((u32)f2h(v[1]) << 16), f2h(v[2]) | ((u32)f2h(v[3]) << 16),
                           f2h(v[4]) | ((u32)f2h(v[5]) << 16), f2h(v[6]) | ((u32)f2h(v[7]) << 16));
    }
}

// out[i, :] = dequantized row ids[i] (an embedding lookup); ids are checked on the host and
// clamped here so that a bad id can never read outside the weight.
extern "C" __global__ void get_rows(const u8* __restrict__ base, i64 nb_total, int k, int m,
                                    const int* __restrict__ ids, int n, float* __restrict__ out) {
    Fields f = make_fields(base, nb_total);
    int cpr = k / 32, bpr = k / Q::BLOCK;
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n * cpr) return;
    int i = (int)(idx / cpr), ch = (int)(idx % cpr);
    int row = ids[i];
    row = row < 0 ? 0 : (row >= m ? m - 1 : row);
    float w[32];
    deq32(f, (i64)row * bpr + ch / NCHUNK, ch % NCHUNK, w);
    float4* op = (float4*)(out + (i64)i * k + 32 * ch);
#pragma unroll
    for (int j = 0; j < 8; j++) op[j] = make_float4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
}
#endif  // RING_BUILD
