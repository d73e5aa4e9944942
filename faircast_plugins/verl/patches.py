"""The verl patch set: activation in ``ActorRolloutRefWorker.init_model``, the FSDP engine's export, step and
checkpoint hooks, and the driver's ``Tracking.log`` (``actor/faircast/lag_cost``). Every hook is inert for engines
(and runs) Fair Cast was not activated on (reference, critic, flag off)."""
from __future__ import annotations

import contextvars
import functools
import logging
from typing import Optional

from ..lag_cost import VERSION_KEY, tracker_of
from ..patching import FairCastPatchError, PatchSet
from . import engine as fc_engine
from . import fp8 as fc_fp8
from . import megatron as verl_megatron
from . import policy as fc_policy
from .config import MEGATRON_STRATEGY, check_supported, delta_sync_advice, read_faircast, verl_option

logger = logging.getLogger("faircast_plugins")

#: verl releases whose patch points were read and verified (docs/verl.md).
VERL_SPECIFIER = ">=0.9.1,<0.10"

_WORKER = "verl.workers.engine_workers:ActorRolloutRefWorker"
_IMPL = "verl.workers.engine.fsdp.transformer_impl"
_ENGINE = f"{_IMPL}:FSDPEngine"
_DETACH = "verl.experimental.separation.engine_workers:DetachActorWorker"
_TRACKING = "verl.utils.tracking:Tracking"
#: where the driver logs the actor worker's metrics (``RayPPOTrainer._update_actor`` prefixes them), and its mean reward
ACTOR_PREFIX = "actor/"
REWARD_KEY = "critic/score/mean"

# The engine whose get_per_tensor_param is running ({"state": EngineFairCast, "cast": bool}): its export stream
# passes through unfuse_moe_params, where the full fp32 tensors still carry the trainer's names (before MoE
# experts are split). LoRA adapter exports skip that function; get_per_tensor_param casts them itself.
_EXPORTING: contextvars.ContextVar = contextvars.ContextVar("faircast_exporting", default=None)


#: What the patched ``init_model`` returns to the driver (verl's own returns None): proof that this worker loaded
#: Fair Cast, whether its config asked for it and whether it activated it.
STATUS_KEY = "faircast_status"


def _status(worker, requested: bool, active: bool) -> dict:
    return {STATUS_KEY: {"requested": requested, "active": active, "role": str(worker.role)}}


def _requested_by_group(worker_group) -> bool:
    """Whether the worker group's own init arguments set ``actor_rollout_ref.faircast`` (a plain worker group keeps
    them; a colocated one does not, and then only the workers' answers tell)."""
    init = getattr(worker_group, "ray_cls_with_init", None)
    config = (getattr(init, "kwargs", None) or {}).get("config")
    try:
        fc = read_faircast(config) if config is not None else None
    except ValueError:
        return True
    return fc is not None and fc.active


def check_workers_activated(worker_group, outputs):
    """The driver side of ``init_model`` (verl's collect step): every worker of a group whose config sets
    ``actor_rollout_ref.faircast`` must have loaded the Fair Cast plugin. verl imports plugins in every process but
    logs a failed import at DEBUG, and ``VERL_USE_EXTERNAL_PLUGINS`` can exclude it: such a worker would train and
    serve round-to-nearest silently, while the others cast."""
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    statuses = [o.get(STATUS_KEY) if isinstance(o, dict) else None for o in outputs]
    requested = any(s is not None and s["requested"] for s in statuses) or _requested_by_group(worker_group)
    missing = [i for i, s in enumerate(statuses) if s is None]
    if requested and missing:
        raise FairCastPatchError(
            f"actor_rollout_ref.faircast is set, but {len(missing)} of {len(outputs)} worker(s) (worker index "
            f"{missing[:8]}) did not load Fair Cast: they run verl's round-to-nearest export and FSDP cast. verl loads "
            f"the faircast_plugins 'verl.plugins' entry point in every process unless VERL_USE_EXTERNAL_PLUGINS "
            f"excludes it, and logs a failed import only at DEBUG: install faircast-plugins on every node (the same "
            f"version), set VERL_USE_EXTERNAL_PLUGINS=auto (or include 'faircast'), and check that "
            f"'import faircast_plugins.verl.plugin' works in the workers' environment."
        )
    return outputs


