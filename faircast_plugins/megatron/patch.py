"""Fair Cast for Megatron-core bf16 training: the main->model param copy after each optimizer step.

Megatron-core trains bf16 params (the forward, hence the loss and the old log-probs, read them; verl's bridge
export, NeMo-RL's and slime's weight sync send them) from fp32 main params inside its optimizer, which writes them
back after every step with a round-to-nearest ``copy_`` in one of two places:

=====================================================  ============================================================
``DistributedOptimizer._copy_main_params_to_model_params``  this rank's DP range of each param, into the bucket's
                                                      ``param_data`` (then all-gathered, at once or overlapped
                                                      with the next forward: the gather moves these bits)
``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params``  every whole TP-local param
=====================================================  ============================================================

The patch wraps both at the class level (inert for optimizers without ``_faircast``: critic, reference) and casts
each (fp32 main, bf16 destination) pair per ROUNDING.md, keyed by the Hugging Face name and flat index of each
element when a converter is given (megatron-bridge, :mod:`.hf_map`), else by :func:`~.layout.param_keys`
(Megatron-native canonical name, full-tensor element index). It also wraps ``step`` of ``MixedPrecisionOptimizer`` and ``ChainedOptimizer``: the
top-level optimizer's step advances the weight version once (a chained optimizer holds the dense and the expert
optimizers) and rolls it back when the step is skipped (``found_inf``) or raises before any cast. After each step
a collective check makes every rank confirm that the data-parallel ranks of each optimizer together cast every
element of its bf16 params exactly once; when one rank fails, all of them raise.

Options under which the copy is not what the forward reads and the engine serves are refused at attach.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Dict, List, Optional, Tuple

import torch

from ..audit import reduce_metrics
from ..cast import RunTable, fair_cast_runs
from ..caster import FairCaster, audit_track
from ..delta_sync import costly_mode_warning
from ..export import save_state
from ..patching import FairCastPatchError, PatchSet, installed_version
from ..policy_lag import refuse_policy_metrics
from .hf_map import (ConverterError, HFGroup, VOCAB_PARAMS, build_element_map, converter_lookup, hf_vocab_size_of,
                     range_runs)
from .layout import (LayoutError, ParamKey, _unwrap, dp_ranges, first_device, float16_pairs, fp32_ranges, param_keys,
                     sub_optimizers)
from .runs import local_runs

logger = logging.getLogger("faircast_plugins")

DISTRIBUTION = "megatron-core"
#: Exactly the releases tests-megatron runs (CPU, gloo; docs/megatron.md): 0.16.1, 0.18.2 (verl 0.9.1's pin through
#: megatron-bridge 0.5.x) and 0.19.2 (what a fresh install of verl's Megatron stack resolves). Anything else is refused
#: with its version: older ones (slime's 0.16.0rc0 pin included) and the unrun ones between them ask for one of these;
#: newer ones may opt in (FAIRCAST_ALLOW_UNVERIFIED=megatron-core, then `faircast doctor megatron-core` must pass).
MEGATRON_SPECIFIER = "==0.16.1 || ==0.18.2 || ==0.19.2"
STATE_FILE = "faircast_state_rank{rank:05d}.pt"
SUPPORTED = {
    "DistributedOptimizer": "megatron.core.optimizer.distrib_optimizer",
    "Float16OptimizerWithFloat16Params": "megatron.core.optimizer.optimizer",
}


def _installed() -> str:
    return installed_version(DISTRIBUTION) or "?"


class MegatronFairCast:
    """Fair Cast state of one Megatron-core optimizer (chained or not): the caster and the key of every bf16 param."""

    def __init__(self, optimizer, caster: FairCaster, keys: Dict[int, ParamKey],
                 hf_groups: Optional[Dict[Tuple[int, int, int], List[HFGroup]]] = None):
        self.optimizer = optimizer
        self.caster = caster
        self.keys = keys
        # (id(param), start, end) of each cast range -> its elements grouped per HF tensor (None: Megatron-native keys)
        self.hf_groups = hf_groups
        # the same ranges as run tables for one fused cast each: (HF names, keyed runs, padded rows' runs)
        self._hf_runs = {k: range_runs(g) for k, g in (hf_groups or {}).items()}
        self._native_runs: Dict[Tuple[int, int, int], RunTable] = {}  # Megatron-native keys, non-contiguous ranges
        self.cast_by_optimizer: Dict[int, int] = {}  # id(sub-optimizer) -> elements cast in this step
        self.problem: Optional[str] = None
        self.last_step_elements = 0
        self.policy = None  # the MegatronPolicyProbe (apply_megatron_patch(measure_policy=True)), its metrics merged
        # With ema_decay the EMA starts from the served weights only before the first step of a fresh run.
        self.ema_may_start = caster.version == 0

    # -- the casts -------------------------------------------------------------------------------------------
    def _cast(self, key: ParamKey, main: torch.Tensor, start: int, end: int, dst: torch.Tensor, step_ema: bool,
              param=None) -> None:
        main = main.detach().reshape(-1)
        if step_ema and self.caster.ema_on:
            start_value = dst.float() if self.ema_may_start else None
            if not self.ema_may_start and not self.caster.has_ema(key.name):
                self.problem = self.problem or (f"no EMA state for {key.name} after the first step: restore the Fair Cast "
                                                f"state of the checkpoint (MegatronFairCast.load)")
                return
            self.caster.update_ema(key.name, main, start=start_value)
        plan = self._hf_runs.get((id(param), start, end))
        if plan is not None and self.caster.mode != "error_feedback":  # error feedback is key- and index-free
            self._cast_runs(key, main, start, dst, plan)
        elif key.contiguous or self.caster.mode == "error_feedback":
            self.caster.cast(key.name, main, offset=key.offset(start) if key.contiguous else start, out=dst)
        else:
            runs = self._native_runs.get((id(param), start, end))
            if runs is None:  # made once, on the host: one row per chunk of rows of the partitioned dim
                runs = self._native_runs[(id(param), start, end)] = RunTable(
                    [[p, f, n, 0] for p, f, n in local_runs(key, start, end).tolist()])
            self._cast_runs(key, main, start, dst, ([key.name], runs, None))

    def _cast_runs(self, key: ParamKey, main: torch.Tensor, start: int, dst: torch.Tensor, plan) -> None:
        """One DP range that is not one contiguous run of its keys: keyed by HF name and HF flat index (ROUNDING.md
        §1), or by Megatron-native name and full index at TP > 1. Every run in one launch (padded vocab rows, round-
        to-nearest, in a second one), no per-element index and no host read."""
        caster = self.caster
        src = caster.source(key.name, main)  # the master, or its EMA (kept per Megatron param range)
        names, keyed, padded = plan
        if keyed is not None:
            fair_cast_runs(src, runs=keyed, keys=[caster.key(n) for n in names], mode=caster.mode,
                           backend=caster.config.backend, out=dst)
        if padded is not None:
            fair_cast_runs(src, runs=padded, keys=[0], mode="nearest", backend=caster.config.backend, out=dst)
        if caster.audit is not None:
            caster.audit.observe(audit_track(key.name, start, main), caster.version, main, dst)

    def copy_distributed(self, opt, step_ema: bool = True) -> None:
        """The distributed optimizer's main->model copy, cast."""
        cast = 0
        for main, param, start, end, dst in dp_ranges(opt):
            key = self.keys.get(id(param))
            if key is None:
                self.problem = self.problem or f"a bf16 param of shape {tuple(param.shape)} has no Fair Cast key"
                dst.copy_(main)
                continue
            self._cast(key, main, start, end, dst, step_ema, param)
            cast += end - start
        for main, dst in fp32_ranges(opt):
            dst.copy_(main)
        self.cast_by_optimizer[id(opt)] = self.cast_by_optimizer.get(id(opt), 0) + cast

    def copy_float16(self, opt, step_ema: bool = True) -> None:
        """The Float16 optimizer's main->model copy, cast."""
        cast = 0
        for main, param in float16_pairs(opt):
            key = self.keys.get(id(param))
            if key is None:
                self.problem = self.problem or f"a bf16 param of shape {tuple(param.shape)} has no Fair Cast key"
                param.data.copy_(main)
                continue
            self._cast(key, main, 0, param.numel(), param.data.view(-1), step_ema, param)
            cast += param.numel()
        self.cast_by_optimizer[id(opt)] = self.cast_by_optimizer.get(id(opt), 0) + cast

    # -- one optimizer step ----------------------------------------------------------------------------------
    def step(self, original, opt, *args, **kwargs):
        self.cast_by_optimizer, self.problem = {}, None
        self.caster.advance(masters=())  # the copy writes the weights after this step: the next version
        try:
            result = original(opt, *args, **kwargs)
        except BaseException:
            if not self.cast_by_optimizer:
                self.caster.rollback()
            raise
        success = result[0] if isinstance(result, tuple) else result
        if not success:  # found_inf: Megatron returned before the copy; the weights keep the last version
            if self.cast_by_optimizer:
                raise FairCastPatchError("Megatron reported a skipped step after Fair Cast had cast its weights")
            self.caster.rollback()
            return result
        problem = _on_any_rank(self._check(), first_device(opt))
        if problem:
            raise FairCastPatchError(problem)
        self.last_step_elements = sum(self.cast_by_optimizer.values())
        self.ema_may_start = False
        return result

    def _check(self) -> Optional[str]:
        """Why the data-parallel ranks of some optimizer did not cast each bf16 element exactly once (None if fine).

        A collective over each distributed optimizer's data-parallel group: every rank runs all of them, whatever it
        found (a rank that returned early would wait in the next collective while its peers wait in this one)."""
        found = self.problem
        for opt in sub_optimizers(self.optimizer):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            owned = _bf16_elements(opt)
            cast = self.cast_by_optimizer.get(id(opt), 0)
            group = getattr(opt, "data_parallel_group", None) if type(opt).__name__ == "DistributedOptimizer" else None
            if group is not None and torch.distributed.get_world_size(group) > 1:
                total = torch.tensor([cast], dtype=torch.int64, device=first_device(opt))
                torch.distributed.all_reduce(total, group=group)
                cast = int(total.item())
            if cast != owned and found is None:
                found = (f"Fair Cast cast {cast} elements of the {owned} bf16 elements of {type(opt).__name__} over its "
                         f"data-parallel ranks in this step with megatron-core {_installed()}: part of the served bf16 "
                         f"copy was written outside Fair Cast (round-to-nearest) or twice. This megatron-core version or "
                         f"configuration is not supported.")
        return found

    def offload_state(self) -> int:
        """Move this rank's per-element Fair Cast state (error-feedback residuals and their last served copies, EMA)
        to host memory, pinned where CUDA is available, e.g. while the trainer offloads its optimizer for the rollout
        (verl: ``MegatronEngine.to("cpu", optimizer=True)``); each cast moves its piece back next to its master. Returns
        the bytes moved off the device."""
        moved = 0
        pin = torch.cuda.is_available()

        def host(t):
            nonlocal moved
            if t is None or t.device.type == "cpu":
                return t
            moved += t.numel() * t.element_size()
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            out.copy_(t, non_blocking=pin)
            return out

        caster = self.caster
        for state in caster._ef.values():
            state.residual, state.served = host(state.residual), host(state.served)
        for name, t in list(caster._ema.items()):
            caster._ema[name] = host(t)
        if moved and pin:
            torch.cuda.synchronize()  # the device copies may be freed once this returns
        return moved

    def metrics(self) -> dict:
        """The ``faircast/*`` metrics since the last call, the audit's sums added over every rank (a collective with
        the audit on: every rank calls it)."""
        out = reduce_metrics(self.caster, device=first_device(self.optimizer))
        if self.policy is not None:
            out.update(self.policy.metrics())  # a collective over the data-parallel group
        return out

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_path(self, directory: str) -> str:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return os.path.join(directory, STATE_FILE.format(rank=rank))

    def _sharding(self) -> dict:
        """What a rank's per-element state depends on: the DP ranges it casts."""
        ranges = []
        for opt in sub_optimizers(self.optimizer):
            if type(opt).__name__ == "DistributedOptimizer":
                ranges += [(self.keys[id(p)].name, s, e) for _, p, s, e, _ in dp_ranges(opt, destinations=False)
                           if id(p) in self.keys]
            else:
                ranges += [(self.keys[id(p)].name, 0, p.numel()) for _, p in float16_pairs(opt) if id(p) in self.keys]
        return {"ranges": sorted(ranges)}

    def save(self, directory: str) -> str:
        """Write this rank's Fair Cast state (seed, weight version, residuals or EMA of its DP ranges) to ``directory``."""
        path = self.state_path(directory)
        return str(save_state(self.caster, directory, filename=os.path.basename(path),
                              extra={"megatron": self._sharding()}))

    def load(self, directory: str, *, step: Optional[int] = None) -> None:
        """Restore this rank's state from ``directory`` (written by :meth:`save`). Without a state file, stateless
        modes resume at weight version ``step`` (the trainer's optimizer step count); stateful ones refuse."""
        path = self.state_path(directory)
        if not os.path.exists(path):
            if self.caster.keeps_state:
                raise FairCastPatchError(
                    f"resuming with faircast {self.caster.config.describe()} needs this rank's Fair Cast state (error-"
                    f"feedback residuals or EMA), but {path} does not exist (a checkpoint written without Fair Cast, "
                    f"or at another world size)")
            if step is None:
                raise FairCastPatchError(f"{path} does not exist: pass the optimizer step to resume at (step=)")
            self.caster.set_version(int(step))
            self.ema_may_start = False
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        if self.caster.keeps_state:
            saved, now = state.get("megatron", {}).get("ranges"), self._sharding()["ranges"]
            if saved is not None and [tuple(r) for r in saved] != now:
                raise FairCastPatchError(
                    f"the Fair Cast state in {directory} holds residuals/EMA of other data-parallel ranges than this "
                    f"rank casts: it is per-rank state; resume with the same parallel layout (TP, PP, EP, DP) and buckets")
        self.caster.load_state_dict(state)
        self.ema_may_start = False


