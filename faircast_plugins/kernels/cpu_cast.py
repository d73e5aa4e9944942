"""The ``cpu`` backend: ROUNDING.md as a fused, multithreaded numba loop over CPU tensors.

Needs numba, a default dependency of faircast-plugins; importing this module without numba raises ImportError, and
:mod:`faircast_plugins.cast` then falls back to the torch reference (and says so once in its log).

Design (``stochastic``): the tensor is walked in blocks of ``BLOCK_GROUPS`` Philox groups (8 elements each,
aligned to the *global* index, so any offset works), one block per parallel iteration. A block is done in steps of
``STEP_GROUPS`` groups, each step being:

1. Philox4x32-10 for every group of the step, straight-line, no branches. LLVM vectorizes the loop across
   groups (64-bit lanes, ``vpmuludq`` for the 32x32->64 products: 4 groups per AVX2 register, 8 per AVX-512
   register where the CPU has it, with ``vpternlogq`` for the three-way XORs); the loop body computes two groups
   half a step apart so that two independent dependency chains are in flight. The four output words of group
   ``t`` are stored at ``noise[4t : 4t+4]``; read as little-endian uint16 that buffer is exactly the per-element
   noise in element order (element ``8t + lane`` uses half ``lane & 1`` of word ``lane >> 1``). The buffer stays
   in L1.
2. The rounding of the step's elements, in chunks of 32 (``add_shift_chunk``, written as LLVM vector IR): if no
   element of the chunk has ``|u| > 0x7F7F0000`` (true for any real weight), the sign-magnitude rule equals the
   two's-complement ``(u + noise) >> 16`` (no carry can reach the sign bit or pass bf16 max): one load of x, one
   range test, a few instructions per 16 elements. Otherwise the full branchless rule (saturation, inf, quiet NaN)
   runs for that chunk. Outputs of ``STREAM_MIN_NUMEL`` elements or more are stored non-temporally where a chunk is
   a whole 64-byte line of ``out``, and each block then ends with ``store_fence``.

Alternating the two in steps of 512 elements lets the core overlap Philox's arithmetic with the rounding's memory
traffic; a whole-block Philox pass followed by a whole-block rounding pass cost the sum of the two.

``nearest`` is an element-wise integer rule that numba vectorizes. ``error_feedback`` goes in chunks of 32 too
(``error_feedback_chunk``, LLVM vector IR): when every sum ``x + r`` of the chunk is finite and below the overflow
threshold, ``q = RNE(x + r)`` and ``r' = (x + r) - q`` for the whole chunk; otherwise (an inf or NaN input, a
saturating sum) the per-element rule runs for that chunk. Its fp32 add and subtract are IEEE, vector or scalar
(fastmath off: no contraction, no reassociation). Each mode has a multithreaded kernel and a serial twin for
tensors below ``PARALLEL_MIN_NUMEL``. All kernels are compiled lazily on first use and cached on disk
(``cache=True``), and release the GIL; one lock serializes calls because numba's fallback threading layer is not
reentrant.
"""
from __future__ import annotations

import ctypes
import platform
import threading
from contextlib import contextmanager
from typing import Sequence

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core.extending import intrinsic
except ImportError as exc:  # pragma: no cover - exercised only where numba is absent
    raise ImportError(
        "the 'cpu' Fair Cast backend needs numba (a dependency of faircast-plugins): pip install 'numba>=0.60' "
        "(or use backend='torch')"
    ) from exc

import numpy as np
import torch

__all__ = ["cast_many", "cast_runs", "BLOCK_GROUPS", "STEP_GROUPS", "philox_block", "block_range", "round_keys", "numpy_bits",
           "exclusive"]

