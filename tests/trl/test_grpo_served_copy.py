"""GRPOTrainer without vLLM: both parts of Fair Cast, measured on the real TRL training loop.

Part 1: the copy that generates is fair_cast(master) at the current weight version.
Part 2: old log-probs and the loss run on that same copy, and the optimizer steps the fp32 master.
Negative control: with the flag off the model runs on the fp32 weights (autocast rounds them to nearest).
"""
from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from faircast_plugins.key import canonical_name
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


class RefAndMasterRecorder(TrainerCallback):
    """Added after the Fair Cast callback: the reference model at train begin and the masters after every step."""

    def __init__(self, trainer):
        self.trainer, self.ref0, self.masters = trainer, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.ref0 = [p.detach().clone() for p in self.trainer.ref_model.parameters()]

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.masters.append([self.trainer._faircast.masters[canonical_name(n)].clone()
                             for n, _ in model.named_parameters()])


def test_sync_ref_mixes_masters_and_a_second_train_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 14.21: TRL's SyncRefModelCallback mixes the fp32 masters (the trained policy) into the reference model,
    not the served copy. Issue 14.13: a real second train() would restart the weight version at 0: refused, while a
    train() that resumes from a checkpoint of this run goes on."""
    from faircast_plugins.patching import FairCastPatchError

    args = grpo_args(tmp_path / "out", max_steps=2, optim="sgd", learning_rate=1e-3, faircast=True, beta=0.1,
                     sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                     save_strategy="steps", save_steps=2)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    recorder = RefAndMasterRecorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    want = recorder.ref0
    for masters in recorder.masters:  # TRL's update, in the same order of operations
        want = [r.clone().mul_(0.5).add_(m, alpha=0.5) for r, m in zip(want, masters)]
    got = [p.detach() for p in trainer.ref_model.parameters()]
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "the reference must mix the fp32 masters"
    last = dict(zip(named_params(trainer), recorder.masters[-1]))
    assert any(not torch.equal(m, p.detach()) for m, p in zip(last.values(), named_params(trainer).values())), \
        "the masters differ from the served copy (the check is not vacuous)"

    masters = {n: m.clone() for n, m in trainer._faircast.masters.items()}
    with pytest.raises(FairCastPatchError, match=r"second train\(\).*weight version"):
        trainer.train()
    assert trainer._faircast.caster.version == 2
    assert all(torch.equal(trainer._faircast.masters[n], m) for n, m in masters.items())
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))  # negative control: a resume
    assert trainer._faircast.caster.version == trainer.state.global_step >= 2


def off_grid_model(model_dir, frozen=()):
    """The tiny policy in fp32, moved off the bf16 grid (a cast then changes something), with some parameters frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 3e-3 * p.abs().mean())
            if any(f in n for f in frozen):
                p.requires_grad_(False)
    return model


