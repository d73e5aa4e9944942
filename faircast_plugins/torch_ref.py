"""Pure-torch implementation of ROUNDING.md: runs on any device, and is the semantic reference.

Everything is integer arithmetic on int64 tensors holding uint32 words (torch lacks uint32 add/shift on
CPU). An int64 product of two values below 2**32 wraps mod 2**64, so its low and high 32-bit halves are
exact after masking. Work is done in bounded chunks so temporaries stay small.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10

# Elements per chunk of the torch path (a multiple of 8): bounds the int64 temporaries to a few MB.
CHUNK = 1 << 18


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 on int64 tensors (or ints) holding uint32 words; keys may be ints or int64 tensors."""
    for r in range(rounds):
        if r:
            k0 = (k0 + PHILOX_W0) & M32
            k1 = (k1 + PHILOX_W1) & M32
        p0 = c0 * PHILOX_M0
        p1 = c2 * PHILOX_M1
        hi0, lo0 = (p0 >> 32) & M32, p0 & M32
        hi1, lo1 = (p1 >> 32) & M32, p1 & M32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def noise16(key, start: int, n: int, device=None) -> torch.Tensor:
    """The 16-bit noise (int32 tensor) of global elements ``start .. start+n-1`` under ``key``."""
    g0 = start >> 3
    g1 = (start + n + 7) >> 3
    g = torch.arange(g0, g1, dtype=torch.int64, device=device)
    k0, k1 = key & M32, key >> 32
    zero = torch.zeros_like(g)
    r0, r1, r2, r3 = philox4x32(g & M32, g >> 32, zero, zero, k0, k1)
    words = torch.stack((r0, r1, r2, r3), dim=1)  # [G, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=2).reshape(-1)  # lane order 0..7 per group
    lo = start & 7
    return halves[lo : lo + n].to(torch.int32)


def noise16_at(key, indices: torch.Tensor) -> torch.Tensor:
    """The 16-bit noise (int32 tensor, same shape) of arbitrary global element indices (int64 tensor)."""
    g = indices >> 3
    lane = indices & 7
    k0, k1 = key & M32, key >> 32
    zero = torch.zeros_like(g)
    words = torch.stack(philox4x32(g & M32, g >> 32, zero, zero, k0, k1), dim=-1)
    word = torch.gather(words, -1, (lane >> 1).unsqueeze(-1)).squeeze(-1)
    return ((word >> ((lane & 1) * 16)) & 0xFFFF).to(torch.int32)


def _nan_bits(u: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    return ((u >> 16) & 0x8000) | (mag >> 16) | 0x0040


def stochastic_bits(u: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """bf16 bits (int32) of fp32 bits ``u`` (int32) under ``noise`` (int32 in [0, 65536))."""
    mag = u & 0x7FFFFFFF
    sign16 = (u >> 16) & 0x8000
    finite = torch.clamp((mag + noise) >> 16, max=0x7F7F)
    out = torch.where(mag == 0x7F800000, torch.full_like(mag, 0x7F80), finite) | sign16
    return torch.where(mag > 0x7F800000, _nan_bits(u, mag), out)


def nearest(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even as ``x.to(torch.bfloat16)``, with the contract's NaN rule."""
    q = x.to(torch.bfloat16)
    nan = torch.isnan(x)
    if bool(nan.any()):
        u = x.view(torch.int32)
        bits = _nan_bits(u, u & 0x7FFFFFFF).to(torch.int16)
        q = torch.where(nan, bits.view(torch.bfloat16), q)
    return q


def _as_bf16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


def cast_stochastic_(out: torch.Tensor, x: torch.Tensor, key: int, offset: int) -> torch.Tensor:
    """Write the stochastic cast of flat fp32 ``x`` (global indices from ``offset``) into flat bf16 ``out``."""
    n = x.numel()
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        u = x[s:e].view(torch.int32)
        out[s:e] = _as_bf16(stochastic_bits(u, noise16(key, offset + s, e - s, device=x.device)))
    return out


def cast_stochastic_at(x: torch.Tensor, key: int, indices: torch.Tensor) -> torch.Tensor:
    """Stochastic cast of ``x`` (any layout) whose elements have the given global ``indices``."""
    u = x.contiguous().view(torch.int32)
    return _as_bf16(stochastic_bits(u, noise16_at(key, indices.contiguous())))


def nearest_bits(u: torch.Tensor) -> torch.Tensor:
    """bf16 bits (int32) of fp32 bits ``u`` (int32), round to nearest even (overflow to inf), NaN rule of §4."""
    mag = u & 0x7FFFFFFF
    rne = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    out = ((u >> 16) & 0x8000) | rne
    return torch.where(mag > 0x7F800000, _nan_bits(u, mag), out)


def error_feedback_bits(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ROUNDING.md §4 error feedback of fp32 ``x`` with residual ``r``: (bf16 bits as int32, the new residual).

    A non-finite residual counts as 0. A non-finite ``x`` is served by the nearest rule of its own bits. Else
    ``s = x + r`` is rounded to nearest even, saturating at the largest finite bf16 of its sign; the new residual
    is ``s - q``, or 0 where ``x`` is not finite or ``q`` saturated.
    """
    ux = x.view(torch.int32)
    r = torch.where((r.view(torch.int32) & 0x7FFFFFFF) >= 0x7F800000, torch.zeros_like(r), r)
    s = x + r
    q = nearest_bits(s.view(torch.int32))
    saturated = (q & 0x7FFF) >= 0x7F80  # s rounds to +-inf or overflowed fp32 (or x is not finite)
    q = torch.where(saturated, (q & 0x8000) | 0x7F7F, q)
    new_r = torch.where(saturated, torch.zeros_like(s), s - _as_bf16(q).float())  # exact
    x_special = (ux & 0x7FFFFFFF) >= 0x7F800000
    return torch.where(x_special, nearest_bits(ux), q), new_r


def cast_error_feedback_(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Error feedback on flat tensors (ROUNDING.md §4): writes ``out`` and updates ``residual`` in place."""
    n = x.numel()
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        q, r = error_feedback_bits(x[s:e], residual[s:e])
        out[s:e] = _as_bf16(q)
        residual[s:e] = r
    return out
