"""The TRL 1.16 patch set: attach the callback, export bf16, save/restore Fair Cast state, log the metrics.

Every target is checked before anything is patched (:class:`faircast_plugins.patching.PatchSet`), and the set
refuses any TRL outside :data:`SUPPORTED`.

* ``GRPOTrainer`` / ``RLOOTrainer`` / ``OnlineDPOTrainer.__init__``: refuse unsupported combinations, then add
  the :class:`FairCastCallback` when ``faircast`` or ``faircast_audit`` is set.
* ``AsyncGRPOTrainer.__init__``: the same, with the callback first in line (the cold weight sync at train begin
  sends the served copy), and the weight manifest it announces to the vLLM server rewritten to bf16.
* ``VLLMGeneration._iter_named_params`` (GRPO, RLOO; colocate and server) and ``AsyncGRPOTrainer._streaming_iter``:
  yield the served copy as bf16, so vLLM's ``load_weights`` copies it bit for bit and server mode streams half the
  bytes. Under DeepSpeed the bf16 parameters already are the served copy and pass through untouched; under FSDP2
  the gathered full fp32 masters are cast to the bits FSDP's patched cast gives their shards.
* ``GRPOTrainer`` / ``RLOOTrainer._generate_single_turn``: with Fair Cast on and
  ``use_transformers_continuous_batching`` (no vLLM), TRL casts the policy to bf16 in place for ``generate_batch``
  and never back; the wrapper generates on bf16 copies of the parameters (exact: they hold the served copy) and
  leaves the fp32 parameters and the buffers as they were (:meth:`FairCastCallback.bf16_generation`). Off or
  audit-only: TRL's own behaviour.
* ``Trainer.save_model``: write the fp32 masters (not the served copy; under DeepSpeed, DeepSpeed's own weights) and ``faircast_state.pt`` +
  ``faircast.json`` (seed, version, mode) into every checkpoint and final save; under FSDP with error feedback or an
  EMA, every rank writes its own ``faircast_state_rankNNNNN.pt`` instead.
* ``Trainer._load_from_checkpoint``: remember the checkpoint so the callback restores the Fair Cast state.
* ``Trainer.log``: add ``faircast/*`` metrics to TRL's logs; with ``faircast_audit`` also ``faircast/lag_cost``
  (:mod:`faircast_plugins.lag_cost`, from TRL's logged ``reward``).
* ``GRPOTrainer`` / ``RLOOTrainer.compute_loss``: with ``faircast_policy_metrics_every: N``, every N optimizer steps
  the first sequences of the batch are scored under the served copy and the master before the loss
  (:meth:`FairCastCallback.measure_policy`); the next log gets ``faircast/policy_*``. Online DPO and AsyncGRPO refuse
  the option.
* ``Trainer.evaluate``: refused before Fair Cast is attached to the engine (DeepSpeed, FSDP before the first
  ``train()``); in one process or DDP the policy serves the copy from construction on.

Refused at construction with Fair Cast on: ``fp16=True``, optimizers that step inside backward or are schedule-free,
``load_best_model_at_end``, a colocated vLLM engine that is not bf16 (and the other refusals in :mod:`.refusals`).

DeepSpeed (bf16, ZeRO-0/1/2/3): the callback attaches :func:`faircast_plugins.deepspeed.apply_deepspeed_patch` to
``trainer.deepspeed`` at the start of training instead of keeping shadow masters. FSDP2 (bf16): it registers the
wrapped policy with :mod:`faircast_plugins.fsdp` instead.
"""
from __future__ import annotations

import functools
import inspect

from ..deepspeed import install_deepspeed_patch
from ..lag_cost import tracker_of
from ..patching import FairCastPatchError, PatchSet
from .callback import FairCastCallback, find_callback
from .config import faircast_config
from .refusals import check_args, check_engine_dtype, check_trainer, generates_in_place

DISTRIBUTION = "trl"
SUPPORTED = ">=1.16.0,<1.17"

