"""Doctor check ``deepspeed``: DeepSpeed's patched fp32 -> bf16 copy-back, ZeRO-2 bf16 at world size 1.

A tiny bf16 model gets a DeepSpeed engine with Fair Cast attached (:func:`apply_deepspeed_patch`); two AdamW steps
run (torch's AdamW: no DeepSpeed C++ op is built). After each step the bf16 weights -- what OpenRLHF broadcasts to
vLLM and what the next forward computes with -- must be ``fair_cast(fp32 master)`` at the new weight version.
The check runs on the CPU (``DS_ACCELERATOR=cpu``, set before DeepSpeed is imported, on a GPU machine too) and
skips DeepSpeed's shared-memory collective op, a minutes-long JIT build that one rank never uses.
"""
from __future__ import annotations

import os
from typing import List

from . import SEED, check_served, expect, world_of_one

STEPS = 2


def _tiny_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(37, 24), torch.nn.Linear(24, 29), torch.nn.Tanh(),
                               torch.nn.Linear(29, 37, bias=False)).to(torch.bfloat16)


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    }


def check() -> List[str]:
    import torch

    os.environ["DS_ACCELERATOR"] = "cpu"
    import importlib

    import deepspeed

    from ..patching import temporarily

    comm_backend = importlib.import_module("deepspeed.comm.torch")  # the module (the package's .torch is torch)
    with world_of_one(), temporarily(comm_backend, "build_shm_op", lambda: None):
        from deepspeed.utils import safe_get_full_fp32_param

        from ..caster import FairCaster
        from ..config import FairCastConfig
        from ..deepspeed import apply_deepspeed_patch, install_deepspeed_patch

        patches = install_deepspeed_patch()
        deepspeed.init_distributed(dist_backend="gloo")
        model = _tiny_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
        fc = apply_deepspeed_patch(engine, FairCaster(FairCastConfig(enabled=True, seed=SEED)))
        expect(fc is not None, "apply_deepspeed_patch attached nothing with Fair Cast enabled")
        seen = []  # (name, weight the forward computes with, version)
        params = dict(engine.module.named_parameters())

        def record(module, args):
            seen.extend((n, p.detach().clone(), fc.caster.version) for n, p in params.items())

        hook = engine.module.register_forward_pre_hook(record)
        ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(7))
        masters, distinct = {}, False
        try:
            for step in range(STEPS + 1):
                logits = engine(ids[:, :-1])  # the last forward runs on the weights of the last step
                if step == STEPS:
                    break
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 37), ids[:, 1:].reshape(-1))
                engine.backward(loss)
                engine.step()
                expect(fc.caster.version == step + 1, f"weight version {fc.caster.version} after {step + 1} steps")
                masters[step + 1] = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params.items()}
        finally:
            hook.remove()
        checked = 0
        for name, weight, version in seen:
            if version in masters:  # version 0 is DeepSpeed's own bf16 initial weights
                distinct |= check_served("DeepSpeed copy-back", name, weight, masters[version][name], version)
                checked += 1
        expect(checked == len(params) * STEPS, f"checked {checked} weights, expected {len(params) * STEPS}")
        expect(distinct, "the served copies equal round-to-nearest everywhere: the check cannot tell them apart")
        expect(fc.last_step_elements == sum(p.numel() for p in params.values()),
               f"the copy-back cast {fc.last_step_elements} elements, not every trainable one")
    return [f"DeepSpeed {patches.version}{'' if patches.verified else ' (UNVERIFIED)'} ZeRO-2 bf16: the weights "
            f"after each of {STEPS} steps (what the forward runs on and the engine is sent) are fair_cast(master)"]
