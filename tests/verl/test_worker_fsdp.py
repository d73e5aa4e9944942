"""verl's real ActorRolloutRefWorker on CPU/gloo: the bf16 copy FSDP computes with == the exported copy ==
fair_cast(master), for FSDP1 and FSDP2 at world sizes 1, 2 and 3 (3 gives uneven, padded shards).

Each case runs init_model -> compute_log_prob -> update_actor (two optimizer steps) -> update_weights(naive)
-> compute_log_prob, recording the weights every forward read on every rank (see harness.py).
"""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import canonical_name, derive_key, fair_cast

from .conftest import SEED, rank_log

N_PARAMS = 27  # tiny Qwen2: embed, lm_head, final norm + 2 layers x (q,k,v weight+bias, o, gate, up, down, 2 norms)


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16, t.dtype
    return t.view(torch.int16)


def served(master: torch.Tensor, version: int, name: str) -> torch.Tensor:
    """The contract's served copy, computed independently of the adapter: the core fair_cast on the full master."""
    return fair_cast(master, key=derive_key(SEED, version, name), backend="torch")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_fsdp_cast_equals_export_equals_fair_cast(worker_runs, strategy, world):
    out, runs = worker_runs(world)
    results = runs[f"{strategy}_on"]
    r0 = results[0]
    assert "Fair Cast ACTIVE on the verl actor" in rank_log(out)
    assert r0["version"] == 2 and r0["seed"] == SEED  # two optimizer steps -> weight version 2
    masters, exported = r0["masters"], r0["exported"]
    assert len(masters) == N_PARAMS and set(exported) == set(masters)

    differs_from_rtn = 0
    for name, master in masters.items():
        assert master.dtype == torch.float32
        expected = served(master, 2, name)
        assert torch.equal(bits(exported[name]), bits(expected)), f"export of {name} is not fair_cast(master)"
        for r in results:  # every rank's forward used exactly the exported copy
            assert torch.equal(bits(r["forward"][name]), bits(expected)), f"rank {r['rank']} forward of {name}"
        # before any optimizer step (compute_log_prob at version 0) the forward used fair_cast at version 0
        expected_v0 = served(r0["masters_v0"][name], 0, name)
        for r in results:
            assert torch.equal(bits(r["forward_v0"][name]), bits(expected_v0)), f"rank {r['rank']} v0 {name}"
        differs_from_rtn += int((bits(expected) != bits(master.to(torch.bfloat16))).sum())
    assert differs_from_rtn > 0, "stochastic rounding never differed from round-to-nearest: the check is vacuous"



@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_flag_off_serves_round_to_nearest(worker_runs, strategy):
    """Negative control: without the flag, the export is the fp32 master and FSDP computes with its RTN cast."""
    out, runs = worker_runs(2)
    results = runs[f"{strategy}_off"]
    r0 = results[0]
    assert r0["version"] is None
    assert "Fair Cast is OFF for this verl worker" in rank_log(out)
    masters, exported = r0["masters"], r0["exported"]
    assert len(masters) == N_PARAMS and set(exported) == set(masters)
    for name, master in masters.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], master)
        rtn = master.to(torch.bfloat16)  # what vLLM's copy_ makes of the fp32 export
        for r in results:
            assert torch.equal(bits(r["forward"][name]), bits(rtn)), f"rank {r['rank']} forward of {name}"


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_export_only_control_breaks_the_match(worker_runs, strategy):
    """Negative control for the trainer half: Fair Cast in the export but FSDP's stock cast in the actor. The
    forward then reads round-to-nearest and differs from the served copy on every parameter: the FSDP patches
    are what make the loss run on the served copy."""
    _, runs = worker_runs(2)
    results = runs[f"{strategy}_export_only"]
    r0 = results[0]
    masters, exported = r0["masters"], r0["exported"]
    for name, master in masters.items():
        assert torch.equal(bits(exported[name]), bits(served(master, 2, name)))
        for r in results:
            assert torch.equal(bits(r["forward"][name]), bits(master.to(torch.bfloat16)))
            assert not torch.equal(bits(r["forward"][name]), bits(exported[name])), name


def test_audit_only_measures_the_round_to_nearest_baseline(worker_runs):
    """faircast: {enable: false, audit: true}: FSDP and the export both round to nearest (mode 'nearest'), and the
    metrics still arrive, so a baseline run can be compared with a Fair Cast run."""
    _, runs = worker_runs(1)
    r0 = runs["fsdp2_audit_only"][0]
    assert r0["version"] == 2
    for name, master in r0["masters"].items():
        rtn = bits(master.to(torch.bfloat16))
        assert torch.equal(bits(r0["exported"][name]), rtn) and torch.equal(bits(r0["forward"][name]), rtn), name
    assert "faircast/served_changed_frac" in r0["metrics"] and "faircast/lag_steps" in r0["metrics"]


def test_metrics_in_update_actor_output(worker_runs):
    """faircast/* metrics (audit on) arrive in update_actor's metrics, which verl's tracking logger records."""
    _, runs = worker_runs(2)
    metrics = runs["fsdp2_on"][0]["metrics"]
    assert metrics["faircast/version"] == 2.0
    for key in ("faircast/served_changed_frac", "faircast/master_moved_frac", "faircast/bias", "faircast/bias_rel",
                "faircast/lag_steps", "faircast/bias_rel_cumulative"):
        assert key in metrics, f"{key} missing from {sorted(metrics)}"
    assert 0.0 < metrics["faircast/master_moved_frac"] <= 1.0  # lr 1e-3 Adam moves every element
    assert 0.0 < metrics["faircast/served_changed_frac"] <= 1.0
    assert runs["fsdp2_off"][0]["metrics"] == {}  # flag off: nothing added


