"""Issue 12.8: the driver's ``Tracking.log`` adds ``actor/faircast/lag_cost`` (lag x slope of ``critic/score/mean``)."""
from __future__ import annotations

import pytest

from tests.lag_cost_checks import STEPS, assert_lag_cost_logged, assert_no_lag_cost


class Recorder:
    def __init__(self):
        self.logged = []

    def log(self, data, step):
        self.logged.append((step, dict(data)))


def _driver_logs(actor_metrics, steps=STEPS):
    """Log ``steps`` driver metric dicts (score rising 0.01 a step) through verl's real, patched ``Tracking``."""
    import verl.workers.engine_workers  # noqa: F401  (verl's plugin entry point applies the Fair Cast patches)
    from verl.utils.tracking import Tracking

    from faircast_plugins.verl.patches import PATCHES

    assert PATCHES.active

    tracking = Tracking("p", "e", default_backend=[])
    recorder = tracking.logger["stub"] = Recorder()
    for step in range(1, steps + 1):
        tracking.log(data={"critic/score/mean": 0.2 + 0.01 * step, **actor_metrics(step)}, step=step)
    return recorder.logged


def test_tracking_log_adds_lag_cost_with_the_audit():
    logged = _driver_logs(lambda step: {"actor/faircast/version": float(step), "actor/faircast/lag_steps": 20.0})
    assert_lag_cost_logged(logged, 20.0, prefix="actor/")


@pytest.mark.parametrize("actor_metrics", [
    lambda step: {},  # Fair Cast off: the hook leaves verl's metrics alone
    lambda step: {"actor/faircast/version": float(step)},  # Fair Cast on, audit off: no lag, no cost
], ids=["off", "no_audit"])
def test_no_lag_no_lag_cost(actor_metrics):
    logged = _driver_logs(actor_metrics)
    assert_no_lag_cost(logged)
