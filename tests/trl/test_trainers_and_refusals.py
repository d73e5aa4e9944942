"""RLOO and Online DPO smoke runs with Fair Cast (and negative controls), and refused combinations (continuous
batching: test_continuous_batching.py; FSDP: test_fsdp.py)."""
from __future__ import annotations

import importlib.util

import pytest

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from conftest import cat_reward
from faircast_plugins.patching import FairCastPatchError
from faircast_plugins.trl import FairCastUnsupportedError
from helpers import grpo_args, grpo_trainer, named_params, on_bf16_grid, watch_forwards

COMMON = dict(use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0, max_steps=3,
              learning_rate=1e-4, lr_scheduler_type="constant")


def rloo(model_dir, dataset, out, **flags):
    from trl import RLOOConfig, RLOOTrainer

    args = RLOOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      **COMMON, **flags)
    return RLOOTrainer(model=model_dir, reward_funcs=cat_reward, args=args, train_dataset=dataset)


def online_dpo(model_dir, dataset, out, **flags):
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    args = OnlineDPOConfig(output_dir=str(out), per_device_train_batch_size=2, max_new_tokens=8, max_length=64,
                           **COMMON, **flags)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return OnlineDPOTrainer(model=model_dir, reward_funcs=cat_reward, args=args, train_dataset=dataset,
                            processing_class=tok)


@pytest.mark.parametrize("build", [rloo, online_dpo], ids=["rloo", "online_dpo"])
def test_smoke_fair_cast_and_negative_control(build, tiny_model_dir, prompts_dataset, tmp_path):
    extra = {"model_init_kwargs": {"dtype": "float32"}} if build is online_dpo else {}
    policy = {} if build is online_dpo else {"faircast_policy_metrics_every": 1}  # Online DPO refuses it (below)
    trainer = build(tiny_model_dir, prompts_dataset, tmp_path / "on", faircast=True, faircast_audit=True,
                    faircast_seed=3, **extra, **policy)
    forwards, handle = watch_forwards(trainer, check_against_masters=True, seed=3)
    trainer.train()
    handle.remove()
    assert trainer.state.global_step == 3 and trainer._faircast.caster.version == 3
    assert forwards.grad > 0 and forwards.no_grad > 0
    assert forwards.mismatches == [] and forwards.off_grid == 0
    masters = trainer._faircast.masters
    assert not all(on_bf16_grid(m) for m in masters.values()), "the fp32 masters keep sub-bf16 updates"
    assert any("faircast/served_changed_frac" in h for h in trainer.state.log_history)
    if policy:  # RLOOTrainer's compute_loss scored its batch each step
        assert sum("faircast/policy_kl" in h for h in trainer.state.log_history) == 3

    off = build(tiny_model_dir, prompts_dataset, tmp_path / "off", **extra)
    forwards, handle = watch_forwards(off, check_against_masters=False)
    off.train()
    handle.remove()
    assert not hasattr(off, "_faircast")
    assert forwards.off_grid > 0, "flag off: the model runs on the fp32 weights"
    assert not all(on_bf16_grid(p.detach()) for p in named_params(off).values())


def test_online_dpo_bf16_policy_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    # OnlineDPO loads with dtype="auto": this bf16 checkpoint gives bf16 params, i.e. no fp32 master
    with pytest.raises(TypeError, match="Fair Cast needs fp32 master weights"):
        online_dpo(tiny_model_dir, prompts_dataset, tmp_path, faircast=True)


