"""Issue 12.8: the trainer actor's logging step adds ``faircast/lag_cost`` (lag x slope of ``rollout/reward_mean``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.lag_cost_checks import STEPS, assert_lag_cost_logged, assert_no_lag_cost


class Recorder:
    def __init__(self):
        self.logged = []

    def log_train(self, global_step, logs_dict):
        self.logged.append((global_step, dict(logs_dict)))


def _trainer_logs(policy_status, steps=STEPS):
    """Run OpenRLHF's real ``save_logs_and_checkpoints``, as the patched (shipped) trainer classes hold it, on a stub
    trainer for ``steps`` steps (mean reward rising 0.01 a step)."""
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.ppo_trainer_async import TrainingActor

    from faircast_plugins.openrlhf import policy

    policy.patch_policy_actor()
    try:
        shipped = [cls.__ray_metadata__.modified_class.save_logs_and_checkpoints for cls in (PPOTrainer, TrainingActor)]
        assert shipped == [policy.save_logs_and_checkpoints] * 2
        wandb = Recorder()
        trainer = SimpleNamespace(args=SimpleNamespace(logger=SimpleNamespace(logging_steps=1),
                                                       ckpt=SimpleNamespace(save_steps=10**9)),
                                  wandb_logger=wandb, tensorboard_logger=None)
        for step in range(1, steps + 1):
            status = {"rollout/reward_mean": 0.2 + 0.01 * step, "policy_loss": 0.1, **policy_status(step)}
            shipped[0](trainer, step, status, {"global_step": step})
    finally:
        policy.POLICY_PATCHES.remove()
    return wandb.logged


def test_trainer_logs_lag_cost_with_the_audit():
    logged = _trainer_logs(lambda step: {"faircast/version": float(step), "faircast/lag_steps": 20.0})
    assert_lag_cost_logged(logged, 20.0, prefix="")


@pytest.mark.parametrize("policy_status", [
    lambda step: {},  # no Fair Cast metrics from the policy
    lambda step: {"faircast/version": float(step)},  # Fair Cast on, audit off: no lag, no cost
], ids=["off", "no_audit"])
def test_no_lag_no_lag_cost(policy_status):
    logged = _trainer_logs(policy_status)
    assert_no_lag_cost(logged)
