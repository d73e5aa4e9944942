"""Doctor check ``trl``: TRL's patched trainer, Fair Cast callback and vLLM export iterator, on CPU.

A tiny GRPO run (the tiny Qwen3 of :mod:`.tiny`, no vLLM engine: TRL generates with the policy) with
``faircast=True`` takes two SGD steps. Every forward of the policy must run on ``fair_cast(fp32 master)`` at the
current weight version (the callback's served copy), and TRL's export iterator
``VLLMGeneration._iter_named_params`` -- what colocate and server modes send to vLLM -- must yield those bf16 bits.
"""
from __future__ import annotations

import os
import tempfile
from typing import List

from . import SEED, check_served, expect

STEPS = 2


def _reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]  # any signal: the check reads weights, not the reward


def check() -> List[str]:
    for var, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")):
        os.environ.setdefault(var, value)
    import torch
    from datasets import Dataset

    from .. import trl as fc_trl  # patches TRL, its configs included
    from ..key import canonical_name
    from ..trl.patches import PATCHES, find_callback
    from .tiny import PROMPTS, build_model, build_tokenizer

    fc_trl.patch()
    patches = PATCHES
    from trl import GRPOConfig, GRPOTrainer  # the configs with the faircast fields
    from trl.generation import vllm_generation
    with tempfile.TemporaryDirectory(prefix="faircast-doctor-trl-") as tmp:
        build_tokenizer(tmp)
        build_model(tmp)
        args = GRPOConfig(
            output_dir=os.path.join(tmp, "out"), faircast=True, faircast_seed=SEED, max_steps=STEPS,
            per_device_train_batch_size=4, num_generations=4, max_completion_length=4, use_cpu=True, beta=0.0,
            optim="sgd", learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, report_to="none",
            save_strategy="no", logging_steps=1, seed=0, data_seed=0, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=tmp, reward_funcs=_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}))
        callback = find_callback(trainer)
        expect(callback is not None, "GRPOTrainer(faircast=True) has no Fair Cast callback: the trainer patch did not run")
        model = trainer.accelerator.unwrap_model(trainer.model)
        seen = []  # (version, {name: weight the forward computes with}, {name: master})

        def record(module, args, kwargs):
            params = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
            seen.append((callback.caster.version, params, {n: m.clone() for n, m in callback.masters.items()}))

        hook = model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            trainer.train()
        finally:
            hook.remove()
        version = callback.caster.version
        expect(version == STEPS, f"weight version {version} after {STEPS} steps")
        distinct, forwards = False, 0
        for v, params, masters in seen:
            expect(bool(masters), "the callback keeps no fp32 masters: the forward would run on them")
            for name, master in masters.items():
                distinct |= check_served("GRPO forward", name, params[name].to(torch.bfloat16), master, v)
                expect(torch.equal(params[name], params[name].to(torch.bfloat16).float()),
                       f"GRPO forward: {name} is not on the bf16 grid")
            forwards += 1
        expect(forwards > 0, "no forward of the policy was seen")
        first, last = seen[0][2], callback.masters
        expect(any(not torch.equal(first[n], last[n]) for n in last), "the optimizer never moved the fp32 masters")

        # TRL's export iterator, as VLLMGeneration.sync_weights walks it (world size 1, no FSDP/DeepSpeed).
        generation = vllm_generation.VLLMGeneration.__new__(vllm_generation.VLLMGeneration)
        generation.model = trainer.model
        generation._dist = vllm_generation.DistributedBackend(trainer.accelerator)
        generation._faircast = callback
        exported = dict(vllm_generation.VLLMGeneration._iter_named_params(generation))
        names = {canonical_name(n) for n in exported}
        expect(names == set(callback.masters), f"the export has {len(names)} tensors, the policy "
                                               f"{len(callback.masters)} trained parameters")
        for name, tensor in exported.items():
            distinct |= check_served("TRL export", name, tensor, callback.masters[canonical_name(name)], version)
        expect(distinct, "the served copies equal round-to-nearest everywhere: the check cannot tell them apart")
    return [f"TRL {patches.version}{'' if patches.verified else ' (UNVERIFIED)'}: {forwards} GRPO forwards over "
            f"{STEPS} steps ran on fair_cast(master); VLLMGeneration._iter_named_params yielded the served bf16 "
            f"copy of all {len(exported)} parameters at weight version {version}"]
