"""Fair Cast state of one verl FSDP training engine: activation, export casting, version, checkpoint, metrics."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple

import torch

from ..audit import reduce_metrics
from ..cast import fair_cast
from ..caster import FairCaster
from ..config import FairCastConfig
from ..export import save_state
from ..fsdp import (apply_fsdp_cast_patches, assemble_served, register_fsdp_module, registered_shards, shard_groups,
                    shard_layout, stage_for_cast, uneven_shards)
from ..key import canonical_name
from . import fp8 as fc_fp8
from .policy import VerlPolicyProbe

logger = logging.getLogger("faircast_plugins")

ATTR = "_faircast"  # the EngineFairCast attached to an FSDPEngine
CHECKPOINT_FILE = "faircast_state_rank_{rank}.pt"


@dataclass
class EngineFairCast:
    """What Fair Cast keeps per engine: the caster and the exported-name -> canonical-name map of its params."""

    caster: FairCaster
    export_names: Dict[str, str]
    module: Any = None  # the engine's FSDP module (its registered shards hold the per-element state)
    canonical: Set[str] = field(default_factory=set)
    peft: bool = False  # LoRA (unmerged): base weights and adapters are exported separately
    # decoupled PPO (verl's DetachActorWorker): the caster state kept with each set of masters verl sets aside
    snapshots: Dict[Any, dict] = field(default_factory=dict)
    newest: int = 0  # the newest weight version this engine reached (the audit follows that one only)
    audit: Any = None  # the caster's audit, detached while an older version's masters are restored
    fp8_audit: Any = None  # rollout.quantization=fp8: the audit, observing the export's fp8 copy (verl/fp8.py)
    policy: Any = None  # policy_metrics_every: the faircast/policy_* probe (verl/policy.py)

    @property
    def stateful(self) -> bool:
        """Error feedback or EMA: the served copy depends on per-element state kept for this rank's shards only."""
        return self.caster.keeps_state


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
    policy = VerlPolicyProbe.of(config)
    caster.policy_measured = policy is not None  # measured in update_actor (verl/policy.py)
    registered = register_fsdp_module(engine.module, caster)
    peft = hasattr(_hf_model(engine.module), "peft_config")
    state = EngineFairCast(caster, _export_names(engine.module, registered), engine.module, set(registered.values()),
                           peft, audit=caster.audit, policy=policy)
    if needs_blocking_offload(engine):
        mark_blocking_offload(engine.module)
        logger.warning("Fair Cast: FSDP2 param_offload with uneven shards (%s, ...): verl's offload of this actor is a "
                       "blocking copy (a non_blocking one can leave the re-padded short shards stale; docs/verl.md)",
                       uneven_shards(engine.module)[0])
    setattr(engine, ATTR, state)
    return state


#: set on a module whose offload must be a blocking copy (:func:`mark_blocking_offload`)
BLOCKING_OFFLOAD = "_faircast_blocking_offload"


def mark_blocking_offload(module) -> None:
    """verl offloads FSDP2 parameters with ``module.to("cpu", non_blocking=True)``; inside that call torch re-pads
    each uneven shard with a host copy of the pinned destination, before the device-to-host copy has landed (issue
    29, finding 8), so the masters of the short ranks could come back stale, and Fair Cast would export them.
    Marked modules are offloaded with a blocking copy instead (``patches._wrap_offload``)."""
    setattr(module, BLOCKING_OFFLOAD, True)


def needs_blocking_offload(engine) -> bool:
    """FSDP2 with ``param_offload`` and an uneven shard anywhere (the same answer on every rank)."""
    from verl.utils.fsdp_utils import fsdp_version

    return bool(getattr(engine, "_is_offload_param", False)) and fsdp_version(engine.module) == 2 \
        and bool(uneven_shards(engine.module))


def canonical_of(state: EngineFairCast, exported_name: str) -> Optional[str]:
    """The canonical name of a registered parameter from the name verl exports it under (None if not registered)."""
    return state.export_names.get(exported_name) or state.export_names.get(canonical_name(exported_name))


