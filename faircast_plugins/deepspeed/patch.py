"""Fair Cast for DeepSpeed bf16 training: the fp32 -> bf16 copy-back after each optimizer step.

In DeepSpeed bf16 training the module's parameters *are* the bf16 copy (the forward, hence the loss and
the old log-probs, run on them, and they are what gets broadcast to a rollout engine) while the fp32
masters live in the optimizer wrapper. After every step the wrapper copies the masters back with a plain
``Tensor.copy_`` (round-to-nearest). This patch makes that copy follow ROUNDING.md, which gives both halves
of Fair Cast at once.

DeepSpeed has no hook there, so the patch wraps ``DeepSpeedEngine._take_model_step`` (inert for engines
without Fair Cast: critic, reference, reward, EMA) and, for the duration of that call only, routes every
fp32 -> bf16 ``copy_`` whose destination is this engine's weight memory through the caster, keyed by the
parameter's canonical name and each element's index in the *full* parameter. One site per configuration:

==========================================  ==========================================================
ZeRO-0 (FP16_Optimizer, FP16_Unfused)       per parameter, replicated on every rank
BF16_Optimizer (ZeRO-1 + fp32 grad accum)   ``update_lp_params``: this rank's flat partition
ZeRO-1/2                                    ``step``: this rank's flat partition, per param group
ZeRO-1/2 + CPU offload                      ``step``: into a staging buffer, then into the partition
ZeRO-3 (+ offload)                          ``_reassign_or_swap_out_partitioned_parameters``
==========================================  ==========================================================

After each step every rank checks that it cast exactly the weight elements its copy-back writes
(:func:`~.layout.copy_back_elements`); the check is collective, so when one rank fails all of them raise
(none is left waiting in DeepSpeed's next collective). The weight version counts steps taken: a step
DeepSpeed skips on overflow casts nothing and leaves it unchanged. A universal-checkpoint load re-derives
the bf16 weights with ``update_lp_params`` and a ZeRO-3 load with the step's own copy-back: the patch runs
both under the interceptor at the restored version. Options whose weights bypass this copy-back (ZenFlow,
NVMe parameter offload, weight quantization (MoQ, ZeRO++ quantized weights), AutoTP, MoE expert
parallelism) are refused at activation.

With ``ema_decay > 0`` the optimizer still updates the fp32 master; the copy-back then writes
``fair_cast(EMA of the master)``. The EMA is elementwise, so each rank keeps it for exactly the master
elements it copies back (its ZeRO partition), keyed like the casts by canonical name and global element
index, and updates it from the freshly stepped master inside the copy-back. It starts at the master of
version 0, which a fresh engine holds exactly in its bf16 weights (DeepSpeed builds its fp32 masters from
them); a resumed run restores it from the checkpoint.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

from ..caster import FairCaster
from ..export import save_state
from ..key import canonical_name
from ..patching import FairCastPatchError, PatchSet, temporarily
from ..policy_lag import refuse_policy_metrics
from .layout import WeightLayout, copy_back_elements

logger = logging.getLogger("faircast_plugins")

DEEPSPEED_SPECIFIER = ">=0.19,<0.20"
STATE_FILE = "faircast_state_rank{rank:05d}.pt"

# The optimizer wrappers whose copy-back sites were verified (runtime module, class name).
SUPPORTED_OPTIMIZERS = {
    "FP16_Optimizer": "deepspeed.runtime.fp16.fused_optimizer",
    "FP16_UnfusedOptimizer": "deepspeed.runtime.fp16.unfused_optimizer",
    "BF16_Optimizer": "deepspeed.runtime.bf16_optimizer",
    "DeepSpeedZeroOptimizer": "deepspeed.runtime.zero.stage_1_and_2",
    "DeepSpeedZeroOptimizer_Stage3": "deepspeed.runtime.zero.stage3",
}

_ORIGINAL_COPY = torch.Tensor.copy_


class _CopyBackInterceptor:
    """Stands in for ``torch.Tensor.copy_`` during one optimizer step of one engine."""

    def __init__(self, layout: WeightLayout, caster: FairCaster, *, step_ema: bool = True, ema_may_start: bool = False):
        self.layout, self.caster = layout, caster
        # step_ema: this copy-back follows an optimizer step (update the EMA), not a re-cast of loaded masters.
        self.step_ema = step_ema and caster.ema_on
        self.ema_may_start = ema_may_start
        self.copies_seen = 0
        self.elements_cast = 0
        # A layout problem is not raised inside DeepSpeed's step (the other ranks would hang in its next
        # collective): the copy stays DeepSpeed's own, and the step's collective check fails on every rank.
        self.problem: Optional[str] = None
        self._busy = False

    def copy_(self, dst: torch.Tensor, src, non_blocking: bool = False):
        if (
            self._busy
            or not isinstance(src, torch.Tensor)
            or dst.dtype != torch.bfloat16
            or src.dtype != torch.float32
        ):
            return _ORIGINAL_COPY(dst, src, non_blocking)
        self.copies_seen += 1
        if not dst.is_contiguous():
            if self.layout.touches(dst):
                self.problem = self.problem or (
                    f"DeepSpeed copied fp32 into a non-contiguous view {tuple(dst.shape)} of the bf16 weights; Fair Cast "
                    f"does not know which parameter elements it covers and refuses to leave them round-to-nearest"
                )
            return _ORIGINAL_COPY(dst, src, non_blocking)
        segments = self.layout.segments(dst)
        if not segments:
            return _ORIGINAL_COPY(dst, src, non_blocking)
        if not src.is_contiguous() or src.numel() != dst.numel():
            self.problem = self.problem or (
                f"DeepSpeed copied an fp32 tensor {tuple(src.shape)} into bf16 weights {tuple(dst.shape)} in a layout "
                f"Fair Cast does not know; refusing to guess which master element lands where"
            )
            return _ORIGINAL_COPY(dst, src, non_blocking)
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        self._busy = True
        try:
            if self.caster.ema_on:  # before the copy: an EMA without state starts at the weights served now
                for seg in segments:
                    self._ema(seg, flat_src[seg.begin: seg.begin + seg.length])
            _ORIGINAL_COPY(dst, src, non_blocking)  # padding between parameters keeps DeepSpeed's own bits
            for seg in segments:
                x = flat_src[seg.begin: seg.begin + seg.length]
                if x.device != flat_dst.device:  # offloaded master: round where the weights live
                    x = x.to(flat_dst.device)
                self.caster.cast(seg.name, x, offset=seg.offset, out=flat_dst[seg.begin: seg.begin + seg.length])
                self.elements_cast += seg.length
        finally:
            self._busy = False
        return dst

    def _ema(self, seg, master: torch.Tensor) -> None:
        """Step this segment's EMA with its updated master (or, re-casting loaded masters, check it exists)."""
        if self.caster.has_ema(seg.name):
            if self.step_ema:
                self.caster.update_ema(seg.name, master)
            return
        if not (self.step_ema and self.ema_may_start):
            raise FairCastPatchError(
                f"Fair Cast has no EMA state for {seg.name} (elements {seg.offset}..{seg.offset + seg.length - 1}) at "
                f"weight version {self.caster.version}: with faircast.ema_decay the EMA starts at a fresh engine's "
                f"first step, or is restored from a checkpoint written with the same Fair Cast settings"
            )
        # A fresh engine's fp32 master at version 0 is exactly its bf16 weights (DeepSpeed builds it from them).
        self.caster.update_ema(seg.name, master, start=self.layout.weights(seg).float())


