"""Shared helpers for the TRL tests: build trainers on the tiny model, and watch every forward."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from faircast_plugins import derive_key, fair_cast, sticky_key
from faircast_plugins.key import canonical_name

GRPO_DEFAULTS = dict(
    per_device_train_batch_size=4, num_generations=4, max_completion_length=8, use_cpu=True, beta=0.0,
    report_to="none", save_strategy="no", logging_steps=1, seed=0, data_seed=0, dataloader_num_workers=0,
    lr_scheduler_type="constant", warmup_steps=0,
)


def grpo_args(output_dir, **overrides):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(output_dir), **{**GRPO_DEFAULTS, **overrides})


def grpo_trainer(model_dir, dataset, args):
    from trl import GRPOTrainer

    from conftest import cat_reward

    return GRPOTrainer(model=model_dir, reward_funcs=cat_reward, args=args, train_dataset=dataset)


def named_params(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {canonical_name(n): p for n, p in model.named_parameters()}


def on_bf16_grid(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).float())


#: vLLM's fused parameters and the HF parameters they concatenate (dim 0)
FUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def expected_for(vllm_name: str, hf: dict) -> torch.Tensor:
    """The tensor vLLM's parameter ``vllm_name`` should hold, rebuilt from HF-named tensors (fusions concatenated)."""
    for fused, parts in FUSED.items():
        if fused in vllm_name:
            return torch.cat([hf[vllm_name.replace(fused, part)] for part in parts], dim=0)
    return hf[vllm_name]


def expected_served(master: torch.Tensor, *, seed: int, version: int, name: str, mode: str) -> torch.Tensor:
    """fair_cast of the master, keyed independently of the adapter (ROUNDING.md key schedule; sticky: version-free)."""
    cname = canonical_name(name)
    key = sticky_key(seed, cname) if mode == "sticky" else derive_key(seed, version, cname)
    return fair_cast(master, key=key, mode=mode, backend="torch")


class EngineCheck:
    """Compares a rollout engine's weights after each weight sync with what it must serve: fair_cast(master) at the
    trainer's current version with Fair Cast on; vLLM's round-to-nearest cast of the fp32 weights with it off.
    Subclasses read the engine (:meth:`engine_weights`: vLLM-named bf16 tensors) and call :meth:`check` after a sync."""

    def __init__(self, trainer, faircast: bool, seed: int):
        self.trainer, self.faircast, self.seed = trainer, faircast, seed
        self.syncs, self.mismatches, self.differs_from_rtn, self.compared = [], [], 0, 0

    def engine_weights(self):
        raise NotImplementedError

    def check(self) -> None:
        import pytest

        version = self.trainer.state.global_step
        params = named_params(self.trainer)
        if self.faircast:
            assert self.trainer._faircast.caster.version == version  # one weight version per optimizer step
            masters = self.trainer._faircast.masters
            hf = {n: expected_served(masters[n], seed=self.seed, version=version, name=n, mode="stochastic")
                  for n in params}
            rtn = {n: masters[n].to(torch.bfloat16) for n in params}
        else:
            hf = rtn = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        self.syncs.append(version)
        for name, got in self.engine_weights():
            if got.numel() == 0:
                pytest.skip(f"vLLM repacked {name} on this host (oneDNN/AMX): its weights cannot be compared bitwise")
            want = expected_for(name, hf)
            got = got[: want.shape[0]]
            self.compared += 1
            if got.dtype != torch.bfloat16 or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                self.mismatches.append((version, name))
            if not torch.equal(got.view(torch.int16), expected_for(name, rtn).view(torch.int16)):
                self.differs_from_rtn += 1


@dataclass
class ForwardLog:
    grad: int = 0        # forwards with autograd on (the loss)
    no_grad: int = 0     # forwards without (generation, old log-probs)
    off_grid: int = 0    # forwards that saw a parameter that is not bf16-representable
    mismatches: list = field(default_factory=list)  # (version, name) where params != fair_cast(master)


def watch_forwards(trainer, *, check_against_masters: bool, mode: str = "stochastic", seed: int = 0):
    """Check every forward of the policy's decoder: which weights did it run on?"""
    model = trainer.accelerator.unwrap_model(trainer.model)
    log = ForwardLog()

    def hook(module, args, kwargs):
        if torch.is_grad_enabled():
            log.grad += 1
        else:
            log.no_grad += 1
        params = named_params(trainer)
        if not all(on_bf16_grid(p.detach()) for p in params.values()):
            log.off_grid += 1
        if check_against_masters:
            callback = trainer._faircast
            version = trainer.state.global_step
            assert callback.caster.version == version
            for name, p in params.items():
                want = expected_served(callback.masters[name], seed=seed, version=version, name=name, mode=mode)
                if not torch.equal(p.detach(), want.float()):
                    log.mismatches.append((version, name))

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    return log, handle


class SGDStepRecorder(TrainerCallback):
    """Added after the Fair Cast callback: checks that plain SGD moved the fp32 value the optimizer holds.

    At ``on_pre_optimizer_step`` it records each parameter and its (clipped) gradient; at ``on_optimizer_step``
    it checks the master (Fair Cast on) or the parameter (off) equals ``before - lr * grad`` bit for bit.
    """

    def __init__(self, trainer, faircast: bool):
        self.trainer, self.faircast = trainer, faircast
        self.before, self.grads = {}, {}
        self.steps, self.failures, self.moved_off_grid = 0, [], 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        params = named_params(self.trainer)
        self.before = {n: p.detach().clone() for n, p in params.items()}
        self.grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        if self.faircast:  # the Fair Cast callback put the masters back just before the step
            for n, p in params.items():
                if not torch.equal(p.detach(), self.trainer._faircast.masters[n]):
                    self.failures.append(("param is not the master before the step", n))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.steps += 1
        lr = self.trainer.lr_scheduler.get_last_lr()[0]
        params = named_params(self.trainer)
        for n, g in self.grads.items():
            after = self.trainer._faircast.masters[n] if self.faircast else params[n].detach()
            want = self.before[n].add(g, alpha=-lr)
            if not torch.equal(after, want):
                self.failures.append(("master != before - lr*grad", n))
            if not on_bf16_grid(after):
                self.moved_off_grid += 1


def length_reward(completions, **kwargs):
    """A reward that differs between a prompt's completions (their length in characters), so that GRPO's advantages,
    hence its gradients, are not all zero on a real model (which rarely says the tiny suite's target word)."""
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]