def cast_export(state: EngineFairCast, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The exported ``(name, full fp32 tensor)`` stream, with every registered parameter replaced by its served bf16.

    Stateless modes cast the full tensor (the same bits as FSDP's per-shard casts). Stateful modes (error
    feedback, EMA) assemble it from every rank's served shard (:func:`served_full`, a collective: verl's export
    already runs on every rank in the same order, for ``full_tensor()``). Unregistered tensors (frozen params,
    buffers) pass unchanged: the rollout rounds them to nearest, which is what FSDP's stock cast does for them.
    Raises if a registered parameter is missing from a dense export (with LoRA, the frozen base weights and the
    adapters travel in separate exports).
    """
    seen = set()
    shards = groups = None
    for name, tensor in weights:
        canonical = canonical_of(state, name)
        if canonical is None:
            yield name, tensor
            continue
        if tensor.dtype != torch.float32:
            raise TypeError(f"Fair Cast export: {name} arrives as {tensor.dtype}, expected the fp32 master")
        if not seen:  # before the first host read of this export
            shards = registered_shards(state.module) if state.stateful else {}
            groups = shard_groups(state.module) if state.stateful else {}
            wait_for_offload_copies([tensor] + [master for _, master in shards.values()])
        seen.add(canonical)
        if state.stateful:
            shards = registered_shards(state.module) if shards is None else shards
            q = served_full(state, canonical, tensor.shape, tensor.device, shards, groups)
        else:
            q = _cast_unaudited(state.caster, canonical, tensor.detach().contiguous())
        fc_fp8.observe_export(state, canonical, tensor, q)
        yield name, q
    missing = state.canonical - seen
    if missing and not state.peft:
        raise RuntimeError(
            f"Fair Cast export: {len(missing)} trained parameter(s) were not in verl's export "
            f"(e.g. {sorted(missing)[:3]}); the rollout would serve a copy Fair Cast did not make"
        )


def wait_for_offload_copies(tensors) -> None:
    """Let the in-flight offload copies land before Fair Cast reads host tensors among ``tensors``.

    verl's ``param_offload`` moves the parameters to pinned host memory with ``non_blocking`` copies on the current
    CUDA stream (``fsdp_utils.offload_fsdp_model_to_cpu`` / ``offload_fsdp2_model_to_cpu``, whose comment says a host
    reader must synchronize first); the CPU cast would otherwise read stale or half-copied masters. One wait on that
    stream per export; nothing without CUDA, or when every tensor is on the GPU (then the casts are stream-ordered).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    if any(t.device.type == "cpu" for t in tensors):
        torch.cuda.current_stream().synchronize()


def _cast_unaudited(caster: FairCaster, name: str, master: torch.Tensor) -> torch.Tensor:
    """``caster.cast`` of a full tensor without the audit observation: the audit samples FSDP's per-shard casts
    (every version, on every rank, all-reduced), and the export of the same version is the same bits. Stateless
    modes only (stateful ones go through :func:`served_full`)."""
    return fair_cast(master, key=caster.key(name), mode=caster.mode, backend=caster.config.backend)


def served_full(state: EngineFairCast, name: str, shape, device, shards=None, groups=None) -> torch.Tensor:
    """The full served bf16 copy of registered parameter ``name`` (collective over the group it is sharded over;
    see :func:`fsdp.assemble_served`)."""
    shards = registered_shards(state.module) if shards is None else shards
    groups = shard_groups(state.module) if groups is None else groups
    return assemble_served(state.caster, name, shards.get(name), shape, device, groups.get(name))


def step_taken(grad_norm) -> bool:
    """Whether ``FSDPEngine.optimizer_step`` stepped: verl skips the update (and returns the norm) when the
    gradient norm is not finite, and the weight version counts steps taken (ROUNDING.md)."""
    try:
        return math.isfinite(float(grad_norm))
    except (TypeError, ValueError):
        return True  # not a norm: nothing says the step was skipped


def advance(state: EngineFairCast) -> None:
    """After an optimizer step: the next FSDP cast and the next export use the new weight version (EMA: this
    rank's shards move towards the updated masters, elementwise, so the shards together are the full EMA)."""
    ema = state.caster.ema_on
    state.caster.advance(
        [(name, master) for name, (_, master) in registered_shards(state.module).items()] if ema else None
    )


