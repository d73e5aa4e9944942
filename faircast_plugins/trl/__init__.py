"""Fair Cast for TRL 1.16: ``faircast: true`` in GRPO, RLOO, Online DPO and AsyncGRPO configs.

    import faircast_plugins.trl            # patches TRL on import (same as faircast_plugins.trl.patch())
    from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(..., faircast=True)  # faircast_mode / faircast_seed / faircast_ema_decay / faircast_audit

From the command line: ``faircast-trl grpo --config cfg.yaml`` (the ``trl`` arguments, ``faircast: true`` in the
YAML), or plain ``trl`` after the opt-in ``faircast-trl hook install``. See docs/trl.md.

Modules: ``config`` (the ``faircast*`` fields on TRL's configs), ``callback`` (the lifecycle every backend shares:
checkpoint record, resume rules, metrics), ``backends`` (one class per backend: shadow masters in one process or
DDP, DeepSpeed, FSDP2), ``patches`` (the PatchSet: trainers, continuous-batching generation, vLLM export,
save/resume, logs), ``cli`` and ``launch`` (``faircast-trl``).
"""
from __future__ import annotations

from .callback import FairCastCallback
from .config import FairCastArguments, faircast_config, patch_configs, unpatch_configs
from .patches import PATCHES, SUPPORTED
from .refusals import FairCastUnsupportedError


def patch() -> None:
    """Add the ``faircast*`` fields to TRL's configs and install the trainer/export patches. Idempotent.

    Refuses (``FairCastPatchError``) a TRL outside ``SUPPORTED`` or one whose patch points are missing, before
    changing anything.
    """
    if PATCHES.active:
        return
    PATCHES.check()
    patch_configs()
    PATCHES.apply(details="faircast fields on GRPOConfig, RLOOConfig, OnlineDPOConfig, AsyncGRPOConfig")


def unpatch() -> None:
    """Undo :func:`patch` (mainly for tests)."""
    PATCHES.remove()
    unpatch_configs()


patch()

__all__ = [
    "FairCastArguments",
    "FairCastCallback",
    "FairCastUnsupportedError",
    "SUPPORTED",
    "faircast_config",
    "patch",
    "unpatch",
]