def _driver_checked(init_model):
    """Give the patched ``init_model`` verl's ONE_TO_ALL dispatch with :func:`check_workers_activated` as its collect
    step (the driver binds worker-group methods from its own, patched, class)."""
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, get_predefined_dispatch_fn

    attrs = getattr(init_model, MAGIC_ATTR, None)  # functools.wraps copied it from the original
    mode = attrs.get("dispatch_mode") if isinstance(attrs, dict) else None
    if isinstance(mode, dict) and mode.get("collect_fn") is check_workers_activated:
        raise FairCastPatchError("ActorRolloutRefWorker.init_model is already wrapped by Fair Cast (patched twice); "
                                 "apply the verl patches only through faircast_plugins.verl.patches.patch()")
    if not isinstance(attrs, dict) or attrs.get("dispatch_mode") != Dispatch.ONE_TO_ALL:
        raise FairCastPatchError(f"ActorRolloutRefWorker.init_model is not registered with Dispatch.ONE_TO_ALL "
                                 f"({attrs!r}): the driver-side activation check cannot be attached")
    dispatch = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)["dispatch_fn"]
    setattr(init_model, MAGIC_ATTR, {**attrs, "dispatch_mode": {"dispatch_fn": dispatch,
                                                                "collect_fn": check_workers_activated}})
    return init_model


def _wrap_init_model(original):
    @functools.wraps(original)
    def init_model(self, *args, **kwargs):
        config = read_faircast(self.config)
        wants = config is not None and config.active and "actor" in self.role
        if wants:
            check_supported(config, self.config)  # fail before the (slow) model build
        result = original(self, *args, **kwargs)
        requested = config is not None and config.active
        if not wants:
            if requested:
                logger.info("Fair Cast: role %r has no actor; nothing to cast in this worker", self.role)
            else:
                logger.warning("Fair Cast is OFF for this verl worker (role=%s): actor_rollout_ref.faircast is not "
                               "set; the rollout serves the round-to-nearest copy", self.role)
            return _status(self, requested, False) if result is None else result
        engine = self.actor.engine
        advice = delta_sync_advice(self.config)  # the mode under a delta weight sync, on either strategy
        if advice is not None:
            getattr(logger, advice[0])(advice[1])
        if self.config.actor.strategy == MEGATRON_STRATEGY:
            fc = verl_megatron.activate(engine, config,
                                        resume_without_state=verl_option(self.config, "resume_without_state"))
            logger.warning("Fair Cast ACTIVE on the verl actor (role=%s, strategy=megatron): %s; %d bf16 params cast "
                           "by Megatron-core's main->model copy (the loss and the export read them)",
                           self.role, config.describe(), len(fc.keys))
            return _status(self, True, True) if result is None else result
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        if not isinstance(engine, FSDPEngine):
            raise ValueError(f"actor_rollout_ref.faircast supports verl's FSDP engines, not {type(engine).__name__}")
        state = fc_engine.activate(engine, config)
        if fc_fp8.attach(state, self.config):
            logger.warning("Fair Cast: rollout.quantization=fp8: the audit measures the fp8 copy verl's engine "
                           "computes with (at each export, by verl's %s quantizer; docs/verl.md)",
                           fc_fp8.verl_fp8_path())
        if verl_option(self.config, "fp8_loss"):
            n = fc_fp8.enable_fp8_loss(engine.module)
            logger.warning("Fair Cast fp8_loss: %d linear layers of the actor compute with the dequantized fp8 copy "
                           "made by verl's %s quantizer (the one its rollout takes here, unless its environment "
                           "sets VERL_DISABLE_TRITON_FP8 differently; fp32 GEMMs, straight-through gradient); the "
                           "fp8 engine's own kernels were not verified", n, fc_fp8.verl_fp8_path())
        logger.warning(
            "Fair Cast ACTIVE on the verl actor (role=%s, strategy=%s): %s; %d parameters cast by Fair Cast in FSDP "
            "and in the export to the rollout; reference/critic models untouched",
            self.role, self.config.actor.strategy, config.describe(), len(state.canonical),
        )
        return _status(self, True, True) if result is None else result

    return _driver_checked(init_model)


