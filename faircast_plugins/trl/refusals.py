"""What Fair Cast refuses in TRL, and why: the combinations that would leave the loss or the export on a copy that is
not the served one, refused with a message naming the option and what to use instead.

:func:`check_args` decides from the trainer's arguments (before any model or engine is built), :func:`check_trainer`
from the built trainer, :func:`check_engine_dtype` from a colocated vLLM engine, :func:`check_optimizer` from the
optimizer that ``train()`` builds, :func:`check_policy_text_only` (the policy metrics) from the built trainer and from
each batch they score. The patches (:mod:`.patches`) and the callback call them; they import nothing of
either.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..patching import FairCastPatchError
from .config import faircast_config


class FairCastUnsupportedError(FairCastPatchError):
    """A Fair Cast combination that is not supported (yet): refused rather than silently rounded to nearest."""


_PEFT_REFUSAL = (
    "Fair Cast with a PEFT/LoRA model in {trainer} is refused: merging the adapter into the base for export "
    "rounds to nearest, and the loss (W x + B A x) is not the served W + B A. Train without PEFT, or without "
    "faircast."
)


def check_args(trainer_name: str, args: Any, peft_config: Any = None) -> None:
    """Refusals that can be decided from the arguments alone, before any model or engine is built."""
    if peft_config is not None:
        raise FairCastUnsupportedError(_PEFT_REFUSAL.format(trainer=trainer_name))
    cfg = faircast_config(args)
    if cfg is not None and cfg.enabled:
        _check_enabled_args(trainer_name, args)
    if getattr(args, "deepspeed", None):
        _check_deepspeed_args(trainer_name, args)
    if getattr(args, "fsdp", None):
        plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
        _check_fsdp(trainer_name, args, plugin_args.get("fsdp_version", 2), "bf16" if args.bf16 else "no")


#: transformers optimizers that move the weights outside ``optimizer.step()`` (inside backward) or swap them
#: (schedule-free ``train()``/``eval()``): the master would never see the update, or the parameters would not hold the
#: served copy.
IN_BACKWARD_OPTIMIZERS = ("galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
                          "apollo_adamw_layerwise", "lomo", "adalomo")


def _check_enabled_args(trainer_name: str, args: Any) -> None:
    """Refusals of options that change what is served or what the optimizer steps (Fair Cast on)."""
    if getattr(args, "fp16", False):
        raise FairCastUnsupportedError(
            f"Fair Cast with {trainer_name}(fp16=True) is refused: fp16 autocast (and the continuous-batching "
            f"generation's fp16 cast) rounds the bf16 served copy again, so the model would not run on the copy that is "
            f"served. Use bf16=True."
        )
    optim = str(getattr(getattr(args, "optim", ""), "value", getattr(args, "optim", "")))
    if optim in IN_BACKWARD_OPTIMIZERS:
        raise FairCastUnsupportedError(
            f"Fair Cast with {trainer_name}(optim={optim!r}) is refused: this optimizer updates the weights inside "
            f"backward, not in optimizer.step(), so the fp32 master would never move. Use a per-step optimizer "
            f"(adamw_torch, the default; galore_adamw / apollo_adamw without _layerwise)."
        )
    if optim.startswith("schedule_free"):
        raise FairCastUnsupportedError(
            f"Fair Cast with {trainer_name}(optim={optim!r}) is refused: schedule-free optimizers swap the parameters "
            f"between their train and eval points (optimizer.train()/eval()), outside the Fair Cast master. Use "
            f"adamw_torch (the default) with a learning-rate schedule."
        )
    if getattr(args, "load_best_model_at_end", False):
        raise FairCastUnsupportedError(
            f"Fair Cast with {trainer_name}(load_best_model_at_end=True) is refused: the best checkpoint is loaded "
            f"with load_state_dict, outside Fair Cast, which would leave its fp32 masters in the parameters and the "
            f"last step's Fair Cast state in the final save. Keep load_best_model_at_end=False and load the best "
            f"checkpoint yourself (`faircast export --checkpoint` rebuilds the copy it served)."
        )


def check_optimizer(trainer_name: str, optimizer: Any) -> None:
    """Refuse a built optimizer (e.g. passed as ``optimizers=``) that steps in backward or is schedule-free."""
    inner = optimizer
    while hasattr(inner, "optimizer") and inner.optimizer is not inner:  # accelerate's / DeepSpeed's wrappers
        inner = inner.optimizer
    name = type(inner).__name__
    if name in ("LayerWiseDummyOptimizer", "Lomo", "AdaLomo") or callable(getattr(inner, "train", None)):
        raise FairCastUnsupportedError(
            f"Fair Cast in {trainer_name} with the optimizer {name} is refused: it updates the weights inside "
            f"backward, or swaps them between its train and eval points (schedule-free), outside the Fair Cast "
            f"master. Use a per-step optimizer such as torch.optim.AdamW."
        )


def check_engine_dtype(trainer_name: str, llm: Any) -> None:
    """A colocated vLLM engine must hold bf16 weights: loading the bf16 served copy into fp16 or fp32 weights would
    round it again (fp16) or serve something else than the trainer's forward (fp32)."""
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    if dtype is None:
        raise FairCastPatchError(
            f"Fair Cast could not read the colocated vLLM engine's dtype (LLM.llm_engine.model_config.dtype) in "
            f"{trainer_name}; it must be bfloat16."
        )
    if dtype != torch.bfloat16:
        raise FairCastUnsupportedError(
            f"Fair Cast in {trainer_name} with a colocated vLLM engine in {dtype} is refused: the served copy is bf16 "
            f"and loading it into {dtype} weights would not serve it bit for bit. vLLM picks the dtype from the model's "
            f"config (torch_dtype); save the model with torch_dtype bfloat16, or use vllm_mode='server' with "
            f"`--dtype bfloat16`."
        )