def test_frozen_cast_once_and_served_from_construction(tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 14.16: frozen parameters are cast once, round to nearest (how the engine loads them, and how DeepSpeed
    and FSDP cast them), never per version. Issue 14.21: the policy serves version 0 from construction on, so an
    evaluate() or an engine sync before train() sees the served copy. Issue 14.20: saving swaps no copies."""
    from safetensors.torch import load_file
    from trl import GRPOTrainer

    from conftest import cat_reward
    from faircast_plugins.trl.backends.fsdp import FSDPBackend
    from faircast_plugins.patching import FairCastPatchError

    frozen = ("model.norm.weight", "layers.0.self_attn.q_proj.weight")
    model = off_grid_model(tiny_model_dir, frozen)
    original = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    args = grpo_args(tmp_path / "out", max_steps=2, optim="sgd", learning_rate=1e-3, faircast=True,
                     faircast_mode="error_feedback")
    trainer = GRPOTrainer(model=model, reward_funcs=cat_reward, args=args, train_dataset=prompts_dataset)
    callback, params = trainer._faircast, named_params(trainer)
    is_frozen = {n: not p.requires_grad for n, p in params.items()}
    assert sum(is_frozen.values()) == 2
    # served from construction: version 0, error feedback with a zero residual is round to nearest
    for n, p in params.items():
        assert torch.equal(p.detach(), original[n].to(torch.bfloat16).float()), n
        assert torch.equal(callback.masters[n], original[n]), n
    assert any(not torch.equal(p.detach(), original[n]) for n, p in params.items())

    # saving points the parameters at the masters and back: no clone of the model
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    with callback.masters_in_params():
        assert all(p.data_ptr() == callback.masters[n].data_ptr() for n, p in params.items())
    assert {n: p.data_ptr() for n, p in params.items()} == ptrs

    trainer.train()
    assert callback.caster.version == 2
    residuals = callback.caster.state_dict()["error_feedback"]
    assert set(residuals) == {n for n in params if not is_frozen[n]}, "frozen parameters have no per-version state"
    for n, p in params.items():
        if is_frozen[n]:
            assert torch.equal(p.detach(), original[n].to(torch.bfloat16).float()), n  # cast once, never again
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert all(torch.equal(saved[n], callback.masters[n]) for n in params), "the save writes every fp32 master"
    assert all(torch.equal(saved[n], original[n]) for n in params if is_frozen[n])

    # DeepSpeed and FSDP attach when train() prepares the engine: before that, evaluate() and a sync are refused
    callback.backend = FSDPBackend(trainer, callback.caster)
    with pytest.raises(FairCastPatchError, match=r"evaluate\(\) before the first train\(\) is refused"):
        trainer.evaluate(eval_dataset=prompts_dataset)
    with pytest.raises(FairCastPatchError, match="weight sync"):
        list(callback.export(iter([("w", torch.zeros(2))])))


def test_audit_only_casts_only_the_sample(tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 14.20: audit-only casts the elements the audit samples, not the whole model, and reports the same
    metrics as casting everything (the sample positions are fixed)."""
    from faircast_plugins import FairCaster

    args = grpo_args(tmp_path / "out", faircast_audit=True, faircast_audit_sample=64)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    callback, params = trainer._faircast, named_params(trainer)
    reference = FairCaster(callback.config)  # casts every element
    reference.cast_many({n: p.detach() for n, p in params.items()})
    callback.on_train_begin(args, trainer.state, trainer.control)
    cast_elements = []
    for method in ("cast", "cast_many"):
        original = getattr(callback.caster, method)

        def counting(named, *a, _original=original, **kw):
            tensors = [a[0]] if isinstance(named, str) else list(named.values())
            cast_elements.extend(t.numel() for t in tensors)
            return _original(named, *a, **kw)

        setattr(callback.caster, method, counting)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the optimizer's steps, without training
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        callback.on_optimizer_step(args, trainer.state, trainer.control)
        reference.advance()
        reference.cast_many({n: p.detach() for n, p in params.items()})
    assert cast_elements and max(cast_elements) <= 64, max(cast_elements)
    assert sum(cast_elements) <= 3 * 64 * len(params) < 3 * sum(p.numel() for p in params.values()) // 10
    got, want = callback.metrics(), reference.metrics()
    assert got.keys() == want.keys() and "faircast/lag_steps" in got
    assert all(abs(got[k] - want[k]) <= 1e-12 * max(1.0, abs(want[k])) for k in want), (got, want)


def _log_steps(trainer, steps: int, lr: float = 1e-6):
    """Log ``steps`` optimizer steps through the patched ``Trainer.log``, without training: each moves every weight by
    ``lr`` (far below half a bf16 step), then logs TRL's mean reward, rising 0.01 a step."""
    callback, params = getattr(trainer, "_faircast", None), named_params(trainer)
    if callback is not None:
        callback.on_train_begin(trainer.args, trainer.state, trainer.control)
    trainer.model.train()
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in params.values():
                p.add_(lr)
        if callback is not None:
            callback.on_optimizer_step(trainer.args, trainer.state, trainer.control)
        trainer.state.global_step = step
        trainer.log({"reward": 0.2 + 0.01 * step})
    return trainer.state.log_history


def test_audit_logs_lag_cost_of_the_standard_export(tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 12.8: with the audit on and the flag off, the logs carry faircast/lag_cost = lag x reward slope, once half
    the window (25 of 50 steps) of rewards was logged; without the audit (flag on or off) there is none."""
    history = _log_steps(grpo_trainer(tiny_model_dir, prompts_dataset, grpo_args(tmp_path / "a", faircast_audit=True)), 30)
    assert not any("faircast/lag_cost" in h for h in history[:24])
    last = history[-1]
    assert last["faircast/lag_cost_window"] == 50.0
    assert last["faircast/reward_slope"] == pytest.approx(0.01)
    assert last["faircast/lag_steps"] > 1.0  # the round-to-nearest copy trails these small updates
    assert last["faircast/lag_cost"] == pytest.approx(last["faircast/lag_steps"] * 0.01)
    for name, flags in {"off": {}, "faircast_no_audit": {"faircast": True}}.items():
        history = _log_steps(grpo_trainer(tiny_model_dir, prompts_dataset, grpo_args(tmp_path / name, **flags)), 30)
        assert len(history) == 30 and not any("faircast/lag_cost" in h for h in history), name