# Philox groups per parallel block: 8,192 elements (x 32 KB, noise 16 KB, out 16 KB), one work item per thread.
# A power of two, so an aligned block never straddles a 2**32 boundary of the group counter.
BLOCK_GROUPS = 1024
assert BLOCK_GROUPS & (BLOCK_GROUPS - 1) == 0
# Inside a block, Philox (pure arithmetic) and the rounding pass (memory traffic) alternate every 64 groups (512
# elements): close enough for the out-of-order core and the prefetchers to overlap one with the other. One Philox
# pass over the whole block, then one rounding pass, ran them back to back (CPU time = the sum of the two).
STEP_GROUPS = 64
assert BLOCK_GROUPS % STEP_GROUPS == 0

_M32 = np.uint64(0xFFFFFFFF)
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_S32 = np.uint64(32)

_U16 = np.uint32(16)
_MAG = np.uint32(0x7FFFFFFF)
_SIGN16 = np.uint32(0x8000)
_INF = np.uint32(0x7F800000)
_BF16_MAX = np.uint32(0x7F7F)
_FAST_LIMIT = np.uint32(0x7F7F0000)  # up to this |u| the two's-complement add needs no saturation
_EF_FAST_LIMIT = np.uint32(0x7F7F8000)  # from this |s| on, round-to-nearest-even gives the bf16 infinity
_QUIET = np.uint32(0x0040)
_ZERO32 = np.uint32(0)
_ONE32 = np.uint32(1)
_HALF_ULP = np.uint32(0x7FFF)


# ---------------------------------------------------------------------------------------------- Philox4x32-10


@njit(inline="always")
def _round(c0, c1, c2, c3, k0, k1):
    # Masking the multiplicands tells LLVM the products are 32x32->64 (one vpmuludq each). The low words may
    # carry garbage above bit 31: they only feed XORs whose results are masked again before the next multiply.
    # (c1 ^ k0) is off the multiply's critical path.
    p0 = (c0 & _M32) * _M0
    p1 = (c2 & _M32) * _M1
    return (c1 ^ k0) ^ (p1 >> _S32), p1, (c3 ^ k1) ^ (p0 >> _S32), p0


@njit(inline="always")
def _philox10(c0, c1, ks):
    """Philox4x32-10 of counter (c0, c1, 0, 0) under the round keys ``ks`` (k0 schedule, then k1 schedule)."""
    c2 = np.uint64(0)
    c3 = np.uint64(0)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[0], ks[10])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[1], ks[11])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[2], ks[12])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[3], ks[13])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[4], ks[14])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[5], ks[15])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[6], ks[16])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[7], ks[17])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[8], ks[18])
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, ks[9], ks[19])
    return c0, c1, c2, c3


@njit(inline="always")
def _store_words(noise, t, c0, c1, c2, c3):
    noise[4 * t] = np.uint32(c0 & _M32)
    noise[4 * t + 1] = np.uint32(c1 & _M32)
    noise[4 * t + 2] = np.uint32(c2 & _M32)
    noise[4 * t + 3] = np.uint32(c3 & _M32)


@njit(inline="always")
def philox_block(noise, g_lo, g_hi, m, ks):
    """Philox words of groups ``g .. g+m-1`` (``g = g_hi * 2**32 + g_lo``, no carry into ``g_hi`` inside a block)
    into ``noise[0 : 4m]``; two independent chains per iteration. With ``g_hi`` fixed, round 1's ``c0`` and
    round 2's first product are loop-invariant, so LLVM hoists them."""
    h = m >> 1
    for t in range(h):
        a0, a1, a2, a3 = _philox10(np.uint64(g_lo + t), g_hi, ks)
        b0, b1, b2, b3 = _philox10(np.uint64(g_lo + h + t), g_hi, ks)
        _store_words(noise, t, a0, a1, a2, a3)
        _store_words(noise, h + t, b0, b1, b2, b3)
    for t in range(2 * h, m):
        c0, c1, c2, c3 = _philox10(np.uint64(g_lo + t), g_hi, ks)
        _store_words(noise, t, c0, c1, c2, c3)


