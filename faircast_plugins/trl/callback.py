"""The Fair Cast callback: the loss runs on the served copy, the optimizer steps the fp32 master.

What happens at each point depends on the backend, one small class each (:mod:`faircast_plugins.trl.backends`):
shadow masters in one process or DDP, the DeepSpeed copy-back patch, the FSDP2 cast patches. The callback holds
what is the same for all of them:

* at construction (:meth:`FairCastCallback.prepare`): the backend's checks; in one process or DDP the policy serves
  version 0 from now on;
* at train begin: refuse an optimizer that moves the weights outside ``optimizer.step()``, refuse a second
  ``train()`` that would restart the weight version, then the backend attaches and restores a resume's Fair Cast
  state (a missing state file is refused when the mode needs it, on every backend, unless
  ``faircast_resume_without_state=True``);
* around each optimizer step: the backend's ``before_step`` / ``after_step`` (the version advances once per step);
* at every save: the backend's state files and one ``faircast.json`` record.

With only ``faircast_audit`` on, nothing is swapped: the callback measures how far the round-to-nearest copy that
vLLM serves trails the master, and TRL's logs get the same ``faircast/*`` metrics.

With ``faircast_policy_metrics_every: N`` (Fair Cast on or off), every N optimizer steps the patched ``compute_loss``
calls :meth:`FairCastCallback.measure_policy` on its batch, and the next log gets the ``faircast/policy_*`` metrics
(:mod:`faircast_plugins.policy_lag`: per-token KL and sequence ESS/n between the served copy and the master).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Dict, Optional

import torch
from transformers import TrainerCallback

from ..caster import FairCaster
from ..config import FairCastConfig
from ..patching import FairCastPatchError
from ..policy_lag import PolicyLagProbe, gather_rows, metrics_of
from .backends import INFO_FILE, Backend, backend_for
from .refusals import check_optimizer, check_policy_text_only


class FairCastCallback(TrainerCallback):
    """Serves ``fair_cast(master)`` to every forward and to the rollout engine, through the trainer's backend."""

    def __init__(self, trainer, config: FairCastConfig):
        if config.measures_policy:
            check_policy_text_only(type(trainer).__name__, trainer)
        self.trainer = trainer
        self.config = config
        self.caster = FairCaster(config)
        self.backend: Backend = backend_for(trainer, self.caster)
        self.resume_dir: Optional[str] = None  # set by the patched Trainer._load_from_checkpoint
        self._served: Optional["torch.cuda.Event"] = None  # recorded where the newest served copy was written
        self.policy: Optional[PolicyLagProbe] = None  # the faircast/policy_* metrics, when asked for
        if config.measures_policy:
            self.backend.check_policy_metrics(type(trainer).__name__)
            self.policy = PolicyLagProbe(config.policy_metrics_every, config.policy_metrics_seqs)

    @property
    def shadow(self) -> bool:
        """True when the policy's fp32 parameters hold the served copy (Fair Cast on, one process or DDP)."""
        return self.backend.shadow

    @property
    def masters(self) -> Dict[str, torch.Tensor]:
        """The fp32 masters kept aside (one process or DDP with Fair Cast on; empty otherwise)."""
        return self.backend.masters

    def prepare(self) -> None:
        """At construction: the backend's checks (fp32 masters); one process or DDP serves version 0 from now on."""
        self.backend.prepare()
        self._mark_served()

    def check_ready(self, what: str) -> None:
        """Refuse ``what`` (an evaluation, an engine sync) before Fair Cast is attached to the engine (DeepSpeed, FSDP
        before the first ``train()``): it would run on, or export, round to nearest of the raw masters."""
        if self.config.enabled and not self.backend.ready:
            raise FairCastPatchError(
                f"{what} before the first train() is refused under {type(self.backend).__name__}: Fair Cast attaches "
                f"to the engine when train() prepares it, so this would run on round to nearest of the raw masters. "
                f"Call it after train() has started, or without faircast."
            )

    # -- the training loop ----------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.config.enabled:
            check_optimizer(type(self.trainer).__name__, self.trainer.optimizer)
        resuming = bool(self.resume_dir) or state.global_step > 0
        if not resuming and self.caster.version != state.global_step:
            raise FairCastPatchError(
                f"a second train() on this {type(self.trainer).__name__} restarts at step {state.global_step}, but "
                f"Fair Cast's weight version counts the optimizer steps taken ({self.caster.version}): the rounding "
                f"noise would repeat and error feedback's residuals would not match. Build a new trainer, or resume: "
                f"train(resume_from_checkpoint=...)."
            )
        self.backend.begin(state, self.resume_dir)
        self.resume_dir = None
        self._mark_served()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.backend.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.backend.after_step()
        self._mark_served()

    def on_save(self, args, state, control, **kwargs):
        self.backend.after_checkpoint(args, state)

    def mix_masters_into(self, sync_ref_callback) -> None:
        """TRL's ``SyncRefModelCallback`` mixes the policy into the reference model at ``on_step_end``: make it mix
        the fp32 masters (the trained policy) rather than the served copy the parameters hold."""
        original = sync_ref_callback.on_step_end

        @functools.wraps(original)
        def on_step_end(*args, **kwargs):
            with self.backend.masters_in_params():
                return original(*args, **kwargs)

        sync_ref_callback.on_step_end = on_step_end

    # -- export, generation, metrics ------------------------------------------------------------------------
    def bf16_generation(self):
        """Around TRL's continuous-batching generation, which casts the policy to bf16 in place and never back."""
        return self.backend.bf16_generation()

    def masters_in_params(self):
        """While saving a checkpoint: the parameters hold the fp32 masters."""
        return self.backend.masters_in_params()

    def export(self, stream):
        """The ``(name, tensor)`` stream a rollout engine receives, as the served copy."""
        self.check_ready("A weight sync to the rollout engine")
        self._wait_for_served()
        yield from self.backend.export(stream) if self.backend.serves_export else stream

    # -- stream order between the served copy and the export (CUDA) -------------------------------------------
    def _cuda_device(self) -> Optional[torch.device]:
        """The trainer's CUDA device, when CUDA is in use (None on CPU: no stream to order)."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        accelerator = getattr(self.trainer, "accelerator", None)
        device = torch.device(getattr(accelerator, "device", None) or self.trainer.args.device)
        return device if device.type == "cuda" else None

    def _mark_served(self) -> None:
        """After the training thread wrote a served copy (or the engine's step did): record an event on its stream."""
        device = self._cuda_device()
        if device is not None:
            self._served = torch.cuda.Event()
            self._served.record(torch.cuda.current_stream(device))

    def _wait_for_served(self) -> None:
        """Order the export after the newest served copy. vLLM's server-mode producer pulls the export inside its own
        side stream, and AsyncGRPO's weight sender pulls it in another thread (whose current stream is the device's
        default one): neither waits for the stream the training thread wrote the served copy on, so without this the
        previous version could be sent. Nothing on CPU."""
        device = self._cuda_device()
        if device is None:
            return
        stream = torch.cuda.current_stream(device)
        if self._served is not None:
            stream.wait_event(self._served)
        else:  # nothing served under this callback yet: what TRL wrote went through the default stream
            stream.wait_stream(torch.cuda.default_stream(device))

    def metrics(self) -> Dict[str, float]:
        """``faircast/*`` metrics since the last log (the audit ones only with ``faircast_audit``; the policy ones only
        with ``faircast_policy_metrics_every``, gathered from every process: a collective, every rank logs)."""
        out = self.backend.metrics()
        if self.policy is not None:
            out.update(metrics_of(gather_rows(self.policy.take(), device=self.trainer.accelerator.device)))
        return out

    def measure_policy(self, inputs, step: int, temperature: float) -> None:
        """From the patched ``compute_loss``: on optimizer steps that are multiples of N, score the first sequences of
        ``inputs`` (``prompt_ids``/``prompt_mask``/``completion_ids``/``completion_mask``) under the served copy and the
        master (:meth:`Backend.policy_views`).

        Attended as TRL's own forward attends (``cat(prompt_mask, completion_mask)``, tool results included); counted
        as its loss counts (``completion_mask * tool_mask``: a tool's output is context, not a sampled token). A batch
        with images is refused (:func:`~.refusals.check_policy_text_only`)."""
        if self.policy is None or not self.policy.due(step):
            return
        check_policy_text_only(type(self.trainer).__name__, inputs=inputs)
        attend = inputs["completion_mask"]
        count = attend * inputs["tool_mask"] if "tool_mask" in inputs else None
        with self.backend.policy_scope() as swap:
            served, master = self.backend.policy_views()
            self.policy.measure(self.backend.model(), step, inputs["prompt_ids"], inputs["prompt_mask"],
                                inputs["completion_ids"], attend, count_mask=count, served=served, master=master,
                                temperature=temperature, collective=self.backend.policy_collective, swap=swap)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_state(self, output_dir: str) -> None:
        """Write the backend's Fair Cast state files and a small JSON record next to the saved model.

        With the fp32 masters as the model weights, ``faircast export`` (:func:`faircast_plugins.export.export_served`)
        rebuilds the served bf16 copy of this checkpoint from the state. Called on every rank (``Trainer.save_model``
        runs on every rank); only the main process writes shared files."""
        extra = self.backend.save_state(output_dir)
        if not self.trainer.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        info = {
            "enabled": self.config.enabled,
            "mode": self.config.effective_mode,
            "seed": self.config.seed,
            "version": self.caster.version,
            "ema_decay": self.config.ema_decay,
            "model_weights": self.backend.saved_weights(),
            **extra,
        }
        with open(os.path.join(output_dir, INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)


def find_callback(trainer) -> Optional[FairCastCallback]:
    return getattr(trainer, "_faircast", None)
