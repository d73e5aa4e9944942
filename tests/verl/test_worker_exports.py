"""verl's two other export paths with Fair Cast, through the real engine: delta_sharded and merged LoRA."""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import FairCastConfig, derive_key, fair_cast, sticky_key

from .conftest import SEED
from .test_worker_stateful import reference

LORA_TARGETS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                "up_proj.weight", "down_proj.weight")


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16, t.dtype
    return t.view(torch.int16)


def _expected_v2(r0, case):
    if case.endswith("_off"):
        return {n: m.to(torch.bfloat16) for n, m in r0["masters"].items()}  # verl's own delta shards: RTN
    if case.endswith(("_ef", "_ema")):
        mode = dict(mode="error_feedback") if case.endswith("_ef") else dict(ema_decay=0.5)
        return reference(r0, FairCastConfig(enabled=True, seed=SEED, **mode))[2]
    return {n: _served(m, n, "sticky" if case.endswith("_sticky") else "stochastic") for n, m in r0["masters"].items()}


def _served(master, name, mode):
    """fair_cast at version 2 (sticky: under its version-free key)."""
    key = sticky_key(SEED, name) if mode == "sticky" else derive_key(SEED, 2, name)
    return fair_cast(master, key=key, mode=mode)


DELTA = [(2, "fsdp2_on"), (2, "fsdp_on"), (1, "fsdp2_ef"), (1, "fsdp_ema"), (3, "fsdp2_ema"), (3, "fsdp_ef"),
         (2, "fsdp2_off"), (2, "fsdp_off"), (2, "fsdp2_sticky")]


@pytest.mark.parametrize("world, case", DELTA, ids=[f"{c}-world{w}" for w, c in DELTA])
def test_delta_sharded_ships_the_served_copy(worker_runs, world, case):
    """get_per_tensor_param_shard (the delta engine's source): the shards of all ranks reassemble, at their global
    indices, to the served copy; and the seed export (version 0) plus every rank's steady delta
    (get_per_tensor_param_delta_shard at version 2) reconstructs it too, as the rollout applies them.
    Control (flag off): verl's own shards, round-to-nearest of the master."""
    _, runs = worker_runs(world)
    results = runs[case]
    r0 = results[0]
    expected = _expected_v2(r0, case)
    changed = 0
    for name, q in expected.items():
        full = torch.zeros(q.numel(), dtype=torch.int16)
        covered = torch.zeros(q.numel(), dtype=torch.bool)
        for r in results:
            idx, local = r["delta_shards"][name]
            full[idx] = bits(local)
            covered[idx] = True
        assert bool(covered.all()), f"{name}: the shards do not cover the parameter"
        assert torch.equal(full.view(q.shape), bits(q)), f"rank shards of {name} != served copy"
        seed = r0["delta_seed"][name]
        applied = seed.to(torch.bfloat16).reshape(-1).clone()  # the delta engine's seed cast (a no-op for bf16)
        for r in results:
            idx, val = r["deltas"][name]
            applied[idx.long()] = val
            changed += idx.numel()
        assert torch.equal(bits(applied).view(q.shape), bits(q)), f"seed + deltas of {name} != served copy"
        if not case.endswith("_off"):
            assert torch.equal(bits(r0["exported"][name]), bits(q)), f"full export of {name}"
            assert seed.dtype == torch.bfloat16
    assert changed > 0, "no delta was shipped: the check is vacuous"
    if case.endswith("_off"):
        assert all(r0["delta_seed"][n].dtype == torch.float32 for n in expected)  # verl sends fp32, then RTN


def _targets(names):
    return {n for n in names if n.endswith(LORA_TARGETS)}


@pytest.mark.parametrize("world", [1, 2])
def test_merged_lora_serves_fair_cast_of_the_fp32_merge(worker_runs, world):
    """model.lora.merge=true: each LoRA-target weight is served as fair_cast(W + s*B@A in fp32) keyed by its
    canonical base-weight name at the current version (world 2 runs in sticky mode: its version-free key); the other
    tensors keep verl's round-to-nearest."""
    _, runs = worker_runs(world)
    for r in runs["fsdp2_lora_merge"]:  # every rank exports the full tensors
        _check_merged(r, "sticky" if world == 2 else "stochastic")


def _check_merged(r0, mode="stochastic"):
    merged, exported, masters = r0["merged"], r0["exported"], r0["masters"]
    assert r0["version"] == 2 and set(exported) == set(merged)
    targets = _targets(exported)
    assert len(targets) == 14  # 2 layers x 7 projections
    sr_vs_rtn = 0
    for name, q in exported.items():
        if name in targets:
            # the merge really happened: the trained adapters moved the weight away from the frozen base
            assert not torch.equal(merged[name], masters[name]), name
            expected = _served(merged[name], name, mode)
            sr_vs_rtn += int((bits(expected) != bits(merged[name].to(torch.bfloat16))).sum())
        else:
            expected = merged[name].to(torch.bfloat16)
        assert torch.equal(bits(q), bits(expected)), name
    assert sr_vs_rtn > 0
    # What the actor computes with (docs/verl.md, "part 2 does not hold"): round-to-nearest of the frozen base
    # plus the Fair Cast copies of the adapters -- not the served merged weight.
    forward = r0["forward"]
    for name in targets:
        assert torch.equal(bits(forward[name]), bits(masters[name].to(torch.bfloat16))), name
        assert not torch.equal(bits(forward[name]), bits(exported[name])), name
    adapters = [n for n in masters if ".lora_" in n]
    assert adapters
    for name in adapters:
        assert torch.equal(bits(forward[name]), bits(_served(masters[name], name, mode))), name


def test_merged_lora_flag_off_is_verls_round_to_nearest(worker_runs):
    """Control: without the flag verl sends round-to-nearest of the same fp32 merge."""
    _, runs = worker_runs(1)
    r0 = runs["fsdp2_lora_merge_off"][0]
    merged, exported = r0["merged"], r0["exported"]
    assert r0["version"] is None and set(exported) == set(merged)
    for name, q in exported.items():
        assert torch.equal(bits(q), bits(merged[name].to(torch.bfloat16))), name
