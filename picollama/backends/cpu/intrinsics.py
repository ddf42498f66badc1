"""Small LLVM-level helpers for the Numba kernels: loads from byte rows, bit casts, scratch.

Numba has no scalar view-casts and no stack arrays; these intrinsics fill those gaps. Each
compiles to a few LLVM instructions inlined into the calling function, so none costs a
call. The kernels read weights only through the ``load_*`` ones: an index computed from
function arguments makes Numba emit a negative-index wrap-around check that LLVM cannot
remove, and that check alone keeps a loop from being vectorized; the loads compute a plain
address instead (the public functions validate every index before a kernel runs).

The others steer LLVM's code generation, and each says why:

- ``opaque(n)`` hides a constant trip count. Numba runs LLVM with its SLP (straight-line)
  vectorizer off, so a loop of 16 or 32 iterations with a constant bound is fully unrolled
  into scalar code before the loop vectorizer sees it. ``range(min(opaque(16), 16))``
  keeps the loop, and LLVM still learns its bound from the ``min``: one 16-lane pass.
- ``fmul``/``fadd``/``fsub`` keep IEEE semantics inside fast-math functions. The dot
  kernels are compiled with ``FASTMATH`` so that their sums can be spread over SIMD lanes;
  the dequantization formulas in them (``d * q - m``) use these, so LLVM can neither fuse
  them into FMAs nor re-associate them, and every weight keeps ggml's float32 rounding.
- ``shr_u32`` shifts in 32 bits (Numba would shift in 64, and vectorize in 64-bit lanes).
- ``load_f16_scale`` converts with F16C without a false dependency (see ``_f16_to_f32``).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array

__all__ = [
    "FASTMATH",
    "load_u8",
    "load_i8",
    "load_u16",
    "load_u32",
    "load_f16",
    "load_f16_scale",
    "load_f32",
    "f32_from_bits",
    "bits_from_f32",
    "shr_u32",
    "opaque",
    "fmul",
    "fadd",
    "fsub",
    "stack_f32",
    "stack_f64",
    "HAS_F16C",
    "round_f16",
    "half_to_f32",
    "f16_bits",
    "fma_f32",
]


_X86 = llvm.get_process_triple().startswith(("x86_64", "i686", "i386"))

# Fast-math flags of every kernel that sums a dot product. reassoc: a sum may be re-ordered
# (split over SIMD lanes, which is what lets LLVM vectorize it); contract: x * w + s may
# become an FMA (one rounding instead of two); nsz: the sign of a zero sum is not kept.
# No NaN/inf assumptions (nnan/ninf), so NaN and inf weights propagate as in numpy.
FASTMATH = {"reassoc", "nsz", "contract"}


def _byte_pointer(context, builder, arrty, arr, row, offset):
    """Pointer to ``arr[row, offset]`` of a 2-D uint8 array (any strides)."""
    ary = context.make_array(arrty)(context, builder, arr)
    stride0, stride1 = cgutils.unpack_tuple(builder, ary.strides, 2)
    row = context.cast(builder, row[0], row[1], types.intp)
    offset = context.cast(builder, offset[0], offset[1], types.intp)
    if arrty.layout != "C":
        # in a C-contiguous array the bytes of a row are adjacent; saying so (rather than
        # multiplying by the run-time stride) is what lets LLVM load them as vectors
        offset = builder.mul(offset, stride1)
    return builder.gep(ary.data, [builder.add(builder.mul(row, stride0), offset)])


def _check_load_args(arr, row, offset):
    return (
        isinstance(arr, types.Array)
        and arr.dtype == types.uint8
        and arr.ndim == 2
        and isinstance(row, types.Integer)
        and isinstance(offset, types.Integer)
    )


def _make_load(result_type, llvm_type, convert):
    """An intrinsic ``load(w, row, offset)`` reading one little-endian value at ``w[row, offset]``.

    ``w`` is the 2-D uint8 weight array; the load is unaligned (align 1), as ggml blocks pack
    their fields at odd offsets.
    """

    def load(typingctx, arr, row, offset):
        if not _check_load_args(arr, row, offset):
            return None
        sig = result_type(arr, row, offset)

        def codegen(context, builder, signature, args):
            ptr = _byte_pointer(
                context,
                builder,
                signature.args[0],
                args[0],
                (args[1], signature.args[1]),
                (args[2], signature.args[2]),
            )
            value = builder.load(builder.bitcast(ptr, llvm_type.as_pointer()), align=1)
            return convert(builder, value)

        return sig, codegen

    return intrinsic(load)


def _f16_to_f32(builder, bits):
    # One F16C instruction (vcvtph2ps) on x86: exact for every finite value, infinity and
    # NaN, except that a signalling NaN comes back quieted (kernels_float.f16_to_f32 is the
    # bit-exact one); a NaN scale makes its whole block NaN either way, with the payload
    # numpy's product would give. Left to itself, LLVM loads the half with vpinsrw into
    # whatever vector register is free, which merges with (so waits for) that register's
    # old value: when that was the previous block's sum, every block waited for the one
    # before, and a kernel ran three times slower. So the half goes into lane 0 of an
    # explicit zero vector, through an empty asm statement LLVM cannot fold away.
    if not _X86:
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
    vec_ty = ir.VectorType(ir.IntType(32), 4)
    word = builder.zext(bits, ir.IntType(32))
    vec = builder.insert_element(ir.Constant(vec_ty, None), word, ir.Constant(ir.IntType(32), 0))
    fnty = ir.FunctionType(vec_ty, [vec_ty])
    vec = builder.call(ir.InlineAsm(fnty, "", "=x,0", side_effect=False), [vec])
    halves = builder.bitcast(vec, ir.VectorType(ir.HalfType(), 8))
    floats = builder.fpext(halves, ir.VectorType(ir.FloatType(), 8))
    return builder.extract_element(floats, ir.Constant(ir.IntType(32), 0))


load_u8 = _make_load(types.uint8, ir.IntType(8), lambda builder, v: v)
load_u8.__doc__ = "``load_u8(w, row, offset)``: the byte at ``w[row, offset]``."
load_i8 = _make_load(types.int8, ir.IntType(8), lambda builder, v: v)
load_i8.__doc__ = "``load_i8(w, row, offset)``: the byte at ``w[row, offset]`` as int8."
load_u16 = _make_load(types.uint16, ir.IntType(16), lambda builder, v: v)
load_u16.__doc__ = "``load_u16(w, row, offset)``: the uint16 at ``w[row, offset:offset + 2]``."
load_u32 = _make_load(types.uint32, ir.IntType(32), lambda builder, v: v)
load_u32.__doc__ = "``load_u32(w, row, offset)``: the uint32 at ``w[row, offset:offset + 4]``."
load_f16 = _make_load(
    types.float32,
    ir.IntType(16),
    lambda builder, v: builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType()),
)
load_f16.__doc__ = (
    "``load_f16(w, row, offset)``: the IEEE half at ``w[row, offset]``, as float32 (F16C on\n"
    "x86: exact, but a signalling NaN comes back quieted). For loops over halves, which LLVM\n"
    "vectorizes; for a block's scale, see ``load_f16_scale``."
)
load_f16_scale = _make_load(types.float32, ir.IntType(16), _f16_to_f32)
load_f16_scale.__doc__ = (
    "``load_f16_scale(w, row, offset)``: as ``load_f16``, for a scalar read ahead of vector\n"
    "code, such as a block's scale: it never waits on an unrelated register (see\n"
    "``_f16_to_f32``), but its asm statement keeps a loop around it from being vectorized."
)
load_f32 = _make_load(types.float32, ir.FloatType(), lambda builder, v: v)
load_f32.__doc__ = "``load_f32(w, row, offset)``: the float32 at ``w[row, offset:offset + 4]``."


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        value = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        if bits.bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return sig, codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """The IEEE bits of the float32 ``value``, as uint32."""
    if value != types.float32:
        return None
    sig = types.uint32(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def shr_u32(typingctx, value, amount):
    """``value >> amount`` in 32-bit arithmetic (amount < 32), as uint32.

    Numba widens a uint32 to 64 bits before shifting, and LLVM then vectorizes the shift in
    64-bit lanes; a 32-bit shift keeps 16 lanes to a register.
    """
    if not (isinstance(value, types.Integer) and isinstance(amount, types.Integer)):
        return None
    sig = types.uint32(value, amount)

    def codegen(context, builder, signature, args):
        def as_i32(v, ty):
            if ty.bitwidth > 32:
                return builder.trunc(v, ir.IntType(32))
            if ty.bitwidth < 32:
                return builder.zext(v, ir.IntType(32))
            return v

        a = as_i32(args[0], signature.args[0])
        return builder.lshr(a, as_i32(args[1], signature.args[1]))

    return sig, codegen


@intrinsic
def opaque(typingctx, n):
    """``n`` unchanged, through an empty inline-asm statement LLVM cannot see into.

    (An empty asm string is valid on every target; "r" is any general register.)
    """
    if not isinstance(n, types.Integer):
        return None
    result = types.intp
    sig = result(n)

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], result)
        fnty = ir.FunctionType(value.type, [value.type])
        return builder.call(ir.InlineAsm(fnty, "", "=r,0", side_effect=False), [value])

    return sig, codegen


def _make_strict(opname):
    def op(typingctx, a, b):
        if not (isinstance(a, types.Float) and a == b):
            return None
        sig = a(a, b)

        def codegen(context, builder, signature, args):
            # Numba's fast-math pass gives every float operation *without* flags the
            # function's flags. ``arcp`` (allow a reciprocal in place of a division) means
            # nothing to a multiply, add or subtract, but having a flag makes the pass skip
            # this instruction, so it keeps IEEE semantics: no reassociation, no fusion.
            return getattr(builder, opname)(args[0], args[1], flags=("arcp",))

        return sig, codegen

    return intrinsic(op)


fmul = _make_strict("fmul")
fmul.__doc__ = "``a * b`` rounded as IEEE float, never fused or re-associated, even in fast math."
fadd = _make_strict("fadd")
fadd.__doc__ = "``a + b`` rounded as IEEE float, never fused or re-associated, even in fast math."
fsub = _make_strict("fsub")
fsub.__doc__ = "``a - b`` rounded as IEEE float, never fused or re-associated, even in fast math."


def _make_stack(dtype, llvm_type):
    def stack(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        size = n.literal_value
        arrty = types.Array(dtype, 1, "C")
        sig = arrty(n)

        def codegen(context, builder, signature, args):
            ary = context.make_array(arrty)(context, builder)
            data = cgutils.alloca_once(builder, ir.ArrayType(llvm_type, size))
            intp = context.get_value_type(types.intp)
            itemsize = context.get_abi_sizeof(llvm_type)
            populate_array(
                ary,
                data=builder.bitcast(data, llvm_type.as_pointer()),
                shape=[ir.Constant(intp, size)],
                strides=[ir.Constant(intp, itemsize)],
                itemsize=ir.Constant(intp, itemsize),
                meminfo=None,
            )
            return ary._getvalue()

        return sig, codegen

    return intrinsic(stack)


stack_f32 = _make_stack(types.float32, ir.FloatType())
stack_f32.__doc__ = (
    "``stack_f32(N)``: a float32 scratch array of the literal size ``N`` on the stack of the\n"
    "enclosing compiled function (allocated once at its entry). It must not outlive that\n"
    "function: use it for per-block buffers, never return it. LLVM knows it aliases nothing,\n"
    "so loops writing it need no runtime overlap checks."
)
stack_f64 = _make_stack(types.float64, ir.DoubleType())
stack_f64.__doc__ = "``stack_f64(N)``: like ``stack_f32``, for float64."


# PICOLLAMA_CPU_ISA: "native" (default) uses what the CPU has; "avx2" leaves out AVX-512;
# "generic" leaves out every x86 instruction we ask for by name (F16C, AVX2, VNNI), the
# code a CPU without them runs (how the tests check that fallback on any machine). Numba's
# cache does not know this setting: picollama.jit_cache puts each setting's code apart.
CPU_ISA = os.environ.get("PICOLLAMA_CPU_ISA", "native")
if CPU_ISA not in ("native", "avx2", "generic"):
    raise ValueError(f"PICOLLAMA_CPU_ISA must be native, avx2 or generic, not {CPU_ISA!r}")
HOST_FEATURES = (
    (llvm.get_host_cpu_features().flatten() or "") if _X86 and CPU_ISA != "generic" else ""
)
HAS_F16C = "+f16c" in HOST_FEATURES


@intrinsic
def _round_f16_hw(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


def round_f16(x):
    """``x`` rounded to the nearest IEEE half (ties to even), as float32."""
    raise NotImplementedError("round_f16 is only callable from Numba-compiled code")


@overload(round_f16, inline="always")
def _round_f16_overload(x):
    if HAS_F16C:
        # vcvtps2ph / vcvtph2ps: two instructions
        def impl(x):
            return _round_f16_hw(np.float32(x))

    else:
        # LLVM would call a runtime helper for the conversion, which the JIT may not have
        from picollama.backends.cpu.qdot_act import f16_bits_to_f32, f32_to_f16_bits

        def impl(x):
            return f16_bits_to_f32(f32_to_f16_bits(np.float32(x)))

    return impl


@intrinsic
def _half_to_f32_hw(typingctx, h):
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def _f16_bits_hw(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


def f16_bits(x):
    """IEEE half bits (uint16) of float32 ``x``, rounded to nearest even: vcvtps2ph where
    the CPU has F16C (a loop of them vectorizes), else ``qdot_act.f32_to_f16_bits``."""
    raise NotImplementedError("f16_bits is only callable from Numba-compiled code")


@overload(f16_bits, inline="always")
def _f16_bits_overload(x):
    if HAS_F16C:

        def impl(x):
            return _f16_bits_hw(np.float32(x))

    else:
        from picollama.backends.cpu.qdot_act import f32_to_f16_bits

        def impl(x):
            return f32_to_f16_bits(np.float32(x))

    return impl


def half_to_f32(h, table):
    """The float32 value of IEEE half bits ``h`` (uint16); ``table`` maps all 65536 bit
    patterns, for CPUs without F16C."""
    raise NotImplementedError("half_to_f32 is only callable from Numba-compiled code")


@overload(half_to_f32, inline="always")
def _half_to_f32_overload(h, table):
    if HAS_F16C:

        def impl(h, table):
            return _half_to_f32_hw(np.uint16(h))

    else:

        def impl(h, table):
            return table[np.int64(h) & 0xFFFF]

    return impl


@intrinsic
def fma_f32(typingctx, a, b, c):
    """``a * b + c`` with one rounding (llvm.fma: an FMA instruction where the CPU has one)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic(
            "llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32])
        )
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen
