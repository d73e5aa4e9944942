"""The coarse-grid calibration's readouts (EXPLORATION, docs/ab/coarse-grid-calibration/), from per-run records.

    python benchmarks/ab/coarse_calibration.py RUN.json [RUN.json ...]

One row per run and step window (the last 20% of steps, steps 11-50 and 51-100): the audit's ``faircast/lag_steps`` and ``faircast/served_changed_frac``,
TRL's importance-sampling ratio mean and ``sampling_logp_difference`` mean (sampler vs trainer), and the share of
steps with a masked sequence (ratio minimum 0); then the fp32 master's held-out expected success at every eval point.
Any run record of the A/B harness works, so the committed fresh/frozen/delayed runs of the same seed and recipe give
the yardstick (what the lag metric reads for a known delay).
"""
from __future__ import annotations

import json
import math
import sys


def _mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def window_stats(run: dict, first: int, last: int) -> dict:
    """The readouts over steps ``first`` .. ``last`` (inclusive)."""
    tail = [s for s in run["steps"] if first <= s["step"] <= last]
    ratio_min = [s.get("sampling/importance_sampling_ratio/min") for s in tail]
    return {
        "lag": _mean([s.get("faircast/lag_steps") for s in tail]),
        "changed": _mean([s.get("faircast/served_changed_frac") for s in tail]),
        "is_mean": _mean([s.get("sampling/importance_sampling_ratio/mean") for s in tail]),
        "logp_diff": _mean([s.get("sampling/sampling_logp_difference/mean") for s in tail]),
        "masked_steps": sum(1 for r in ratio_min if r == 0.0) / max(1, len([r for r in ratio_min if r is not None])),
        "steps": len(tail),
    }


#: step windows: the last 20% of a 300-step run (the protocol's readout), and two early ones (the audit's 8-step
#: window full; before and after a delayed@50 sampler starts to move)
WINDOWS = ((241, 300, "Steps 241-300 (the last 20%)"), (11, 50, "Steps 11-50"), (51, 100, "Steps 51-100"))


def main(paths) -> int:
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    for first, last, label in WINDOWS:
        print(f"**{label}:**")
        print()
        print("| arm | seed | lag, steps | served changed / step | IS ratio mean | logp diff mean | steps with a masked "
              "sequence |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in runs:
            t = window_stats(r, first, last)
            print(f"| {r['arm']} | {r['seed']} | {t['lag']:.1f} | {100 * t['changed']:.2f}% | {t['is_mean']:.3f} | "
                  f"{t['logp_diff']:.3f} | {100 * t['masked_steps']:.0f}% |")
        print()
    print("**The fp32 master's held-out expected success (%) at each eval step:**")
    points = sorted({e["step"] for r in runs for e in r["evals"]})
    print()
    print("| arm | " + " | ".join(str(p) for p in points) + " |")
    print("| --- | " + " | ".join("---" for _ in points) + " |")
    for r in runs:
        by = {e["step"]: e["master_expected"] for e in r["evals"]}
        print(f"| {r['arm']} | " + " | ".join(f"{100 * by[p]:.2f}" if p in by else "" for p in points) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
