"""Which parameter element each bf16 weight address of a DeepSpeed engine holds.

DeepSpeed copies its fp32 masters back into bf16 memory with flat, partition-sized ``copy_`` calls whose
destinations are views of the weights (ZeRO-0/1/2, BF16_Optimizer), of ZeRO-3's partition buffers, or of
a per-rank staging buffer that is copied into the weights right after (ZeRO-1/2 with CPU offload). A
:class:`WeightLayout` maps any such destination to ``(canonical name, global element index)`` runs, so a
copy-back can be cast per ROUNDING.md whatever the stage, the partitioning or the world size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

BF16_BYTES = 2


@dataclass(frozen=True)
class Span:
    """``numel`` bf16 elements at byte address ``start``: elements ``offset ..`` of parameter ``name``.

    ``weights``: those elements as a flat bf16 tensor (to read what is served before a copy-back overwrites it).
    """

    start: int
    numel: int
    name: str
    offset: int
    weights: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + BF16_BYTES * self.numel


@dataclass(frozen=True)
class Alias:
    """A staging buffer at ``start`` whose contents are copied verbatim to the weights at ``target``."""

    start: int
    numel: int
    target: int


@dataclass(frozen=True)
class Segment:
    """Elements ``[begin, begin + length)`` of a flat copy are elements ``offset ..`` of parameter ``name``."""

    begin: int
    length: int
    name: str
    offset: int


class WeightLayout:
    """Address map of an engine's bf16 weights at one moment (rebuilt every step: offload moves memory)."""

    def __init__(self, spans: Sequence[Span], aliases: Sequence[Alias] = ()):
        self.spans = sorted((s for s in spans if s.numel > 0), key=lambda s: s.start)
        self._starts = [s.start for s in self.spans]
        self._by_name = {s.name: s for s in self.spans}
        self.aliases = list(aliases)
        for a, b in zip(self.spans, self.spans[1:]):
            if b.start < a.end:
                raise ValueError(f"bf16 weights of {a.name} and {b.name} overlap in memory; cannot tell them apart")

    @classmethod
    def of_engine(cls, engine, named_params: Sequence[Tuple[str, torch.nn.Parameter]]) -> "WeightLayout":
        """The layout of ``engine``'s low-precision weights, keyed by the canonical names in ``named_params``."""
        import deepspeed.comm as dist

        spans: List[Span] = []
        if engine.zero_optimization_stage() == 3:
            # Each rank holds elements [rank * p, (rank + 1) * p) of the flattened parameter in ds_tensor,
            # p = ds_tensor.ds_numel; the tail of the last partition is padding.
            for name, p in named_params:
                part = p.ds_tensor
                rank = dist.get_rank(group=p.ds_process_group)
                first = part.ds_numel * rank
                valid = min(part.ds_numel, p.ds_numel - first)
                if valid > 0 and part.numel() > 0:
                    spans.append(Span(part.data_ptr(), valid, name, first, part.data.view(-1)[:valid]))
        else:
            # ZeRO-0/1/2 and BF16_Optimizer keep every full parameter as a view of the bf16 weights.
            spans = [Span(p.data_ptr(), p.numel(), name, 0, p.data.view(-1)) for name, p in named_params if p.numel() > 0]
        return cls(spans, _offload_aliases(engine))

    def touches(self, dst: torch.Tensor) -> bool:
        """Whether any element of ``dst`` (any layout) may lie in the mapped weight memory."""
        if dst.numel() == 0:
            return False
        lo = dst.data_ptr()
        hi = lo + dst.element_size() * (1 + sum((n - 1) * abs(st) for n, st in zip(dst.shape, dst.stride())))
        targets = [(s.start, s.end) for s in self.spans]
        targets += [(a.start, a.start + BF16_BYTES * a.numel) for a in self.aliases]
        return any(a < hi and lo < b for a, b in targets)

    def segments(self, dst: torch.Tensor) -> List[Segment]:
        """The parameter runs that a flat, contiguous bf16 destination ``dst`` covers (padding is left out)."""
        lo = dst.data_ptr()
        n = dst.numel()
        for alias in self.aliases:
            if alias.start <= lo < alias.start + BF16_BYTES * alias.numel:
                lo = alias.target + (lo - alias.start)
                break
        hi = lo + BF16_BYTES * n
        out: List[Segment] = []
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while i < len(self.spans) and self.spans[i].start < hi:
            span = self.spans[i]
            a, b = max(lo, span.start), min(hi, span.end)
            if a < b:
                out.append(Segment((a - lo) // BF16_BYTES, (b - a) // BF16_BYTES, span.name,
                                   span.offset + (a - span.start) // BF16_BYTES))
            i += 1
        return out

    def weights(self, seg: Segment) -> torch.Tensor:
        """The bf16 weight elements a segment covers, as they are now (a view of the weight memory)."""
        span = self._by_name.get(seg.name)
        if span is None or span.weights is None or not span.offset <= seg.offset <= span.offset + span.numel - seg.length:
            raise KeyError(f"no mapped weights for {seg}")
        return span.weights[seg.offset - span.offset: seg.offset - span.offset + seg.length]


def _offload_aliases(engine) -> List[Alias]:
    """ZeRO-1/2 with CPU offload casts into a per-rank staging buffer, then copies it into this rank's partition."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() not in (1, 2) or not getattr(opt, "cpu_offload", False):
        return []
    import deepspeed.comm as dist

    aliases = []
    for i, buf in enumerate(opt.param_buffer_of_bit16_for_cpu_offload_groups):
        pid = dist.get_rank(group=opt.real_dp_process_group[i])
        target = opt.parallel_partitioned_bit16_groups[i][pid]
        aliases.append(Alias(buf.data_ptr(), buf.numel(), target.data_ptr()))
    return aliases


def copy_back_elements(engine, layout: WeightLayout) -> int:
    """How many parameter elements this rank's copy-back must write: the count Fair Cast must have cast.

    ZeRO-0 copies every full parameter on every rank and ZeRO-3 this rank's partition of each (the spans of
    ``layout``); ZeRO-1/2 and BF16_Optimizer copy this rank's partition of each flat parameter group.
    """
    stage = engine.zero_optimization_stage()
    if stage in (0, 3):
        return sum(s.numel for s in layout.spans)
    import deepspeed.comm as dist

    opt = engine.optimizer
    groups = opt.bf16_partitioned_groups if hasattr(opt, "bf16_partitioned_groups") else opt.parallel_partitioned_bit16_groups
    total = 0
    for i, partitions in enumerate(groups):
        partition = partitions[dist.get_rank(group=opt.real_dp_process_group[i])]
        total += sum(seg.length for seg in layout.segments(partition))
    return total
