"""TRL's GRPO quickstart with Fair Cast: the only changes are the import and ``faircast=True``.

    # GPUs, a real model (TRL's quickstart model and data set):
    accelerate launch examples/trl/grpo.py
    # CPU, offline, the tiny model (python examples/trl/tiny.py tiny):
    python examples/trl/grpo.py --tiny tiny
"""
import argparse

import faircast_plugins.trl  # noqa: F401  adds `faircast` to TRL's configs
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", metavar="DIR", help="run on CPU with the tiny model written by tiny.py")
cli = parser.parse_args()

if cli.tiny:  # CPU smoke run: same trainer, tiny model, local prompts, a toy reward
    from tiny import cat_reward

    model, reward = cli.tiny, cat_reward
    dataset = load_dataset("json", data_files=f"{cli.tiny}/data/train.jsonl", split="train")
    extra = dict(use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                 max_steps=4, logging_steps=1, report_to="none", save_strategy="no", faircast_audit=True)
else:
    from trl.rewards import accuracy_reward

    model, reward = "Qwen/Qwen2-0.5B-Instruct", accuracy_reward
    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
    extra = {}

trainer = GRPOTrainer(
    model=model,
    reward_funcs=reward,
    args=GRPOConfig(output_dir="Qwen2-0.5B-GRPO", faircast=True, **extra),
    train_dataset=dataset,
)
trainer.train()
