"""The two weight views of a DeepSpeed bf16 engine's module that the ``faircast/policy_*`` metrics score
(:class:`faircast_plugins.policy_lag.PolicyLagProbe`), shared by TRL's DeepSpeed backend and OpenRLHF's policy actor.

``served``: the module's bf16 weight widened to fp32 (exact). After every optimizer step DeepSpeed's copy-back wrote
it: ``fair_cast(master)`` with the copy-back patch attached and Fair Cast on, DeepSpeed's own round to nearest
otherwise; it is what the rollout engine receives.

``master``: the fp32 master the optimizer trains, assembled from DeepSpeed's optimizer partitions. Given the engine
(:class:`DeepSpeedPolicyViews`), a window of consecutive parameters at a time from the optimizer's flat fp32
partitions (:mod:`faircast_plugins.deepspeed.master_windows`: ZeRO-1/2 one broadcast per owning rank, ZeRO-3 one
all-gather, per window of up to ``WINDOW_BYTES``); otherwise, and for a parameter outside that layout, one
parameter at a time by ``deepspeed.utils.safe_get_full_fp32_param`` (ZeRO-1/2: an all-reduce over the
data-parallel group; ZeRO-3: an all-gather of the fp32 partitions). Both are collectives: every rank must run them
for the same parameters in the same order, so the probe's forwards run on every rank. Frozen parameters have no
optimizer master; their bf16 weight is all there is.

ZeRO-3, direct (:func:`zero3_direct`, the default where it applies): both views come from the optimizer's partitions
a window at a time (served: the bf16 partitions ``fp16_partitioned_groups_flat``, exactly what DeepSpeed's module
hooks would gather; master: the fp32 ones), and the swap of :meth:`DeepSpeedPolicyViews.scope` runs each forward
with DeepSpeed's module hooks and the engine's forward prologue/epilogue hooks detached
(:func:`faircast_plugins.policy_lag.hooks_detached`): no per-module bf16 all-gather (session 15 ran one per module
in each of the two forwards, the master forward's wasted), no "external parameter" gathers (the prologue marks the
modules in forward), nothing recorded in the prefetch trace. ``p.ds_status`` and ``p.ds_tensor`` are not touched; a
persistent parameter (whole on every rank) is served from its own weight. It applies when every partitioned
parameter of the module is in both window layouts (not a frozen one, not one offloaded away from the flat buffers,
not a sub-group swapped to NVMe).

ZeRO-3 otherwise (DeepSpeed 0.19, ``runtime/zero/parameter_offload.py``): each module's forward pre-hook, registered
at engine init, all-gathers the module's partitions into ``p.data`` (``fetch_sub_module``) and its forward hook
releases them (``release_sub_module`` -> ``param.partition()``). :func:`faircast_plugins.policy_lag.weights_swapped`
registers its pre-hook after DeepSpeed's (it runs after the fetch: ``p.data`` is the gathered bf16 weight, which
the views read) and its post-hook prepended (it runs before the release: DeepSpeed partitions the gathered bf16
tensor it put there, never ours).

ZeRO-3's prefetcher (``partitioned_param_coordinator.py``) records the module order of one forward + backward as its
trace and, once complete, releases and prefetches by it. The probe's forwards (no backward; the modules of the HF
forward, where a trainer's own forward may differ, e.g. TRL's fused LM head reads ``lm_head.weight`` without calling
``lm_head``) would be recorded or checked against that trace: measured, TRL's next backward then found the tied
embedding released (``AccumulateGrad`` on an empty weight). :meth:`DeepSpeedPolicyViews.scope` therefore
invalidates the trace after the probe (also after direct forwards, which record nothing: kept as the tested state),
the state TRL's own generation leaves it in (``trl.models.utils.add_hooks``): the next training forward records a
fresh trace, and training runs as without the probe (tested bit for bit); the cost is one step without prefetch every
N steps.

One :class:`DeepSpeedPolicyViews` per measurement builds each layout once (the master one; under ZeRO-3 the served
one too) and decides once whether the forwards run direct; nothing is kept across measurements (the weights move at
every step, and an offload/reload can move the flat buffers).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

import torch

from ..patching import FairCastPatchError
from ..policy_lag import hooks_detached, weights_swapped, widened

View = Callable[[torch.nn.Parameter], Optional[torch.Tensor]]


#: the served view: the module's bf16 weight (gathered, inside a ZeRO-3 module forward) widened to fp32
served_view = widened


def master_view(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full fp32 master of ``p`` from DeepSpeed's optimizer (a collective); the served view for frozen ones."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p) if p.requires_grad else None
    if full is None:
        return served_view(p)
    return full.to(p.data.device).view(p.data.shape)


class DeepSpeedPolicyViews:
    """The probe's two views of a DeepSpeed ``engine``'s module for ONE measurement (the weights move at every step,
    and an offload/reload can move the flat buffers: build one per measurement).

    Builds the master layout (:func:`~faircast_plugins.deepspeed.master_windows.layout_of`) once and, under ZeRO-3,
    the served one once, deciding there whether the forwards run direct (:func:`zero3_direct`). Use:
    ``with views.scope() as swap: probe.measure(engine.module, ..., served=views.served, master=views.master,
    swap=swap, collective=True)``.

    ``served`` / ``master``: parameter -> tensor functions. Without a master layout read here: the per-parameter
    views (:func:`served_view`, :func:`master_view`); with one, the master view assembles the optimizer's masters a
    window at a time (:class:`~faircast_plugins.deepspeed.master_windows.MasterWindows`), the per-parameter view for a
    parameter outside it; under ZeRO-3 direct, the served view the bf16 partitions likewise (a persistent parameter,
    whole on every rank: its own weight)."""

    def __init__(self, engine):
        from .master_windows import MasterWindows, layout_of

        self.engine = engine
        layout = layout_of(getattr(engine, "optimizer", None))
        windows = MasterWindows(layout) if layout is not None and layout.places else None
        #: ZeRO-3 direct (:func:`zero3_direct`): the windowed served view; the forwards run with DeepSpeed's hooks
        #: detached
        self.direct = zero3_direct(engine, layout)
        self.served: View = served_view
        self.master: View = master_view
        if windows is None:
            return

        def master(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
            full = windows(p)
            return full if full is not None else master_view(p)

        self.master = master
        if self.direct is None:
            return
        direct = self.direct

        def served(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
            if _gathered(p):  # a persistent parameter (stage3_param_persistence_threshold): its bf16 weight is whole
                return served_view(p)
            return direct(p)

        self.served = served

    @contextmanager
    def scope(self) -> Iterator[Optional[Callable]]:
        """Around the probe's forwards on ``engine.module``; yields the probe's ``swap``. Under ZeRO-3 direct, each
        forward runs with DeepSpeed's module hooks detached (:func:`deepspeed_hooks`: the views bring every weight, no
        bf16 gather per module, the wasted one of the master pass included); otherwise (ZeRO-3) inside them. Either
        way under ZeRO-3 the prefetch trace is invalidated afterwards (see the module docstring), so the next training
        forward records its own. Below ZeRO-3: None (the default swap)."""
        engine = self.engine
        coordinator = _trace_coordinator(engine)
        swap = None
        if coordinator is not None and self.direct is not None:
            detached = deepspeed_hooks(engine)

            @contextmanager
            def swap(model, view):
                with hooks_detached(detached), weights_swapped(model, view):
                    yield
        try:
            yield swap
        finally:
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()


def _gathered(p: torch.nn.Parameter) -> bool:
    return getattr(getattr(p, "ds_status", None), "name", "AVAILABLE") == "AVAILABLE"


def zero3_direct(engine, master_layout):
    """Under ZeRO-3, the windowed served view (the bf16 partitions, gathered a window at a time) when it and the
    master windows (``master_layout``, the engine's :class:`~faircast_plugins.deepspeed.master_windows.Zero3Layout`)
    hold every parameter DeepSpeed has partitioned away, so the probe's forwards need none of DeepSpeed's per-module
    gathers (:meth:`DeepSpeedPolicyViews.scope` then runs them with its module hooks detached); else None (a frozen or
    offloaded parameter, another DeepSpeed: the forwards run inside DeepSpeed's hooks as before)."""
    if engine is None or engine.zero_optimization_stage() != 3:
        return None
    from .master_windows import MasterWindows, Zero3Layout

    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None or not all(hasattr(offload, a) for a in ("forward_hooks", "backward_hooks")):
        return None
    if not isinstance(master_layout, Zero3Layout):
        return None
    served = Zero3Layout(engine.optimizer, served=True)
    if any(not _gathered(p) and (id(p) not in master_layout.places or id(p) not in served.places)
           for p in engine.module.parameters()):
        return None
    return MasterWindows(served)


def deepspeed_hooks(engine) -> List:
    """The handles of ZeRO-3's module hooks (gather before each module's forward, release after, the backward
    bookkeeping, the step reset of the root) and of the engine's forward prologue/epilogue hooks on the root (the
    prologue marks every module "in forward", where reading a partitioned parameter gathers it): what the direct
    forwards run without (:func:`~faircast_plugins.policy_lag.hooks_detached`)."""
    offload = engine.optimizer.parameter_offload
    handles = [*offload.forward_hooks, *offload.backward_hooks, getattr(offload, "fwd_pre_hook", None),
               getattr(engine, "module_forward_pre_hook", None), getattr(engine, "module_forward_post_hook", None)]
    return [h for h in handles if h is not None]


def _trace_coordinator(engine):
    """ZeRO-3's parameter coordinator of ``engine`` (None below ZeRO-3); refuses a DeepSpeed without the one read."""
    if engine.zero_optimization_stage() != 3:
        return None
    offload = getattr(engine.optimizer, "parameter_offload", None)
    coordinator = offload.get_param_coordinator() if offload is not None else None
    if coordinator is None or not hasattr(coordinator, "_invalidate_trace"):
        from ..patching import installed_version

        raise FairCastPatchError(
            f"faircast policy metrics under DeepSpeed {installed_version('deepspeed') or '?'} ZeRO-3: the engine's "
            f"optimizer has no parameter_offload.get_param_coordinator()._invalidate_trace (read in DeepSpeed 0.19), "
            f"which keeps the probe's forwards out of ZeRO-3's prefetch trace. Use ZeRO-0/1/2, or set "
            f"policy_metrics_every=0"
        )
    return coordinator


__all__ = ["DeepSpeedPolicyViews", "deepspeed_hooks", "master_view", "served_view", "zero3_direct"]
