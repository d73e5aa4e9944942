"""faircast_plugins.openrlhf.policy_probe without an engine: refusals, the wrapper of training_step, when it measures."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from faircast_plugins import FairCastConfig
from faircast_plugins.openrlhf import policy_probe
from faircast_plugins.patching import FairCastPatchError

CONFIG = FairCastConfig(policy_metrics_every=2, policy_metrics_seqs=3)


def _actor(is_vlm=False):
    engine = SimpleNamespace(global_steps=0, module=object(), zero_optimization_stage=lambda: 2)
    return SimpleNamespace(model=engine, is_vlm=is_vlm)


def test_vision_language_policies_are_refused_naming_the_option():
    with pytest.raises(FairCastPatchError, match="--faircast.policy_metrics_every is not supported for vision-language"):
        policy_probe.attach(_actor(is_vlm=True), CONFIG)


def test_ring_attention_is_refused_naming_the_option():
    assert policy_probe.refusal(lambda dotted, default: default) is None
    why = policy_probe.refusal(lambda dotted, default: 4 if dotted == "ds.ring_attn_size" else default)
    assert "--ds.ring_attn_size 4" in why and "--faircast.policy_metrics_every 0" in why


def test_the_wrapped_training_step_measures_on_due_steps_before_the_update():
    """Due at optimizer steps 0, 2, 4 (every 2), once per step (two micro-batches per step here), before OpenRLHF's own
    training_step, on the Experience's prompt / response split by ``action_mask``, at the rollout temperature, with
    positions from the mask and as many forwards on every rank; installing twice wraps once."""
    import torch

    actor = _actor()
    probe = policy_probe.attach(actor, CONFIG)
    assert (probe.every, probe.seqs) == (2, 3)
    calls = []

    def measure(model, step, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        probe.measured_step = step  # as PolicyLagProbe.measure does
        calls.append(("measure", step, tuple(prompt_ids.shape), tuple(completion_ids.shape), kw["temperature"],
                      kw["mask_positions"], kw["collective"], bool(torch.equal(completion_mask, experience.action_mask.long()))))

    probe.measure = measure

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        calls.append(("train", actor.model.global_steps))
        return {"step": step}

    args = SimpleNamespace(rollout=SimpleNamespace(temperature=0.7))
    holder = SimpleNamespace(actor=actor, trainer=SimpleNamespace(training_step=training_step, args=args))
    policy_probe.install(holder)
    policy_probe.install(holder)  # idempotent
    experience = SimpleNamespace(sequences=torch.zeros(4, 12, dtype=torch.long), attention_mask=torch.ones(4, 12),
                                 action_mask=torch.ones(4, 5, dtype=torch.bool))
    for micro in range(6):
        assert holder.trainer.training_step(experience, 0.0, micro) == {"step": micro}
        if micro % 2 == 1:
            actor.model.global_steps += 1
    measured = ("measure", (4, 7), (4, 5), 0.7, True, True, True)
    assert calls == [(measured[0], 0, *measured[1:]), ("train", 0), ("train", 0), ("train", 1), ("train", 1),
                     (measured[0], 2, *measured[1:]), ("train", 2), ("train", 2)]
