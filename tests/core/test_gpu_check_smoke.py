"""python -m benchmarks.gpu.kernel --cpu-smoke: the GPU run's kernel part's bits, auto, stream, paths, huge and regs sections run on CPU
(Triton interpreter, and the real compiler for sm_90), leave their JSON behind section by section, and say what
needs CUDA and was skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_cpu_smoke_bits_gaps_and_regs(tmp_path):
    out = tmp_path / "kernel.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.kernel", "--cpu-smoke", "--skip", "export,speed,tiles",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    data = json.loads(out.read_text())
    assert data["sections"] == {"bits": "done", "auto": "done", "stream": "done", "paths": "done", "master16": "done",
                                "huge": "done", "export": "skipped", "regs": "done", "speed": "skipped",
                                "tiles": "skipped"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = [c["check"] for c in data["checks"]]
    for expected in ("golden table == CPU reference", "master16: Triton compact + recover give every master back", f"specials stochastic @{2**63 - 4099 - 0}",
                     "specials error_feedback, non-zero residual == CPU reference", "element tensor (nearest",
                     "fair_cast_many(backend='auto')", "FairCaster.cast (config backend 'auto')",
                     "auto with TRITON_INTERPRET=1 exported (finding 11): the cast runs",
                     "fair_cast on the CPU (no streams), behind the write of its input",
                     "65,536-element tensor (error_feedback, aligned @8589934592), 7 chunks",
                     "(error_feedback, aligned @8589934592): the kernel's aligned branch is the one taken",
                     "(error_feedback, unaligned @8589934595): the kernel's unaligned branch is the one taken",
                     "DTensor on a one-rank gloo group (finding 3): fair_cast refuses with a TypeError naming to_local",
                     "DTensor on a one-rank gloo group (finding 3): FairCaster.cast refuses",
                     "DTensor (finding 3): nothing was launched before the refusals",
                     "DTensor's local shard after the refusals, FairCaster.cast == CPU reference",
                     "audit metrics on CPU (no CUDA device: the structure only) == on CPU tensors, float-equal",
                     "audit (finding 2, Fair Cast on): a parameter observed on cpu then on the host",
                     "negative control: the audit metrics of Fair Cast differ from the flag-off run's"):
        assert any(expected.split(" == ")[0] in n for n in names), expected
    skipped = {s["what"]: s["why"] for s in data["skipped"]}
    assert skipped["stream negative control"] == "the CPU has no streams"
    assert "no CUDA device" in skipped["backend='auto' on CUDA picks 'triton'"]
    for cuda_only in ("auto on CUDA with TRITON_INTERPRET=1 takes the torch path with a warning (finding 11)",
                      "auto on CUDA without triton (finding 7)", "audit host syncs on CUDA (finding 8)",
                      "FairCaster.cast_many over two devices (finding 10)"):
        assert "CUDA" in skipped[cuda_only], cuda_only
    assert skipped["section export"].startswith("not selected")
    assert any(r["rows"] == 256 and not r["spills"] for r in data["regs"])
    failures = [c["check"] for c in data["checks"] if not c["ok"]]
    assert not failures and not data["nan_only"], (failures, data["nan_only"])
    assert proc.returncode == 0