class DeepSpeedFairCast:
    """Fair Cast state of one DeepSpeed engine: the caster, the canonical names of its trainable parameters."""

    def __init__(self, engine, caster: FairCaster, named_params):
        self.engine = engine
        self.caster = caster
        self.named_params = named_params
        self.last_step_elements = 0
        # With ema_decay, the EMA may start from the weights only on a fresh engine (version 0, no step taken).
        self.ema_may_start = caster.version == 0 and int(getattr(engine, "global_steps", 0)) == 0

    def _intercepting(self, interceptor: "_CopyBackInterceptor"):
        def copy_(dst, src, non_blocking=False):  # a plain function, so that it binds to the tensor like copy_
            return interceptor.copy_(dst, src, non_blocking)

        return temporarily(torch.Tensor, "copy_", copy_)

    def take_model_step(self, original, *args, **kwargs):
        layout = WeightLayout.of_engine(self.engine, self.named_params)
        interceptor = _CopyBackInterceptor(layout, self.caster, ema_may_start=self.ema_may_start)
        # The copy-back writes the weights after this step: the next version. (With ema_decay the interceptor
        # updates the EMA partition by partition, from the masters as the copy-back reads them.)
        self.caster.advance(masters=())
        try:
            with self._intercepting(interceptor):
                result = original(self.engine, *args, **kwargs)
        except BaseException:
            self.caster.rollback()
            raise
        # The version counts optimizer steps taken (ROUNDING.md): a step DeepSpeed skips (bf16/fp16 overflow:
        # ZeRO-1/2 and ZeRO-0 with loss scaling) copies nothing back and leaves the weights and the version as they were.
        skipped = interceptor.elements_cast == 0 and getattr(self.engine.optimizer, "overflow", False)
        problem = None if skipped else _copy_back_problem(self.engine, layout, interceptor, "an optimizer step")
        problem = _on_any_rank(problem)
        if skipped or problem:
            self.caster.rollback()
        if problem:
            raise FairCastPatchError(problem)
        if not skipped:
            self.last_step_elements = interceptor.elements_cast
            self.ema_may_start = False
        return result

    def recast_after_load(self) -> None:
        """Re-derive the bf16 weights from the loaded masters at the current version, where a load rounded them.

        ZeRO-3 rebuilds its bf16 partitions from the fp32 masters with round-to-nearest when it loads a
        checkpoint, and so does a universal-checkpoint load under ZeRO-1/2 and BF16_Optimizer
        (``update_lp_params``). A plain ZeRO-0/1/2 or BF16_Optimizer load restores the saved (Fair Cast) bf16 bits.
        """
        opt = self.engine.optimizer
        if self.engine.zero_optimization_stage() == 3:
            if not hasattr(opt, "_reassign_or_swap_out_partitioned_parameters"):
                raise FairCastPatchError(
                    f"DeepSpeed {_installed()} ZeRO-3 has no _reassign_or_swap_out_partitioned_parameters; Fair Cast "
                    f"cannot restore the served copy after a checkpoint load"
                )

            def copy_back():
                for sub_group in range(len(opt.fp16_partitioned_groups_flat)):
                    opt._reassign_or_swap_out_partitioned_parameters(sub_group)

            self._recast("a ZeRO-3 checkpoint load", copy_back)
            _regather_persistent(opt.persistent_parameters)
        elif self.engine.load_universal_checkpoint():
            if not hasattr(opt, "update_lp_params"):
                raise FairCastPatchError(
                    f"Fair Cast cannot restore the served copy after a universal-checkpoint load with DeepSpeed "
                    f"{_installed()} {type(opt).__name__} (no update_lp_params); load a regular checkpoint instead"
                )
            self._recast("a universal-checkpoint load", opt.update_lp_params)

    def _recast(self, what: str, copy_back) -> None:
        """Run DeepSpeed's own fp32 -> bf16 copy-back ``copy_back()`` under the interceptor, at the current version."""
        layout = WeightLayout.of_engine(self.engine, self.named_params)
        interceptor = _CopyBackInterceptor(layout, self.caster, step_ema=False)
        with torch.no_grad(), self._intercepting(interceptor):
            copy_back()
        problem = _on_any_rank(_copy_back_problem(self.engine, layout, interceptor, what))
        if problem:
            raise FairCastPatchError(problem)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_path(self, tag_dir: str) -> str:
        import deepspeed.comm as dist

        return os.path.join(tag_dir, STATE_FILE.format(rank=dist.get_rank()))

    def save(self, tag_dir: str) -> str:
        """Write this rank's Fair Cast state (seed, weight version, error-feedback residuals or EMA) next to the checkpoint."""
        sharding = {
            "zero_stage": self.engine.zero_optimization_stage(),
            "world_size": self.engine.world_size,
            "global_steps": self.engine.global_steps,
        }
        path = self.state_path(tag_dir)
        return str(save_state(self.caster, tag_dir, filename=os.path.basename(path), extra={"deepspeed": sharding}))

    def load(self, tag_dir: str) -> None:
        """Restore this rank's Fair Cast state from a checkpoint directory written by :meth:`save`."""
        path = self.state_path(tag_dir)
        per_rank = self._per_rank_state()
        if not os.path.exists(path):
            if per_rank:
                raise FairCastPatchError(
                    f"resuming with faircast {per_rank} needs this rank's Fair Cast state, but {path} does not "
                    f"exist (checkpoint written without Fair Cast, or with a different world size)"
                )
            self.caster.set_version(int(self.engine.global_steps))
            logger.warning("Fair Cast: %s has no Fair Cast state; weight version set to the engine's global step %d",
                           tag_dir, self.caster.version)
            self.recast_after_load()
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = state.get("deepspeed", {})
        if per_rank:
            for what, now in (("world size", self.engine.world_size), ("ZeRO stage", self.engine.zero_optimization_stage())):
                was = saved.get("world_size" if what == "world size" else "zero_stage")
                if was not in (None, now):
                    raise FairCastPatchError(
                        f"the Fair Cast state in {tag_dir} ({per_rank}) was written at {what} {was}, this run has {now}: "
                        f"it is per-rank state of each rank's partition; resume at the same world size and ZeRO stage"
                    )
        self.caster.load_state_dict(state)
        self.ema_may_start = False
        self.recast_after_load()

    def _per_rank_state(self) -> str:
        """What per-partition state this run keeps ("" for none)."""
        if not self.caster.keeps_state:
            return ""
        if self.caster.mode == "error_feedback":
            return "mode=error_feedback (residuals)"
        return f"ema_decay={self.caster.config.ema_decay} (EMA of the master)"