def cast_local_shards(state: EngineFairCast, weights, fsdp_version: int):
    """verl's ``(name, local bf16 shard, ShardSpec)`` stream (``get_per_tensor_param_shard``, the delta_sharded
    engine's source) with each registered parameter's shard replaced by the same elements of the served copy.

    FSDP2: the exported DTensor shard *is* the shard FSDP casts, so it is cast in place (no collective). FSDP1
    exports ``Shard(0)`` chunks that do not follow its flat-parameter shards: the served copy is assembled
    (:func:`served_full`, collective on every rank in verl's identical order) and this rank's block taken from it.
    """
    from verl.workers.engine.spec import derive_dtensor_placement, translate_flat_indices

    shards, groups = registered_shards(state.module), shard_groups(state.module)
    wait_for_offload_copies([master for _, master in shards.values()])
    for name, local, spec in weights:
        canonical = canonical_of(state, name)
        if canonical is None:
            yield name, local, spec
            continue
        place = spec.place if spec.place is not None else derive_dtensor_placement(spec)[0]
        n = local.numel()
        if fsdp_version == 2:
            offset = place if isinstance(place, int) else place.flat_offset
            if n == 0:
                yield name, local, spec
                continue
            got = shards.get(canonical)
            if got is None or got[0] != offset or got[1].numel() != n or not (
                    isinstance(place, int) or place.is_flat_contiguous):
                raise RuntimeError(f"Fair Cast delta export: the shard of {name} verl exports does not match the "
                                   f"shard FSDP casts (offset {offset}, {n} elements)")
            master = stage_for_cast(got[1], local.device, state.caster.state_device(canonical))
            q = state.caster.cast(canonical, master, offset=offset)
        else:
            full = served_full(state, canonical, spec.full_shape, local.device, shards, groups).reshape(-1)
            if isinstance(place, int):
                q = full[place: place + n]
            else:
                q = full[translate_flat_indices(torch.arange(n, device=local.device), place)]
        yield name, q.reshape(-1).to(local.device), spec


def merged_lora_export(engine, state: EngineFairCast) -> Iterator[Tuple[str, torch.Tensor]]:
    """verl's merged-LoRA export (``model.lora.merge=true``) with Fair Cast: each LoRA-target weight is merged
    in fp32 (W + s*B@A, by verl's ``merged_lora_context``) and cast with the key of its canonical base-weight
    name at the current version; every other tensor is exported as verl exports it (round-to-nearest)."""
    from verl.utils.fsdp_utils import merged_lora_context, normalize_peft_param_name
    from verl.workers.engine.fsdp import transformer_impl as impl

    hf = _hf_model(engine.module)
    merged = _lora_target_weights(hf)
    device = impl.get_device_id()
    seen = set()
    try:
        with merged_lora_context(engine.module, backup_adapters=True):
            params = normalize_peft_param_name(engine.module.state_dict())
            renamed = impl.convert_weight_keys({n: n for n in params}, hf)  # exported name -> verl's name
            params = impl.convert_weight_keys(params, hf)
            for name, param in params.items():
                full = param.to(device, non_blocking=True).full_tensor() if hasattr(param, "full_tensor") else param
                canonical = canonical_name(renamed.get(name, name))
                if canonical in merged:
                    if full.dtype != torch.float32:
                        raise TypeError(f"Fair Cast merged-LoRA export: {name} is {full.dtype}, expected fp32")
                    seen.add(canonical)
                    yield name, fair_cast(full.detach().contiguous(), key=state.caster.key(canonical),
                                          mode=state.caster.mode, backend=state.caster.config.backend)
                elif hasattr(param, "full_tensor"):
                    yield name, full.to(torch.bfloat16)  # what verl sends for a DTensor: round-to-nearest
                else:
                    yield name, param.detach().clone()
    finally:
        if engine._is_offload_param:
            impl.offload_fsdp_model_to_cpu(engine.module)
    if merged - seen:
        raise RuntimeError(f"Fair Cast merged-LoRA export: LoRA-target weights missing from verl's export: "
                           f"{sorted(merged - seen)[:3]}")


