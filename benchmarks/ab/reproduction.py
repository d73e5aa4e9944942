"""Seed by seed, one A/B run set against another: the committed CPU A/B against a re-run (issue #19 item 1).

    python benchmarks/ab/reproduction.py docs/ab/cpu-results.json docs/ab/repro-seed0/results.json [--seed 0]

Prints, for every arm both have, the final served and master expected success and the lag of each, and the
paired effects against ``standard`` (served and master) of each, so a reader sees what reproduced and what did not.
"""
from __future__ import annotations

import argparse
import json


def runs(path: str, seed: int) -> dict:
    with open(path) as f:
        res = json.load(f)
    return res, {r["arm"]: r for r in res["runs"] if r["seed"] == seed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference")
    ap.add_argument("rerun")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    (ref_res, ref), (new_res, new) = runs(args.reference, args.seed), runs(args.rerun, args.seed)
    for label, res in (("reference", ref_res), ("re-run", new_res)):
        ws = res.get("warm_start") or {}
        print(f"{label}: compute {res.get('compute', res['protocol'].get('compute', 'not recorded'))}, code "
              f"{(res.get('code') or {}).get('commit', 'not recorded')}, machine "
              f"{(res['meta'].get('hardware') or {}).get('cpu', 'not recorded')}, warm start held-out expected "
              f"{100 * ws.get('heldout_bf16', {}).get('expected', float('nan')):.2f}%")
    print()
    print("| arm | served: reference / re-run (%) | master: reference / re-run (%) | lag (steps) | served - standard "
          "(points) | master - standard (points) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for arm in [a for a in ref if a in new]:
        r, n = ref[arm], new[arm]
        ds = [100 * (x[arm]["served_expected"] - x["standard"]["served_expected"]) for x in (ref, new)]
        dm = [100 * (x[arm]["master_expected"] - x["standard"]["master_expected"]) for x in (ref, new)]
        print(f"| {arm} | {100 * r['served_expected']:.2f} / {100 * n['served_expected']:.2f} | "
              f"{100 * r['master_expected']:.2f} / {100 * n['master_expected']:.2f} | {r['lag_steps']:.1f} / "
              f"{n['lag_steps']:.1f} | {ds[0]:+.3f} / {ds[1]:+.3f} | {dm[0]:+.3f} / {dm[1]:+.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
