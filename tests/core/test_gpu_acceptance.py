"""benchmarks/gpu_acceptance.py: the device run's orchestration on CPU, in seconds: a part that cannot start in
the time left is skipped with the reason, unknown parts are refused, and the record is written (the parts' own
runs are tests/core/test_gpu_check_smoke.py and tests/trl/test_gpu_acceptance_smoke.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_acceptance.py")


def test_parts_without_time_are_skipped_with_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--budget-s", "0", "--parts", "kernel,fsdp2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    data = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert proc.returncode == 0 and data["finished"], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert data["parts"]["fsdp2"]["status"] == "skipped"
    assert data["parts"]["fsdp2"]["why"].startswith("the time budget was spent")
    skipped = {s["what"]: s["why"] for s in data["skipped"]}
    assert skipped["trl"] == "not selected (--parts)" and "fsdp2" in skipped
    assert data["env"]["versions"]["torch"]["version"] and data["env"]["faircast_plugins"]
    assert len(data["env"]["commit"]["sha"]) == 40 and data["env"]["commit"]["from"] == "git"  # the code it ran
    assert "skipped  fsdp2: the time budget was spent" in proc.stdout


def test_unknown_part_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--parts", "fsdp3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown part(s) ['fsdp3']" in proc.stderr


def test_the_documented_device_command_is_one_and_fits_the_tool():
    """The one `run` command, as the script's docstring and docs/kernels.md give it: the same line, under the device
    tool's 2000 characters, installing the carried wheels before the script runs."""
    import re

    pattern = re.compile(r"^ *(python3 -m pip install .*benchmarks/gpu_acceptance\.py.*)$", re.M)
    with open(SCRIPT) as fh:
        in_script = pattern.findall(fh.read())
    with open(os.path.join(REPO, "docs", "kernels.md")) as fh:
        in_docs = pattern.findall(fh.read())
    assert len(in_script) == 1 and in_docs == in_script, (in_script, in_docs)
    command = in_script[0]
    assert len(command) < 2000
    assert "--target /tmp/site .whl/*.whl" in command and "--no-index" in command and "$OUT" in command