def _lora_target_weights(peft_model) -> Set[str]:
    """Canonical names of the base weights LoRA adapters are merged into."""
    from peft.tuners.lora import LoraLayer

    return {canonical_name(f"{prefix}.base_layer.weight") for prefix, m in peft_model.named_modules()
            if isinstance(m, LoraLayer) and len(m.lora_A) and hasattr(m, "base_layer")}


# -- decoupled PPO: the masters verl sets aside --------------------------------------------------------------


def _cpu_copy(obj: Any) -> Any:
    """A copy on the CPU (``.cpu()`` alone would alias CPU tensors, which later casts update in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    return obj


def snapshot(state: EngineFairCast, key) -> None:
    """With verl's ``save_model_to_cpu(key)``: keep the caster's state (version, error-feedback residuals and
    cached copy, EMA) with the fp32 masters verl copies to the CPU, so restoring them restores the copy they served."""
    state.newest = max(state.newest, state.caster.version)
    state.snapshots[key] = _cpu_copy(state.caster.state_dict())


def restore(state: EngineFairCast, key) -> None:
    """With verl's ``restore_model_from_cpu(key)``: the caster goes back to the state kept with those masters, so
    FSDP computes (old log-probs) with the bits served at their version. The audit follows the newest version
    only: it is detached while older masters are restored. State tensors move back to the masters' device at
    their first cast."""
    saved = state.snapshots.get(key)
    if saved is None:
        return  # verl restores nothing either
    state.newest = max(state.newest, state.caster.version)
    state.caster.load_state_dict(saved)
    state.caster.audit = state.audit if state.caster.version >= state.newest else None


def drop_snapshot(state: EngineFairCast, key) -> None:
    """With verl's ``clear_cpu_model(key)``."""
    state.snapshots.pop(key, None)


# -- checkpoint ----------------------------------------------------------------------------------------------


def _world() -> Tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def save(state: EngineFairCast, local_path: str) -> str:
    """Write this rank's Fair Cast state (config with seed, version, its shards' residuals / EMA on the CPU) next to
    verl's actor checkpoint, with the shard layout (``export.save_state``): resume checks it, and ``faircast export
    --state 'faircast_state_rank_*.pt'`` merges the ranks' files."""
    rank, world = _world()
    sharding = {"rank": rank, "world_size": world, "shards": shard_layout(state.module)}
    return str(save_state(state.caster, local_path, filename=CHECKPOINT_FILE.format(rank=rank),
                          extra={"fsdp": sharding}))


def load(state: EngineFairCast, local_path: str) -> bool:
    """Restore the Fair Cast state saved by :func:`save`; False (with a loud warning) when the checkpoint has none."""
    rank, world = _world()
    path = os.path.join(local_path, CHECKPOINT_FILE.format(rank=rank))
    if not os.path.exists(path):
        logger.warning(
            "Fair Cast: the checkpoint at %s has no Fair Cast state (%s); the weight version restarts at %d. "
            "The served copies stay consistent between trainer and rollout, but do not repeat the original run's.",
            local_path, os.path.basename(path), state.caster.version,
        )
        return False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    saved_world = (saved.get("fsdp") or {}).get("world_size", world)
    if state.stateful and saved_world != world:
        raise ValueError(
            f"Fair Cast: {path} holds this rank's error-feedback residuals / EMA for a world size of {saved_world}, "
            f"this run has {world}: that state is per FSDP shard. Resume at world size {saved_world}, or use "
            f"mode=stochastic without ema_decay."
        )
    state.caster.load_state_dict(saved)  # tensors stay on the CPU until their first cast moves them to the masters
    logger.warning("Fair Cast: resumed at weight version %d from %s", state.caster.version, path)
    return True


# -- metrics -------------------------------------------------------------------------------------------------


def metrics(state: EngineFairCast, device=None) -> Dict[str, float]:
    """``faircast/*`` metrics since the last call, summed over every rank (collective when distributed)."""
    return reduce_metrics(fc_fp8.metrics_source(state), device=device)
