"""python -m benchmarks.gpu.real_sizes --cpu-smoke: issue 29's device checks run on the CPU at tiny sizes (structure only),
leave their JSON behind, and say what needs CUDA and was skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_cpu_smoke(tmp_path):
    out = tmp_path / "real_sizes.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.real_sizes", "--cpu-smoke", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert proc.returncode == 0 and not data["failed"], tail
    assert data["sections"] == {"audit": "done", "fp8quant": "skipped", "fp8loss": "done", "offload": "skipped"}, tail
    assert data["audit"]["totals"]["n"] >= 4096
    assert {(r["fp8_loss"], r["checkpoint"]) for r in data["fp8loss"]["rows"]} == {
        (False, False), (True, False), (False, True), (True, True)}
    skipped = {s["what"] for s in data["skipped"]}
    assert skipped == {"section fp8quant", "section offload"}, data["skipped"]


def test_every_bf16_amax_blocks():
    """The fp8 check's input: one 128x128 block per positive normal bf16 value, that value the block's amax."""
    code = ("import sys; sys.argv = ['x', '--cpu-smoke']; import benchmarks.gpu.real_sizes as g;"
            "m = g.every_bf16_amax(); a = m.float().abs().reshape(256, 128, 127, 128).amax(dim=(1, 3));"
            "print(a.unique().numel(), int((a > 0).sum()), tuple(m.shape))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["32512", "32512", "(32768,", "16256)"], proc.stdout + proc.stderr


def test_offload_state_cost_cpu_smoke(tmp_path):
    """benchmarks/offload_state_cost.py --cpu-smoke (findings 5 and 6's before/after benchmark): its rows, on CPU."""
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "benchmarks/offload_state_cost.py", "--cpu-smoke", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["what"].split(":")[0] for r in data["finding6_ema_copy"]] == ["before", "after"]
    assert [r["what"].split(":")[0] for r in data["finding5_ef_export"]] == ["before", "after"]
