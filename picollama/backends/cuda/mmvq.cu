// Matrix-vector products with int8 activations and dp4a, llama.cpp's "mmvq" arithmetic, for
// the types of the common model files: Q4_0, Q5_0, Q8_0, Q4_K and Q6_K (appended to
// quant.cu's module for these types only; the other types keep quant.cu's float kernel).
//
// Activations. Each block of the grid quantizes x once into shared memory (the grid is one
// wave of blocks, so this happens once per multiprocessor slot, not per row): each run of 32
// values gets d = max|x| / 127 and codes q = round(x * (127 / max|x|)) in int8 (Q8_1's
// scheme; the codes are ggml-cpu's quantize_row_q8_1's, so the CPU backend's), and the
// integer sum of each half (16 codes) is kept for the types whose codes carry an offset.
// With `norm`, x is first RMS-normalized and scaled exactly as the rms_norm kernel does it.
//
// Weights. A lane takes 16 bytes of a weight's code field at a time (a "chunk": 32 weights
// of Q4_0/Q5_0/Q4_K/Q6_K, 16 of Q8_0), turns them into words of four small integer codes
// and multiplies them with the activation codes by dp4a (four products and a sum in one
// instruction). The integer sums are exact; the block scales are applied in float32:
//     y = sum over blocks of d_w * sc * d_x * (sum q_w q_x - off * sum q_x)  [- dmin m d_x sum q_x]
// so y equals x_q W^T (x_q: the dequantized int8 activations) up to float32 rounding, and
// differs from x W^T by at most sum_j |w_j| |x_j - x_q,j| <= sum_j |w_j| d_x / 2 (the bound
// tests/test_cuda_backend.py checks).
//
// Rows. A warp takes two rows at a time (row and row + the grid's warp count, or a gate row
// and its up row); each lane loads U chunks of both rows before it uses any, so that
// 2 * 32 * U * 16 bytes (more with Q6_K's high bits) per warp are in flight; with MVQ_PIPE
// (below) the next such unit's loads go out before this one is multiplied. One launch can cover the rows of up to three weights of the
// same type and width that share x (Q, K and V), or, with `act`, the rows of a gate and an
// up weight, writing act(gate . x) * (up . x) (the SwiGLU / GeGLU of the feed-forward).

// Q4_K and Q6_K (the big matrices of Q4_K_M models): one block of 16 warps per
// multiprocessor, chunks of two 16-byte runs that share their scales (pairs), measured the
// fastest on the H200 for the 8B shapes; the small types keep 2 blocks of 8 warps, which the
// 576-wide rows of small models prefer. The backend reads the block size back from the
// kernel (max_threads_per_block).
#if defined(QTYPE_Q4_K) || defined(QTYPE_Q6_K)
#ifndef MVQ_WARPS
#define MVQ_WARPS 16
#endif
#ifndef MVQ_MIN_BLOCKS
#define MVQ_MIN_BLOCKS 1
#endif
#ifndef MVQ_SMALL_WARPS
#define MVQ_SMALL_WARPS 8
#endif
#ifndef MVQ_Q4K_PAIR
#define MVQ_Q4K_PAIR 1
#endif
#ifndef MVQ_Q6K_PAIR
#define MVQ_Q6K_PAIR 1
#endif
#ifndef MVQ_UNROLL_Q6K_PAIR
#define MVQ_UNROLL_Q6K_PAIR 1
#endif
#endif
#ifndef MVQ_WARPS
#define MVQ_WARPS 8
#endif
// Grids of few blocks (the 135M's ffn_down, Q6_K 576 x 1536: 18 blocks of 16 warps) take
// matvec_q8_n1_small, blocks of MVQ_SMALL_WARPS warps: twice the blocks over twice the SMs
// for the same rows. Built only where it is smaller than MVQ_WARPS (Q4_K and Q6_K); the
// backend uses it for one token where its grid leaves at least half the SMs idle.
#ifndef MVQ_SMALL_WARPS
#define MVQ_SMALL_WARPS MVQ_WARPS
#endif
// MVQ_PIPE (one token, with MVQ_PRELOAD): the loads of a warp's next unit (row pair and
// iteration) go out before the current one is multiplied (mvq_body). On for every type:
// the 32-weight types with units of 2 blocks (the 135M, whose rows of 576 are Q5_0 and
// Q8_0: tg128 1353-1373 -> 1527-1539 t/s on an H100, run 26), Q4_K's pairs one chunk a
// unit and Q6_K's pairs as they are, each job located again per unit (no spills: 117-123
// registers, sm_90). The 8B on an H100, one lease (run 27): 343.6 / 343.7 t/s without
// the pipe for Q4_K and Q6_K, 349.3 with it for Q4_K alone, 342.7 for Q6_K alone, 356.2
// for both. MVQ_PIPE_Q4K=0 / MVQ_PIPE_Q6K=0 build those types without it (comparisons).
#ifndef MVQ_PIPE_Q4K
#define MVQ_PIPE_Q4K 1
#endif
#ifndef MVQ_PIPE_Q6K
#define MVQ_PIPE_Q6K 1
#endif
#ifndef MVQ_PIPE
#if defined(QTYPE_Q4_K)
#define MVQ_PIPE MVQ_PIPE_Q4K
#elif defined(QTYPE_Q6_K)
#define MVQ_PIPE MVQ_PIPE_Q6K
#else
#define MVQ_PIPE 1
#endif
#endif
#ifndef MVQ_UNROLL
#define MVQ_UNROLL (MVQ_PIPE ? 2 : 4)
#endif
#ifndef MVQ_UNROLL_Q6K
#define MVQ_UNROLL_Q6K 3  // 4 would spill registers with two rows
#endif
#ifndef MVQ_Q4K_PAIR
#define MVQ_Q4K_PAIR 0  // Q4_K: chunks of 32 bytes (two of 16 sharing their scales)
#endif
#ifndef MVQ_UNROLL_Q4K_PAIR
#define MVQ_UNROLL_Q4K_PAIR (MVQ_PIPE ? 1 : 2)
#endif
#ifndef MVQ_Q6K_PAIR
#define MVQ_Q6K_PAIR 0  // Q6_K: chunks of two ql runs that share their qh bytes
#endif
#ifndef MVQ_UNROLL_Q6K_PAIR
#define MVQ_UNROLL_Q6K_PAIR 2
#endif
#ifndef MVQ_MIN_BLOCKS
#define MVQ_MIN_BLOCKS 2  // blocks per multiprocessor the one-token kernels are built for
#endif
// Before x is quantized (and, with dependent launches, before the kernel before has
// finished), a warp issues the loads of its first row pair's first iteration into registers.
#ifndef MVQ_PRELOAD
#define MVQ_PRELOAD 1
#endif

// The most blocks a launch that writes x may have for its reader to take x's sum of squares
// from their partial sums (ssq_out / ssq_in below); the host links no bigger launch.
#ifndef MVQ_SSQ_MAX
#define MVQ_SSQ_MAX 256
#endif

// MVQ_QRCP (on): x's codes as ggml-cpu's quantize_row_q8_1 makes them, q = rint(x * (127 /
// max|x|)), one division a run's lane instead of five: every block quantizes all of x, on
// the critical path of each launch (NOTES runs 40-41: tg128 1.026x on the 8B shape). 0:
// q = round(x / d), llama.cpp CUDA's quantize_q8_1.
#ifndef MVQ_QRCP
#define MVQ_QRCP 1
#endif
// MVQ_Q16 (off): in the one-token kernels a lane quantizes 16 consecutive values of x (half
// a run of 32) instead of 4 (quantize16): the run's max|x| in one shuffle with the
// neighbouring lane (three with 8 lanes a run), the half's sum of codes without one (two),
// the scale's two divisions once for 16 values (4), the codes in one 16-byte store (4
// bytes). The same codes, scales and sums as quantize4's (the same operations on each
// value); ~160 instructions for 16 values (with the norm) where quantize4's four calls
// issue ~400, all on the critical path of every launch (NOTES run 41).
#ifndef MVQ_Q16
#define MVQ_Q16 0
#endif
// MVQ_TRACE (a diagnostic build: bench_synthetic --trace): each warp of the one-token
// kernels writes its times (%globaltimer, ns) into mvq_trace: entry, the dependent-launch
// wait done, x quantized, its first unit multiplied, done; with the first weight's address,
// the block, the warp and the SM; then two times inside the prologue: x's first round of
// loads quantized, and the next unit's loads issued in the pipe's first step (before its
// first unit is multiplied); and when the first round's loads of x (and norm_w, ssq_in)
// are in registers. Slots are taken in order of finishing, up to MVQ_TRACE_CAP.
#ifndef MVQ_TRACE
#define MVQ_TRACE 0
#endif
// MVQ_TRACE_DEP: which of the first round's loads its time waits for (bits: 1 x, 2 norm_w,
// 4 ssq_in, through the norm's scale)
#ifndef MVQ_TRACE_DEP
#define MVQ_TRACE_DEP 7
#endif
#if MVQ_TRACE
#define MVQ_TRACE_CAP 262144
__device__ unsigned long long mvq_trace[MVQ_TRACE_CAP][10];
__device__ unsigned int mvq_trace_n;
__device__ __forceinline__ unsigned long long mvq_gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define MVQ_TR(name) const unsigned long long name = mvq_gtimer()
#define MVQ_TR_FIRST() \
    if (tr_f == 0) tr_f = mvq_gtimer()
