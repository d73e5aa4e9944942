"""The served copy and the fp32 master of an FSDP-wrapped policy, for ``faircast/policy_*`` (FSDP1 and FSDP2).

:class:`~faircast_plugins.policy_lag.PolicyLagProbe` scores a few sequences twice, once on each copy of the weights.
Under FSDP neither copy exists whole outside a forward: each unit's forward gathers its weights and frees them after.
So the views are taken where FSDP has gathered them, one module (FSDP2) or one unit (FSDP1) at a time:

FSDP2 (``fully_shard``)
    during a module's forward its registered parameter is the unsharded bf16 tensor FSDP's all-gather built from the
    bf16 cast of every rank's shard: the served copy (Fair Cast's bits through :mod:`faircast_plugins.fsdp`'s patched
    cast, or round to nearest with Fair Cast off, what the standard export serves). Served view: that tensor widened
    to fp32 (exact), in FSDP's own forward. Master view: a second forward with FSDP's forward hooks off (FSDP's bf16
    all-gather would be wasted there): at each FSDP2 module's forward, its parameter groups' padded fp32 shards are
    gathered in ONE all-gather per group (:func:`gathered_group`, FSDP2's own layout in fp32) and its parameters read
    those full masters until the module's forward ends. Where that layout does not hold (grouped ``fully_shard``,
    other placements, a tensor subclass with its own all-gather) the master is gathered one parameter at a time
    (:func:`full_master`) inside FSDP's forward, as before.
FSDP1 (``FullyShardedDataParallel``, ``use_orig_params`` True or False)
    served view: the unit's bf16 unsharded views (the patched low-precision shard, or round to nearest) widened to
    fp32 around each module's forward (FSDP1's low-precision unshard, forced even where ``FSDP_USE_FULL_PREC_IN_EVAL=1``
    would make its eval forward gather the fp32 masters); master view: FSDP1's own full-precision eval unshard (what
    ``summon_full_params`` uses), which gathers the fp32 flat shards instead of the bf16 ones, one unit at a time.

Both forwards run in fp32: inside :func:`policy_scope` FSDP's casts of forward inputs to ``param_dtype`` (FSDP2's
``cast_forward_inputs``/``output_dtype``, FSDP1's ``cast_forward_inputs``/``cast_root_forward_inputs``) are off, and
the probe turns autocast off. Nothing is written to a parameter or a shard; every swapped attribute is put back after
its module's forward, and FSDP1 handles the scope unsharded are resharded (freed) when it exits.

Cost per measurement (FSDP2): the served forward is a plain FSDP forward (one bf16 all-gather per unit), the master
forward one fp32 all-gather per unit and no bf16 one: 2 collectives per unit instead of 2 plus one per parameter, 6
bytes gathered per parameter instead of 8 (benchmarks/step/results/fsdp2_policy_onegather.log).

Memory: FSDP2, one unit's fp32 full masters (twice while its gathered buffer is laid out) beside the root's (FSDP's
served forward: its bf16 unsharded unit, as in training); FSDP1, one unit's fp32 unsharded flat parameter instead of
its bf16 one (twice its bytes) during the master forward, beside the root's (whatever the sharding strategy:
SHARD_GRAD_OP's units are freed after their forwards too).
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .fsdp import _all_gather, _param_groups, _reshard_fsdp1, fsdp1_modules
from .patching import FairCastPatchError
from .policy_lag import hooks_detached, swap_hooks, widened

#: (module, attribute name, the tensor the attribute holds now) -> the tensor to compute with instead (None: as it is)
OwnedView = Callable[[nn.Module, str, torch.Tensor], Optional[torch.Tensor]]


def _widened(module: nn.Module, name: str, t: torch.Tensor) -> Optional[torch.Tensor]:
    """The served view: FSDP's low-precision unsharded weight, widened to fp32 (exact)."""
    return widened(t)


class _View:
    """One copy of the weights as the probe's forward reads it: a per-attribute view, and what FSDP must do around
    the whole forward (FSDP1's full-precision unshard for the master)."""

    def __init__(self, view: Optional[OwnedView], around: Callable = None, is_master: bool = False):
        self.view, self.around = view, around
        self.is_master = is_master  # FSDP2: may read the masters of one all-gather per group (_gathered_masters)

    @contextmanager
    def forward(self):
        if self.around is None:
            yield
        else:
            with self.around():
                yield


def _fsdp2_owners(states) -> Dict[Tuple[int, str], object]:
    """``{(id(module), attribute): FSDPParam}`` for every place an FSDP2 parameter is registered (tied: each)."""
    owners = {}
    for state in states:
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                owners[(id(info.module), info.param_name)] = fsdp_param
                for module, name in zip(info.shared_modules, info.shared_param_names):
                    owners[(id(module), name)] = fsdp_param
    return owners


