"""One line per (experiment, arm): served, master and SR(master) expected success, the lag, the readout effect.

    python benchmarks/ab/summarize.py out/explore/*/results.json

The table docs/ab.md shows for the exploration runs (issue #19 item 3): what each arm's master learned (master,
SR(master)) apart from how its served copy read it out (served - SR(master)). Means over the seeds each ran.
"""
from __future__ import annotations

import json
import math
import sys


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def rows(path: str):
    with open(path) as f:
        res = json.load(f)
    proto = res["protocol"]
    setting = (f"{proto['task']}, d={proto['warmstart']['hidden_size']}, ws seed {proto['warmstart']['seed']}, "
               f"{proto.get('compute')}, {proto['steps']} steps, {proto.get('lr_schedule', 'constant')}, "
               f"iters {proto.get('num_iterations', 1)}, eps {proto.get('epsilon', 0.2)}")
    for arm in proto["arms"]:
        ss = [s for s in res["runs"] if s["arm"] == arm]
        if not ss:
            continue
        g = lambda k: _mean([s.get(k) for s in ss])  # noqa: E731
        yield (proto["name"], setting, arm, len(ss), 100 * g("served_expected"), 100 * g("master_expected"),
               100 * g("sr_expected"), g("lag_steps"), 100 * g("served_minus_sr"), g("clip_ratio"))


def main(paths) -> int:
    print("| experiment | setting | arm | seeds | served (%) | master (%) | SR(master) (%) | lag (steps) | "
          "served - SR (points) | clip ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        for r in rows(path):
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.1f} | "
                  f"{r[8]:+.3f} | {r[9]:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
