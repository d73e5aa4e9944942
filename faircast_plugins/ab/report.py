"""The A/B report: per-run summaries, paired statistics, the lag-cost prediction, results.json, report.md, curves.png."""
from __future__ import annotations

import glob
import json
import math
import os
from typing import List, Optional, Sequence

from ..lag_cost import WINDOW, LagCost, slope
from . import stats
from .arms import aa_twin, parse_arm
from .protocol import DERIVED, METRICS, READOUTS

#: Per-step logs averaged over a run, for the noise question: (logged key, summary name).
NOISE = (("grad_norm", "grad_norm"), ("adam_v_mean", "adam_v_mean"),
         ("sampling/importance_sampling_ratio/mean", "is_ratio_mean"),
         ("sampling/importance_sampling_ratio/min", "is_ratio_min"),
         ("sampling/importance_sampling_ratio/max", "is_ratio_max"),
         ("sampling/sampling_logp_difference/mean", "logp_diff_mean"), ("clip_ratio/region_mean", "clip_ratio"))
MECHANISM = ("faircast/lag_steps", "faircast/served_changed_frac", "faircast/bias_rel_cumulative")


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _tail(rows: list, frac: float = 0.2) -> list:
    return rows[-max(1, math.ceil(len(rows) * frac - 1e-9)):] if rows else []


