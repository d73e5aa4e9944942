"""Fair Cast on verl's Megatron engine: attach the shared Megatron-core patch to the actor's optimizer.

verl 0.9.1's ``MegatronEngine`` (``workers/engine/megatron/transformer_impl.py``) builds the bf16 model chunks
(``engine.module``) and Megatron-core's optimizer (``engine.optimizer``, ``initialize`` l.609) and steps it in
``optimizer_step`` (l.700). The forward, the loss and the bridge export (``get_per_tensor_param``) all read the
bf16 params that the optimizer's main->model copy writes, so patching that copy (faircast_plugins/megatron) makes
both the loss and the served weights ``fair_cast(master)``; no export patch is needed. The engine's megatron-bridge
``AutoBridge`` (``engine.bridge``, the converters of that export) is passed on, so every element is keyed by the
Hugging Face name and index it is exported as (docs/ROUNDING.md §1) and ``faircast export`` from the HF checkpoint
of the master reproduces the served bits. Checkpoints: this rank's Fair Cast state is written into verl's checkpoint
directory *before* verl's ``save_checkpoint`` (l.774) runs, because that call finalises the checkpoint (its manifest,
the HDFS upload, the retention of old checkpoints: ``MegatronCheckpointManager._finalize_save``); it is read before
verl's ``load_checkpoint`` (l.801). A resume from a checkpoint without it is refused (the weight version would restart
at 0 and reuse earlier noise; verl does not restore the step count by default), unless
``actor_rollout_ref.faircast.resume_without_state=true``. When verl offloads the optimizer (``actor.megatron.
optimizer_offload``: ``MegatronEngine.to("cpu", optimizer=True)`` around the rollout), Fair Cast's per-element state
(error-feedback residual and served copy, 6 B per element of the DP shard; EMA, 4 B) goes to pinned host memory
with it, and comes back at the next cast. With ``actor_rollout_ref.faircast.policy_metrics_every=N`` (Fair Cast on or
off), every N optimizer steps the engine's ``train_batch`` first scores the first ``policy_metrics_seqs`` sequences of
the batch it is about to train on under the served bf16 params and the fp32 masters (:mod:`faircast_plugins.megatron.
policy`), and the worker's ``update_actor`` adds ``faircast/policy_*`` to the metrics it returns (with the other
``faircast/*`` ones).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

from ..caster import FairCaster
from ..config import FairCastConfig
from ..megatron import MegatronFairCast, apply_megatron_patch
from ..patching import FairCastPatchError, PatchSet

logger = logging.getLogger("faircast_plugins")

ATTR = "_faircast_megatron"  # the MegatronFairCast attached to a verl MegatronEngine
FRESH_ATTR = "_faircast_resume_without_state"  # actor_rollout_ref.faircast.resume_without_state
_ENGINE = "verl.workers.engine.megatron.transformer_impl:MegatronEngine"


def state_of(engine) -> Optional[MegatronFairCast]:
    return getattr(engine, ATTR, None)


def activate(engine, config: FairCastConfig, *, resume_without_state: bool = False) -> MegatronFairCast:
    """Attach Fair Cast to a built verl ``MegatronEngine`` (after ``initialize``): its optimizer's main->model copy
    follows ``config``. Raises ValueError / FairCastPatchError for what it cannot serve exactly.
    ``resume_without_state``: accept a ``load_checkpoint`` of a checkpoint without Fair Cast state."""
    if getattr(engine, "_qat_enabled", False):
        raise ValueError("actor_rollout_ref.faircast with QAT is not supported: the QAT export re-quantizes the served copy")
    if getattr(engine, "optimizer", None) is None:
        raise ValueError("actor_rollout_ref.faircast: the Megatron engine has no optimizer (forward_only?); "
                         "Fair Cast attaches to the actor's optimizer")
    if getattr(engine, "vanilla_bridge", False):
        raise ValueError("actor_rollout_ref.faircast with the vanilla mbridge (vanilla_mbridge=True) is not supported: "
                         "Fair Cast keys the served weights through megatron-bridge's converters; set vanilla_mbridge=False")
    if config.measures_policy:
        from megatron.core import parallel_state as ps

        stages = ps.get_pipeline_model_parallel_world_size()
        if stages > 1:  # the probe runs at PP > 1 in a Megatron-core loop; through verl's engine it has not been run
            raise ValueError(f"actor_rollout_ref.faircast.policy_metrics_every={config.policy_metrics_every} on verl's "
                             f"Megatron engine with pipeline_model_parallel_size={stages} is not measured (the probe's "
                             f"pipelined forward is tested in megatron-core's own loop only, apply_megatron_patch(..., "
                             f"measure_policy=True)): use pipeline_model_parallel_size=1 for the metric, or remove "
                             f"policy_metrics_every (faircast audit's faircast/lag_steps measures the lag in weight space)")
    if _overlaps_param_gather(engine):
        raise ValueError("actor_rollout_ref.faircast on verl's Megatron engine does not support overlap_param_gather "
                         "(actor.megatron.override_ddp_config): Megatron all-gathers the updated params in the next "
                         "forward, but verl exports them right after the step, so the rollout would get the other "
                         "data-parallel ranks' params of the previous version. Remove overlap_param_gather")
    PATCHES.apply(details="Fair Cast state saved and loaded with verl's Megatron checkpoints")
    bridge = getattr(engine, "bridge", None)  # None: an engine built without a bridge keeps Megatron-native keys
    fc = apply_megatron_patch(engine.optimizer, FairCaster(config), model_chunks=list(engine.module), bridge=bridge,
                              measure_policy=True)
    setattr(engine, ATTR, fc)
    setattr(engine, FRESH_ATTR, bool(resume_without_state))
    return fc


def _overlaps_param_gather(engine) -> bool:
    chunks = list(getattr(engine, "module", None) or [])
    if any(getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False) for c in chunks):
        return True
    optimizer = getattr(engine, "optimizer", None)
    subs = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    return any(getattr(getattr(o, "config", None), "overlap_param_gather", False) for o in subs if o is not None)


def _first(action):
    """Run ``action`` before the engine's checkpoint method (verl finalises a save inside it)."""
    def factory(original):
        @functools.wraps(original)
        def wrapper(self, local_path, *args, **kwargs):
            fc = state_of(self)
            if fc is not None:
                action(self, fc, local_path)
            return original(self, local_path, *args, **kwargs)

        return wrapper

    return factory


