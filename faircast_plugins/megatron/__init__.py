"""Fair Cast for Megatron-core bf16 training (shared by verl's Megatron engine, slime and NeMo-RL).

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.megatron import apply_megatron_patch

    optimizer = get_megatron_optimizer(config, model_chunks)
    apply_megatron_patch(optimizer, FairCaster(FairCastConfig(enabled=True, seed=1234)))

After every optimizer step the bf16 params (the copy the forward reads and that is sent to a rollout engine)
equal ``fair_cast(fp32 master)`` at the new weight version, bit for bit, with the distributed or the Float16
optimizer, under data, tensor, pipeline and expert parallelism. See ``patch.py`` and ``docs/megatron.md``.
"""
from .layout import ParamKey, param_keys
from .patch import (
    MEGATRON_SPECIFIER,
    MegatronFairCast,
    apply_megatron_patch,
    install_megatron_patch,
    remove_megatron_patch,
)

__all__ = [
    "MEGATRON_SPECIFIER",
    "MegatronFairCast",
    "ParamKey",
    "apply_megatron_patch",
    "install_megatron_patch",
    "param_keys",
    "remove_megatron_patch",
]
