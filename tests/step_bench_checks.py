"""The per-step benchmark (benchmarks/step/), smoke-sized, shared by the framework suites that can run its drivers.

Structure only (a tiny model, one repetition, three arms): the timings mean nothing here. What is checked is what the
table is built from: every arm is there, ratios are to flag off, and the counted Fair Cast state is what each path
must hold -- none for stochastic under DeepSpeed, FSDP2 and verl's worker (their targets: +0 B/param), the 2 B (or
fp32) masters for TRL in one process; error feedback's residuals are found on every path (the negative control: the
counter sees state when there is some).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
STEP = os.path.join(ROOT, "benchmarks", "step")
ARMS = "stochastic,error_feedback + audit"
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_step_bench_smoke(driver: list, tmp_path, *, one_process_masters: bool = False, env: dict = None) -> dict:
    """Run ``benchmarks/step/<driver[0]> <driver[1:]> --smoke`` on three arms and check its table; returns its rows."""
    out = tmp_path / "step.json"
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    run_env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=ROOT + os.pathsep + run_env.get("PYTHONPATH", ""), **(env or {}))
    cmd = [sys.executable, os.path.join(STEP, driver[0]), *driver[1:], "--smoke", "--arms", ARMS, "--json", str(out)]
    run = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ratio (med)" in run.stdout and "breakdown" in run.stdout
    result = json.loads(out.read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    probes = ["flag off + policy probe", "stochastic + policy probe"] if "--policy-seqs" in driver else []
    assert list(rows) == ["flag off", "stochastic", "error_feedback + audit", *probes]
    if probes:  # --policy-seqs (trl_plain.py, deepspeed_zero.py): the probe ran each step and its cost line printed
        assert "cost per step at faircast_policy_metrics_every=10" in run.stdout
        assert run.stdout.count("probe every step") == 2
    assert result["smoke"] and result["reps"] == 1 and result["params"] > 0
    assert rows["flag off"]["ratio_median"] == 1.0 and rows["flag off"]["state_bytes"] == 0
    assert all(r["ms_median"] > 0 for r in rows.values())
    stochastic, ef = rows["stochastic"], rows["error_feedback + audit"]
    if one_process_masters:  # shadow masters in one process: +2 or +4 B/param, whatever the backend keeps
        assert 2.0 <= stochastic["state_b_per_param"] <= 4.0, stochastic
    else:  # the masters are the framework's own: Fair Cast holds nothing for a stateless mode
        assert stochastic["state_bytes"] == 0, stochastic["state_holders"]
        assert stochastic["target"].startswith(("met", "MISS: time")), stochastic["target"]  # never a memory miss
    # error feedback keeps a residual per element (4 B/param over the ranks) and its served copy, the audit its tracks
    assert ef["state_b_per_param"] >= 4.0 and any("_ef" in k for k in ef["state_holders"]), ef["state_holders"]
    assert any("audit" in k for k in ef["state_holders"]), ef["state_holders"]
    assert set(ef["breakdown_ms"]) >= {"step", "engine: cast kernel", "engine: audit"}, ef["breakdown_ms"]
    return rows
