"""Fair Cast inside OpenRLHF's policy actor: attach the DeepSpeed patch, report ``faircast/*`` metrics (and, in the
trainer actor that logs them, ``faircast/lag_cost``).

``PolicyModelActor`` is a Ray actor class, and Ray ships it to the worker processes *by value*: patching
the importable class on the driver does not reach the workers. What does reach them is the class stored
in ``PolicyModelActor.__ray_metadata__.modified_class``, and functions stored in it travel *by reference*
(``faircast_plugins.openrlhf.policy.<name>``), so every worker imports this module and runs the code
below. :func:`patch_policy_actor` installs them on the driver before the actors are created; this works
the same on a multi-node cluster as long as ``faircast-plugins`` is installed on every node.

Only the policy's DeepSpeed engine gets Fair Cast: the critic, reference, reward and EMA engines are
other objects and stay on DeepSpeed's own copy-back.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Optional

from ..caster import FairCaster
from ..config import FairCastConfig
from ..lag_cost import VERSION_KEY, tracker_of
from ..patching import FairCastPatchError, PatchSet
from . import policy_probe

logger = logging.getLogger("faircast_plugins")

OPENRLHF_SPECIFIER = ">=0.11.2,<0.12"
_ACTOR = "openrlhf.trainer.ray.ppo_actor:PolicyModelActor"
#: the Ray trainer actors (sync and async) whose ``save_logs_and_checkpoints`` logs each step's status
_TRAINERS = ("openrlhf.trainer.ppo_trainer:PPOTrainer", "openrlhf.trainer.ppo_trainer_async:TrainingActor")
#: the step's mean reward over every rollout sample, as the trainer logs it
REWARD_KEY = "rollout/reward_mean"


def config_from_args(args) -> FairCastConfig:
    """The Fair Cast config carried by OpenRLHF's (hierarchized) args as ``args.faircast``."""
    ns = getattr(args, "faircast", None)
    if ns is None:
        return FairCastConfig(enabled=False)
    values = vars(ns) if isinstance(ns, SimpleNamespace) else dict(ns)
    return FairCastConfig.from_value({k: v for k, v in values.items() if v is not None})


# (dotted OpenRLHF option, its default, why Fair Cast refuses any other value)
REFUSED_OPTIONS = (
    ("ds.lora.rank", 0,
     "Fair Cast with LoRA (--ds.lora.rank > 0) is not supported: the trained adapters are not the served weights"),
    ("ds.tensor_parallel_size", 1,
     "Fair Cast with DeepSpeed AutoTP (--ds.tensor_parallel_size > 1) is not supported: each rank trains a slice of "
     "a weight, which the DeepSpeed copy-back patch cannot key by its place in the full weight; shard the policy "
     "with --ds.zero_stage 3 instead"),
)


def refused_option(get, config: Optional[FairCastConfig] = None) -> Optional[str]:
    """Why Fair Cast refuses this run's OpenRLHF options (None if it does not); ``get(dotted, default)`` reads one."""
    for dotted, default, message in REFUSED_OPTIONS:
        value = get(dotted, default)
        if value is not None and value != default:
            return message
    if config is not None and config.measures_policy:
        return policy_probe.refusal(get)
    return None


def _option(args, dotted: str, default):
    for part in dotted.split("."):
        args = getattr(args, part, None)
        if args is None:
            return default
    return args


def check_supported(args) -> FairCastConfig:
    """The run's Fair Cast config; raises for OpenRLHF options Fair Cast refuses."""
    config = config_from_args(args)
    refusal = refused_option(lambda dotted, default: _option(args, dotted, default), config) if config.active else None
    if refusal:
        raise FairCastPatchError(refusal)
    return config


def attach_to_policy(policy_actor, args) -> None:
    """Give the policy actor's DeepSpeed engine (``policy_actor.actor.model``) Fair Cast per ``args.faircast``, and
    its ``faircast/policy_*`` probe with ``--faircast.policy_metrics_every``."""
    from ..deepspeed import apply_deepspeed_patch

    config = check_supported(args)
    if not config.active:
        return
    engine = policy_actor.actor.model
    caster = FairCaster(config)
    if config.measures_policy:
        policy_probe.attach(policy_actor.actor, config)
        caster.policy_measured = True  # the copy-back patch then accepts the option
    apply_deepspeed_patch(engine, caster)


def policy_metrics(engine) -> dict:
    """``faircast/*`` metrics of the policy engine since the last call, summed over all ranks, and the
    ``faircast/policy_*`` ones of every rank's measured sequences (collectives: every rank calls it)."""
    from ..audit import reduce_metrics

    fc = engine.__dict__.get("_faircast")
    out = reduce_metrics(fc.caster) if fc is not None else {}
    out.update(policy_probe.take_metrics(engine))
    return out


# -- what runs inside the Ray actor (stored by reference in the shipped class) ---------------------------------
def _original(method: str):
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    return getattr(PolicyModelActor.__ray_actor_class__, method)  # the worker's own, unpatched class


def init_model_from_pretrained(self, strategy, *args, **kwargs):
    """OpenRLHF's policy init, then Fair Cast on the policy engine (restoring its checkpointed state)."""
    from ..deepspeed import install_deepspeed_patch

    if check_supported(strategy.args).active:  # refuse before minutes of model loading, not after
        install_deepspeed_patch()  # before the init, so a checkpoint load records where Fair Cast state lives
    result = _original("init_model_from_pretrained")(self, strategy, *args, **kwargs)
    attach_to_policy(self, strategy.args)
    if config_from_args(strategy.args).measures_policy:
        policy_probe.install(self)  # measures inside the actor's ActorPPOTrainer.training_step
    return result


def fit(self, *args, **kwargs):
    """OpenRLHF's policy ``fit``, its status extended with the ``faircast/*`` metrics."""
    status = _original("fit")(self, *args, **kwargs)
    status.update(policy_metrics(self.actor.model))
    return status


def save_logs_and_checkpoints(self, global_step, logs_dict=None, *args, **kwargs):
    """The trainer's logging step, with ``faircast/lag_cost`` (mean reward x the policy's ``faircast/lag_steps``)
    added to the logged status when Fair Cast reports from the policy."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    if logs_dict and VERSION_KEY in logs_dict:
        tracker_of(self).add_to(logs_dict, global_step, REWARD_KEY)
    return BasePPOTrainer.save_logs_and_checkpoints(self, global_step, logs_dict, *args, **kwargs)


_SHIPPED = ".__ray_metadata__.modified_class."
POLICY_PATCHES = (
    PatchSet("OpenRLHF", "openrlhf", OPENRLHF_SPECIFIER)
    .wrap(_ACTOR + _SHIPPED + "init_model_from_pretrained", lambda _orig: init_model_from_pretrained)
    .wrap(_ACTOR + _SHIPPED + "fit", lambda _orig: fit)
)
for _trainer in _TRAINERS:
    POLICY_PATCHES.wrap(_trainer + _SHIPPED + "save_logs_and_checkpoints", lambda _orig: save_logs_and_checkpoints)


def patch_policy_actor() -> PatchSet:
    """On the driver, before the actors are created: route the policy actor's init and fit through Fair Cast, and
    the trainer actor's logging through :func:`save_logs_and_checkpoints`.

    Idempotent; ``POLICY_PATCHES.remove()`` undoes it.
    """
    return POLICY_PATCHES.apply(details="policy actor attaches the DeepSpeed copy-back patch in every Ray worker")