#define MVQ_TR_X1() \
    if (tr_x1 == 0) tr_x1 = mvq_gtimer()
#define MVQ_TR_ISSUED() \
    if (tr_f == 0) tr_i = mvq_gtimer()
// the time once `dep` (a sum of the round's loaded values) is in a register: the asm's
// operand makes the timer read wait for the loads
#define MVQ_TR_LANDED(dep) \
    if (tr_xl == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(tr_xl) : "f"(dep))
#define MVQ_TR_END()                                                                       \
    do {                                                                                   \
        if (lane == 0) {                                                                   \
            unsigned int smid;                                                             \
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));                              \
            const unsigned int slot = atomicAdd(&mvq_trace_n, 1u);                         \
            if (slot < MVQ_TRACE_CAP) {                                                    \
                unsigned long long* r = mvq_trace[slot];                                   \
                r[0] = (unsigned long long)w0;                                             \
                r[1] = blockIdx.x | ((unsigned long long)warp << 16) |                     \
                       ((unsigned long long)smid << 24);                                   \
                r[2] = tr_0, r[3] = tr_1, r[4] = tr_2, r[5] = tr_f, r[6] = mvq_gtimer();    \
                r[7] = tr_x1, r[8] = tr_i, r[9] = tr_xl;                                   \
            }                                                                              \
        }                                                                                  \
    } while (0)
#else
#define MVQ_TR(name)
#define MVQ_TR_FIRST()
#define MVQ_TR_X1()
#define MVQ_TR_ISSUED()
#define MVQ_TR_LANDED(dep)
#define MVQ_TR_END()
#endif

// one token's quantized x in shared memory
struct XQ {
    const signed char* q;  // k codes
    const float* d;        // k / 32 scales
    const int* s;          // k / 16 sums of 16 codes
};

// four bits b as the bytes (b_i << 4): bit i of b moves to bit 4 of byte i
__device__ __forceinline__ u32 spread4_bit4(u32 b) { return ((b * 0x00204081u) & 0x01010101u) << 4; }

// MVQ_XSWZ: x's codes are stored with their 16-byte units permuted within each 128 bytes.
// Q4_K's and Q6_K's pair-form lanes read x 64 bytes apart (Q6_K's: 16 and 128 apart too),
// which lands four lanes of a quarter warp on one bank group: every 16-byte x load is a
// 4-way shared-memory conflict. 1: address bits 4-5 XOR bits 7-8 (Q4_K's reads
// conflict-free, Q6_K's 2-way); 2: also bit 6 XOR bit 7 (both conflict-free). The writer
// (quantize4) and every reader (ld_x16) apply it to the shared address alike; x's codes
// start 128-byte aligned and are whole 128-byte groups there (k a multiple of 256), so no
// unit moves out of x. 2 by default (run 36: the 8B's decode 1.021x on an H100 over 3
// rounds, 1.052x on an H200 over 2; the 135M's 1.022x and 0.985x); 0: x's codes in order.
#ifndef MVQ_XSWZ
#define MVQ_XSWZ 2
#endif
#if !(defined(QTYPE_Q4_K) || defined(QTYPE_Q6_K))
#undef MVQ_XSWZ
#define MVQ_XSWZ 0
#endif
// MVQ_SWS (off): the same permutation taken on x's offset in the block's dynamic shared
// memory instead of on the generic address, so that x's stores and loads stay shared-memory
// ones (STS / LDS with 32-bit addresses) where the generic address's 64-bit arithmetic
// makes them generic (ST / LD), ~8 instructions a 16-byte load of x in the dot loops. The
// offset's bit 7 can differ from the address's: a constant XOR of bit 6 over all of x, the
// same bank pattern; writer and readers both take it, so no code moves out of x.
#ifndef MVQ_SWS
#define MVQ_SWS 0
#endif
#if MVQ_XSWZ
#define XSWZ_BITS(a) (((a) >> 3) & 0x30ull) ^ (MVQ_XSWZ == 2 ? ((a) >> 1) & 0x40ull : 0ull)
#if MVQ_SWS
extern __shared__ __align__(128) int4 mvq_smem[];  // the block's dynamic shared memory
template <typename T>
__device__ __forceinline__ T* xswz_smem(T* p) {
    const u32 off = (u32)((const signed char*)p - (const signed char*)mvq_smem);
    return (T*)((signed char*)mvq_smem + (off ^ (u32)XSWZ_BITS(off)));
}
#define XSWZ(p) xswz_smem(p)
#else
#define XSWZ(p) ((decltype(p))((unsigned long long)(p) ^ XSWZ_BITS((unsigned long long)(p))))
#endif
#else
#define XSWZ(p) (p)
#endif
__device__ __forceinline__ int4 ld_x16(const signed char* p) { return *(const int4*)XSWZ(p); }

// element i of a field of sz-byte elements: one wide multiply-add (IMAD.WIDE.U32). The
// kernels count a weight's chunks and blocks in 32 bits (a weight of fewer than 2^32
// chunks: 2^36 weights and more for every type here)
__device__ __forceinline__ const u8* at(const u8* p, u32 i, u32 sz) {
    return p + (unsigned long long)i * sz;
}

// MVQ_HI16: the high nibbles of Q4_0 and Q4_K codes multiplied where they lie, as the
// unsigned bytes (w & 0xF0) = 16 q (dp4a.u32.s32), and the sum shifted right by 4: exact
// (every term is a multiple of 16), one instruction less a word than (w >> 4) & 0x0F.
// On since run 25 (with MVQ_Q4K_PRMT: Q4_K's loop 402 -> 322 instructions a row pair).
#ifndef MVQ_HI16
#define MVQ_HI16 1
#endif
// sum += hi nibbles of w . x (w: four bytes of two nibbles), as (w >> 4) & 0x0F0F0F0F
// would give; with MVQ_HI16 into a sum of 16 times that, which hi_sum() turns back
__device__ __forceinline__ int dp4a_hi(u32 w, int x, int sum) {
    return MVQ_HI16 ? dp4a_us(w & 0xF0F0F0F0u, x, sum) : dp4a((int)((w >> 4) & 0x0F0F0F0Fu), x, sum);
}
__device__ __forceinline__ int hi_sum(int sum) { return MVQ_HI16 ? sum >> 4 : sum; }

#if defined(QTYPE_Q4_K)
// MVQ_Q4K_PRMT: the 6-bit scales and mins of sub-blocks 2 g and 2 g + 1 without branches.
// A lane's g is the same for all its chunks (c = lane + 32 i, g = c % 4 or c / 2 % 4), but
// differs between lanes, so the branches of scale_min2 diverge and a warp runs both (~17
// issue slots a chunk, by cuobjdump). Here two byte permutes gather the bytes that either
// case needs and lane-constant masks keep what each case keeps: the same bytes (an integer
// function; checked against scale_min2 for all g on random words). On since run 25.
#ifndef MVQ_Q4K_PRMT
#define MVQ_Q4K_PRMT 1
#endif
// g of every chunk a lane takes, CPB chunks a block: every caller gives lane l the chunks
// c = l + 32 i (c0 = lane in row_dot2), so g = (c % CPB) / (CPB / 4) is l's; from the
// thread index the compiler sees that it does not change in the loops, and makes the
// masks and selectors once
__device__ __forceinline__ int lane_g(int cpb) { return (int)(threadIdx.x % cpb) / (cpb / 4); }
__device__ __forceinline__ u32 q4k_scale_min2(u32 s0, u32 s1, u32 s2, int g) {
    const bool lo = g < 2;
    // scale bytes 2 g', 2 g' + 1, 2 g' + 4, 2 g' + 5 (g' = g % 2), and for g >= 2 bytes
    // 2 g + 4, 2 g + 5 twice
    const u32 w2 = __byte_perm(s0, s1, (g & 1) ? 0x7632u : 0x5410u);
    const u32 w1 = lo ? w2 : __byte_perm(s2, s2, (g & 1) ? 0x3232u : 0x1010u);
    const u32 m1 = lo ? 0x3F3F3F3Fu : 0x00000F0Fu, m2 = lo ? 0u : 0x0F0F0000u;
    const u32 m3 = lo ? 0u : 0x30303030u;
    return (w1 & m1) | ((w1 >> 4) & m2) | ((w2 >> 2) & m3);
}
#endif

