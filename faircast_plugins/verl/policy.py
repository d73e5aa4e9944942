"""``faircast/policy_*`` in verl's FSDP engine worker (``actor_rollout_ref.faircast.policy_metrics_every: N``).

At the start of ``update_actor`` -- before its first optimizer step, so the FSDP cast's served copy and the fp32
masters are the same weight version the rollout served -- the first ``policy_metrics_seqs`` sequences of the batch
this rank trains on are scored under the served copy and the master (:mod:`faircast_plugins.fsdp_policy`: FSDP1 or
FSDP2), at the batch's sampling temperature. ``update_actor`` may take several optimizer steps (mini-batches,
epochs); a measurement is taken at the first ``update_actor`` that starts at or after each multiple of N steps. The
rows are gathered over the ranks (a collective every rank runs, at the same calls) and returned in the metrics dict
verl logs under ``actor/`` (``actor/faircast/policy_kl``, ...).

The probe's forward is the HF model's own on padded sequences (prompt left-padded, response right-padded), with the
response's attention mask; the tokens counted are ``response_mask`` (not a tool's output).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ..policy_lag import PolicyLagProbe, gather_rows, metrics_of


@dataclass
class VerlPolicyProbe:
    """The probe of one verl actor engine and the weight version from which the next measurement is due."""

    probe: PolicyLagProbe
    next_due: int = 0
    measured: bool = field(default=False)  # rows were taken since the last metrics call (the same on every rank)

    @classmethod
    def of(cls, config) -> Optional["VerlPolicyProbe"]:
        if not config.measures_policy:
            return None
        return cls(PolicyLagProbe(config.policy_metrics_every, config.policy_metrics_seqs))

    def due(self, version: int) -> bool:
        return version >= self.next_due


def _padded(t: torch.Tensor, left: bool) -> torch.Tensor:
    """A nested (jagged) ``[B, *]`` tensor as a padded ``[B, max]`` one, padded on the left or the right."""
    rows = list(t.unbind()) if t.is_nested else list(t)
    width = max((r.shape[0] for r in rows), default=0)
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype if rows else torch.long,
                      device=rows[0].device if rows else None)
    for i, r in enumerate(rows):
        if left:
            out[i, width - r.shape[0]:] = r
        else:
            out[i, : r.shape[0]] = r
    return out


def probe_batch(data, seqs: int) -> Dict[str, torch.Tensor]:
    """The first ``seqs`` sequences of a verl training batch (the worker's ``TensorDict``, after verl's no-padding
    conversion or before it) as the probe's padded tensors: ``prompt_ids``/``prompt_mask`` (left-padded),
    ``completion_ids``/``completion_mask`` (right-padded; the response's attention mask) and ``count_mask`` (the
    response tokens the loss trains: ``response_mask``)."""
    prompts, responses = data["prompts"][:seqs], data["responses"][:seqs]
    count = data["response_mask"][:seqs]
    if prompts.is_nested or responses.is_nested:
        prompt_ids, completion_ids = _padded(prompts, left=True), _padded(responses, left=False)
        prompt_mask = _padded(torch.nested.nested_tensor([torch.ones_like(r) for r in prompts.unbind()]), True) \
            if prompts.is_nested else torch.ones_like(prompt_ids)
        completion_mask = _padded(torch.nested.nested_tensor([torch.ones_like(r) for r in responses.unbind()]),
                                  False) if responses.is_nested else torch.ones_like(completion_ids)
        count = _padded(count, left=False) if count.is_nested else count
        count = count[:, : completion_ids.shape[1]]
    else:
        attention = data["attention_mask"][:seqs]
        width = prompts.shape[1]
        prompt_ids, completion_ids = prompts, responses
        prompt_mask, completion_mask = attention[:, :width], attention[:, width:]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(prompt_ids.dtype),
            "completion_ids": completion_ids, "completion_mask": completion_mask.to(completion_ids.dtype),
            "count_mask": count.to(completion_ids.dtype) * completion_mask.to(completion_ids.dtype)}


def _device(module) -> torch.device:
    """Where the module's (loaded) shards live: the probe's inputs go there."""
    p = next(module.parameters())
    return (p.to_local() if hasattr(p, "to_local") else p).device


def measure(engine, policy: VerlPolicyProbe, version: int, data) -> None:
    """At the start of ``update_actor``: score the batch's first sequences when a measurement is due (every rank
    decides the same, from the weight version; the forwards' collectives pair up)."""
    if not policy.due(version):
        return
    from verl.utils import tensordict_utils as tu

    from ..fsdp_policy import FSDPPolicyViews

    every = policy.probe.every
    policy.next_due = (version // every + 1) * every
    temperature = float(tu.get_non_tensor_data(data=data, key="temperature", default=1.0) or 1.0)
    batch = probe_batch(data, policy.probe.seqs)
    with engine.eval_mode():  # verl loads offloaded parameters here, and reshards the root FSDP unit after
        device = _device(engine.module)
        batch = {k: v.to(device) for k, v in batch.items()}
        views = FSDPPolicyViews(engine.module)
        with views.scope():
            policy.probe.measure(engine.module, version, batch["prompt_ids"], batch["prompt_mask"],
                                 batch["completion_ids"], batch["completion_mask"], count_mask=batch["count_mask"],
                                 served=views.served, master=views.master, swap=views.swapped,
                                 temperature=temperature)
    policy.measured = True


def metrics(policy: VerlPolicyProbe) -> Dict[str, float]:
    """The measured rows, gathered from every rank (a collective: every rank calls it after the same
    ``update_actor``), as ``faircast/policy_*``; nothing when no measurement was taken."""
    if not policy.measured:
        return {}
    policy.measured = False
    return metrics_of(gather_rows(policy.probe.take()))


__all__ = ["VerlPolicyProbe", "measure", "metrics", "probe_batch"]
