"""python -m benchmarks.gpu --cpu-smoke: the GPU run's adapter parts, each in its own process as on the GPU, on
the CPU with gloo: FSDP2's cast site, DeepSpeed ZeRO-2 and ZeRO-3, and a TRL GRPO run, each with Fair
Cast on (== fair_cast(master), != round-to-nearest) and flag off (== round-to-nearest, != fair_cast(master)).
The kernel parts are tests/core/test_gpu_check_smoke.py's (this session has no triton)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
ADAPTERS = {"fsdp2": ["FSDP2 forward weights"],
            "deepspeed": ["DeepSpeed ZeRO-2 weights after each step", "DeepSpeed ZeRO-3 weights after each step"],
            "trl": ["GRPO forward weights", "TRL export iterator (engine-bound copy)"]}


def test_adapter_parts_match_fair_cast_and_their_flag_off_controls(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--cpu-smoke", *ADAPTERS, "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    data = json.loads((tmp_path / "run.json").read_text())
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and data["finished"] and not data["failed"], tail
    assert {s["what"] for s in data["skipped"]} == {"kernel", "realsize", "megatron", "export", "perf"}, data["skipped"]
    for part, labels in ADAPTERS.items():
        entry = data["parts"][part]
        assert entry["status"] == "done", (part, entry.get("why"), tail)
        result = entry["result"]
        assert result["checks"] and all(c["ok"] for c in result["checks"])
        tallies = result["adapters"]
        for label in labels:
            (on,) = [v for k, v in tallies.items() if k.startswith(label) and k.endswith("Fair Cast on")]
            assert on["elements"] > 0 and on["not_bf16"] == 0
            assert on["differ_from_fair_cast"] == 0 and on["differ_from_nearest"] > 0, (label, on)
            if label == "GRPO forward weights":  # flag off: the forward runs on the fp32 master (a grid check)
                continue
            (off,) = [v for k, v in tallies.items() if k.startswith(label) and k.endswith("flag off")]
            assert off["elements"] == on["elements"]
            assert off["differ_from_nearest"] == 0 and off["differ_from_fair_cast"] > 0, (label, off)
    fsdp2 = data["parts"]["fsdp2"]["result"]
    assert fsdp2["process_group"]["backend"] == "gloo"
    assert fsdp2["program"] == "benchmarks.gpu.adapters" and fsdp2["commit"] == data["commit"]  # each part's envelope