def _regather_persistent(params) -> None:
    """Refresh the full copies ZeRO-3 keeps of small ("persistent") parameters from their recast partitions."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p in params:
        if p.ds_status != ZeroParamStatus.AVAILABLE or p.data.numel() != p.ds_numel:
            continue  # not gathered now: DeepSpeed gathers it from the partitions when it is used
        parts = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size(group=p.ds_process_group))]
        dist.all_gather(parts, p.ds_tensor.data, group=p.ds_process_group)
        full = torch.cat([t.to(p.data.device) for t in parts])[: p.ds_numel]
        p.data.copy_(full.view_as(p.data))


def _copy_back_problem(engine, layout: WeightLayout, interceptor: _CopyBackInterceptor, what: str) -> Optional[str]:
    """Why this rank's copy-back did not cast exactly the elements it owns (None when it did)."""
    if interceptor.problem:
        return interceptor.problem
    expected = copy_back_elements(engine, layout)
    if interceptor.elements_cast == expected > 0:
        return None
    where = (f"during {what} with DeepSpeed {_installed()} ({type(engine.optimizer).__name__}, "
             f"ZeRO-{engine.zero_optimization_stage()})")
    if interceptor.elements_cast == 0:
        return (f"Fair Cast saw {interceptor.copies_seen} fp32->bf16 copies but none into the model's weights {where}; "
                f"the served bf16 copy would silently stay round-to-nearest. This DeepSpeed version or configuration is "
                f"not supported.")
    return (f"Fair Cast cast {interceptor.elements_cast} weight elements {where}, but this rank owns {expected}: part of "
            f"the served bf16 copy was written outside Fair Cast (round-to-nearest) or twice. This DeepSpeed "
            f"configuration is not supported.")