#if defined(QTYPE_Q8_0)
struct QD {  // d, qs[32]: a chunk is half a block (16 codes)
    static constexpr int CPB = 2, UNROLL = MVQ_UNROLL;
    struct Raw {
        uint4 q;
        u32 d;
    };
    __device__ static __forceinline__ Raw load(const Fields& f, u32 gc) {
        Raw r;
        r.q = ld_u128(at(f.p1, gc, 16));
        r.d = ld_u16(at(f.p0, gc / CPB, 2));
        return r;
    }
    // chunk c of a row: block c / 2 of the row, half c % 2
    __device__ static __forceinline__ float dot(const Raw& r, int c, const XQ& x) {
        int jb = c >> 1;
        int4 xv = ld_x16(x.q + 16 * c);
        int s = dp4a((int)r.q.x, xv.x, 0);
        s = dp4a((int)r.q.y, xv.y, s);
        s = dp4a((int)r.q.z, xv.z, s);
        s = dp4a((int)r.q.w, xv.w, s);
        return h2f((u16)r.d) * x.d[jb] * (float)s;
    }
};
#elif defined(QTYPE_Q4_0) || defined(QTYPE_Q5_0)
// Q4_0: d, qs[16]; Q5_0: d, qh, qs[16]. Weight j (< 16): low nibble of qs[j] (Q5_0: bit j of
// qh as bit 4), weight j + 16: high nibble (bit j + 16 of qh); codes minus 8 (Q5_0: 16).
struct QD {
    static constexpr int CPB = 1, UNROLL = MVQ_UNROLL;
    struct Raw {
        uint4 q;
        u32 qh;
        u32 d;
    };
    __device__ static __forceinline__ Raw load(const Fields& f, u32 gc) {  // gc: the block
        Raw r;
#if defined(QTYPE_Q4_0)
        r.q = ld_u128(at(f.p1, gc, 16));
        r.qh = 0;
#else
        r.q = ld_u128(at(f.p2, gc, 16));
        r.qh = ld_u32(at(f.p1, gc, 4));
#endif
        r.d = ld_u16(at(f.p0, gc, 2));
        return r;
    }
    __device__ static __forceinline__ float dot(const Raw& r, int c, const XQ& x) {
        int jb = c;
        int4 xl = ld_x16(x.q + 32 * jb), xh = ld_x16(x.q + 32 * jb + 16);
        int xlo[4] = {xl.x, xl.y, xl.z, xl.w};
        int xhi[4] = {xh.x, xh.y, xh.z, xh.w};
        u32 w[4] = WORDS4(r.q);
        int s = 0;
#if defined(QTYPE_Q5_0) || !MVQ_HI16
#pragma unroll
        for (int e = 0; e < 4; e++) {
            u32 lo = w[e] & 0x0F0F0F0Fu, hi = (w[e] >> 4) & 0x0F0F0F0Fu;
#if defined(QTYPE_Q5_0)
            lo |= spread4_bit4((r.qh >> (4 * e)) & 0xFu);
            hi |= spread4_bit4((r.qh >> (16 + 4 * e)) & 0xFu);
#endif
            s = dp4a((int)lo, xlo[e], s);
            s = dp4a((int)hi, xhi[e], s);
        }
#else  // Q4_0 with MVQ_HI16: the high nibbles' sum apart, 16 times over
        int s_hi = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            s = dp4a((int)(w[e] & 0x0F0F0F0Fu), xlo[e], s);
            s_hi = dp4a_hi(w[e], xhi[e], s_hi);
        }
        s += hi_sum(s_hi);
#endif
#if defined(QTYPE_Q4_0)
        s -= 8 * (x.s[2 * jb] + x.s[2 * jb + 1]);
#else
        s -= 16 * (x.s[2 * jb] + x.s[2 * jb + 1]);
#endif
        return h2f((u16)r.d) * x.d[jb] * (float)s;
    }
};
#elif defined(QTYPE_Q4_K) && MVQ_Q4K_PAIR
// (d, dmin), scales[12], qs[128]: here a chunk is 32 bytes, qs[32 g .. 32 g + 31] (g 0..3):
// its low nibbles are the 32 weights of sub-block 2 g, its high nibbles those of 2 g + 1, so
// one chunk takes one scale and min pair (scale_min2) for 64 weights
struct QD {
    static constexpr int CPB = 4, UNROLL = MVQ_UNROLL_Q4K_PAIR;
    struct Raw {  // the words as loaded: decoding them here would stall the next loads
        uint4 qa, qb;
        u32 dm, s0, s1, s2;
    };
    __device__ static __forceinline__ Raw load(const Fields& f, u32 gc) {
        Raw r;
        const u8* p = at(f.p1, gc, 32);  // qs[32 g ..] of block gc / 4 (g = gc % 4)
        r.qa = ld_u128(p);
        r.qb = ld_u128(p + 16);
        const uint4 hd = ld_u128(at(f.p0, gc / CPB, 16));  // (d, dmin), scales[12]
        r.dm = hd.x, r.s0 = hd.y, r.s1 = hd.z, r.s2 = hd.w;
        return r;
    }
    __device__ static __forceinline__ u32 half12(u32 s0, u32 s1, u32 s2, int i) {
        u32 w = i < 2 ? s0 : (i < 4 ? s1 : s2);
        return (w >> (16 * (i & 1))) & 0xFFFFu;
    }
    __device__ static __forceinline__ u32 scale_min2(u32 s0, u32 s1, u32 s2, int g) {
        u32 a, b;
        if (g < 2) {
            a = half12(s0, s1, s2, g) & 0x3F3Fu;
            b = half12(s0, s1, s2, g + 2) & 0x3F3Fu;
        } else {
            a = (half12(s0, s1, s2, g + 2) & 0x0F0Fu) | ((half12(s0, s1, s2, g - 2) & 0xC0C0u) >> 2);
            b = ((half12(s0, s1, s2, g + 2) >> 4) & 0x0F0Fu) | ((half12(s0, s1, s2, g) & 0xC0C0u) >> 2);
        }
        return a | (b << 16);
    }
    __device__ static __forceinline__ float dot(const Raw& r, int c, const XQ& x) {
        int g = c & 3;
        int jb = (c >> 2) * 8 + 2 * g;  // x's 32-run of sub-block 2 g (the next is 2 g + 1)
        const signed char* xl = x.q + 32 * jb;
        int4 xl0 = ld_x16(xl), xl1 = ld_x16(xl + 16), xh0 = ld_x16(xl + 32), xh1 = ld_x16(xl + 48);
        int xlo[8] = {xl0.x, xl0.y, xl0.z, xl0.w, xl1.x, xl1.y, xl1.z, xl1.w};
        int xhi[8] = {xh0.x, xh0.y, xh0.z, xh0.w, xh1.x, xh1.y, xh1.z, xh1.w};
        u32 w[8] = {r.qa.x, r.qa.y, r.qa.z, r.qa.w, r.qb.x, r.qb.y, r.qb.z, r.qb.w};
        int sl = 0, sh = 0;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            sl = dp4a((int)(w[e] & 0x0F0F0F0Fu), xlo[e], sl);
            sh = dp4a_hi(w[e], xhi[e], sh);
        }
        sh = hi_sum(sh);
        u32 sm = MVQ_Q4K_PRMT ? q4k_scale_min2(r.s0, r.s1, r.s2, lane_g(4)) : scale_min2(r.s0, r.s1, r.s2, g);
        int sc0 = (int)byte_of(sm, 0), sc1 = (int)byte_of(sm, 1);
        int m0 = (int)byte_of(sm, 2), m1 = (int)byte_of(sm, 3);
        float d = h2f((u16)(r.dm & 0xFFFFu)), dmin = h2f((u16)(r.dm >> 16));
        float dx0 = x.d[jb], dx1 = x.d[jb + 1];
        int ql = m0 * (x.s[2 * jb] + x.s[2 * jb + 1]), qh = m1 * (x.s[2 * jb + 2] + x.s[2 * jb + 3]);
        return d * (dx0 * (float)(sc0 * sl) + dx1 * (float)(sc1 * sh)) -
               dmin * (dx0 * (float)ql + dx1 * (float)qh);
    }
};
#elif defined(QTYPE_Q4_K)
// (d, dmin), scales[12], qs[128]: chunk cc (0..7) of a block is qs[16 cc .. 16 cc + 15]; its
// low nibbles are weights 16 h .. 16 h + 15 of sub-block 2 g, its high nibbles the same of
// sub-block 2 g + 1 (g = cc / 2, h = cc % 2); w = d * sc * q - dmin * m per sub-block.
struct QD {
    static constexpr int CPB = 8, UNROLL = MVQ_UNROLL;
    struct Raw {  // the words as loaded: decoding them here would stall the next loads
        uint4 q;
        u32 dm, s0, s1, s2;
    };
    __device__ static __forceinline__ Raw load(const Fields& f, u32 gc) {
        Raw r;
        r.q = ld_u128(at(f.p1, gc, 16));  // qs[16 cc ..] of block gc / 8 (cc = gc % 8)
        const uint4 hd = ld_u128(at(f.p0, gc / CPB, 16));  // (d, dmin), scales[12]
        r.dm = hd.x, r.s0 = hd.y, r.s1 = hd.z, r.s2 = hd.w;
        return r;
    }
    // 16 bits i (0..5) of the 12 scale bytes s0, s1, s2
    __device__ static __forceinline__ u32 half12(u32 s0, u32 s1, u32 s2, int i) {
        u32 w = i < 2 ? s0 : (i < 4 ? s1 : s2);
        return (w >> (16 * (i & 1))) & 0xFFFFu;
    }
    // ggml's get_scale_min_k4 for sub-blocks 2 g and 2 g + 1 at once, on 16-bit pairs (as
    // llama.cpp's vec_dot_q4_K_q8_1): the 6-bit scales and mins as sc0, sc1, m0, m1 bytes
    __device__ static __forceinline__ u32 scale_min2(u32 s0, u32 s1, u32 s2, int g) {
        u32 a, b;
        if (g < 2) {
            a = half12(s0, s1, s2, g) & 0x3F3Fu;
            b = half12(s0, s1, s2, g + 2) & 0x3F3Fu;
        } else {
            a = (half12(s0, s1, s2, g + 2) & 0x0F0Fu) | ((half12(s0, s1, s2, g - 2) & 0xC0C0u) >> 2);
            b = ((half12(s0, s1, s2, g + 2) >> 4) & 0x0F0Fu) | ((half12(s0, s1, s2, g) & 0xC0C0u) >> 2);
        }
        return a | (b << 16);
    }
    __device__ static __forceinline__ float dot(const Raw& r, int c, const XQ& x) {
        int cc = c & 7, g = cc >> 1, h = cc & 1;
        int jb = (c >> 3) * 8 + 2 * g;  // x's 32-run of sub-block 2 g (the next is 2 g + 1)
        int4 xa = ld_x16(x.q + 32 * jb + 16 * h), xb = ld_x16(x.q + 32 * (jb + 1) + 16 * h);
        int xlo[4] = {xa.x, xa.y, xa.z, xa.w};
        int xhi[4] = {xb.x, xb.y, xb.z, xb.w};
        u32 w[4] = WORDS4(r.q);
        int sl = 0, sh = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            sl = dp4a((int)(w[e] & 0x0F0F0F0Fu), xlo[e], sl);
            sh = dp4a_hi(w[e], xhi[e], sh);
        }
        sh = hi_sum(sh);
        u32 sm = MVQ_Q4K_PRMT ? q4k_scale_min2(r.s0, r.s1, r.s2, lane_g(8)) : scale_min2(r.s0, r.s1, r.s2, g);
        int sc0 = (int)byte_of(sm, 0), sc1 = (int)byte_of(sm, 1);
        int m0 = (int)byte_of(sm, 2), m1 = (int)byte_of(sm, 3);
        float d = h2f((u16)(r.dm & 0xFFFFu)), dmin = h2f((u16)(r.dm >> 16));
        float dx0 = x.d[jb], dx1 = x.d[jb + 1];
        int ql = m0 * x.s[2 * jb + h], qh = m1 * x.s[2 * jb + 2 + h];
        return d * (dx0 * (float)(sc0 * sl) + dx1 * (float)(sc1 * sh)) -
               dmin * (dx0 * (float)ql + dx1 * (float)qh);
    }
};
#elif defined(QTYPE_Q6_K) && MVQ_Q6K_PAIR
// ql[128], qh[64], scales[16] (int8), d, as below; here a chunk is the two 16-byte runs of ql
// that share their 16 bytes of qh: u = 2 hh + p (0..3) covers ql[64 hh + 16 p ..] (k = 0, 2)
// and ql[64 hh + 32 + 16 p ..] (k = 1, 3), qh[32 hh + 16 p ..], l = 16 p .. 16 p + 15
struct QD {
    static constexpr int CPB = 4, UNROLL = MVQ_UNROLL_Q6K_PAIR;
    struct Raw {  // the words as loaded: decoding them here would stall the next loads
        uint4 l0, l1, qh;
        u32 sa, sb, d;
    };
    __device__ static __forceinline__ Raw load(const Fields& f, u32 gc) {
        const u32 b = gc / CPB;
        const int u = (int)(gc % CPB);
        int hh = u >> 1, p = u & 1;
        Raw r;
        const u8* lp = at(f.p0, b, 128) + 64 * hh + 16 * p;
        r.l0 = ld_u128(lp);
        r.l1 = ld_u128(lp + 32);
        r.qh = ld_u128(at(f.p1, gc, 16));  // 64 b + 32 hh + 16 p
        const uint2 s8 = ld_u64(at(f.p2, b, 16) + 8 * hh);  // scales 8 hh .. 8 hh + 7
        r.sa = s8.x, r.sb = s8.y;
        r.d = ld_u16(at(f.p3, b, 2));
        return r;
    }
    __device__ static __forceinline__ float dot(const Raw& r, int c, const XQ& x) {
        int u = c & 3, hh = u >> 1, p = u & 1;
        int j0 = (c >> 2) * 8 + 4 * hh;  // x's 32-runs of k = 0..3: j0 + k
        u32 h[4] = WORDS4(r.qh);
        float acc = 0.f;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const uint4 lw = kk == 0 ? r.l0 : r.l1;
            u32 l[4] = WORDS4(lw);
            int ja = j0 + kk, jb = ja + 2;
            int4 xa = ld_x16(x.q + 32 * ja + 16 * p), xb = ld_x16(x.q + 32 * jb + 16 * p);
            int xav[4] = {xa.x, xa.y, xa.z, xa.w};
            int xbv[4] = {xb.x, xb.y, xb.z, xb.w};
            int s_a = 0, s_b = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                u32 qa = (l[e] & 0x0F0F0F0Fu) | (((h[e] >> (2 * kk)) & 0x03030303u) << 4);
                u32 qb = ((l[e] >> 4) & 0x0F0F0F0Fu) | (((h[e] >> (2 * kk + 4)) & 0x03030303u) << 4);
                s_a = dp4a((int)qa, xav[e], s_a);
                s_b = dp4a((int)qb, xbv[e], s_b);
            }
            s_a -= 32 * x.s[2 * ja + p];
            s_b -= 32 * x.s[2 * jb + p];
            int sc_a = (int)(signed char)(u8)byte_of(r.sa, 2 * kk + p);
            int sc_b = (int)(signed char)(u8)byte_of(r.sb, 2 * kk + p);
            acc += x.d[ja] * (float)(sc_a * s_a) + x.d[jb] * (float)(sc_b * s_b);
        }
        return h2f((u16)r.d) * acc;
    }
};
#elif defined(QTYPE_Q6_K)
// ql[128], qh[64], scales[16] (int8), d. Weight 128 hh + 32 k + l of a block (k 0..3, l 0..31):
// low bits in ql[64 hh + 32 (k % 2) + l] (low nibble for k < 2), top bits at bit 2 k of
// qh[32 hh + l], scale 8 hh + 2 k + l / 16, w = d * sc * (q - 32). Chunk cc (0..7):
// hh = cc / 4, kk = (cc / 2) % 2, p = cc % 2 covers ql[64 hh + 32 kk + 16 p ..] (16 bytes):
// its low nibbles are k = kk, its high nibbles k = kk + 2, with l = 16 p .. 16 p + 15.
struct QD {
    static constexpr int CPB = 8, UNROLL = MVQ_UNROLL_Q6K;
    struct Raw {  // the words as loaded: decoding them here would stall the next loads
        uint4 ql, qh;
        u32 sa, sb, d;
    };
    __device__ static __forceinline__ Raw load(const Fields& f, u32 gc) {
        const u32 b = gc / CPB;
        const int cc = (int)(gc % CPB);
        int hh = cc >> 2, p = cc & 1;
        Raw r;
        r.ql = ld_u128(at(f.p0, gc, 16));  // 128 b + 64 hh + 32 kk + 16 p
        r.qh = ld_u128(at(f.p1, b, 64) + 32 * hh + 16 * p);
        const uint2 s8 = ld_u64(at(f.p2, b, 16) + 8 * hh);  // scales 8 hh .. 8 hh + 7
        r.sa = s8.x, r.sb = s8.y;
        r.d = ld_u16(at(f.p3, b, 2));
        return r;
    }
    __device__ static __forceinline__ float dot(const Raw& r, int c, const XQ& x) {
        int cc = c & 7, hh = cc >> 2, kk = (cc >> 1) & 1, p = cc & 1;
        int ja = (c >> 3) * 8 + 4 * hh + kk, jb = ja + 2;  // x's 32-runs of k = kk, kk + 2
        int4 xa = ld_x16(x.q + 32 * ja + 16 * p), xb = ld_x16(x.q + 32 * jb + 16 * p);
        int xav[4] = {xa.x, xa.y, xa.z, xa.w};
        int xbv[4] = {xb.x, xb.y, xb.z, xb.w};
        u32 l[4] = WORDS4(r.ql);
        u32 h[4] = WORDS4(r.qh);
        int s_a = 0, s_b = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            u32 qa = (l[e] & 0x0F0F0F0Fu) | (((h[e] >> (2 * kk)) & 0x03030303u) << 4);
            u32 qb = ((l[e] >> 4) & 0x0F0F0F0Fu) | (((h[e] >> (2 * kk + 4)) & 0x03030303u) << 4);
            s_a = dp4a((int)qa, xav[e], s_a);
            s_b = dp4a((int)qb, xbv[e], s_b);
        }
        s_a -= 32 * x.s[2 * ja + p];
        s_b -= 32 * x.s[2 * jb + p];
        int sc_a = (int)(signed char)(u8)byte_of(r.sa, 2 * kk + p);
        int sc_b = (int)(signed char)(u8)byte_of(r.sb, 2 * kk + p);
        float d = h2f((u16)r.d);
        return d * (x.d[ja] * (float)(sc_a * s_a) + x.d[jb] * (float)(sc_b * s_b));
    }
};
#else
#error "mmvq.cu: no int8-activation kernel for this type"
#endif

