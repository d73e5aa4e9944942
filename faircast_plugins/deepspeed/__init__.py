"""Fair Cast for DeepSpeed bf16 training (shared by the OpenRLHF adapter and TRL runs on DeepSpeed).

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)
    apply_deepspeed_patch(engine, FairCaster(FairCastConfig(enabled=True, seed=1234)))

After every optimizer step the engine's bf16 weights (the copy the forward uses and that a rollout engine
is sent) equal ``fair_cast(fp32 master)`` at the new weight version, bit for bit, for every ZeRO stage,
offload setting and world size. See ``patch.py`` for the covered copy-back sites and ``docs/openrlhf.md``.
"""
from .layout import WeightLayout
from .patch import (
    DEEPSPEED_SPECIFIER,
    DeepSpeedFairCast,
    apply_deepspeed_patch,
    install_deepspeed_patch,
    remove_deepspeed_patch,
)

__all__ = [
    "DEEPSPEED_SPECIFIER",
    "DeepSpeedFairCast",
    "WeightLayout",
    "apply_deepspeed_patch",
    "install_deepspeed_patch",
    "remove_deepspeed_patch",
]
