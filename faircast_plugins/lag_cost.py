"""``faircast/lag_cost``: what the served copy's lag is costing a run, estimated live from its own logs.

If the served copy behaves like the fp32 policy delayed by its measured lag (the A/B's ``fp32-delayed@k`` arm tests
exactly that; docs/ab.md has the result), the reward it collects trails the master's by about

    lag_cost = lag_steps x reward_slope

where ``lag_steps`` is the audit's ``faircast/lag_steps`` and ``reward_slope`` the least-squares slope of the
logged mean reward per optimizer step over the last ``window`` logged steps. It reads in reward units: a run with
the flag off (audit on) sees what the standard export costs it now; with Fair Cast on the lag, and the cost, are ~0.
The slope of a noisy per-step reward is itself noisy: read the metric averaged over tens of steps.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Optional, Tuple

#: logged steps the reward slope is fitted over (also logged, as ``faircast/lag_cost_window``)
WINDOW = 50


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
