"""Which parameter element each bf16 model-param element of a Megatron-core model holds.

A Megatron rank holds a tensor-parallel (TP) slice of each weight, of its pipeline stage's layers and of its
expert-parallel rank's experts, under local names (``decoder.layers.0`` is another layer on every stage,
``local_experts.0`` another expert on every expert rank). :func:`param_keys` gives each bf16 parameter the key
ROUNDING.md asks for, from Megatron's own metadata:

* **name**: the Megatron-native canonical name (ROUNDING.md §1, "Megatron-core without a converter"): the name in
  the unwrapped model with the global layer index (``layer_number - 1``) and the global expert index
  (``ep_rank * num_local_experts + i``); a pipeline-parallel ``output_layer`` tied to the embedding is keyed as
  ``embedding.word_embeddings.weight``;
* **index**: the element's row-major position in the full (TP=1) tensor, from the param's ``partition_dim`` and
  ``partition_stride`` (Megatron's ``_initialize_affine_weight_cpu`` split: chunks of ``local / stride`` rows along
  ``partition_dim``, rank ``r`` holding chunks ``r, r + tp, ...``).

TransformerEngine's grouped expert linears (``TEGroupedMLP``: ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``, params ``weight<i>`` / ``bias<i>``) are keyed from what megatron-core and
megatron-bridge do with them, not from their attributes: megatron-core 0.18.2 with TE >= 2.13 stamps only
``partition_dim`` and ``partition_stride = 1`` and megatron-bridge then sets ``tensor_model_parallel = False``; TE <= 2.12
stamps ``partition_dim = 0`` on every weight. The split is the one megatron-core computes with (``explicit_expert_comm``:
column -> the output rows split over the module's expert-tensor-parallel group, row -> the input columns; a GLU
``linear_fc1`` holds ``[gate_r; up_r]`` on rank ``r``, i.e. stride 2) and the one megatron-bridge's export gathers
(``AutoMapping`` by module class, ``GatedMLPMapping`` per-rank gate/up split). A grouped layout this module does not
know is refused (:class:`LayoutError`), and so is any param with a ``partition_dim`` but no ``tensor_model_parallel``
under tensor parallelism: its split cannot be told with certainty.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

_LAYER = re.compile(r"^(.*?)(?:^|\.)layers\.(\d+)$")
_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_EXPERT_PARAM = re.compile(r"\.experts\.(?:local_experts\.|linear_fc)")  # megatron-bridge's ``is_expert``
#: megatron-core's TE grouped expert linears and the split megatron-bridge's AutoMapping gives each class
GROUPED_LINEARS = {"TEColumnParallelGroupedLinear": "column", "TERowParallelGroupedLinear": "row"}
#: module classes (by name part) whose ``weight`` megatron-core always splits over their tensor-parallel group
_SPLIT_WEIGHT_MODULES = ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding")
_GROUPED_PARAM = re.compile(r"^(weight|bias)(\d+)$")
TIED_EMBEDDING = "embedding.word_embeddings.weight"


class LayoutError(ValueError):
    """A parameter whose global position Fair Cast cannot derive from Megatron's metadata."""


