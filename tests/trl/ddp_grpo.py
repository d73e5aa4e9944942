"""Run by test_ddp.py under torchrun: CPU DDP GRPO with Fair Cast; each rank saves its served copy and masters."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "trl"))
import torch
import faircast_plugins.trl  # noqa
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from tiny import PROMPTS, cat_reward

d, out = sys.argv[1], sys.argv[2]
args = GRPOConfig(output_dir=out, use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=3, logging_steps=1, report_to="none", save_strategy="no", beta=0.0, learning_rate=1e-4,
                  faircast=True, faircast_seed=21)
tr = GRPOTrainer(model=d, reward_funcs=cat_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
tr.train()
cb = tr._faircast
rank = tr.accelerator.process_index
model = tr.accelerator.unwrap_model(tr.model)
torch.save({"served": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": cb.masters, "version": cb.caster.version, "world": tr.accelerator.num_processes},
           os.path.join(out, f"rank{rank}.pt"))
