// Helpers shared by the CUDA backend's kernels (included into every module's source).
//
// No CUDA headers are included: NVRTC compiles these without cuda_fp16.h or the C
// library, so they build wherever CuPy finds NVRTC. fp16 conversions are single PTX
// instructions; small unsigned integers become floats through the exponent-bias trick
// (2^23 + q has q in its mantissa), which is exact and avoids the slow I2F conversion.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// q (0 <= q < 2^23) as a float, exactly: 2^23 + q has q in its mantissa.
__device__ __forceinline__ float u2f(u32 q) {
    return __uint_as_float(0x4B000000u | q) - 8388608.0f;
}

// q - offset as a float, exactly, for 0 <= q < 2^23 and small offsets.
__device__ __forceinline__ float u2f_off(u32 q, float magic_plus_offset) {
    return __uint_as_float(0x4B000000u | q) - magic_plus_offset;
}

__device__ __forceinline__ u32 ld_u32(const u8* p) { return __ldg((const u32*)p); }
__device__ __forceinline__ u16 ld_u16(const u8* p) { return __ldg((const u16*)p); }
__device__ __forceinline__ uint2 ld_u64(const u8* p) { return __ldg((const uint2*)p); }
__device__ __forceinline__ uint4 ld_u128(const u8* p) { return __ldg((const uint4*)p); }

// byte i (0..3) of a 32-bit word
__device__ __forceinline__ u32 byte_of(u32 w, int i) { return (w >> (8 * i)) & 0xFFu; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The RMS norm's scale 1 / sqrt(mean + eps) from the float64 sum of squares of d values,
// in the CPU's float32 steps.
__device__ __forceinline__ float rms_scale(double sum, int d, float eps) {
    const float mean = (float)(sum / (double)d);
    return 1.0f / (float)sqrt((double)__fadd_rn(mean, eps));
}

// v normed: (v * s) * g a value, two float32 products in the CPU's order
__device__ __forceinline__ float4 norm4(float4 v, float s, float4 g) {
    return make_float4(__fmul_rn(__fmul_rn(v.x, s), g.x), __fmul_rn(__fmul_rn(v.y, s), g.y),
                       __fmul_rn(__fmul_rn(v.z, s), g.z), __fmul_rn(__fmul_rn(v.w, s), g.w));
}

// RoPE's (cos, sin) for pair i at position p: theta = p theta_scale^i by i float32
// products (the CPU's order), the angle freq_scale theta, cos and sin in float64
__device__ __forceinline__ float2 rope_cs(float p, int i, float theta_scale, float freq_scale) {
    float theta = p;
    for (int s = 0; s < i; s++) theta = __fmul_rn(theta, theta_scale);
    const float angle = __fmul_rn(freq_scale, theta);
    return make_float2((float)cos((double)angle), (float)sin((double)angle));
}

// The RMS norm's scale of a row of d values whose squares the block's threads summed (each
// thread its part, in double, into acc): 1 / sqrt(mean + eps) with ggml's float32 steps,
// written to *scale by one thread. red: a shared slot a warp; every thread of the block
// must call it (two barriers).
__device__ __forceinline__ void block_rms_scale(double acc, double* red, int n_warps, int d,
                                                float eps, float* scale) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    acc = warp_sum_d(acc);
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        double v = lane < n_warps ? red[lane] : 0.0;
        v = warp_sum_d(v);
        if (lane == 0) *scale = rms_scale(v, d, eps);
    }
    __syncthreads();
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The four bytes of w as floats 2^23 + byte, minus `off` (exact): one PRMT and one FADD
// per value. PRMT selector 0x765i puts byte i of w under the bytes 0x00, 0x00, 0x4B.
__device__ __forceinline__ void bytes4(u32 w, float off, float* q) {
    q[0] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7650)) - off;
    q[1] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7651)) - off;
    q[2] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7652)) - off;
    q[3] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7653)) - off;
}

// a . b + c over the four signed bytes of a and b (one DP4A instruction)
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// a . b + c over the four unsigned bytes of a and the four signed bytes of b
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// silu(g) * u = g / (1 + exp(-g)) * u, in the CPU backend's float32 steps
__device__ __forceinline__ float silu_mul1(float g, float u) {
    float e = (float)exp(-(double)g);
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), u);
}

// gelu(g) * u with ggml's tanh approximation, in ggml's order of float32 operations
__device__ __forceinline__ float gelu_mul1(float g, float u) {
    const float coef_a = 0.044715f;
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f;
    float inner = __fmul_rn(__fmul_rn(sqrt_2_over_pi, g),
                            __fadd_rn(1.0f, __fmul_rn(__fmul_rn(coef_a, g), g)));
    float th = (float)tanh((double)inner);
    return __fmul_rn(__fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, th)), u);
}

// Programmatic dependent launch (sm_90 on): a kernel of a decode graph launched with the
// programmatic-serialization attribute may start while the kernel before it still runs;
// pdl_wait() blocks until that kernel has finished and its writes are visible, so every
// such kernel calls it before it reads an activation or writes anything. pdl_trigger()
// lets the next kernel's blocks be scheduled now (they wait in their own pdl_wait()).
// Without the attribute (eager launches, other GPUs) both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Where a kernel lets its dependents launch: 0 at entry, before its own wait (run 8; then
// each waiting kernel lets the next one in too, so the blocks of several later kernels sit
// in the SMs while one runs), 1 right after its wait (at most the next kernel waits beside
// the running one), 2 when its main work is done (the next launch overlaps only the tail).
// Each kernel calls pdl_trigger_at(0 / 1 / 2, chosen) at those points; `chosen` is the
// launch's (the backend: 1 for grids of at most half the SMs, whose dependents find idle
// SMs to wait on, else 2; run 10 measured both ways). Building with PDL_TRIGGER defined
// (bench_synthetic --define) forces one place on every launch.
#ifndef PDL_TRIGGER
#define PDL_TRIGGER -1
#endif

__device__ __forceinline__ void pdl_trigger_at(int where, int chosen) {
    if (where == (PDL_TRIGGER >= 0 ? PDL_TRIGGER : chosen)) pdl_trigger();
}