static_assert(Q::BLOCK / QD::CPB == 16 || Q::BLOCK / QD::CPB == 32 || Q::BLOCK / QD::CPB == 64,
              "a chunk is 16, 32 or 64 weights");

// One iteration of a row pair: the loads of chunks c0 + 32 u (u < UNROLL) of rows a and b
// (b only with `two`), and their dots with the n rows of x. ALL: the caller knows that
// both rows are there and every chunk of every iteration is in range (cpr a multiple of
// 32 UNROLL: the 4096- and 14336-wide rows of the 8B shape), so no lane tests either:
// each test is a branch and a reconvergence point per chunk (~15% of the loop's issue
// slots with Q4_K, by cuobjdump).
template <bool ALL = false>
__device__ __forceinline__ void load_iter(const Fields& fa, i64 ba, const Fields& fb, i64 bb,
                                          bool two, int cpr, int c0, QD::Raw* ra, QD::Raw* rb) {
#pragma unroll
    for (int u = 0; u < QD::UNROLL; u++) {
        int c = c0 + 32 * u;
        if (ALL || c < cpr) {
            ra[u] = QD::load(fa, (u32)ba * QD::CPB + c);
            if (ALL || two) rb[u] = QD::load(fb, (u32)bb * QD::CPB + c);
        }
    }
}

