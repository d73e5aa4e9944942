"""A stand-in of megatron-core's TransformerEngine grouped expert linears (``TEGroupedMLP``'s ``linear_fc1`` /
``linear_fc2``), test-only: TransformerEngine does not install here. It reproduces only what Fair Cast reads, the
module classes, the per-expert params ``weight<i>`` / ``bias<i>`` and the attributes left on them:

* megatron-core 0.18.2 ``extensions/transformer_engine.py`` ``TEGroupedLinear.__init__``: ``explicit_expert_comm =
  is_expert and (tp_size > 1 or expert_parallel)`` over the expert-tensor-parallel group ``_tp_group``; with it the
  column (row) linear holds ``output_size / etp`` rows (``input_size / etp`` columns) and TE gets
  ``parallel_mode=None``; ``allreduce = not expert_parallel`` on every param; then, when ``explicit_expert_comm``,
  ``partition_dim`` (0 column, 1 row) and ``partition_stride = 1`` are stamped on ``weight<i>`` and
  ``tensor_model_parallel`` is not;
* TransformerEngine >= 2.13 ``GroupedLinear`` sets no tensor-parallel attribute on ``weight<i>`` (only its
  ``single_grouped_weight`` path does); TE <= 2.12 sets ``tensor_model_parallel=True, partition_dim=0, stride 1`` on
  every weight under ``parallel_mode=None`` (the comment in megatron-core above its stamp);
* megatron-bridge's provider ends with ``set_defaults_if_not_set_tensor_model_parallel_attributes`` on every param
  (``tensor_model_parallel=False, partition_dim=-1, partition_stride=1`` where unset);
* megatron-core 0.16.1 does not stamp (``stamp=False``).

:func:`shard` is what each expert-tensor-parallel rank holds of the full (TP=1) tensor, as megatron-core computes with
it (``moe/experts.py``: a GLU ``linear_fc1`` holds ``[gate_r; up_r]`` on rank ``r``; ``linear_fc2`` the ``r``-th block
of input columns, its bias whole).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch


class FakeGroup:
    """A process group's ``size()`` / ``rank()`` (what megatron-core's ``get_pg_size`` / ``get_pg_rank`` read)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _defaults(p) -> None:
    for attr, value in (("tensor_model_parallel", False), ("partition_dim", -1), ("partition_stride", 1)):
        if not hasattr(p, attr):
            setattr(p, attr, value)


class TEGroupedLinear(torch.nn.Module):
    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: str, config, bias: bool,
                 etp: FakeGroup, expert_parallel: bool, te: str = "2.16", stamp: bool = True, bridge: bool = True):
        super().__init__()
        self.config = config
        self._tp_group = etp
        tp_size = etp.size()
        self.expert_parallel = expert_parallel
        self.explicit_expert_comm = tp_size > 1 or expert_parallel
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= tp_size
            else:
                input_size //= tp_size
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.zeros(output_size, input_size, dtype=torch.bfloat16))
            if te == "2.12":  # TE <= 2.12 under parallel_mode=None
                w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(output_size, dtype=torch.bfloat16)))
        for p in self.parameters():
            p.allreduce = not expert_parallel
        if stamp and self.explicit_expert_comm:
            for i in range(num_gemms):
                w = getattr(self, f"weight{i}")
                w.partition_dim, w.partition_stride = (0 if parallel_mode == "column" else 1), 1
        if bridge:
            for p in self.parameters():
                _defaults(p)


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, parallel_mode="column", **kwargs)


class TERowParallelGroupedLinear(TEGroupedLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, parallel_mode="row", **kwargs)


class _Layer(torch.nn.Module):
    def __init__(self, number: int):
        super().__init__()
        self.layer_number = number


def moe_model(*, hidden: int, ffn: int, experts: int, ep: int, etp: int, etp_rank: int, glu: bool = True,
              bias: bool = True, layer: int = 0, **kw) -> torch.nn.Module:
    """A GPT-shaped module tree with one TEGroupedMLP layer (``decoder.layers.<layer>.mlp.experts``) as one rank holds
    it: ``experts / ep`` local experts of ``ffn`` intermediate size, split over ``etp`` expert-tensor-parallel ranks."""
    config = SimpleNamespace(gated_linear_unit=glu)
    model = torch.nn.Module()
    model.config = config
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([_Layer(layer + 1)])
    mlp = torch.nn.Module()
    model.decoder.layers[0].mlp = mlp
    mlp.experts = torch.nn.Module()
    mlp.experts.num_local_experts = experts // ep
    group = FakeGroup(etp, etp_rank)
    common = dict(config=config, bias=bias, etp=group, expert_parallel=ep > 1, **kw)
    mlp.experts.linear_fc1 = TEColumnParallelGroupedLinear(experts // ep, hidden, ffn * (2 if glu else 1), **common)
    mlp.experts.linear_fc2 = TERowParallelGroupedLinear(experts // ep, ffn, hidden, **common)
    return model


def full_shape(which: str, kind: str, *, hidden: int, ffn: int, glu: bool = True):
    rows = ffn * (2 if glu else 1)
    if which == "linear_fc1":
        return (rows, hidden) if kind == "weight" else (rows,)
    return (hidden, ffn) if kind == "weight" else (hidden,)


def shard(full: torch.Tensor, which: str, kind: str, etp: int, rank: int, glu: bool = True) -> torch.Tensor:
    """What expert-tensor-parallel rank ``rank`` holds of ``full`` (megatron-core's computation layout)."""
    if which == "linear_fc1":
        parts = torch.chunk(full, 2, dim=0) if glu else (full,)
        return torch.cat([torch.chunk(part, etp, dim=0)[rank] for part in parts], dim=0)
    if kind == "bias":
        return full
    return torch.chunk(full, etp, dim=1)[rank]