def _fsdp1_slots(units) -> Dict[int, Tuple[nn.Module, List[str]]]:
    """``{id(module): (module, attributes)}`` of every original parameter FSDP1 flattened (tied: every place)."""
    slots: Dict[int, Tuple[nn.Module, List[str]]] = {}
    for unit in units:
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        for info in list(flat._param_infos) + list(flat._shared_param_infos):
            slots.setdefault(id(info.module), (info.module, []))[1].append(info.param_name)
    return slots


def full_master(fsdp_param, device: torch.device) -> torch.Tensor:
    """The fp32 full tensor of one FSDP2 parameter (a collective over the group it is sharded over: every rank calls
    it for the same parameters in the same order). A shard offloaded to the host is gathered on ``device``.

    Like FSDP2's own all-gather: every rank's padded flat shard (equal sizes, dim-0 chunks in rank order) gathered
    into one buffer whose first rows are the tensor; DTensor's ``full_tensor()`` for any other layout."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = fsdp_param.sharded_param
    padded = getattr(fsdp_param, "_sharded_param_data", None)
    rows = getattr(fsdp_param, "padded_sharded_param_size", None)
    group = getattr(getattr(fsdp_param, "mesh_info", None), "shard_process_group", None)
    plain = all(p.is_replicate() or (isinstance(p, Shard) and p.dim == 0) for p in sharded.placements)
    if plain and padded is not None and rows is not None and group is not None and sharded.dim() > 0 \
            and padded.numel() == math.prod(rows):
        world = torch.distributed.get_world_size(group)
        local = padded if padded.device == device else padded.to(device)
        gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
        _all_gather(gathered, local, group)
        return gathered.view(world * rows[0], *rows[1:])[: sharded.shape[0]]
    local = sharded.to_local()
    if local.device != device:
        local = local.to(device)
        sharded = DTensor.from_local(local, sharded.device_mesh, sharded.placements, run_check=False,
                                     shape=sharded.shape, stride=sharded.stride())
    return sharded.full_tensor().detach()


def gathered_group(group) -> List[torch.Tensor]:
    """The fp32 full tensor of every parameter of one FSDP2 parameter group (``group.fsdp_params``, in order), from ONE
    all-gather over the group's shard process group (every rank calls it for the same groups in the same order).

    FSDP2's own all-gather, in fp32: each rank's padded flat shards (``_sharded_param_data``, dim-0 chunks padded to
    the first chunk's size) concatenated in the group's parameter order, gathered rank-major into one buffer, then
    each parameter's ``[world, padded]`` columns laid out as rows (a copy) and cut to its global size. A shard on
    the host (CPU offload) is gathered on the group's device. Bit-exact copies of the masters; at world size 1 the
    shards themselves (no copy). Memory: the group's fp32 gathered buffer and its per-parameter copies (twice the
    unit's fp32 bytes) until it returns."""
    params = list(group.fsdp_params)
    device = group.device
    pg = group.mesh_info.shard_process_group
    world = torch.distributed.get_world_size(pg)
    shards = [p._sharded_param_data for p in params]
    shards = [s if s.device == device else s.to(device) for s in shards]  # a host shard (CPU offload): moved
    if world == 1:
        return [s.view(p.padded_sharded_param_size)[: p.sharded_param.shape[0]] for p, s in zip(params, shards)]
    flat = torch.cat(shards)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=device)
    _all_gather(out, flat, pg)
    out = out.view(world, flat.numel())
    fulls, start = [], 0
    for p, s in zip(params, shards):
        rows = p.padded_sharded_param_size
        full = out[:, start:start + s.numel()].reshape(world * rows[0], *rows[1:])
        fulls.append(full[: p.sharded_param.shape[0]])
        start += s.numel()
    return fulls