template <int NT, bool ALL = false>
__device__ __forceinline__ void dot_iter(const QD::Raw* ra, const QD::Raw* rb, bool two, int cpr,
                                         int c0, XQ x0, int k, int n, float* acc_a,
                                         float* acc_b) {
    int nb32 = k >> 5;
#pragma unroll
    for (int u = 0; u < QD::UNROLL; u++) {
        int c = c0 + 32 * u;
        if (ALL || c < cpr) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < n) {
                    XQ xt = {x0.q + t * k, x0.d + t * nb32, x0.s + 2 * t * nb32};
                    acc_a[t] += QD::dot(ra[u], c, xt);
                    if (ALL || two) acc_b[t] += QD::dot(rb[u], c, xt);
                }
            }
        }
    }
}

// acc_a[t] += row a . x_t and, with `two`, acc_b[t] += row b . x_t over the cpr chunks of
// the rows (this lane's share: chunks lane + 32 i). Both rows' loads are issued before
// either is used, so that a warp has 2 * QD::UNROLL chunks per lane in flight. With PRE the
// first iteration's chunks are already in pa, pb (load_iter at c0 = lane). ALL: as
// load_iter's (the caller checks it: `two` and cpr a multiple of 32 QD::UNROLL).
template <int NT, bool PRE, bool ALL>
__device__ __forceinline__ void row_dot2(const Fields& fa, i64 ba, const Fields& fb, i64 bb,
                                         bool two, int cpr, int lane, XQ x0, int k, int n,
                                         float* acc_a, float* acc_b, const QD::Raw* pa,
                                         const QD::Raw* pb) {
    int c0 = lane;
    if constexpr (PRE) {
        dot_iter<NT, ALL>(pa, pb, two, cpr, c0, x0, k, n, acc_a, acc_b);
        c0 += 32 * QD::UNROLL;
    }
    for (; c0 < cpr; c0 += 32 * QD::UNROLL) {
        QD::Raw ra[QD::UNROLL], rb[QD::UNROLL];
        load_iter<ALL>(fa, ba, fb, bb, two, cpr, c0, ra, rb);
        dot_iter<NT, ALL>(ra, rb, two, cpr, c0, x0, k, n, acc_a, acc_b);
    }
}

// which weight row `row` of the launch is: its fields, first block, output and row count
struct RowRef {
    Fields f;
    i64 b0;
    float* y;
    int r, m, slot;
};

__device__ __forceinline__ RowRef locate(int row, int bpr, const u8* w0, i64 nb0, int m0,
                                         float* y0, const u8* w1, i64 nb1, int m1, float* y1,
                                         const u8* w2, i64 nb2, int m2, float* y2) {
    RowRef rr;
    if (row < m0) {
        rr.f = make_fields(w0, nb0), rr.r = row, rr.m = m0, rr.y = y0, rr.slot = 0;
    } else if (row < m0 + m1) {
        rr.f = make_fields(w1, nb1), rr.r = row - m0, rr.m = m1, rr.y = y1, rr.slot = 1;
    } else {
        rr.f = make_fields(w2, nb2), rr.r = row - m0 - m1, rr.m = m2, rr.y = y2, rr.slot = 2;
    }
    rr.b0 = (i64)rr.r * bpr;
    return rr;
}

// Rows of up to three weights (w0, w1, w2: m0 + m1 + m2 rows, each into its own y) times the
// n (<= NT) rows of x: y_i[t, r] = W_i[r] . x[t] (y0 = resid + W0 x with has_resid). With
// act (1: SiLU, 2: GELU), w0 and w1 are a gate and an up weight of m0 rows and
// y0[t, r] = act(W0[r] . x[t]) * (W1[r] . x[t]), as silu_mul / gelu_mul compute it.
// Dynamic shared memory: n * k * 11 / 8 bytes (codes, scales, half sums).
//
// ROPE (one token; w0, w1, w2 are Q, K and V): the rows are taken in RoPE's pairs (2 i, 2 i + 1)
// of a head, or (i, i + n_rot / 2) with neox, and lane 0 turns each pair of q and k as the
// rope kernel does (ops.cu, rope_head: the same float32 operations) before it writes y0 (q)
// and y1 (k); k and v (y2) also go to row *start of the fp16 caches *kcs and *vcs (a graph's
// parameters, like the position), as store_kv rounds them. This folds rope(q), rope(k) and store_kv into the Q/K/V launch.
struct RopeArgs {
    const int* pos;    // the token's position (device memory: graphs replay at any position)
    const int* start;  // the cache row written
    u16* const* kcs;   // the layer's caches, kcs[0] and vcs[0]
    u16* const* vcs;
    int head_dim, head_dim_v, n_rot, neox, n_ctx;
    float theta_scale, freq_scale;
};

// rows (ra, rb) of pair p of a weight with heads of hd rows, and whether RoPE turns them
__device__ __forceinline__ bool rope_pair(int p, int hd, int n_rot, int neox, int* ra, int* rb) {
    int h = p / (hd >> 1), i = p - h * (hd >> 1), half = n_rot >> 1;
    bool rot = i < half;
    int a = (rot && neox) ? i : 2 * i;
    int b = (rot && neox) ? i + half : 2 * i + 1;
    *ra = h * hd + a;
    *rb = h * hd + b;
    return rot;
}

template <bool B>
struct BoolC {
    static constexpr bool value = B;
};

// A warp's unit of work: rows a and b (b only with `two`) of the launch's weights, with
// their dots taken together; for RoPE also the pair's index in its head and whether it turns.
struct Job {
    RowRef a, b;
    bool two, rot;
    int pair;
};

