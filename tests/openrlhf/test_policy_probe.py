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
    training_step, on the Experience split where ``action_mask`` starts (attended by ``attention_mask``, counted by
    ``action_mask``), at the rollout temperature, with positions from the mask and as many forwards on every rank;
    installing twice wraps once."""
    import torch

    actor = _actor()
    probe = policy_probe.attach(actor, CONFIG)
    assert (probe.every, probe.seqs) == (2, 3)
    calls = []

    def measure(model, step, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        probe.measured_step = step  # as PolicyLagProbe.measure does
        attended = torch.equal(torch.cat([prompt_mask, completion_mask], 1), experience.attention_mask)
        calls.append(("measure", step, tuple(prompt_ids.shape), tuple(completion_ids.shape), kw["temperature"],
                      kw["mask_positions"], kw["collective"], attended,
                      bool(torch.equal(kw["count_mask"], experience.action_mask.long()))))

    probe.measure = measure

    def training_step(experience, kl_ctl, step, loss_batch_info=None):
        calls.append(("train", actor.model.global_steps))
        return {"step": step}

    args = SimpleNamespace(rollout=SimpleNamespace(temperature=0.7))
    holder = SimpleNamespace(actor=actor, trainer=SimpleNamespace(training_step=training_step, args=args))
    policy_probe.install(holder)
    policy_probe.install(holder)  # idempotent
    attention_mask = torch.ones(4, 12, dtype=torch.long)
    attention_mask[1, -3:] = 0  # right padding
    action_mask = torch.ones(4, 5, dtype=torch.bool)
    action_mask[0, :2] = False  # an observation inside the response
    experience = SimpleNamespace(sequences=torch.zeros(4, 12, dtype=torch.long), attention_mask=attention_mask,
                                 action_mask=action_mask)
    for micro in range(6):
        assert holder.trainer.training_step(experience, 0.0, micro) == {"step": micro}
        if micro % 2 == 1:
            actor.model.global_steps += 1
    measured = ("measure", (4, 7), (4, 5), 0.7, True, True, True, True)
    assert calls == [(measured[0], 0, *measured[1:]), ("train", 0), ("train", 0), ("train", 1), ("train", 1),
                     (measured[0], 2, *measured[1:]), ("train", 2), ("train", 2)]


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import torch

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=False,
                      attn_implementation="eager")
    return Qwen2ForCausalLM(cfg).eval()


def test_the_probe_attends_what_openrlhf_attends_and_counts_its_actions(monkeypatch):
    """OpenRLHF 0.11.2's real layout (built by its own ``_process_response_into_experience`` and the replay buffer's
    batching): ``action_mask`` is ``[B, T-1]``, 0 on the prompt and on a tool's observation between two actions, and
    the batch is right-padded. Every forward of the probe sees the Experience's own ``attention_mask`` (before: the
    prompt was its first token and only the actions were attended), and the rows equal a reference that scores the
    whole sequences as ``Actor.forward`` does, counting only the action tokens."""
    import contextlib

    import torch

    from experiences import experience_batch
    from faircast_plugins.deepspeed import policy_views
    from faircast_plugins.policy_lag import positions_from_mask, sequence_stats

    temperature = 0.8
    experience = experience_batch([
        [([11, 12, 13], False), ([21, 22], True), ([31, 32, 33], False), ([41, 42, 43], True)],  # two turns
        [([51, 52, 53, 54], False), ([61, 62, 63], True)],  # shorter: right-padded
    ])
    assert experience.action_mask.shape[1] == experience.sequences.shape[1] - 1  # the layout the probe must read

    def served(p):  # the engine's bf16 copy (round to nearest), widened
        return p.detach().to(torch.bfloat16).float()

    class Views:  # DeepSpeed's two views, for a plain module
        def __init__(self, engine):
            self.served, self.master = served, (lambda p: None)

        @contextlib.contextmanager
        def scope(self):
            yield None  # the probe's own weights_swapped

    monkeypatch.setattr(policy_views, "DeepSpeedPolicyViews", Views)
    model = _tiny_qwen2()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attention_mask"].clone()), with_kwargs=True)
    engine = SimpleNamespace(global_steps=0, module=model)
    probe = policy_probe.attach(SimpleNamespace(model=engine), CONFIG)
    policy_probe.measure(engine, experience, temperature)
    assert len(seen) == 2 and all(torch.equal(att, experience.attention_mask) for att in seen)
    rows = probe.take()

    seqs, att, actions = experience.sequences, experience.attention_mask, experience.action_mask
    n = actions.shape[1]
    served_model = _tiny_qwen2()
    with torch.no_grad():
        for p in served_model.parameters():
            p.copy_(served(p))
        logits = [m(input_ids=seqs, attention_mask=att, position_ids=positions_from_mask(att), use_cache=False)
                  .logits[:, -n - 1:-1] for m in (served_model, model)]
    want = sequence_stats(*logits, seqs[:, -n:], actions.long(), temperature)
    assert rows[:, 1].tolist() == [5.0, 3.0]  # the action tokens, no observation or padding
    assert torch.allclose(rows, want, rtol=1e-9, atol=1e-12), (rows, want)
    assert float(rows[:, 0].sum()) > 0