def _wrap_update_actor(original):
    @functools.wraps(original)
    def update_actor(self, *args, **kwargs):
        engine = self.actor.engine if self.actor is not None else None
        state = fc_engine.state_of(engine) if engine is not None else None
        if state is not None and state.policy is not None:  # before the update: the served version's masters
            data = kwargs["data"] if "data" in kwargs else args[0]
            fc_policy.measure(engine, state.policy, state.caster.version, data)
        output = original(self, *args, **kwargs)
        megatron = verl_megatron.state_of(engine) if engine is not None else None
        if state is None and megatron is None:
            return output
        from verl.utils import tensordict_utils as tu
        from verl.utils.device import get_device_id

        if megatron is not None:
            extra = megatron.metrics()  # collective: every rank calls it
        else:
            device = get_device_id() if state.caster.audit is not None else None
            extra = fc_engine.metrics(state, device=device)  # collective: every rank calls it
            if state.policy is not None:
                extra.update(fc_policy.metrics(state.policy))  # collective after a measurement (every rank)
        if output is not None:
            merged = dict(tu.get(output, "metrics") or {})
            merged.update(extra)
            tu.assign_non_tensor(output, metrics=merged)
        return output

    return update_actor


def _wrap_tracking_log(original):
    """The driver's ``Tracking.log(metrics, step)``: with Fair Cast on the actor (``actor/faircast/version`` logged),
    add ``actor/faircast/lag_cost`` from the step's mean score and the audit's ``actor/faircast/lag_steps``."""

    @functools.wraps(original)
    def log(self, data, step, *args, **kwargs):
        if isinstance(data, dict) and ACTOR_PREFIX + VERSION_KEY in data:
            data = tracker_of(self).add_to(dict(data), step, REWARD_KEY, prefix=ACTOR_PREFIX)
        return original(self, data, step, *args, **kwargs)

    return log


def _then(action):
    """A wrapper factory for engine methods after which Fair Cast acts on its state: run the original, then
    ``action(state, *args, **kwargs)`` with the engine's Fair Cast state (nothing for engines without one)."""

    def factory(original):
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            state = fc_engine.state_of(self)
            if state is not None:
                action(state, *args, **kwargs)
            return result

        return wrapper

    return factory


def _after_optimizer_step(original):
    @functools.wraps(original)
    def optimizer_step(self, *args, **kwargs):
        grad_norm = original(self, *args, **kwargs)
        state = fc_engine.state_of(self)
        if state is not None and fc_engine.step_taken(grad_norm):
            fc_engine.advance(state)  # the next FSDP cast and the next export use the new weight version
        return grad_norm

    return optimizer_step


def _on_actor_engine(action):
    """A wrapper factory for ``DetachActorWorker`` methods (verl's decoupled PPO keeps fp32 masters aside, by key):
    run the original, then ``action(state, key)`` with the actor engine's Fair Cast state."""

    def factory(original):
        @functools.wraps(original)
        def wrapper(self, n, *args, **kwargs):
            result = original(self, n, *args, **kwargs)
            actor = getattr(self, "actor", None)
            state = fc_engine.state_of(actor.engine) if actor is not None else None
            if state is not None:
                action(state, n)
            return result

        return wrapper

    return factory


def _save(state, local_path, *args, **kwargs):
    fc_engine.save(state, local_path)


def _load(state, local_path, *args, **kwargs):
    fc_engine.load(state, local_path)


def _wrap_get_per_tensor_param(original):
    @functools.wraps(original)
    def get_per_tensor_param(self, *args, **kwargs):
        state = fc_engine.state_of(self)
        if state is None:
            return original(self, *args, **kwargs)
        hooked = {"state": state, "cast": False}
        token = _EXPORTING.set(hooked)
        try:
            weights, peft_config = original(self, *args, **kwargs)
        finally:
            _EXPORTING.reset(token)
        if not hooked["cast"]:
            # verl's LoRA adapter export (peft_config set, base already synced) skips unfuse_moe_params
            weights = fc_engine.cast_export(state, weights)
        return weights, peft_config

    return get_per_tensor_param


def _wrap_unfuse_moe_params(original):
    @functools.wraps(original)
    def unfuse_moe_params(weights, *args, **kwargs):
        hooked: Optional[dict] = _EXPORTING.get()
        if hooked is not None:
            hooked["cast"] = True
            weights = fc_engine.cast_export(hooked["state"], weights)
        return original(weights, *args, **kwargs)

    return unfuse_moe_params


def _wrap_get_per_tensor_param_shard(original):
    @functools.wraps(original)
    def get_per_tensor_param_shard(self, *args, **kwargs):
        weights, extra = original(self, *args, **kwargs)
        state = fc_engine.state_of(self)
        if state is None:
            return weights, extra
        from verl.utils.fsdp_utils import fsdp_version

        return fc_engine.cast_local_shards(state, weights, fsdp_version(self.module)), extra

    return get_per_tensor_param_shard