// value v's int8 code in a run of max |x| amax and scale d = amax / 127: rint(v * (127 /
// amax)) as ggml-cpu's quantize_row_q8_1; with MVQ_QRCP=0, round(v / d) as llama.cpp CUDA's
__device__ __forceinline__ int x_code(float v, float amax, float d) {
#if MVQ_QRCP
    const float id = amax == 0.0f ? 0.0f : 127.0f / amax;
    const int q = __float2int_rn(__fmul_rn(v, id));
#else
    const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
#endif
    return max(-127, min(127, q));
}

// MVQ_T0 (off): the one-token kernels take x's token index as 0 without dividing (with one
// token every value in x is token 0's): an integer division by k a value of x's rounds is
// ~24 instructions, two a round, and the first stands before x's loads are issued
#ifndef MVQ_T0
#define MVQ_T0 0
#endif
// the token of x's values 4 i4 .. 4 i4 + 3 in a kernel of NT tokens of k values each (0 for
// values past x's end, `in` false)
template <int NT>
__device__ __forceinline__ int x_token(int i4, bool in, int k) {
    if (MVQ_T0 && NT == 1) return 0;
    return in ? (4 * i4) / k : 0;
}

// x's values 4 i4 .. 4 i4 + 3 (v) as int8 codes into sq, their run's scale into sd and the
// half sums into ss: 8 lanes a run of 32 (Q8_1's scheme), so every lane of the warp calls
// it; `in`: whether this lane's values are x's (else it only joins the shuffles)
__device__ __forceinline__ void quantize4(float4 v, int i4, bool in, signed char* sq, float* sd,
                                          int* ss) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.0f;
    int q[4];
    float vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; e++) q[e] = x_code(vv[e], amax, d);
    int hs = q[0] + q[1] + q[2] + q[3];
    hs += __shfl_xor_sync(0xffffffffu, hs, 1);
    hs += __shfl_xor_sync(0xffffffffu, hs, 2);
    if (in) {
        int run = i4 >> 3, sub = i4 & 7;  // run index = t * nb32 + j / 32
        u32 packed = (u32)(q[0] & 0xFF) | ((u32)(q[1] & 0xFF) << 8) |
                     ((u32)(q[2] & 0xFF) << 16) | ((u32)(q[3] & 0xFF) << 24);
        *(u32*)XSWZ(sq + 4 * i4) = packed;
        if ((sub & 3) == 0) ss[2 * run + (sub >> 2)] = hs;
        if (sub == 0) sd[run] = d;
    }
}

// x's values 16 h .. 16 h + 15 (v) as int8 codes into sq, the run's scale into sd (from the
// even lane of the pair) and the half's sum into ss; every lane of the warp calls it (the
// shuffle with lane ^ 1), `in`: whether this lane's values are x's
__device__ __forceinline__ void quantize16(const float4 (&v)[4], int h, bool in, signed char* sq,
                                           float* sd, int* ss) {
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 4; e++)
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[e].x), fabsf(v[e].y)),
                                 fmaxf(fabsf(v[e].z), fabsf(v[e].w))));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float d = amax / 127.0f;
    u32 w[4];
    int hs = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int q0 = x_code(v[e].x, amax, d), q1 = x_code(v[e].y, amax, d);
        const int q2 = x_code(v[e].z, amax, d), q3 = x_code(v[e].w, amax, d);
        hs += q0 + q1 + q2 + q3;
        w[e] = (u32)(q0 & 0xFF) | ((u32)(q1 & 0xFF) << 8) | ((u32)(q2 & 0xFF) << 16) |
               ((u32)(q3 & 0xFF) << 24);
    }
    if (in) {
        *(int4*)XSWZ(sq + 16 * h) = make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
        ss[h] = hs;  // (2 run + half)
        if ((h & 1) == 0) sd[h >> 1] = d;
    }
}

// W: warps per block (the kernel's launch bound: MVQ_WARPS, or MVQ_SMALL_WARPS)
template <int NT, int XB, bool ROPE, int W>
__device__ __forceinline__ void mvq_body(
    const u8* __restrict__ w0, i64 nb0, int m0, float* y0, const u8* __restrict__ w1, i64 nb1,
    int m1, float* y1, const u8* __restrict__ w2, i64 nb2, int m2, float* y2, int k,
    const float* __restrict__ x, int n, const float* __restrict__ norm_w, float eps, int norm,
    const float* __restrict__ resid, int has_resid, int act, RopeArgs ra, double* ssq_out,
    const double* __restrict__ ssq_in, int ssq_n, int pdl_at) {
#if MVQ_XSWZ && MVQ_SWS
    // (mvq_smem declared with XSWZ above)
#elif MVQ_XSWZ  // x's codes (first) start 128-byte aligned: past the static arrays (s_cs ...)
    extern __shared__ __align__(128) int4 mvq_smem[];
#else
    extern __shared__ int4 mvq_smem[];
#endif
    MVQ_TR(tr_0);
#if MVQ_TRACE
    unsigned long long tr_f = 0, tr_x1 = 0, tr_i = 0, tr_xl = 0;
#endif
    __shared__ double red[W];
    __shared__ float s_scale[NT];
    __shared__ float2 s_cs[ROPE ? 128 : 1];  // RoPE: (cos, sin) of pair i of a head
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nb32 = k >> 5;
    int bpr = k / Q::BLOCK, cpr = bpr * QD::CPB;
    int m_rows = act ? m0 : m0 + m1 + m2;
    int row_first = blockIdx.x * W + warp;
    int n_warps = gridDim.x * W;

    // Jobs: a gate row and its up row (act); a RoPE pair of q, k or v rows (ROPE: m0 / 2
    // pairs of q, then m1 / 2 of k, then m2 / 2 of v); else rows j and j + n_warps. Warp w
    // takes jobs w, w + n_warps, ... (of the second kind, w, w + 2 n_warps, ...).
    const int pq = m0 >> 1, pk = m1 >> 1;
    const int n_jobs = ROPE ? pq + pk + (m2 >> 1) : m_rows;
    const int job_step = (ROPE || act) ? n_warps : 2 * n_warps;
    auto job_at = [&](int j) {
        Job jb;
        jb.rot = false;
        jb.pair = 0;
        if constexpr (ROPE) {
            const int slot = j < pq ? 0 : (j < pq + pk ? 1 : 2);
            const int pp = slot == 0 ? j : (slot == 1 ? j - pq : j - pq - pk);
            int r_a, r_b;
            jb.rot = rope_pair(pp, slot == 2 ? ra.head_dim_v : ra.head_dim,
                               slot == 2 ? 0 : ra.n_rot, ra.neox, &r_a, &r_b);
            jb.pair = pp;
            Fields f = make_fields(slot == 0 ? w0 : (slot == 1 ? w1 : w2),
                                   slot == 0 ? nb0 : (slot == 1 ? nb1 : nb2));
            float* y = slot == 0 ? y0 : (slot == 1 ? y1 : y2);
            const int m = slot == 0 ? m0 : (slot == 1 ? m1 : m2);
            jb.a = RowRef{f, (i64)r_a * bpr, y, r_a, m, slot};
            jb.b = RowRef{f, (i64)r_b * bpr, y, r_b, m, slot};
            jb.two = true;
        } else if (act) {
            jb.a = RowRef{make_fields(w0, nb0), (i64)j * bpr, y0, j, m0, 0};
            jb.b = RowRef{make_fields(w1, nb1), (i64)j * bpr, y0, j, m0, 1};
            jb.two = true;
        } else {
            const int j_b = j + n_warps;
            jb.two = j_b < m_rows;
            jb.a = locate(j, bpr, w0, nb0, m0, y0, w1, nb1, m1, y1, w2, nb2, m2, y2);
            jb.b = locate(jb.two ? j_b : j, bpr, w0, nb0, m0, y0, w1, nb1, m1, y1, w2, nb2, m2,
                          y2);
        }
        return jb;
    };

    // the next launch is let in at pdl_at's point: 0 here, 1 after the wait, 2 at the end
    pdl_trigger_at(0, pdl_at);
    // The weights are constant, so the first job's first iteration of loads goes out now,
    // into registers, while x is read and quantized (and, with dependent launches, while the
    // kernel before still runs). (An L2 prefetch of the warp's first rows besides, 2 or 8 KB
    // a warp, made both the 135M and the 8B shapes 4-6% slower: run 10.)
    QD::Raw pa[QD::UNROLL], pb[QD::UNROLL];
    // (one token only: with NT rows of x the registers would spill)
    const bool have_first = MVQ_PRELOAD && NT == 1 && row_first < n_jobs;
    if (have_first) {
        Job jb = job_at(row_first);
        load_iter(jb.a.f, jb.a.b0, jb.b.f, jb.b.b0, jb.two, cpr, lane, pa, pb);
    }
    if constexpr (ROPE) {
        // every pair's angle, with rope_head's float32 operations (ops.cu), before the dots:
        // not on the critical path of each pair's epilogue. The position was copied to the
        // device before the graph's first kernel, so it may be read before the wait.
        const float p_f = (float)*ra.pos;
        for (int i = threadIdx.x; i < (ra.n_rot >> 1); i += blockDim.x)
            s_cs[i] = rope_cs(p_f, i, ra.theta_scale, ra.freq_scale);
    }
    pdl_wait();
    MVQ_TR(tr_1);
    pdl_trigger_at(1, pdl_at);

    signed char* sq = (signed char*)mvq_smem;
    float* sd = (float*)(sq + n * k);
    int* ss = (int*)(sd + n * nb32);
    // ssq_in (one token, with norm): the sum of x's squares comes from the launch that wrote
    // x, one partial sum a block of it (ssq_n of them, at most MVQ_SSQ_MAX): loaded beside x
    // in its first round, so the norm costs no round trip and no block barrier of its own
    // (not in the wide-x kernel, XB 4, whose registers it would spill: no normed x is wide)
    const bool ssq = NT == 1 && XB <= 2 && norm && ssq_in != nullptr;
    if (norm && !ssq) {
        for (int t = 0; t < n; t++) {
            const float4* xt = (const float4*)(x + (i64)t * k);
            double acc = 0.0;
#pragma unroll 4
            for (int j = threadIdx.x; j < k / 4; j += W * 32) {
                float4 v = __ldg(xt + j);
                acc += (double)v.x * v.x + (double)v.y * v.y;
                acc += (double)v.z * v.z + (double)v.w * v.w;
            }
            block_rms_scale(acc, red, W, k, eps, &s_scale[t]);
        }
    }
    // Each thread takes 4 consecutive values, 8 lanes a run of 32: its scale, codes and half
    // sums. Every lane of the block goes through the same number of rounds (the shuffles
    // need whole warps); lanes past the end compute on zeros and store nothing. The loads
    // of XB rounds are issued before the first is used (wide x: one latency, not XB).
    int n4 = n * k / 4;
    float ssq_scale = 0.f;
    // with ssq: the writer's partial sums, issued before x's first loads and added after
    // them (one round trip); the same sum, bit for bit, in every lane of every block
    auto ssq_issue = [&](double (&sl)[MVQ_SSQ_MAX / 32]) {
#pragma unroll
        for (int u = 0; u < MVQ_SSQ_MAX / 32; u++) {
            const int i = lane + 32 * u;
            sl[u] = i < ssq_n ? ssq_in[i] : 0.0;
        }
    };
    auto ssq_add = [&](const double (&sl)[MVQ_SSQ_MAX / 32]) {
        double v = 0.0;
#pragma unroll
        for (int u = 0; u < MVQ_SSQ_MAX / 32; u++) v += sl[u];
        return rms_scale(warp_sum_d(v), k, eps);  // block_rms_scale's float32 steps
    };
#if MVQ_Q16
    // one token: 16 values a lane (quantize16), H halves a lane's loads issued at once (the
    // wide x's two: one latency, not two); warps past x's end leave
    constexpr int H = XB >= 4 ? 2 : 1;
    const int nh = NT == 1 ? k / 16 : 0;
    if (NT == 1) n4 = 0;  // (no rounds of quantize4)
    for (int b = 0; b < nh && b + 32 * warp < nh; b += H * W * 32) {
        float4 xv[H][4], gv[H][4];
        double sl[MVQ_SSQ_MAX / 32];
        if (ssq && b == 0) ssq_issue(sl);
#pragma unroll
        for (int r = 0; r < H; r++) {
            const int h = b + r * W * 32 + threadIdx.x;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                xv[r][e] = gv[r][e] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (h < nh) xv[r][e] = __ldg((const float4*)x + 4 * h + e);
                if (h < nh && norm) gv[r][e] = __ldg((const float4*)norm_w + 4 * h + e);
            }
        }
        if (ssq && b == 0) ssq_scale = ssq_add(sl);
        MVQ_TR_LANDED((MVQ_TRACE_DEP & 1 ? xv[H - 1][3].w : 0.f) +
                      (MVQ_TRACE_DEP & 2 ? gv[H - 1][3].w : 0.f) +
                      (MVQ_TRACE_DEP & 4 ? ssq_scale : 0.f));
#pragma unroll
        for (int r = 0; r < H; r++) {
            const int h = b + r * W * 32 + threadIdx.x;
            if (norm && h < nh) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    xv[r][e] = norm4(xv[r][e], ssq ? ssq_scale : s_scale[0], gv[r][e]);
            }
            quantize16(xv[r], h, h < nh, sq, sd, ss);
        }
        MVQ_TR_X1();
    }