def generates_in_place(args: Any) -> bool:
    """TRL's continuous-batching generation (``use_transformers_continuous_batching``; vLLM takes precedence)."""
    return bool(getattr(args, "use_transformers_continuous_batching", False)) and not getattr(args, "use_vllm", False)


def _check_deepspeed_args(trainer_name: str, args: Any) -> None:
    """DeepSpeed runs go through the shared copy-back patch, which needs bf16; refuse the rest now
    (the patch re-checks the built engine when it is attached at the start of training)."""
    if not getattr(args, "bf16", False):
        raise FairCastUnsupportedError(
            f"Fair Cast with DeepSpeed in {trainer_name} needs bf16=True (DeepSpeed bf16: fp32 masters in the optimizer, "
            f"bf16 weights in the module); fp16 and fp32 DeepSpeed runs are refused."
        )
    from ..deepspeed.patch import zeropp_refusals  # torch only; DeepSpeed itself is not imported

    for refusal in zeropp_refusals(_deepspeed_json(args).get("zero_optimization") or {}):
        raise FairCastUnsupportedError(f"Fair Cast with DeepSpeed in {trainer_name} is refused: {refusal}.")


def _deepspeed_json(args: Any) -> dict:
    """The DeepSpeed config the user passed (``args.deepspeed``: a dict or a JSON file, as transformers parsed it);
    an empty dict when it cannot be read here (the built engine is checked again when the patch attaches)."""
    parsed = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(parsed, dict):
        return parsed
    given = getattr(args, "deepspeed", None)
    if isinstance(given, dict):
        return given
    if isinstance(given, str) and os.path.isfile(given):
        with open(given) as f:
            return json.load(f)
    return {}


def _check_fsdp(trainer_name: str, args: Any, fsdp_version: int, param_dtype: Any) -> None:
    """FSDP runs go through the shared FSDP cast patches: FSDP2 with a bf16 compute copy (every mode; error-feedback
    residuals and EMAs are per-rank state of each rank's shards, see :class:`FairCastCallback`)."""
    if trainer_name == "OnlineDPOTrainer":
        raise FairCastUnsupportedError(
            "Fair Cast with FSDP in OnlineDPOTrainer is refused: its own FSDP weight push to vLLM is not wired. "
            "Run it without FSDP, or use GRPOTrainer/RLOOTrainer."
        )
    if generates_in_place(args):
        raise FairCastUnsupportedError(
            f"Fair Cast with FSDP and {trainer_name}(use_transformers_continuous_batching=True) is refused: that path "
            f"runs model.to(torch.bfloat16) on the FSDP module, which casts the sharded fp32 masters themselves to "
            f"bf16 and never back. Use vLLM (use_vllm=True) or regular generation under FSDP."
        )
    if fsdp_version != 2:
        raise FairCastUnsupportedError(
            f"Fair Cast with FSDP{fsdp_version} in {trainer_name} is refused: only FSDP2 (fsdp_config version 2, "
            f"the default) is supported. Under FSDP1, TRL generates without vLLM inside summon_full_params, which "
            f"hands the root unit's fp32 masters to the forward outside FSDP's cast."
        )
    if str(param_dtype) not in ("bf16", "torch.bfloat16"):
        raise FairCastUnsupportedError(
            f"Fair Cast with FSDP in {trainer_name} needs bf16 mixed precision (bf16=True, the TRL default): FSDP's "
            f"bf16 cast of the fp32 shards is where the served copy is made; got {param_dtype}."
        )


def check_trainer(trainer_name: str, trainer: Any) -> None:
    """Refusals that need the built trainer (accelerate plugins from the environment, PEFT, dtypes)."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        _check_deepspeed_args(trainer_name, trainer.args)
    if getattr(trainer, "is_fsdp_enabled", False):  # also when accelerate's environment turned FSDP on
        plugin = trainer.accelerator.state.fsdp_plugin
        policy = getattr(plugin, "mixed_precision_policy", None)
        _check_fsdp(trainer_name, trainer.args, plugin.fsdp_version, getattr(policy, "param_dtype", None))
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        raise FairCastUnsupportedError(_PEFT_REFUSAL.format(trainer=trainer_name))


#: the batch keys through which TRL 1.16's GRPO / RLOO give a vision-language policy its images (``_generate_and_score_
#: completions``' output, which ``compute_loss`` passes to the model's forward)
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                     "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images", "num_tiles",
                     "pixel_values_videos", "video_grid_thw")


def check_policy_text_only(trainer_name: str, trainer: Any = None, inputs: Any = None) -> None:
    """Refuse ``faircast_policy_metrics_every`` for a vision-language policy: the probe's forwards pass only the token
    ids and their masks, so they would score the image placeholder tokens as text, without the images, and the
    metrics would be wrong with no error. Decided from the built trainer (TRL's ``_is_vlm``: a ``ProcessorMixin``
    processing class) and, in case it was not recognisable there, from each batch the probe scores."""
    keys = [k for k in MULTIMODAL_INPUTS if inputs is not None and k in inputs]
    if getattr(trainer, "_is_vlm", False) or keys:
        why = f"the batch carries {', '.join(keys)}" if keys else "its processing_class is a processor (a VLM)"
        raise FairCastUnsupportedError(
            f"{trainer_name}(faircast_policy_metrics_every=...) is not supported for vision-language policies ({why}): "
            f"the policy metrics score the text tokens without the images, so their values would be wrong. Set "
            f"faircast_policy_metrics_every=0 for this model (faircast_audit measures the lag in weight space)."
        )
