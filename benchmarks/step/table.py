"""docs/performance.md's step table from the drivers' ``--json`` results: one column per run, one row per arm.

    python benchmarks/step/table.py "TRL, one process=trl.json" "verl FSDP2 worker, 2 ranks=verl.json" ...

Each cell: median of the paired step-time ratios to flag off (ratio of the best times) / Fair Cast's counted state in
B/param / RSS growth in B/param, then the target verdict for stochastic and sticky. Under the table, one line per
run: its date, machine, torch and commit, as the run recorded them.
"""
from __future__ import annotations

import argparse
import json
import sys


def cell(row: dict) -> str:
    text = (f"{row['ratio_median']:.2f}x ({row['ratio_min_times']:.2f}x) / {row['state_b_per_param']:+.2f} / "
            f"{row['rss_build_delta_b_per_param']:+.1f}")
    target = row.get("target", "")
    if target.startswith("MISS"):
        text += f" **miss: {target[len('MISS: '):]}**"
    elif target == "met":
        text += " **met**"
    return text


def table(runs: list) -> str:
    heads = []
    for label, result in runs:
        base = next(r for r in result["rows"] if r["arm"] == "flag off")
        heads.append(f"{label} ({result['reps']} reps, flag off {base['ms_median'] / 1e3:.2f} s)")
    lines = ["| arm: step time ratio to flag off, median of paired reps (best times) / FC state B/param / RSS "
             "B/param | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(runs)]
    arms = []  # in the drivers' order (harness.ALL_ARMS), as the runs list them
    for _, result in runs:
        arms += [r["arm"] for r in result["rows"] if r["arm"] not in arms]
    for arm in arms:
        cells = []
        for _, result in runs:
            row = next((r for r in result["rows"] if r["arm"] == arm), None)
            cells.append("-" if row is None else cell(row))
        if any(c != "-" for c in cells):
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines.append("")
    for label, result in runs:
        lines.append(f"- {label}: {result['date']}, {result['machine']}, torch {result['torch']}, commit "
                     f"{result['commit']}, {result['params'] / 1e6:.1f}M params")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH of a driver's --json output, one per column")
    args = parser.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.rpartition("=")
        if not sep:
            raise SystemExit(f"expected LABEL=PATH, got {spec!r}")
        with open(path) as f:
            runs.append((label, json.load(f)))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