def _on_any_rank(problem: Optional[str]) -> Optional[str]:
    """A collective: every rank learns whether any rank found a problem, so all of them raise (none waits forever
    in DeepSpeed's next collective). Returns this rank's problem, or one naming the ranks that failed."""
    import deepspeed.comm as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    from deepspeed.accelerator import get_accelerator

    failed = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=get_accelerator().current_device_name())
    failed[dist.get_rank()] = int(problem is not None)
    dist.all_reduce(failed)
    ranks = [r for r, bad in enumerate(failed.tolist()) if bad]
    if problem is None and ranks:
        problem = f"Fair Cast failed on rank(s) {ranks} (see their error); every rank stops here"
    return problem


def _installed() -> str:
    from ..patching import installed_version

    return installed_version("deepspeed") or "?"


# -- the class-level patches ---------------------------------------------------------------------------------
def _wrap_take_model_step(original):
    @functools.wraps(original)
    def _take_model_step(self, *args, **kwargs):
        fc = self.__dict__.get("_faircast")
        if fc is None:
            return original(self, *args, **kwargs)
        return fc.take_model_step(original, *args, **kwargs)

    return _take_model_step


def _wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, *args, **kwargs):
        fc = self.__dict__.get("_faircast")
        if fc is not None and tag is None:
            tag = f"global_step{self.global_steps}"  # DeepSpeed's own default, resolved here to know the folder
        result = original(self, save_dir, tag, *args, **kwargs)
        if fc is not None:
            fc.save(os.path.join(save_dir, str(tag)))
        return result

    return save_checkpoint


