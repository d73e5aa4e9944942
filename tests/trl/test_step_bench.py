"""The per-step benchmark's TRL, FSDP2 and ZeRO-3 drivers, smoke-sized (checks: tests/step_bench_checks.py)."""
from __future__ import annotations

import importlib.util

import pytest

from tests.step_bench_checks import check_step_bench_smoke

DRIVERS = {
    "trl": ["trl_plain.py", "--policy-seqs", "2"],  # + the faircast/policy_* probe arms
    "fsdp2": ["fsdp2.py", "--policy-seqs", "2"],  # + the probe arms through the FSDP2 views
    "zero3": ["deepspeed_zero.py", "--stage", "3", "--policy-seqs", "1"],  # + the probe arms (OpenRLHF's path)
}


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


@pytest.mark.parametrize("path", [
    pytest.param("trl", marks=_needs("trl")),
    pytest.param("fsdp2", marks=_needs("trl")),
    pytest.param("zero3", marks=_needs("deepspeed")),
])
def test_step_bench_smoke(path, tmp_path):
    check_step_bench_smoke(DRIVERS[path], tmp_path, one_process_masters=path == "trl")

