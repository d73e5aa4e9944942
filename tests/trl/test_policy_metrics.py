"""faircast_policy_metrics_every on a real GRPOTrainer (one process): faircast/policy_* in TRL's logs."""
from __future__ import annotations

import pytest
import torch

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from faircast_plugins.patching import FairCastPatchError
from faircast_plugins.policy_lag import ESS_KEY, KL_KEY, SEQS_KEY, TOKENS_KEY, sequence_stats, summarize
from helpers import grpo_args, grpo_trainer, named_params

# Updates far below half a bf16 step (plain SGD at 1e-5 on the tiny model): the standard export's lag piles up.
SMALL = dict(learning_rate=1e-5, optim="sgd", gradient_accumulation_steps=1, max_steps=5)


def _policy_logs(trainer):
    return [h for h in trainer.state.log_history if KL_KEY in h]


def test_flag_off_logs_the_round_to_nearest_lag_and_changes_nothing(tiny_model_dir, prompts_dataset, tmp_path):
    runs = {}
    for name, flags in {"plain": {}, "probe": {"faircast_policy_metrics_every": 2,
                                              "faircast_policy_metrics_seqs": 3}}.items():
        trainer = grpo_trainer(tiny_model_dir, prompts_dataset, grpo_args(tmp_path / name, **SMALL, **flags))
        trainer.train()
        runs[name] = trainer
    logs = _policy_logs(runs["probe"])
    assert [h["step"] for h in logs] == [1, 3, 5]  # measured before steps 0, 2, 4; logged with the next log
    assert all(h[SEQS_KEY] == 3 and h[TOKENS_KEY] > 0 for h in logs)
    # step 0: the fp32 masters are the bf16 checkpoint, so round to nearest serves them exactly
    assert logs[0][KL_KEY] == 0.0 and logs[0][ESS_KEY] == 1.0
    # later: sub-half-ulp updates the served copy does not see
    assert all(h[KL_KEY] > 0 and h[ESS_KEY] < 1 for h in logs[1:])
    assert not _policy_logs(runs["plain"])
    # the probe perturbs nothing: the same weights, bit for bit, as the run without it
    plain, probed = named_params(runs["plain"]), named_params(runs["probe"])
    assert all(torch.equal(plain[n], probed[n]) for n in plain)


def test_fair_cast_on_measures_its_noise_against_the_masters(tiny_model_dir, prompts_dataset, tmp_path):
    args = grpo_args(tmp_path / "on", **SMALL, faircast=True, faircast_policy_metrics_every=1,
                     faircast_policy_metrics_seqs=2)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    trainer.train()
    logs = _policy_logs(trainer)
    assert len(logs) == 5 and all(h[SEQS_KEY] == 2 for h in logs)
    # the served copy's rounding noise (the tiny random model's outputs are nearly uniform: some steps' logits do not
    # move at all, an independent forward of both copies agrees, so not every step shows it)
    assert logs[0][KL_KEY] == 0.0 and sum(h[KL_KEY] > 0 for h in logs[1:]) >= 2
    assert all(0.5 <= h[ESS_KEY] <= 1 for h in logs)

    # The probe's numbers equal an independent computation: a model holding the masters, one holding the served copy.
    # Fresh models from the checkpoint (no accelerate wrapper: a plain fp32 forward), loaded with each copy.
    from transformers import AutoModelForCausalLM

    callback = trainer._faircast
    served_model, master_model = (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
                                  for _ in range(2))
    with torch.no_grad():
        for n, p in named_params(trainer).items():
            dict(served_model.named_parameters())[n].copy_(p)  # the parameters hold the served copy
            dict(master_model.named_parameters())[n].copy_(callback.masters[n])
    g = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(0, 50, (2, 3), generator=g), "prompt_mask": torch.ones(2, 3, dtype=torch.long),
             "completion_ids": torch.randint(0, 50, (2, 6), generator=g),
             "completion_mask": torch.ones(2, 6, dtype=torch.long)}
    callback.policy.measured_step = None
    callback.measure_policy(batch, 0, temperature=0.9)
    got = summarize(callback.policy.take())
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    with torch.no_grad():
        s = served_model(input_ids=ids).logits[:, 2:-1].float()
        m = master_model(input_ids=ids).logits[:, 2:-1].float()
    want = summarize(sequence_stats(s, m, batch["completion_ids"], batch["completion_mask"], 0.9))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert got[KL_KEY] > 0  # (on this batch the two copies' logits differ)


