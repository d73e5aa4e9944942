"""The ``cpu`` backend of :mod:`faircast_plugins.master16`: a 2 B master's compaction and recovery as one numba pass each.

* :func:`recover_` rebuilds fp32 master bits in place from the served copy they hold (fp32 bits ``sign | hi << 16``)
  and the unsigned low 16 bits: ``bits - (carry << 16) | low`` with ``carry = (low + noise) >> 16``, the noise being
  the cast's own Philox words (ROUNDING.md §3), computed block by block exactly as the ``cpu`` cast does
  (:func:`faircast_plugins.kernels.cpu_cast.philox_block`), so nothing is materialized beside the tensor.
* :func:`compact` takes the low 16 bits of fp32 master bits and counts the elements the carry rule misses (NaN,
  finite magnitudes the cast may saturate); only when there are any (never, for a real weight) does the caller look
  for them.

The torch reference is :mod:`faircast_plugins.master16` (its probe cast); tests compare the two bit for bit.
numba's disk cache is invalidated by changes to this file only, not to the Philox code it inlines from
``cpu_cast.py``: master16 checks a kernel module against the reference once per process before using it, so a stale
cache fails loudly instead of recovering wrong masters.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .cpu_cast import _FAST_LIMIT as _SATURATES  # finite magnitudes above it may saturate in the cast
from .cpu_cast import _INF, _MAG, _U16, _U32  # the rounding rule's constants, one definition for both kernels
from .cpu_cast import (BLOCK_GROUPS, PARALLEL_MIN_NUMEL, STEP_GROUPS, block_range, exclusive, numpy_bits,
                       philox_block, round_keys)

_LOW = np.uint32(0xFFFF)
#: master16's one-time self-check runs each of these (serial and parallel kernels: they are compiled apart)
SELF_CHECK_VARIANTS = ({"parallel": False}, {"parallel": True})


@njit(inline="always")
def _recover_range(bits, low16, noise, lo, hi, head):
    for i in range(lo, hi):
        low = _U32(low16[i])
        carry = _U32(_U32(low + _U32(noise[i - head])) >> _U16)
        bits[i] = _U32(_U32(bits[i] - _U32(carry << _U16)) | low)


@njit(inline="always")
def _recover_block(bits, low16, ks, offset, g_first, g_end, g_block, words):
    n = bits.size
    g0 = max(g_block, g_first)
    g1 = min(g_block + BLOCK_GROUPS, g_end)
    noise = words.view(np.uint16)
    for s0 in range(g0, g1, STEP_GROUPS):
        s1 = min(s0 + STEP_GROUPS, g1)
        philox_block(words, np.uint64(s0 & 0xFFFFFFFF), np.uint64(s0 >> 32), s1 - s0, ks)
        head = 8 * s0 - offset
        _recover_range(bits, low16, noise, max(head, 0), min(8 * (s1 - s0) + head, n), head)


@njit(parallel=True, cache=True, nogil=True)
def _recover_kernel(bits, low16, ks, offset):
    g_first, g_end, b_first, n_blocks = block_range(bits.size, offset)
    for b in prange(n_blocks):
        words = np.empty(4 * BLOCK_GROUPS, np.uint32)
        _recover_block(bits, low16, ks, offset, g_first, g_end, (b_first + b) * BLOCK_GROUPS, words)


@njit(cache=True, nogil=True)
def _recover_kernel_serial(bits, low16, ks, offset):
    g_first, g_end, b_first, n_blocks = block_range(bits.size, offset)
    words = np.empty(4 * BLOCK_GROUPS, np.uint32)
    for b in range(n_blocks):
        _recover_block(bits, low16, ks, offset, g_first, g_end, (b_first + b) * BLOCK_GROUPS, words)


@njit(inline="always")
def _compact_range(low16, bits, lo, hi):
    misses = 0
    for i in range(lo, hi):
        u = bits[i]
        low16[i] = np.uint16(u & _LOW)
        mag = _U32(u & _MAG)
        misses += 1 if (mag > _SATURATES) & (mag != _INF) else 0
    return misses


@njit(parallel=True, cache=True, nogil=True)
def _compact_kernel(low16, bits):
    block = 8 * BLOCK_GROUPS
    n_blocks = (bits.size + block - 1) // block
    misses = 0
    for b in prange(n_blocks):
        misses += _compact_range(low16, bits, b * block, min(b * block + block, bits.size))
    return misses


@njit(cache=True, nogil=True)
def _compact_kernel_serial(low16, bits):
    return _compact_range(low16, bits, 0, bits.size)


def _check(bits: torch.Tensor, low16: torch.Tensor) -> None:
    """numba reads raw buffers without bounds checks: the sizes and dtypes are checked here, before any call."""
    if bits.dtype != torch.int32 or low16.dtype != torch.int16 or bits.numel() != low16.numel():
        raise ValueError(f"master16 kernels take int32 bits and int16 low halves of one size, got {bits.dtype} "
                         f"[{bits.numel()}] and {low16.dtype} [{low16.numel()}]")


def _parallel(numel: int, parallel) -> bool:
    return numel >= PARALLEL_MIN_NUMEL if parallel is None else parallel


def recover_(bits: torch.Tensor, low16: torch.Tensor, *, key: int, offset: int = 0, parallel=None) -> None:
    """In place: flat int32 ``bits`` (a served copy's fp32 bits, global indices from ``offset``) become the master
    bits, exceptions aside. ``parallel``: force the multithreaded (True) or the serial (False) kernel."""
    _check(bits, low16)
    kernel = _recover_kernel if _parallel(bits.numel(), parallel) else _recover_kernel_serial
    with exclusive():
        kernel(numpy_bits(bits, torch.int32, np.uint32), numpy_bits(low16, torch.int16, np.uint16), round_keys(key),
               offset)


def compact(low16: torch.Tensor, bits: torch.Tensor, *, parallel=None, read: bool = True) -> int:
    """``low16 <- bits & 0xFFFF`` (flat int16 / int32); returns how many elements the stochastic carry rule misses
    (an int: no device to wait for, whatever ``read`` says)."""
    _check(bits, low16)
    kernel = _compact_kernel if _parallel(bits.numel(), parallel) else _compact_kernel_serial
    with exclusive():
        return int(kernel(numpy_bits(low16, torch.int16, np.uint16), numpy_bits(bits, torch.int32, np.uint32)))
