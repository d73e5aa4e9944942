"""What a stale or rounded sampler costs under TRL's importance-sampling correction, against completion length.

    python -m faircast_plugins.ab.staleness --preset smollm2 --out out/staleness      (~1 h on 2 loaded cores)
    python -m faircast_plugins.ab.staleness --preset smoke --out out/staleness-smoke  (seconds; CI)

No seeds of training are compared: the quantity is a distribution. Two phases:

1. **train**: one fresh GRPO run of the A/B harness (``run_one``: TRL + colocated vLLM, compute fp32, the arm
   ``fp32-served``) that saves the fp32 master at the preset's steps (``save_masters``).
2. **measure**: at each of the preset's ``times`` t, the samplers S in {the master θ_t (control), RTN(θ_t),
   SR(θ_t) (Fair Cast's copy at version t), θ_{t-lag} (``lag`` steps stale), θ_0 (frozen)} each draw completions
   (temperature 1, no top-k/top-p: TRL's defaults; the end-of-sequence token does not stop a completion, so every
   completion has the full length; it is a free-running continuation, no reward is needed). Each token is scored
   in lockstep by S and by the learner θ_t (fp32 HF forwards, the same kernels: only the weights differ), and at
   every length T of ``lengths`` (prefixes of one completion) this reports

   * ``sd_log_ratio``: the spread of the sequence log-ratio  L = sum_{i<=T} log θ_t(y_i) - log S(y_i);
   * ``kl_per_token``: the exact per-token KL(S || θ_t) of the next-token distributions, averaged over positions;
   * ``ess_fraction``: ESS/n = (sum w)^2 / (n sum w^2) of the sequence weights w = exp(L) (TRL's ratio);
   * ``masked_fraction`` / ``masked_weight``: the share of sequences that TRL 1.16's ``sequence_mask`` (its default
     ``vllm_importance_sampling_mode``; cap ``vllm_importance_sampling_clip_max`` = 3.0, no lower cap by default)
     sets to 0, and the share of the total weight they carried; ``truncated_weight``: the share of weight that
     ``sequence_truncate`` would clip away at the same cap;
   * ``ess_fraction_lognormal``: exp(-sd^2), what a lognormal with that spread predicts.

The rounding samplers are cast from θ_t exactly as the A/B's readouts are (``run_one.readout_copy``), and computed
in fp32, so they isolate the weights' rounding from bf16 kernels.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

#: TRL 1.16 GRPOConfig defaults read from its source (grpo_config.py, grpo_trainer.py): the sequence-level ratio
#: exp(sum of per-token (trainer - sampler) log-prob differences), masked to 0 above clip_max.
TRL_IS_MODE = "sequence_mask"
TRL_IS_CAP = 3.0


@dataclass
class Preset:
    name: str
    protocol: str = "smollm2-word2z"   # the A/B preset whose task, warm start and GRPO settings the run uses
    seed: int = 70                     # the trajectory's seed (not one of PROTOCOL-4's 60-63)
    steps: int = 20
    times: List[int] = field(default_factory=lambda: [10, 20])  # at t = lag the stale sampler is θ_0 (= frozen)
    lag: int = 10
    lengths: List[int] = field(default_factory=lambda: [27, 100, 300])
    prompts: int = 4
    samples: int = 8
    sampling_seed: int = 0
    threads: int = 2
    #: measured in this order; ``master`` (the control: 0 by construction, the same forward) last
    samplers: List[str] = field(default_factory=lambda: ["frozen", "stale", "rtn", "sr", "master"])
    #: the smoke preset: a tiny random model and synthetic "masters" instead of a training run
    synthetic: bool = False


PRESETS = {
    "smollm2": Preset("smollm2"),
    "smoke": Preset("smoke", steps=2, times=[2], lag=1, lengths=[2, 5], prompts=2, samples=2, threads=1,
                    synthetic=True),
}


# ----------------------------------------------------------------------------------------------------------------
# statistics of importance weights


def weight_stats(log_ratio: Sequence[float], cap: float = TRL_IS_CAP) -> dict:
    """The statistics of sequence log-ratios ``log_ratio`` (learner minus sampler) that say what TRL's correction
    does with them: spread, ESS fraction, what ``sequence_mask`` drops and what ``sequence_truncate`` clips."""
    import torch

    L = torch.as_tensor(list(log_ratio), dtype=torch.float64)
    n = L.numel()
    w = torch.exp(L)
    total = float(w.sum())
    ess = total ** 2 / (n * float((w * w).sum()))
    masked = w > cap
    kept = torch.where(masked, torch.zeros_like(w), w)
    sd = float(L.std(unbiased=True)) if n > 1 else 0.0
    return {
        "n": n,
        "mean_log_ratio": float(L.mean()),
        "sd_log_ratio": sd,
        "mean_weight": total / n,
        "ess_fraction": ess,
        "ess_fraction_lognormal": math.exp(-sd * sd),
        "masked_fraction": float(masked.double().mean()),
        "masked_weight": float(w[masked].sum()) / total,
        "ess_fraction_after_mask": (float(kept.sum()) ** 2 / (n * float((kept * kept).sum()))
                                    if float(kept.sum()) > 0 else 0.0),
        "truncated_weight": float((w - w.clamp(max=cap)).sum()) / total,
    }


# ----------------------------------------------------------------------------------------------------------------
# phase 1: the trajectory


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance(preset: Preset) -> dict:
    import platform

    import torch

    from .provenance import code_provenance, machine, versions

    return {"started": _utc_now(), "code": code_provenance(), "versions": versions(), "machine": machine(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": preset.threads,
            "dtype": "float32 (trainer compute, masters, samplers' forwards)", "torch": torch.__version__,
            "preset": asdict(preset)}


def train(preset: Preset, out: str, log=print) -> str:
    """The GRPO run that saves the masters; returns its ``masters`` folder (reused when already complete)."""
    from .protocol import load
    from .runner import prepare, run_spec, spec_digest, _free_port

    work = os.path.join(out, "run.work")
    masters = os.path.join(work, "masters")
    # every 5 steps besides the preset's own: a slow machine can fall back to an earlier t
    save_at = sorted({0, *preset.times, *(t - preset.lag for t in preset.times), *range(0, preset.steps + 1, 5)})
    if all(os.path.isfile(os.path.join(masters, f"step{s}.pt")) for s in save_at):
        log(f"masters at steps {save_at} already saved in {masters}")
        return masters
    proto = load(preset=preset.protocol, steps=preset.steps, eval_every=preset.steps, readouts=False,
                 threads=preset.threads)
    model, train_set, heldout, warm = prepare(proto, out, log)
    spec = run_spec(proto, "fp32-served", preset.seed, model, train_set, heldout, out)
    spec.update(workdir=work, save_masters=save_at)
    spec["digest"] = spec_digest(spec)
    os.makedirs(out, exist_ok=True)
    spec_path = os.path.join(out, "run.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    threads = str(preset.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    log(f"training: {preset.steps} steps of {proto.prompts_per_step}x{proto.generations}, lr {proto.lr}, "
        f"seed {preset.seed}, saving the masters at {save_at}")
    with open(os.path.join(out, "run.log"), "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "faircast_plugins.ab.run_one", spec_path,
                                 os.path.join(out, "run.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        for line in proc.stdout:
            logf.write(line)
            logf.flush()
            if line.startswith("  ["):
                log(line.rstrip())
        if proc.wait() != 0:
            raise RuntimeError(f"the training run failed; see {os.path.join(out, 'run.log')}")
    return masters


# ----------------------------------------------------------------------------------------------------------------
# phase 2: the samplers, drawn and scored in lockstep


def sampler_weights(kind: str, masters: Dict[int, Dict], t: int, lag: int, seed: int) -> Optional[Dict]:
    """The fp32 weights of sampler ``kind`` at time ``t`` (None for ``master``: the learner itself)."""
    import torch

    from .run_one import readout_copy

    if kind == "master":
        return None
    if kind in ("rtn", "sr"):
        return {n: readout_copy(kind, m, seed, t, n).to(torch.float32) for n, m in masters[t].items()}
    if kind == "stale":
        return masters[t - lag]
    if kind == "frozen":
        return masters[0]
    raise ValueError(f"unknown sampler {kind!r}")


def lockstep(sampler, learner, prompts: List[List[int]], samples: int, length: int, seed: int,
             log=None, at_lengths: Sequence[int] = (), on_length=None) -> dict:
    """``samples`` completions of ``length`` tokens per prompt drawn from ``sampler`` (temperature 1, end of sequence
    ignored), each token scored by ``sampler`` and ``learner`` in the same step. The draws use shared uniforms
    (inverse CDF of one uniform per row and position from ``seed``): every sampler given the same ``seed`` draws
    from the same random numbers. Returns per row: the cumulative log-ratio (learner - sampler) after each token
    and the exact per-position KL(sampler || learner). ``on_length(T, draws)`` is called when the completions reach
    each length of ``at_lengths`` (a partial result survives an interruption)."""
    import torch

    rows = [p for p in prompts for _ in range(samples)]
    B, width = len(rows), max(map(len, rows))
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    for i, r in enumerate(rows):  # left padded
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    uniforms = torch.rand(B, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    same = learner is sampler
    out_s = sampler(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    out_l = out_s if same else learner(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    log_ratio = torch.zeros(B, length, dtype=torch.float64)
    kl = torch.zeros(B, length, dtype=torch.float64)
    tokens = torch.zeros(B, length, dtype=torch.long)
    last = pos[:, -1:]
    start = time.time()
    for i in range(length):
        ls = torch.log_softmax(out_s.logits[:, -1].double(), -1)
        ll = ls if same else torch.log_softmax(out_l.logits[:, -1].double(), -1)
        ps = ls.exp()
        cdf = ps.cumsum(-1)
        tok = torch.searchsorted(cdf, (uniforms[:, i:i + 1] * cdf[:, -1:]).contiguous()).clamp(max=ps.shape[-1] - 1)
        tokens[:, i] = tok.squeeze(-1)
        log_ratio[:, i] = (ll.gather(-1, tok) - ls.gather(-1, tok)).squeeze(-1)
        kl[:, i] = (ps * (ls - ll)).sum(-1)
        if on_length is not None and i + 1 in at_lengths:
            on_length(i + 1, {"cum_log_ratio": log_ratio[:, :i + 1].cumsum(-1), "kl": kl[:, :i + 1],
                              "tokens": tokens[:, :i + 1]})
        if i + 1 == length:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], -1)
        last = last + 1
        out_s = sampler(input_ids=tok, attention_mask=mask, position_ids=last, past_key_values=out_s.past_key_values,
                        use_cache=True)
        out_l = out_s if same else learner(input_ids=tok, attention_mask=mask, position_ids=last,
                                           past_key_values=out_l.past_key_values, use_cache=True)
        if log and (i + 1) % 50 == 0:
            log(f"    token {i + 1}/{length} ({time.time() - start:.0f} s)")
    return {"cum_log_ratio": log_ratio.cumsum(-1), "kl": kl, "tokens": tokens}


def summarize_draws(draws: dict, lengths: Sequence[int], eos: Sequence[int] = ()) -> Dict[int, dict]:
    """:func:`weight_stats` of the sequence log-ratios at each prefix length, with the mean per-token KL; with
    ``eos`` token ids and the drawn ``tokens``, also ``stop_at_eos``: the same for completions that end at their first
    end-of-sequence token within T (what a rollout with ``max_tokens`` T returns and TRL weighs)."""
    import torch

    out = {}
    for T in lengths:
        row = weight_stats(draws["cum_log_ratio"][:, T - 1].tolist())
        if eos and "tokens" in draws:
            toks = draws["tokens"][:, :T]
            hit = torch.zeros_like(toks, dtype=torch.bool)
            for e in eos:
                hit |= toks == e
            first = torch.where(hit.any(-1), hit.int().argmax(-1), torch.full((toks.shape[0],), T - 1))
            stopped = draws["cum_log_ratio"][:, :T].gather(-1, first[:, None]).squeeze(-1)
            row["stop_at_eos"] = {**weight_stats(stopped.tolist()), "mean_length": float((first + 1).double().mean()),
                                  "ended": float(hit.any(-1).double().mean())}
        row["kl_per_token"] = float(draws["kl"][:, :T].mean())
        row["kl_per_token_after_27"] = float(draws["kl"][:, 27:T].mean()) if T > 27 else None
        out[T] = row
    return out


def _synthetic(preset: Preset):
    """The smoke preset's stand-ins: a tiny random Qwen3, random prompts, and masters that drift linearly."""
    import torch

    from .warmstart import WarmStartSpec, build_model

    model = build_model(WarmStartSpec(hidden_size=32, layers=1, heads=2), 64).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    direction = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) for n, p in base.items()}
    masters = {s: {n: (base[n] + 0.02 * s * direction[n]).to(torch.bfloat16).float() + 1e-4 * s * direction[n]
                   for n in base} for s in range(preset.steps + 1)}
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 64, (5 + i,), generator=gen).tolist() for i in range(preset.prompts)]
    return model, masters, prompts


