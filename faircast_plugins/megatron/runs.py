"""Runs: how a Megatron cast range is laid out in the full tensor and in the Hugging Face tensors, a few int64 rows
per row or head block instead of one index per element.

A run is a stretch of elements that advance by one in every index space at once. Megatron's partition rule makes a
TP-local param a run per chunk of rows along ``partition_dim`` (:func:`local_runs`, from :class:`.layout.ParamKey`
alone); a converter's element map is a run per contiguous block it moves (:class:`.hf_map.ElementMap`); their
intersection (:func:`intersect`) gives each cast range's runs in the HF tensors, which
:func:`faircast_plugins.cast.fair_cast_runs` casts in one launch. Every function here costs O(runs), never
O(elements).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .layout import ParamKey


def local_runs(key: ParamKey, start: int, end: int) -> torch.Tensor:
    """int64 ``(runs, 3)`` rows ``(local offset - start, full TP=1 index, length)`` of the TP-local flat elements
    ``[start, end)``, in local order (the same elements as :meth:`ParamKey.indices`, one row per chunk)."""
    if end <= start:
        return torch.zeros((0, 3), dtype=torch.int64)
    if key.contiguous:
        return torch.tensor([[0, key.offset(start), end - start]], dtype=torch.int64)
    d = key.partition_dim
    inner = 1
    for s in key.local_shape[d + 1:]:
        inner *= s
    rows = key.local_shape[d]
    chunk = rows // key.stride
    size = chunk * inner  # elements per run: `chunk` whole rows of the partitioned dim
    k = torch.arange(start // size, (end - 1) // size + 1, dtype=torch.int64)
    outer, c = k // key.stride, k % key.stride
    full = (outer * rows * key.tp_size + (c * key.tp_size + key.tp_rank) * chunk) * inner
    lo = torch.clamp(k * size, min=start)
    hi = torch.clamp((k + 1) * size, max=end)
    return torch.stack([lo - start, full + (lo - k * size), hi - lo], dim=1)


def intersect(local: torch.Tensor, emap_runs: torch.Tensor) -> torch.Tensor:
    """Pieces of the local runs ``(pos, full, length)`` cut at the element map's run boundaries: int64 rows ``(pos,
    name id, HF index, length)`` in local order. ``emap_runs``: rows ``(full first, length, name id, HF first)``
    sorted by full index, tiling the full tensor."""
    if not local.shape[0]:
        return torch.zeros((0, 4), dtype=torch.int64)
    F, L, N, H = (c.contiguous() for c in emap_runs.unbind(1))
    lp, lf, ln = (c.contiguous() for c in local.unbind(1))
    i0 = torch.searchsorted(F, lf, right=True) - 1
    i1 = torch.searchsorted(F, lf + ln - 1, right=True) - 1
    counts = i1 - i0 + 1
    which = torch.repeat_interleave(torch.arange(local.shape[0]), counts)
    firsts = torch.cumsum(counts, 0) - counts
    idx = i0[which] + torch.arange(which.numel()) - firsts[which]
    s = torch.maximum(lf[which], F[idx])
    e = torch.minimum(lf[which] + ln[which], F[idx] + L[idx])
    return torch.stack([lp[which] + s - lf[which], N[idx], H[idx] + s - F[idx], e - s], dim=1)


def merge(pos: torch.Tensor, hf: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Maximal runs ``(pos, hf, length)`` of runs in position order: neighbours where both indices continue join."""
    n = pos.numel()
    if n == 0:
        return torch.zeros((0, 3), dtype=torch.int64)
    start = torch.ones(n, dtype=torch.bool)
    start[1:] = (pos[1:] != pos[:-1] + length[:-1]) | (hf[1:] != hf[:-1] + length[:-1])
    first = torch.nonzero(start).view(-1)
    last = torch.cat([first[1:] - 1, torch.tensor([n - 1])])
    return torch.stack([pos[first], hf[first], pos[last] + length[last] - pos[first]], dim=1)


def split_by_name(pieces: torch.Tensor) -> Tuple[Tuple[int, torch.Tensor], ...]:
    """``(name id, maximal runs (pos, hf, length))`` per name id in ascending order (-1, padded rows, first; their
    runs are of offsets only: hf = pos)."""
    out = []
    for nid in torch.unique(pieces[:, 1]).tolist():
        sel = pieces[pieces[:, 1] == nid]
        hf = sel[:, 0] if nid < 0 else sel[:, 2]
        out.append((nid, merge(sel[:, 0], hf, sel[:, 3])))
    return tuple(out)
