"""DeepSpeed (bf16): the module's bf16 parameters are the served copy, the fp32 masters live in DeepSpeed's optimizer.

Policy metrics (``faircast_policy_metrics_every``, ZeRO-0/1/2/3): the two weight views are the cast-site layer's
(:mod:`faircast_plugins.deepspeed.policy_views`, shared with OpenRLHF): served = the module's bf16 weight widened
(under ZeRO-3, as DeepSpeed's forward hook gathered it), master = the optimizer's fp32 partitions assembled a window of
parameters at a time (one collective per window, which every rank runs in the same module order).

At train begin the shared DeepSpeed copy-back patch (:func:`faircast_plugins.deepspeed.apply_deepspeed_patch`) is
attached to the trainer's engine with this caster: it advances the weight version at each optimizer step and writes
``fair_cast(master)`` into the bf16 weights, and it saves/restores per-rank Fair Cast state in DeepSpeed's checkpoint
folder (``global_stepN/faircast_state_rankNNNNN.pt``). Nothing is swapped and nothing else is cast here.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Optional

import torch

from . import INFO_FILE, Backend


class DeepSpeedBackend(Backend):
    policy_collective = True  # the master view assembles each master from every rank's partition
    def __init__(self, trainer, caster):
        super().__init__(trainer, caster)
        self.attached = None  # the DeepSpeedFairCast of the trainer's engine
        self._views = None  # the views of the measurement in progress (policy_scope)

    def begin(self, state, resume_dir: Optional[str]) -> None:
        from ...deepspeed import apply_deepspeed_patch
        from ...deepspeed.patch import STATE_FILE

        engine = self.trainer.deepspeed
        if self.attached is None or self.attached.engine is not engine:
            self.caster.set_version(state.global_step)  # a DeepSpeed resume then restores the saved state
            loaded = engine.__dict__.get("_faircast_loaded_from")  # remembered by the patched load_checkpoint
            fresh = False
            if loaded and self.config.keeps_state:
                path = os.path.join(loaded, STATE_FILE.format(rank=self.world()[0]))
                if not os.path.exists(path):
                    self.missing_state(path, state.global_step)  # refused unless asked for
                    engine.__dict__.pop("_faircast_loaded_from")
                    fresh = True
            self.attached = apply_deepspeed_patch(engine, self.caster, module=self.model())
            if fresh:
                self.attached.recast_after_load()
        if self.caster.version != state.global_step:
            raise RuntimeError(
                f"Fair Cast state restored from the DeepSpeed checkpoint is at weight version {self.caster.version} "
                f"but the trainer resumes at step {state.global_step}"
            )
        self.ready = True

    def after_step(self) -> None:
        pass  # the DeepSpeed patch advanced the version and cast inside the engine's step

    # -- the policy metrics' two views of the weights ---------------------------------------------------------
    def check_policy_metrics(self, trainer_name: str) -> None:
        self.caster.policy_measured = True  # the copy-back patch then accepts the option (every ZeRO stage)

    @contextmanager
    def policy_scope(self):
        """One measurement's views of the engine (each layout built once:
        :class:`~faircast_plugins.deepspeed.policy_views.DeepSpeedPolicyViews`), their scope yielding the probe's
        swap."""
        from ...deepspeed.policy_views import DeepSpeedPolicyViews

        self._views = DeepSpeedPolicyViews(self.trainer.deepspeed)
        try:
            with self._views.scope() as swap:
                yield swap
        finally:
            self._views = None

    def policy_views(self):
        """``(served, master)`` of the measurement; only inside :meth:`policy_scope`."""
        return self._views.served, self._views.master

    def saved_weights(self) -> str:
        return ("bf16 served copy (DeepSpeed's module weights; ZeRO-3 writes them only with "
                "stage3_gather_16bit_weights_on_model_save; fp32 masters and per-rank Fair Cast state are in the "
                "DeepSpeed checkpoint)")

    def save_state(self, output_dir: str) -> dict:
        return {}  # the Fair Cast state belongs to the DeepSpeed checkpoint (one file per rank, by the patch)

    def after_checkpoint(self, args, state) -> None:
        """Point the checkpoint's ``faircast.json`` at the per-rank state files DeepSpeed just wrote."""
        if not args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from ...deepspeed.patch import STATE_FILE

        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        info_path = os.path.join(checkpoint, INFO_FILE)
        tag = f"global_step{self.trainer.deepspeed.global_steps}"  # the Trainer saves with DeepSpeed's default tag
        if not (os.path.exists(info_path) and os.path.exists(os.path.join(checkpoint, tag, STATE_FILE.format(rank=0)))):
            return
        with open(info_path) as f:
            info = json.load(f)
        info["state"] = os.path.join(tag, STATE_FILE.replace("{rank:05d}", "*"))
        with open(info_path, "w") as f:
            json.dump(info, f, indent=2)
