"""An EMULATED coarser served grid for the A/B harness (ab-audit-2 §5.3 (3)): not a product rounding mode.

What it models. The engine serves ``w0 + Q_u(w - w0)``: ``w`` the fp32 master, ``w0`` the run's step-0 master (the
bf16 warm start, on the bf16 grid), ``u = S * ulp_bf16(w0)`` per element with ``S`` an integer scale. The base
weights stay exact and only the *update* since step 0 is quantized, ``S`` times more coarsely than bf16 quantizes it
(``S = 16``: about e4m3's 4 significant bits against bf16's 8). An update the served copy does not carry piles up the
way bf16's does, but ``S`` times longer: round to nearest lags ``~S`` times more steps at a given learning rate, which
brings the toy's lag (a few steps at bf16) to the preprint's 50-150 steps. ``Q_u`` is one of:

* ``nearest``: ``u * round(t)`` with ``t = (w - w0) / u``, ties to the even multiple (even ``n``, the update counted
  in grid steps from ``w0``). At ``S = 1`` this is bf16 round to nearest of ``w`` while ``w`` stays in ``w0``'s
  binade, except at an exact tie when ``w0``'s bf16 mantissa is odd (bf16 sends a tie to the even *mantissa*, this
  rule to the even *update*).
* ``stochastic``: ``n = sigma * floor((floor(sigma * t * 2**16) + noise) / 2**16)``, ``sigma`` the sign of ``w0``
  (its sign bit: -0.0 counts negative) and ``noise`` the contract's 16-bit per-element noise
  (``torch_ref.noise16``, ROUNDING.md §3) under ``key`` (``derive_key(seed, step, canonical name)``, as Fair Cast
  keys its cast) at the element's global (row-major, unsharded) index. This is ROUNDING.md's stochastic rule applied
  to the update in sign-magnitude about ``w0``, so at ``S = 1``, while ``w`` stays in ``w0``'s binade with its sign,
  it is ``fair_cast(w, key=key)`` bit for bit. Reproducible and index-keyed like Fair Cast (a slice cast alone, with
  its offset, equals the same slice of the whole). Unbiased up to the 16-bit uniform: ``sigma * t`` is truncated to
  16 fraction bits before the noise is added, so ``|E[served] - w| < u * 2**-16`` (``S * 2**-16`` bf16 ulps, always
  toward ``-inf`` in ``sigma``'s direction); Fair Cast's own cast is exactly unbiased because fp32 has exactly 16 bits
  below bf16, which holds here only at ``S = 1`` inside ``w0``'s binade.

``ulp_bf16``, explicitly: the spacing of the bf16 grid in ``w0``'s binade, ``2**(max(E, 1) - 134)`` with ``E`` the
8-bit biased exponent of ``w0``'s fp32 bits. A normal ``w0`` (E >= 1) gets ``2**(E - 127 - 7)``; zero and subnormal
``w0`` (E = 0) get the subnormal spacing ``2**-133``, which is also the spacing of the smallest normal binade (bf16's
grid is uniform across that boundary). So an element that starts at 0 is quantized about as finely as fp32 (the
grid there is ``S * 2**-133``): bf16 is that fine near zero too. The grid is fixed at ``w0``'s binade for the whole
run: an element that moves into another binade keeps its step-0 spacing (a real coarse grid would refine or coarsen
with it). A non-finite ``w0`` is refused; a non-finite master is served as it is.

Its bias in the A/B, stated: the emulation keeps the first-order dynamics (which updates are dropped; lag ``~ u / lr``)
but multiplies the second-order costs by ``~S``: stochastic rounding's noise variance (``~ u * |w - w0|``) and round
to nearest's crossing jumps (a whole ``u`` at once) are both ``S`` times bf16's. The test is therefore **biased
against Fair Cast**, about ``S``-fold in its noise cost. It is a model of the mechanism, not bf16 evidence.

Arithmetic: float64 throughout. ``w - w0`` is exact there (two fp32 values whose exponents differ by at most 29),
``/ u`` is exact when ``S`` is a power of two (else one float64 rounding), and for ``w0`` on the bf16 grid (the
A/B refuses any other start) ``w0 + n * u`` is a multiple of ``ulp_bf16(w0)`` that fp32 holds exactly unless it needs
more than 24 significant bits (then fp32 rounds it to nearest: in practice only for ``w0`` at zero or subnormal,
where the grid is finer than fp32's). Where ``n = 0`` the served
value is ``w0`` itself, bit for bit (-0.0 stays -0.0).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..torch_ref import CHUNK, noise16

#: The two rules ``Q_u`` (``nearest``: the standard export's analogue; ``stochastic``: Fair Cast's).
MODES = ("nearest", "stochastic")

_TWO16 = 65536.0


def check_scale(scale) -> int:
    """``scale`` as the grid's integer ``S >= 1``; a clear ``ValueError`` otherwise."""
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"the emulated grid's scale S must be an integer >= 1 (u = S * ulp_bf16(w0)), got {scale!r}")
    return scale