def _one_gather_blocker(states2) -> Optional[str]:
    """Why FSDP2's one-gather path cannot serve these states (None: it can): it needs lazily initialised states with
    one module each (not grouped ``fully_shard([a, b])``), fp32 masters sharded plainly on dim 0 over one shard
    group (FSDP2's padded flat shard), and no tensor subclass with its own all-gather. Anything else gathers each
    parameter alone (:func:`full_master`), as before. Only the master's gather changes: the served copy is FSDP's own
    gathered bits in every mode (error feedback and an EMA included)."""
    from torch.distributed.tensor import Shard

    for state in states2:
        if getattr(state, "_is_root", None) is None:
            return "a state not yet lazily initialised (no forward ran)"
        if len(getattr(state, "_modules", ())) != 1:
            return "grouped fully_shard"
        for group in _param_groups(state):
            if getattr(getattr(group, "mesh_info", None), "shard_process_group", None) is None:
                return "no shard process group"
            for p in group.fsdp_params:
                sharded, padded = p.sharded_param, getattr(p, "_sharded_param_data", None)
                rows = getattr(p, "padded_sharded_param_size", None)
                if padded is None or rows is None or sharded.dim() == 0 or padded.numel() != math.prod(rows) \
                        or padded.dtype != torch.float32:
                    return f"parameter layout of {p._param_fqn if hasattr(p, '_param_fqn') else p}"
                if not all(pl.is_replicate() or (isinstance(pl, Shard) and pl.dim == 0) for pl in sharded.placements):
                    return "placements other than Shard(0)"
                if hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather"):
                    return "a tensor subclass with its own all-gather"
    return None


@contextmanager
def _gathered_masters(modules2, states2):
    """Forwards inside read the full fp32 master of every FSDP2 parameter, with FSDP2's forward hooks (its unshard,
    reshard and root setup) detached (:func:`~faircast_plugins.policy_lag.hooks_detached`: no bf16 all-gather, no
    cast, no reshard, FSDP's state untouched): at each FSDP2 module's forward each of its parameter groups is
    gathered in fp32 in one collective (:func:`gathered_group`), and every place its parameters are registered (tied:
    each) holds the view until that module's forward ends (the root's for the whole forward, as FSDP keeps it); the
    registered tensors (sharded or FSDP's unsharded ones) are put back after."""
    groups = {id(m): _param_groups(s) for m, s in zip(modules2, states2)}

    def swap_in(module, args, kwargs, swapped):
        for group in groups[id(module)]:
            for fsdp_param, full in zip(group.fsdp_params, gathered_group(group)):
                info = fsdp_param._module_info
                for owner, name in [(info.module, info.param_name)] + list(zip(info.shared_modules,
                                                                                info.shared_param_names)):
                    swapped.append((owner, name, owner._parameters[name]))
                    owner._parameters[name] = full
        return args, kwargs

    def put_back(swapped):
        for owner, name, p in reversed(swapped):
            owner._parameters[name] = p

    fsdp_hooks = [h for s in states2 for h in (s._pre_forward_hook_handle, s._post_forward_hook_handle)]
    with hooks_detached(fsdp_hooks), swap_hooks(modules2, swap_in, put_back):
        yield


@contextmanager
def _no_input_casts(states2, units1):
    """FSDP's casts of forward inputs (and FSDP2's of outputs) to the low precision, off: the probe's activations stay
    fp32 between units."""
    saved = []
    try:
        for state in states2:
            saved.append((state, "_mp_policy", state._mp_policy))
            state._mp_policy = dataclasses.replace(state._mp_policy, cast_forward_inputs=False, output_dtype=None)
        for unit in units1:
            mp = unit.mixed_precision
            saved.append((unit, "mixed_precision", mp))
            setattr(unit, "mixed_precision", dataclasses.replace(mp, cast_forward_inputs=False,
                                                                 cast_root_forward_inputs=False))
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


@contextmanager
def _fsdp1_precision(units, full: bool):
    """Inside (with the modules in eval mode): FSDP1's unshard gathers the fp32 flat shards (``full``: the master
    view, each module's attributes during its forward are views of the full fp32 masters) or the low-precision ones
    (the served view), whatever ``FSDP_USE_FULL_PREC_IN_EVAL`` set when FSDP1 wrapped the model (with it, FSDP1's own
    eval forward would serve the fp32 masters: KL 0). Each non-root unit's unsharded flat parameter is freed after its
    forward whatever the sharding strategy (FSDP1 frees it itself only for FULL_SHARD and HYBRID_SHARD: with
    SHARD_GRAD_OP, verl's ``reshard_after_forward: false``, every unit's fp32 copy would stay, the whole model in
    fp32), the root's after the forward."""
    handles = [u._handle for u in units if u._handle is not None]
    saved = [(obj, obj._use_full_prec_in_eval) for obj in list(units) + handles]
    _reshard_fsdp1(units)
    for obj, _ in saved:
        obj._use_full_prec_in_eval = full
    hooks = [u.register_forward_hook(lambda unit, args, output: _reshard_fsdp1([unit]))
             for u in units if not getattr(u, "_is_root", False)]
    try:
        yield
    finally:
        try:
            for hook in hooks:
                hook.remove()
            _reshard_fsdp1(units)  # with the flag still as set: the buffers this view gathered
        finally:
            for obj, value in saved:
                obj._use_full_prec_in_eval = value


