"""What each training backend does for Fair Cast under TRL: one small class per backend.

* :class:`~.plain.ShadowMasters` -- one process or DDP: the fp32 parameters hold the served copy, the masters are
  kept aside (also the audit-only mode of every backend without DeepSpeed or FSDP);
* :class:`~.deepspeed.DeepSpeedBackend` -- DeepSpeed bf16: the shared DeepSpeed copy-back patch writes the served
  copy into the module's bf16 weights;
* :class:`~.fsdp.FSDPBackend` -- FSDP2 bf16: the shared FSDP cast patches make FSDP's bf16 cast of each shard the
  served copy.

:class:`Backend` is what they share: the points of the lifecycle that :class:`~faircast_plugins.trl.FairCastCallback`
calls (``prepare`` at construction, ``begin`` at train begin, ``before_step``/``after_step`` around each optimizer
step, ``export``, ``save_state``) and the one rule for a resume from a checkpoint without Fair Cast state.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager, nullcontext
from typing import Dict, Iterator, Optional, Tuple

import torch

from ...caster import FairCaster
from ...export import STATE_FILE
from ...audit import reduce_metrics
from ...key import canonical_name
from ...patching import FairCastPatchError

logger = logging.getLogger("faircast_plugins")

RESUME_OPTION = "faircast_resume_without_state"
#: the JSON record (seed, mode, version) written next to every saved model
INFO_FILE = "faircast.json"


def state_what(config) -> str:
    if config.effective_mode == "error_feedback":
        return "faircast_mode=error_feedback (its residuals)"
    return f"faircast_ema_decay={config.ema_decay} (the EMA of the master)"


class Backend:
    """One backend's side of the Fair Cast lifecycle. Subclasses override what they do differently."""

    #: the policy's own parameters hold the served copy (one process or DDP with Fair Cast on)
    shadow = False
    #: the policy probe's forwards communicate (its views or the model's hooks): every rank runs as many
    policy_collective = False

    def __init__(self, trainer, caster: FairCaster):
        self.trainer, self.caster, self.config = trainer, caster, caster.config
        self.ready = False  # Fair Cast acts on the forwards and the export from now on
        self.masters: Dict[str, torch.Tensor] = {}

    def model(self) -> torch.nn.Module:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def world(self) -> Tuple[int, int]:
        """``(rank, world size)`` of the trainer's processes."""
        accelerator = self.trainer.accelerator
        return accelerator.process_index, accelerator.num_processes

    def fp32_params(self) -> Dict[str, torch.nn.Parameter]:
        """The policy's floating-point parameters by canonical name; a clear ``TypeError`` unless all are fp32."""
        params = {canonical_name(n): p for n, p in self.model().named_parameters() if p.is_floating_point()}
        bad = sorted(n for n, p in params.items() if p.dtype != torch.float32)
        if bad:
            raise TypeError(
                f"Fair Cast needs fp32 master weights, but {len(bad)} parameter(s) are "
                f"{params[bad[0]].dtype} (e.g. {bad[0]}). Load the policy in fp32 (the GRPO/RLOO default; "
                f"model_init_kwargs={{'dtype': 'float32'}}) and keep bf16=True for bf16 compute."
            )
        return params

    # -- lifecycle ------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """When the trainer is built (no engine yet): refuse what cannot work."""

    def begin(self, state, resume_dir: Optional[str]) -> None:
        """At train begin: attach to the engine, restore a resume's Fair Cast state, serve the current version."""
        raise NotImplementedError

    def before_step(self) -> None:
        """Just before the optimizer step."""

    def after_step(self) -> None:
        """Just after the optimizer step: advance the weight version and serve it."""
        raise NotImplementedError

    # -- export and generation ------------------------------------------------------------------------------
    @property
    def serves_export(self) -> bool:
        """Whether a rollout engine's ``(name, tensor)`` stream must be replaced by the served copy."""
        return False

    def export(self, stream) -> Iterator:
        """The stream a rollout engine receives, as the served copy."""
        yield from stream

    def bf16_generation(self):
        """Around TRL's continuous-batching generation (which casts the policy to bf16 in place, and never back):
        puts every floating buffer (e.g. rotary ``inv_freq``) back to the tensor it held before."""
        return restoring_buffers(self.model())

    def masters_in_params(self):
        """While saving: the parameters hold the fp32 masters."""
        return nullcontext()

    # -- checkpoints ----------------------------------------------------------------------------------------
    def saved_weights(self) -> str:
        raise NotImplementedError

    def save_state(self, output_dir: str) -> dict:
        """Write this backend's Fair Cast state files (called on every rank); returns entries for faircast.json."""
        if self.trainer.args.should_save:
            from ...export import save_state

            save_state(self.caster, output_dir)  # faircast_state.pt, the file `faircast export --state` reads
        return {}

    def after_checkpoint(self, args, state) -> None:
        """After the Trainer wrote a checkpoint (every file of it)."""

    def load_state(self, directory: str) -> Optional[str]:
        """Restore the Fair Cast state saved in ``directory``; returns the missing file's path, or None."""
        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return path
        self.caster.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        logger.warning("Fair Cast: restored state (weight version %d) from %s", self.caster.version, path)
        return None

    def restore(self, directory: Optional[str], step: int) -> None:
        """Set the weight version to ``step``, restoring the state of a resume from ``directory``."""
        if directory:
            missing = self.load_state(directory)
            if missing is None:
                if self.caster.version != step:
                    raise RuntimeError(
                        f"Fair Cast state in {directory} is at weight version {self.caster.version} but the trainer "
                        f"resumes at step {step}"
                    )
                return
            self.missing_state(missing, step)
        self.caster.set_version(step)

    def missing_state(self, path: str, step: int) -> None:
        """A resume without Fair Cast state, the same on every backend: refused when the mode keeps per-element state
        (starting it fresh would not reproduce the run) unless ``faircast_resume_without_state=True`` asks for it."""
        if self.config.keeps_state and not getattr(self.trainer.args, RESUME_OPTION, False):
            raise FairCastPatchError(
                f"resuming at step {step} with {state_what(self.config)} needs the Fair Cast state {path}, which does "
                f"not exist (a checkpoint written without Fair Cast, with another mode, or by a plugin version that did "
                f"not save it); starting the state fresh would not reproduce the run. Set {RESUME_OPTION}=True to "
                f"start it fresh on purpose."
            )
        if self.config.enabled:
            logger.warning("Fair Cast: resuming at step %d without %s; Fair Cast state (error-feedback residuals, EMA) "
                           "starts fresh at weight version %d", step, path, step)
        self.caster.load_state_dict(FairCaster(self.config, version=step).state_dict())  # fresh, at this version

    # -- metrics --------------------------------------------------------------------------------------------
    def check_policy_metrics(self, trainer_name: str) -> None:
        """At construction with ``faircast_policy_metrics_every``: refuse a backend that has no weight views for it."""
        raise FairCastPatchError(
            f"{trainer_name}(faircast_policy_metrics_every=...) is not supported under {type(self).__name__} yet: it "
            f"scores the batch under the served copy and the fp32 master, which this backend does not hold as separate "
            f"weights. Use one process or DDP, or set faircast_policy_metrics_every=0 (faircast_audit's "
            f"faircast/lag_steps measures the lag in weight space on every backend)."
        )

    def policy_views(self):
        """``(served, master)``: parameter -> tensor functions (None: the parameter as it is) for
        :class:`~faircast_plugins.policy_lag.PolicyLagProbe`."""
        raise NotImplementedError

    def policy_scope(self):
        """Around one measurement: a context that yields the probe's ``swap`` (None: the default
        :func:`~faircast_plugins.policy_lag.weights_swapped`, over each module's own parameters); e.g. DeepSpeed
        ZeRO-3 forgets its prefetch trace afterwards."""
        return nullcontext(None)

    def metrics(self) -> Dict[str, float]:
        """Summed over ranks (:func:`audit.reduce_metrics`: a collective when distributed; every rank calls
        ``Trainer.log``)."""
        return reduce_metrics(self.caster, device=self.trainer.accelerator.device)


@contextmanager
def restoring_buffers(model: torch.nn.Module):
    """Put every floating buffer of ``model`` back to the tensor it held before (TRL's in-place cast replaces them)."""
    buffers = [(module, name, buf) for module in model.modules()
               for name, buf in module.named_buffers(recurse=False) if buf.is_floating_point()]
    try:
        yield
    finally:
        for module, name, buf in buffers:
            setattr(module, name, buf)


def backend_for(trainer, caster: FairCaster) -> Backend:
    """The backend the trainer runs on (decided when the trainer is built)."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        from .deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(trainer, caster)
    if getattr(trainer, "is_fsdp_enabled", False):
        from .fsdp import FSDPBackend

        return FSDPBackend(trainer, caster)
    from .plain import ShadowMasters

    return ShadowMasters(trainer, caster)