#endif
    for (int base0 = 0; base0 < n4; base0 += XB * W * 32) {
        float4 xv[XB], gv[XB];
        double sl[MVQ_SSQ_MAX / 32];
        if (ssq && base0 == 0) ssq_issue(sl);
#pragma unroll
        for (int r = 0; r < XB; r++) {
            int i4 = base0 + r * W * 32 + threadIdx.x;
            bool in = i4 < n4;
            int t = x_token<NT>(i4, in, k);
            int j = 4 * i4 - t * k;
            xv[r] = gv[r] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (in) xv[r] = __ldg((const float4*)(x + (i64)t * k + j));
            if (in && norm) gv[r] = __ldg((const float4*)(norm_w + j));
        }
        if (ssq && base0 == 0) ssq_scale = ssq_add(sl);
        MVQ_TR_LANDED((MVQ_TRACE_DEP & 1 ? xv[XB - 1].w : 0.f) +
                      (MVQ_TRACE_DEP & 2 ? gv[XB - 1].w : 0.f) +
                      (MVQ_TRACE_DEP & 4 ? ssq_scale : 0.f));
#pragma unroll
        for (int r = 0; r < XB; r++) {
            int i4 = base0 + r * W * 32 + threadIdx.x;
            bool in = i4 < n4;
            int t = x_token<NT>(i4, in, k);
            float4 v = xv[r];
            if (norm && in) v = norm4(v, ssq ? ssq_scale : s_scale[t], gv[r]);
            quantize4(v, i4, in, sq, sd, ss);
        }
        MVQ_TR_X1();
    }
    __syncthreads();
    MVQ_TR(tr_2);

    XQ x0 = {sq, sd, ss};
    const int crow = ROPE ? *ra.start : 0;
    u16* const kc = ROPE ? *ra.kcs : nullptr;
    u16* const vc = ROPE ? *ra.vcs : nullptr;
    // ssq_out (one token, one weight, with resid): lane 0 of each warp adds the squares of
    // the outputs it writes (the next launch's x), and the block's sum goes to
    // ssq_out[blockIdx.x] at the end (ssq_epilogue), warps in order
    double ssq_acc = 0.0;
    // a job's sums over the warp's lanes, and their outputs
    auto finish = [&](const Job& jb, const float* acc_a, const float* acc_b) {
        if constexpr (ROPE) {
            float o0 = warp_sum(acc_a[0]), o1 = warp_sum(acc_b[0]);
            if (lane == 0) {
                if (jb.rot) {  // rope_head's arithmetic, pair i of the head
                    const int hd = ra.head_dim, i = jb.pair - (jb.pair / (hd >> 1)) * (hd >> 1);
                    const float2 cs = s_cs[i];
                    float x0v = o0, x1v = o1;
                    o0 = __fsub_rn(__fmul_rn(x0v, cs.x), __fmul_rn(x1v, cs.y));
                    o1 = __fadd_rn(__fmul_rn(x0v, cs.y), __fmul_rn(x1v, cs.x));
                }
                jb.a.y[jb.a.r] = o0;
                jb.b.y[jb.b.r] = o1;
                if (jb.a.slot > 0 && crow < ra.n_ctx) {  // the host checks the bound first
                    u16* c = jb.a.slot == 1 ? kc + (i64)crow * m1 : vc + (i64)crow * m2;
                    c[jb.a.r] = f2h(o0);
                    c[jb.b.r] = f2h(o1);
                }
            }
        } else if (act) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < n) {
                    float gv = warp_sum(acc_a[t]), uv = warp_sum(acc_b[t]);
                    if (lane == 0) {
                        y0[(i64)t * m0 + jb.a.r] = act == 1 ? silu_mul1(gv, uv) : gelu_mul1(gv, uv);
                    }
                }
            }
        } else {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < n) {
                    float va = warp_sum(acc_a[t]);
                    float vb = warp_sum(acc_b[t]);
                    if (lane == 0) {
                        const RowRef& a = jb.a;
                        const RowRef& b = jb.b;
                        i64 at = (i64)t * a.m + a.r;
                        const float ya = (has_resid && a.slot == 0) ? __fadd_rn(resid[at], va) : va;
                        a.y[at] = ya;
                        if (NT == 1 && a.slot == 0) ssq_acc += (double)ya * ya;
                        if (jb.two) {
                            i64 bt = (i64)t * b.m + b.r;
                            const float yb = (has_resid && b.slot == 0) ? __fadd_rn(resid[bt], vb) : vb;
                            b.y[bt] = yb;
                            if (NT == 1 && b.slot == 0) ssq_acc += (double)yb * yb;
                        }
                    }
                }
            }
        }
    };
    auto ssq_epilogue = [&]() {
        if (NT == 1 && ssq_out != nullptr) {
            if (lane == 0) red[warp] = ssq_acc;
            __syncthreads();
            if (threadIdx.x == 0) {
                double v = 0.0;
                for (int w = 0; w < W; w++) v += red[w];
                ssq_out[blockIdx.x] = v;
            }
        }
    };
    // a row's chunks are whole iterations (row_dot2's ALL, with both rows of a job)
    const bool whole = cpr % (32 * QD::UNROLL) == 0;
    // f(BoolC<ALL>) for job jb: ALL where both its rows are there and whole iterations
    auto with_all = [&](const Job& jb, auto f) {
        if (whole && jb.two) f(BoolC<true>{});
        else f(BoolC<false>{});
    };
    auto run_job = [&](const Job& jb, auto pre) {
        float acc_a[NT], acc_b[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) acc_a[t] = acc_b[t] = 0.f;
        with_all(jb, [&](auto all) {
            row_dot2<NT, decltype(pre)::value, decltype(all)::value>(
                jb.a.f, jb.a.b0, jb.b.f, jb.b.b0, jb.two, cpr, lane, x0, k, n, acc_a, acc_b, pa,
                pb);
        });
        finish(jb, acc_a, acc_b);
    };
