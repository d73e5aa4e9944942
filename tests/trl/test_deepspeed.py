"""GRPO on a real DeepSpeed ZeRO-2 and ZeRO-3 bf16 engine through TRL/accelerate (CPU, gloo, one process).

With ``faircast=True`` the module's bf16 weights (the copy the loss, the old log-probs and a vLLM export use) equal
``fair_cast(fp32 master)`` at the weight version of every step, with the masters read from DeepSpeed's optimizer;
with Fair Cast off (negative control) they equal DeepSpeed's round-to-nearest copy of the same masters.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster
from helpers import expected_served

SCRIPT = Path(__file__).with_name("ds_grpo.py")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed in this environment (nox -s tests-trl installs it)")


OPTIMIZER = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


def _run(tiny_model_dir, out: Path, mode: str, stage: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, str(SCRIPT), tiny_model_dir, str(out), mode, str(stage)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return torch.load(out / f"{mode}.pt", weights_only=False)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def ds_runs(request, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"trl-ds-zero{request.param}")
    return request.param, {mode: _run(tiny_model_dir, out, mode, request.param) for mode in ("stochastic", "off")}


def _masters_moved_off_grid(steps) -> bool:
    return any(not torch.equal(m, m.bfloat16().float()) for s in steps for m in s["masters"].values())


def test_served_copy_is_fair_cast_of_the_deepspeed_masters(ds_runs):
    stage, runs = ds_runs
    run = runs["stochastic"]
    steps = run["steps"]
    assert run["is_deepspeed"] and run["zero_stage"] == stage
    assert len(steps) == 3 and {s["optimizer"] for s in steps} == {OPTIMIZER[stage]}
    assert [s["version"] for s in steps] == [s["global_step"] for s in steps] == [1, 2, 3]
    assert _masters_moved_off_grid(steps)  # otherwise any rounding would match
    differs_from_nearest = 0
    for s in steps:
        for name, master in s["masters"].items():
            served = s["served"][name]
            assert served.dtype == torch.bfloat16, name
            want = expected_served(master, seed=run["seed"], version=s["version"], name=name, mode="stochastic")
            assert torch.equal(served, want), (s["version"], name)
            differs_from_nearest += int(not torch.equal(served, master.to(torch.bfloat16)))
        assert s["metrics"]["faircast/version"] == s["version"]
    assert differs_from_nearest > 0  # the check above would not tell Fair Cast from round-to-nearest


def test_without_faircast_deepspeed_serves_round_to_nearest(ds_runs):
    stage, runs = ds_runs
    run = runs["off"]
    steps = run["steps"]
    assert run["is_deepspeed"] and run["zero_stage"] == stage and len(steps) == 3
    assert [s["version"] for s in steps] == [None] * 3  # no Fair Cast callback
    assert _masters_moved_off_grid(steps)
    stochastic_differs = 0
    for s in steps:
        for name, master in s["masters"].items():
            assert torch.equal(s["served"][name], master.to(torch.bfloat16)), (s["global_step"], name)
            sr = expected_served(master, seed=run["seed"], version=s["global_step"], name=name, mode="stochastic")
            stochastic_differs += int(not torch.equal(s["served"][name], sr))
    assert stochastic_differs > 0


def test_ema_serves_fair_cast_of_the_ema_of_the_deepspeed_masters(tiny_model_dir, tmp_path):
    """faircast_ema_decay under DeepSpeed (ZeRO-2): the bf16 weights are fair_cast(EMA of the master), equal to a
    FairCaster that runs the same EMA on the recorded masters from the initial weights; not fair_cast(master)."""
    run = _run(tiny_model_dir, tmp_path, "ema", 2)
    assert run["is_deepspeed"] and run["ema_decay"] > 0
    ref = FairCaster(FairCastConfig(enabled=True, seed=run["seed"], ema_decay=run["ema_decay"], backend="torch"))
    ref.cast_many({n: w.float() for n, w in run["initial"].items()})  # version 0: the EMA starts at the master
    not_the_master = 0
    for s in run["steps"]:
        ref.advance(s["masters"])
        assert ref.version == s["version"] == s["global_step"]
        for name, master in s["masters"].items():
            assert torch.equal(s["served"][name], ref.cast(name, master)), (s["version"], name)
            plain = expected_served(master, seed=run["seed"], version=s["version"], name=name, mode="stochastic")
            not_the_master += int(not torch.equal(s["served"][name], plain))
    assert not_the_master > 0  # the check above would not tell the EMA from the master
