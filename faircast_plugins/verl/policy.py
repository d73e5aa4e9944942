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

from ..patching import FairCastPatchError
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
        """Whether an ``update_actor`` starting at weight ``version`` measures: the first one at or after each multiple
        of ``every`` steps (one may take several steps). True moves the next due version on."""
        if version < self.next_due:
            return False
        every = self.probe.every
        self.next_due = (version // every + 1) * every
        return True


def _rows(t: torch.Tensor, n: int) -> list:
    """The first ``n`` rows of a ``[B, *]`` tensor, nested (jagged: no slicing on dim 0) or not."""
    return list(t.unbind())[:n] if t.is_nested else list(t[:n])


def _padded(rows: list, width: int, left: bool, ones: bool = False) -> torch.Tensor:
    """Rows of different lengths as one ``[n, width]`` tensor, padded with zeros on the left or the right (``ones``:
    the rows' attention mask instead of the rows)."""
    out = torch.zeros(len(rows), width, dtype=torch.long if ones else rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        value = torch.ones_like(r, dtype=out.dtype) if ones else r
        if left:
            out[i, width - r.shape[0]:] = value
        else:
            out[i, : r.shape[0]] = value
    return out


#: the option that turns the probe on (what a refusal tells the user to remove)
POLICY_OPTION = "actor_rollout_ref.faircast.policy_metrics_every"


def _refuse_vision_language(data) -> None:
    """The probe's forward takes ids and attention masks only: a vision-language batch (``multi_modal_inputs``, or
    mrope's multi-dimensional ``position_ids``) would be scored without its images, its placeholders as text."""
    keys = set(data.keys())
    what = None
    if "multi_modal_inputs" in keys:
        what = "multi_modal_inputs (images or video)"
    elif "position_ids" in keys and data["position_ids"].dim() > 2:
        what = f"{data['position_ids'].dim()}-dimensional position_ids (mrope)"
    if what is not None:
        raise FairCastPatchError(
            f"{POLICY_OPTION}: this batch carries {what}: a vision-language policy, which the probe (the HF "
            f"model's forward on ids and attention masks only) would score without its images. Not supported on "
            f"verl's FSDP engines; remove {POLICY_OPTION}.")


def probe_batch(data, seqs: int) -> Dict[str, torch.Tensor]:
    """The first ``seqs`` sequences of a verl training batch (the worker's ``TensorDict``, after verl's no-padding
    conversion or before it) as the probe's padded tensors: ``prompt_ids``/``prompt_mask`` (left-padded),
    ``completion_ids``/``completion_mask`` (right-padded; the response's attention mask) and ``count_mask`` (the
    response tokens the loss trains: ``response_mask``). Padded ``prompts``/``responses`` take their masks from
    ``attention_mask``; nested (jagged) ones are their own valid tokens. A vision-language batch is refused
    (:class:`FairCastPatchError`)."""
    _refuse_vision_language(data)
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested or responses.is_nested:
        p_rows, r_rows = _rows(prompts, seqs), _rows(responses, seqs)
        p_width, r_width = max(r.shape[0] for r in p_rows), max(r.shape[0] for r in r_rows)
        prompt_ids, prompt_mask = _padded(p_rows, p_width, True), _padded(p_rows, p_width, True, ones=True)
        completion_ids = _padded(r_rows, r_width, False)
        completion_mask = _padded(r_rows, r_width, False, ones=True)
        count = data["response_mask"]
        count = _padded(_rows(count, seqs), r_width, False) if count.is_nested else count[:seqs, :r_width]
    else:
        attention = data["attention_mask"][:seqs]
        width = prompts.shape[1]
        prompt_ids, completion_ids = prompts[:seqs], responses[:seqs]
        prompt_mask, completion_mask = attention[:, :width], attention[:, width:]
        count = data["response_mask"][:seqs]
    dtype = completion_ids.dtype
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(dtype), "completion_ids": completion_ids,
            "completion_mask": completion_mask.to(dtype), "count_mask": count.to(dtype) * completion_mask.to(dtype)}


def _device(module) -> torch.device:
    """Where FSDP computes the module's forward: the probe's inputs go there. Not where the shards are stored: with
    CPU offload (FSDP2's ``CPUOffloadPolicy``, verl's ``actor.fsdp_config.offload_policy``; FSDP1's
    ``CPUOffload``) they stay on the host, and the master forward runs without FSDP's hook that would move the
    inputs. FSDP2: its state's device (the mesh's); FSDP1: the unit's ``compute_device``; neither: the first
    parameter's local tensor."""
    from torch.distributed.fsdp import FSDPModule

    from ..fsdp import fsdp1_modules

    for m in module.modules():
        if isinstance(m, FSDPModule):
            return m._get_fsdp_state()._device
    for unit in fsdp1_modules(module):
        if getattr(unit, "compute_device", None) is not None:
            return unit.compute_device
    p = next(module.parameters())
    return (p.to_local() if hasattr(p, "to_local") else p).device


def measure(engine, policy: VerlPolicyProbe, version: int, data) -> None:
    """At the start of ``update_actor``: score the batch's first sequences when a measurement is due (every rank
    decides the same, from the weight version; the forwards' collectives pair up)."""
    if not policy.due(version):
        return
    from verl.utils import tensordict_utils as tu

    from ..fsdp_policy import FSDPPolicyViews

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
                                 temperature=temperature, collective=True)  # FSDP's gathers: as many forwards per rank
    policy.measured = True


def metrics(policy: VerlPolicyProbe) -> Dict[str, float]:
    """The measured rows, gathered from every rank (a collective: every rank calls it after the same
    ``update_actor``), as ``faircast/policy_*``; nothing when no measurement was taken."""
    if not policy.measured:
        return {}
    policy.measured = False
    return metrics_of(gather_rows(policy.probe.take()))


__all__ = ["VerlPolicyProbe", "measure", "metrics", "probe_batch"]