@contextmanager
def owned_swapped(slots: Dict[int, Tuple[nn.Module, List[str]]], view: _View):
    """Forwards inside read ``view`` instead of each listed attribute: swapped in by a forward pre-hook on its module
    and back by a forward hook, so at most one module's other copy is alive at a time. A parameter (FSDP2, FSDP1 with
    ``use_orig_params``) gets its ``.data`` swapped; a plain tensor attribute (FSDP1's unsharded views) is set."""
    def pre(module, args, kwargs, swapped):
        for name in slots[id(module)][1]:
            t = getattr(module, name)
            if not isinstance(t, torch.Tensor):
                continue
            other = view.view(module, name, t) if view.view is not None else None
            if other is None:
                continue
            if isinstance(t, nn.Parameter):
                swapped.append((t, None, t.data))
                t.data = other
            else:  # FSDP1's plain tensor view, an instance attribute (set as nn.Module's checks would refuse it)
                swapped.append((module, name, t))
                module.__dict__[name] = other
        return args, kwargs

    def put_back(swapped):
        for owner, name, data in reversed(swapped):
            if name is None:
                owner.data = data
            else:
                owner.__dict__[name] = data

    with view.forward(), swap_hooks([module for module, _ in slots.values()], pre, put_back):
        yield


class FSDPPolicyViews:
    """The probe's two views of an FSDP1 or FSDP2 policy ``root`` (see the module docstring).

    Use inside :meth:`scope`: ``probe.measure(root, ..., served=views.served, master=views.master,
    swap=views.swapped)``."""

    def __init__(self, root: nn.Module):
        self.root = root
        from torch.distributed.fsdp import FSDPModule

        self.modules2 = [m for m in root.modules() if isinstance(m, FSDPModule)]
        self.states2 = [m._get_fsdp_state() for m in self.modules2]
        self.units1 = fsdp1_modules(root)
        if not self.states2 and not self.units1:
            raise FairCastPatchError(f"faircast policy metrics: {type(root).__name__} holds no FSDP1 or FSDP2 module")
        self.slots: Dict[int, Tuple[nn.Module, List[str]]] = {}
        self.owners = _fsdp2_owners(self.states2)
        for fsdp_param in {id(p): p for p in self.owners.values()}.values():
            info = fsdp_param._module_info
            for module, name in [(info.module, info.param_name)] + list(zip(info.shared_modules,
                                                                                info.shared_param_names)):
                names = self.slots.setdefault(id(module), (module, []))[1]
                if name not in names:
                    names.append(name)
        for key, (module, names) in _fsdp1_slots(self.units1).items():
            have = self.slots.setdefault(key, (module, []))[1]
            have.extend(n for n in names if n not in have)
        self.served = _View(_widened, (lambda: _fsdp1_precision(self.units1, full=False)) if self.units1 else None)
        self.master = _View(self._fsdp2_master if self.owners else None,
                            (lambda: _fsdp1_precision(self.units1, full=True)) if self.units1 else None, is_master=True)
        #: why the last master forward gathered each FSDP2 parameter alone (None: one fp32 all-gather per group)
        self.per_param_reason: Optional[str] = None

    def _fsdp2_master(self, module: nn.Module, name: str, t: torch.Tensor) -> Optional[torch.Tensor]:
        fsdp_param = self.owners.get((id(module), name))
        if fsdp_param is None:
            return None
        if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise FairCastPatchError(f"faircast policy metrics: FSDP2 parameter {name} of {type(module).__name__} is a "
                                     f"tensor subclass with its own all-gather; its fp32 master cannot be gathered")
        return full_master(fsdp_param, t.device)

    def swapped(self, model: nn.Module, view: _View):
        """The ``swap`` argument of :meth:`PolicyLagProbe.measure`."""
        if view.is_master and self.states2 and not self.units1:
            self.per_param_reason = _one_gather_blocker(self.states2)  # after the served forward's lazy init
            if self.per_param_reason is None:
                return _gathered_masters(self.modules2, self.states2)
        return owned_swapped(self.slots, view)

    @contextmanager
    def scope(self) -> Iterator["FSDPPolicyViews"]:
        """Around a measurement: every unit resharded first (a root FSDP left unsharded by an earlier forward gathers
        the current shards again), FSDP's low-precision casts of forward inputs off, FSDP1 units resharded after."""
        for module in self.modules2:  # a root left unsharded by an earlier forward gathers the current shards again
            module.reshard()
        if self.units1:
            _reshard_fsdp1(self.units1)
        try:
            with _no_input_casts(self.states2, self.units1):
                yield self
        finally:
            if self.units1:
                _reshard_fsdp1(self.units1)


__all__ = ["FSDPPolicyViews", "full_master", "gathered_group", "owned_swapped"]
