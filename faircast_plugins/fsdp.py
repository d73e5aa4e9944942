"""Fair Cast in PyTorch FSDP's own low-precision cast (FSDP1 and FSDP2): the bf16 copy the trainer computes with.

With mixed precision, FSDP casts each rank's fp32 shard to bf16 before the all-gather (FSDP2) or before the
unshard (FSDP1), by round-to-nearest. After :func:`apply_fsdp_cast_patches`, the parameters of a module given
to :func:`register_fsdp_module` are cast by its :class:`~faircast_plugins.FairCaster` instead, keyed by canonical
name and *global* element index, so every shard layout (any world size, uneven or padded shards) yields the same
bits as ``caster.cast(name, full_master)`` -- the copy the rollout engine is sent. Modules that are not registered
(a reference model, a critic) keep FSDP's stock cast.

Three private torch call sites are wrapped (checked and pinned by version):

* FSDP2, ``FSDPParam.all_gather_inputs`` -- the property used at world size 1, with CPU offload, and for
  params that skip the fast path;
* FSDP2, ``_fsdp_collectives._get_param_all_gather_inputs`` -- the foreach fast path used at world size > 1;
* FSDP1, ``FlatParamHandle._use_low_precision_shard`` -- the low-precision flat shard.

Each wrapper runs the original (so shapes, padding, streams and allocation stay torch's), then overwrites the
valid elements of each registered parameter with the Fair Cast bits. Padding is never read by the compute.

Torch releases (the sources of 2.11.0, 2.12.0/2.12.1, 2.13.0, 2.14.0/2.14.1, 2.15.0 were compared; 2.15.0 changes
none of the three call sites): the three call sites,
the FSDP2 shard layout (dim-0 chunks, zero-padded to the first chunk's size) and the FSDP1 flat-shard metadata they
read are the same in all of them, with two differences that matter here: torch 2.11 keeps one optional
``FSDPState._fsdp_param_group`` where 2.12+ keeps a list ``_fsdp_param_groups`` (see :func:`_param_groups`), and
under compiled autograd 2.11's fast path returns the property's inputs for every parameter (cast there; the fast-path
wrapper then casts the same bits again). 2.14 adds parameters annotated with the optional ``spmd_types`` package
(stored as DTensors on a multi-dim mesh); that path is not exercised here.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .caster import FairCaster
from .key import canonical_name
from .patching import FairCastPatchError, PatchSet

logger = logging.getLogger("faircast_plugins")

#: torch releases whose private FSDP cast sites were read and the verl FSDP worker tests run on (docs/verl.md).
TORCH_SPECIFIER = ">=2.11,<2.16"

_FSDP2_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs"
_FSDP2_FAST_PATH = "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs"
_FSDP1_SHARD = "torch.distributed.fsdp._flat_param:FlatParamHandle._use_low_precision_shard"

_ATTR = "_faircast_cast"  # set on FSDPParam (FSDP2) and FlatParamHandle (FSDP1) objects of registered modules


@dataclass
class _ParamCast:
    """How one FSDP2 parameter shard is cast: its caster, canonical name, and the global index of its first element."""

    caster: FairCaster
    name: str
    offset: int
    numel: int


@dataclass
class _HandleCast:
    """How one FSDP1 flat parameter is cast: its caster and the canonical names of the params it holds."""

    caster: FairCaster
    names: list


# -- the patched call sites ------------------------------------------------------------------------------------


@torch.no_grad()
def _fair_cast_fsdp2(fsdp_param, out: torch.Tensor) -> None:
    """Overwrite the valid prefix of a bf16 all-gather input with the Fair Cast bits of that shard."""
    spec: Optional[_ParamCast] = getattr(fsdp_param, _ATTR, None)
    if spec is None or spec.numel == 0 or out.dtype != torch.bfloat16:
        return
    src = fsdp_param._sharded_param_data[: spec.numel]
    q = spec.caster.cast(spec.name, src, offset=spec.offset)
    out[: spec.numel].copy_(q.to(out.device, non_blocking=True))


def _is_plain_sharded(fsdp_param) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return fsdp_param.sharded_state == ShardedState.SHARDED and not hasattr(
        fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"
    )


def _wrap_all_gather_inputs(prop: property) -> property:
    original = prop.fget

    def all_gather_inputs(self):
        inputs = original(self)
        if getattr(self, _ATTR, None) is not None and _is_plain_sharded(self):
            _fair_cast_fsdp2(self, inputs[0])
        return inputs

    all_gather_inputs.__doc__ = original.__doc__
    return property(all_gather_inputs, prop.fset, prop.fdel, prop.__doc__)


def _wrap_get_param_all_gather_inputs(original):
    def _get_param_all_gather_inputs(fsdp_params):
        inputs = original(fsdp_params)
        for fsdp_param, ins in zip(fsdp_params, inputs):
            # Params that took the property path were already cast there; the fast path fills the rest.
            if getattr(fsdp_param, _ATTR, None) is not None and _is_plain_sharded(fsdp_param) and len(ins) == 1:
                if not getattr(fsdp_param, "offload_to_cpu", False) and fsdp_param.param_dtype is not None:
                    _fair_cast_fsdp2(fsdp_param, ins[0])
        return inputs

    return _get_param_all_gather_inputs


def _wrap_use_low_precision_shard(original):
    @torch.no_grad()
    def _use_low_precision_shard(self):
        original(self)
        spec: Optional[_HandleCast] = getattr(self, _ATTR, None)
        if spec is None:
            return
        flat = self.flat_param
        mp_shard = flat._mp_shard
        if mp_shard.dtype != torch.bfloat16:
            return
        local = flat._local_shard
        for name, info in zip(spec.names, flat._shard_param_infos):
            if name is None or not info.in_shard or not info.numel_in_shard:
                continue
            src = local[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard]
            q = spec.caster.cast(name, src, offset=info.intra_param_start_idx)
            mp_shard[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard].copy_(q.to(mp_shard.device))

    return _use_low_precision_shard


#: The three FSDP cast wrappers; nothing is touched until :func:`apply_fsdp_cast_patches`.
PATCHES = (
    PatchSet("torch FSDP", "torch", TORCH_SPECIFIER)
    .wrap(_FSDP2_PARAM, _wrap_all_gather_inputs)
    .wrap(_FSDP2_FAST_PATH, _wrap_get_param_all_gather_inputs)
    .wrap(_FSDP1_SHARD, _wrap_use_low_precision_shard)
)


def apply_fsdp_cast_patches() -> PatchSet:
    """Install the three FSDP cast wrappers (idempotent). Checks the torch version and every symbol first."""
    return PATCHES.apply(details="registered FSDP modules cast their bf16 compute copy with Fair Cast")


def remove_fsdp_cast_patches() -> None:
    PATCHES.remove()


# -- registration ----------------------------------------------------------------------------------------------


def _check_master(name: str, param: torch.Tensor) -> None:
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.dtype != torch.float32:
        raise TypeError(
            f"Fair Cast needs fp32 master weights, but FSDP holds {name} as {local.dtype}. Load the trained model in "
            f"fp32 (mixed precision param_dtype=bf16 then gives the bf16 compute copy Fair Cast replaces)."
        )


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list since torch 2.12, a single optional group in torch 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if not hasattr(state, "_fsdp_param_group"):  # torch 2.11 has the single group only
        raise FairCastPatchError(
            f"FSDP2 state {type(state).__name__} has neither _fsdp_param_groups (torch >=2.12) nor "
            f"_fsdp_param_group (torch 2.11): this torch's FSDP2 internals are not supported ({TORCH_SPECIFIER})"
        )
    group = state._fsdp_param_group
    return [group] if group is not None else []


def shard_offset(name: str, param) -> Tuple[int, int]:
    """``(global index of the first local element, local element count)`` of an FSDP2 parameter (a DTensor
    sharded on dim 0, the default ``Shard(0)``): ``caster.cast(name, param.to_local(), offset=...)`` then gives
    this rank's part of ``caster.cast(name, param.full_tensor())``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(param.placements)
    if any(not isinstance(p, Shard) or p.dim != 0 for p in placements if not p.is_replicate()):
        raise FairCastPatchError(
            f"Fair Cast supports FSDP2 parameters sharded on dim 0 (the default Shard(0)); {name} has "
            f"placements {placements}"
        )
    local_shape, global_offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
    row = math.prod(param.shape[1:]) if param.dim() > 1 else 1
    return (global_offset[0] * row if param.dim() else 0), math.prod(local_shape)


