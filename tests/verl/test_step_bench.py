"""The per-step benchmark's verl FSDP2 worker driver (benchmarks/step/verl_fsdp2.py), smoke-sized, at 2 gloo ranks
(checks: tests/step_bench_checks.py): verl's worker holds no Fair Cast state for a stateless mode."""
from __future__ import annotations

from tests.step_bench_checks import check_step_bench_smoke


def test_verl_step_bench_smoke(tmp_path):
    check_step_bench_smoke(["verl_fsdp2.py", "--model-dir", str(tmp_path / "model"), "--policy-seqs", "2"], tmp_path,
                           env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VERL_PLATFORM": "cpu"})
