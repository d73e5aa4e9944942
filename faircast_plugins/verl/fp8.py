"""verl's ``rollout.quantization: fp8`` with Fair Cast: the audit on the fp8 copy, and the ``fp8_loss`` opt-in.

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

``faircast.fp8_loss`` (:func:`enable_fp8_loss`): the actor's quantized linear layers compute with the dequantized
fp8 copy of FSDP's full bf16 compute weight, in fp32, with a straight-through gradient.
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


# -- the loss on the fp8 copy (opt-in: faircast.fp8_loss) ----------------------------------------------------


class _StraightThroughFp8(torch.autograd.Function):
    """Forward: the dequantized fp8 copy of the (full, bf16) compute weight; backward: the gradient unchanged, in
    the weight's dtype (straight through to FSDP's gradient of the fp32 master)."""

    @staticmethod
    def forward(ctx, weight):
        ctx.dtype = weight.dtype
        return served_fp8(weight.detach())

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype)


def compute_weight(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight the actor's forward uses for linear layer ``name`` under ``fp8_loss`` (fp32 values
    ``fp8 * descale`` of verl's quantizer, from FSDP's full bf16 compute copy)."""
    return _StraightThroughFp8.apply(weight)


def _fp8_forward(module: torch.nn.Linear, name: str):
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = compute_weight(name, module.weight)  # full here: FSDP all-gathered it for this forward
        bias = module.bias.to(torch.float32) if module.bias is not None else None
        with torch.autocast(device_type=x.device.type, enabled=False):  # autocast would round the weight to bf16
            return torch.nn.functional.linear(x.to(torch.float32), weight, bias).to(x.dtype)

    return forward


def enable_fp8_loss(module: torch.nn.Module) -> int:
    """``faircast.fp8_loss``: every linear layer verl's fp8 engine quantizes computes, in the actor's forward (old
    log-probs and loss), with the dequantized fp8 copy of FSDP's bf16 compute weight, in fp32, gradient straight
    through. Returns how many layers it changed."""
    from ..key import canonical_name

    count = 0
    for prefix, sub in module.named_modules():
        weight = getattr(sub, "weight", None)
        name = canonical_name(f"{prefix}.weight")
        if isinstance(sub, torch.nn.Linear) and weight is not None and quantized_by_engine(name, weight):
            sub.forward = _fp8_forward(sub, name)
            count += 1
    return count
