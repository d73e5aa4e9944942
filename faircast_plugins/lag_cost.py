"""``faircast/lag_cost``: what the served copy's lag is costing a run, estimated live from its own logs.

If the served copy behaves like the fp32 policy delayed by its measured lag (the A/B's ``fp32-delayed@k`` arm tests
exactly that; docs/ab.md has the result), the reward it collects trails the master's by about

    lag_cost = lag_steps x reward_slope

where ``lag_steps`` is the audit's ``faircast/lag_steps`` and ``reward_slope`` the least-squares slope of the
logged mean reward per optimizer step over the last ``window`` logged steps. It reads in reward units: a run with
the flag off (audit on) sees what the standard export costs it now; with Fair Cast on the lag, and the cost, are ~0.
The slope of a noisy per-step reward is itself noisy: read the metric averaged over tens of steps. Measured
(docs/ab.md): accurate where updates are far below half a bf16 step (0.39 predicted vs 0.41 points at lr 1e-6),
2x too high at lr 2e-6, where round-to-nearest's error decorrelates from the update: an upper estimate.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Deque, Dict, Optional, Tuple

#: logged steps the reward slope is fitted over (also logged, as ``faircast/lag_cost_window``)
WINDOW = 50
#: the audit metric the lag is read from, and the one every Fair Cast run (audit on or off) logs
LAG_KEY = "faircast/lag_steps"
VERSION_KEY = "faircast/version"


def slope(points) -> Optional[float]:
    """Least-squares slope of ``(x, y)`` points, None for fewer than two distinct x."""
    pts = list(points)
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    if den == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in pts) / den


class LagCost:
    """Feed it each logged step's mean reward and lag; it returns the ``faircast/lag_cost`` metrics once the reward
    window is half full."""

    def __init__(self, window: int = WINDOW):
        if window < 4:
            raise ValueError("the lag-cost window needs at least 4 steps")
        self.window = window
        self.rewards: Deque[Tuple[float, float]] = deque(maxlen=window)

    def update(self, step: float, reward: Optional[float], lag_steps: Optional[float]) -> Dict[str, float]:
        if reward is not None:
            self.rewards.append((float(step), float(reward)))
        if lag_steps is None or len(self.rewards) < self.window // 2:
            return {}
        s = slope(self.rewards)
        if s is None:
            return {}
        return {"faircast/reward_slope": s, "faircast/lag_cost": float(lag_steps) * s,
                "faircast/lag_cost_window": float(self.window)}

    def add_to(self, metrics: Dict[str, Any], step: float, reward_key: str, prefix: str = "") -> Dict[str, Any]:
        """Read one logged step's mean reward (``metrics[reward_key]``) and lag (``metrics[prefix + LAG_KEY]``) from
        an adapter's metrics dict and add the lag-cost metrics to it (in place), under the lag's ``prefix``."""
        out = self.update(step, _number(metrics.get(reward_key)), _number(metrics.get(prefix + LAG_KEY)))
        metrics.update({prefix + key: value for key, value in out.items()})
        return metrics


def _number(value: Any) -> Optional[float]:
    """A logged scalar (float, numpy or 0-d tensor) as a float; None for a missing, non-numeric or NaN value."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def tracker_of(owner: Any, window: int = WINDOW) -> LagCost:
    """The run's tracker, kept on the object that logs the run's metrics (a trainer, a logger): one per run."""
    tracker = owner.__dict__.get("_faircast_lag_cost")
    if tracker is None:
        tracker = owner.__dict__["_faircast_lag_cost"] = LagCost(window)
    return tracker