def _register_fsdp2(root: nn.Module, caster: FairCaster, names: Dict[int, str], trainable_only: bool) -> Dict[str, str]:
    from torch.distributed.fsdp import FSDPModule

    registered: Dict[str, str] = {}
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module._get_fsdp_state()):
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                name = names.get(id(param))
                if name is None or (trainable_only and not param.requires_grad):
                    continue
                _check_master(name, param)
                offset, numel = shard_offset(name, param)
                if numel != fsdp_param._sharded_local_tensor.numel():
                    raise FairCastPatchError(f"FSDP2 shard of {name}: expected {numel} local elements, found "
                                             f"{fsdp_param._sharded_local_tensor.numel()}")
                setattr(fsdp_param, _ATTR, _ParamCast(caster, name, offset, numel))
                registered[name] = name
    # Tied parameters: every name under which a registered parameter appears maps to its first name.
    for alias, param in root.named_parameters(remove_duplicate=False):
        first = names.get(id(param))
        if first in registered:
            registered[canonical_name(alias)] = first
    return registered


def _register_fsdp1(root: nn.Module, caster: FairCaster, trainable_only: bool) -> Dict[str, str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    registered: Dict[str, str] = {}
    for prefix, module in root.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat = module._handle.flat_param
        base = (prefix + "." if prefix else "") + "_fsdp_wrapped_module."
        originals = getattr(flat, "_params", None)  # kept with use_orig_params=True (mixed requires_grad allowed)
        names = []
        for i, fqn in enumerate(flat._fqns):
            trainable = originals[i].requires_grad if originals else flat.requires_grad
            keep = trainable or not trainable_only
            names.append(canonical_name(base + fqn) if keep else None)
        master = getattr(flat, "_local_shard", flat)  # _local_shard appears at FSDP's lazy init
        if master.dtype != torch.float32:
            raise TypeError(f"Fair Cast needs fp32 master weights; FSDP1 flat parameter {prefix or '<root>'} holds "
                            f"{master.dtype}")
        setattr(module._handle, _ATTR, _HandleCast(caster, names))
        registered.update({n: n for n in names if n is not None})
        # Tied parameters live once in a flat parameter; their other names are "shared" infos.
        for info in flat._shared_param_infos:
            alias = canonical_name(base + (info.module_name + "." if info.module_name else "") + info.param_name)
            prim = canonical_name(base + (info.prim_module_name + "." if info.prim_module_name else "") + info.prim_param_name)
            if prim in registered:
                registered[alias] = prim
    return registered


def register_fsdp_module(root: nn.Module, caster: FairCaster, *, trainable_only: bool = True) -> Dict[str, str]:
    """Make FSDP cast ``root``'s parameters with ``caster``.

    Returns ``{name: canonical name}`` for every name under which a registered parameter appears (a tied
    parameter's second name maps to its first).

    ``root`` is an FSDP1-wrapped module or a module containing FSDP2 (``fully_shard``) modules. Names are the
    canonical (Hugging Face) names, so tied parameters use their first name. With ``trainable_only`` (default),
    frozen parameters keep FSDP's round-to-nearest cast (they never move, so there is nothing to make fair,
    and stochastic rounding would make them jitter between versions). Call :func:`apply_fsdp_cast_patches` too.
    """
    names = {id(p): canonical_name(n) for n, p in root.named_parameters()}
    registered = {**_register_fsdp2(root, caster, names, trainable_only), **_register_fsdp1(root, caster, trainable_only)}
    if not registered:
        raise FairCastPatchError(
            f"register_fsdp_module found no FSDP1/FSDP2 parameters to cast in {type(root).__name__}: Fair Cast "
            f"cannot make the trainer compute with the served copy"
        )
    return registered


def _registered(root: nn.Module):
    """``(canonical name, global offset, flat fp32 shard, full shape)`` of each registered parameter with elements on
    this rank, as FSDP's cast reads them."""
    for module in root.modules():
        handle = getattr(module, "_handle", None)
        spec = getattr(handle, _ATTR, None) if handle is not None else None
        if spec is not None:
            flat = handle.flat_param
            local = flat._local_shard
            for name, info, shape in zip(spec.names, flat._shard_param_infos, flat._shapes):
                if name is not None and info.in_shard and info.numel_in_shard:
                    start = info.offset_in_shard
                    yield name, info.intra_param_start_idx, local[start: start + info.numel_in_shard], tuple(shape)
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in _param_groups(get_state()):
            for fsdp_param in group.fsdp_params:
                pspec: Optional[_ParamCast] = getattr(fsdp_param, _ATTR, None)
                if pspec is not None and pspec.numel:
                    yield (pspec.name, pspec.offset, fsdp_param._sharded_param_data[: pspec.numel],
                           tuple(fsdp_param.sharded_param.shape))


def registered_shards(root: nn.Module) -> Dict[str, Tuple[int, torch.Tensor]]:
    """This rank's fp32 master shard of every registered parameter of ``root``, as FSDP's cast reads it.

    Returns ``{canonical name: (global flat index of the shard's first element, flat fp32 view)}``; parameters
    with no elements on this rank are left out. Stateful modes (error feedback, EMA) keep their per-element
    state for exactly these shards, so an export assembles the served copy from them (see ``caster.cast``).
    """
    return {name: (offset, shard) for name, offset, shard, _ in _registered(root)}


def shard_layout(root: nn.Module) -> Dict[str, list]:
    """``{canonical name: [global offset, numel, full shape]}`` of this rank's registered shards: the layout a per-rank
    Fair Cast state file records (``export.merge_rank_states`` puts the ranks' states back together with it)."""
    return {name: [offset, shard.numel(), list(shape)] for name, offset, shard, shape in _registered(root)}


@torch.no_grad()
def assemble_served(caster: FairCaster, name: str, shard: Optional[Tuple[int, torch.Tensor]], shape,
                    device) -> torch.Tensor:
    """The full served bf16 copy of ``name``, put together from every rank's ``caster.cast`` of its own ``shard``
    (``(global offset, flat fp32 shard)`` from :func:`registered_shards`, or None when this rank holds none).

    Collective over the default process group: every rank calls it for the same names in the same order. Each rank
    writes ``bits + 1`` (1..65536, as int32) at its shard's global indices and zeros elsewhere; a MAX all-reduce
    then gives each element's bits exactly, whatever the layout (replicated shards carry equal bits).
    """
    numel = math.prod(shape)
    buf = torch.zeros(numel, dtype=torch.int32, device=device)
    if shard is not None:
        offset, master = shard
        q = caster.cast(name, master, offset=offset)
        buf[offset: offset + q.numel()] = q.view(torch.int16).to(device=device, dtype=torch.int32).bitwise_and(0xFFFF) + 1
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX)
    if numel and not bool(buf.min() > 0):
        raise RuntimeError(f"Fair Cast: no rank holds some elements of {name}; cannot assemble its served copy")
    bits = buf - 1
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16).view(shape)


def unregister_fsdp_module(root: nn.Module) -> None:
    """Give ``root`` back FSDP's stock cast."""
    for module in root.modules():
        handle = getattr(module, "_handle", None)
        if handle is not None and hasattr(handle, _ATTR):
            delattr(handle, _ATTR)
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            for group in _param_groups(get_state()):
                for fsdp_param in group.fsdp_params:
                    if hasattr(fsdp_param, _ATTR):
                        delattr(fsdp_param, _ATTR)


__all__ = [
    "TORCH_SPECIFIER",
    "apply_fsdp_cast_patches",
    "assemble_served",
    "register_fsdp_module",
    "registered_shards",
    "remove_fsdp_cast_patches",
    "shard_layout",
    "shard_offset",
    "unregister_fsdp_module",
]