def _wrap_load_checkpoint(original):
    @functools.wraps(original)
    def load_checkpoint(self, *args, **kwargs):
        load_path, client_states = original(self, *args, **kwargs)
        if load_path is not None:
            # Remembered even before Fair Cast is attached (OpenRLHF loads inside its actor's init).
            self.__dict__["_faircast_loaded_from"] = os.path.dirname(load_path)
            fc = self.__dict__.get("_faircast")
            if fc is not None:
                fc.load(os.path.dirname(load_path))
        return load_path, client_states

    return load_checkpoint


def _build_patchset() -> PatchSet:
    engine = "deepspeed.runtime.engine:DeepSpeedEngine."
    return (
        PatchSet("DeepSpeed", "deepspeed", DEEPSPEED_SPECIFIER)
        .wrap(engine + "_take_model_step", _wrap_take_model_step)
        .wrap(engine + "save_checkpoint", _wrap_save_checkpoint)
        .wrap(engine + "load_checkpoint", _wrap_load_checkpoint)
    )


PATCHES = _build_patchset()


def install_deepspeed_patch() -> PatchSet:
    """Install the class-level DeepSpeed patches (idempotent). They act only on engines with Fair Cast attached."""
    return PATCHES.apply(details="copy-back of engines with Fair Cast attached follows ROUNDING.md")


def apply_deepspeed_patch(engine, caster: FairCaster, *, module: Optional[torch.nn.Module] = None) -> Optional[DeepSpeedFairCast]:
    """Make ``engine``'s fp32 -> bf16 copy-back after each optimizer step follow the Fair Cast contract.

    ``engine``: the ``deepspeed.DeepSpeedEngine`` of the policy (only that one: critic, reference and EMA
    engines stay as they are). ``caster``: a :class:`~faircast_plugins.FairCaster`, at the weight version
    of the engine's masters (0 for a fresh run). ``module``: the Hugging Face model whose
    ``named_parameters()`` give the canonical names (default ``engine.module``; pass the inner model when
    the engine wraps it, e.g. OpenRLHF's ``Actor.model``).

    Returns the attached :class:`DeepSpeedFairCast` (also ``engine._faircast``), or ``None`` when the
    config is neither enabled nor auditing (the engine is left untouched). Raises
    :class:`~faircast_plugins.patching.FairCastPatchError` for unsupported DeepSpeed versions or modes.
    """
    refuse_policy_metrics(caster, "apply_deepspeed_patch (DeepSpeed, OpenRLHF)")
    if not caster.config.active:
        return None
    install_deepspeed_patch()
    _check_engine(engine, caster)
    named = _named_trainable(engine, module if module is not None else engine.module)
    fc = DeepSpeedFairCast(engine, caster, named)
    engine.__dict__["_faircast"] = fc
    loaded = engine.__dict__.get("_faircast_loaded_from")
    if loaded:
        fc.load(loaded)
    logger.warning(
        "Fair Cast attached to DeepSpeed engine (ZeRO-%d, %s, %d trainable parameters): %s, weight version %d",
        engine.zero_optimization_stage(), type(engine.optimizer).__name__, len(named), caster.config.describe(),
        caster.version,
    )
    return fc