@dataclass(frozen=True)
class ParamKey:
    """The canonical name of one TP-local param and where its elements sit in the full tensor."""

    name: str
    local_shape: Tuple[int, ...]
    tp_size: int = 1
    tp_rank: int = 0
    partition_dim: int = -1  # -1: not split by tensor parallelism (replicated on the TP ranks)
    stride: int = 1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    @property
    def contiguous(self) -> bool:
        """True when the TP-local param is one contiguous run of the full flattened tensor."""
        return self.tp_size == 1 or self.partition_dim < 0 or (self.partition_dim == 0 and self.stride == 1)

    def offset(self, start: int = 0) -> int:
        """Global index of local flat element ``start`` (``contiguous`` params only)."""
        if self.tp_size == 1 or self.partition_dim < 0:
            return start
        return self.tp_rank * self.numel + start

    def indices(self, start: int, end: int, device=None) -> torch.Tensor:
        """Global indices of local flat elements ``[start, end)`` (any layout)."""
        local = torch.arange(start, end, dtype=torch.int64, device=device)
        if self.contiguous:
            return local + self.offset(0)
        d = self.partition_dim
        inner = 1
        for s in self.local_shape[d + 1:]:
            inner *= s
        rows = self.local_shape[d]
        chunk = rows // self.stride
        a = (local // inner) % rows
        outer = local // (inner * rows)
        full_a = ((a // chunk) * self.tp_size + self.tp_rank) * chunk + a % chunk
        return (outer * rows * self.tp_size + full_a) * inner + local % inner


def _unwrap(chunk):
    """The model inside Megatron's DDP / Float16Module wrappers (each keeps it as ``.module``)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _tp(param, expert: bool) -> Tuple[int, int]:
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _group_size_rank(group) -> Tuple[int, int]:
    """Size and rank of a process group as megatron-core's ``get_pg_size`` / ``get_pg_rank`` read them."""
    if group is None:
        return 1, 0
    return int(group.size()), int(group.rank())


def _is_grouped_linear(module) -> bool:
    return any(c.__name__ in ("TEGroupedLinear", *GROUPED_LINEARS) for c in type(module).__mro__) or (
        "GroupedLinear" in type(module).__name__)


def grouped_split(module, module_name: str, param_name: str, model_config=None) -> Tuple[int, int, int, int]:
    """``(tp size, tp rank, partition dim, stride)`` of ``param_name`` of a TE grouped expert linear, from its class,
    its ``explicit_expert_comm`` and its expert-tensor-parallel group (megatron-core's ``_tp_group`` = ``expt_tp``).
    Raises :class:`LayoutError` for a grouped layout whose split is not certain."""
    where = f"{module_name}.{param_name}"
    kind = GROUPED_LINEARS.get(type(module).__name__)
    if kind is None:
        raise LayoutError(f"{where}: {type(module).__name__} is a grouped linear Fair Cast does not know the tensor-"
                          f"parallel split of (known: {', '.join(GROUPED_LINEARS)})")
    m = _GROUPED_PARAM.match(param_name)
    if m is None:
        raise LayoutError(f"{where}: a single grouped weight or bias for all local experts (moe_single_grouped_weight / "
                          f"moe_single_grouped_bias, TransformerEngine >= 2.14): Fair Cast keys each expert's "
                          f"weight<i> / bias<i> separately. Set moe_single_grouped_weight=False and "
                          f"moe_single_grouped_bias=False")
    leaf = module_name.rsplit(".", 1)[-1]
    expected = "linear_fc1" if kind == "column" else "linear_fc2"
    if leaf != expected:
        raise LayoutError(f"{where}: a {kind}-parallel grouped linear named {leaf!r}, not the experts' {expected}: "
                          f"Fair Cast does not know its layout")
    if getattr(module, "_tp_group", None) is not None:
        size, rank = _group_size_rank(module._tp_group)
    else:
        from megatron.core import parallel_state as ps

        size, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    if size == 1:
        return 1, 0, -1, 1
    if getattr(module, "explicit_expert_comm", None) is not True:
        raise LayoutError(f"{where}: expert tensor parallel size {size} without megatron-core's explicit expert "
                          f"communication (explicit_expert_comm): TransformerEngine would split it itself, a layout "
                          f"Fair Cast did not read. Use expert_tensor_parallel_size=1")
    if m.group(1) == "bias" and kind == "row":
        return 1, 0, -1, 1  # a row-parallel bias is whole on every rank
    config = getattr(module, "config", None) or model_config
    glu = kind == "column" and bool(getattr(config, "gated_linear_unit", False))
    return size, rank, (0 if kind == "column" else 1), (2 if glu else 1)


def _layer_prefixes(model: torch.nn.Module) -> Dict[str, str]:
    """``decoder.layers.<local>`` -> ``decoder.layers.<global>`` for every layer that knows its ``layer_number``."""
    out = {}
    for name, module in model.named_modules():
        m = _LAYER.match(name)
        number = getattr(module, "layer_number", None)
        if m and isinstance(number, int):
            out[name] = name[: len(name) - len(m.group(2))] + str(number - 1)
    return out


def _expert_names(name: str, model: torch.nn.Module) -> str:
    """Local expert ids in ``name`` -> global ones."""
    from megatron.core import parallel_state as ps

    def global_id(local: int, experts_path: str) -> int:
        experts = model.get_submodule(experts_path)
        per_rank = getattr(experts, "num_local_experts", None)
        if per_rank is None:
            raise LayoutError(f"cannot tell how many local experts {experts_path} holds (for {name})")
        return ps.get_expert_model_parallel_rank() * int(per_rank) + local

    m = _LOCAL_EXPERT.search(name)
    if m:
        path = name[: m.start()] + ".experts"
        return name[: m.start(2)] + str(global_id(int(m.group(2)), path)) + name[m.end(2):]
    m = _GROUPED_EXPERT.search(name)
    if m:
        path = name[: m.start()] + ".experts"
        return name[: m.start(2)] + str(global_id(int(m.group(2)), path))
    return name


def param_keys(model_chunks: Iterable[torch.nn.Module]) -> Dict[int, ParamKey]:
    """``id(param) -> ParamKey`` for every bf16 parameter of this rank's model chunks.

    Raises :class:`LayoutError` for layouts it cannot key (legacy ``GroupedMLP`` expert weights, duplicate keys).
    """
    keys: Dict[int, ParamKey] = {}
    seen: Dict[str, str] = {}  # canonical name -> local name: one param per name on a rank
    for chunk in model_chunks:
        model = _unwrap(chunk)
        layers = _layer_prefixes(model)
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        model_config = getattr(model, "config", None)
        for local_name, p in model.named_parameters():
            if p.dtype != torch.bfloat16:
                continue
            module_name, _, param_name = local_name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            name = local_name
            for local, global_ in layers.items():
                if name.startswith(local + "."):
                    name = global_ + name[len(local):]
                    break
            expert = not bool(getattr(p, "allreduce", True)) or bool(_EXPERT_PARAM.search(name))
            if expert:
                if re.search(r"\.experts\.weight[12]$", name):
                    raise LayoutError(
                        f"{local_name}: the legacy GroupedMLP stores all local experts in one tensor; Fair Cast keys "
                        f"each expert separately. Use the SequentialMLP or TEGroupedMLP expert layers "
                        f"(moe_grouped_gemm with TransformerEngine)"
                    )
                name = _expert_names(name, model)
            if tied and name == "output_layer.weight":
                name = TIED_EMBEDDING
            if _is_grouped_linear(module):  # the split megatron-core computes with, not the attributes TE left
                tp_size, tp_rank, dim, stride = grouped_split(module, module_name, param_name, model_config)
            else:
                split = bool(getattr(p, "tensor_model_parallel", False))
                dim = int(getattr(p, "partition_dim", -1))
                if not split and dim >= 0 and _tp(p, expert)[0] > 1:
                    raise LayoutError(
                        f"{local_name} ({type(module).__name__}) has partition_dim {dim} but tensor_model_parallel "
                        f"unset or False at tensor parallel size {_tp(p, expert)[0]}: Fair Cast cannot tell whether "
                        f"it is split. Run it at (expert) tensor parallel size 1")
                if (not split and param_name == "weight" and _tp(p, expert)[0] > 1
                        and any(m in type(module).__name__ for m in _SPLIT_WEIGHT_MODULES)):
                    raise LayoutError(
                        f"{local_name}: the weight of a {type(module).__name__}, which megatron-core splits over its "
                        f"tensor-parallel group (size {_tp(p, expert)[0]}), is not marked tensor_model_parallel: its "
                        f"split cannot be told with certainty. Run it at (expert) tensor parallel size 1")
                tp_size, tp_rank = _tp(p, expert) if split else (1, 0)
                dim = dim if split else -1
                stride = int(getattr(p, "partition_stride", 1)) if split else 1
            key = ParamKey(name=name, local_shape=tuple(p.shape), tp_size=tp_size, tp_rank=tp_rank,
                           partition_dim=dim, stride=stride)
            if key.partition_dim >= 0 and key.local_shape[key.partition_dim] % key.stride:
                raise LayoutError(f"{local_name}: dim {key.partition_dim} of {key.local_shape} not divisible by its "
                                  f"partition stride {key.stride}")
            if id(p) in keys:
                continue
            if name in seen:
                raise LayoutError(f"{local_name} and {seen[name]} get the same Fair Cast key {name}; their casts would "
                                  f"share noise")
            seen[name] = local_name
            keys[id(p)] = key
    return keys


def dp_ranges(optimizer, destinations: bool = True
              ) -> List[Tuple[torch.Tensor, torch.nn.Parameter, int, int, Optional[torch.Tensor]]]:
    """``(main shard, model param, start, end, destination)`` per bf16 param of a distributed optimizer: the fp32
    shard of elements ``[start, end)`` of the flattened TP-local param and the bf16 param-buffer slice the
    main->model copy writes it to. ``destinations=False``: None instead of the slice, so that the ranges can be read
    while the bucket's storage is offloaded (verl's ``param_offload`` resizes it to 0 bytes between steps: a slice of
    it raises)."""
    out = []
    for main_group, model_group in zip(optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups):
        for main, param in zip(main_group, model_group):
            ranges = optimizer._get_model_param_range_map(param)
            local, world = ranges["param"], ranges["gbuf_world_in_bucket"]
            dst = None
            if destinations:
                gbuf_index, _, bucket_id = optimizer.model_param_gbuf_map[param]
                buffer = optimizer.buffers[gbuf_index].buckets[bucket_id].param_data
                dst = buffer.view(-1)[world.start: world.end]
            out.append((main, param, local.start, local.end, dst))
    return out


def fp32_ranges(optimizer) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``(main shard, destination)`` of a distributed optimizer's fp32 params (copied as they are, not cast)."""
    out = []
    for main_group, model_group in zip(optimizer.shard_fp32_groups, optimizer.model_fp32_groups):
        for main, param in zip(main_group, model_group):
            world = optimizer._get_model_param_range_map(param)["gbuf_world_in_bucket"]
            gbuf_index, _, bucket_id = optimizer.model_param_gbuf_map[param]
            buffer = optimizer.buffers[gbuf_index].buckets[bucket_id].param_data
            out.append((main, buffer.view(-1)[world.start: world.end]))
    return out


def float16_pairs(optimizer) -> List[Tuple[torch.Tensor, torch.nn.Parameter]]:
    """``(fp32 main param, bf16 model param)`` of a Float16OptimizerWithFloat16Params (whole TP-local params)."""
    return [(main, param) for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
            for param, main in zip(model_group, main_group)]


def sub_optimizers(optimizer) -> List:
    """The optimizers inside a Megatron ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def first_device(optimizer) -> Optional[torch.device]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return None
