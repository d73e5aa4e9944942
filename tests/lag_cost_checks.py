"""Shared checks of ``faircast/lag_cost`` as an adapter logs it (issue 12.8), for the verl and OpenRLHF tests."""
from __future__ import annotations

import pytest

STEPS = 30  # logged steps, reward rising 0.01 a step; the tracker reports once 25 (half its 50-step window) were seen


def assert_lag_cost_logged(logged, lag_steps: float, prefix: str = "") -> None:
    """``logged``: ``(step, metrics)`` per logged step, with ``lag_steps`` logged and the reward rising 0.01 a step."""
    assert len(logged) == STEPS
    assert not any(prefix + "faircast/lag_cost" in data for _, data in logged[:24])  # half the window first
    step, last = logged[-1]
    assert step == STEPS and last[prefix + "faircast/lag_cost_window"] == 50.0
    assert last[prefix + "faircast/reward_slope"] == pytest.approx(0.01)
    assert last[prefix + "faircast/lag_cost"] == pytest.approx(lag_steps * 0.01)


def assert_no_lag_cost(logged) -> None:
    assert len(logged) == STEPS and not any("faircast/lag_cost" in key for _, data in logged for key in data)
