"""OpenRLHF's own actor, strategy and policy loss on CPU: what broadcast_to_vllm sends is the Fair Cast copy.

See ``openrlhf_actor_worker.py`` for the run and its CPU substitutions (gloo instead of the CUDA-only
``setup_distributed``, DeepSpeed's torch AdamW instead of the FusedAdam JIT build, an HF model standing in
for vLLM's CUDA-only weight receiver).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster, derive_key, fair_cast

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import openrlhf_actor_worker as worker  # noqa: E402

RUNS = [(2, "on"), (3, "on"), (2, "off"), (2, "ema"), (3, "on", "policy"), (2, "off", "policy")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    d = tmp_path_factory.mktemp("openrlhf_actor")
    for run in RUNS:
        path = d / ("z" + "-".join(map(str, run)) + ".pt")
        proc = subprocess.run([sys.executable, os.path.join(HERE, "openrlhf_actor_worker.py"), str(path), *map(str, run)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"OpenRLHF actor run {run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
        out[run] = torch.load(path, weights_only=False)
    return out


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("stage", [2, 3])
def test_broadcast_weights_are_the_fair_cast_copy(runs, stage):
    rec = runs[(stage, "on")]
    assert rec["zero_stage"] == stage
    assert rec["versions"] == list(range(1, worker.STEPS + 1))
    for step, (served, masters) in enumerate(zip(rec["served"], rec["masters"]), start=1):
        assert len(served) == 27  # every parameter of the tiny Qwen2
        for name, w in served.items():
            want = fair_cast(masters[name].contiguous(), key=derive_key(worker.SEED, step, name))
            diff = int((_bits(w) != _bits(want)).sum())
            assert diff == 0, f"ZeRO-{stage} step {step}: {name} differs from fair_cast(master) in {diff} elements"


def test_same_copy_under_zero2_and_zero3(runs):
    a, b = runs[(2, "on")], runs[(3, "on")]
    for step in range(worker.STEPS):
        for name in a["masters"][step]:
            if torch.equal(a["masters"][step][name], b["masters"][step][name]):
                assert torch.equal(_bits(a["served"][step][name]), _bits(b["served"][step][name])), (step, name)


@pytest.mark.parametrize("key", [(2, "on"), (2, "off"), (2, "ema")])
def test_trainer_forward_runs_on_the_served_copy(runs, key):
    """The trainer's forward (old log-probs, loss) runs on exactly the weights the rollout engine receives.

    ZeRO-2 runs the plain module, so its logits equal the served model's bit for bit. ZeRO-3 swaps in its
    own linear autograd function (a different matmul, last-bit differences on identical weights), so for
    ZeRO-3 the check is on the weights themselves (test_broadcast_weights_are_the_fair_cast_copy).
    """
    rec = runs[key]
    for trainer, served in zip(rec["trainer_logits"], rec["served_logits"]):
        assert torch.equal(_bits(trainer), _bits(served))


def test_negative_control_without_faircast_is_round_to_nearest(runs):
    rec = runs[(2, "off")]
    assert rec["versions"] == [None] * worker.STEPS and rec["metrics"] == [{}] * worker.STEPS
    served, masters = rec["served"][-1], rec["masters"][-1]
    differs = 0
    for name, w in served.items():
        assert torch.equal(_bits(w), _bits(masters[name].to(torch.bfloat16))), name
        sr = fair_cast(masters[name].contiguous(), key=derive_key(worker.SEED, worker.STEPS, name))
        differs += int((_bits(sr) != _bits(w)).sum())
    assert differs > 0


def test_policy_metrics(runs):
    metrics = runs[(2, "on")]["metrics"]
    assert [m["faircast/version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert "faircast/lag_steps" in metrics[-1] and "faircast/served_changed_frac" in metrics[-1]


@pytest.mark.parametrize("key", [(2, "on"), (3, "on"), (2, "off"), (2, "ema")])
def test_openrlhf_checkpoint_round_trip(runs, key):
    """strategy.save_ckpt, then a fresh policy that loads it before Fair Cast is attached (as OpenRLHF's
    init does): same weight version, and the weights a resume broadcast sends are the saved served copy."""
    rec = runs[key]
    assert rec["resumed_version"] == (worker.STEPS if key[1] != "off" else None)
    for name, w in rec["served"][-1].items():
        assert torch.equal(_bits(rec["resumed_served"][name]), _bits(w)), name


def test_ema_decay_serves_the_cast_of_the_ema(runs):
    """--faircast.ema_decay through OpenRLHF's CLI: what broadcast_to_vllm sends is fair_cast(EMA of the master),
    equal to a FairCaster running the same EMA on the full masters from the initial weights; the optimizer still
    trains the master, and the served copy is not fair_cast(master)."""
    rec = runs[(2, "ema")]
    assert rec["ema_decay"] == worker.EMA_DECAY and rec["versions"] == list(range(1, worker.STEPS + 1))
    ref = FairCaster(FairCastConfig(enabled=True, seed=worker.SEED, ema_decay=worker.EMA_DECAY))
    ref.cast_many({n: w.float() for n, w in rec["initial"].items()})  # version 0: the EMA starts at the master
    not_the_master = 0
    for step, (served, masters) in enumerate(zip(rec["served"], rec["masters"]), start=1):
        ref.advance(masters)
        for name, w in served.items():
            assert torch.equal(_bits(w), _bits(ref.cast(name, masters[name].contiguous()))), (step, name)
            plain = fair_cast(masters[name].contiguous(), key=derive_key(worker.SEED, step, name))
            not_the_master += int((_bits(plain) != _bits(w)).sum())
    assert not_the_master > 0


def _reference_rows(probe) -> torch.Tensor:
    """The probe's rows recomputed in one process: plain fp32 HF models holding the full served copy and the full
    master, scoring the recorded tokens as OpenRLHF's ``Actor.forward`` does (positions from the attention mask, the
    run's temperature), only ``action_mask`` tokens counted."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from faircast_plugins.policy_lag import positions_from_mask, sequence_stats

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False,
                      attn_implementation="eager")
    seqs, att, actions = probe["sequences"][:2], probe["attention_mask"][:2], probe["action_mask"][:2]
    n = actions.shape[1]
    logits = []
    for view in ("served_view", "master_view"):
        model = Qwen2ForCausalLM(cfg).eval()
        model.load_state_dict(probe[view])
        with torch.no_grad():
            out = model(input_ids=seqs, attention_mask=att, position_ids=positions_from_mask(att), use_cache=False)
        logits.append(out.logits[:, -n - 1:-1])
    return sequence_stats(*logits, seqs[:, -n:], actions.long(), probe["temperature"])


