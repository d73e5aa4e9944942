"""Fair Cast state of one verl FSDP training engine: activation, export casting, version, checkpoint, metrics."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, Optional, Set, Tuple

import torch

from ..audit import finalize
from ..cast import fair_cast
from ..caster import FairCaster
from ..config import FairCastConfig
from ..fsdp import apply_fsdp_cast_patches, register_fsdp_module
from ..key import canonical_name

logger = logging.getLogger("faircast_plugins")

ATTR = "_faircast"  # the EngineFairCast attached to an FSDPEngine
CHECKPOINT_FILE = "faircast_state_rank_{rank}.pt"


@dataclass
class EngineFairCast:
    """What Fair Cast keeps per engine: the caster and the exported-name -> canonical-name map of its params."""

    caster: FairCaster
    export_names: Dict[str, str]
    canonical: Set[str] = field(default_factory=set)
    peft: bool = False  # LoRA (unmerged): base weights and adapters are exported separately
    cumulative: Dict[str, float] = field(default_factory=lambda: {"dev_along": 0.0, "abs_update": 0.0})


def state_of(engine) -> Optional[EngineFairCast]:
    return getattr(engine, ATTR, None)


def _hf_model(module):
    return getattr(module, "_fsdp_wrapped_module", module)


def _export_names(module, registered: Dict[str, str]) -> Dict[str, str]:
    """Map the names ``get_per_tensor_param`` exports to canonical trainer names (the same rename verl applies)."""
    from verl.workers.engine.fsdp import transformer_impl

    converted = transformer_impl.convert_weight_keys({n: n for n in registered}, _hf_model(module))
    names = {exported: registered[original] for exported, original in converted.items()}
    # PEFT exports adapters without the adapter name (peft's get_peft_model_state_dict): q_proj.lora_A.weight
    # for the parameter q_proj.lora_A.default.weight. Both names key the same parameter.
    for exported, canonical in list(names.items()):
        for part in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B."):
            head, sep, tail = exported.partition(part)
            if sep and "." in tail:
                names.setdefault(head + part + tail.split(".", 1)[1], canonical)
    return names


def activate(engine, config: FairCastConfig) -> EngineFairCast:
    """Attach Fair Cast to a built verl ``FSDPEngine``: its FSDP bf16 cast and its export follow ``config``."""
    if getattr(engine, "_qat_enabled", False):
        raise ValueError("actor_rollout_ref.faircast with QAT is not supported: the QAT quantizer re-rounds the export")
    if getattr(engine, "_autocast_dtype", None) != torch.bfloat16:
        raise ValueError(
            f"actor_rollout_ref.faircast needs bf16 mixed precision in the actor (fsdp_config.mixed_precision."
            f"param_dtype=bf16), got {getattr(engine, '_autocast_dtype', None)}"
        )
    apply_fsdp_cast_patches()
    caster = FairCaster(config)
    registered = register_fsdp_module(engine.module, caster)
    peft = hasattr(_hf_model(engine.module), "peft_config")
    state = EngineFairCast(caster, _export_names(engine.module, registered), set(registered.values()), peft)
    setattr(engine, ATTR, state)
    return state


def cast_export(state: EngineFairCast, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The exported ``(name, full fp32 tensor)`` stream, with every registered parameter replaced by its served bf16.

    Unregistered tensors (frozen params, buffers) pass unchanged: the rollout rounds them to nearest, which is
    what FSDP's stock cast does for them. Raises if a registered parameter is missing from a dense export (with
    LoRA, the frozen base weights and the adapters travel in separate exports).
    """
    seen = set()
    for name, tensor in weights:
        canonical = state.export_names.get(name) or state.export_names.get(canonical_name(name))
        if canonical is None:
            yield name, tensor
            continue
        if tensor.dtype != torch.float32:
            raise TypeError(f"Fair Cast export: {name} arrives as {tensor.dtype}, expected the fp32 master")
        seen.add(canonical)
        yield name, _cast_unaudited(state.caster, canonical, tensor.detach().contiguous())
    missing = state.canonical - seen
    if missing and not state.peft:
        raise RuntimeError(
            f"Fair Cast export: {len(missing)} trained parameter(s) were not in verl's export "
            f"(e.g. {sorted(missing)[:3]}); the rollout would serve a copy Fair Cast did not make"
        )


def _cast_unaudited(caster: FairCaster, name: str, master: torch.Tensor) -> torch.Tensor:
    """``caster.cast`` without the audit observation: the audit samples FSDP's per-shard casts (every version,
    on every rank, all-reduced), and the export of the same version is the same bits. Only the stateless modes
    reach here (error feedback and EMA are refused for verl's FSDP engines)."""
    return fair_cast(master, key=caster.key(name), mode=caster.mode, backend=caster.config.backend)


# -- checkpoint ----------------------------------------------------------------------------------------------


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def save(state: EngineFairCast, local_path: str) -> str:
    """Write this rank's Fair Cast state (config with seed, version) next to verl's actor checkpoint."""
    path = os.path.join(local_path, CHECKPOINT_FILE.format(rank=_rank()))
    os.makedirs(local_path, exist_ok=True)
    sd = state.caster.state_dict()
    torch.save(sd, path)
    return path


def load(state: EngineFairCast, local_path: str) -> bool:
    """Restore the Fair Cast state saved by :func:`save`; False (with a loud warning) when the checkpoint has none."""
    path = os.path.join(local_path, CHECKPOINT_FILE.format(rank=_rank()))
    if not os.path.exists(path):
        logger.warning(
            "Fair Cast: the checkpoint at %s has no Fair Cast state (%s); the weight version restarts at %d. "
            "The served copies stay consistent between trainer and rollout, but do not repeat the original run's.",
            local_path, os.path.basename(path), state.caster.version,
        )
        return False
    state.caster.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
    logger.warning("Fair Cast: resumed at weight version %d from %s", state.caster.version, path)
    return True


# -- metrics -------------------------------------------------------------------------------------------------


def metrics(state: EngineFairCast, device=None) -> Dict[str, float]:
    """``faircast/*`` metrics since the last call, summed over every rank (collective when distributed)."""
    out = {"faircast/version": float(state.caster.version)}
    audit = state.caster.audit
    if audit is None:
        return out
    totals = audit.totals()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        totals = dict(zip(keys, t.cpu().tolist()))
    out.update(finalize(totals))
    c = state.cumulative  # the core's bias_rel_cumulative, over every rank's shards
    c["dev_along"] += totals.get("dev_along", 0.0)
    c["abs_update"] += totals.get("abs_update", 0.0)
    if c["abs_update"]:
        out["faircast/bias_rel_cumulative"] = abs(c["dev_along"]) / c["abs_update"]
    return out