# ---------------------------------------------------------------------------------------------- vector chunk
# numba's loop vectorizer gives up when the range check and the add-and-shift share a loop (a data-dependent branch
# per chunk), and two whole-step loops read x twice. So this chunk is written as LLVM vector IR: LLVM lowers it for
# the machine it runs on (AVX2, AVX-512, NEON), without fast-math flags or target-specific intrinsics. It lives in
# this file because numba's disk cache of a kernel is invalidated by changes to the kernel's own file only.

CHUNK = 32  # elements per call of add_shift_chunk and error_feedback_chunk

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_I16 = ir.IntType(16)
_V32 = ir.VectorType(_I32, CHUNK)
_V16 = ir.VectorType(_I16, CHUNK)
_VF32 = ir.VectorType(ir.FloatType(), CHUNK)


def _splat(value: int) -> ir.Constant:
    return ir.Constant(_V32, [value] * CHUNK)


def _flat_arrays(*args_and_dtypes) -> bool:
    """True if every ``(arg, dtype)`` is a 1-D C-contiguous numba array of that dtype (what the chunks accept)."""
    return all(isinstance(arg, types.Array) and arg.ndim == 1 and arg.layout == "C" and arg.dtype == dtype
               for arg, dtype in args_and_dtypes)


def _chunk_ptr(builder, array, j, vector_type):
    """Pointer to ``array[j : j + CHUNK]`` as one vector."""
    return builder.bitcast(builder.gep(array.data, [j]), vector_type.as_pointer())


def _element_align(array_type, size: int) -> int:
    return size if array_type.aligned else 1


def _any_lane(builder, mask):
    """One i1: is any lane of the CHUNK-lane i1 ``mask`` set."""
    return builder.icmp_unsigned("!=", builder.bitcast(mask, ir.IntType(CHUNK)), ir.Constant(ir.IntType(CHUNK), 0))


@intrinsic
def add_shift_chunk(typingctx, out, xu, noise, j, streaming):
    """``out[j:j+32] = (xu[j:j+32] + noise[j:j+32]) >> 16`` and return False, if every ``|xu| <= 0x7F7F0000``;
    otherwise store nothing and return True (the caller runs the full rule of ROUNDING.md §4 on the chunk).

    ``out`` is uint16, ``xu`` uint32 (the fp32 bits), ``noise`` uint16, all 1-D and C-contiguous with at least
    ``j + 32`` elements (not checked). Under the range condition the sign-magnitude rule of the contract equals this
    two's-complement add: no carry reaches the sign bit or passes the largest finite bf16. With ``streaming`` true
    and ``out + 2j`` on a 64-byte boundary the store is non-temporal (no read of the destination line, no cache
    pollution); the kernel then ends each block with :func:`store_fence`.
    """
    if not (_flat_arrays((out, types.uint16), (xu, types.uint32), (noise, types.uint16))
            and isinstance(j, types.Integer) and isinstance(streaming, types.Boolean)):
        return None

    def codegen(context, builder, sig, args):
        out_a, xu_a, noise_a = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:3], args[:3]))
        j, streaming = args[3], args[4]
        x = builder.load(_chunk_ptr(builder, xu_a, j, _V32), align=_element_align(sig.args[1], 4))
        magnitude = builder.and_(x, _splat(int(_MAG)))
        any_outside = _any_lane(builder, builder.icmp_unsigned(">", magnitude, _splat(int(_FAST_LIMIT))))
        with builder.if_then(builder.not_(any_outside), likely=True):
            noise16 = builder.load(_chunk_ptr(builder, noise_a, j, _V16), align=_element_align(sig.args[2], 2))
            total = builder.add(x, builder.zext(noise16, _V32))
            value = builder.trunc(builder.lshr(total, _splat(16)), _V16)
            target = _chunk_ptr(builder, out_a, j, _V16)
            address = builder.ptrtoint(target, _I64)
            on_line = builder.icmp_unsigned("==", builder.and_(address, ir.Constant(_I64, 63)), ir.Constant(_I64, 0))
            with builder.if_else(builder.and_(streaming, on_line)) as (stream, plain):
                with stream:
                    store = builder.store(value, target, align=64)
                    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
                with plain:
                    builder.store(value, target, align=_element_align(sig.args[0], 2))
        return any_outside

    return types.boolean(out, xu, noise, j, streaming), codegen