def remove_deepspeed_patch(engine) -> None:
    """Detach Fair Cast from ``engine``: its copy-back is round-to-nearest again."""
    engine.__dict__.pop("_faircast", None)


def _check_engine(engine, caster: FairCaster) -> None:
    version = _installed()
    if not engine.bfloat16_enabled():
        raise FairCastPatchError(
            "Fair Cast's DeepSpeed patch needs bf16 training (\"bf16\": {\"enabled\": true}); this engine is not bf16"
        )
    if engine.bf16_master_weights_and_gradients():
        raise FairCastPatchError(
            "Fair Cast cannot work with DeepSpeed's bf16_master_weights_and_grads: the master itself is bf16, so "
            "updates below half a bf16 step vanish inside the optimizer before any cast. Disable it (OpenRLHF does not set it)."
        )
    if engine.torch_autocast_enabled():
        raise FairCastPatchError("Fair Cast's DeepSpeed patch does not support torch_autocast (module weights stay fp32)")
    opt = engine.optimizer
    supported = any(
        type(opt).__name__ == cls and type(opt).__module__ == mod for cls, mod in SUPPORTED_OPTIMIZERS.items()
    )
    if not supported:
        raise FairCastPatchError(
            f"Fair Cast supports the DeepSpeed {version} optimizer wrappers {', '.join(SUPPORTED_OPTIMIZERS)}; this "
            f"engine uses {type(opt).__module__}.{type(opt).__name__} (ZenFlow, SuperOffload, DeepCompile and the like "
            f"copy the masters elsewhere and are refused)"
        )
    for refusal in _refused_options(engine):
        raise FairCastPatchError(f"Fair Cast's DeepSpeed patch does not support {refusal}")


def _refused_options(engine):
    """DeepSpeed options under which the copy-back Fair Cast intercepts is not what the forward reads or serves."""
    zero = engine._config.zero_config
    if getattr(engine, "zenflow", False) or getattr(zero, "zenflow", None) is not None:
        yield ("ZenFlow (zero_optimization.zenflow): it updates the masters and copies them back outside the optimizer "
               "step Fair Cast intercepts (ZeRO-3's ZenFlow even keeps the usual optimizer class). Remove the zenflow "
               "section; plain CPU offload (offload_optimizer) is supported")
    if zero.offload_param is not None and zero.offload_param.device == "nvme":
        yield ("ZeRO-3 parameter offload to NVMe (zero_optimization.offload_param.device=nvme): sub-groups swapped out "
               "to NVMe are written from the masters by the swapper, round-to-nearest, outside Fair Cast. Use "
               "offload_param.device=cpu (or none)")
    yield from zeropp_refusals(zero)
    # DeepSpeed 0.19.8 removed compression training (MoQ) together with its config section and engine.quantizer.
    compression = getattr(engine._config, "compression_config", None) or {}
    weight_quantization = compression.get("weight_quantization", {}).get("shared_parameters", {})
    if getattr(engine, "quantizer", None) is not None or weight_quantization.get("enabled", False):
        yield ("DeepSpeed weight quantization (MoQ, compression_training.weight_quantization): it re-quantizes the bf16 "
               "weights after the copy-back, so the forward and the rollout engine would not get the Fair Cast copy. "
               "Disable compression_training.weight_quantization")
    quantized_init = getattr(engine._config, "weight_quantization_config", None)
    if quantized_init is not None and quantized_init.quantized_initialization:
        yield ("ZeRO-3 quantized weight initialization (weight_quantization.quantized_initialization): the partitions "
               "hold int8 weights that the forward dequantizes, so neither the forward nor the rollout engine reads the "
               "Fair Cast copy. Remove weight_quantization.quantized_initialization (it is meant for inference)")
    tp = engine.autotp_size() or 1
    tp_layers = sorted({type(m).__name__ for m in engine.module.modules() if _is_tensor_parallel_layer(m)})
    if tp > 1 or tp_layers:
        yield (f"DeepSpeed AutoTP (tensor_parallel.autotp_size={tp}{', layers ' + ', '.join(tp_layers) if tp_layers else ''}"
               f"; OpenRLHF --ds.tensor_parallel_size, deepspeed.tp_model_init): each rank holds a slice of a weight "
               f"(some fused, split per sub-parameter), which Fair Cast would key as the full tensor at offset 0. Shard "
               f"with ZeRO-3 instead (--ds.zero_stage 3, tensor_parallel_size 1)")
    autoep = engine._config.expert_parallel_config
    ep = max([autoep.autoep_size if autoep is not None and autoep.enabled else 1] + _expert_parallel_sizes(engine.module))
    if ep > 1:
        yield (f"DeepSpeed-MoE expert parallelism (ep_size={ep}, MoE(ep_size=...) or expert_parallel.autoep_size): "
               f"experts on different ranks share local parameter names (deepspeed_experts.0 is another expert on each "
               f"rank), so their casts would share noise keys, and a rollout engine would not get them all. Use ep_size=1")


