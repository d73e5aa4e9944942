"""The README's main job, smoke-sized: every arm runs with a real vLLM engine and the table and plot come out."""
from __future__ import annotations

import json
import os
import subprocess
import sys

DEMO = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "demo", "run_demo.py")


def test_demo_runs_every_arm_and_reports(tmp_path):
    run = subprocess.run([sys.executable, DEMO, "--steps", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "standard export" in run.stdout and "Fair Cast" in run.stdout and "sticky" in run.stdout
    assert "lag, steps" in run.stdout
    assert os.path.getsize(tmp_path / "lag.png") > 1000
    res = json.loads((tmp_path / "results.json").read_text())
    std, fc, sticky = (res["summary"][arm] for arm in ("standard export", "Fair Cast", "sticky"))
    assert [len(h) for h in res["history"].values()] == [4, 4, 4]
    # even after 4 steps at lr 1e-6 the standard export's served copy trails by steps, Fair Cast's does not
    assert std["lag_steps_max"] > 2 and abs(fc["lag_steps_final"]) < 1
    assert fc["served_changed_frac"] > 3 * std["served_changed_frac"]
    assert std["bias_rel"] > 0.5 > 0.2 > fc["bias_rel"]
    # sticky follows the master like stochastic rounding, with far fewer served elements changing per step
    assert abs(sticky["lag_steps_final"]) < 1 and sticky["bias_rel"] < 0.2
    # (per step after the first: at step 1 both change the elements whose first Adam step crossed a threshold)
    last = {arm: h[-1]["faircast/served_changed_frac"] for arm, h in res["history"].items()}
    assert last["sticky"] < last["Fair Cast"] / 3, last


def test_demo_real_model_option_parses_and_its_reward_has_a_gradient():
    """``--model smollm2`` (the real model; a full run is `nox -s demo -- --model smollm2`): its defaults, and the
    partial-credit reward that gives GRPO a gradient before the model knows the answer format."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.parse_args(["--model", "smollm2"]).steps == 8 and demo.parse_args([]).steps == 60
    reward = demo.partial_credit({"p": " 2 * 3 = 6. 10 + 6 = 16. Answer: 16\n"})
    full, some, none = reward(["p", "p", "p"], [" 2 * 3 = 6. 10 + 6 = 16. Answer: 16\nmore", "She has 10 and 3", "x"])
    assert full == 1.0 and 0 < some < 1 and none == 0.0
