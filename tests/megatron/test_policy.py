"""faircast/policy_* under Megatron-core (faircast_plugins/megatron/policy.py), CPU, gloo: the probe's metrics equal a
one-process reference (a TP=1 fp32 GPT holding the full served copy, then the full master), at world 1 (distributed
and Float16 optimizers, tied embedding), DP2, TP2, EP2 (MoE, SequentialMLP) and TP2 x DP2; flag off serves round to nearest of the master;
PP2; nothing is left behind (the run with the probe trains exactly as the run without); virtual pipeline chunks are refused.
The scenarios (tests/megatron/worker.py ``policy*``) run in test_megatron.py's launches."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("megatron.core")

# the scenarios run in test_megatron.py's torchrun launches (its WS1 / WS2 / WS4 lists; fixtures in conftest.py)
from tests.megatron.test_megatron import _ranks  # noqa: E402

KEYS = ("faircast/policy_kl", "faircast/policy_ess_frac", "faircast/policy_seq_log_ratio_std", "faircast/policy_seqs",
        "faircast/policy_tokens")


def _check(results, name, dp):
    ranks = _ranks(results, name)
    faircast = name != "policy_off"
    for r in ranks:
        first, _, third = r["metrics"]
        # step 0: the masters are Megatron's fp32 copies of the bf16 init: the views agree exactly
        assert first["faircast/policy_kl"] == 0.0 and first["faircast/policy_ess_frac"] == 1.0, first
        assert r["params_unchanged"] and r["shards_unchanged"], r
        assert r["modes_kept"], "a submodule kept in eval came back in the training model's mode"
        assert r["same_as_control"], "the run with the probe did not train exactly as the run without"
        assert r["master_view_exact"], "the assembled master view differs from the optimizer's masters"
        assert r["served_view_is"], f"served view != {'fair_cast' if faircast else 'round to nearest'}(master)"
        assert r["views_differ"] > 0 and r["version"] == 3
        ref = r["reference"]
        assert set(KEYS) <= set(third), third
        assert third["faircast/policy_seqs"] == ref["faircast/policy_seqs"] == 2 * dp
        assert third["faircast/policy_tokens"] == ref["faircast/policy_tokens"] == dp * (11 + 6)  # 11 and 6 completion tokens
        assert third["faircast/policy_kl"] > 0, third  # the masters moved off the bf16 grid after two steps
        # TP2 sums the row-parallel matmuls' partial products in another order than the TP=1 reference: fp32 logits
        # ~1e-7 apart move the sequence log-ratios (sums of per-token differences of ~-5 log-probs) by ~1e-6, so
        # their std (~3e-3 here) by up to ~1e-3 relative (measured 3e-6 to 2e-5); a wrong vocab slice or view would
        # be off by O(1). TP=1 (EP2 included): 1e-6 relative.
        tol = 1e-3 if name == "policy_tp2" else 1e-6
        for key in KEYS:
            assert math.isclose(third[key], ref[key], rel_tol=tol, abs_tol=1e-12), (key, third[key], ref[key])
    assert len({tuple(sorted(r["metrics"][2].items())) for r in ranks}) == 1  # every rank logs the same numbers


@pytest.mark.parametrize("name", ["policy", "policy_off", "policy_f16", "policy_tied"])
def test_world1_metrics_equal_the_one_process_reference(ws1, name):
    _check(ws1, name, dp=1)


@pytest.mark.parametrize("name,dp", [("policy", 2), ("policy_off", 2), ("policy_tp2", 1), ("policy_ep2", 2)])
def test_world2_metrics_equal_the_one_process_reference(ws2, name, dp):
    _check(ws2, name, dp)
    if name in ("policy", "policy_off"):  # DP ranks with different chunk counts: no hang, each keeps its own rows
        assert sorted(tuple(r["uneven_rows"]) for r in _ranks(ws2, name)) == [(1, 1), (2, 2)]


def test_tp2_x_dp2_metrics_equal_the_one_process_reference(ws4):
    _check(ws4, "policy_tp2", dp=2)


def test_pp2_metrics_equal_the_one_process_reference(ws2):
    """Two pipeline stages: the probe runs Megatron's forward-only schedule (fp32 activations between the stages)."""
    _check(ws2, "policy_pp2", dp=1)
    ranks = _ranks(ws2, "policy_pp2")
    assert sorted(r["coords"]["pp"] for r in ranks) == [0, 1]


def test_virtual_pipeline_is_refused_with_what_to_use(ws2):
    for r in _ranks(ws2, "policy_pp2"):
        assert r["refused"] and "one chunk per rank" in r["refused"], r


def test_verl_engine_refuses_the_metric_at_pp2(monkeypatch):
    """verl's Megatron engine at PP > 1: the pipelined probe has not run through it, so the metric is refused there
    (naming the option and what to use), before anything is patched."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from faircast_plugins import FairCastConfig
    from faircast_plugins.verl import megatron as verl_megatron

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    engine = SimpleNamespace(optimizer=object(), module=[])
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1 for the metric"):
        verl_megatron.activate(engine, FairCastConfig(enabled=True, seed=1, policy_metrics_every=1))
