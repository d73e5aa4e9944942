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

Cost per all-gather (issue #20, findings 5 and 6; measured in docs/gpu-paths.md): a parameter group is one batched
cast (one :func:`~faircast_plugins.fair_cast_many`) written straight into the all-gather input buffers, with its keys
hashed once per weight version. The property path casts its parameter alone at world size 1 (there is no all-gather
there) and defers to the group's batch when the fast path calls it. A shard on the host (CPU offload) is moved to
the device of the buffer it fills and cast there, so the host never runs the cast; error feedback is the exception:
its residual stays with the master, so it is cast where the master lives, once per version, and the bits copied.

Torch releases (the sources of 2.11.0, 2.12.0/2.12.1, 2.13.0, 2.14.0/2.14.1, 2.15.0 were compared; 2.15.0 changes
none of the three call sites): the three call sites,
the FSDP2 shard layout (dim-0 chunks, zero-padded to the first chunk's size) and the FSDP1 flat-shard metadata they
read are the same in all of them, with two differences that matter here: torch 2.11 keeps one optional
``FSDPState._fsdp_param_group`` where 2.12+ keeps a list ``_fsdp_param_groups`` (see :func:`_param_groups`), and
under compiled autograd 2.11's fast path returns the property's inputs for every parameter (the property then
leaves them to the fast-path wrapper, which casts the group once). 2.14 adds parameters annotated with the optional
``spmd_types`` package (stored as DTensors on a multi-dim mesh); that path is not exercised here.
"""
from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .cast import fair_cast_many
from .caster import FairCaster, audit_track
from .policy_lag import refuse_policy_metrics
from .key import canonical_name
from .patching import FairCastPatchError, PatchSet

logger = logging.getLogger("faircast_plugins")

#: torch releases whose private FSDP cast sites were read and the verl FSDP worker tests run on (docs/verl.md).
TORCH_SPECIFIER = ">=2.11,<2.16"

_FSDP2_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs"
_FSDP2_FAST_PATH = "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs"
_FSDP1_SHARD = "torch.distributed.fsdp._flat_param:FlatParamHandle._use_low_precision_shard"

_ATTR = "_faircast_cast"  # set on FSDPParam (FSDP2) and FlatParamHandle (FSDP1) objects of registered modules


class _KeyCache:
    """The Fair Cast keys of some parameters at one weight version: each name is hashed once per version (and seed
    and mode), not at every all-gather."""

    def __init__(self):
        self._tag: Optional[tuple] = None
        self._keys: Dict[str, int] = {}

    def get(self, caster: FairCaster, name: str) -> int:
        tag = (caster.version, caster.config.seed, caster.mode)
        if tag != self._tag:
            self._tag, self._keys = tag, {}
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = caster.key(name)
        return key


@dataclass
class _ParamCast:
    """How one FSDP2 parameter shard is cast: its caster, canonical name, and the global index of its first element."""

    caster: FairCaster
    name: str
    offset: int
    numel: int
    keys: _KeyCache = field(default_factory=_KeyCache)
    group: object = None  # the process group the parameter is sharded over (HSDP: one replica's shard group)


@dataclass
class _HandleCast:
    """How one FSDP1 flat parameter is cast: its caster and the canonical names of the params it holds."""

    caster: FairCaster
    names: list
    keys: _KeyCache = field(default_factory=_KeyCache)
    group: object = None  # FSDP1's sharding process group (HYBRID_SHARD: the intra-node one)


class _Job(NamedTuple):
    """One shard to cast: ``out`` (a flat bf16 view into FSDP's buffer) <- ``master`` (flat fp32, global ``offset``)."""

    caster: FairCaster
    keys: _KeyCache
    name: str
    offset: int
    master: torch.Tensor
    out: torch.Tensor


# -- the patched call sites ------------------------------------------------------------------------------------


def stage_for_cast(master: torch.Tensor, device, state_device: Optional[torch.device] = None) -> torch.Tensor:
    """A host master shard (verl's ``param_offload``) copied to the accelerator ``device`` the served copy is
    wanted on, so the cast and its state (error-feedback residual, EMA) stay there, as at the all-gather: no host
    cast, no state moving between host and device every step. Left on the host when its state lives there (FSDP's
    own CPU offload casts on the host at every all-gather); anything else is returned as it is."""
    if master.device.type == "cpu" and torch.device(device).type != "cpu" and \
            (state_device is None or state_device.type != "cpu"):
        return master.to(device, non_blocking=True)  # pinned (offloaded) masters: ordered on the current stream
    return master


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: an offloaded (pinned) host shard is copied without blocking the host, ordered on the
    current stream before the cast that reads it."""
    return t if t.device == device else t.to(device, non_blocking=True)


@torch.no_grad()
def _cast_into(jobs: List[_Job]) -> None:
    """Write every job's Fair Cast bits into its ``out``: one batched cast per (caster, device), on the device of the
    outputs. Error feedback casts each shard on its master's device (its residual lives there), once per version."""
    batches: Dict[tuple, List[_Job]] = {}
    for job in jobs:
        batches.setdefault((id(job.caster), job.out.device), []).append(job)
    for batch in batches.values():
        caster, device = batch[0].caster, batch[0].out.device
        if caster.mode == "error_feedback":
            for job in batch:
                if job.master.device == device:
                    caster.cast(job.name, job.master, offset=job.offset, out=job.out)
                else:
                    job.out.copy_(caster.cast(job.name, job.master, offset=job.offset), non_blocking=True)
            continue
        sources = [caster.source(job.name, job.master) for job in batch]
        staged = [_to_device(src, device) for src in sources]
        fair_cast_many(staged, keys=[job.keys.get(caster, job.name) for job in batch],
                       offsets=[job.offset for job in batch], mode=caster.mode, backend=caster.config.backend,
                       outs=[job.out for job in batch])
        if caster.audit is not None:
            for job, src, x in zip(batch, sources, staged):
                master = x if src is job.master else _to_device(job.master, device)
                caster.audit.observe(audit_track(job.name, job.offset, job.master), caster.version, master, job.out)


_BATCH = threading.local()  # .active: the FSDP2 fast path is collecting its group's casts


def _fsdp2_job(fsdp_param, inputs) -> Optional[_Job]:
    """The cast of a registered FSDP2 parameter's bf16 all-gather input, or None (not registered, no elements here,
    not bf16, or a state or tensor subclass whose input is not the plain shard)."""
    spec: Optional[_ParamCast] = getattr(fsdp_param, _ATTR, None)
    if spec is None or not spec.numel or len(inputs) != 1 or inputs[0].dtype != torch.bfloat16:
        return None
    if not _is_plain_sharded(fsdp_param):
        return None
    return _Job(spec.caster, spec.keys, spec.name, spec.offset, fsdp_param._sharded_param_data[: spec.numel],
                inputs[0][: spec.numel])


def _is_plain_sharded(fsdp_param) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return fsdp_param.sharded_state == ShardedState.SHARDED and not hasattr(
        fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"
    )


def _wrap_all_gather_inputs(prop: property) -> property:
    original = prop.fget

    def all_gather_inputs(self):
        inputs = original(self)
        if not getattr(_BATCH, "active", False):  # inside the fast path, its wrapper casts the whole group
            job = _fsdp2_job(self, inputs)
            if job is not None:
                _cast_into([job])
        return inputs

    all_gather_inputs.__doc__ = original.__doc__
    return property(all_gather_inputs, prop.fset, prop.fdel, prop.__doc__)


def _wrap_get_param_all_gather_inputs(original):
    def _get_param_all_gather_inputs(fsdp_params):
        outer = getattr(_BATCH, "active", False)
        _BATCH.active = True
        try:
            inputs = original(fsdp_params)
        finally:
            _BATCH.active = outer
        # One batch for the group, whichever path (foreach copy or property) made each input.
        jobs = [job for fsdp_param, ins in zip(fsdp_params, inputs) if (job := _fsdp2_job(fsdp_param, ins))]
        _cast_into(jobs)
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
        if spec.caster.mode != "error_feedback" and not spec.caster.ema_on:
            local = _to_device(local, mp_shard.device)  # an offloaded shard: one copy for the whole flat shard
        jobs = []
        for name, info in zip(spec.names, flat._shard_param_infos):
            if name is None or not info.in_shard or not info.numel_in_shard:
                continue
            start, end = info.offset_in_shard, info.offset_in_shard + info.numel_in_shard
            jobs.append(_Job(spec.caster, spec.keys, name, info.intra_param_start_idx, local[start:end],
                             mp_shard[start:end]))
        _cast_into(jobs)

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
                group = getattr(getattr(fsdp_param, "mesh_info", None), "shard_process_group", None)
                setattr(fsdp_param, _ATTR, _ParamCast(caster, name, offset, numel, group=group))
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
        setattr(module._handle, _ATTR, _HandleCast(caster, names, group=getattr(module, "process_group", None)))
        registered.update({n: n for n in names if n is not None})
        # Tied parameters live once in a flat parameter; their other names are "shared" infos.
        for info in flat._shared_param_infos:
            alias = canonical_name(base + (info.module_name + "." if info.module_name else "") + info.param_name)
            prim = canonical_name(base + (info.prim_module_name + "." if info.prim_module_name else "") + info.prim_param_name)
            if prim in registered:
                registered[alias] = prim
    return registered


def _reshard_fsdp2(root: nn.Module) -> None:
    """Reshard every FSDP2 module under ``root``: a root FSDP2 module keeps its unsharded parameters registered after
    a forward (until its backward), and those are not the ``FSDPParam.sharded_param`` objects registration looks up;
    its next forward would also compute with that kept bf16 copy, cast before Fair Cast was (un)registered."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp1_modules(root: nn.Module) -> list:
    """The FSDP1 units under ``root`` (``FullyShardedDataParallel`` modules), in module order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m for m in root.modules() if isinstance(m, FSDP)]


def _reshard_fsdp1(units) -> None:
    """Free every FSDP1 unit's unsharded flat parameter that is still allocated (FSDP1 keeps the root unit's after its
    forward, and under SHARD_GRAD_OP every unit's, until the backward): the next unshard then gathers the current
    shards, in whichever precision is asked for, cast by whatever is registered then. A kept copy is reused as it is:
    registered after a forward, the next forwards (all of them, while no backward runs) would compute with FSDP's
    round-to-nearest copy, and unregistered, with Fair Cast's. Freed as FSDP1's own post-forward frees: its
    ``_runtime_utils._reshard``, which also queues the free event that rate-limits FSDP1's next all-gathers
    (``limit_all_gathers``) on an accelerator."""
    from torch.distributed.fsdp._runtime_utils import _reshard as fsdp1_reshard

    for unit in units:
        handle = unit._handle
        if handle is None or not handle.uses_sharded_strategy:  # NO_SHARD casts its flat parameter at every unshard
            continue
        if not hasattr(handle.flat_param, "_full_param_padded"):  # before FSDP's lazy init: nothing gathered yet
            continue
        padded = handle._get_padded_unsharded_flat_param()
        if padded.untyped_storage().size() > 0:
            fsdp1_reshard(unit, handle, True)


def _reshard(root: nn.Module) -> None:
    """Drop every bf16 compute copy FSDP keeps under ``root`` (FSDP2 and FSDP1): the next forward gathers anew."""
    _reshard_fsdp2(root)
    _reshard_fsdp1(fsdp1_modules(root))


def register_fsdp_module(root: nn.Module, caster: FairCaster, *, trainable_only: bool = True) -> Dict[str, str]:
    """Make FSDP cast ``root``'s parameters with ``caster``.

    Returns ``{name: canonical name}`` for every name under which a registered parameter appears (a tied
    parameter's second name maps to its first).

    ``root`` is an FSDP1-wrapped module or a module containing FSDP2 (``fully_shard``) modules. Names are the
    canonical (Hugging Face) names, so tied parameters use their first name. With ``trainable_only`` (default),
    frozen parameters keep FSDP's round-to-nearest cast (they never move, so there is nothing to make fair,
    and stochastic rounding would make them jitter between versions). Call :func:`apply_fsdp_cast_patches` too.

    Registering after a forward is fine: every bf16 compute copy FSDP kept from it (an FSDP2 root module's, an FSDP1
    root unit's, every FSDP1 unit's under SHARD_GRAD_OP) is dropped first, so the next forward gathers Fair Cast's
    copy. Register outside a forward and its backward (between them the backward would gather the other cast).
    """
    refuse_policy_metrics(caster, "register_fsdp_module (FSDP under TRL and verl)")
    # FSDP2: names are read from the sharded parameters it registers on the modules; both: a bf16 copy kept from an
    # earlier forward (round to nearest) would be computed with again instead of Fair Cast's
    _reshard(root)
    names = {id(p): canonical_name(n) for n, p in root.named_parameters()}
    _LAYOUTS.pop(caster, None)  # shard layouts are learnt again at the next export
    registered = {**_register_fsdp2(root, caster, names, trainable_only), **_register_fsdp1(root, caster, trainable_only)}
    if not registered:
        raise FairCastPatchError(
            f"register_fsdp_module found no FSDP1/FSDP2 parameters to cast in {type(root).__name__}: Fair Cast "
            f"cannot make the trainer compute with the served copy"
        )
    return registered


def _specs(root: nn.Module):
    """Every Fair Cast registration under ``root``: ``(FSDP1 flat handle, its spec)`` and ``(FSDP2 param, its spec)``."""
    for module in root.modules():
        handle = getattr(module, "_handle", None)
        spec = getattr(handle, _ATTR, None) if handle is not None else None
        if spec is not None:
            yield handle, spec
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in _param_groups(get_state()):
            for fsdp_param in group.fsdp_params:
                pspec: Optional[_ParamCast] = getattr(fsdp_param, _ATTR, None)
                if pspec is not None:
                    yield fsdp_param, pspec


def _registered(root: nn.Module):
    """``(canonical name, global offset, flat fp32 shard, full shape)`` of each registered parameter with elements on
    this rank, as FSDP's cast reads them."""
    for owner, spec in _specs(root):
        if isinstance(spec, _ParamCast):  # FSDP2: one parameter
            if spec.numel:
                yield spec.name, spec.offset, owner._sharded_param_data[: spec.numel], tuple(owner.sharded_param.shape)
            continue
        flat = owner.flat_param  # FSDP1: the parameters of one flat shard
        local = flat._local_shard
        for name, info, shape in zip(spec.names, flat._shard_param_infos, flat._shapes):
            if name is not None and info.in_shard and info.numel_in_shard:
                start = info.offset_in_shard
                yield name, info.intra_param_start_idx, local[start: start + info.numel_in_shard], tuple(shape)


def registered_shards(root: nn.Module) -> Dict[str, Tuple[int, torch.Tensor]]:
    """This rank's fp32 master shard of every registered parameter of ``root``, as FSDP's cast reads it.

    Returns ``{canonical name: (global flat index of the shard's first element, flat fp32 view)}``; parameters
    with no elements on this rank are left out. Stateful modes (error feedback, EMA) keep their per-element
    state for exactly these shards, so an export assembles the served copy from them (see ``caster.cast``).
    """
    return {name: (offset, shard) for name, offset, shard, _ in _registered(root)}


def shard_groups(root: nn.Module) -> Dict[str, object]:
    """The process group each registered parameter of ``root`` is sharded over (``{canonical name: group}``, None
    for the default group), including parameters with no elements on this rank: the group
    :func:`assemble_served` gathers over (under HSDP one replica's shard group, not every rank)."""
    groups: Dict[str, object] = {}
    for _, spec in _specs(root):
        names = [spec.name] if isinstance(spec, _ParamCast) else [n for n in spec.names if n is not None]
        groups.update(dict.fromkeys(names, spec.group))
    return groups


def shard_layout(root: nn.Module) -> Dict[str, list]:
    """``{canonical name: [global offset, numel, full shape]}`` of this rank's registered shards: the layout a per-rank
    Fair Cast state file records (``export.merge_rank_states`` puts the ranks' states back together with it)."""
    return {name: [offset, shard.numel(), list(shape)] for name, offset, shard, shape in _registered(root)}


#: Per caster, ``{(name, full shape, world size): [(global offset, numel) of each rank's shard]}``, learnt at a
#: parameter's first assembly and dropped when a module is (un)registered. Every rank fills and reads it at the same
#: calls (assembly is collective, in the same order everywhere), so every rank takes the same collectives.
_LAYOUTS: "weakref.WeakKeyDictionary[FairCaster, Dict[tuple, List[Tuple[int, int]]]]" = weakref.WeakKeyDictionary()


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    dist = torch.distributed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name since torch 2.13
    gather(output, tensor, group=group)


def _shard_layout_of(caster: FairCaster, name: str, shape: tuple, mine: Tuple[int, int], device, world: int,
                     rank: int, group=None) -> List[Tuple[int, int]]:
    """Every rank's ``(global offset, numel)`` of ``name`` in ``group``: one small all-gather at the first assembly,
    then cached."""
    cache = _LAYOUTS.setdefault(caster, {})
    key = (name, shape, world, id(group))
    layout = cache.get(key)
    if layout is None:
        gathered = torch.empty(2 * world, dtype=torch.int64, device=device)
        _all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group)
        layout = cache[key] = [tuple(pair) for pair in gathered.view(world, 2).tolist()]
    elif layout[rank] != mine:
        raise RuntimeError(
            f"Fair Cast: this rank's shard of {name} is {mine} (offset, numel), not {layout[rank]} as at its first "
            f"assembly: register the module again after resharding it (on every rank)"
        )
    return layout


def _check_covered(name: str, numel: int, layout: List[Tuple[int, int]]) -> None:
    reached = 0
    for offset, n in sorted(p for p in layout if p[1]):
        if offset > reached:
            break
        reached = max(reached, offset + n)
    if reached < numel:
        raise RuntimeError(f"Fair Cast: no rank holds some elements of {name}; cannot assemble its served copy")


@torch.no_grad()
def assemble_served(caster: FairCaster, name: str, shard: Optional[Tuple[int, torch.Tensor]], shape,
                    device, group=None) -> torch.Tensor:
    """The full served bf16 copy of ``name``, put together from every rank's ``caster.cast`` of its own ``shard``
    (``(global offset, flat fp32 shard)`` from :func:`registered_shards`, or None when this rank holds none).

    Collective over ``group``, the group the parameter is sharded over (:func:`shard_groups`; None: the default
    group; under HSDP one replica's shard group, so replicas do not resend the same shards): every rank calls it for
    the same names in the same order. The ranks
    all-gather their served bf16 shards (padded to the largest) and each puts every rank's shard at its global
    offset (replicated shards carry equal bits). Which rank holds which elements is exchanged once per parameter
    (the first assembly after registration), so later exports move the bf16 bits only, with no host sync.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    dist = torch.distributed
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    q = None
    mine = (0, 0)
    if shard is not None:
        offset, master = shard
        q = caster.cast(name, stage_for_cast(master, device, caster.state_device(name)),
                        offset=offset).reshape(-1).to(device)
        mine = (offset, q.numel())
    if world == 1:
        layout = [mine]
    else:
        layout = _shard_layout_of(caster, name, shape, mine, device, world, dist.get_rank(group), group)
    _check_covered(name, numel, layout)
    if not numel:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    if world == 1:
        return q.view(shape)  # covered: the one shard is the whole tensor
    width = max(n for _, n in layout)
    send = q if q is not None and q.numel() == width else torch.zeros(width, dtype=torch.bfloat16, device=device)
    if q is not None and send is not q:
        send[: q.numel()] = q
    gathered = torch.empty(world * width, dtype=torch.bfloat16, device=device)
    _all_gather(gathered, send, group)
    if all(n == max(0, min(width, numel - r * width)) and (not n or offset == r * width)
           for r, (offset, n) in enumerate(layout)):
        return gathered[:numel].view(shape)  # FSDP2's dim-0 chunks in rank order: the gathered buffer is the tensor
    full = torch.empty(numel, dtype=torch.bfloat16, device=device)
    for r, (offset, n) in enumerate(layout):
        if n:
            full[offset: offset + n] = gathered[r * width: r * width + n]
    return full.view(shape)


def uneven_shards(root) -> List[str]:
    """Names of the FSDP2 (DTensor) parameters whose sharded dimension the shard group does not divide: FSDP2 pads
    their shards, and re-pads the short ones with a host copy whenever the module moves (``FSDPParam.
    reset_sharded_param``). Decided from the global shape, so every rank gives the same answer."""
    found = []
    for name, p in root.named_parameters():
        placements, mesh = getattr(p, "placements", None), getattr(p, "device_mesh", None)
        if placements is None or mesh is None:
            continue
        for mesh_dim, placement in enumerate(placements):
            dim = getattr(placement, "dim", None)
            if placement.is_shard() and dim is not None and p.shape[dim] % mesh.size(mesh_dim):
                found.append(name)
                break
    return found


def unregister_fsdp_module(root: nn.Module) -> None:
    """Give ``root`` back FSDP's stock cast, from its next forward on (the bf16 copies FSDP keeps are dropped)."""
    _LAYOUTS.clear()
    _reshard(root)
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
    "shard_groups",
    "register_fsdp_module",
    "registered_shards",
    "remove_fsdp_cast_patches",
    "shard_layout",
    "shard_offset",
    "unregister_fsdp_module",
]
