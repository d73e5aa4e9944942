"""Reading ``actor_rollout_ref.faircast`` from a verl worker config."""
from __future__ import annotations

from typing import Any, Optional

from ..config import FairCastConfig

#: Strategies whose bf16 compute copy Fair Cast can make follow the contract (see docs/verl.md for Megatron).
FSDP_STRATEGIES = ("fsdp", "fsdp2")


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain Python (resolving ``${faircast}`` interpolations); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def read_faircast(worker_config: Any) -> Optional[FairCastConfig]:
    """The Fair Cast config of an ``actor_rollout_ref`` node, or None when the key is absent.

    Accepts ``faircast: true|false`` or a mapping with ``enable``, ``mode``, ``seed``, ``ema_decay``, ``audit``
    (and ``audit_sample``, ``backend``). Raises ValueError naming the bad value otherwise.
    """
    getter = getattr(worker_config, "get", None)
    value = getter("faircast", None) if getter is not None else None
    if value is None:
        return None
    try:
        config = FairCastConfig.from_value(_plain(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"actor_rollout_ref.faircast: {exc}") from None
    return config


def check_supported(config: FairCastConfig, worker_config: Any) -> None:
    """Refuse, with the reason, the combinations verl's FSDP adapter cannot make bit-exact."""
    strategy = worker_config.actor.strategy
    if strategy not in FSDP_STRATEGIES:
        raise ValueError(
            f"actor_rollout_ref.faircast is set but actor.strategy={strategy!r}: Fair Cast for verl supports the FSDP "
            f"engines ({', '.join(FSDP_STRATEGIES)}) only. With Megatron the fp32 master lives in Megatron-core's "
            f"optimizer and the bf16 params are written by its main->model param copy, inside Megatron-core rather "
            f"than verl; that copy is not patched (see docs/verl.md)."
        )
    lora = worker_config.model.get("lora_rank", 0) or 0
    if lora and config.keeps_state and (worker_config.model.get("lora", {}) or {}).get("merge", False):
        raise ValueError(
            "actor_rollout_ref.faircast with model.lora.merge=true supports mode=stochastic or sticky (or nearest) "
            "without ema_decay: the merged weight W + s*B@A is not a parameter FSDP holds, so there is no per-shard "
            "error-feedback residual or EMA for it. Use mode=stochastic or sticky, or unmerged LoRA."
        )
    if lora and strategy != "fsdp2":
        raise ValueError(
            f"actor_rollout_ref.faircast with LoRA is supported with actor.strategy=fsdp2 only (got {strategy!r}): "
            f"with FSDP1, verl 0.9.1's adapter export came out empty in our checks, so the served adapters could "
            f"not be verified."
        )
    rollout_dtype = str(worker_config.rollout.get("dtype", "bfloat16"))
    if rollout_dtype not in ("bfloat16", "bf16"):
        raise ValueError(
            f"actor_rollout_ref.faircast needs a bf16 rollout, got rollout.dtype={rollout_dtype!r}: the served copy "
            f"Fair Cast defines is bf16."
        )
