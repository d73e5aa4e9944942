"""Ray worker setup hook for running OpenRLHF's real PolicyModelActor on CPU (tests only).

Runs in every Ray worker process (``runtime_env["worker_process_setup_hook"]``) and replaces only
CUDA-specific plumbing, never Fair Cast logic:

* the import shims of ``shims.py`` (flash_attn, vllm);
* ``DeepspeedStrategy.setup_distributed``: gloo instead of ``torch.cuda.set_device`` + a CUDA device mesh;
* ``DeepspeedStrategy.get_ds_train_config``: DeepSpeed's torch AdamW instead of the FusedAdam JIT build;
* ``ppo_actor.torch_dist_barrier_and_cuda_sync``: the barrier without ``torch.cuda.synchronize``;
* ``torch.cuda.current_device`` answers ``"cpu"`` (OpenRLHF moves experiences and reductions to "the current
  device") and ``torch.cuda.synchronize`` is a no-op (the end of ``PolicyModelActor.fit``);
* ``ppo_actor.NaiveReplayBuffer``: built while ``torch.cuda.current_device`` answers 0 (it records a
  ``cuda:N`` target device that only its unused ``sample()`` reads).

``probe`` is a method the Ray test adds to the shipped actor class, to look inside the worker.
"""
from __future__ import annotations

import os
import sys


def install() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import shims

    shims.install()
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    def setup_distributed(self, timeout=None):
        deepspeed.init_distributed(dist_backend="gloo")
        self.world_size = torch.distributed.get_world_size()
        self.ring_attn_rank = 0
        self.accumulated_gradient = self.train_batch_size // self.micro_train_batch_size // self.world_size

    real_config = DeepspeedStrategy.get_ds_train_config

    def get_ds_train_config(self, optim_dict=None, **kw):
        cfg = real_config(self, optim_dict, **kw)
        if "optimizer" in cfg:
            cfg["optimizer"]["params"]["torch_adam"] = True
        return cfg

    real_buffer = ppo_actor.NaiveReplayBuffer

    def replay_buffer(*args, **kwargs):
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            return real_buffer(*args, **kwargs)
        finally:
            torch.cuda.current_device = current

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    ppo_actor.NaiveReplayBuffer = replay_buffer
    DeepspeedStrategy.setup_distributed = setup_distributed
    DeepspeedStrategy.get_ds_train_config = get_ds_train_config
    ppo_actor.torch_dist_barrier_and_cuda_sync = torch.distributed.barrier


def _qualified(fn) -> str:
    fn = getattr(fn, "__wrapped__", fn)  # Ray may wrap actor methods in the worker
    return f"{fn.__module__}.{fn.__qualname__}"


def probe(self, steps: int = 2) -> dict:
    """Inside the policy worker: is Fair Cast attached, and does a training step serve fair_cast(master)?"""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from faircast_plugins import derive_key, fair_cast
    from faircast_plugins.openrlhf import policy

    engine = self.actor.model
    fc = engine.__dict__.get("_faircast")
    out = {
        "pid": os.getpid(),
        "init_function": _qualified(type(self).init_model_from_pretrained),
        "attached": fc is not None,
        "ema_attached": self.ema_model is not None and "_faircast" in self.ema_model.model.__dict__,
    }
    if fc is None:
        return out
    out.update(seed=fc.caster.config.seed, mode=fc.caster.config.mode, version_before=fc.caster.version)
    seq = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(seq)
    action_mask = torch.ones(2, 3, dtype=torch.bool)
    for _ in range(steps):
        logp = self.actor(seq, action_mask, attention_mask=mask)
        loss = -logp.mean()
        self.strategy.backward(loss, self.actor, self.actor_optim)
        self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
    version = fc.caster.version
    mismatched = 0
    for name, p in engine.module.named_parameters():
        want = fair_cast(safe_get_full_fp32_param(p).contiguous(), key=derive_key(fc.caster.config.seed, version, name))
        mismatched += int((p.data.view(torch.int16) != want.view(torch.int16)).sum())
    out.update(version=version, mismatched=mismatched, metrics=policy.policy_metrics(engine))
    return out
