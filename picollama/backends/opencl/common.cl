// Helpers shared by the OpenCL backend's programs (prepended to every program's source).
//
// Written to the core of OpenCL C 1.2. What a device may lack comes in as macros that
// device.py sets from what the device reports:
// - USE_FP64 (cl_khr_fp64): sums of squares, divisions and transcendentals in double, as
//   the CPU reference computes them; without it, float32 (a few ulps further away).
// - HAVE_FMA (CL_FP_FMA): fma() for the dot products; without it a multiply and an add.
// No fp16 arithmetic is used: F16 data (weights, the KV cache) are widened with
// vload_half*, which is core OpenCL, and every sum is float32 or wider.
//
// FP_CONTRACT is off so that the compiler never fuses a * b + c into an FMA where we did
// not ask for one: dequantization must round as ggml's does, bit for bit.
//
// Vectors are at most 8 wide: PoCL 3.0 (LLVM 14) crashes compiling 16-wide float vectors
// for x86 CPUs without AVX-512.

#pragma OPENCL FP_CONTRACT OFF

#ifdef USE_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

typedef uchar u8;
typedef ushort u16;
typedef uint u32;
typedef long i64;

#ifdef HAVE_FMA
#define MAD(a, b, c) fma((a), (b), (c))
#else
#define MAD(a, b, c) ((a) * (b) + (c))
#endif

// float32 results of one float32 operation or function, rounded from double where the
// device has it (a float32 division or square root computed in double and rounded once is
// correctly rounded; exp, tanh, cos and sin then come within an ulp of the C library's)
#ifdef USE_FP64
#define F_DIV(a, b) ((float)((double)(a) / (double)(b)))
#define F_SQRT(a) ((float)sqrt((double)(a)))
#define F_EXP(a) ((float)exp((double)(a)))
#define F_TANH(a) ((float)tanh((double)(a)))
#define F_COS(a) ((float)cos((double)(a)))
#define F_SIN(a) ((float)sin((double)(a)))
typedef double wide_t;
#else
#define F_DIV(a, b) ((a) / (b))
#define F_SQRT(a) sqrt(a)
#define F_EXP(a) exp(a)
#define F_TANH(a) tanh(a)
#define F_COS(a) cos(a)
#define F_SIN(a) sin(a)
typedef float wide_t;
#endif

#define NEG_INF (-INFINITY)

// the 8 bytes of a uint2 as floats
inline float8 bytes8(uint2 w) { return convert_float8(as_uchar8(w)); }

// the 8 bytes of a uint2 as floats, signed
inline float8 sbytes8(uint2 w) { return convert_float8(as_char8(w)); }

// byte i (0..11) of three little-endian words
inline u32 byte12(u32 a, u32 b, u32 c, int i) {
    u32 w = i < 4 ? a : (i < 8 ? b : c);
    return (w >> (8 * (i & 3))) & 0xFFu;
}

// horizontal sum of a float8, in a fixed order
inline float hsum8(float8 v) {
    float4 s = v.lo + v.hi;
    return (s.x + s.y) + (s.z + s.w);
}