@intrinsic
def error_feedback_chunk(typingctx, out, x, residual, j):
    """ROUNDING.md §4 ``error_feedback`` for ``x[j:j+32]`` and ``residual[j:j+32]`` in place, and return False, if
    every sum ``s = x + r`` has ``|s|`` below 0x7F7F8000 (the fp32 bits, the smallest magnitude that would round
    to the bf16 infinity); otherwise store nothing and return True (the caller runs the full rule per element).

    Under that condition x and r are finite (an inf or NaN in either makes ``s`` inf or NaN) and the sum is not
    saturated, so the rule is: ``q = RNE(s)``, ``r' = s - q`` (exact), with the same IEEE fp32 add and subtract as
    the per-element rule (no fast-math flags). ``out`` is uint16, ``x`` and ``residual`` float32, all 1-D and
    C-contiguous with at least ``j + 32`` elements (not checked).
    """
    if not (_flat_arrays((out, types.uint16), (x, types.float32), (residual, types.float32))
            and isinstance(j, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        out_a, x_a, r_a = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:3], args[:3]))
        j = args[3]
        r_ptr = _chunk_ptr(builder, r_a, j, _VF32)
        total = builder.fadd(builder.load(_chunk_ptr(builder, x_a, j, _VF32), align=_element_align(sig.args[1], 4)),
                             builder.load(r_ptr, align=_element_align(sig.args[2], 4)))
        bits = builder.bitcast(total, _V32)
        magnitude = builder.and_(bits, _splat(int(_MAG)))
        any_outside = _any_lane(builder, builder.icmp_unsigned(">=", magnitude, _splat(int(_EF_FAST_LIMIT))))
        with builder.if_then(builder.not_(any_outside), likely=True):
            odd = builder.and_(builder.lshr(magnitude, _splat(16)), _splat(1))
            nearest = builder.lshr(builder.add(magnitude, builder.add(odd, _splat(int(_HALF_ULP)))), _splat(16))
            q = builder.or_(builder.and_(builder.lshr(bits, _splat(16)), _splat(int(_SIGN16))), nearest)
            served = builder.bitcast(builder.shl(q, _splat(16)), _VF32)
            builder.store(builder.trunc(q, _V16), _chunk_ptr(builder, out_a, j, _V16),
                          align=_element_align(sig.args[0], 2))
            builder.store(builder.fsub(total, served), r_ptr, align=_element_align(sig.args[2], 4))
        return any_outside

    return types.boolean(out, x, residual, j), codegen