TRAINERS = {
    "GRPOTrainer": "trl.trainer.grpo_trainer:GRPOTrainer.__init__",
    "RLOOTrainer": "trl.trainer.rloo_trainer:RLOOTrainer.__init__",
    "OnlineDPOTrainer": "trl.experimental.online_dpo.online_dpo_trainer:OnlineDPOTrainer.__init__",
}
GENERATE_IN_PLACE = {
    "GRPOTrainer": "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn",
    "RLOOTrainer": "trl.trainer.rloo_trainer:RLOOTrainer._generate_single_turn",
}
ASYNC_GRPO = "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer.__init__"
ASYNC_EXPORT = "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer._streaming_iter"
VLLM_EXPORT = "trl.generation.vllm_generation:VLLMGeneration._iter_named_params"
SAVE_MODEL = "transformers.trainer:Trainer.save_model"
LOAD_CHECKPOINT = "transformers.trainer:Trainer._load_from_checkpoint"
LOG = "transformers.trainer:Trainer.log"
#: the loss of the trainers whose batch the policy metrics score (prompt_ids, completion_ids and their masks)
COMPUTE_LOSS = {
    "GRPOTrainer": "trl.trainer.grpo_trainer:GRPOTrainer.compute_loss",
    "RLOOTrainer": "trl.trainer.rloo_trainer:RLOOTrainer.compute_loss",
}
EVALUATE = "transformers.trainer:Trainer.evaluate"
#: TRL's mean reward of a logged step, which ``faircast/lag_cost`` multiplies the lag by the slope of
REWARD_KEY = "reward"


