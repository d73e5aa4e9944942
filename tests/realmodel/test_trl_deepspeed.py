"""TRL GRPO on DeepSpeed ZeRO-2 and ZeRO-3 (bf16 engines, one CPU process, gloo) on SmolLM2-135M-Instruct, Fair Cast
and the audit on.

The harness is tests/trl's (ds_grpo.py, ``FAIRCAST_TEST_REAL_MODEL=1``: 2 steps of 2 prompts x 2 completions of 4
tokens, each snapshot compared in place): at the start and after each step, every module weight DeepSpeed holds
(gathered under ZeRO-3) equals fair_cast(DeepSpeed's fp32 master) of the current version, bit for bit; the audit's
metrics are finite. Negative control, Fair Cast off (audit on): the round-to-nearest copy. One process per ZeRO
stage, as tests/trl/test_deepspeed.py runs them (importing DeepSpeed and TRL is the slow part)."""
import importlib.util
import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "trl"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
                                reason="the TRL tier runs in the tests-trl virtualenv (trl, deepspeed)")

INVOCATIONS = [["z2:stochastic", "z2:off"], ["z3:stochastic", "z3:off"]]


@pytest.fixture(scope="module")
def ds_runs(smollm2, tmp_path_factory):
    import test_deepspeed

    out = tmp_path_factory.mktemp("realmodel-ds")
    os.environ["FAIRCAST_TEST_REAL_MODEL"] = "1"
    try:
        for scenarios in INVOCATIONS:
            test_deepspeed._invoke(str(smollm2), out, scenarios)
    finally:
        del os.environ["FAIRCAST_TEST_REAL_MODEL"]
    return {s: test_deepspeed._load(out, s.replace(":", "-")) for scenarios in INVOCATIONS for s in scenarios}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_engine_holds_fair_cast_of_the_real_masters(ds_runs, stage):
    for mode in ("stochastic", "off"):  # "off": the negative control, round to nearest
        res = ds_runs[f"z{stage}:{mode}"]
        assert res["is_deepspeed"] and res["zero_stage"] == stage
        snaps = res["steps"]
        assert [s["global_step"] for s in snaps] == [0, 1, 2]
        assert snaps[0]["numel"]["model.embed_tokens.weight"] == 49152 * 576 > 2 ** 24
        for s in snaps:
            assert s["compared"] >= 272 and s["mismatches"] == [], (mode, s["global_step"], s["mismatches"][:5])
        if mode == "stochastic":
            assert [s["version"] for s in snaps] == [0, 1, 2]
            assert snaps[-1]["differs_from_nearest"] > 0  # the check tells Fair Cast from round-to-nearest
        audit = [{k: v for k, v in h.items() if k.startswith("faircast/")} for h in res["logs"]]
        assert len(audit) == 2 and all(audit), res["logs"]
        assert all(math.isfinite(v) for a in audit for v in a.values()), audit
