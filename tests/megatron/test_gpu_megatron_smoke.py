"""python -m benchmarks.gpu.megatron_worker --cpu-smoke: the device script's Megatron part runs the worker (gloo, the stand-ins)
and judges it with the same criteria as tests/megatron/test_megatron.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_smoke(tmp_path):
    out = tmp_path / "megatron.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.megatron_worker", "--cpu-smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert proc.returncode == 0 and data["sections"] == {"megatron": "done", "megatron-cost": "done",
                                                                "megatron-doctor": "skipped"} and not data["failed"], \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["format"] == 1 and data["program"] == "benchmarks.gpu.megatron_worker" and data["commit"]  # envelope
    names = [c["check"] for c in data["checks"]]
    assert len(names) == 21 + 6 and all(c["ok"] for c in data["checks"]), names
    assert sum(n.startswith("megatron cost smoke") and "no host sync" in n for n in names) == 3
    assert any("do_off: every bf16 param is round-to-nearest" in n for n in names)
    assert sum("faircast export of the HF checkpoint" in n for n in names) == 5