def _bound(original, self, args, kwargs) -> dict:
    """The trainer's constructor arguments by name (``args``, ``peft_config``, ...)."""
    try:
        return dict(inspect.signature(original).bind_partial(self, *args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)


def _trainer_init(trainer_name: str):
    def factory(original):
        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            bound = _bound(original, self, args, kwargs)
            cfg = faircast_config(bound["args"]) if bound.get("args") is not None else None
            if cfg is not None and cfg.active:
                check_args(trainer_name, bound["args"], bound.get("peft_config"))
                if cfg.measures_policy and trainer_name not in COMPUTE_LOSS:  # before any model is loaded
                    raise FairCastPatchError(
                        f"{trainer_name}(faircast_policy_metrics_every={cfg.policy_metrics_every}) is not supported: "
                        f"the policy metrics score the batch in GRPOTrainer's and RLOOTrainer's compute_loss. Use one "
                        f"of those, or set faircast_policy_metrics_every=0 (faircast_audit measures the lag in weight "
                        f"space)."
                    )
            original(self, *args, **kwargs)
            cfg = faircast_config(self.args)
            if cfg is None or not cfg.active:
                return
            check_trainer(trainer_name, self)
            if getattr(self, "is_deepspeed_enabled", False):
                install_deepspeed_patch()  # now, so that a DeepSpeed resume (before on_train_begin) reaches the callback
            callback = FairCastCallback(self, cfg)
            callback.prepare()  # fp32 masters: fail now, not after the first generation
            self._faircast = callback
            self.add_callback(callback)
            for other in self.callback_handler.callbacks:
                if cfg.enabled and type(other).__name__ == "SyncRefModelCallback":
                    callback.mix_masters_into(other)  # the reference mixes in the masters, not the served copy
            generation = getattr(self, "vllm_generation", None)
            if generation is not None:
                generation._faircast = callback
            llm = getattr(generation, "llm", None) if generation is not None else getattr(self, "llm", None)
            if cfg.enabled and llm is not None:  # a colocated engine (GRPO/RLOO's VLLMGeneration, Online DPO's own)
                check_engine_dtype(trainer_name, llm)

        return __init__

    return factory


def _async_grpo_init(original):
    init = _trainer_init("AsyncGRPOTrainer")(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        callback = find_callback(self)
        if callback is None:
            return
        # First in line: the cold weight sync at train begin (_TrainBeginCallback) must already send the served copy.
        self.callback_handler.callbacks.remove(callback)
        self.callback_handler.callbacks.insert(0, callback)
        if callback.config.enabled:
            _bf16_manifest(self)

    return __init__


def _bf16_manifest(trainer) -> None:
    """AsyncGRPO announces every tensor's dtype to the vLLM server once, at construction; the stream is bf16 now."""
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    client = getattr(trainer, "weight_transfer", None)
    if not isinstance(client, WeightTransferClient):
        return  # another rank (no client), or an injected transfer backend that reads the stream's own dtypes
    info = getattr(client, "_weight_update_info", None)
    if not isinstance(info, dict) or not isinstance(info.get("dtype_names"), list):
        raise FairCastPatchError(
            "Fair Cast could not find AsyncGRPO's weight manifest (WeightTransferClient._weight_update_info"
            "['dtype_names']) in this TRL; the bf16 stream would not match the announced fp32 dtypes."
        )
    info["dtype_names"] = ["bfloat16" if d == "float32" else d for d in info["dtype_names"]]


def _generate_in_place(original):
    @functools.wraps(original)
    def _generate_single_turn(self, *args, **kwargs):
        callback = find_callback(self)
        if callback is None or not callback.config.enabled or not generates_in_place(self.args):
            return original(self, *args, **kwargs)  # TRL's own behaviour (audit-only included)
        with callback.bf16_generation():
            return original(self, *args, **kwargs)

    return _generate_single_turn


def _served_export(find):
    """Wrap a ``(name, tensor)`` export iterator so that it yields the served copy; ``find(self)`` gives the
    trainer's callback (None: the stream is left as it is)."""

    def factory(original):
        @functools.wraps(original)
        def iterate(self, *args, **kwargs):
            callback = find(self)
            stream = original(self, *args, **kwargs)
            yield from stream if callback is None else callback.export(stream)

        return iterate

    return factory


_vllm_export = _served_export(lambda generation: getattr(generation, "_faircast", None))  # GRPO, RLOO
_async_export = _served_export(find_callback)  # AsyncGRPOTrainer


def _save_model(original):
    @functools.wraps(original)
    def save_model(self, output_dir=None, _internal_call=False, *args, **kwargs):
        callback = find_callback(self)
        if callback is None:
            return original(self, output_dir, _internal_call, *args, **kwargs)
        with callback.masters_in_params():
            result = original(self, output_dir, _internal_call, *args, **kwargs)
        callback.save_state(output_dir if output_dir is not None else self.args.output_dir)  # every rank
        return result

    return save_model


def _load_from_checkpoint(original):
    @functools.wraps(original)
    def _load(self, resume_from_checkpoint, *args, **kwargs):
        callback = find_callback(self)
        if callback is not None:
            callback.resume_dir = resume_from_checkpoint
        return original(self, resume_from_checkpoint, *args, **kwargs)

    return _load


def _evaluate(original):
    @functools.wraps(original)
    def evaluate(self, *args, **kwargs):
        callback = find_callback(self)
        if callback is not None:
            callback.check_ready("evaluate()")
        return original(self, *args, **kwargs)

    return evaluate


def _compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, model, inputs, *args, **kwargs):
        callback = find_callback(self)
        if callback is not None and callback.policy is not None and model.training:
            callback.measure_policy(inputs, self.state.global_step, float(getattr(self.args, "temperature", 1.0)))
        return original(self, model, inputs, *args, **kwargs)

    return compute_loss


def _log(original):
    @functools.wraps(original)
    def log(self, logs, *args, **kwargs):
        callback = find_callback(self)
        if callback is not None and self.model.training:
            logs.update(callback.metrics())
            if callback.config.audit:  # the mean reward (GRPO, RLOO, AsyncGRPO log it as "reward") and the lag
                tracker_of(callback).add_to(logs, self.state.global_step, REWARD_KEY)
        return original(self, logs, *args, **kwargs)

    return log


def build_patch_set() -> PatchSet:
    patches = PatchSet("TRL", DISTRIBUTION, SUPPORTED)
    for name, target in TRAINERS.items():
        patches.wrap(target, _trainer_init(name))
    for target in GENERATE_IN_PLACE.values():
        patches.wrap(target, _generate_in_place)
    patches.wrap(ASYNC_GRPO, _async_grpo_init)
    patches.wrap(ASYNC_EXPORT, _async_export)
    patches.wrap(VLLM_EXPORT, _vllm_export)
    patches.wrap(SAVE_MODEL, _save_model)
    patches.wrap(LOAD_CHECKPOINT, _load_from_checkpoint)
    patches.wrap(LOG, _log)
    for target in COMPUTE_LOSS.values():
        patches.wrap(target, _compute_loss)
    patches.wrap(EVALUATE, _evaluate)
    return patches


#: Every TRL symbol Fair Cast wraps; nothing is touched until ``faircast_plugins.trl.patch()`` applies it.
PATCHES = build_patch_set()
