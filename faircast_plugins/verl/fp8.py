"""verl's ``rollout.quantization: fp8`` with Fair Cast: the audit measures what the fp8 engine computes with.

With fp8, verl's vLLM engine quantizes every linear weight it receives (``quant_weights`` ->
``scaled_fp8_blockwise``, 128x128 blocks, e4m3): Fair Cast's export stays the served bf16 copy and verl's quantizer
runs after it, unchanged. So the ``faircast/*`` audit metrics (``lag_steps``, ``served_changed_frac``, ``bias``)
are computed on the dequantized fp8 copy (:func:`faircast_plugins.fp8.served_fp8`, bit-identical to verl's
PyTorch quantizer) instead of on the bf16 shards FSDP casts: with the flag off (``faircast: {enable: false,
audit: true}``) they show what verl's fp8 path costs.

That audit observes the full tensors of each export (``get_per_tensor_param``: every rank sees the same full
tensors, so the sums grow by the world size and every ratio stays the same), at the weight version of the
export; between two exports more than one version apart it restarts its window (no metrics for that interval),
so lag is reported when each ``update_actor`` takes one optimizer step (``ppo_mini_batch_size`` = the train batch).
Delta syncs (``get_per_tensor_param_shard``) are not observed.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..fp8 import quantized_by_engine, served_fp8
from .config import rollout_quantization

def attach(state, worker_config) -> bool:
    """With ``rollout.quantization: fp8`` and the audit on: move the audit from FSDP's shard casts to the export's
    fp8 copy. Returns whether it did."""
    if rollout_quantization(worker_config) != "fp8" or state.caster.audit is None:
        return False
    state.fp8_audit, state.caster.audit, state.audit = state.caster.audit, None, None
    return True


def observe_export(state, name: str, master: torch.Tensor, served: torch.Tensor) -> None:
    """Audit one exported parameter on what the fp8 engine computes with (a no-op without the fp8 audit)."""
    audit = getattr(state, "fp8_audit", None)
    if audit is None:
        return
    engine_copy = served_fp8(served) if quantized_by_engine(name, served) else served
    audit.observe(name, state.caster.version, master, engine_copy)


def metrics_source(state):
    """What :func:`faircast_plugins.audit.reduce_metrics` reads (a caster's ``version`` and ``audit``)."""
    audit = getattr(state, "fp8_audit", None)
    return state.caster if audit is None else SimpleNamespace(version=state.caster.version, audit=audit)
