"""Reading ``actor_rollout_ref.faircast`` from a verl worker config."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..config import FairCastConfig, parse_bool
from ..delta_sync import costly_mode_warning, rates as delta_rates

#: Strategies whose bf16 compute copy Fair Cast can make follow the contract.
FSDP_STRATEGIES = ("fsdp", "fsdp2")
#: Megatron-core's main->model param copy (faircast_plugins/megatron, docs/megatron.md).
MEGATRON_STRATEGY = "megatron"


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain Python (resolving ``${faircast}`` interpolations); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


#: Options of the ``faircast`` mapping that only the verl adapter reads (the rest is :class:`FairCastConfig`).
#: ``allow_merged_lora``: accept ``model.lora.merge=true``, whose loss cannot run on the served merged weight.
#: ``fp8_loss``: with ``rollout.quantization: fp8``, the actor's forward runs its quantized linear layers on the
#: dequantized fp8 copy (fp32 GEMMs, straight-through gradient; ``verl/fp8.py::enable_fp8_loss``).
#: ``resume_without_state``: (Megatron engine) resume from a checkpoint that holds no Fair Cast state (written without
#: Fair Cast): the weight version restarts at 0 and residuals / EMA start empty, so use a ``seed`` no earlier run of
#: this model used. Without it such a resume is refused (verl/megatron.py).
VERL_OPTIONS = ("allow_merged_lora", "fp8_loss", "resume_without_state")

FP8_LOSS_NEEDS_FP8 = (
    "actor_rollout_ref.faircast.fp8_loss: true (the actor's forward on the dequantized fp8 copy) needs "
    "actor_rollout_ref.rollout.quantization=fp8: without it the engine serves the bf16 copy, and the forward "
    "would compute with weights the engine never sees. Set rollout.quantization=fp8, or remove fp8_loss."
)


def _value(worker_config: Any) -> Any:
    getter = getattr(worker_config, "get", None)
    return _plain(getter("faircast", None)) if getter is not None else None


DELTA_BACKENDS = ("delta_sharded",)


def delta_sync(worker_config: Any) -> Optional[str]:
    """The sparse (delta) weight-sync backend the rollout uses (``rollout.checkpoint_engine.backend``), or None."""
    rollout = getattr(worker_config, "rollout", None)
    engine = rollout.get("checkpoint_engine", None) if rollout is not None else None
    backend = engine.get("backend", None) if engine is not None else None
    return str(backend) if backend in DELTA_BACKENDS else None


def _mode_given(value: Any) -> bool:
    return isinstance(value, dict) and value.get("mode") is not None


def read_faircast(worker_config: Any) -> Optional[FairCastConfig]:
    """The Fair Cast config of an ``actor_rollout_ref`` node, or None when the key is absent.

    Accepts ``faircast: true|false`` or a mapping with ``enable``, ``mode``, ``seed``, ``ema_decay``, ``audit``
    (and ``audit_sample``, ``backend``, and the verl options :data:`VERL_OPTIONS`). Raises ValueError naming the
    bad value otherwise. With a delta weight sync and no ``mode`` given, the mode is ``sticky``
    (:func:`delta_sync_advice` says why).
    """
    value = _value(worker_config)
    if value is None:
        return None
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in VERL_OPTIONS}
    sparse = "sticky" if delta_sync(worker_config) and not _mode_given(value) else None
    try:
        config = FairCastConfig.from_value(value, mode=sparse)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"actor_rollout_ref.faircast: {exc}") from None
    return config


def delta_sync_advice(worker_config: Any) -> Optional[Tuple[str, str]]:
    """``(log level, message)`` about the mode under a delta weight sync, or None when there is nothing to say:
    ``sticky`` chosen because no mode was given (info), or a mode set explicitly that sends several times more
    elements per sync than ``sticky`` (warning, with the measured ratio)."""
    backend = delta_sync(worker_config)
    config = read_faircast(worker_config)
    if backend is None or config is None or not config.enabled:
        return None
    where = f"rollout.checkpoint_engine.backend={backend}"
    if not _mode_given(_value(worker_config)):
        return "info", (f"Fair Cast: mode=sticky (no faircast.mode given): {where} sends only the served elements that "
                        f"change per weight version (measured per version, benchmarks/verl_delta.py: "
                        f"{delta_rates()}); sticky changes about as few elements as round-to-nearest, unbiased. "
                        f"Set faircast.mode to choose another mode")
    warning = costly_mode_warning(config.mode, where, "faircast.mode=sticky (docs/verl.md, Limits)")
    return ("warning", warning) if warning else None


def verl_option(worker_config: Any, name: str) -> bool:
    """A boolean verl-only option of the ``faircast`` mapping (false when absent or ``faircast`` is not a mapping)."""
    value = _value(worker_config)
    if not isinstance(value, dict) or name not in value:
        return False
    return parse_bool(value[name], f"actor_rollout_ref.faircast.{name}")


#: ``rollout.quantization`` values Fair Cast accepts: verl's fp8 quantizer then quantizes the served bf16 copy
#: (``quant_weights`` -> ``scaled_fp8_blockwise`` in the vLLM engine), unchanged (docs/verl.md, "fp8 rollouts").
SUPPORTED_QUANTIZATION = ("fp8",)


def rollout_quantization(worker_config: Any) -> Optional[str]:
    """``actor_rollout_ref.rollout.quantization`` (None when unset)."""
    rollout = getattr(worker_config, "rollout", None)
    value = rollout.get("quantization", None) if rollout is not None else None
    return str(value) if value else None


def _get(node: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        getter = getattr(node, "get", None)
        node = getter(key, None) if getter is not None else None
        if node is None:
            return default
    return node


def check_policy_metrics(config: FairCastConfig, worker_config: Any, strategy: str, lora: int,
                         quantization: Any) -> None:
    """``policy_metrics_every`` on verl's FSDP engines: refuse what its probe (the HF model's own forward on padded
    sequences, under the FSDP views of fsdp_policy) would not measure as the rollout serves it."""
    what = f"actor_rollout_ref.faircast.policy_metrics_every={config.policy_metrics_every}"
    ulysses = max(int(_get(worker_config, "actor", "ulysses_sequence_parallel_size", default=1) or 1),
                  int(_get(worker_config, "actor", "fsdp_config", "ulysses_sequence_parallel_size", default=1) or 1))
    if ulysses > 1:
        raise ValueError(f"{what} with ulysses_sequence_parallel_size={ulysses} is not supported: the probe scores "
                         f"whole sequences on each rank. Use ulysses_sequence_parallel_size=1, or remove it.")
    if _get(worker_config, "model", "use_fused_kernels", default=False):
        raise ValueError(f"{what} with model.use_fused_kernels=true is not supported: verl's fused forward returns "
                         f"log-probs, and the probe needs the logits. Set use_fused_kernels=false, or remove it.")
    if lora:
        raise ValueError(f"{what} with LoRA (model.lora_rank={lora}) is not supported: not verified (the served "
                         f"adapters and the frozen base). Remove it, or train without LoRA.")
    if quantization:
        raise ValueError(f"{what} with rollout.quantization={quantization} is not supported: the rollout serves the "
                         f"quantized copy, and the probe scores the bf16 one. Remove it.")


def check_supported(config: FairCastConfig, worker_config: Any) -> None:
    """Refuse, with the reason, the combinations verl's FSDP adapter cannot make bit-exact."""
    strategy = worker_config.actor.strategy
    if strategy == MEGATRON_STRATEGY:  # policy_metrics_every: measured by verl/megatron.py (its refusals there)
        check_megatron(config, worker_config)
        return
    if verl_option(worker_config, "resume_without_state"):
        raise ValueError("actor_rollout_ref.faircast.resume_without_state applies to actor.strategy=megatron only")
    if strategy not in FSDP_STRATEGIES:
        raise ValueError(
            f"actor_rollout_ref.faircast is set but actor.strategy={strategy!r}: Fair Cast for verl supports the FSDP "
            f"engines ({', '.join(FSDP_STRATEGIES)}) and {MEGATRON_STRATEGY!r}."
        )
    lora = worker_config.model.get("lora_rank", 0) or 0
    merged = bool(lora and (worker_config.model.get("lora", {}) or {}).get("merge", False))
    if merged and config.keeps_state:
        raise ValueError(
            "actor_rollout_ref.faircast with model.lora.merge=true supports mode=stochastic or sticky (or nearest) "
            "without ema_decay: the merged weight W + s*B@A is not a parameter FSDP holds, so there is no per-shard "
            "error-feedback residual or EMA for it. Use mode=stochastic or sticky, or unmerged LoRA."
        )
    if merged and config.enabled and not verl_option(worker_config, "allow_merged_lora"):
        raise ValueError(
            "actor_rollout_ref.faircast with model.lora.merge=true: the rollout would serve fair_cast(W + s*B@A), but "
            "the actor computes its log-probs and loss with round-to-nearest of the frozen base plus the adapters, "
            "not with that served weight (docs/verl.md, Limits). Use unmerged LoRA (model.lora.merge=false), where "
            "both sides use the same bits, or accept the gap explicitly with "
            "actor_rollout_ref.faircast.allow_merged_lora=true."
        )
    if lora and strategy != "fsdp2":
        raise ValueError(
            f"actor_rollout_ref.faircast with LoRA is supported with actor.strategy=fsdp2 only (got {strategy!r}): "
            f"with FSDP1, verl 0.9.1's adapter export came out empty in our checks, so the served adapters could "
            f"not be verified."
        )
    if config.measures_policy:
        check_policy_metrics(config, worker_config, strategy, lora, quantization=rollout_quantization(worker_config))
    quantization = rollout_quantization(worker_config)
    if verl_option(worker_config, "fp8_loss") and quantization != "fp8":
        raise ValueError(FP8_LOSS_NEEDS_FP8)
    if verl_option(worker_config, "fp8_loss") and lora:
        raise ValueError(
            "actor_rollout_ref.faircast.fp8_loss with LoRA is not supported: the fp8 forward replaces whole linear "
            "layers, and how verl's fp8 engine serves LoRA base weights and adapters was not checked. Use fp8_loss "
            "without LoRA, or LoRA without fp8_loss."
        )
    if quantization and quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"actor_rollout_ref.faircast is set but rollout.quantization={quantization!r}: that quantizer re-rounds "
            f"the bf16 copy Fair Cast serves in a way not checked here. Supported with Fair Cast: "
            f"{', '.join(SUPPORTED_QUANTIZATION)} (verl's blockwise e4m3 quantizer runs after Fair Cast's bf16 stage, "
            f"docs/verl.md), or no rollout.quantization (serve bf16), or turn Fair Cast off."
        )
    if quantization and worker_config.rollout.get("quantization_config_file", None):
        raise ValueError(
            f"actor_rollout_ref.faircast with rollout.quantization={quantization!r} and a quantization_config_file: "
            f"the file can change verl's fp8 block size and scheme, which the audit's fp8 copy and the tests assume "
            f"to be verl's default (128x128 blocks, e4m3). Remove rollout.quantization_config_file."
        )
    rollout_dtype = str(worker_config.rollout.get("dtype", "bfloat16"))
    if rollout_dtype not in ("bfloat16", "bf16"):
        raise ValueError(
            f"actor_rollout_ref.faircast needs a bf16 rollout, got rollout.dtype={rollout_dtype!r}: the served copy "
            f"Fair Cast defines is bf16."
        )


