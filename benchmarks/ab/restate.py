"""Recomputes, from the committed results.json files alone, every number docs/evidence.md (the README's "Does it
help?") and docs/ab.md
print about the two pre-registered CPU runs, with the statistics that fit a few seeds (faircast_plugins/ab/stats.py:
paired t primary, Holm over the comparisons listed here, MDE; sign test and bootstrap secondary with their limits).

    python benchmarks/ab/restate.py            # prints the table docs/ab.md quotes
"""
from __future__ import annotations

import json
import os
import sys

from faircast_plugins.ab import stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN1 = os.path.join(ROOT, "docs/ab/cpu-results.json")
RUN2 = os.path.join(ROOT, "docs/ab/learning/results.json")

#: (label, results file, metric, arm A, arm B): the comparisons the README and docs/ab.md state; the Holm family is
#: these rows of run 2 (run 1's rows are adjusted among themselves).
ROWS = [
    ("learning: master, faircast - standard", RUN2, "master_expected", "faircast", "standard"),
    ("learning: SR(master), faircast - standard", RUN2, "sr_expected", "faircast", "standard"),
    ("learning: master, export-only - standard", RUN2, "master_expected", "export-only", "standard"),
    ("learning: master, faircast - export-only", RUN2, "master_expected", "faircast", "export-only"),
    ("readout: served, faircast - standard", RUN2, "served_expected", "faircast", "standard"),
    ("readout effect (served - SR), faircast - standard", RUN2, "served_minus_sr", "faircast", "standard"),
    ("A/A: served, faircast-aa - faircast", RUN2, "served_expected", "faircast-aa", "faircast"),
    ("A/A: master, faircast-aa - faircast", RUN2, "master_expected", "faircast-aa", "faircast"),
    ("lr 1e-5: served, faircast - standard", RUN2, "served_expected", "faircast@lr=1e-5", "standard@lr=1e-5"),
    ("lr 1e-5: master, faircast - standard", RUN2, "master_expected", "faircast@lr=1e-5", "standard@lr=1e-5"),
    ("lr 1e-4: served, faircast - standard", RUN2, "served_expected", "faircast@lr=1e-4", "standard@lr=1e-4"),
    ("lr 1e-4: master, faircast - standard", RUN2, "master_expected", "faircast@lr=1e-4", "standard@lr=1e-4"),
    ("served, standard@1e-4 - faircast@1e-6", RUN2, "served_expected", "standard@lr=1e-4", "faircast"),
    ("run 1 learning: master, faircast - standard", RUN1, "master_expected", "faircast", "standard"),
    ("run 1 learning: master, export-only - standard", RUN1, "master_expected", "export-only", "standard"),
    ("run 1 readout: served, faircast - standard", RUN1, "served_expected", "faircast", "standard"),
]


def values(path: str, metric: str) -> dict:
    with open(path) as f:
        runs = json.load(f)["runs"]
    return stats.by_arm_seed([(r["arm"], r["seed"], r[metric]) for r in runs if metric in r])


def main() -> int:
    results, labels = [], []
    for label, path, metric, a, b in ROWS:
        results.append(stats.compare(a, b, values(path, metric)))
        labels.append(label)
    for run in (RUN2, RUN1):
        stats.adjust_family([r for r, row in zip(results, ROWS) if row[1] == run])
    print(stats.TABLE_NOTE + "\n")
    table = stats.table(results).splitlines()
    print("\n".join(table[:2]))
    for label, line in zip(labels, table[2:]):
        print(line.replace("| ", f"| {label}: ", 1))
    gains = {}  # what the standard arm's master learned: its final figure minus the warm start's (both held out)
    for run in (RUN2, RUN1):
        with open(run) as f:
            res = json.load(f)
        final = [r["master_expected"] for r in res["runs"] if r["arm"] == "standard"]
        gains[run] = sum(final) / len(final) - res["warm_start"]["heldout_bf16"]["expected"]
    # the negative learning effect as a share of what the standard arm's master learned over its run
    for r, row in zip(results, ROWS):
        if row[2] == "master_expected" and row[3] == "faircast" and row[4] == "standard":
            print(f"\n{row[0]}: {100 * r.mean_diff:+.4f} points = {100 * r.mean_diff / gains[row[1]]:+.2f}% of the "
                  f"standard master's gain from the warm start ({100 * gains[row[1]]:.2f} points); {r.losses}/{r.n} seeds "
                  f"lower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
