"""``faircast/policy_*`` in OpenRLHF's policy actor (``--faircast.policy_metrics_every N``): what the served copy's
distance from the fp32 master costs the batch (:mod:`faircast_plugins.policy_lag`), on DeepSpeed ZeRO-0/1/2/3.

Where it measures: ``ActorPPOTrainer.training_step(experience, ...)`` (``openrlhf/trainer/ray/ppo_actor.py``, 0.11.2)
trains the policy on one micro-batch of ``Experience``. :func:`install` wraps that method on the actor's own trainer
instance (inside the Ray worker, from the shipped ``init_model_from_pretrained``), so that on the first micro-batch of
every N-th optimizer step (``engine.global_steps``, the steps taken: DeepSpeed steps at the accumulation boundary),
before the update, the first ``seqs`` sequences are scored under both views of the weights
(:mod:`faircast_plugins.deepspeed.policy_views`: the module's bf16 weight, i.e. the served copy, and DeepSpeed's fp32
master). Served copy and master are then the same weight version.

The tokens, scored like ``Actor.forward``: ``sequences`` ``[B, T]``, attended by the Experience's ``attention_mask``
``[B, T]`` (every prompt, action and observation token; 0 only on padding), positions from that mask, logits at
``--rollout.temperature``; counted by ``action_mask`` ``[B, A]``, which covers the last ``A`` tokens. In 0.11.2
(``SamplesGenerator._process_response_into_experience``) ``A = T - 1``: the mask spans the whole sequence after its
first token, 0 on the prompt and on the observations between a multi-turn rollout's actions. So the probe's "prompt" is
the first ``T - A`` tokens, and what it attends never comes from ``action_mask`` (which would hide the prompt and the
observations from the context). Every rank runs the probe on the same step (the master view and ZeRO-3's gathers are
collectives; OpenRLHF gives every rank the same number of micro-batches).

Logged: :func:`take_metrics` (from the patched ``fit``) adds the rows gathered over ranks to the status dict
``fit`` returns, which OpenRLHF's trainer logs like the ``--faircast.audit`` metrics.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

from ..patching import FairCastPatchError
from ..policy_lag import PolicyLagProbe, gather_rows, metrics_of

#: where the probe lives on the policy's DeepSpeed engine
PROBE_ATTR = "_faircast_policy_probe"


def refusal(get) -> Optional[str]:
    """Why ``--faircast.policy_metrics_every`` cannot be measured with this run's OpenRLHF options (None if it can);
    ``get(dotted, default)`` reads one option."""
    ring = get("ds.ring_attn_size", 1) or 1
    if ring > 1:
        return (f"--faircast.policy_metrics_every is not supported with ring attention (--ds.ring_attn_size {ring}): "
                f"every rank of a ring group holds the same sequences, which the probe would count {ring} times. Use "
                f"--ds.ring_attn_size 1, or --faircast.policy_metrics_every 0 (--faircast.audit's faircast/lag_steps "
                f"measures the lag in weight space)")
    return None


def attach(actor, config) -> PolicyLagProbe:
    """Give the policy's DeepSpeed engine (``actor.model`` of OpenRLHF's ``Actor``) its probe."""
    if getattr(actor, "is_vlm", False):
        raise FairCastPatchError(
            "--faircast.policy_metrics_every is not supported for vision-language policies: the probe scores the text "
            "tokens without the multimodal inputs. Use --faircast.policy_metrics_every 0")
    probe = PolicyLagProbe(config.policy_metrics_every, config.policy_metrics_seqs)
    actor.model.__dict__[PROBE_ATTR] = probe
    return probe


def measure(engine, experience, temperature: float) -> None:
    """On the steps it is due, score the first sequences of ``experience`` under the served copy and the master."""
    probe = engine.__dict__.get(PROBE_ATTR)
    step = int(engine.global_steps)
    if probe is None or not probe.due(step):
        return
    from ..deepspeed.policy_views import DeepSpeedPolicyViews

    sequences, attention_mask, action_mask = experience.sequences, experience.attention_mask, experience.action_mask
    actions = action_mask.shape[1]  # the last tokens (0.11.2: all but the first); attended by attention_mask
    views = DeepSpeedPolicyViews(engine)  # this measurement's: each layout built once
    with views.scope() as swap:
        probe.measure(engine.module, step, sequences[:, :-actions], attention_mask[:, :-actions],
                      sequences[:, -actions:], attention_mask[:, -actions:], count_mask=action_mask.long(),
                      served=views.served, master=views.master, temperature=temperature, mask_positions=True,
                      collective=True, swap=swap)


def install(policy_actor) -> None:
    """Measure inside ``policy_actor.trainer.training_step`` (the instance's method), before each due update."""
    trainer = policy_actor.trainer
    original = trainer.training_step
    if getattr(original, "_faircast_policy", False):
        return
    engine = policy_actor.actor.model
    temperature = float(getattr(getattr(trainer.args, "rollout", None), "temperature", 1.0) or 1.0)

    @functools.wraps(original)
    def training_step(experience, *args, **kwargs):
        measure(engine, experience, temperature)
        return original(experience, *args, **kwargs)

    training_step._faircast_policy = True
    trainer.training_step = training_step


def take_metrics(engine) -> Dict[str, float]:
    """The ``faircast/policy_*`` metrics since the last call, every rank's rows (a collective: every rank calls it)."""
    probe = engine.__dict__.get(PROBE_ATTR)
    return metrics_of(gather_rows(probe.take())) if probe is not None else {}


__all__ = ["attach", "install", "measure", "refusal", "take_metrics"]
