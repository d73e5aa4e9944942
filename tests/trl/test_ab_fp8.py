"""The A/B harness's fp8 arm pair (``standard-fp8``, ``faircast-fp8``): the engine serves the dequantized fp8 copy.

Unit: the arms and the fp8 stage (``run_one.fp8_engine_copy``: verl's ``x.to(bf16)`` then the blockwise e4m3
copy for linear weights; bit-identity with verl's own quantizer is tests/verl/test_fp8_rollout.py). End to end:
``faircast ab --preset smoke --arms standard,standard-fp8,faircast-fp8 --seeds 0`` runs them through real TRL
and a real vLLM engine, records the engine as an emulation, and each fp8 arm's readout of its own rule (fp8 of
round-to-nearest, fp8 of the stochastic copy) is, bit for bit, what its engine was served.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from faircast_plugins import fair_cast
from faircast_plugins.ab.arms import FP8_ENGINE, parse_arm
from faircast_plugins.ab.run_one import fp8_engine_copy
from faircast_plugins.fp8 import dequantize_blockwise, quantize_blockwise

FP8_ARMS = ["standard-fp8", "faircast-fp8"]


def test_fp8_arms_and_their_stage():
    std, fc = parse_arm("standard-fp8"), parse_arm("faircast-fp8")
    assert std.fp8 and fc.fp8 and not std.faircast and fc.faircast and fc.mode == "stochastic"
    assert std.engine_dtype == fc.engine_dtype == "float32"  # the dequantized fp8 values, held exactly
    assert not parse_arm("standard").fp8 and parse_arm("faircast-fp8@lr=1e-5").lr == 1e-5
    g = torch.Generator().manual_seed(0)
    master = torch.randn(200, 136, generator=g) * 0.02
    q, s = quantize_blockwise(master.to(torch.bfloat16))
    held = fp8_engine_copy("model.layers.0.self_attn.q_proj.weight", master)  # standard: fp8 of round-to-nearest
    assert held.dtype == torch.float32 and torch.equal(held, dequantize_blockwise(q, s))
    assert not torch.equal(held, master.to(torch.bfloat16).float())  # the fp8 stage changed it
    served = fair_cast(master, key=7)  # faircast: fp8 of the Fair Cast copy
    assert torch.equal(fp8_engine_copy("model.layers.0.mlp.down_proj.weight", served),
                       dequantize_blockwise(*quantize_blockwise(served)))
    emb = fp8_engine_copy("model.embed_tokens.weight", master)  # not a linear layer: bf16 as sent
    assert torch.equal(emb, master.to(torch.bfloat16).float())
    assert "emulated fp8" in FP8_ENGINE


@pytest.fixture(scope="module")
def fp8_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab_fp8")
    run = subprocess.run([sys.executable, "-m", "faircast_plugins.cli", "ab", "--preset", "smoke", "--arms",
                          ",".join(["standard", *FP8_ARMS]), "--seeds", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return out


def test_smoke_runs_the_fp8_arms(fp8_smoke):
    out = fp8_smoke
    res = json.loads((out / "results.json").read_text())
    assert res["failed_runs"] == [] and res["missing_runs"] == []
    assert sorted(r["arm"] for r in res["runs"]) == sorted(["standard", *FP8_ARMS])
    for arm in FP8_ARMS:
        run = json.loads((out / "runs" / arm / "seed0.json").read_text())
        assert run["engine"] == FP8_ENGINE
        assert "faircast/lag_steps" in run["steps"][-1]  # the audit measured what the (fp8) engine held
        for e in run["evals"]:
            assert 0.0 <= e["served_expected"] <= 1.0
            # the readouts go through the same fp8 stage: the arm's own rule is what its engine was served
            assert e["rtn_is_served"] is (arm == "standard-fp8")
            assert e["sr_is_served"] is (arm == "faircast-fp8")
    assert json.loads((out / "runs" / "standard" / "seed0.json").read_text())["engine"] == "bfloat16"
