"""Run by test_ddp.py under torchrun: CPU DDP GRPO with Fair Cast; each rank saves its served copy and masters.

    torchrun --nproc_per_node 2 ddp_grpo.py MODEL_DIR OUT_DIR [cb]

With ``cb``, GRPO generates with ``use_transformers_continuous_batching``; each rank also records, at the start of
every ``generate_batch``, how many parameters are not the bf16 ``fair_cast(master)`` of the current version, and the
parameter and buffer dtypes after training.
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "trl"))
import torch
import faircast_plugins.trl  # noqa
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from tiny import PROMPTS, cat_reward

from faircast_plugins import derive_key, fair_cast

d, out = sys.argv[1], sys.argv[2]
cb = sys.argv[3:] == ["cb"]
CB_CONFIG = {"num_blocks": 8, "block_size": 32, "max_batch_tokens": 256}  # small paged cache
extra = dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config=CB_CONFIG) if cb else {}
args = GRPOConfig(output_dir=out, use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=3, logging_steps=1, report_to="none", save_strategy="no", beta=0.0, learning_rate=1e-4,
                  faircast=True, faircast_seed=21, faircast_policy_metrics_every=1, faircast_policy_metrics_seqs=2,
                  **extra)
tr = GRPOTrainer(model=d, reward_funcs=cat_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
model = tr.accelerator.unwrap_model(tr.model)
generations = []
if cb:
    generate_batch = model.generate_batch

    def watched_generate_batch(*a, **k):
        version = tr._faircast.caster.version
        masters = tr._faircast.masters
        bad = sum(not (p.dtype == torch.bfloat16 and torch.equal(
            p.detach(), fair_cast(masters[n], key=derive_key(21, version, n), mode="stochastic", backend="torch")))
            for n, p in model.named_parameters())
        generations.append((version, bad))
        return generate_batch(*a, **k)

    model.generate_batch = watched_generate_batch
tr.train()
cb_state = tr._faircast
rank = tr.accelerator.process_index
torch.save({"served": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": dict(cb_state.masters),  # (a read-only view: 2 B masters)
            "version": cb_state.caster.version, "world": tr.accelerator.num_processes,
            "generations": generations, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "buffer_dtypes": sorted({str(b.dtype) for b in model.buffers()}),
            "policy_logs": [{k: v for k, v in h.items() if k.startswith("faircast/policy")}
                            for h in tr.state.log_history if "faircast/policy_kl" in h]},
           os.path.join(out, f"rank{rank}.pt"))
