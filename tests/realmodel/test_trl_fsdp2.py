"""TRL GRPO on FSDP2 (2 CPU ranks, gloo, bf16 mixed precision) on SmolLM2-135M-Instruct, Fair Cast and the audit on.

The harness is tests/trl's (fsdp_grpo.py under torchrun, ``FAIRCAST_TEST_REAL_MODEL=1``: 2 steps, 2 prompts x 2
completions of 4 tokens): every forward (generation, old log-probs, loss) reads, on every rank's shards, bf16 weights
equal to fair_cast(gathered fp32 master) of the current version, bit for bit; the audit's metrics (all-reduced over
the shards) are finite. Negative control, Fair Cast off (audit on): the round-to-nearest copy."""
import importlib.util
import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "trl"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="the TRL tier runs in the tests-trl virtualenv")


def _check(ranks, faircast: bool):
    for r, res in enumerate(ranks):
        assert res["rank"] == r and res["world"] == 2 and res["is_fsdp"] and res["fsdp_version"] == 2
        assert res["param_dtype"] == "torch.bfloat16" and "FSDPLlamaDecoderLayer" in res["fsdp_types"]
        assert res["steps"] == 2 and res["forwards"]["grad"] == 2 and res["forwards"]["no_grad"] > 0
        assert res["checked"] > 0 and res["n_mismatches"] == 0, res["mismatches"][:5]
        if faircast:
            assert res["version"] == 2 and res["differs_from_nearest"] > 0
        audit = [h for h in res["logs"] if "faircast/served_changed_frac" in h]
        assert len(audit) == 2, res["logs"]
        assert all(math.isfinite(v) for h in audit for v in h.values()), audit


def test_trl_fsdp2_every_forward_runs_on_fair_cast_of_the_real_masters(smollm2, tmp_path, monkeypatch):
    from test_fsdp import _run

    monkeypatch.setenv("FAIRCAST_TEST_REAL_MODEL", "1")
    _check(_run(str(smollm2), tmp_path, "stochastic"), faircast=True)
    _check(_run(str(smollm2), tmp_path, "off"), faircast=False)  # negative control: round to nearest
