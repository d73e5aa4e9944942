"""benchmarks/verl_delta.py --smoke: elements changed per version in verl's delta_sharded source, per mode.

One rank, FSDP2, masters off the bf16 grid (the session's fp32 tiny model), Adam lr 1e-6, three versions through
verl's real ``prime_delta_snapshots`` / ``get_per_tensor_param_delta_shard``. Sticky is as sparse as
round-to-nearest; the negative control, stochastic (fresh thresholds every version), is not.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import ROOT, RANK_TIMEOUT_S


def test_delta_traffic_smoke(model_dir, tmp_path):
    out = tmp_path / "delta.json"
    proc = subprocess.run([sys.executable, "benchmarks/verl_delta.py", "--smoke", "--model-dir", model_dir,
                           "--out-dir", str(tmp_path / "runs"), "--json", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=RANK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| fsdp2 | 1 | sticky |" in proc.stdout  # the printed table
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert sorted(rows) == ["nearest", "sticky", "stochastic"]
    for r in rows.values():
        assert r["strategy"] == "fsdp2" and r["world"] == 1 and r["lr"] == 1e-6
        assert len(r["changed_frac"]) == report["config"]["versions"] == 3
        assert r["total_elements"] > 0 and r["lag_steps"] is not None and r["bias_rel_cumulative"] is not None
    near, sr, sticky = (rows[m]["steady_changed_frac"] for m in ("nearest", "stochastic", "sticky"))
    assert 0 < near < sr / 4, (near, sr)  # negative control: fresh thresholds every version are not sparse
    assert 0.5 * near < sticky < 1.5 * near, (near, sticky)  # fixed thresholds change as rarely as nearest
