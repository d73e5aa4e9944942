"""The ``triton`` backend of :mod:`faircast_plugins.master16`: a 2 B master's compaction and recovery, one launch each.

* :func:`recover_`: in place, fp32 bits of the served copy become master bits ``bits - (carry << 16) | low`` with
  ``carry = (low + noise) >> 16``; the noise comes from the cast kernel's own Philox tile function (tiles of ``ROWS``
  groups aligned to the global index, as in :mod:`faircast_plugins.kernels.triton_cast`).
* :func:`compact`: ``low16 <- bits & 0xFFFF`` and a device-side count of the elements the carry rule misses (NaN,
  finite magnitudes the cast may saturate), kept on the device until the caller reads it (``compact_all``: once
  per step for every parameter).

The torch reference is :mod:`faircast_plugins.master16`; tests compare the two under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_cast import DEFAULT_NUM_WARPS, DEFAULT_ROWS, M32, N_ROUNDS, _check_device, _launch, _noise16, interpreting

_INTERPRETER_ROWS = 1 << 12  # the interpreter pays per program: few, large tiles


@triton.jit
def _recover_kernel(bits_ptr, low_ptr, meta_ptr, ROWS: tl.constexpr, N_ROUNDS: tl.constexpr):
    # numel, offset and the key halves come from an int64 tensor, as in triton_cast: a plain int argument would be
    # typed by its value (i32 or i64, and 1 becomes a compile-time constant) and compiled once per kind
    numel = tl.load(meta_ptr + 0)
    offset = tl.load(meta_ptr + 1)
    k0 = tl.load(meta_ptr + 2).to(tl.uint32)
    k1 = tl.load(meta_ptr + 3).to(tl.uint32)
    pid = tl.program_id(0).to(tl.int64)
    groups = (offset >> 3) + pid * ROWS + tl.arange(0, ROWS)
    local = groups[:, None] * 8 + tl.arange(0, 8)[None, :] - offset
    mask = (local >= 0) & (local < numel)
    q = tl.load(bits_ptr + local, mask=mask, other=0).to(tl.uint32, bitcast=True)
    low = tl.load(low_ptr + local, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    carry = (low + _noise16(groups, k0, k1, N_ROUNDS)) >> 16
    tl.store(bits_ptr + local, ((q - (carry << 16)) | low).to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _compact_kernel(low_ptr, bits_ptr, misses_ptr, meta_ptr, BLOCK: tl.constexpr):
    numel = tl.load(meta_ptr + 0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    u = tl.load(bits_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(low_ptr + offs, (u & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    mag = u & 0x7FFFFFFF
    miss = (mag > 0x7F7F0000) & (mag != 0x7F800000) & mask
    tl.atomic_add(misses_ptr, tl.sum(miss.to(tl.int32), axis=0))


def _meta(values, device: torch.device) -> torch.Tensor:
    """The kernels' int64 scalars on ``device``; on CUDA a pinned, asynchronous copy (no host wait)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64)


def _check(bits: torch.Tensor, low16: torch.Tensor) -> None:
    _check_device(bits.device)
    if bits.dtype != torch.int32 or low16.dtype != torch.int16 or bits.numel() != low16.numel() \
            or bits.device != low16.device or not (bits.is_contiguous() and low16.is_contiguous()):
        raise ValueError("master16 kernels take contiguous int32 bits and int16 low halves of one size, one device")


def recover_(bits: torch.Tensor, low16: torch.Tensor, *, key: int, offset: int = 0) -> None:
    """In place: flat int32 ``bits`` (a served copy's fp32 bits, global indices from ``offset``) become the master
    bits, exceptions aside."""
    _check(bits, low16)
    n = bits.numel()
    if not n:
        return
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
        raise ValueError(f"key must be an int in [0, 2**64), got {key!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + n > 2**63:
        raise ValueError(f"offset must be an int in [0, 2**63 - numel], got {offset!r}")
    rows = _INTERPRETER_ROWS if interpreting() else DEFAULT_ROWS
    groups = ((offset + n + 7) >> 3) - (offset >> 3)
    meta = _meta([n, offset, key & M32, key >> 32], bits.device)
    _launch(_recover_kernel, (triton.cdiv(groups, rows),), bits, low16, meta, ROWS=rows, N_ROUNDS=N_ROUNDS,
            num_warps=DEFAULT_NUM_WARPS)


def compact(low16: torch.Tensor, bits: torch.Tensor, *, read: bool = True):
    """``low16 <- bits & 0xFFFF`` (flat int16 / int32); returns how many elements the stochastic carry rule misses:
    an int (``read``: a host sync), or the count on the device (``read=False``: :func:`master16.compact_all` reads
    a whole step's counts at once)."""
    _check(bits, low16)
    n = bits.numel()
    misses = torch.zeros(1, dtype=torch.int32, device=bits.device)
    if n:
        block = 1 << 16 if interpreting() else 2048
        _launch(_compact_kernel, (triton.cdiv(n, block),), low16, bits, misses, _meta([n], bits.device), BLOCK=block,
                num_warps=DEFAULT_NUM_WARPS)
    return int(misses.item()) if read else misses