@pytest.mark.parametrize("key", [(3, "on", "policy"), (2, "off", "policy")])
def test_policy_metrics_equal_a_one_process_reference(runs, key):
    """--faircast.policy_metrics_every 1 through OpenRLHF's CLI, measured inside the wrapped
    ActorPPOTrainer.training_step before each update: the served view the probe's forwards read is the module's bf16
    weight of that version (fair_cast(master) with Fair Cast on, DeepSpeed's round to nearest with it off), the master
    view is the fp32 master (and differs from it once trained), the rows equal a one-process fp32 reference, and the
    status dict fit() returns carries the metrics of those rows. ZeRO-3: read inside its gather/release hooks (its
    linear function: last-bit differences, the tolerance), and every released parameter is released again after."""
    from faircast_plugins.policy_lag import TOKENS_KEY, metrics_of

    stage, flag, _ = key
    rec = runs[key]
    assert [p["step"] for p in rec["probes"]] == list(range(worker.STEPS))
    initial = {n: w.float() for n, w in rec["initial"].items()}
    for probe, metrics in zip(rec["probes"], rec["metrics"]):
        step = probe["step"]
        assert probe["temperature"] == worker.TEMPERATURE and probe["stale"] == []
        masters = initial if step == 0 else rec["masters"][step - 1]
        served = rec["initial"] if step == 0 else rec["served"][step - 1]
        assert set(probe["master_view"]) == set(masters) == set(probe["served_view"])
        for name, m in masters.items():
            assert torch.equal(probe["master_view"][name], m.float()), (step, name)
            assert torch.equal(probe["served_view"][name], served[name].float()), (step, name)
            want = (fair_cast(m.contiguous(), key=derive_key(worker.SEED, step, name)) if flag == "on" and step > 0
                    else m.to(torch.bfloat16))
            assert torch.equal(_bits(served[name]), _bits(want)), (step, name)
        if step > 0:
            assert any(not torch.equal(probe["master_view"][n], probe["served_view"][n]) for n in masters)
        # the masters (ZeRO-3: both views) came from the optimizer's partitions a window at a time, and the ZeRO-3
        # forwards ran without DeepSpeed's module gathers (deepspeed/master_windows.py, policy_views.zero3_direct)
        assert probe["window_loads"] >= 1 and probe["per_parameter_masters"] == 0 and probe["deepspeed_fetches"] == 0
        # each layout built once per measurement (policy_views.DeepSpeedPolicyViews; before: master 3x, served 2x)
        assert (probe["master_layouts"], probe["served_layouts"]) == (1, int(stage == 3))
        tol = dict(rtol=1e-3, atol=1e-5) if stage == 3 else dict(rtol=1e-5, atol=1e-9)
        ref = _reference_rows(probe)
        assert torch.allclose(probe["rows"], ref, **tol), (step, probe["rows"], ref)
        assert metrics[TOKENS_KEY] == 7.0  # 5 + 2 action tokens: the action mask counts (no prompt, observation, pad)
        assert {k: v for k, v in metrics.items() if k.startswith("faircast/policy")} == metrics_of(probe["rows"])
    assert rec["metrics"][0]["faircast/policy_kl"] == 0.0  # version 0: the masters are the bf16 checkpoint
    assert all(m["faircast/policy_kl"] > 0 for m in rec["metrics"][1:])


def test_policy_probe_leaves_training_unchanged(runs):
    """ZeRO-3 with Fair Cast on: the run with the probe every step serves and trains bit-identically to the run
    without it (the probe's forwards leave the masters, the served copy and ZeRO-3's state as they were)."""
    plain, probed = runs[(3, "on")], runs[(3, "on", "policy")]
    assert plain["probes"] == [] and len(probed["probes"]) == worker.STEPS
    for a, b in zip(plain["masters"] + plain["served"], probed["masters"] + probed["served"]):
        assert all(torch.equal(a[n], b[n]) for n in a)