#: ZeRO++ options under which the forward does not read the copy Fair Cast writes and serves (DeepSpeed 0.19:
#: ``partitioned_param_coordinator.py`` gathers through an int8 quantizer, ``partition_parameters.py`` stores frozen
#: weights as int8), while ``GatheredParameters`` still hands the rollout engine the unquantized bf16 copy.
#: Not refused: ``zero_hpz_partition_size`` > 1 (its secondary partition is a bf16 copy of the gathered served copy,
#: dropped after every step) and ``zero_quantized_gradients`` (it quantizes gradients, not the weights or the
#: copy-back).
ZEROPP_WEIGHT_QUANTIZATION = {
    "zero_quantized_weights": "ZeRO-3 gathers the weights for every forward through an int8 quantizer",
    "zero_quantized_nontrainable_weights": "ZeRO-3 stores the frozen weights as int8 and gathers them dequantized",
}


def zeropp_refusals(zero) -> list:
    """Refusals of ZeRO++ weight quantization in ``zero`` (the engine's zero config, or the ``zero_optimization``
    section of a DeepSpeed JSON, as a dict)."""
    get = zero.get if isinstance(zero, dict) else lambda name, default=None: getattr(zero, name, default)
    return [f"ZeRO++ {name}=true (zero_optimization.{name}): {why}, so the loss would run on dequant(int8(served "
            f"copy)) while the rollout engine gets the bf16 served copy. Set zero_optimization.{name} to false"
            for name, why in ZEROPP_WEIGHT_QUANTIZATION.items() if get(name, False)]


def _is_tensor_parallel_layer(module) -> bool:
    from deepspeed.module_inject import layers

    return isinstance(module, (layers.TensorParallel_Layer, layers.TensorParallelConv2d))


def _expert_parallel_sizes(module) -> list:
    """The ep_size of every DeepSpeed-MoE layer (native ``deepspeed.moe.layer.MoE`` and AutoEP layers) in ``module``."""
    from deepspeed.moe.layer import MoE

    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:  # AutoEP is newer than some 0.19 releases
        AutoEPMoELayer = MoE
    return [int(getattr(m, "ep_size", 1)) for m in module.modules() if isinstance(m, (MoE, AutoEPMoELayer))]


def _named_trainable(engine, module: torch.nn.Module):
    names = {id(p): canonical_name(n) for n, p in module.named_parameters()}
    named = []
    for p in engine.module.parameters():
        if not p.requires_grad:
            continue
        if id(p) not in names:
            raise FairCastPatchError(
                "a trainable parameter of the DeepSpeed engine is not in the module given for naming; pass the model "
                "that holds every trainable parameter as module="
            )
        if p.dtype != torch.bfloat16:
            raise FairCastPatchError(f"parameter {names[id(p)]} is {p.dtype}; Fair Cast's DeepSpeed patch needs bf16 weights")
        named.append((names[id(p)], p))
    if not named:
        raise FairCastPatchError("the DeepSpeed engine has no trainable parameters")
    return named