def test_backends_without_two_views_refuse_at_construction():
    from faircast_plugins.trl.backends import Backend

    with pytest.raises(FairCastPatchError, match="faircast_policy_metrics_every=0"):
        Backend.__new__(Backend).check_policy_metrics("GRPOTrainer")


def test_deepspeed_marks_the_caster_at_every_zero_stage():
    """ZeRO-0..3 measure the policy metrics (ZeRO-3 was refused before the views ran inside its gather/release hooks:
    tests/trl/test_deepspeed.py runs it); the backend's probe forwards are collectives."""
    from types import SimpleNamespace

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.trl.backends.deepspeed import DeepSpeedBackend

    for stage in (0, 1, 2, 3):
        state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage))
        trainer = SimpleNamespace(accelerator=SimpleNamespace(state=state))
        ok = DeepSpeedBackend(trainer, FairCaster(FairCastConfig(policy_metrics_every=3)))
        ok.check_policy_metrics("GRPOTrainer")
        assert ok.caster.policy_measured and ok.policy_collective  # apply_deepspeed_patch accepts the option


class _CapturingProbe:
    """Stands in for PolicyLagProbe: records what measure_policy hands it (always due)."""

    def __init__(self):
        self.seen = {}

    def due(self, step):
        return True

    def measure(self, model, step, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        self.seen.update(attention=torch.cat([prompt_mask, completion_mask], 1), count_mask=kw.get("count_mask"))


def _callback_stub(trainer=None):
    """Just what FairCastCallback.measure_policy reads: the probe, the backend's views and scope, the trainer."""
    import contextlib
    from types import SimpleNamespace

    backend = SimpleNamespace(policy_scope=lambda: contextlib.nullcontext(None), policy_views=lambda: (None, None),
                              model=lambda: None, policy_collective=False)
    return SimpleNamespace(policy=_CapturingProbe(), backend=backend,
                           trainer=trainer if trainer is not None else SimpleNamespace())


def _tool_batch():
    return {"prompt_ids": torch.tensor([[5, 6, 7]]), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
            "completion_ids": torch.tensor([[8, 9, 10, 11, 12, 13, 0]]),
            "completion_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0]]),
            "tool_mask": torch.tensor([[1, 1, 0, 0, 1, 1, 1]])}  # tokens 10, 11: a tool's result; the last: padding


def test_tool_results_are_attended_and_not_counted():
    """TRL's forward attends cat(prompt_mask, completion_mask) (grpo_trainer: tool results in the context; tool_mask only
    in the loss): the probe's forwards attend the same, and count completion_mask * tool_mask (before: the tool results
    were masked out of the attention, so every token after a tool call was scored without its output)."""
    from faircast_plugins.trl.callback import FairCastCallback

    stub, inputs = _callback_stub(), _tool_batch()
    FairCastCallback.measure_policy(stub, inputs, 0, 1.0)
    seen = stub.policy.seen
    assert torch.equal(seen["attention"], torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))
    assert torch.equal(seen["count_mask"], inputs["completion_mask"] * inputs["tool_mask"])
    del inputs["tool_mask"]  # no tools: attended and counted alike (count_mask defaults to the completion mask)
    FairCastCallback.measure_policy(stub, inputs, 0, 1.0)
    assert seen["count_mask"] is None and torch.equal(seen["attention"][:, 3:], inputs["completion_mask"])


def test_vision_language_policies_are_refused_naming_the_option():
    """A VLM's batch carries its images (pixel_values, image_grid_thw, ...), which the probe's text-only forwards would
    drop: refused at construction when TRL recognises a VLM (a processor as processing_class: ``_is_vlm``), else at the
    first measurement, naming the option."""
    from types import SimpleNamespace

    from faircast_plugins import FairCastConfig
    from faircast_plugins.trl.callback import FairCastCallback

    with pytest.raises(FairCastPatchError, match=r"not supported for vision-language.*faircast_policy_metrics_every=0"):
        FairCastCallback(SimpleNamespace(_is_vlm=True), FairCastConfig(policy_metrics_every=1))
    stub = _callback_stub()
    inputs = {**_tool_batch(), "pixel_values": torch.zeros(4, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(FairCastPatchError, match=r"pixel_values, image_grid_thw.*faircast_policy_metrics_every=0"):
        FairCastCallback.measure_policy(stub, inputs, 0, 1.0)
    assert stub.policy.seen == {}
