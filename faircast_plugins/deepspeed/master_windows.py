"""The fp32 masters of a DeepSpeed ZeRO-1/2/3 engine for the policy probe's master view, assembled a WINDOW of
consecutive parameters at a time: one collective per window, where ``safe_get_full_fp32_param`` runs one per
parameter (ZeRO-1/2: ``get_full_hp_param``, an all-reduce of a zero-filled full fp32 tensor; ZeRO-3:
``_fp32_state_allgather``, an all-gather of the parameter's fp32 partition).

Layouts read (DeepSpeed 0.19.6 and 0.19.8, ``runtime/zero/stage_1_and_2.py`` and ``stage3.py``):

ZeRO-1/2 (``DeepSpeedZeroOptimizer``)
    param group ``i``'s bf16 parameters are views of one flat buffer ``bit16_groups_flat[i]`` (in the order of
    ``round_robin_bit16_groups[i]``; offsets ``round_robin_bit16_offsets[i]`` in 0.19.8, which pads between
    parameters, else the parameters' own offsets in that buffer), split over ``real_dp_process_group[i]`` into
    contiguous partitions in rank order (``get_data_parallel_partitions``: ``numel // dp`` each, the first
    ``numel % dp`` one more); rank ``r``'s fp32 master of its partition is ``single_partition_of_fp32_groups[i]``,
    element for element. A window ``[a, b)`` of the flat layout is assembled by one broadcast per rank that owns part
    of it, from that rank's fp32 partition: every element crosses the wire once (the all-reduce moves each twice,
    and keeps no sign of a ``-0.0`` master: here the master's own bits arrive).
ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``)
    every parameter is partitioned on its own: rank ``r`` holds elements ``[r * n, (r + 1) * n)`` of it (``n =
    partition_numel()``, the last rank's zero-padded); sub-group ``i``'s fp32 partitions are the flat
    ``fp32_partitioned_groups_flat[i]``, the parameter at ``grad_position[param_id] = (i, offset, n)``, the same
    layout on every rank. A window ``[a, b)`` of that local layout is one all-gather over the parameters' partition
    group; parameter ``p`` is then rows ``[:, offset - a : offset - a + n]`` of the ``[world, b - a]`` result,
    flattened and cut to ``ds_numel`` (what ``_fp32_state_allgather`` returns for it alone).

Windows are whole parameters packed in layout order up to :data:`WINDOW_BYTES` of assembled fp32 (a larger parameter
is a window of its own), and the last :data:`KEPT_WINDOWS` assembled are kept, so memory is bounded whatever the
model size (the forward's order within a layer differs from the layout's: a second window saves reloading). Every
rank asks for the same parameters in the same order (the probe's forwards run on every rank), so every rank loads
the same windows in the same order: the collectives pair. A parameter outside these layouts (frozen: no master; a
ZeRO-3 sub-group swapped to NVMe; another optimizer: ZeRO-0's ``BF16_Optimizer``) gets ``None`` here and the
per-parameter view.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

#: bytes of assembled fp32 masters in one window (a parameter larger than this is a window of its own)
WINDOW_BYTES = 1 << 28
#: windows kept assembled at a time (the most recently used)
KEPT_WINDOWS = 2

FP32_BYTES = 4


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _global_rank(group, rank: int) -> int:
    dist = _dist()
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, rank)


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _pack(spans: List[Tuple[int, int]], limit: int) -> List[Tuple[int, int]]:
    """Consecutive ``(start, end)`` spans (sorted by start) packed into windows of at most ``limit`` elements each
    (a span longer than that alone)."""
    windows: List[Tuple[int, int]] = []
    for start, end in spans:
        if windows and end - windows[-1][0] <= limit:
            windows[-1] = (windows[-1][0], end)
        else:
            windows.append((start, end))
    return windows


class Zero12Layout:
    """Where ZeRO-1/2's fp32 masters are: see the module docstring."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.places: Dict[int, Tuple[int, int, int, torch.Size]] = {}  # id(p) -> (group, offset, numel, shape)
        self.bounds: List[List[Tuple[int, int]]] = []  # per group: each dp rank's [start, end) of the flat layout
        dist = _dist()
        for i, flat in enumerate(optimizer.bit16_groups_flat):
            group = optimizer.real_dp_process_group[i]
            dp = dist.get_world_size(group=group) if dist else 1
            base, extra = divmod(flat.numel(), dp)
            sizes = [base + (r < extra) for r in range(dp)]
            starts = [sum(sizes[:r]) for r in range(dp)]
            self.bounds.append([(s, s + n) for s, n in zip(starts, sizes)])
            me = dist.get_rank(group=group) if dist else 0
            if optimizer.single_partition_of_fp32_groups[i].numel() != sizes[me]:  # on one rank: refuse, not hang
                from ..patching import FairCastPatchError, installed_version

                raise FairCastPatchError(
                    f"faircast policy metrics under DeepSpeed {installed_version('deepspeed') or '?'} ZeRO-1/2: this "
                    f"rank's fp32 partition of param group {i} holds "
                    f"{optimizer.single_partition_of_fp32_groups[i].numel()} elements, not the {sizes[me]} of "
                    f"get_data_parallel_partitions as read in DeepSpeed 0.19. Use DeepSpeed 0.19, or set "
                    f"policy_metrics_every=0")
            params = optimizer.round_robin_bit16_groups[i]
            offsets = getattr(optimizer, "round_robin_bit16_offsets", None)
            offsets = offsets[i] if offsets is not None else [self._offset_in(flat, p) for p in params]
            for p, offset in zip(params, offsets):
                if offset is not None:
                    self.places[id(p)] = (i, int(offset), p.numel(), p.shape)

    @staticmethod
    def _offset_in(flat: torch.Tensor, p: torch.nn.Parameter) -> Optional[int]:
        """``p``'s offset in ``flat`` when its data is a view of it (DeepSpeed 0.19.6's layout), else None."""
        if p.data.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or p.dtype != flat.dtype:
            return None
        return p.data.storage_offset() - flat.storage_offset()

    def windows(self) -> Dict[int, List[Tuple[int, int]]]:
        spans: Dict[int, List[Tuple[int, int]]] = {}
        for i, offset, numel, _ in sorted(self.places.values()):
            spans.setdefault(i, []).append((offset, offset + numel))
        return {i: _pack(s, WINDOW_BYTES // FP32_BYTES) for i, s in spans.items()}

    def load(self, i: int, start: int, end: int) -> torch.Tensor:
        """The fp32 masters of the flat layout's ``[start, end)`` in group ``i`` (a collective over its dp group)."""
        opt, dist = self.optimizer, _dist()
        local = opt.single_partition_of_fp32_groups[i]
        group = opt.real_dp_process_group[i]
        me = dist.get_rank(group=group) if dist else 0
        bounds = self.bounds[i]
        if len(bounds) == 1:
            return local.narrow(0, start, end - start)  # one rank holds every master: a view, no copy
        out = torch.empty(end - start, dtype=local.dtype, device=_device())
        for r, (lo, hi) in enumerate(bounds):
            lo, hi = max(lo, start), min(hi, end)
            if lo >= hi:
                continue
            piece = out.narrow(0, lo - start, hi - lo)
            if r == me:
                piece.copy_(local.narrow(0, lo - bounds[r][0], hi - lo))
            dist.broadcast(piece, src=_global_rank(group, r), group=group)
        return out

    def extract(self, window: torch.Tensor, start: int, place) -> torch.Tensor:
        _, offset, numel, shape = place
        return window.narrow(0, offset - start, numel).view(shape)


class Zero3Layout:
    """Where ZeRO-3's fp32 masters are (see the module docstring); with ``served=True`` its bf16 partitions instead
    (``fp16_partitioned_groups_flat``, the same layout: each parameter's ``ds_tensor`` is a view of it), which
    DeepSpeed's module hooks gather into the served weights the forward reads."""

    def __init__(self, optimizer, served: bool = False):
        self.optimizer, self.served = optimizer, served
        self.flats = optimizer.fp16_partitioned_groups_flat if served else optimizer.fp32_partitioned_groups_flat
        self.places: Dict[int, Tuple[int, int, int, int, torch.Size]] = {}  # id(p) -> (sub-group, offset, n, numel, shape)
        self.groups: Dict[int, object] = {}  # sub-group -> the process group its parameters are partitioned over
        swappable = getattr(optimizer, "_swappable_optimizer_subgroup", lambda i: False)
        for i, params in enumerate(optimizer.fp16_groups):
            flat = self.flats[i] if i < len(self.flats) else None
            if not params or flat is None or (not served and swappable(i)):
                continue  # swapped to NVMe between uses: the per-parameter view (DeepSpeed swaps it in)
            groups = {id(optimizer._get_param_partition_group(p)) for p in params}
            if len(groups) != 1:
                continue
            self.groups[i] = optimizer._get_param_partition_group(params[0])
            for p in params:
                group, offset, n = optimizer.grad_position[optimizer.get_param_id(p)]
                if group != i or n != p.partition_numel() or (served and not self._holds(flat, offset, p)):
                    continue
                self.places[id(p)] = (i, int(offset), int(n), int(p.ds_numel), p.ds_shape)

    @staticmethod
    def _holds(flat: torch.Tensor, offset: int, p) -> bool:
        """``p``'s bf16 partition is the flat's ``[offset, offset + n)`` (not a copy elsewhere, e.g. offloaded)."""
        part = getattr(p, "ds_tensor", None)
        return (part is not None and part.dtype == flat.dtype and part.numel() == p.partition_numel()
                and part.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                and part.storage_offset() == flat.storage_offset() + offset)

    def windows(self) -> Dict[int, List[Tuple[int, int]]]:
        dist = _dist()
        spans: Dict[int, List[Tuple[int, int]]] = {}
        for i, offset, n, _, _ in sorted(self.places.values()):
            spans.setdefault(i, []).append((offset, offset + n))
        out = {}
        for i, s in spans.items():
            world = dist.get_world_size(group=self.groups[i]) if dist else 1
            out[i] = _pack(s, max(1, WINDOW_BYTES // (FP32_BYTES * world)))
        return out

    def load(self, i: int, start: int, end: int) -> torch.Tensor:
        """``[world, end - start]``: every rank's partitions ``[start, end)`` of sub-group ``i`` (one all-gather over
        its partition group)."""
        dist = _dist()
        group = self.groups[i]
        local = self.flats[i].narrow(0, start, end - start)
        world = dist.get_world_size(group=group) if dist else 1
        if world == 1:
            return local.unsqueeze(0)  # a view, no copy
        local = local.to(_device()).contiguous()
        out = torch.empty(world, end - start, dtype=local.dtype, device=local.device)
        dist.all_gather(list(out.unbind(0)), local, group=group)
        return out

    def extract(self, window: torch.Tensor, start: int, place) -> torch.Tensor:
        _, offset, n, numel, shape = place
        full = window[:, offset - start:offset - start + n].reshape(-1)[:numel].view(shape)
        return full.float() if self.served else full  # the served copy widened to fp32 (exact)


def layout_of(optimizer):
    """The layout of ``optimizer``'s fp32 masters (None: an optimizer not read here)."""
    if all(hasattr(optimizer, a) for a in ("fp32_partitioned_groups_flat", "grad_position", "fp16_groups")):
        return Zero3Layout(optimizer)
    if all(hasattr(optimizer, a) for a in ("single_partition_of_fp32_groups", "bit16_groups_flat",
                                           "round_robin_bit16_groups", "real_dp_process_group")):
        return Zero12Layout(optimizer)
    return None


class MasterWindows:
    """``p -> its full fp32 master`` (``None`` for a parameter outside the layout), assembling a window at a time.
    One per measurement: the masters move at every optimizer step."""

    def __init__(self, layout):
        self.layout = layout
        self.where: Dict[int, Tuple[int, int, int]] = {}  # id(p) -> (group, window start, window end)
        windows = layout.windows()
        starts = {i: [start for start, _ in w] for i, w in windows.items()}
        for pid, place in layout.places.items():
            i, offset = place[0], place[1]
            self.where[pid] = (i, *windows[i][bisect.bisect_right(starts[i], offset) - 1])
        self.kept: "OrderedDict[Tuple[int, int, int], torch.Tensor]" = OrderedDict()
        self.loads = 0  # windows assembled (collectives issued), for tests and the benchmark

    def __call__(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        key = self.where.get(id(p))
        if key is None:
            return None
        window = self.kept.get(key)
        if window is None:
            window = self.layout.load(*key)
            self.loads += 1
            self.kept[key] = window
            while len(self.kept) > KEPT_WINDOWS:
                self.kept.popitem(last=False)
        else:
            self.kept.move_to_end(key)
        return self.layout.extract(window, key[1], self.layout.places[id(p)]).to(p.data.device)


__all__ = ["KEPT_WINDOWS", "MasterWindows", "WINDOW_BYTES", "Zero12Layout", "Zero3Layout", "layout_of"]
