"""The README's main job, smoke-sized: both arms run with a real vLLM engine and the table and plot come out."""
from __future__ import annotations

import json
import os
import sys

DEMO = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "demo")


def test_demo_runs_both_arms_and_reports(tmp_path, capsys):
    sys.path.insert(0, DEMO)
    try:
        import run_demo
    finally:
        sys.path.remove(DEMO)
    assert run_demo.main(["--steps", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "standard export" in out and "Fair Cast" in out and "lag, steps" in out
    assert os.path.getsize(tmp_path / "lag.png") > 1000
    res = json.loads((tmp_path / "results.json").read_text())
    std, fc = res["summary"]["standard export"], res["summary"]["Fair Cast"]
    assert len(res["history"]["standard export"]) == len(res["history"]["Fair Cast"]) == 4
    # even after 4 steps at lr 1e-6 the standard export's served copy trails by steps, Fair Cast's does not
    assert std["lag_steps_max"] > 2 and abs(fc["lag_steps_final"]) < 1
    assert fc["served_changed_frac"] > 5 * std["served_changed_frac"]
