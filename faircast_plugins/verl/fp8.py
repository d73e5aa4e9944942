"""verl's ``rollout.quantization: fp8`` with Fair Cast: the audit on the fp8 copy, and the ``fp8_loss`` opt-in.

With fp8, verl's vLLM engine quantizes every linear weight it receives (``quant_weights`` ->
``scaled_fp8_blockwise``, 128x128 blocks, e4m3): Fair Cast's export stays the served bf16 copy and verl's quantizer
runs after it, unchanged. So the ``faircast/*`` audit metrics (``lag_steps``, ``served_changed_frac``, ``bias``)
are computed on the dequantized fp8 copy (:func:`engine_fp8`: made by verl's own ``scaled_fp8_blockwise``, so by
whichever of its two quantizers, Triton or PyTorch, the rollout takes in this environment) instead of on the bf16
shards FSDP casts: with the flag off (``faircast: {enable: false, audit: true}``) they show what verl's fp8 path
costs.

That audit observes the full tensors of each export (``get_per_tensor_param``: every rank sees the same full
tensors, so the sums grow by the world size and every ratio stays the same), at the weight version of the
export; between two exports more than one version apart it restarts its window (no metrics for that interval),
so lag is reported when each ``update_actor`` takes one optimizer step (``ppo_mini_batch_size`` = the train batch).
Delta syncs (``get_per_tensor_param_shard``) are not observed.

``faircast.fp8_loss`` (:func:`enable_fp8_loss`): the actor's quantized linear layers compute with the dequantized
fp8 copy of FSDP's full bf16 compute weight, in fp32, with a straight-through gradient.
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from ..fp8 import BLOCK, dequantize_blockwise, quantized_by_engine
from .config import rollout_quantization

FP8_KERNEL = "verl.utils.kernel.fp8_kernel"


def verl_fp8_path() -> str:
    """``"triton"`` or ``"pytorch"``: the quantizer verl's ``scaled_fp8_blockwise`` takes in this process, by verl's
    own rule (Triton wherever triton imports, unless ``VERL_DISABLE_TRITON_FP8=1``). Their block descales differ
    in the last bit for many amax values (72.7% on an H200, docs/kernels.md; ``faircast_plugins.fp8.descale_triton``)."""
    kernel = importlib.import_module(FP8_KERNEL)
    try:
        triton, disabled = kernel._TRITON_AVAILABLE, kernel._DISABLE_TRITON_FP8
    except AttributeError as e:
        raise RuntimeError(f"{FP8_KERNEL} no longer has {e.name}: cannot tell which fp8 quantizer verl's rollout "
                           "takes. Use a verl release this package supports (docs/verl.md), or remove "
                           "faircast.fp8_loss and the audit under rollout.quantization=fp8") from None
    return "triton" if triton and not disabled else "pytorch"


def engine_fp8(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 weight verl's fp8 engine computes with for the bf16 ``weight`` (2-D, or 3-D per expert): verl's own
    ``scaled_fp8_blockwise`` (128x128 blocks), dequantized. Its Triton path runs on the GPU, as in the rollout."""
    if weight.dim() == 3:
        return torch.stack([engine_fp8(e) for e in weight])
    x = weight.detach().to(torch.bfloat16)
    if verl_fp8_path() == "triton" and x.device.type != "cuda" and torch.cuda.is_available():
        x = x.cuda()
    q, descale = importlib.import_module(FP8_KERNEL).scaled_fp8_blockwise(x, [BLOCK, BLOCK])
    return dequantize_blockwise(q, descale.reshape(descale.shape[0], descale.shape[1])).to(weight.device)


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
    engine_copy = engine_fp8(served) if quantized_by_engine(name, served) else served
    audit.observe(name, state.caster.version, master, engine_copy)


def metrics_source(state):
    """What :func:`faircast_plugins.audit.reduce_metrics` reads (a caster's ``version`` and ``audit``)."""
    audit = getattr(state, "fp8_audit", None)
    return state.caster if audit is None else SimpleNamespace(version=state.caster.version, audit=audit)


# -- the loss on the fp8 copy (opt-in: faircast.fp8_loss) ----------------------------------------------------


def compute_weight(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight the actor's forward uses for linear layer ``name`` under ``fp8_loss`` (fp32 values
    ``fp8 * descale`` of verl's quantizer, from FSDP's full bf16 compute copy; no autograd history)."""
    return engine_fp8(weight)


class _Fp8Linear(torch.autograd.Function):
    """``linear(x, dequantized fp8 copy of weight, bias)`` in fp32, gradient straight through to ``weight``.

    It saves the input and the weight itself (the parameter FSDP re-gathers for the backward, as for any linear),
    never the fp32 dequantized copy: that would stay alive, unsharded, from each layer's forward to its backward
    (4 B/param). The backward dequantizes the weight again (one more quantization per weight and step)."""

    @staticmethod
    def forward(ctx, x, weight, bias, name):
        w32 = compute_weight(name, weight)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        b32 = bias.detach().to(torch.float32) if bias is not None else None
        return torch.nn.functional.linear(x.detach().to(torch.float32), w32, b32).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g32 = grad.to(torch.float32)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g32.matmul(engine_fp8(weight)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = g32.reshape(-1, g32.shape[-1]).t().matmul(
                x.detach().reshape(-1, x.shape[-1]).to(torch.float32)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g32.reshape(-1, g32.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


def _fp8_forward(module: torch.nn.Linear, name: str):
    def forward(x: torch.Tensor) -> torch.Tensor:
        # module.weight is full here: FSDP all-gathered it for this forward (and re-gathers it for the backward)
        with torch.autocast(device_type=x.device.type, enabled=False):  # autocast would round the weight to bf16
            return _Fp8Linear.apply(x, module.weight, module.bias, name)

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