def test_deepspeed_without_bf16_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    args = grpo_args(tmp_path, faircast=True, bf16=False)
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # set after init: no DeepSpeed engine is built here
    with pytest.raises(FairCastUnsupportedError, match="DeepSpeed.*bf16=True"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed in this environment")
def test_peft_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    from peft import LoraConfig
    from trl import GRPOTrainer

    args = grpo_args(tmp_path, faircast=True)
    with pytest.raises(FairCastUnsupportedError, match="PEFT/LoRA"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=cat_reward, args=args, train_dataset=prompts_dataset,
                    peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # negative control: the same PEFT run without the flag builds
    plain = GRPOTrainer(model=tiny_model_dir, reward_funcs=cat_reward, args=grpo_args(tmp_path),
                        train_dataset=prompts_dataset, peft_config=LoraConfig(r=4, target_modules=["q_proj"]))
    assert not hasattr(plain, "_faircast")


def test_patch_is_idempotent_and_removable():
    import trl
    from trl.trainer import grpo_config

    import faircast_plugins.trl as fc_trl
    from faircast_plugins.patching import is_patched

    fc_trl.patch()  # already applied on import: a no-op
    assert getattr(grpo_config.GRPOConfig, "__faircast_config__", False)
    fc_trl.unpatch()
    try:
        assert not getattr(grpo_config.GRPOConfig, "__faircast_config__", False)
        assert not is_patched(trl.GRPOTrainer.__init__)
        with pytest.raises(TypeError):
            grpo_config.GRPOConfig(output_dir="/tmp/x", use_cpu=True, faircast=True)
    finally:
        fc_trl.patch()
    assert is_patched(trl.GRPOTrainer.__init__) and trl.GRPOConfig is grpo_config.GRPOConfig


def test_fp16_is_refused_on_every_path(tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 14.17: fp16 autocast rounds the bf16 served copy again; refused without continuous batching too."""
    args = grpo_args(tmp_path, faircast=True)
    args.bf16, args.fp16 = False, True  # set after init: transformers refuses fp16 on a CPU-only host
    with pytest.raises(FairCastUnsupportedError, match=r"fp16=True.*Use bf16=True"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


@pytest.mark.parametrize("optim", ["lomo", "adalomo", "galore_adamw_layerwise", "apollo_adamw_layerwise",
                                   "schedule_free_adamw"])
def test_optimizers_outside_step_are_refused(optim, tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 14.14: optimizers that step inside backward, or swap weights (schedule-free), never move the master."""
    args = grpo_args(tmp_path, faircast=True)
    args.optim = optim  # set after init: transformers checks the optional packages only when it builds them
    with pytest.raises(FairCastUnsupportedError, match=f"optim='{optim}'"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


def test_built_optimizer_outside_step_is_refused_at_train(tiny_model_dir, prompts_dataset, tmp_path):
    """An optimizer passed as ``optimizers=`` is checked when training starts (schedule-free: train()/eval())."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from faircast_plugins.trl.refusals import check_optimizer

    class ScheduleFreeLike(torch.optim.SGD):
        def train(self):
            pass

        def eval(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=cat_reward, args=grpo_args(tmp_path, faircast=True),
                          train_dataset=prompts_dataset, optimizers=(ScheduleFreeLike(model.parameters(), lr=1e-3), None))
    with pytest.raises(FairCastUnsupportedError, match="ScheduleFreeLike"):
        trainer.train()
    check_optimizer("GRPOTrainer", torch.optim.SGD(model.parameters(), lr=1e-3))  # negative control: accepted


def test_load_best_model_at_end_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    """Issue 14.15: the best checkpoint is loaded outside Fair Cast (load_state_dict)."""
    args = grpo_args(tmp_path, faircast=True)
    args.load_best_model_at_end, args.metric_for_best_model = True, "loss"  # after init: transformers checks strategies
    with pytest.raises(FairCastUnsupportedError, match="load_best_model_at_end"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)
    args.faircast, args.faircast_audit = False, True  # audit only: nothing is swapped, nothing to refuse
    assert grpo_trainer(tiny_model_dir, prompts_dataset, args)._faircast.shadow is False


def test_colocated_engine_must_be_bf16():
    """Issue 14.17: a colocated vLLM engine in fp16 (a fp16 checkpoint, or vLLM's pick for fp32 on some GPUs)."""
    from types import SimpleNamespace

    import torch

    from faircast_plugins.trl.refusals import check_engine_dtype

    def llm(dtype):
        return SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))

    for dtype in (torch.float16, torch.float32):
        with pytest.raises(FairCastUnsupportedError, match="colocated vLLM engine in torch.float"):
            check_engine_dtype("GRPOTrainer", llm(dtype))
    check_engine_dtype("GRPOTrainer", llm(torch.bfloat16))  # negative control


def test_online_dpo_refuses_the_policy_metrics(tiny_model_dir, prompts_dataset, tmp_path):
    with pytest.raises(FairCastPatchError, match="OnlineDPOTrainer.*faircast_policy_metrics_every=0"):
        online_dpo(tiny_model_dir, prompts_dataset, tmp_path, faircast_policy_metrics_every=5,
                   model_init_kwargs={"dtype": "float32"})