def _save(engine, fc, local_path):
    os.makedirs(local_path, exist_ok=True)  # what verl's local_mkdir_safe does next
    fc.save(local_path)


def _load(engine, fc, local_path):
    path = fc.state_path(local_path)
    if not os.path.exists(path):
        if not getattr(engine, FRESH_ATTR, False):
            raise FairCastPatchError(
                f"resuming verl's Megatron actor from {local_path} with Fair Cast ({fc.caster.config.describe()}): the "
                f"checkpoint holds no Fair Cast state ({os.path.basename(path)}; written without Fair Cast, at another "
                f"world size, or by a version that wrote it after verl had finalised and uploaded the checkpoint). "
                f"Resuming would restart the weight version at 0 and reuse its noise (and lose error-feedback residuals "
                f"or the EMA). Resume from a checkpoint saved with Fair Cast on, or accept a fresh start with "
                f"actor_rollout_ref.faircast.resume_without_state=true and a faircast.seed no earlier run used")
        logger.warning("Fair Cast: %s holds no Fair Cast state; resume_without_state=true: weight version %d, "
                       "residuals/EMA empty (use a seed no earlier run of this model used)", local_path, fc.caster.version)
        return
    fc.load(local_path)


def policy_inputs(data, seqs: int):
    """``(input_ids, position_ids, token_mask, temperature)`` of the first ``seqs`` sequences of a verl training
    batch, right-padded to one length: verl's no-padding layout (nested ``input_ids`` / ``position_ids``), with the
    counted tokens from a nested ``loss_mask`` aligned with ``input_ids`` (SFT), else from ``response_mask`` (PPO:
    the response is the last ``attention_mask``-valid response positions of each unpadded sequence)."""
    import torch
    from verl.utils import tensordict_utils as tu

    ids_all, pos_all = data["input_ids"], data["position_ids"]
    if not getattr(ids_all, "is_nested", False):
        raise ValueError("faircast policy_metrics_every on verl's Megatron engine reads its no-padding batches (nested "
                         "input_ids, use_remove_padding's layout); this batch is padded")
    ids = list(ids_all.unbind())[:seqs]
    pos = list(pos_all.unbind())[:seqs]
    if any(p.dim() != 1 for p in pos):
        raise ValueError("faircast policy_metrics_every on verl's Megatron engine: multi-dimensional position ids "
                         "(mrope, vision-language models) are not supported; remove policy_metrics_every")
    loss_mask = data.get("loss_mask", None) if hasattr(data, "get") else None
    masks = []
    if loss_mask is not None and getattr(loss_mask, "is_nested", False):
        masks = list(loss_mask.unbind())[:seqs]
    else:
        response = data["response_mask"]
        attention = data.get("attention_mask", None)
        width = response.shape[1]
        for i, seq in enumerate(ids):
            n = int(attention[i, -width:].sum()) if attention is not None else int(
                response[i].nonzero().max()) + 1 if response[i].any() else 0
            m = torch.zeros(seq.shape[0], dtype=torch.long, device=seq.device)
            if n:
                m[-n:] = response[i, :n].to(m.device).long()
            masks.append(m)
    length = max(int(t.shape[0]) for t in ids)
    out_ids = torch.zeros(len(ids), length, dtype=ids[0].dtype, device=ids[0].device)
    out_pos = torch.arange(length, device=ids[0].device).repeat(len(ids), 1)
    out_mask = torch.zeros(len(ids), length, dtype=torch.long, device=ids[0].device)
    for i, (t, p_, m) in enumerate(zip(ids, pos, masks)):
        out_ids[i, : t.shape[0]], out_pos[i, : t.shape[0]], out_mask[i, : t.shape[0]] = t, p_, m.long()
    temperature = float(tu.get_non_tensor_data(data=data, key="temperature", default=1.0) or 1.0)
    return out_ids, out_pos, out_mask, temperature


