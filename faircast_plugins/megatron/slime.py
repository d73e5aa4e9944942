"""Hugging Face keys for slime (THUDM/slime): slime's own Megatron -> HF converters as Fair Cast converters.

slime sends its weights to SGLang through ``convert_to_hf(args, model_name, name, param, quantization_config)``
(``slime/backends/megatron_utils/megatron_to_hf/__init__.py``): ``name`` is the Megatron name behind slime's
``module.module.`` prefix (DDP around Float16Module) with the global layer and expert ids (the ids of Fair Cast's
canonical names, :mod:`.layout`), ``param`` the full (TP-gathered) tensor. It drops the padded vocab rows past
``args.vocab_size`` (the HF vocab) and dispatches on ``model_name`` to a per-model ``convert_<model>_to_hf(args,
name, param)`` that returns ``[(HF name, tensor), ...]``. :func:`slime_converters` turns that function into the
``converters=`` lookup of :func:`~.patch.apply_megatron_patch`, so that Fair Cast keys every element by the HF name
and index slime exports it as (docs/ROUNDING.md §1); the attach's self-check refuses a converter that changes
values (:mod:`.hf_map`).

    from faircast_plugins.megatron import apply_megatron_patch
    from faircast_plugins.megatron.slime import slime_converters

    fc = apply_megatron_patch(optimizer, caster, model_chunks=model,
                              converters=slime_converters(args, model_name, self.hf_config),
                              hf_vocab_size=args.vocab_size)

``model_name`` is what slime's actor gives its weight updater: ``args.model_name``, else
``type(hf_config).__name__.lower()``; ``hf_config`` the actor's HF config, whose ``quantization_config`` slime's weight
updater passes to ``convert_to_hf`` (``backends/megatron_utils/actor.py``). slime is imported here, when called, not by
this module.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

from .hf_map import ConverterError

CONVERTER_MODULE = "slime.backends.megatron_utils.megatron_to_hf"
#: what slime's named_params_and_buffers puts before a Megatron name (DistributedDataParallel, Float16Module)
SLIME_PREFIX = "module.module."


def slime_convert_to_hf() -> Callable:
    """slime's ``convert_to_hf``, or an ImportError that says what is missing."""
    try:
        module = importlib.import_module(CONVERTER_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"Fair Cast's slime converters need slime's Megatron->HF converters ({CONVERTER_MODULE}, from "
            f"github.com/THUDM/slime), which do not import here: {exc}. Call slime_converters in slime's own "
            f"environment (the Megatron actor), or pass converters= of your own") from exc
    convert = getattr(module, "convert_to_hf", None)
    if not callable(convert):
        raise ImportError(f"{CONVERTER_MODULE} has no convert_to_hf: this slime version is not one Fair Cast was "
                          f"checked with (docs/megatron.md)")
    return convert


_REQUIRED: Any = object()


def _quantization_config(hf_config):
    if isinstance(hf_config, dict):
        return hf_config.get("quantization_config")
    return getattr(hf_config, "quantization_config", None)


def slime_converters(args, model_name: str, hf_config=_REQUIRED) -> Callable[[str], Callable]:
    """``Megatron name -> converter`` through slime's ``convert_to_hf(args, model_name, ...)``: each converter takes
    the full (TP=1) tensor of one param and returns ``{HF name: tensor}``, as slime's weight sync exports it.

    ``args``: slime's Megatron arguments (``vocab_size``, ``hidden_size``, ``num_attention_heads``,
    ``num_query_groups``, ``kv_channels``, ``q_lora_rank``, ... as slime's converters read them). Pass
    ``hf_vocab_size=args.vocab_size`` to :func:`~.patch.apply_megatron_patch` with it. ``hf_config``: the actor's HF
    config (slime's ``self.hf_config``); required, because slime's weight updater quantizes the export when it carries a
    ``quantization_config``. Refused: such a ``quantization_config`` (fp8 / int4: the served weights are not the bf16
    params Fair Cast casts) and ``args.q_lora_rank`` (slime pairs the MLA ``q_a_proj`` and ``kv_a_proj_with_mqa``
    exports across calls through a module-level cache, which a converter run one param at a time would leave
    filled). Under ``--update-weight-mode=delta`` the lookup says so (``lookup.delta_sync``):
    :func:`~.patch.apply_megatron_patch` then warns for a mode that changes most served elements every version."""
    if hf_config is _REQUIRED or hf_config is None:
        raise ConverterError(
            "slime_converters(args, model_name, hf_config): pass the actor's HF config (slime's self.hf_config). slime's "
            "weight updater quantizes the exported weights when hf_config.quantization_config is set, and Fair Cast "
            "must refuse that: the served weights would not be the bf16 params it casts")
    convert_to_hf = slime_convert_to_hf()
    quantization_config = _quantization_config(hf_config)
    if quantization_config is not None:
        raise ConverterError(
            f"slime's export quantizes the weights for the rollout (hf_config.quantization_config "
            f"{quantization_config.get('quant_method', quantization_config) if isinstance(quantization_config, dict) else getattr(quantization_config, 'quant_method', quantization_config)!r}): "
            f"the served weights are not the bf16 params Fair Cast casts. Serve a bf16 checkpoint (no "
            f"quantization_config in the HF config) to use Fair Cast")
    if getattr(args, "q_lora_rank", None) is not None:
        raise ConverterError(
            "slime exports MLA's q_a_proj and kv_a_proj_with_mqa in pairs held in a module-level cache between calls "
            "(args.q_lora_rank is set): Fair Cast's one-param-at-a-time converter run would leave that cache filled. "
            "Not supported")

    def lookup(name: str) -> Callable:
        slime_name = SLIME_PREFIX + name

        def convert(tensor) -> Dict[str, object]:
            try:
                pairs = convert_to_hf(args, model_name, slime_name, tensor)
            except ValueError as exc:  # slime's "Unknown parameter name" / "Unsupported model"
                raise ConverterError(f"slime's convert_to_hf (model {model_name!r}) does not convert {slime_name}: "
                                     f"{exc}") from None
            out: Dict[str, object] = {}
            for hf_name, value in pairs:
                if hf_name in out:
                    raise ConverterError(f"slime's convert_to_hf returned {hf_name} twice for {slime_name}")
                out[hf_name] = value
            return out

        convert.__qualname__ = f"slime convert_to_hf[{model_name}]"
        return convert

    if getattr(args, "update_weight_mode", None) == "delta":  # slime sends only the HF elements that changed
        lookup.delta_sync = "slime's --update-weight-mode=delta"
    return lookup