def _wrap_merged_lora_per_tensor_param(original):
    @functools.wraps(original)
    def _merged_lora_per_tensor_param(self, *args, **kwargs):
        state = fc_engine.state_of(self)
        if state is None:
            return original(self, *args, **kwargs)
        return fc_engine.merged_lora_export(self, state)

    return _merged_lora_per_tensor_param


def _wrap_offload(original):
    """verl's ``offload_fsdp_model_to_cpu`` as the FSDP engine calls it: a blocking copy for a module Fair Cast
    marked (FSDP2 with uneven shards, :func:`engine.mark_blocking_offload`), verl's own otherwise."""
    @functools.wraps(original)
    def offload_fsdp_model_to_cpu(model, empty_cache: bool = True):
        if not getattr(model, fc_engine.BLOCKING_OFFLOAD, False):
            return original(model, empty_cache)
        model.to("cpu")  # blocking: torch's re-padding host copy of the short shards then reads landed data
        if empty_cache:
            from verl.utils.device import get_torch_device

            get_torch_device().empty_cache()

    return offload_fsdp_model_to_cpu


def build_patch_set() -> PatchSet:
    """Every verl symbol Fair Cast wraps, checked together against the installed verl before any is touched."""
    patches = PatchSet("verl", "verl", VERL_SPECIFIER)
    patches.wrap(f"{_WORKER}.init_model", _wrap_init_model)
    patches.wrap(f"{_WORKER}.update_actor", _wrap_update_actor)
    patches.wrap(f"{_ENGINE}.optimizer_step", _after_optimizer_step)
    patches.wrap(f"{_ENGINE}.get_per_tensor_param", _wrap_get_per_tensor_param)
    patches.wrap(f"{_IMPL}:unfuse_moe_params", _wrap_unfuse_moe_params)
    patches.wrap(f"{_ENGINE}.get_per_tensor_param_shard", _wrap_get_per_tensor_param_shard)
    patches.wrap(f"{_IMPL}:offload_fsdp_model_to_cpu", _wrap_offload)  # uneven FSDP2 shards: a blocking offload
    patches.wrap(f"{_ENGINE}._merged_lora_per_tensor_param", _wrap_merged_lora_per_tensor_param)
    patches.wrap(f"{_ENGINE}.save_checkpoint", _then(_save))
    patches.wrap(f"{_ENGINE}.load_checkpoint", _then(_load))
    patches.wrap(f"{_TRACKING}.log", _wrap_tracking_log)  # the driver's metrics: faircast/lag_cost
    # decoupled PPO (fully-async and v1 separate-async trainers): old log-probs on restored old masters
    patches.wrap(f"{_DETACH}.save_model_to_cpu", _on_actor_engine(fc_engine.snapshot))
    patches.wrap(f"{_DETACH}.restore_model_from_cpu", _on_actor_engine(fc_engine.restore))
    patches.wrap(f"{_DETACH}.clear_cpu_model", _on_actor_engine(fc_engine.drop_snapshot))
    return patches


#: Every verl symbol Fair Cast wraps; nothing is touched until :func:`patch` applies it.
PATCHES = build_patch_set()


def patch() -> PatchSet:
    """Install the verl patches (idempotent). Raises FairCastPatchError naming the installed verl if it cannot."""
    return PATCHES.apply(details="inert until a worker's config sets actor_rollout_ref.faircast (enable per run)")


def unpatch() -> None:
    PATCHES.remove()


def guard_unsupported(reason: str) -> None:
    """When :func:`patch` cannot apply: make ``init_model`` refuse configs that ask for Fair Cast, with ``reason``."""
    from ..patching import resolve

    try:
        owner, attr, original = resolve(f"{_WORKER}.init_model")
    except FairCastPatchError:
        return  # nothing to guard; the ERROR line already said Fair Cast is unavailable

    @functools.wraps(original)
    def init_model(self, *args, **kwargs):
        config = read_faircast(self.config)
        if config is not None and config.active:
            raise FairCastPatchError(f"actor_rollout_ref.faircast is set but Fair Cast cannot run: {reason}")
        return original(self, *args, **kwargs)

    setattr(owner, attr, init_model)
