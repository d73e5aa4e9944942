"""Two-process DDP (torchrun, gloo on CPU): every rank serves the same fair_cast(master) and keeps the same masters,
with regular generation and with transformers' continuous batching (``use_transformers_continuous_batching``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faircast_plugins import derive_key, fair_cast

SCRIPT = Path(__file__).with_name("ddp_grpo.py")


@pytest.mark.parametrize("generation", ["generate", "continuous_batching"])
def test_ddp_ranks_serve_identical_fair_cast_copies(tmp_path, tiny_model_dir, generation):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", "29531", str(SCRIPT), tiny_model_dir, str(tmp_path),
         *(["cb"] if generation == "continuous_batching" else [])],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and [r["version"] for r in ranks] == [3, 3]
    a, b = ranks
    for name, q in a["served"].items():
        assert torch.equal(q, b["served"][name]), name
        assert torch.equal(a["masters"][name], b["masters"][name]), name
        want = fair_cast(a["masters"][name], key=derive_key(21, 3, name), mode="stochastic", backend="torch")
        assert torch.equal(q, want.float()), name
    assert any(not torch.equal(m, m.bfloat16().float()) for m in a["masters"].values())
    # faircast_policy_metrics_every=1, 2 sequences per rank: every log has both ranks' rows, the same on each rank
    assert len(a["policy_logs"]) == 3 and a["policy_logs"] == b["policy_logs"]
    assert all(h["faircast/policy_seqs"] == 4 and 0.25 <= h["faircast/policy_ess_frac"] <= 1 for h in a["policy_logs"])
    if generation == "continuous_batching":  # generate_batch ran on the bf16 served copy; the masters stayed fp32
        for r in ranks:
            assert r["generations"] == [(0, 0), (1, 0), (2, 0)], r["generations"]
            assert r["param_dtypes"] == r["buffer_dtypes"] == ["torch.float32"]