def test_checkpoint_resume_serves_bit_identical_copy(worker_runs):
    """A fresh worker that loads verl's actor checkpoint resumes at the saved version and serves the same bits."""
    out, runs = worker_runs(2)
    before, after = runs["fsdp2_on"], runs["fsdp2_resume"]
    assert after[0]["version"] == before[0]["version"] == 2
    assert sorted(p.name for p in (out / "ckpt").glob("faircast_state_rank_*.pt")) == [
        "faircast_state_rank_0.pt", "faircast_state_rank_1.pt"]
    saved = torch.load(out / "ckpt" / "faircast_state_rank_0.pt", weights_only=False)
    assert saved["version"] == 2 and saved["config"]["seed"] == SEED
    for name, q in before[0]["exported"].items():
        assert torch.equal(bits(after[0]["exported"][name]), bits(q)), f"resumed export of {name} differs"
        for r in after:
            assert torch.equal(bits(r["forward"][name]), bits(q)), f"resumed rank {r['rank']} forward of {name}"


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_tied_embeddings_use_one_canonical_key(worker_runs, strategy):
    """With tie_word_embeddings, embed_tokens and lm_head are one parameter: both names are served and computed
    with the bits keyed by its first name, model.embed_tokens.weight."""
    _, runs = worker_runs(2)
    results = runs[f"{strategy}_tied"]
    r0 = results[0]
    masters, exported = r0["masters"], r0["exported"]
    assert "lm_head.weight" not in masters and len(masters) == N_PARAMS - 1
    embed = served(masters["model.embed_tokens.weight"], 2, "model.embed_tokens.weight")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in exported:
            assert torch.equal(bits(exported[name]), bits(embed)), name
        for r in results:
            assert torch.equal(bits(r["forward"][name]), bits(embed)), f"rank {r['rank']} {name}"
    assert "model.embed_tokens.weight" in exported
    for name, master in masters.items():
        assert torch.equal(bits(exported[name]), bits(served(master, 2, name))), name


def test_unmerged_lora_adapters_are_served_as_computed(worker_runs):
    """LoRA (unmerged): the frozen base weights keep round-to-nearest on both sides; the trained adapters are
    exported (verl's adapter sync) as the Fair Cast copy the forward computes with."""
    _, runs = worker_runs(1)
    r0 = runs["fsdp2_lora"][0]
    assert r0["version"] == 2
    masters, forward = r0["masters"], r0["forward"]
    adapters = {n for n in masters if ".lora_" in n}
    assert adapters, "no LoRA parameters: the case did not build a LoRA actor"
    adapter_export = r0["exports"][-1]  # verl sends the base weights first, then the adapters
    assert len(adapter_export) == len(adapters)
    for exported_name, q in adapter_export.items():
        # peft exports "...q_proj.lora_A.weight" for the parameter "...q_proj.lora_A.default.weight"
        head, part, tail = exported_name.partition(".lora_A." if ".lora_A." in exported_name else ".lora_B.")
        name = canonical_name(f"{head}{part}default.{tail}")
        assert name in adapters, exported_name
        expected = served(masters[name], 2, name)
        assert torch.equal(bits(q), bits(expected)), exported_name
        assert torch.equal(bits(forward[name]), bits(expected)), name
    for name in masters.keys() - adapters:  # frozen base weights: RTN in the forward
        assert torch.equal(bits(forward[name]), bits(masters[name].to(torch.bfloat16))), name


def test_checkpoint_engine_path_sends_the_same_copy(worker_runs):
    """update_weights with a checkpoint-engine backend (the nccl/nixl/hccl route: send_weights of
    get_per_tensor_param) sends the same Fair Cast bf16 copy as the colocated path."""
    _, runs = worker_runs(1)
    r0 = runs["fsdp_on"][0]
    sent, exported = r0["sent_by_checkpoint_engine"], r0["exported"]
    assert set(sent) == set(exported) and len(sent) == N_PARAMS
    for name, q in exported.items():
        assert torch.equal(bits(sent[name]), bits(q)), name


def test_moe_experts_unfused_on_export_keep_one_canonical_key(worker_runs):
    """Qwen3-MoE with packed experts (mlp.experts.gate_up_proj [E, 2I, H]) sharded unevenly over 3 ranks: FSDP
    computes with fair_cast(packed master), and verl's export splits that same copy into per-expert tensors."""
    _, runs = worker_runs(3)
    results = runs["fsdp2_moe"]
    r0 = results[0]
    masters, exported = r0["masters"], r0["exported"]
    packed = [n for n in masters if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    assert packed, "the MoE model has no packed expert parameters"
    for name, master in masters.items():
        expected = served(master, 2, name)
        for r in results:
            assert torch.equal(bits(r["forward"][name]), bits(expected)), f"rank {r['rank']} forward of {name}"
        if name not in packed:
            assert torch.equal(bits(exported[name]), bits(expected)), name
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith("gate_up_proj"):
            gate, up = expected.chunk(2, dim=1)
            parts = {"gate_proj": gate, "up_proj": up}
        else:
            parts = {"down_proj": expected}
        for e in range(expected.shape[0]):
            for proj, full in parts.items():
                got = exported[f"{base}.{e}.{proj}.weight"]
                assert torch.equal(bits(got), bits(full[e].contiguous())), f"{base}.{e}.{proj}.weight"
