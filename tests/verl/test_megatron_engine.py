"""verl 0.9.1's MegatronEngine with Fair Cast on megatron-core 0.16.1 (CPU, gloo): activation as the worker does it,
verl's own ``optimizer_step``, the served params == fair_cast(master), state written and read with verl's checkpoints.

Here, in tests-verl's virtualenv (no megatron-bridge), the engine gets the model and optimizer that
tests/megatron/worker.py builds; everything after that is verl's code and Fair Cast's. The whole engine, from
``initialize()`` through megatron-bridge 0.5.1 to verl's own export, runs in tests-megatron
(tests/megatron/test_verl_engine.py).
"""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def test_verl_megatron_engine_serves_fair_cast(tmp_path_factory):
    from tests.megatron.test_megatron import launch

    (r,) = launch(1, ["verl"], tmp_path_factory)["verl"]
    assert "error" not in r, r.get("error")
    assert r["version"] == 2 and r["check"]["mismatches"] == [] and r["check"]["differs_from_rtn"] == r["check"]["params"]
    assert r["state_files"] == ["faircast_state_rank00000.pt"] and r["verl_checkpoint_calls"] == 2
    assert r["version_after_load"] == 2
