"""An fp32 master kept in 2 B per element beside its served copy: its low 16 bits, plus a short exception list.

A served copy ``q`` of master bits ``u`` holds ``u``'s sign and high 16 bits up to one carry (ROUNDING.md §4):

* ``stochastic`` / ``sticky``: ``q = sign | ((u & 0x7FFFFFFF) + noise) >> 16``, so the carry is
  ``(low16 + noise) >> 16``. It is read back from the cast engine itself, by casting the probe ``1.0 + low16 * 2**-23``
  (fp32 bits ``0x3F80:low16``) under the same key and global indices: the probe is served ``0x3F80 + carry``. No
  noise function is duplicated here, and the carry comes from the very engine that made ``q``.
  The rule fails only where the cast saturates (finite ``|u| > 0x7F7F0000``: ``mag + noise`` may pass the largest
  finite bf16) and for NaN (the quiet bit); infinities, zeros (either sign) and subnormals recover exactly.
* ``nearest`` (round to nearest even, e.g. a frozen weight's ``.to(torch.bfloat16)``): the carry is
  ``(low16 + 0x7FFF + (h & 1)) >> 16`` with ``h`` the served high bits; exact except at a tie that rounded up to an
  even ``h`` (and overflow, NaN), which the comparison at :func:`compact` puts in the exception list.

The exception list holds the flat indices and full fp32 values of every element the rule misses.

This module is the torch reference (vectorized, in bounded chunks). For the stochastic-rule modes the ``cpu`` and
``triton`` backends run one fused pass each instead (:mod:`faircast_plugins.kernels.cpu_master16`,
:mod:`faircast_plugins.kernels.triton_master16`): the compaction takes the low halves and counts the misses, the
recovery computes the cast's noise in place, no probe tensor. Each kernel module is checked against this reference
once per process before its first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

from .cast import STOCHASTIC_RULE, fair_cast, resolve_backend

#: modes whose served copy gives the master back from its low 16 bits
COMPACT_MODES = STOCHASTIC_RULE + ("nearest",)
#: elements per chunk: bounds the temporaries (int32 / bf16 probes) to a few MB
CHUNK = 1 << 20
_ONE = 0x3F800000  # fp32 bits of 1.0: the probe's high half
_SATURATES = 0x7F7F0000  # finite magnitudes above this may be clamped to 0x7F7F by the stochastic cast
_INF = 0x7F800000


def low16_of(bits: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of int32 ``bits`` as int16 (two's complement of the unsigned value)."""
    return (((bits & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16)


def unsigned16(low16: torch.Tensor) -> torch.Tensor:
    """int16 ``low16`` back to its unsigned value (int32 in [0, 65536))."""
    return low16.to(torch.int32) & 0xFFFF


def stochastic_misses(bits: torch.Tensor) -> torch.Tensor:
    """Where the stochastic carry rule cannot give fp32 ``bits`` (int32) back: NaN, and finite magnitudes the cast
    may saturate. Needs no noise."""
    mag = bits & 0x7FFFFFFF
    return (mag > _SATURATES) & (mag != _INF)


def nearest_carry(q_bits: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even carry guessed from the served fp32 bits ``q_bits`` and the unsigned ``low`` 16 bits."""
    h = (q_bits >> 16) & 1
    return (low + 0x7FFF + h) >> 16


def stochastic_carry(low: torch.Tensor, *, key: int, offset: int, mode: str, backend: str) -> torch.Tensor:
    """``(low + noise) >> 16`` of elements with global indices from ``offset``, from the cast engine (a probe cast)."""
    probe = (low | _ONE).view(torch.float32)
    served = fair_cast(probe, key=key, offset=offset, mode=mode, backend=backend)
    return served.view(torch.int16).to(torch.int32) - (_ONE >> 16)


def assemble(q_bits: torch.Tensor, low: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """Master bits from served fp32 bits, unsigned low 16 bits and the carry: ``sign | (h - carry) << 16 | low``."""
    return (q_bits - (carry << 16)) | low


@dataclass
class Compact:
    """One parameter's master beside its served copy: 2 B per element plus its exceptions."""

    low16: torch.Tensor  # int16, flat, one per element
    index: torch.Tensor  # int64 flat indices the rule misses
    value: torch.Tensor  # their fp32 masters
    key: Optional[int]  # the key the served copy was cast under (None: nearest)
    mode: str  # "stochastic", "sticky" or "nearest"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.low16, self.index, self.value))


def _carry(q_bits, low, c: Compact, start: int, backend: str) -> torch.Tensor:
    if c.mode == "nearest":
        return nearest_carry(q_bits, low)
    return stochastic_carry(low, key=c.key, offset=start, mode=c.mode, backend=backend)


_CHECKED: set = set()  # kernel modules that matched this reference (checked on the first device they ran on)


def _kernels(backend: str, device: torch.device, mode: str):
    """The fused kernel module for a stochastic-rule ``mode`` on the resolved ``backend``, or None (this reference)."""
    if mode not in STOCHASTIC_RULE:
        return None
    resolved = resolve_backend(backend, device)
    if resolved == "cpu":
        from .kernels import cpu_master16 as module
    elif resolved == "triton":
        from .kernels import triton_master16 as module
    else:
        return None
    if module.__name__ not in _CHECKED:
        _self_check(module, device)
        _CHECKED.add(module.__name__)
    return module


def _self_check(module, device: torch.device) -> None:
    """The kernels must give back a master cast by the torch reference (odd size, specials included); raises
    otherwise (for the numba kernels: a stale disk cache of an edited ``cpu_cast.py``)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    master = torch.randn(9 * 1024 + 37, generator=g, device="cpu", dtype=torch.float32) * 0.02
    master[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, torch.finfo(torch.float32).max],
                              device="cpu", dtype=torch.float32)
    key = 0x243F6A8885A308D3
    served = fair_cast(master, key=key, mode="stochastic", backend="torch").float()
    low16 = torch.empty(master.numel(), dtype=torch.int16, device=device)
    for extra in getattr(module, "SELF_CHECK_VARIANTS", ({},)):
        bits = served.view(torch.int32).clone().to(device)
        misses = module.compact(low16, master.view(torch.int32).to(device), **extra)
        module.recover_(bits, low16, key=key, **extra)
        bits[5] = master.view(torch.int32)[5]  # the saturating element is an exception: the caller puts it back
        if misses != 1 or not torch.equal(bits.cpu(), master.view(torch.int32)):
            raise RuntimeError(f"{module.__name__} does not give back the master of a torch-reference cast: "
                               "a stale numba cache? delete faircast_plugins/kernels/__pycache__ and retry, or pass "
                               "backend='torch'")


def _low16_for(x: torch.Tensor, low16: Optional[torch.Tensor]) -> torch.Tensor:
    n = x.numel()
    if low16 is None or low16.numel() != n or low16.device != x.device or low16.dtype != torch.int16 \
            or low16.dim() != 1 or not low16.is_contiguous():
        low16 = torch.empty(n, dtype=torch.int16, device=x.device)
    return low16


def _fused_compact(x: torch.Tensor, low16: torch.Tensor, found: int, kernels, key: Optional[int],
                   mode: str) -> Compact:
    """The compact state after a fused compaction counted ``found`` misses (the masters ``x`` still intact)."""
    bits = x.view(torch.int32)
    index = torch.nonzero(stochastic_misses(bits)).reshape(-1) if found else torch.zeros(0, dtype=torch.int64,
                                                                                         device=x.device)
    if index.numel() != found:
        raise RuntimeError(f"{kernels.__name__} counted {found} elements the carry rule misses, the reference "
                           f"{index.numel()}: pass backend='torch' and report this")
    return Compact(low16, index, x[index].clone(), key, mode)


def compact(master: torch.Tensor, served: torch.Tensor, *, key: Optional[int], mode: str, backend: str = "auto",
            low16: Optional[torch.Tensor] = None) -> Compact:
    """The compact form of fp32 ``master`` whose served copy (bf16, or bf16 values in fp32) is ``served``; the served
    copy of a stochastic-rule mode must come from ``fair_cast(master, key=key, mode=mode)`` with global indices from 0
    (it is read only under ``nearest``). ``low16`` (int16, flat): a buffer to reuse."""
    if mode not in COMPACT_MODES:
        raise ValueError(f"a master cannot be kept in 2 B under mode {mode!r}; compact modes: {COMPACT_MODES}")
    x = master.detach().reshape(-1)
    bits = x.view(torch.int32)
    n = x.numel()
    low16 = _low16_for(x, low16)
    kernels = _kernels(backend, x.device, mode)
    if kernels is not None:
        return _fused_compact(x, low16, int(kernels.compact(low16, bits)), kernels, key, mode)
    misses = []
    q = served.detach().reshape(-1) if mode == "nearest" else None
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        b = bits[s:e]
        low16[s:e] = low16_of(b)
        if mode == "nearest":  # compare with what the rule gives back: exact whatever made the copy
            qb = q[s:e].float().view(torch.int32)
            miss = assemble(qb, b & 0xFFFF, nearest_carry(qb, b & 0xFFFF)) != b
        else:
            miss = stochastic_misses(b)
        misses.append(torch.nonzero(miss).reshape(-1) + s)
    index = torch.cat(misses) if misses else torch.zeros(0, dtype=torch.int64, device=x.device)
    return Compact(low16, index, x[index].clone(), key, mode)


def compact_all(masters: Mapping[str, torch.Tensor], *, keys: Mapping[str, Optional[int]], mode: str,
                backend: str = "auto", buffers: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, Compact]:
    """:func:`compact` of every master of a step under a stochastic-rule ``mode`` (the served copies are not needed),
    with the fused kernels' miss counts read from the device once for all of them: one host sync per step, not one
    per parameter. Call it while the masters are intact (before the parameters take their served copies): the
    exceptions are read from them. ``buffers``: low halves to reuse, by name."""
    if mode not in STOCHASTIC_RULE:
        raise ValueError(f"compact_all takes a stochastic-rule mode {STOCHASTIC_RULE}, got {mode!r}")
    out: Dict[str, Compact] = {}
    pending = []
    for name, master in masters.items():
        x = master.detach().reshape(-1)
        low16 = _low16_for(x, (buffers or {}).get(name))
        kernels = _kernels(backend, x.device, mode)
        if kernels is None:  # the torch reference: chunked, one nonzero per chunk
            out[name] = compact(x, None, key=keys[name], mode=mode, backend=backend, low16=low16)
        else:
            pending.append((name, x, low16, kernels, kernels.compact(low16, x.view(torch.int32), read=False)))
    counts = [c for _, _, _, _, c in pending]
    on_device = [i for i, c in enumerate(counts) if isinstance(c, torch.Tensor)]
    if on_device:  # the one host read
        for i, v in zip(on_device, torch.cat([counts[i].reshape(1) for i in on_device]).tolist()):
            counts[i] = v
    for (name, x, low16, kernels, _), found in zip(pending, counts):
        out[name] = _fused_compact(x, low16, int(found), kernels, keys[name], mode)
    return {name: out[name] for name in masters}


def recover_(p: torch.Tensor, c: Compact, backend: str = "auto") -> torch.Tensor:
    """In place: fp32 ``p`` holds the served copy (bf16 values); afterwards it holds the master, bit for bit."""
    flat = p.detach().view(-1)
    bits = flat.view(torch.int32)
    n = flat.numel()
    if c.low16.numel() != n or c.low16.dtype != torch.int16 or c.low16.device != flat.device:
        raise ValueError(f"this compact master has {c.low16.numel()} low halves ({c.low16.dtype}, {c.low16.device}) "
                         f"for a parameter of {n} elements on {flat.device}: it belongs to another tensor")
    kernels = _kernels(backend, flat.device, c.mode)
    if kernels is not None:
        kernels.recover_(bits, c.low16, key=c.key)
    else:
        for s in range(0, n, CHUNK):
            e = min(n, s + CHUNK)
            qb = bits[s:e]
            low = unsigned16(c.low16[s:e])
            bits[s:e] = assemble(qb, low, _carry(qb, low, c, s, backend))
    if c.index.numel():
        flat[c.index] = c.value
    return p


def recover(served: torch.Tensor, c: Compact, backend: str = "auto") -> torch.Tensor:
    """The master (a new fp32 tensor of ``served``'s shape) from its served copy (bf16, or bf16 values in fp32)."""
    return recover_(served.detach().float().clone(), c, backend)
