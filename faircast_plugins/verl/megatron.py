"""Fair Cast on verl's Megatron engine: attach the shared Megatron-core patch to the actor's optimizer.

verl 0.9.1's ``MegatronEngine`` (``workers/engine/megatron/transformer_impl.py``) builds the bf16 model chunks
(``engine.module``) and Megatron-core's optimizer (``engine.optimizer``, ``initialize`` l.609) and steps it in
``optimizer_step`` (l.700). The forward, the loss and the bridge export (``get_per_tensor_param``) all read the
bf16 params that the optimizer's main->model copy writes, so patching that copy (faircast_plugins/megatron) makes
both the loss and the served weights ``fair_cast(master)``; no export patch is needed. The engine's megatron-bridge
``AutoBridge`` (``engine.bridge``, the converters of that export) is passed on, so every element is keyed by the
Hugging Face name and index it is exported as (docs/ROUNDING.md §1) and ``faircast export`` from the HF checkpoint
of the master reproduces the served bits. Checkpoints: this rank's Fair Cast state is written next to verl's
(``save_checkpoint`` / ``load_checkpoint``, l.774 / l.801).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

from ..caster import FairCaster
from ..config import FairCastConfig
from ..megatron import MegatronFairCast, apply_megatron_patch
from ..patching import PatchSet

logger = logging.getLogger("faircast_plugins")

ATTR = "_faircast_megatron"  # the MegatronFairCast attached to a verl MegatronEngine
_ENGINE = "verl.workers.engine.megatron.transformer_impl:MegatronEngine"


def state_of(engine) -> Optional[MegatronFairCast]:
    return getattr(engine, ATTR, None)


def activate(engine, config: FairCastConfig) -> MegatronFairCast:
    """Attach Fair Cast to a built verl ``MegatronEngine`` (after ``initialize``): its optimizer's main->model copy
    follows ``config``. Raises ValueError / FairCastPatchError for what it cannot serve exactly."""
    if getattr(engine, "_qat_enabled", False):
        raise ValueError("actor_rollout_ref.faircast with QAT is not supported: the QAT export re-quantizes the served copy")
    if getattr(engine, "optimizer", None) is None:
        raise ValueError("actor_rollout_ref.faircast: the Megatron engine has no optimizer (forward_only?); "
                         "Fair Cast attaches to the actor's optimizer")
    if getattr(engine, "vanilla_bridge", False):
        raise ValueError("actor_rollout_ref.faircast with the vanilla mbridge (vanilla_mbridge=True) is not supported: "
                         "Fair Cast keys the served weights through megatron-bridge's converters; set vanilla_mbridge=False")
    PATCHES.apply(details="Fair Cast state saved and loaded with verl's Megatron checkpoints")
    bridge = getattr(engine, "bridge", None)  # None: an engine built without a bridge keeps Megatron-native keys
    fc = apply_megatron_patch(engine.optimizer, FairCaster(config), model_chunks=list(engine.module), bridge=bridge)
    setattr(engine, ATTR, fc)
    return fc


def _then(action):
    def factory(original):
        @functools.wraps(original)
        def wrapper(self, local_path, *args, **kwargs):
            result = original(self, local_path, *args, **kwargs)
            fc = state_of(self)
            if fc is not None:
                action(self, fc, local_path, kwargs)
            return result

        return wrapper

    return factory


def _save(engine, fc, local_path, kwargs):
    fc.save(local_path)


def _load(engine, fc, local_path, kwargs):
    scheduler = getattr(engine, "lr_scheduler", None)
    fc.load(local_path, step=getattr(scheduler, "num_steps", None))


PATCHES = (
    PatchSet("verl Megatron engine", "verl", ">=0.9.1,<0.10")
    .wrap(f"{_ENGINE}.save_checkpoint", _then(_save))
    .wrap(f"{_ENGINE}.load_checkpoint", _then(_load))
)
