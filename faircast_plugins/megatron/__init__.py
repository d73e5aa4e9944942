"""Fair Cast for Megatron-core bf16 training (shared by verl's Megatron engine, slime and NeMo-RL).

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.megatron import apply_megatron_patch

    optimizer = get_megatron_optimizer(config, model_chunks)
    apply_megatron_patch(optimizer, FairCaster(FairCastConfig(enabled=True, seed=1234)), bridge=auto_bridge)

After every optimizer step the bf16 params (the copy the forward reads and that is sent to a rollout engine)
equal ``fair_cast(fp32 master)`` at the new weight version, bit for bit, with the distributed or the Float16
optimizer, under data, tensor, pipeline and expert parallelism. With ``bridge=`` (megatron-bridge) or
``converters=`` each element is keyed by the Hugging Face name and index it is exported as (``hf_map.py``);
without, by its Megatron-native name. See ``patch.py`` and ``docs/megatron.md``.
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