def check_megatron(config: FairCastConfig, worker_config: Any) -> None:
    """Refuse what Fair Cast cannot make bit-exact on verl's Megatron engine, before the model is built (the
    optimizer's own options are checked again when Fair Cast attaches: faircast_plugins/megatron/patch.py)."""
    megatron = worker_config.actor.get("megatron", {}) or {}
    dtype = str(megatron.get("dtype", "bfloat16"))
    if dtype not in ("bfloat16", "bf16"):
        raise ValueError(
            f"actor_rollout_ref.faircast with actor.strategy=megatron needs actor.megatron.dtype=bfloat16, got {dtype!r}: "
            f"verl's fp16 path uses Megatron's precision-aware optimizer, whose main->model copy runs inside "
            f"TransformerEngine's FusedAdam, outside the copy Fair Cast patches."
        )
    for option, why in (
        ("use_megatron_fsdp", "Megatron-FSDP copies the masters with its own buffer code, not patched"),
        ("vanilla_mbridge", "the vanilla mbridge export path was not read; use megatron-bridge (vanilla_mbridge=false)"),
    ):
        if megatron.get(option, False):
            raise ValueError(f"actor_rollout_ref.faircast with actor.strategy=megatron does not support "
                             f"actor.megatron.{option}=true: {why}.")
    ddp = megatron.get("override_ddp_config", {}) or {}
    if ddp.get("overlap_param_gather", False):
        raise ValueError(
            "actor_rollout_ref.faircast with actor.strategy=megatron does not support "
            "actor.megatron.override_ddp_config.overlap_param_gather=true: Megatron then all-gathers the updated params "
            "in the next forward, but verl exports them right after the step, so the rollout would get the other "
            "data-parallel ranks' params of the previous version. Remove overlap_param_gather (slime and NeMo-RL sync "
            "the params before they leave; verl does not).")
    optim = worker_config.actor.get("optim", {}) or {}
    override = optim.get("override_optimizer_config", {}) or {}
    for option, why in (
        ("use_precision_aware_optimizer", "the main->model copy runs inside TransformerEngine's FusedAdam, outside the "
                                          "copy Fair Cast patches; set it to false"),
        ("optimizer_cpu_offload", "the hybrid CPU optimizer updates and copies back the masters itself, not tested with "
                                  "Fair Cast; keep the optimizer on the GPU (actor.megatron.optimizer_offload=true, "
                                  "which offloads between steps, is fine)"),
        ("use_layer_wise_distributed_optimizer", "the layer-wise (Muon) optimizer keeps and copies the params "
                                                 "elsewhere; use Adam with the distributed optimizer"),
        ("fp8_param_gather", "the params are gathered quantized; gather bf16 params"),
    ):
        if optim.get(option, False) or override.get(option, False):
            raise ValueError(f"actor_rollout_ref.faircast with actor.strategy=megatron does not support "
                             f"actor.optim.{option} (or override_optimizer_config.{option}): {why}.")
    model_overrides = megatron.get("override_transformer_config", {}) or {}
    for option, why in (
        ("fp8", "the forward reads quantized weights, not the bf16 copy Fair Cast writes"),
        ("fp4", "the forward reads quantized weights, not the bf16 copy Fair Cast writes"),
        ("quant_recipe", "per-layer quantization recipes quantize the weights the forward reads"),
        ("use_kitchen", "Kitchen quantized layers read quantized weights"),
        ("moe_single_grouped_weight", "one grouped weight for all local experts is not keyed per expert; set it false"),
        ("moe_single_grouped_bias", "one grouped bias for all local experts is not keyed per expert; set it false"),
        ("layernorm_zero_centered_gamma", "the export adds 1 to the norm weight in bf16, a second rounding"),
    ):
        if model_overrides.get(option, None):
            raise ValueError(f"actor_rollout_ref.faircast with actor.strategy=megatron does not support "
                             f"actor.megatron.override_transformer_config.{option}: {why}.")
    if (megatron.get("qat", {}) or {}).get("enable", False):
        raise ValueError("actor_rollout_ref.faircast with actor.strategy=megatron does not support QAT "
                         "(actor.megatron.qat.enable): the QAT export re-quantizes the served copy.")
    if worker_config.model.get("lora_rank", 0) or (worker_config.model.get("lora", {}) or {}).get("rank", 0):
        raise ValueError("actor_rollout_ref.faircast with actor.strategy=megatron does not support LoRA yet: the "
                         "adapter export through megatron-bridge was not checked. Use full fine-tuning, or FSDP2.")
    if rollout_quantization(worker_config):
        raise ValueError("actor_rollout_ref.faircast with actor.strategy=megatron serves bf16 only: remove "
                         "rollout.quantization (its fp8 export on Megatron was not checked).")
    rollout_dtype = str(worker_config.rollout.get("dtype", "bfloat16"))
    if rollout_dtype not in ("bfloat16", "bf16"):
        raise ValueError(f"actor_rollout_ref.faircast needs a bf16 rollout, got rollout.dtype={rollout_dtype!r}")
    if verl_option(worker_config, "fp8_loss") or verl_option(worker_config, "allow_merged_lora"):
        raise ValueError("actor_rollout_ref.faircast.fp8_loss / allow_merged_lora apply to the FSDP engines only")
