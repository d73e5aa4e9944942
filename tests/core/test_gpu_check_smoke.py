"""benchmarks/gpu_check.py --cpu-smoke: the GPU check's bits and regs sections run on CPU (Triton interpreter, and
the real compiler for sm_90) and leave their JSON behind, section by section."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_cpu_smoke_bits_and_regs(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--skip", "export,speed,tiles",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    data = json.loads(out.read_text())
    assert data["sections"] == {"bits": "done", "export": "skipped", "regs": "done", "speed": "skipped",
                                "tiles": "skipped"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = [c["check"] for c in data["bits"]]
    for expected in ("golden table == CPU reference", f"specials stochastic @{2**63 - 4099 - 0}",
                     "specials error_feedback, non-zero residual == CPU reference", "element tensor (nearest)"):
        assert any(expected.split(" == ")[0] in n for n in names), expected
    assert any(r["rows"] == 256 and not r["spills"] for r in data["regs"])
    failures = [c["check"] for c in data["bits"] if not c["ok"]]
    assert not failures and not data["nan_only"], (failures, data["nan_only"])
    assert proc.returncode == 0