def _wrap_train_batch(original):
    @functools.wraps(original)
    def train_batch(self, data, *args, **kwargs):
        fc = state_of(self)
        probe = fc.policy if fc is not None else None
        if probe is not None and probe.due(fc.caster.version):  # before the update: served and masters one version
            ids, pos, mask, temperature = policy_inputs(data, probe.probe.seqs)
            device = next(probe.model.parameters()).device
            probe.measure(fc.caster.version, ids.to(device), pos.to(device), mask.to(device), temperature=temperature)
        return original(self, data, *args, **kwargs)

    return train_batch


def _wrap_to(original):
    @functools.wraps(original)
    def to(self, device, model: bool = True, optimizer: bool = True, grad: bool = True, *args, **kwargs):
        result = original(self, device, model, optimizer, grad, *args, **kwargs)
        fc = state_of(self)
        if fc is not None and optimizer and str(device) == "cpu":
            moved = fc.offload_state()
            if moved:
                logger.info("Fair Cast: %.1f MB of error-feedback/EMA state to host memory with verl's optimizer",
                            moved / 2**20)
        return result

    return to


PATCHES = (
    PatchSet("verl Megatron engine", "verl", ">=0.9.1,<0.10")
    .wrap(f"{_ENGINE}.to", _wrap_to)
    .wrap(f"{_ENGINE}.train_batch", _wrap_train_batch)
    .wrap(f"{_ENGINE}.save_checkpoint", _first(_save))
    .wrap(f"{_ENGINE}.load_checkpoint", _first(_load))
)
