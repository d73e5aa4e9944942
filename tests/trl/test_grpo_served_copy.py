"""GRPOTrainer without vLLM: both parts of Fair Cast, measured on the real TRL training loop.

Part 1: the copy that generates is fair_cast(master) at the current weight version.
Part 2: old log-probs and the loss run on that same copy, and the optimizer steps the fp32 master.
Negative control: with the flag off the model runs on the fp32 weights (autocast rounds them to nearest).
"""
from __future__ import annotations

import pytest
import torch

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from helpers import SGDStepRecorder, grpo_args, grpo_trainer, named_params, on_bf16_grid, watch_forwards

# Two optimizer steps per generation batch (steps_per_generation=2, num_iterations=2) with gradient
# accumulation 2, so old log-probs are computed by a separate forward, and the model generates twice.
STEP_SHAPE = dict(gradient_accumulation_steps=2, num_iterations=2, max_steps=4, optim="sgd", learning_rate=1e-3)


def run(tiny_model_dir, prompts_dataset, tmp_path, *, check, mode="stochastic", **flags):
    args = grpo_args(tmp_path / "out", **STEP_SHAPE, **flags)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    forwards, handle = watch_forwards(trainer, check_against_masters=check, mode=mode, seed=args.faircast_seed)
    sgd = SGDStepRecorder(trainer, faircast=args.faircast)
    trainer.add_callback(sgd)
    trainer.train()
    handle.remove()
    return trainer, forwards, sgd


@pytest.mark.parametrize("mode", ["stochastic", "sticky", "nearest"])
def test_every_forward_runs_on_fair_cast_of_master(tiny_model_dir, prompts_dataset, tmp_path, mode):
    trainer, forwards, sgd = run(
        tiny_model_dir, prompts_dataset, tmp_path, check=True, mode=mode, faircast=True, faircast_mode=mode,
        faircast_seed=1234,
    )
    assert trainer.state.global_step == 4 and trainer._faircast.caster.version == 4
    # generation (no grad: 2 generations x several tokens), old log-probs (no grad) and the loss (grad) all ran
    assert forwards.grad >= 8 and forwards.no_grad >= 8, forwards
    assert forwards.mismatches == [], forwards.mismatches[:5]
    assert forwards.off_grid == 0
    # part 2: the optimizer stepped the fp32 master with the gradient taken at the served copy
    assert sgd.steps == 4 and sgd.failures == [], sgd.failures[:5]
    assert sgd.moved_off_grid > 0, "the masters should hold sub-bf16 precision the served copy does not"
    # after training the parameters hold the served copy at the final version
    assert all(on_bf16_grid(p.detach()) for p in named_params(trainer).values())


def test_error_feedback_serves_bf16_and_steps_master(tiny_model_dir, prompts_dataset, tmp_path):
    from faircast_plugins import FairCastConfig, FairCaster

    trainer, forwards, sgd = run(
        tiny_model_dir, prompts_dataset, tmp_path, check=False, faircast=True, faircast_mode="error_feedback"
    )
    assert forwards.off_grid == 0 and forwards.grad >= 8 and forwards.no_grad >= 8
    assert sgd.steps == 4 and sgd.failures == [] and sgd.moved_off_grid > 0
    # the residual state exists and was advanced once per version
    state = trainer._faircast.caster.state_dict()
    assert state["version"] == 4 and state["error_feedback"]
    assert all(s["version"] == 5 for s in state["error_feedback"].values())
    assert FairCaster(FairCastConfig(enabled=True, mode="error_feedback")).mode == "error_feedback"


def test_negative_control_flag_off_runs_on_fp32_master(tiny_model_dir, prompts_dataset, tmp_path):
    trainer, forwards, sgd = run(tiny_model_dir, prompts_dataset, tmp_path, check=False)
    assert not hasattr(trainer, "_faircast")
    assert forwards.grad >= 8 and forwards.no_grad >= 8
    # the checkpoint is bf16, so the first forwards are on the grid; once SGD moves the weights they are not
    assert forwards.off_grid > 0
    assert sgd.steps == 4 and sgd.failures == []
    assert not all(on_bf16_grid(p.detach()) for p in named_params(trainer).values())


def test_audit_only_changes_nothing_and_logs_metrics(tiny_model_dir, prompts_dataset, tmp_path):
    off, _, _ = run(tiny_model_dir, prompts_dataset, tmp_path / "off", check=False)
    audit, _, _ = run(tiny_model_dir, prompts_dataset, tmp_path / "audit", check=False, faircast_audit=True)
    assert audit._faircast.shadow is False
    p_off, p_audit = named_params(off), named_params(audit)
    assert all(torch.equal(p_off[n], p_audit[n]) for n in p_off), "audit-only must not change training"
    logged = [h for h in audit.state.log_history if "loss" in h]
    assert len(logged) == 4
    for key in ("faircast/served_changed_frac", "faircast/master_moved_frac", "faircast/lag_steps", "faircast/bias"):
        assert all(key in h for h in logged[1:]), (key, logged[-1])
    assert not any("faircast/lag_steps" in h for h in off.state.log_history)


def test_small_updates_lag_under_nearest_not_under_fair_cast(tiny_model_dir, prompts_dataset, tmp_path):
    """The metric a user sees: with updates far below half a bf16 step, round-to-nearest serves a stale copy."""
    small = dict(learning_rate=1e-5, max_steps=8, optim="sgd", gradient_accumulation_steps=1)
    lags = {}
    for name, flags in {"off": {}, "fair": {"faircast": True}}.items():
        args = grpo_args(tmp_path / name, **small, faircast_audit=True, **flags)
        trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
        trainer.train()
        values = [h["faircast/lag_steps"] for h in trainer.state.log_history if "faircast/lag_steps" in h]
        assert len(values) >= 6
        lags[name] = sum(values[-4:]) / 4
    assert lags["off"] > 1.0, lags   # the round-to-nearest copy trails by more than a step
    assert abs(lags["fair"]) < 0.5 * lags["off"], lags


def test_ema_serves_fair_cast_of_the_ema(tiny_model_dir, prompts_dataset, tmp_path):
    from faircast_plugins import derive_key, fair_cast

    args = grpo_args(tmp_path / "out", max_steps=3, optim="sgd", learning_rate=1e-3, faircast=True,
                     faircast_ema_decay=0.5, faircast_seed=5)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    forwards, handle = watch_forwards(trainer, check_against_masters=False)
    trainer.train()
    handle.remove()
    assert forwards.off_grid == 0 and forwards.grad > 0
    callback = trainer._faircast
    ema = callback.caster.state_dict()["ema"]
    params = named_params(trainer)
    assert set(ema) == set(params)
    differs = 0
    for name, p in params.items():
        want = fair_cast(ema[name], key=derive_key(5, 3, name), mode="stochastic", backend="torch")
        assert torch.equal(p.detach(), want.float()), name
        differs += not torch.equal(ema[name], callback.masters[name])
    assert differs > 0, "the EMA must lag the master"


def test_second_train_call_keeps_the_masters(tiny_model_dir, prompts_dataset, tmp_path):
    args = grpo_args(tmp_path / "out", max_steps=2, optim="sgd", learning_rate=1e-3, faircast=True)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    trainer.train()
    masters = {n: m.clone() for n, m in trainer._faircast.masters.items()}
    assert not all(on_bf16_grid(m) for m in masters.values())
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert all(torch.equal(trainer._faircast.masters[n], m) for n, m in masters.items())