# x86 orders non-temporal stores only with SFENCE/MFENCE: LLVM lowers a seq_cst fence to a LOCK-prefixed add there,
# which does not order them (the Linux kernel's mb() uses MFENCE for that reason). Other targets take the fence.
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def store_fence(typingctx):
    """Make this thread's non-temporal stores globally visible before its later stores (SFENCE on x86)."""

    def codegen(context, builder, sig, args):
        if _X86:
            sfence = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(sfence, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


# ---------------------------------------------------------------------------------------------- rounding rules


# numba widens integer arithmetic to 64 bits; wrapping every intermediate in _U32 lets LLVM keep 32-bit lanes
# (8 elements per AVX2 register instead of 4).
_U32 = np.uint32


@njit(inline="always")
def _nonfinite_hi(mag):
    # inf keeps 0x7F80; NaN keeps its top payload and gets the quiet bit
    return _U32(_U32(mag >> _U16) | (_QUIET if mag > _INF else _ZERO32))


@njit(inline="always")
def _stochastic_bits(u, noise):
    mag = _U32(u & _MAG)
    finite = min(_U32(_U32(mag + noise) >> _U16), _BF16_MAX)
    hi = _nonfinite_hi(mag) if mag >= _INF else finite
    return _U32(_U32(_U32(u >> _U16) & _SIGN16) | hi)


@njit(inline="always")
def _nearest_bits(u):
    mag = _U32(u & _MAG)
    rne = _U32(_U32(mag + _U32(_HALF_ULP + _U32(_U32(mag >> _U16) & _ONE32))) >> _U16)  # overflow and inf -> inf
    hi = _nonfinite_hi(mag) if mag > _INF else rne
    return _U32(_U32(_U32(u >> _U16) & _SIGN16) | hi)


@njit(inline="always")
def _round_chunk(out, xu, noise, j, streaming):
    if add_shift_chunk(out, xu, noise, j, streaming):
        for k in range(j, j + CHUNK):
            out[k] = np.uint16(_stochastic_bits(xu[k], noise[k]))


@njit(inline="always")
def _round_block(out, xu, noise, streaming):
    """The stochastic rule for ``out[j] <- (xu[j], noise[j])``: chunks of ``CHUNK`` elements take the vector
    add-and-shift when none is near bf16 max, inf or NaN (true for any real weight), else the full rule. A streaming
    chunk is stored non-temporally only where it is a whole 64-byte line of ``out``; starting the chunks on the
    line grid instead was tried: mixing normal and non-temporal stores in every step made it 1.7x slower."""
    n = xu.size
    j = 0
    while j + CHUNK <= n:
        _round_chunk(out, xu, noise, j, streaming)
        j += CHUNK
    for k in range(j, n):
        out[k] = np.uint16(_stochastic_bits(xu[k], noise[k]))


# ---------------------------------------------------------------------------------------------- kernels


@njit(inline="always")
def _stochastic_block(out, xu, ks, offset, g_first, g_end, g_block, words, streaming):
    """Cast the elements of the aligned block of groups ``g_block .. g_block+BLOCK_GROUPS-1`` that lie in ``xu``."""
    n = xu.size
    g0 = max(g_block, g_first)
    g1 = min(g_block + BLOCK_GROUPS, g_end)
    noise = words.view(np.uint16)  # global element 8*s0 + k uses noise[k]
    for s0 in range(g0, g1, STEP_GROUPS):  # Philox and rounding alternate in steps (see STEP_GROUPS)
        s1 = min(s0 + STEP_GROUPS, g1)
        philox_block(words, np.uint64(s0 & 0xFFFFFFFF), np.uint64(s0 >> 32), s1 - s0, ks)
        # this step's elements as local indices [lo, hi); differences first, as 8*s1 alone may not fit in int64
        head = 8 * s0 - offset  # in [-7, n)
        lo = max(head, 0)
        hi = min(8 * (s1 - s0) + head, n)
        _round_block(out[lo:hi], xu[lo:hi], noise[lo - head : hi - head], streaming)


@njit(inline="always")
def block_range(n, offset):
    g_first = offset >> 3
    g_end = ((offset + n - 1) >> 3) + 1  # offset + n may be 2**63 exactly: no "+ 7"
    b_first = g_first // BLOCK_GROUPS  # blocks are aligned in group space, so none straddles a 2**32 boundary
    return g_first, g_end, b_first, (g_end - 1) // BLOCK_GROUPS + 1 - b_first


@njit(parallel=True, cache=True, nogil=True)
def _stochastic_kernel(out, xu, ks, offset, streaming):
    g_first, g_end, b_first, n_blocks = block_range(xu.size, offset)
    for b in prange(n_blocks):
        words = np.empty(4 * BLOCK_GROUPS, np.uint32)  # hoisted: one buffer per thread
        _stochastic_block(out, xu, ks, offset, g_first, g_end, (b_first + b) * BLOCK_GROUPS, words, streaming)
        if streaming:
            store_fence()


@njit(cache=True, nogil=True)
def _stochastic_kernel_serial(out, xu, ks, offset, streaming):
    g_first, g_end, b_first, n_blocks = block_range(xu.size, offset)
    words = np.empty(4 * BLOCK_GROUPS, np.uint32)
    for b in range(n_blocks):
        _stochastic_block(out, xu, ks, offset, g_first, g_end, (b_first + b) * BLOCK_GROUPS, words, streaming)
    if streaming:
        store_fence()


@njit(inline="always")
def _error_feedback_element(out, x, residual, i):
    """ROUNDING.md §4: a non-finite residual counts as 0; a non-finite x is served from its own bits; a finite sum
    rounds to nearest even, saturating at the largest finite bf16 (residual reset)."""
    ux = np.float32(x[i]).view(np.uint32)
    r = np.float32(residual[i])
    if (r.view(np.uint32) & _MAG) >= _INF:
        r = np.float32(0.0)
    if (ux & _MAG) >= _INF:
        out[i] = np.uint16(_nearest_bits(ux))
        residual[i] = np.float32(0.0)
        return
    s = x[i] + r  # fp32 + fp32, IEEE round-to-nearest (fastmath is off); finite or +-inf, never NaN
    q = _nearest_bits(np.float32(s).view(np.uint32))
    if (q & _U32(0x7FFF)) >= _U32(0x7F80):
        out[i] = np.uint16((q & _SIGN16) | _BF16_MAX)
        residual[i] = np.float32(0.0)
    else:
        out[i] = np.uint16(q)
        residual[i] = s - np.uint32(q << _U16).view(np.float32)  # exact


@njit(parallel=True, cache=True, nogil=True)
def _nearest_kernel(out, xu):
    for i in prange(xu.size):
        out[i] = np.uint16(_nearest_bits(xu[i]))


@njit(cache=True, nogil=True)
def _nearest_kernel_serial(out, xu):
    for i in range(xu.size):
        out[i] = np.uint16(_nearest_bits(xu[i]))


@njit(inline="always")
def _error_feedback_range(out, x, residual, lo, hi):
    """Error feedback for elements ``lo .. hi-1``: chunks of ``CHUNK`` take :func:`error_feedback_chunk`, a chunk
    with a non-finite input or a sum at the overflow threshold and the tail take the per-element rule."""
    j = lo
    while j + CHUNK <= hi:
        if error_feedback_chunk(out, x, residual, j):
            for i in range(j, j + CHUNK):
                _error_feedback_element(out, x, residual, i)
        j += CHUNK
    for i in range(j, hi):
        _error_feedback_element(out, x, residual, i)


@njit(parallel=True, cache=True, nogil=True)
def _error_feedback_kernel(out, x, residual):
    block = 8 * BLOCK_GROUPS
    for b in prange((x.size + block - 1) // block):
        _error_feedback_range(out, x, residual, b * block, min(b * block + block, x.size))


@njit(cache=True, nogil=True)
def _error_feedback_kernel_serial(out, x, residual):
    _error_feedback_range(out, x, residual, 0, x.size)


@njit(inline="always")
def _run_of(starts, b):
    """The run ``r`` with ``starts[r] <= b < starts[r + 1]`` (``starts``: running block counts, ascending)."""
    lo, hi = 0, starts.size - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if starts[mid] <= b:
            lo = mid
        else:
            hi = mid
    return lo


@njit(inline="always")
def _stochastic_run_block(out, xu, runs, starts, ks, b, words, streaming):
    """Block ``b`` of the run table: block ``b - starts[r]`` of run ``r``'s aligned group blocks."""
    r = _run_of(starts, b)
    pos, first, n = runs[r, 0], runs[r, 1], runs[r, 2]
    g_first, g_end, b_first, _ = block_range(n, first)
    _stochastic_block(out[pos: pos + n], xu[pos: pos + n], ks[runs[r, 3]], first, g_first, g_end,
                      (b_first + b - starts[r]) * BLOCK_GROUPS, words, streaming)


@njit(parallel=True, cache=True, nogil=True)
def _stochastic_runs_kernel(out, xu, runs, starts, ks, streaming):
    for b in prange(starts[-1]):
        words = np.empty(4 * BLOCK_GROUPS, np.uint32)  # hoisted: one buffer per thread
        _stochastic_run_block(out, xu, runs, starts, ks, b, words, streaming)
        if streaming:
            store_fence()


@njit(cache=True, nogil=True)
def _stochastic_runs_kernel_serial(out, xu, runs, starts, ks, streaming):
    words = np.empty(4 * BLOCK_GROUPS, np.uint32)
    for b in range(starts[-1]):
        _stochastic_run_block(out, xu, runs, starts, ks, b, words, streaming)
    if streaming:
        store_fence()


@njit(parallel=True, cache=True, nogil=True)
def _nearest_runs_kernel(out, xu, runs):
    for r in prange(runs.shape[0]):
        for i in range(runs[r, 0], runs[r, 0] + runs[r, 2]):
            out[i] = np.uint16(_nearest_bits(xu[i]))


@njit(cache=True, nogil=True)
def _nearest_runs_kernel_serial(out, xu, runs):
    for r in range(runs.shape[0]):
        for i in range(runs[r, 0], runs[r, 0] + runs[r, 2]):
            out[i] = np.uint16(_nearest_bits(xu[i]))


# ---------------------------------------------------------------------------------------------- host side


def round_keys(key: int) -> np.ndarray:
    """The 10 Philox round keys of ``key``: ``[k0 + r*W0 for r in 0..9] + [k1 + r*W1 for r in 0..9]`` mod 2**32."""
    k0, k1 = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    return np.array([(k0 + r * _W0) & 0xFFFFFFFF for r in range(10)] + [(k1 + r * _W1) & 0xFFFFFFFF for r in range(10)],
                    dtype=np.uint64)


def numpy_bits(t: torch.Tensor, dtype: torch.dtype, np_dtype) -> np.ndarray:
    """Zero-copy numpy view of a flat contiguous CPU tensor's bits, valid while ``t`` lives.

    Made from the data pointer, not ``Tensor.numpy()``: that marks the tensor's storage non-resizable for good, and
    the frameworks free and restore the storage of the tensors Fair Cast writes (verl's ``param_offload`` resizes
    Megatron's bucket storage to 0 bytes and back between steps)."""
    if t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"the cpu backend takes flat contiguous CPU tensors, got {tuple(t.shape)} on {t.device}")
    t = t.detach().view(dtype)  # validates the reinterpretation
    count = t.numel() * t.element_size() // np.dtype(np_dtype).itemsize
    if count == 0:
        return np.empty(0, dtype=np_dtype)
    return np.frombuffer((ctypes.c_char * (count * np.dtype(np_dtype).itemsize)).from_address(t.data_ptr()),
                         dtype=np_dtype, count=count)


_LOCK = threading.Lock()

# Below this many elements a tensor is cast on the calling thread: waking the worker threads costs more than it
# saves (microseconds on an idle machine, milliseconds on a busy one), and a model has hundreds of small tensors.
PARALLEL_MIN_NUMEL = 1 << 18
# From this many elements (16 MB of x, 8 MB of bf16 out) the stochastic kernels write out with non-temporal stores:
# an output that size leaves the caches before anyone reads it, so loading each destination line first (what a
# normal store does) only costs bandwidth. Smaller outputs are stored normally and stay cached for their reader.
STREAM_MIN_NUMEL = 1 << 22

_KERNELS = {  # mode -> (serial, parallel)
    "stochastic": (_stochastic_kernel_serial, _stochastic_kernel),
    "sticky": (_stochastic_kernel_serial, _stochastic_kernel),  # the stochastic rule under the version-free key
    "nearest": (_nearest_kernel_serial, _nearest_kernel),
    "error_feedback": (_error_feedback_kernel_serial, _error_feedback_kernel),
}


def _use_torch_thread_count() -> None:
    """Run numba's kernels on ``torch.get_num_threads()`` threads (at most its pool's), leaving torch's count as it was.

    The first call starts numba's pool, and its OpenMP layer then calls ``omp_set_num_threads(NUMBA_NUM_THREADS)``,
    which binds to the libgomp torch loaded: a caller's ``torch.set_num_threads(1)`` would silently become the CPU
    count for every torch op after the first cast (other reduction orders, other bits).
    """
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@contextmanager
def exclusive():
    """Hold the kernels' lock (numba's fallback threading layer is not reentrant), on torch's thread count."""
    with _LOCK:
        _use_torch_thread_count()
        yield


def cast_many(items: Sequence, mode: str) -> None:
    """Cast every :class:`faircast_plugins.cast.CastItem` in place (``item.out``, and ``item.residual`` for EF).

    Bit-identical to :mod:`faircast_plugins.torch_ref` for every input. Uses at most
    ``torch.get_num_threads()`` threads, like the torch ops around it.
    """
    if mode not in _KERNELS:
        raise ValueError(f"unknown Fair Cast mode {mode!r}")
    with exclusive():
        for item in items:
            if item.x.dtype != torch.float32 or item.out.dtype != torch.bfloat16 or item.out.numel() != item.x.numel():
                raise TypeError("the cpu backend casts fp32 x into a bf16 out of the same size")
            kernel = _KERNELS[mode][item.x.numel() >= PARALLEL_MIN_NUMEL]
            out = numpy_bits(item.out, torch.int16, np.uint16)
            if mode in ("stochastic", "sticky"):
                kernel(out, numpy_bits(item.x, torch.int32, np.uint32), round_keys(item.key), item.offset,
                       item.x.numel() >= STREAM_MIN_NUMEL)
            elif mode == "nearest":
                kernel(out, numpy_bits(item.x, torch.int32, np.uint32))
            else:
                if item.residual is None or item.residual.dtype != torch.float32 or item.residual.numel() != item.x.numel():
                    raise ValueError("error_feedback needs an fp32 residual the size of x")
                kernel(out, numpy_bits(item.x, torch.float32, np.float32), numpy_bits(item.residual, torch.float32, np.float32))


def _run_blocks(runs) -> tuple:
    """The run table as numpy int64 and the running count of aligned group blocks per run (``starts[-1]`` in all):
    one parallel iteration per block of any run, as :func:`cast_many` has per block of one tensor."""
    table = runs.table.numpy()
    first, n = table[:, 1], table[:, 2]
    g_first = first >> 3
    g_end = ((first + n - 1) >> 3) + 1
    blocks = (g_end - 1) // BLOCK_GROUPS + 1 - g_first // BLOCK_GROUPS
    return table, np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)


