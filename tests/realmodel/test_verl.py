"""verl's real ActorRolloutRefWorker (FSDP2 and FSDP1, one gloo rank) on SmolLM2-135M-Instruct, Fair Cast and the
audit on.

The harness is tests/verl's (harness.py through conftest.run_ranks, ``light`` cases): init_model -> compute_log_prob
-> update_actor (two optimizer steps) -> update_weights(naive) -> compute_log_prob. The exported copy and the bf16
weights the last forward read equal fair_cast(master) at version 2, bit for bit (the 28.3M-element tied embedding
included); update_actor's ``faircast/*`` audit metrics are finite. Negative control, Fair Cast off (audit on): the
export and the forward are the round-to-nearest copy of the master."""
import importlib.util
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                                reason="the verl tier runs in the tests-verl virtualenv")

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def verl_runs(smollm2, tmp_path_factory):
    from tests.verl.conftest import ON_AUDIT, run_ranks

    audit_only = "+actor_rollout_ref.faircast={enable:false,audit:true}"
    cases = [dict(name="fsdp2_on", strategy="fsdp2", overrides=[ON_AUDIT], light=True),
             dict(name="fsdp2_off", strategy="fsdp2", overrides=[audit_only], light=True),
             dict(name="fsdp_on", strategy="fsdp", overrides=[ON_AUDIT], light=True)]
    runs = run_ranks(tmp_path_factory.mktemp("realmodel-verl"), model_dir=str(smollm2), world=1, cases=cases)
    return {name: results[0] for name, results in runs.items()}


def _bits(t):
    assert t.dtype == torch.bfloat16, t.dtype
    return t.view(torch.int16)


def _audit_finite(metrics):
    values = [v for vs in metrics.values() for v in (vs if isinstance(vs, list) else [vs])]
    assert metrics and values and all(math.isfinite(float(v)) for v in values), metrics


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_verl_worker_exports_and_computes_with_fair_cast_of_the_real_masters(verl_runs, strategy):
    from faircast_plugins import derive_key, fair_cast
    from tests.verl.conftest import SEED

    r = verl_runs[f"{strategy}_on"]
    assert r["version"] == 2 and r["seed"] == SEED
    masters, exported = r["masters"], r["exported"]
    assert masters[EMBED].numel() == 49152 * 576 > 2 ** 24 and "lm_head.weight" not in masters  # tied
    assert set(exported) - {"lm_head.weight"} == set(masters)
    differs_from_rtn = 0
    for name, master in masters.items():
        want = _bits(fair_cast(master, key=derive_key(SEED, 2, name), backend="torch"))
        assert torch.equal(_bits(exported[name]), want), f"export of {name}"
        if name == EMBED and "lm_head.weight" in exported:  # one parameter, served under both names
            assert torch.equal(_bits(exported["lm_head.weight"]), want)
        assert torch.equal(_bits(r["forward"][name]), want), f"forward of {name}"
        differs_from_rtn += not torch.equal(want, _bits(master.to(torch.bfloat16)))
    assert differs_from_rtn > 0
    _audit_finite(r["metrics"])


def test_verl_flag_off_serves_round_to_nearest(verl_runs):
    """faircast: {enable: false, audit: true}: the export and the forward both round to nearest (mode 'nearest')."""
    r = verl_runs["fsdp2_off"]
    assert r["version"] == 2  # the audit keeps the weight version
    assert set(r["exported"]) - {"lm_head.weight"} == set(r["masters"])
    for name, master in r["masters"].items():
        rtn = _bits(master.to(torch.bfloat16))
        assert torch.equal(_bits(r["exported"][name]), rtn) and torch.equal(_bits(r["forward"][name]), rtn), name
    assert any(not torch.equal(m, m.bfloat16().float()) for m in r["masters"].values())  # the step moved them
    _audit_finite(r["metrics"])