class _LazyMasters(dict):
    """The saved masters by step, loaded on first use; waits for a step the training run has not saved yet (the
    measurement of an early time point overlaps the rest of the run)."""

    def __init__(self, folder: str, log=print):
        super().__init__()
        self.folder, self.log = folder, log

    def __missing__(self, step: int):
        import torch

        path = os.path.join(self.folder, f"step{step}.pt")
        if not os.path.isfile(path):
            self.log(f"waiting for the training run to save {path}")
            while not os.path.isfile(path):
                time.sleep(10)
        self[step] = torch.load(path, map_location="cpu")
        return self[step]


def measure(preset: Preset, out: str, masters_dir: Optional[str], log=print) -> dict:
    import copy

    import torch

    from .run_one import load_masters

    torch.set_num_threads(preset.threads)
    if preset.synthetic:
        template, masters, prompts = _synthetic(preset)
        eos = [0]
        model_dir, run_seed = None, preset.seed
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .scoring import encode
        from .task import Problem

        spec_path = os.path.join(out, "run.spec.json")
        while not os.path.isfile(spec_path):  # written by the training phase once its warm start is built
            time.sleep(10)
        with open(spec_path) as f:
            spec = json.load(f)
        model_dir, run_seed = spec["model"], int(spec["seed"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        problems = [Problem(**p) for p in spec["train"][:preset.prompts]]
        prompts = encode(tokenizer, problems).prompt_ids
        masters = _LazyMasters(masters_dir, log)
        template = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eos = template.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
    learner, sampler = template, copy.deepcopy(template)
    results = {"preset": asdict(preset), "trl_is": {"mode": TRL_IS_MODE, "cap": TRL_IS_CAP}, "model": model_dir,
               "run_seed": run_seed, "prompt_lengths": [len(p) for p in prompts], "times": {}}
    path = os.path.join(out, "results.json")
    n = len(prompts) * preset.samples
    for t in preset.times:
        load_masters(learner, masters[t])
        results["times"][str(t)] = {}
        for kind in preset.samplers:
            t0 = time.time()
            if kind == "stale" and t - preset.lag == 0 and "frozen" in results["times"][str(t)]:
                results["times"][str(t)][kind] = {**results["times"][str(t)]["frozen"], "same_as": "frozen"}
                log(f"t={t} sampler stale: θ_{t - preset.lag} is the frozen sampler (measured once)")
                continue
            weights = sampler_weights(kind, masters, t, preset.lag, run_seed)
            if weights is not None:
                load_masters(sampler, weights)
            log(f"t={t} sampler {kind}: {n} completions of {max(preset.lengths)} tokens")

            def record(T: int, draws: dict, t=t, kind=kind, t0=t0) -> None:
                done = [L for L in preset.lengths if L <= T]
                rows = summarize_draws(draws, done, eos)
                results["times"][str(t)][kind] = {
                    "by_length": {str(L): r for L, r in rows.items()},
                    "kl_by_position": draws["kl"].mean(0).tolist(),
                    "log_ratio_at_lengths": {str(L): draws["cum_log_ratio"][:, L - 1].tolist() for L in done},
                    "tokens": draws["tokens"].tolist(),
                    "complete": T == max(preset.lengths), "wall_s": time.time() - t0,
                }
                r = rows[T]
                log(f"  T={T:>4}  sd {r['sd_log_ratio']:.3f}  KL/token {r['kl_per_token']:.2e}  ESS/n "
                    f"{r['ess_fraction']:.3f}  masked {r['masked_fraction']:.3f} (weight {r['masked_weight']:.3f})")
                if "stop_at_eos" in r:
                    e = r["stop_at_eos"]
                    log(f"         stopped at end of sequence (mean length {e['mean_length']:.1f}, {e['ended']:.0%} "
                        f"ended): sd {e['sd_log_ratio']:.3f}  ESS/n {e['ess_fraction']:.3f}  masked "
                        f"{e['masked_fraction']:.3f} (weight {e['masked_weight']:.3f})")
                results["finished"] = _utc_now()
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(results, f)
                os.replace(tmp, path)  # written at every length: a partial result survives an interruption

            with torch.no_grad():
                lockstep(learner if weights is None else sampler, learner, prompts, preset.samples,
                         max(preset.lengths), preset.sampling_seed + t, log, preset.lengths, record)
    return results


# ----------------------------------------------------------------------------------------------------------------
# the report: a table (markdown + JSON) and a plot against length

#: the predictions committed before the measurement (docs/ab/staleness-mechanism/PREDICTION.md), for the frozen
#: sampler: ab-audit-2's √T extrapolation from stage A, and this measurement's author's
PREDICTED = {
    "audit (frozen, √T from σ(27) = 0.6)": {27: {"sd": 0.6, "ess": 0.70, "masked_weight": 0.06},
                                           100: {"sd": 1.15, "ess": 0.27, "masked_weight": 0.35},
                                           300: {"sd": 2.0, "ess": 0.02, "masked_weight": 0.67}},
    "mine (frozen, t = 20)": {27: {"sd": 0.4, "ess": 0.85, "masked_weight": 0.03},
                              100: {"sd": 0.65, "ess": 0.65, "masked_weight": 0.12},
                              300: {"sd": 1.0, "ess": 0.35, "masked_weight": 0.30}},
}
LABELS = {"master": "θ_t (control)", "rtn": "RTN(θ_t)", "sr": "SR(θ_t), Fair Cast", "stale": "θ_{t-10}",
          "frozen": "θ_0 (frozen)"}


def table_rows(results: dict) -> List[dict]:
    rows = []
    for t, by_sampler in results["times"].items():
        for kind, res in by_sampler.items():
            for T, r in res["by_length"].items():
                rows.append({"t": int(t), "sampler": kind, "T": int(T), **{k: v for k, v in r.items()}})
    return rows


def write_report(results: dict, folder: str, predicted: Optional[dict] = None, title: str = "") -> None:
    """``table.md``, ``table.json`` and ``lengths.png`` in ``folder`` from a measurement's ``results``, with
    ``predicted`` (default :data:`PREDICTED`; ``{}`` for none) drawn beside the measurement."""
    predicted = PREDICTED if predicted is None else predicted
    os.makedirs(folder, exist_ok=True)
    rows = table_rows(results)
    with open(os.path.join(folder, "table.json"), "w") as f:
        json.dump({"rows": rows, "predicted": {k: {str(T): v for T, v in p.items()} for k, p in predicted.items()},
                   "trl_is": results["trl_is"], "preset": results["preset"], "n_per_cell": rows[0]["n"] if rows
                   else 0}, f, indent=1)
    head = ("| t | sampler | T | mean log-ratio | sd of log-ratio | KL / token | ESS/n | exp(-sd²) | masked (ratio > 3) "
            "| weight masked | ESS/n after mask | weight truncated at 3 | mean weight |")
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        lines.append(f"| {r['t']} | {LABELS.get(r['sampler'], r['sampler'])}"
                     f"{' (= θ_0)' if results['times'][str(r['t'])][r['sampler']].get('same_as') else ''} | "
                     f"{r['T']} | {r['mean_log_ratio']:.3f} | {r['sd_log_ratio']:.3f} | {r['kl_per_token']:.2e} | {r['ess_fraction']:.3f} | "
                     f"{r['ess_fraction_lognormal']:.3f} | {r['masked_fraction']:.3f} | {r['masked_weight']:.3f} | "
                     f"{r['ess_fraction_after_mask']:.3f} | {r['truncated_weight']:.3f} | {r['mean_weight']:.3g} |")
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(results, rows, os.path.join(folder, "lengths.png"), predicted, title)


def _plot(results: dict, rows: List[dict], path: str, predicted: dict, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = sorted({r["t"] for r in rows})
    fig, axes = plt.subplots(2, len(times), figsize=(max(9, 5.5 * len(times)), 8), squeeze=False)
    lengths = sorted({r["T"] for r in rows})
    colors = {"master": "0.6", "rtn": "tab:red", "sr": "tab:green", "stale": "tab:orange", "frozen": "tab:blue"}
    for j, t in enumerate(times):
        for kind in LABELS:
            pts = sorted((r["T"], r) for r in rows if r["t"] == t and r["sampler"] == kind)
            if not pts:
                continue
            Ts = [T for T, _ in pts]
            axes[0][j].plot(Ts, [r["ess_fraction"] for _, r in pts], "o-", color=colors[kind], label=LABELS[kind])
            axes[1][j].plot(Ts, [r["sd_log_ratio"] for _, r in pts], "o-", color=colors[kind], label=LABELS[kind])
        for (name, pred), style in zip(predicted.items(), ("k--", "k:")):
            Ts = sorted(pred)
            axes[0][j].plot(Ts, [pred[T]["ess"] for T in Ts], style, label=f"predicted: {name}")
            axes[1][j].plot(Ts, [pred[T]["sd"] for T in Ts], style, label=f"predicted: {name}")
        axes[0][j].set(title=f"t = {t}: ESS/n of TRL's sequence weights", xlabel="completion length T (tokens)",
                       ylabel="ESS / n", xscale="log", ylim=(0, 1.05))
        axes[1][j].set(title=f"t = {t}: sd of the sequence log-ratio", xlabel="completion length T (tokens)",
                       ylabel="sd (nats)", xscale="log")
        n = rows[0]["n"] if rows else 0
        axes[0][j].axhline(1 / max(n, 1), color="0.8", lw=0.8, label=f"1/n (one sequence carries all, n = {n})")
        for ax in axes[:, j]:
            ax.set_xticks(lengths)
            ax.set_xticklabels([str(T) for T in lengths])
            ax.minorticks_off()
        axes[0][j].legend(fontsize=7)
    n = rows[0]["n"] if rows else 0
    fig.suptitle(title or f"SmolLM2-135M, word2z GRPO (fp32, lr 3e-6): sampler vs learner θ_t, n = {n} completions "
                          f"per point", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# the command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m faircast_plugins.ab.staleness", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smoke", choices=sorted(PRESETS))
    p.add_argument("--out", default="out/staleness")
    p.add_argument("--phase", default="all", choices=("all", "train", "measure", "report"))
    p.add_argument("--report", help="write table.md, table.json and lengths.png here (default: OUT/report)")
    p.add_argument("--prompts", type=int, help="prompts per sampler (overrides the preset)")
    p.add_argument("--samples", type=int, help="completions per prompt (overrides the preset)")
    p.add_argument("--threads", type=int, help="torch threads (overrides the preset; 1 on a shared machine: "
                                               "OpenMP threads spin while others wait for a core)")
    p.add_argument("--times", help="comma-separated steps t to measure at, in order (overrides the preset)")
    p.add_argument("--samplers", help="comma-separated samplers, in order (overrides the preset): "
                                      "frozen, stale, rtn, sr, master")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    for k in ("prompts", "samples", "threads"):
        if getattr(args, k) is not None:
            setattr(preset, k, getattr(args, k))
    if args.times:
        preset.times = [int(x) for x in args.times.split(",")]
    if args.samplers:
        preset.samplers = [x.strip() for x in args.samplers.split(",")]
        unknown = set(preset.samplers) - set(LABELS)
        if unknown:
            raise SystemExit(f"unknown sampler(s) {sorted(unknown)}; samplers: {', '.join(LABELS)}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    report_dir = args.report or os.path.join(args.out, "report")
    if args.phase == "report":
        with open(os.path.join(args.out, "results.json")) as f:
            write_report(json.load(f), report_dir)
        print(f"report written to {report_dir}")
        return 0

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.0f} s] {msg}", flush=True)

    prov_path = os.path.join(args.out, f"provenance-{args.phase}.json")
    with open(prov_path, "w") as f:
        json.dump(provenance(preset), f, indent=1)
    log(f"provenance recorded: {prov_path}")
    if preset.synthetic:
        masters = None
    elif args.phase == "all":  # the training run in the background; the measurement waits for each saved step
        masters = os.path.join(args.out, "run.work", "masters")
        trainer = __import__("threading").Thread(target=train, args=(preset, args.out, log), daemon=True)
        trainer.start()
    elif args.phase == "train":
        masters = train(preset, args.out, log)
    else:
        masters = os.path.join(args.out, "run.work", "masters")
    if args.phase in ("all", "measure"):
        write_report(measure(preset, args.out, masters, log), report_dir)
        log(f"report written to {report_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
