"""python -m benchmarks.gpu: the GPU run's orchestration on CPU, in seconds: a part that cannot start in the time
left is skipped with the reason, unknown parts are refused, and the record is written with the envelope every
result of benchmarks/gpu carries (the parts' own runs are tests/core/test_gpu_check_smoke.py and
tests/trl/test_gpu_acceptance_smoke.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
GPU = os.path.join(REPO, "benchmarks", "gpu")


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_parts_without_time_are_skipped_with_the_reason(tmp_path):
    proc = run("--cpu-smoke", "--budget-s", "0", "kernel", "fsdp2", "--out", str(tmp_path))
    data = json.loads((tmp_path / "run.json").read_text())
    assert proc.returncode == 0 and data["finished"], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert data["parts"]["fsdp2"]["status"] == "skipped"
    assert data["parts"]["fsdp2"]["why"].startswith("the time budget was spent")
    skipped = {s["what"]: s["why"] for s in data["skipped"]}
    assert skipped["trl"] == "not selected" and "fsdp2" in skipped
    assert "skipped  fsdp2: the time budget was spent" in proc.stdout
    # the envelope: the code it ran (this checkout's commit), when, with what, on what
    from benchmarks.gpu.record import ENVELOPE, FORMAT

    assert list(data)[:len(ENVELOPE)] == list(ENVELOPE) and data["format"] == FORMAT
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert data["commit"] == head and data["commit_from"] == "git" and isinstance(data["dirty"], bool)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["time"])
    assert data["versions"]["torch"]["version"] and data["faircast_plugins"].startswith(REPO)
    assert data["device"]["cuda"] is False and data["program"] == "benchmarks.gpu"


def test_unknown_part_is_refused(tmp_path):
    proc = run("--cpu-smoke", "fsdp3", "--out", str(tmp_path))
    assert proc.returncode == 2 and "unknown part(s) ['fsdp3']" in proc.stderr


def test_list_names_every_part_and_what_it_needs():
    proc = run("--list")
    assert proc.returncode == 0, proc.stderr
    for part, needs in (("kernel", "triton>=3.2"), ("megatron", "megatron-core==0.16.1"),
                        ("deepspeed", "deepspeed==0.19.6"), ("trl", "trl==1.16.0"), ("fsdp2", "torch only")):
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.split()[0] == part]
        assert needs in line, line


def test_the_offline_command_is_one_line_in_the_readme_and_uses_the_wheels():
    """The one install-and-run line for a GPU machine without network: in the README, with the wheels of wheels.sh
    installed apart (--target) and the entry point run from the checkout."""
    pattern = re.compile(r"^ *(python3 -m pip install .*-m benchmarks\.gpu.*)$", re.M)
    with open(os.path.join(GPU, "README.md")) as fh:
        (command,) = pattern.findall(fh.read())
    assert len(command) < 2000
    assert "--target /tmp/site .whl/*.whl" in command and "--no-index" in command and "PYTHONPATH=/tmp/site" in command


def test_the_user_docs_name_no_setup_of_ours():
    """What a user runs on their own GPU box is documented without the machinery this project ran it with."""
    with open(os.path.join(GPU, "README.md")) as fh:
        text = fh.read()
    for word in ("$OUT", "carr", "lent", "device tool", "the device"):
        assert word not in text, word


def test_load_gives_the_committed_results_the_envelope():
    """The runs of 2026-12-04 were written before the envelope (format 0): load() reads them with the same keys, the
    commit unknown (their README names it), and a new record as written."""
    import glob

    from benchmarks.gpu.record import ENVELOPE, load

    paths = sorted(glob.glob(os.path.join(GPU, "results", "*", "run*.json")))
    assert len(paths) >= 4
    for path in paths:
        data = load(path)
        assert set(ENVELOPE) <= set(data) and data["format"] in (0, 1), path
        assert data["device"]["name"] == "NVIDIA H200" and data["device"]["count"] == 1, (path, data["device"])
        assert data["versions"]["torch"]["version"].startswith("2.11"), path
    run3 = load(os.path.join(GPU, "results", "2026-12-04-h200", "run3-after-fixes.json"))
    assert run3["format"] == 0 and run3["commit"] is None and run3["device"]["capability"] == "9.0"
    assert run3["parts"]["megatron"]["status"] == "done" and "env" in run3  # the rest of the record as it was


# Files that may still name the scripts' old paths: the run records (logs and JSON as written then) and, until the
# branch editing its content is merged, megatron_worker.py's docstring and one Skip message.
OLD_PATHS_ALLOWED = ("benchmarks/gpu/results/",)


def test_no_file_names_the_old_gpu_script_paths():
    """The GPU scripts moved into benchmarks/gpu/ (one entry point): no page, test or script points to the old files."""
    old = re.compile(r"benchmarks/gpu_(acceptance|adapters|check|megatron|paths|real_sizes|report|wheels|results)\b"
                     r"|\bfrom gpu_report\b|\bimport gpu_\w+")
    found = []
    for top in ("README.md", "docs", "benchmarks", "tests", "faircast_plugins", "examples", "noxfile.py", ".gitignore"):
        for dirpath, _, files in os.walk(os.path.join(REPO, top)) if os.path.isdir(os.path.join(REPO, top)) else \
                [(REPO, [], [top])]:
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, REPO)
                if rel.startswith(OLD_PATHS_ALLOWED) or not name.endswith((".py", ".md", ".sh", ".toml", ".txt", ".yaml",
                                                                            ".gitignore")):
                    continue
                with open(path, encoding="utf-8", errors="replace") as fh:
                    found += [f"{rel}:{i}" for i, line in enumerate(fh, 1) if old.search(line)]
    assert found == []