def ulp_bf16(w0: torch.Tensor) -> torch.Tensor:
    """The bf16 grid's spacing in the binade of each fp32 element of ``w0`` (float64, exact powers of two):
    ``2**(max(E, 1) - 134)``, ``E`` the biased exponent; zero and subnormals get ``2**-133``."""
    if w0.dtype != torch.float32:
        raise TypeError(f"ulp_bf16 takes an fp32 tensor, got {w0.dtype}")
    biased = (w0.contiguous().view(torch.int32).to(torch.int64) >> 23) & 0xFF
    if bool((biased == 0xFF).any()):
        raise ValueError("ulp_bf16: a non-finite w0 has no grid spacing (the step-0 master must be finite)")
    exponent = biased.clamp(min=1) - 134  # in [-133, 120]: a normal float64
    return ((exponent + 1023) << 52).view(torch.float64)  # 2**exponent, built from its bits


def coarse_served(w: torch.Tensor, w0: torch.Tensor, scale: int, mode: str, *, key: Optional[int] = None,
                  offset: int = 0) -> torch.Tensor:
    """The served fp32 copy ``w0 + Q_u(w - w0)``, ``u = scale * ulp_bf16(w0)`` (module docstring for every rule).

    ``w`` and ``w0``: fp32 tensors of one shape, row-major; ``offset``: the global index of their first element (a
    shard or slice of a larger parameter); ``key``: the stochastic rule's Philox key (``derive_key``), unused by
    ``nearest``. Returns a new fp32 tensor of ``w``'s shape on its device."""
    scale = check_scale(scale)
    if mode not in MODES:
        raise ValueError(f"unknown emulated-grid rounding {mode!r}; one of {', '.join(MODES)}")
    if w.dtype != torch.float32 or w0.dtype != torch.float32:
        raise TypeError(f"the emulated grid takes fp32 master and start, got {w.dtype} and {w0.dtype}")
    if w.shape != w0.shape:
        raise ValueError(f"master shape {tuple(w.shape)} differs from its step-0 shape {tuple(w0.shape)}")
    if mode == "stochastic" and key is None:
        raise ValueError("the stochastic emulated grid needs a key (derive_key(seed, step, canonical name))")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative int (a global element index), got {offset!r}")
    flat_w, flat_w0 = w.detach().contiguous().view(-1), w0.detach().contiguous().view(-1)
    out = torch.empty_like(flat_w)
    for s in range(0, flat_w.numel(), CHUNK):
        e = min(flat_w.numel(), s + CHUNK)
        noise = noise16(key, offset + s, e - s, device=w.device) if mode == "stochastic" else None
        out[s:e] = _served_chunk(flat_w[s:e], flat_w0[s:e], scale, noise)
    return out.view(w.shape)


def _served_chunk(w: torch.Tensor, w0: torch.Tensor, scale: int, noise: Optional[torch.Tensor]) -> torch.Tensor:
    u = ulp_bf16(w0) * scale
    w0d = w0.double()
    t = (w.double() - w0d) / u
    if noise is None:
        n = torch.round(t)  # half to even
    else:
        sigma = torch.where(w0.view(torch.int32) < 0, -1.0, 1.0).to(torch.float64)
        fixed = torch.floor(sigma * t * _TWO16)  # the update in sigma's direction, 16 fraction bits
        n = sigma * torch.floor((fixed + noise.to(torch.float64)) / _TWO16)
    served = torch.where(n == 0, w0, (w0d + n * u).to(torch.float32))
    return torch.where(torch.isfinite(w), served, w)