def summarize_run(run: dict) -> dict:
    """One run's final figures: each metric over the last 20% of eval points, the mechanism over the last 20% of steps."""
    evals, steps = run["evals"], run["steps"]
    out = {"arm": run["arm"], "seed": run["seed"], "lr": run["lr"], "wall_s": run.get("wall_s")}
    for m in METRICS:
        pts = [(e["step"], e[m]) for e in evals if m in e]
        out[m] = stats.final_value(pts) if pts else float("nan")
    tail = _tail(steps)
    out["lag_steps"] = _mean([s.get("faircast/lag_steps") for s in tail])
    out["lag_steps_max"] = max((s.get("faircast/lag_steps", float("-inf")) for s in steps), default=float("nan"))
    out["served_changed_frac"] = _mean([s.get("faircast/served_changed_frac") for s in steps])
    out["bias_rel"] = steps[-1].get("faircast/bias_rel_cumulative", float("nan")) if steps else float("nan")
    out["reward_first"] = _mean([s.get("reward") for s in steps[:max(1, len(steps) // 5)]])
    out["reward_last"] = _mean([s.get("reward") for s in tail])
    live = live_lag_cost([(s["step"], s.get("reward"), s.get("faircast/lag_steps")) for s in steps])
    out["lag_cost_live"] = _mean([v for _, v in _tail(live)]) if live else float("nan")
    # the readout split: the master's best readout (fp32 forward, or RTN/SR/sticky through the engine) against the
    # served copy, within the run
    readouts = {"master": out["master_expected"], **{r: out[f"{r}_expected"] for r in READOUTS}}
    finite = {k: v for k, v in readouts.items() if not math.isnan(v)}
    out["readout_best"] = max(finite.values()) if finite else float("nan")
    out["readout_best_kind"] = max(finite, key=finite.get) if finite else None
    out["readout_effect"] = out["served_expected"] - out["readout_best"]
    out["served_minus_sr"] = out["served_expected"] - out["sr_expected"]
    for kind in READOUTS:  # the readout that is, by construction, the arm's own export must be it bit for bit
        flags = [e[f"{kind}_is_served"] for e in evals if f"{kind}_is_served" in e]
        out[f"{kind}_is_served"] = all(flags) if flags else None
    for key, name in NOISE:
        out[name] = _mean([s.get(key) for s in steps])
    half = evals[len(evals) // 2:]  # learning slope of the served copy over the second half of the run
    fitted = slope([(e["step"], e["served_expected"]) for e in half])
    out["slope_per_step"] = float("nan") if fitted is None else fitted
    return out


def live_lag_cost(rows) -> list:
    """``(step, faircast/lag_cost)`` as an adapter would have logged it, from ``(step, reward, lag)`` rows."""
    tracker, out = LagCost(), []
    for step, reward, lag in sorted(rows, key=lambda r: r[0]):
        m = tracker.update(step, reward, lag)
        if m:
            out.append((step, m["faircast/lag_cost"]))
    return out


def load_runs(out: str) -> List[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "runs", "*", "seed*.json"))):
        if path.endswith(".spec.json"):
            continue
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def lag_cost(summaries: List[dict], reference: str = "fp32-served", baseline: str = "standard") -> Optional[dict]:
    """Does the standard export cost what a delay of its measured lag would? predicted = lag x the reference arm's
    learning slope (per seed, then averaged); measured = reference - baseline (paired)."""
    ref = {s["seed"]: s for s in summaries if s["arm"] == reference}
    base = {s["seed"]: s for s in summaries if s["arm"] == baseline}
    seeds = sorted(set(ref) & set(base))
    if not seeds:
        return None
    predicted = [base[s]["lag_steps"] * ref[s]["slope_per_step"] for s in seeds]
    measured = [ref[s]["served_expected"] - base[s]["served_expected"] for s in seeds]
    reward_gap = [ref[s]["reward_last"] - base[s]["reward_last"] for s in seeds]
    return {"reference": reference, "baseline": baseline, "seeds": seeds, "predicted": _mean(predicted),
            "measured": _mean(measured), "per_seed": list(zip(seeds, predicted, measured)),
            "lag_steps": _mean([base[s]["lag_steps"] for s in seeds]),
            "slope_per_step": _mean([ref[s]["slope_per_step"] for s in seeds]),
            "live_lag_cost": _mean([base[s]["lag_cost_live"] for s in seeds]), "measured_reward_gap": _mean(reward_gap)}


def compare_all(summaries: List[dict], proto, pairs) -> tuple:
    """Every pair on every metric (paired t primary, TOST where the protocol declares a margin), the p-values of the
    pre-declared family Holm-adjusted together. Returns (comparisons by metric, the family as used)."""
    results = {}
    for metric in (*METRICS, *DERIVED):
        values = stats.by_arm_seed([(s["arm"], s["seed"], s[metric]) for s in summaries])
        results[metric] = [stats.compare(a, b, values, margin=proto.equivalence_margin) for a, b in pairs]
    declared = [tuple(f) for f in proto.family]
    members = declared or [(proto.metric, a, b) for a, b in pairs]
    in_family = [r for metric, rs in results.items() for r in rs if (metric, r.a, r.b) in members]
    stats.adjust_family(in_family)
    family = {"declared": bool(declared), "members": [list(m) for m in members],
              "note": "pre-declared in the protocol" if declared else
              f"not declared: every pair of the primary metric {proto.metric}"}
    return {m: [r.as_dict() for r in rs] for m, rs in results.items()}, family


def _oriented(pairs: List[tuple], proto) -> List[tuple]:
    """Each pair as the protocol's family declares it (``[metric, A, B]``: A - B, e.g. fresh - frozen with the
    baseline first), where the default pairs have it the other way round (baseline second)."""
    declared = {tuple(f[1:]) for f in proto.family}
    return [p[::-1] if p not in declared and p[::-1] in declared else p for p in pairs]


def _aa_pair(results: dict, proto) -> Optional[dict]:
    """The A/A control's comparison on the primary metric: ``faircast-aa`` vs ``faircast``, or any ``<arm>-aa``
    (the same arm with other random draws; ``<arm>-aa@S`` for ``<arm>@S``) vs its ``<arm>``."""
    for c in results["comparisons"][proto.metric]:
        if aa_twin(c["a"]) == c["b"]:
            return c
    return None


def build(out: str, proto, provenance: dict, ws_info: Optional[dict], failed: Sequence[str], meta: dict) -> dict:
    runs = load_runs(out)
    summaries = [summarize_run(r) for r in runs]
    arms = [a for a in proto.arms if any(s["arm"] == a for s in summaries)]
    pairs = _oriented(stats.default_pairs(arms, proto.baseline, extra=[tuple(p) for p in proto.pairs]), proto)
    comparisons, family = compare_all(summaries, proto, pairs)
    from .runner import load_sessions

    sessions = load_sessions(out)
    results = {
        "protocol": proto.as_dict(), "compute": proto.compute, "code": meta.get("code"),
        "run_code": [json.loads(c) for c in sorted({json.dumps(r.get("code"), sort_keys=True) for r in runs})],
        "protocol_provenance": provenance, "warm_start": ws_info, "meta": meta,
        "sessions": sessions, "retries": [r for sess in sessions for r in sess.get("retries", [])],
        "family": family,
        "failed_runs": list(failed), "missing_runs": [f"{a} seed {s}" for a in proto.arms for s in proto.seeds
                                                      if not any(r["arm"] == a and r["seed"] == s for r in summaries)],
        "runs": summaries, "comparisons": comparisons, "lag_cost": lag_cost(summaries),
        "curves": {r["arm"] + f"/seed{r['seed']}": {"evals": r["evals"], "lag": [
            (s["step"], s.get("faircast/lag_steps")) for s in r["steps"]]} for r in runs},
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(results, proto))
    plot(results, proto, os.path.join(out, "curves.png"))
    return results


def _ms(xs, scale=100.0, digits=2) -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return ""
    sd = stats._sd(xs) if len(xs) > 1 else float("nan")
    return f"{scale * _mean(xs):.{digits}f}" + ("" if math.isnan(sd) else f" ± {scale * sd:.{digits}f}")


def _arm_table(results: dict, proto) -> str:
    rows = ["| arm | lr | seeds | served expected (%) | served greedy (%) | served sampled (%) | master expected (%) | "
            "lag, steps (last 20%) | served changed / step | bias (cumulative) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in proto.arms:
        ss = [s for s in results["runs"] if s["arm"] == arm]
        if not ss:
            rows.append(f"| {arm} | | 0 | (no run finished) | | | | | | |")
            continue
        ms = lambda key: _ms([s[key] for s in ss])  # noqa: E731

        rows.append(f"| {arm} | {ss[0]['lr']:g} | {len(ss)} | {ms('served_expected')} | {ms('served_greedy')} | "
                    f"{ms('served_sampled')} | {ms('master_expected')} | {_mean([s['lag_steps'] for s in ss]):.1f} | "
                    f"{100 * _mean([s['served_changed_frac'] for s in ss]):.2f}% | "
                    f"{_mean([s['bias_rel'] for s in ss]):.3f} |")
    return "\n".join(rows)


def _pairs_table(results: dict, metric: str) -> str:
    return stats.table([stats.PairResult.from_dict(c) for c in results["comparisons"][metric]])


def _finished_arms(results: dict, proto):
    """``(arm, its run summaries)`` for each arm of the protocol that has finished runs, in protocol order."""
    for arm in proto.arms:
        ss = [s for s in results["runs"] if s["arm"] == arm]
        if ss:
            yield arm, ss


def _readout_table(results: dict, proto) -> str:
    rows = ["| arm | served | master (fp32 forward) | RTN(master) | SR(master) | sticky(master) | best readout | "
            "readout effect: served - best (points) | served - SR (points) | checks |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, ss in _finished_arms(results, proto):
        kinds = sorted({s["readout_best_kind"] for s in ss if s.get("readout_best_kind")})
        checks = ", ".join(f"{k} = served" for k in READOUTS if ss and all(s.get(f"{k}_is_served") for s in ss))
        rows.append(f"| {arm} | {_ms([s['served_expected'] for s in ss])} | "
                    f"{_ms([s['master_expected'] for s in ss])} | "
                    + " | ".join(_ms([s[f"{k}_expected"] for s in ss]) for k in READOUTS)
                    + f" | {'/'.join(kinds)} | {_ms([s['readout_effect'] for s in ss], digits=3)} | "
                    f"{_ms([s['served_minus_sr'] for s in ss], digits=3)} | {checks} |")
    return "\n".join(rows)


def _noise_table(results: dict, proto) -> str:
    rows = ["| arm | grad norm | Adam v mean | IS ratio mean [min, max] | logp diff (engine vs trainer) | clip ratio |",
            "| --- | --- | --- | --- | --- | --- |"]
    for arm, ss in _finished_arms(results, proto):
        g = lambda k: _mean([s.get(k, float("nan")) for s in ss])  # noqa: E731
        rows.append(f"| {arm} | {g('grad_norm'):.4g} | {g('adam_v_mean'):.4g} | {g('is_ratio_mean'):.5f} "
                    f"[{g('is_ratio_min'):.4f}, {g('is_ratio_max'):.4f}] | {g('logp_diff_mean'):.3g} | "
                    f"{g('clip_ratio'):.3g} |")
    return "\n".join(rows)


def _effect_sections(results: dict, proto) -> List[str]:
    """The two effects, reported apart: what each arm's master learned (compared between arms at a fixed readout),
    and how the arm's served copy reads that master out (within an arm)."""
    have_readouts = any(not math.isnan(s.get("sr_expected", float("nan"))) for s in results["runs"])
    lines = ["## Learning effect: what the masters learned (between arms)", "",
             "The fp32 master of each arm, read out the same way in every arm: its fp32 forward, and SR(master) "
             "through the engine (keyed by the run seed and the weight version in every arm, so the rounding draw is "
             "paired too). A difference here is a difference in what training produced.", "",
             "fp32 master (fp32 forward), exact expected success:", "", _pairs_table(results, "master_expected"), ""]
    if have_readouts:
        lines += ["SR(master) through the engine:", "", _pairs_table(results, "sr_expected"), "",
                  "## Readout effect: the served copy against the master's best readout (within each arm)", "",
                  "Mean ± sd over seeds of the final figures (expected success, %). The readout effect is what "
                  "evaluating the served copy instead of the best copy of the same master gains (> 0) or loses (< 0); "
                  "it says nothing about learning.", "", _readout_table(results, proto), "",
                  "Readout effect, paired between arms:", "", _pairs_table(results, "readout_effect"), ""]
    lines += ["## Noise: gradient, optimizer and importance-sampling statistics (mean over each run's steps)", "",
              _noise_table(results, proto), ""]
    return lines


def _protocol_status(prov: dict) -> str:
    """Whether the run is the committed protocol, or differs from it (and how)."""
    if prov.get("committed_unchanged"):
        return ""
    if prov.get("file_committed_unchanged") and prov.get("overrides"):
        return (f" (the file committed unchanged; run with overrides of {', '.join(prov['overrides'])}: **exploratory "
                f"unless the protocol's text declares this run**, as a stage or a subset)")
    return " (**not committed as run: exploratory**)"


def markdown(results: dict, proto) -> str:
    prov, meta, ws = results["protocol_provenance"], results["meta"], results["warm_start"]
    lines = [f"# A/B report: {proto.name}", "",
             f"Command: `{meta.get('command', '')}`; started {meta.get('started', '(not recorded)')}, finished "
             f"{meta.get('finished', '')}; wall time {meta.get('wall_min', float('nan')):.1f} min on "
             f"{meta.get('machine', '')}.", "",
             f"Protocol: `{os.path.basename(prov.get('path', ''))}`, sha256 `{prov.get('sha256', '')[:16]}`, "
             f"commit `{prov.get('commit')}`" + _protocol_status(prov) + ".", ""]
    code = meta.get("code") or {}
    lines += [f"Compute: **{proto.compute}** (trainer); code commit `{code.get('commit')}`"
              + (" (**dirty tree**: " + ", ".join(code.get("changed", [])[:5]) + ")" if code.get("dirty") else "")
              + "; versions: " + ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
              + (f"; CPU {hw['cpu']} ({', '.join(hw['isa'])})" if (hw := meta.get("hardware")) else "") + ".", ""]
    sessions = results.get("sessions") or []
    if sessions:
        lines += [f"Sessions ({len(sessions)}; each recorded when it started): " + "; ".join(
            f"{x['started']} `{(x.get('code') or {}).get('commit')}` dirty={(x.get('code') or {}).get('dirty')}, "
            f"{len(x.get('resumed_past', []))} runs found finished, {len(x.get('ran', []))} ran, "
            f"{len(x.get('retries', []))} retried, {len(x.get('failed', []))} failed" for x in sessions) + ".", ""]
    if results.get("retries"):
        lines += ["Retried runs (the failed attempt's log kept): " + "; ".join(
            f"{r['run']} (exit {r['exit']}, {r['at']})" for r in results["retries"]) + ".", ""]
    fam = results.get("family")
    if fam:
        lines += [f"Holm family ({fam['note']}): " + "; ".join(f"{m}: {a} vs {b}" for m, a, b in fam["members"])
                  + (f". Equivalence margin: ±{100 * proto.equivalence_margin:.3g} points (TOST)."
                     if proto.equivalence_margin else ". No equivalence margin declared."), "",
                  stats.TABLE_NOTE, ""]
    if len(results.get("run_code", [])) > 1:
        lines += ["**The runs come from more than one code state** (resumed across a change): "
                  + "; ".join(f"`{c.get('commit')}` dirty={c.get('dirty')}" for c in results["run_code"]), ""]
    if proto.description:
        lines += [proto.description, ""]
    if ws and "base" in ws:  # a pretrained model fine-tuned on the task's format (the protocol's sft)
        lines += [f"Warm start: {ws['base']} ({ws['parameters'] / 1e6:.1f}M parameters), SFT {ws['spec']['steps']} "
                  f"steps of {ws['spec']['batch']} at lr {ws['spec']['lr']:g} on {ws['task']}, saved in bf16 by "
                  f"{'stochastic rounding' if ws['spec'].get('rounding', 'nearest') == 'stochastic' else 'round-to-nearest'}"
                  + (f" (round-to-nearest would score {100 * ws['heldout_nearest']['expected']:.3f}%, the fp32 master "
                     f"{100 * ws['heldout_fp32']['expected']:.1f}%)" if "heldout_nearest" in ws else "") + "; held-out "
                  f"expected success {100 * ws['heldout_base']['expected']:.2f}% before, "
                  f"{100 * ws['heldout_bf16']['expected']:.1f}% after (greedy {100 * ws['heldout_bf16']['greedy']:.1f}%).",
                  ""]
    elif ws:
        lines += [f"Warm start: {ws['parameters'] / 1e6:.1f}M-parameter Qwen3 (d={ws['spec']['hidden_size']}, "
                  f"{ws['spec']['layers']} layers), SFT {ws['spec']['sft_steps']} steps, saved in bf16; held-out "
                  f"expected success {100 * ws['heldout_bf16']['expected']:.1f}%, greedy "
                  f"{100 * ws['heldout_bf16']['greedy']:.1f}%.", ""]
    lines += [f"Every arm ran {proto.steps} GRPO steps ({proto.prompts_per_step} prompts x {proto.generations} "
              f"samples) at lr {proto.lr:g} unless its name says otherwise, seeds {proto.seeds}; the final figure of a "
              f"run is the mean of its last 20% of eval points (every {proto.eval_every} steps) on "
              f"{proto.heldout} held-out prompts. Served = through the engine; master = the fp32 master.", ""]
    if results["failed_runs"] or results["missing_runs"]:
        lines += [f"**Runs that failed: {', '.join(results['failed_runs']) or 'none'}; missing: "
                  f"{', '.join(results['missing_runs']) or 'none'}.**", ""]
    lines += ["## Every arm (mean ± sd over seeds)", "", _arm_table(results, proto), ""]
    lines += _effect_sections(results, proto)
    for metric, title in (("served_expected", "primary: exact expected success of the served copy"),
                          ("served_greedy", "greedy success of the served copy"),
                          ("served_sampled", "sampled success of the served copy (temperature 1)"),
                          ("master_expected", "exact expected success of the fp32 master")):
        lines += [f"## Paired: {title}", "", _pairs_table(results, metric), ""]
    aa = _aa_pair(results, proto)
    if aa:
        aa = stats.PairResult.from_dict(aa)
        what = ("faircast with another Fair Cast seed" if aa.a == "faircast-aa"
                else f"{aa.a}: {aa.b} with another rounding seed" if parse_arm(aa.a).seed_offset
                else f"{aa.a}: {aa.b} with other draws")
        if math.isnan(aa.t_ci_low):
            lines += [f"A/A control ({what}): mean {100 * aa.mean_diff:+.3f} points over "
                      f"{aa.n} seed(s): no interval with fewer than 2 seeds.", ""]
        else:
            lines += [f"A/A control ({what}): mean {100 * aa.mean_diff:+.3f} points, 95% "
                      f"paired-t CI [{100 * aa.t_ci_low:+.3f}, {100 * aa.t_ci_high:+.3f}], "
                      f"{'contains' if aa.ci_contains_zero else '**does not contain**'} 0; its sd of paired "
                      f"differences ({100 * aa.sd_diff:.3f} points) is the noise floor for the pairs above.", ""]
    lc = results.get("lag_cost")
    if lc:
        lines += ["## Lag cost: is the standard export a delayed policy?", "",
                  f"Predicted cost = standard's lag ({lc['lag_steps']:.1f} steps) x {lc['reference']}'s learning slope "
                  f"over the second half ({100 * lc['slope_per_step']:.4f} points/step) = "
                  f"{100 * lc['predicted']:.3f} points; measured {lc['reference']} - standard = "
                  f"{100 * lc['measured']:.3f} points.", "",
                  f"Live estimate, as the adapters log it (`faircast/lag_cost` = lag x the slope of the training reward "
                  f"over the last {WINDOW} steps), on the standard arm's own logs over the last 20% of steps: "
                  f"{lc['live_lag_cost']:.4f} reward; measured {lc['reference']} - standard training reward over the "
                  f"last 20% of steps: {lc['measured_reward_gap']:.4f}.", ""]
    return "\n".join(lines) + "\n"


def plot(results: dict, proto, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for arm in proto.arms:
        curves = [c for k, c in results["curves"].items() if k.rsplit("/", 1)[0] == arm]
        if not curves:
            continue
        steps = sorted({e["step"] for c in curves for e in c["evals"]})
        mean, band = [], []
        for st in steps:
            xs = [100 * e["served_expected"] for c in curves for e in c["evals"] if e["step"] == st]
            m = _mean(xs)
            se = stats._sd(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
            mean.append(m)
            band.append(stats.t_ppf(0.975, len(xs) - 1) * se if len(xs) > 1 else 0.0)  # a t band: few seeds
        (line,) = ax1.plot(steps, mean, label=arm, linewidth=1.5)
        ax1.fill_between(steps, [m - b for m, b in zip(mean, band)], [m + b for m, b in zip(mean, band)],
                         color=line.get_color(), alpha=0.15)
        lag_steps = sorted({s for c in curves for s, v in c["lag"] if v is not None})
        lag = [_mean([v for c in curves for s, v in c["lag"] if s == st and v is not None]) for st in lag_steps]
        ax2.plot(lag_steps, lag, label=arm, color=line.get_color(), linewidth=1.2)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("served copy: expected held-out success (%)")
    ax1.set_title(f"{proto.name}: mean and 95% t band over seeds")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("what the engine holds trails the master by (steps)")
    ax2.axhline(0, color="grey", linewidth=0.6)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