def cast_runs(x: torch.Tensor, out: torch.Tensor, runs, keys: Sequence[int], mode: str) -> None:
    """:func:`faircast_plugins.cast.fair_cast_runs` on CPU tensors: every run of ``runs`` (a
    :class:`faircast_plugins.cast.RunTable`) in one parallel loop over the runs' blocks, bit-identical to casting
    each run with :func:`cast_many`."""
    if mode not in _KERNELS or mode == "error_feedback":
        raise ValueError(f"cast_runs casts stochastic, sticky or nearest, not {mode!r}")
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16 or out.numel() != x.numel() or x.numel() < runs.extent:
        raise TypeError("the cpu backend casts fp32 x into a bf16 out of the same size, covering every run")
    table, starts = runs.cached("cpu", "cpu_blocks", lambda: _run_blocks(runs))
    o, xu = numpy_bits(out, torch.int16, np.uint16), numpy_bits(x, torch.int32, np.uint32)
    parallel = runs.numel >= PARALLEL_MIN_NUMEL
    with exclusive():
        if mode == "nearest":
            (_nearest_runs_kernel if parallel else _nearest_runs_kernel_serial)(o, xu, table)
            return
        ks = np.stack([round_keys(k) for k in keys])
        kernel = _stochastic_runs_kernel if parallel else _stochastic_runs_kernel_serial
        kernel(o, xu, table, starts, ks, runs.numel >= STREAM_MIN_NUMEL)
