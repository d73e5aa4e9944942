"""faircast/lag_cost = lag x the reward's recent slope."""
import pytest

from faircast_plugins.lag_cost import LagCost, slope


def test_slope_is_least_squares():
    assert slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert slope([(0, 1.0)]) is None and slope([(3, 1.0), (3, 2.0)]) is None


def test_lag_cost_needs_half_a_window_then_multiplies_lag_by_slope():
    lc = LagCost(window=10)
    out = {}
    for step in range(1, 11):
        out = lc.update(step, 0.5 + 0.01 * step, 20.0)
        if step < 5:
            assert out == {}
    assert out["faircast/reward_slope"] == pytest.approx(0.01)
    assert out["faircast/lag_cost"] == pytest.approx(0.2)
    assert out["faircast/lag_cost_window"] == 10.0
    assert lc.update(11, 0.61, None) == {}  # no lag logged this step: nothing to report
    assert lc.update(12, None, 0.0)["faircast/lag_cost"] == 0.0  # Fair Cast on: no lag, no cost


def test_window_is_bounded_and_checked():
    lc = LagCost(window=4)
    for step in range(100):
        lc.update(step, float(step > 95), 1.0)
    assert len(lc.rewards) == 4
    with pytest.raises(ValueError):
        LagCost(window=2)


def test_add_to_reads_a_logged_metrics_dict_under_the_lags_prefix():
    from types import SimpleNamespace

    from faircast_plugins.lag_cost import tracker_of

    owner = SimpleNamespace()
    tracker = tracker_of(owner, window=4)
    assert tracker_of(owner) is tracker  # one per run
    for step in range(1, 4):
        logged = tracker.add_to({"r": 0.1 * step, "actor/faircast/lag_steps": 10.0}, step, "r", prefix="actor/")
    assert logged["actor/faircast/lag_cost"] == pytest.approx(1.0)
    assert "faircast/lag_cost" not in logged
    # a NaN or missing reward is skipped; no lag (audit off, or a prefix that does not match): no cost
    assert "actor/faircast/lag_cost" in tracker.add_to({"r": float("nan"), "actor/faircast/lag_steps": 1.0}, 4, "r", "actor/")
    assert "faircast/lag_cost" not in tracker.add_to({"r": 0.5, "actor/faircast/lag_steps": 1.0}, 5, "r")