#if MVQ_PIPE
    // MVQ_PIPE: the warp's (job, iteration) units as one stream, each unit's loads issued
    // before the unit ahead of it is multiplied, so that a lane always has a unit in flight
    // (across jobs too: the 8B's 4096-wide rows are one unit a job). Two register sets,
    // taken in turn (ping-pong, no copies); the first is the preload above (so not without
    // MVQ_PRELOAD, whose build takes the loop below).
    if constexpr (NT == 1 && MVQ_PRELOAD) {
        if (have_first) {
            const int n_it = (cpr + 32 * QD::UNROLL - 1) / (32 * QD::UNROLL);
            QD::Raw qa[QD::UNROLL], qb[QD::UNROLL];
            int jc = row_first, it = 0;
            float acc_a[1] = {0.f}, acc_b[1] = {0.f};
            // multiply the unit (job jc, iteration it) in (ca, cb) after issuing the next
            // one's loads into (na, nb); false when the warp has no unit left. (Jobs are
            // located again where they are used, rather than kept live across units.)
            auto step = [&](const QD::Raw* ca, const QD::Raw* cb, QD::Raw* na, QD::Raw* nb) {
                int it_n = it + 1, j_n = jc;
                if (it_n == n_it) it_n = 0, j_n = jc + job_step;
                const bool more = j_n < n_jobs;
                if (more) {
                    const Job jn = job_at(j_n);
                    const int c_n = lane + 32 * QD::UNROLL * it_n;
                    with_all(jn, [&](auto all) {
                        load_iter<decltype(all)::value>(jn.a.f, jn.a.b0, jn.b.f, jn.b.b0, jn.two,
                                                        cpr, c_n, na, nb);
                    });
                }
                MVQ_TR_ISSUED();
                const Job jb = job_at(jc);
                const int c = lane + 32 * QD::UNROLL * it;
                with_all(jb, [&](auto all) {
                    dot_iter<1, decltype(all)::value>(ca, cb, jb.two, cpr, c, x0, k, n, acc_a, acc_b);
                });
                if (it == n_it - 1) {
                    finish(jb, acc_a, acc_b);
                    acc_a[0] = acc_b[0] = 0.f;
                }
                it = it_n, jc = j_n;
                MVQ_TR_FIRST();
                return more;
            };
            while (step(pa, pb, qa, qb) && step(qa, qb, pa, pb)) {
            }
        }
        ssq_epilogue();
        MVQ_TR_END();
        pdl_trigger_at(2, pdl_at);
        return;
    }
#endif
    // the first job from the registers loaded above (peeled, so that they are dead after it)
    int j = row_first;
    if (MVQ_PRELOAD && NT == 1 && have_first) {
        run_job(job_at(j), BoolC<true>{});
        j += job_step;
    }
    for (; j < n_jobs; j += job_step) run_job(job_at(j), BoolC<false>{});
    ssq_epilogue();
    MVQ_TR_END();
    pdl_trigger_at(2, pdl_at);
}

#ifndef RING_BUILD  // ring.cu builds the code above without the kernels
#define MVQ_PARAMS                                                                          \
    const u8 *__restrict__ w0, i64 nb0, int m0, float *y0, const u8 *__restrict__ w1, i64 nb1, \
        int m1, float *y1, const u8 *__restrict__ w2, i64 nb2, int m2, float *y2, int k,      \
        const float *__restrict__ x, int n, const float *__restrict__ norm_w, float eps,      \
        int norm, const float *__restrict__ resid, int has_resid, int act,                   \
        const int *rope_pos, const int *rope_start, u16 *const *kcs, u16 *const *vcs,        \
        int head_dim, int head_dim_v, int n_rot, int neox, int n_ctx, float theta_scale,     \
        float freq_scale, double *ssq_out, const double *ssq_in, int ssq_n, int pdl_at
#define MVQ_ARGS                                                                           \
    w0, nb0, m0, y0, w1, nb1, m1, y1, w2, nb2, m2, y2, k, x, n, norm_w, eps, norm, resid,     \
        has_resid, act,                                                                    \
        RopeArgs{rope_pos, rope_start, kcs,   vcs,         head_dim,   head_dim_v,            \
                 n_rot,    neox,       n_ctx, theta_scale, freq_scale}, ssq_out, ssq_in, ssq_n, pdl_at

// n <= MV_MAX_TOKENS rows of x (short batches), n <= 2 and n <= 4 (fewer accumulators a
// row: the server's decode steps of a few sequences), and the decode case n = 1 (fewer
// registers). Each row of x gets the same float operations in all of them.
extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32) matvec_q8(MVQ_PARAMS) {
    mvq_body<MV_MAX_TOKENS, 1, false, MVQ_WARPS>(MVQ_ARGS);
}

extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32) matvec_q8_2(MVQ_PARAMS) {
    mvq_body<2, 1, false, MVQ_WARPS>(MVQ_ARGS);
}

extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32) matvec_q8_4(MVQ_PARAMS) {
    mvq_body<4, 1, false, MVQ_WARPS>(MVQ_ARGS);
}

extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32, MVQ_MIN_BLOCKS) matvec_q8_n1(MVQ_PARAMS) {
    mvq_body<1, 1, false, MVQ_WARPS>(MVQ_ARGS);
}

#if MVQ_SMALL_WARPS < MVQ_WARPS
// one token, a small grid (MVQ_SMALL_WARPS above): each warp gets the registers of
// matvec_q8_n1's, and x's loads go out MVQ_WARPS / MVQ_SMALL_WARPS rounds at a time, so that
// a block quantizes x in as many round trips as a block of MVQ_WARPS warps
#define MVQ_SMALL_BLOCKS (MVQ_MIN_BLOCKS * MVQ_WARPS / MVQ_SMALL_WARPS)
extern "C" __global__ void __launch_bounds__(MVQ_SMALL_WARPS * 32, MVQ_SMALL_BLOCKS) matvec_q8_n1_small(MVQ_PARAMS) {
    mvq_body<1, MVQ_WARPS / MVQ_SMALL_WARPS, false, MVQ_SMALL_WARPS>(MVQ_ARGS);
}
#endif

// one token of a wide x (the feed-forward's down matrix): x's loads four rounds at a time, in
// a kernel of its own so that the registers this takes don't weigh on the others
extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32, MVQ_MIN_BLOCKS) matvec_q8_n1_wide(MVQ_PARAMS) {
    mvq_body<1, 4, false, MVQ_WARPS>(MVQ_ARGS);
}

// one token's Q, K and V with RoPE and the KV cache write (ROPE above)
extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32, MVQ_MIN_BLOCKS) matvec_q8_n1_rope(MVQ_PARAMS) {
    mvq_body<1, 1, true, MVQ_WARPS>(MVQ_ARGS);
}
#endif  // RING_BUILD