def _bf16_elements(opt) -> int:
    """How many bf16 param elements the optimizer's main->model copy must write, over its data-parallel ranks."""
    if type(opt).__name__ == "DistributedOptimizer":  # its groups hold only the params this rank has a range of
        return sum(p.numel() for buffer in opt.buffers for p in buffer.params if p.dtype == torch.bfloat16)
    return sum(p.numel() for group in opt.float16_groups for p in group)


def _bf16_groups(opt):
    if type(opt).__name__ == "DistributedOptimizer":
        return opt.model_float16_groups
    return opt.float16_groups


def _on_any_rank(problem: Optional[str], device) -> Optional[str]:
    """Every rank learns whether any rank found a problem, so all of them raise (none waits in a later collective)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return problem
    world = torch.distributed.get_world_size()
    failed = torch.zeros(world, dtype=torch.int32, device=device)
    failed[torch.distributed.get_rank()] = int(problem is not None)
    torch.distributed.all_reduce(failed)
    ranks = [r for r, bad in enumerate(failed.tolist()) if bad]
    if problem is None and ranks:
        problem = f"Fair Cast failed on rank(s) {ranks} (see their error); every rank stops here"
    return problem


# -- the class-level patches ---------------------------------------------------------------------------------
def _fc(opt) -> Optional[MegatronFairCast]:
    return opt.__dict__.get("_faircast")


def _wrap_distributed_copy(original):
    @functools.wraps(original)
    def _copy_main_params_to_model_params(self, *args, **kwargs):
        fc = _fc(self)
        if fc is None or getattr(self, "is_stub_optimizer", False):
            return original(self, *args, **kwargs)
        return fc.copy_distributed(self)

    return _copy_main_params_to_model_params


def _wrap_float16_copy(original):
    @functools.wraps(original)
    def _copy_main_params_to_model_params(self, *args, **kwargs):
        fc = _fc(self)
        if fc is None:
            return original(self, *args, **kwargs)
        return fc.copy_float16(self)

    return _copy_main_params_to_model_params


def _wrap_step(original):
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        fc = _fc(self)
        if fc is None or fc.optimizer is not self:  # only the top-level optimizer's step counts a version
            return original(self, *args, **kwargs)
        return fc.step(original, self, *args, **kwargs)

    return step


def _build_patchset() -> PatchSet:
    opt = "megatron.core.optimizer.optimizer:"
    return (
        PatchSet("Megatron-core", DISTRIBUTION, MEGATRON_SPECIFIER)
        .wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_main_params_to_model_params",
              _wrap_distributed_copy)
        .wrap(opt + "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params", _wrap_float16_copy)
        .wrap(opt + "MixedPrecisionOptimizer.step", _wrap_step)
        .wrap(opt + "ChainedOptimizer.step", _wrap_step)
    )


PATCHES = _build_patchset()


def install_megatron_patch() -> PatchSet:
    """Install the class-level Megatron-core patches (idempotent). They act only on optimizers with Fair Cast."""
    return PATCHES.apply(details="main->model param copy of optimizers with Fair Cast attached follows ROUNDING.md")


def apply_megatron_patch(optimizer, caster: FairCaster, model_chunks=None, *, bridge=None, converters=None,
                         hf_vocab_size: Optional[int] = None, measure_policy: bool = False
                         ) -> Optional[MegatronFairCast]:
    """Make ``optimizer``'s fp32 -> bf16 main->model param copy follow the Fair Cast contract.

    ``optimizer``: what ``megatron.core.optimizer.get_megatron_optimizer`` returned for the policy (a
    ``ChainedOptimizer``, a ``DistributedOptimizer`` or a ``Float16OptimizerWithFloat16Params``); only that one
    (critic and reference optimizers stay as they are). ``caster``: at the weight version of the optimizer's
    masters (0 for a fresh run; :meth:`MegatronFairCast.load` on resume). ``model_chunks``: the model chunks
    the optimizer was built for (default: the optimizer's own ``model_chunks``).

    Keys (docs/ROUNDING.md §1): with ``bridge`` (megatron-bridge's ``AutoBridge``, its model bridge or mapping
    registry: what exports the weights to Hugging Face) or ``converters`` (``{Megatron name: converter}`` or a
    lookup function, e.g. slime's converters through :func:`.slime.slime_converters`), every
    element is keyed by its Hugging Face name and flat index, learnt once here from the converters themselves and
    self-checked (:mod:`.hf_map`); ``hf_vocab_size`` (default: the bridge's HF config) marks the padded vocab rows.
    Without either, the Megatron-native names key it (a user's own megatron-core loop).

    ``measure_policy``: the caller measures ``faircast/policy_*`` (``policy_metrics_every`` in the config): the
    returned object's ``policy`` is a :class:`.policy.MegatronPolicyProbe`; call its ``measure`` on the batch before
    the optimizer step when ``due`` (the step count: ``caster.version``), and :meth:`MegatronFairCast.metrics`
    includes its metrics. Without it ``policy_metrics_every`` is refused (nothing would measure it).

    Returns the attached :class:`MegatronFairCast` (also ``optimizer._faircast``), or None when the config is
    neither enabled nor auditing nor measuring the policy. Raises :class:`~faircast_plugins.patching.FairCastPatchError`
    for unsupported megatron-core versions, optimizers and options.
    """
    if not caster.config.active:
        return None
    measured = measure_policy and caster.config.measures_policy
    if not measured:
        refuse_policy_metrics(caster, "Megatron-core's patch (apply_megatron_patch; verl's Megatron engine, slime, NeMo-RL)")
    delta = getattr(converters, "delta_sync", None)
    warning = delta and costly_mode_warning(caster.config.effective_mode, delta, "FairCastConfig(mode='sticky')")
    if warning:
        logger.warning(warning)
    install_megatron_patch()
    subs = sub_optimizers(optimizer)
    check_optimizer(optimizer)
    if model_chunks is None:
        model_chunks = [c for opt in subs for c in (getattr(opt, "model_chunks", None) or [])]
        model_chunks = list({id(c): c for c in model_chunks}.values())
    if not model_chunks:
        raise FairCastPatchError("pass model_chunks=: this Megatron optimizer does not keep its model chunks")
    for refusal in refused_model_options(model_chunks):
        raise FairCastPatchError(f"Fair Cast's Megatron-core patch does not support {refusal}")
    try:
        keys = param_keys(model_chunks)
    except LayoutError as exc:
        raise FairCastPatchError(f"Fair Cast cannot key this Megatron model: {exc}") from None
    probe = None
    if measured:  # refuses the layouts it cannot measure (virtual pipeline, context parallel, overlap_param_gather)
        from .policy import MegatronPolicyProbe

        probe = MegatronPolicyProbe(optimizer, model_chunks, every=caster.config.policy_metrics_every,
                                    seqs=caster.config.policy_metrics_seqs, caster=caster)
    missing = [tuple(p.shape) for opt in subs for g in _bf16_groups(opt) for p in g if id(p) not in keys]
    if missing:
        raise FairCastPatchError(f"{len(missing)} bf16 params of the optimizer (first: shape {missing[0]}) are not in "
                                 f"the model chunks given; pass every chunk the optimizer was built for")
    hf_groups = None
    if bridge is not None or converters is not None:
        try:
            hf_groups = hf_cast_groups(subs, model_chunks, keys, bridge=bridge, converters=converters,
                                       hf_vocab_size=hf_vocab_size)
        except (ConverterError, ValueError) as exc:
            raise FairCastPatchError(f"Fair Cast cannot key this Megatron model by Hugging Face names: {exc}") from None
    fc = MegatronFairCast(optimizer, caster, keys, hf_groups)
    fc.policy = probe
    for opt in subs:
        opt.__dict__["_faircast"] = fc
    if len(subs) > 1 or subs[0] is not optimizer:
        optimizer.__dict__["_faircast"] = fc
    logger.warning(
        "Fair Cast attached to Megatron-core %s (%s, %d bf16 params, %s keys): %s, weight version %d", _installed(),
        "+".join(type(o).__name__ for o in subs), len(keys), "Megatron-native" if hf_groups is None else "Hugging Face",
        caster.config.describe(), caster.version,
    )
    return fc


def cast_ranges(subs) -> List[Tuple[torch.nn.Parameter, int, int]]:
    """``(bf16 model param, start, end)`` of every range this rank's main->model copies cast."""
    out = []
    for opt in subs:
        if type(opt).__name__ == "DistributedOptimizer":
            out += [(p, s, e) for _, p, s, e, _ in dp_ranges(opt, destinations=False)]
        elif not getattr(opt, "is_stub_optimizer", False):
            out += [(p, 0, p.numel()) for _, p in float16_pairs(opt)]
    return out


def hf_cast_groups(subs, model_chunks, keys: Dict[int, ParamKey], *, bridge=None, converters=None,
                   hf_vocab_size: Optional[int] = None) -> Dict[Tuple[int, int, int], List[HFGroup]]:
    """Each cast range's elements grouped per Hugging Face tensor, from the converters' element maps (built one
    param at a time and dropped once its ranges are grouped)."""
    lookup = converter_lookup(bridge, converters)
    if hf_vocab_size is None and bridge is not None:
        hf_vocab_size = hf_vocab_size_of(bridge)
    modules = {}
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for name, p in model.named_parameters():
            modules.setdefault(id(p), model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model)
    by_param: Dict[int, list] = {}
    for p, start, end in cast_ranges(subs):
        by_param.setdefault(id(p), [p]).append((start, end))
    groups: Dict[Tuple[int, int, int], List[HFGroup]] = {}
    owner: Dict[str, str] = {}
    for pid, (p, *ranges) in by_param.items():
        key = keys[pid]
        if key.name in VOCAB_PARAMS and hf_vocab_size is None:
            raise ConverterError(f"{key.name}: pass hf_vocab_size= (the Hugging Face vocab size: Megatron pads the "
                                 f"vocab, the rows past it have no HF element)")
        converter = lookup(key.name)
        if converter is None:
            raise ConverterError(f"no converter maps the Megatron param {key.name} to Hugging Face names, so Fair "
                                 f"Cast cannot tell its HF name and index. Add one, or attach without converters "
                                 f"(Megatron-native keys, docs/ROUNDING.md §1)")
        emap = build_element_map(key, converter, modules.get(pid), hf_vocab_size)
        for name in emap.names:
            if owner.setdefault(name, key.name) != key.name:
                raise ConverterError(f"{key.name} and {owner[name]} both convert to the HF tensor {name}; Fair "
                                     f"Cast keys each HF element once")
        for start, end in ranges:
            groups[(pid, start, end)] = emap.groups(key, start, end)
    return groups


def remove_megatron_patch(optimizer) -> None:
    """Detach Fair Cast from ``optimizer``: its main->model copy is round-to-nearest again."""
    for opt in sub_optimizers(optimizer) + [optimizer]:
        opt.__dict__.pop("_faircast", None)


def check_optimizer(optimizer) -> None:
    """Refuse, with the reason, the optimizers and options whose bf16 params Fair Cast cannot make bit-exact."""
    for opt in sub_optimizers(optimizer):
        name = type(opt).__name__
        if SUPPORTED.get(name) != type(opt).__module__:
            raise FairCastPatchError(
                f"Fair Cast's Megatron-core patch supports the {' and '.join(SUPPORTED)} (in a ChainedOptimizer or "
                f"alone); this optimizer is {type(opt).__module__}.{name} (layer-wise / Muon and FP32 optimizers write "
                f"or keep the params elsewhere). Use the distributed optimizer with Adam (use_distributed_optimizer)")
        for refusal in refused_options(opt):
            raise FairCastPatchError(f"Fair Cast's Megatron-core patch does not support {refusal}")


def refused_options(opt):
    """Options of one optimizer under which its main->model copy is not what the forward reads and is served."""
    config = opt.config
    ddp = getattr(opt, "ddp_config", None)
    if getattr(config, "fp16", False) or not getattr(config, "bf16", False):
        yield ("fp16 or fp32 training (OptimizerConfig.fp16/bf16): Fair Cast serves bf16 params from fp32 masters. "
               "Train in bf16 (bf16=True); verl: actor.megatron.dtype=bfloat16")
    if getattr(config, "use_precision_aware_optimizer", False):
        yield ("the precision-aware optimizer (use_precision_aware_optimizer): the main->model copy happens inside "
               "TransformerEngine's FusedAdam, outside the copy Fair Cast patches. Set use_precision_aware_optimizer="
               "False (verl sets it for fp16 and when actor.optim.use_precision_aware_optimizer=true)")
    if getattr(config, "optimizer_cpu_offload", False):
        yield ("optimizer CPU offload (optimizer_cpu_offload, HybridDeviceOptimizer): the masters are updated and copied "
               "back by the hybrid optimizer, not yet tested with Fair Cast. Keep the optimizer on the GPU")
    if (getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False) or getattr(ddp, "fp8_param_gather", False)
            or getattr(ddp, "fp4_param_gather", False)):
        yield ("fp8/fp4/MXFP8 param gathers (fp8_param_gather, fp4_param_gather, reuse_grad_buf_for_mxfp8_param_ag): the params are "
               "quantized from the masters, so the forward does not read a bf16 copy. Gather bf16 params")
    if getattr(ddp, "use_megatron_fsdp", False) or getattr(ddp, "use_custom_fsdp", False):
        yield ("Megatron-FSDP (use_megatron_fsdp): its main->model copy is copy_main_weights_to_model_weights in "
               "megatron_fsdp, not patched. Use the distributed optimizer (use_distributed_optimizer=True)")


def refused_model_options(model_chunks):
    """Model options under which the bf16 params are not what the engine serves."""
    for chunk in model_chunks:
        config = getattr(_unwrap(chunk), "config", None)
        if getattr(config, "layernorm_zero_centered_gamma", False):
            yield ("zero-centred norms (layernorm_zero_centered_gamma): the served norm weight is param + 1, added in "
                   "bf16 by the export (a second rounding). Use a model without zero-centred gamma")
            return
        if getattr(config, "fp8", None) or getattr(config, "fp4", None):
            yield ("fp8/fp4 training (TransformerConfig.fp8/fp4): the forward reads quantized weights, not the bf16 copy "
                   "Fair Cast writes. Train in bf16")
            return
        if getattr(config, "quant_recipe", None) or getattr(config, "use_kitchen", False):
            yield ("per-layer quantization (TransformerConfig.quant_recipe / use_kitchen): the forward reads quantized "
                   "weights, not the bf16 copy Fair Cast writes. Train in bf16 without a quantization recipe")
            return
