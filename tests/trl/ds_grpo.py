"""Run by test_deepspeed.py: GRPO through TRL/accelerate on a real DeepSpeed ZeRO-2/3 bf16 engine, on CPU (gloo).

    python ds_grpo.py MODEL_DIR OUT_DIR MODE [STAGE]     (MODE: stochastic | off | ema; ZeRO STAGE, default 2)

``ema`` is stochastic with ``faircast_ema_decay=EMA_DECAY``.

After every optimizer step a callback records, per canonical parameter name, the fp32 master held by DeepSpeed's
optimizer (``safe_get_full_fp32_param``) and the module's bf16 weight (the served copy), and writes them to
``OUT_DIR/<MODE>.pt``.

CPU shims (tests only): a one-process gloo group is initialised through DeepSpeed before TRL builds its
``PartialState`` (accelerate then keeps it and switches to DeepSpeed); DeepSpeed's shared-memory all-reduce op, a
JIT C++ build that gloo does not need, is skipped; and transformers' "bf16 needs a GPU" argument check is bypassed
(accelerate only takes the DeepSpeed path with ``use_cpu=False``; DeepSpeed's CPU accelerator runs bf16 fine).
"""
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "trl"))

model_dir, out_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
stage = int(sys.argv[4]) if len(sys.argv) > 4 else 2
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu")

import torch  # noqa: E402

torch.set_num_threads(1)
import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")

import transformers.training_args  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True

import faircast_plugins.trl  # noqa: E402,F401
from datasets import Dataset  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from tiny import PROMPTS, cat_reward  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from faircast_plugins.key import canonical_name  # noqa: E402

SEED = 1234
STEPS = 3
EMA_DECAY = 0.5
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": stage},
    # DeepSpeed builds torch.optim.AdamW (no C++ op build): "torch_adam".
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "steps_per_print": 10**9,
}


def _full(p, engine):
    with deepspeed.zero.GatheredParameters([p], enabled=engine.zero_optimization_stage() == 3):
        return p.detach().clone()


class Recorder(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.steps = []
        self.initial = None

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.deepspeed
        module = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.initial = {canonical_name(n): _full(p, engine) for n, p in module.named_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.deepspeed
        module = self.trainer.accelerator.unwrap_model(self.trainer.model)
        fc = getattr(self.trainer, "_faircast", None)
        self.steps.append({
            "global_step": state.global_step,
            "version": fc.caster.version if fc is not None else None,
            "engine_steps": engine.global_steps,
            "optimizer": type(engine.optimizer).__name__,
            "masters": {canonical_name(n): safe_get_full_fp32_param(p).detach().clone().float()
                        for n, p in module.named_parameters()},
            "served": {canonical_name(n): _full(p, engine) for n, p in module.named_parameters()},
            "metrics": fc.metrics() if fc is not None else {},
        })


args = GRPOConfig(
    output_dir=os.path.join(out_dir, mode), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
    max_steps=STEPS, learning_rate=1e-4, beta=0.0, bf16=True, use_cpu=False, deepspeed=DS_CONFIG,
    report_to="none", save_strategy="no", logging_steps=1, seed=0, data_seed=0, dataloader_num_workers=0,
    lr_scheduler_type="constant", warmup_steps=0,
    faircast=(mode != "off"), faircast_mode=("stochastic" if mode in ("off", "ema") else mode), faircast_seed=SEED,
    faircast_ema_decay=(EMA_DECAY if mode == "ema" else 0.0),
)
recorder = Recorder()
trainer = GRPOTrainer(model=model_dir, reward_funcs=cat_reward, args=args,
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[recorder])
recorder.trainer = trainer
trainer.train()
torch.save({"steps": recorder.steps, "initial": recorder.initial, "seed": SEED, "ema_decay": args.faircast_ema_decay,
            "is_deepspeed": trainer.is_deepspeed_enabled,
            "zero_stage": trainer.deepspeed.zero_optimization_stage()},
           os.path.join(out_dir, f"{mode}.pt"))
