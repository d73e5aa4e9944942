"""mode: error_feedback and ema_decay under verl's real FSDP1/FSDP2 engines (world sizes 1, 2, 3).

The per-element state (error-feedback residual, EMA of the master) lives with each rank's FSDP shard. Both are
elementwise, so the shards together must give exactly what a single-process FairCaster gives on the full
masters, version after version: the reference below replays every version (0, 1, 2) on the full fp32 masters
the harness recorded after each optimizer step, and every rank's forward and the export must equal it.
"""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import FairCaster, FairCastConfig, derive_key, fair_cast

from .conftest import SEED

EF = FairCastConfig(enabled=True, seed=SEED, mode="error_feedback")
EMA = FairCastConfig(enabled=True, seed=SEED, ema_decay=0.5)
CASES = [(1, "fsdp2_ef", EF), (1, "fsdp_ema", EMA), (2, "fsdp2_ef", EF), (2, "fsdp_ema", EMA), (3, "fsdp2_ema", EMA),
         (3, "fsdp_ef", EF)]


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16, t.dtype
    return t.view(torch.int16)


def reference(r0: dict, config: FairCastConfig) -> list:
    """The served copy at every version, from one FairCaster on the full masters (no sharding anywhere)."""
    caster = FairCaster(config)
    masters = [r0["masters_v0"], *r0["masters_by_step"]]
    served = []
    for version, full in enumerate(masters):
        served.append({name: caster.cast(name, x) for name, x in full.items()})
        if version + 1 < len(masters):
            caster.advance(masters[version + 1].items())
    return served


@pytest.mark.parametrize("world, case, config", CASES, ids=[f"{c}-world{w}" for w, c, _ in CASES])
def test_sharded_state_serves_the_single_process_copy(worker_runs, world, case, config):
    _, runs = worker_runs(world)
    results = runs[case]
    r0 = results[0]
    assert r0["version"] == 2 and len(r0["masters_by_step"]) == 2  # the version advanced at each optimizer step
    expected = reference(r0, config)
    assert set(r0["exported"]) == set(expected[2])
    rtn_diff = sr_diff = 0
    for name, q in expected[2].items():
        assert torch.equal(bits(r0["exported"][name]), bits(q)), f"export of {name}"
        for r in results:
            assert torch.equal(bits(r["forward"][name]), bits(q)), f"rank {r['rank']} forward of {name} at v2"
            assert torch.equal(bits(r["forward_v0"][name]), bits(expected[0][name])), f"rank {r['rank']} v0 {name}"
        master = r0["masters"][name]
        rtn_diff += int((bits(q) != bits(master.to(torch.bfloat16))).sum())
        sr_diff += int((bits(q) != bits(fair_cast(master, key=derive_key(SEED, 2, name)))).sum())
    # negative controls: the state matters (not round-to-nearest, not plain stochastic rounding of the master)
    assert rtn_diff > 0 and sr_diff > 0, (rtn_diff, sr_diff)


@pytest.mark.parametrize("case", ["fsdp2_ef", "fsdp_ema"])
def test_resume_restores_the_state_bit_identically(worker_runs, case):
    """A fresh worker that loads verl's actor checkpoint (per-rank residuals / EMA in faircast_state_rank_<r>.pt)
    serves and computes with the same bits as the straight run."""
    out, runs = worker_runs(2)
    straight, resumed = runs[case], runs[f"{case}_resume"]
    saved = [torch.load(out / f"ckpt_{case.split('_')[1]}" / f"faircast_state_rank_{r}.pt", weights_only=False)
             for r in range(2)]
    state_key = "error_feedback" if case.endswith("ef") else "ema"
    assert all(s["version"] == 2 and s[state_key] for s in saved)
    if state_key == "error_feedback":
        assert any(bool(e["residual"].abs().sum() > 0) for s in saved for e in s["error_feedback"].values())
    assert resumed[0]["version"] == 2
    for name, q in straight[0]["exported"].items():
        assert torch.equal(bits(resumed[0]["exported"][name]), bits(q)), f"resumed export of {name}"
        for r in resumed:
            assert torch.equal(bits(r["forward"][name]), bits(q)), f"resumed rank {r['rank']} forward of {name}"
    # control: without the restored state the copy would differ (zero residual = RTN; no EMA = SR of the master)
    stateless = {name: (m.to(torch.bfloat16) if state_key == "error_feedback"
                        else fair_cast(m, key=derive_key(SEED, 2, name)))
                 for name, m in straight[0]["masters"].items()}
    assert any(not torch.equal(bits(q), bits(stateless[n])) for n, q in straight[0]["exported"].items())


def test_error_feedback_metrics(worker_runs):
    """The faircast/* metrics keep working with error feedback (audit on, summed over ranks)."""
    _, runs = worker_runs(2)
    metrics = runs["fsdp2_ef"][0]["metrics"]
    assert metrics["faircast/version"] == 2.0
    for key in ("faircast/served_changed_frac", "faircast/master_moved_frac", "faircast/bias_rel",
                "faircast/lag_steps"):
        assert key in metrics, f"{key} missing from {sorted(metrics)}"
    assert 0.0 < metrics["faircast/served_changed_frac"] <= 1.0
