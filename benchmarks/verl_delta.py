"""Served elements changed per weight version in verl's ``delta_sharded`` source, per Fair Cast mode (CPU, gloo).

Runs verl 0.9.1's real ``ActorRolloutRefWorker`` (tests/verl/harness.py, on the CPU platform shim) for each
strategy, mode and world size: the seed export and ``prime_delta_snapshots``, then per version one Adam step
(``update_actor``) and ``get_per_tensor_param_delta_shard``, counting the (index, value) pairs every rank would
send. The audit (``audit: true``) gives the lag and the cumulative relative bias. Run in the tests-verl venv:

    python benchmarks/verl_delta.py --smoke            # 1 rank, FSDP2, masters off the grid, 3 versions
    python benchmarks/verl_delta.py --json out.json    # FSDP2 and FSDP1 at 1, 2 and 3 ranks, masters on the grid

The full preset builds the tiny Qwen2 in bf16, so verl's fp32 masters start on the bf16 grid (a bf16 checkpoint),
at Adam lr 1e-6 (updates far below half a bf16 step): round-to-nearest changes nothing until the drift reaches half
a step, then settles at the rate sticky has from the first version. ``--smoke`` uses an fp32 checkpoint (masters
off the grid), where every mode is in its steady state from the first version.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEED = 1234
#: the ``actor_rollout_ref.faircast`` mapping of each mode (nearest: Fair Cast off, the audit measures verl's RTN)
MODES = {
    "nearest": "{enable:false,audit:true}",
    "stochastic": f"{{enable:true,seed:{SEED},mode:stochastic,audit:true}}",
    "sticky": f"{{enable:true,seed:{SEED},mode:sticky,audit:true}}",
    "error_feedback": f"{{enable:true,seed:{SEED},mode:error_feedback,audit:true}}",
}
PRESETS = {
    "smoke": dict(worlds=[1], strategies=["fsdp2"], modes=["nearest", "stochastic", "sticky"], versions=3,
                  steady=2, dtype="float32"),
    "full": dict(worlds=[1, 2, 3], strategies=["fsdp2", "fsdp"], modes=list(MODES), versions=6, steady=3,
                 dtype="bfloat16"),
}


def cases(strategies, modes, versions, lr):
    return [dict(name=f"{s}_{m}", strategy=s, delta_versions=versions,
                 overrides=[f"+actor_rollout_ref.faircast={MODES[m]}", f"actor_rollout_ref.actor.optim.lr={lr}"])
            for s in strategies for m in modes]


def summarize(result: dict, steady: int) -> dict:
    """Per-version changed fractions, their mean over the last ``steady`` versions, and the last audit metrics."""
    frac = [c / result["total"] for c in result["changed"]]
    last = result["metrics"][-1] if result["metrics"] else {}
    lags = [m["faircast/lag_steps"] for m in result["metrics"][-steady:] if "faircast/lag_steps" in m]
    return {
        "changed_frac": frac,
        "steady_changed_frac": sum(frac[-steady:]) / steady,
        "peak_changed_frac": max(frac),  # the largest delta of the run (round-to-nearest's come in bursts)
        "total_elements": result["total"],
        "lag_steps": sum(lags) / len(lags) if lags else None,  # the audit's lag, averaged like the changed fraction
        "bias_rel_cumulative": last.get("faircast/bias_rel_cumulative"),
        "audit_changed_frac": last.get("faircast/served_changed_frac"),
        "lr": result["lr"],
    }


def table(rows: list) -> str:
    cols = ["strategy", "ranks", "mode", "changed per version (steady)", "first and last versions", "peak",
            "vs nearest", "lag, steps", "bias_rel_cum"]
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    base = {(r["strategy"], r["world"]): r["steady_changed_frac"] for r in rows if r["mode"] == "nearest"}
    for r in rows:
        ref = base.get((r["strategy"], r["world"]))
        ratio = f"{r['steady_changed_frac'] / ref:.2f}x" if ref else "-"
        fr = r["changed_frac"]
        per = " ".join(f"{f:.2%}" for f in (fr if len(fr) <= 6 else fr[:3] + fr[-3:]))
        fmt = (lambda v, spec: "-" if v is None else format(v, spec))
        lines.append(f"| {r['strategy']} | {r['world']} | {r['mode']} | {r['steady_changed_frac']:.2%} | {per} | "
                     f"{r['peak_changed_frac']:.2%} | {ratio} | {fmt(r['lag_steps'], '.2f')} | "
                     f"{fmt(r['bias_rel_cumulative'], '.3f')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="1 rank, FSDP2, 3 modes, 3 versions (under a minute on free cores)")
    parser.add_argument("--worlds", type=int, nargs="+")
    parser.add_argument("--strategies", nargs="+", choices=["fsdp2", "fsdp"])
    parser.add_argument("--modes", nargs="+", choices=list(MODES))
    parser.add_argument("--versions", type=int, help="weight versions per run")
    parser.add_argument("--steady", type=int, help="average the changed fraction over the last N versions")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="checkpoint dtype (bfloat16: masters on the grid)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--model-dir", help="a tiny model already built (tests/verl/tiny_model.py) in --dtype")
    parser.add_argument("--out-dir", help="where the ranks write their logs and results (default: a temp dir)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    opts = dict(PRESETS["smoke" if args.smoke else "full"])
    for key in ("worlds", "strategies", "modes", "versions", "steady", "dtype"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    opts["steady"] = min(opts["steady"], opts["versions"])

    from tests.verl import tiny_model
    from tests.verl.conftest import run_ranks

    out = pathlib.Path(args.out_dir or tempfile.mkdtemp(prefix="verl_delta_"))
    model_dir = args.model_dir or tiny_model.build(str(out / f"tiny_qwen2_{opts['dtype']}"), dtype=opts["dtype"])
    rows = []
    for world in opts["worlds"]:
        start = time.time()
        runs = run_ranks(out / f"world{world}", model_dir=model_dir, world=world,
                         cases=cases(opts["strategies"], opts["modes"], opts["versions"], args.lr))
        print(f"world {world}: {time.time() - start:.0f} s", flush=True)
        for name, ranks in runs.items():
            strategy, mode = name.split("_", 1)
            rows.append(dict(strategy=strategy, world=world, mode=mode, **summarize(ranks[0], opts["steady"])))
    report = {"config": {**opts, "lr": args.lr, "model_dir": model_dir}, "rows": rows}
    print(table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
