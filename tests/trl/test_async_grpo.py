"""TRL's real AsyncGRPOTrainer on CPU, one process (FSDP2 with 2 processes: test_fsdp.py), with its two documented
plug points filled by test stand-ins.

What runs on CPU: the trainer, its data path (rollout queue -> packing -> collator), the tree-attention loss forward,
the optimizer, the weight-sync callbacks and ``_streaming_iter``. What does not, and is replaced here (tests only):

* the vLLM server and its NCCL weight transfer: ``rollout_worker=`` and ``weight_transfer=`` are the trainer's own
  injection points (``RolloutWorkerProtocol``, ``WeightTransferProtocol``). The stand-in worker queues fixed token
  rollouts; the stand-in transfer records every tensor of every sync (async_stubs.py);
* the FA3 tree-attention kernel, which TRL downloads from the Hub (``kernels-community/flash-attn3``, CUDA only):
  ``packing._flash_attn`` is pointed at a causal varlen attention written with torch SDPA;
* ``get_peak_flops_per_device``, which calls ``torch.cuda.get_device_name``: returns None (MFU metrics off).

Checked: every loss forward runs on ``fair_cast(master)`` at the current version; every sync (the cold one at train
begin and one per step) streams bf16 tensors equal to ``fair_cast(master)``; the manifest the real
``WeightTransferClient`` would announce to the server says bf16. Negative control: with the flag off the stream and
the manifest stay fp32 and the forwards run on fp32 weights off the bf16 grid.
"""
from __future__ import annotations

import pytest
import torch

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from async_stubs import RecordingTransfer, StubRolloutWorker, install_cpu_shims
from helpers import expected_served, on_bf16_grid, watch_forwards

SEED = 99


@pytest.fixture
def cpu_async_grpo(monkeypatch):
    return install_cpu_shims(monkeypatch.setattr)


def _args(tmp_path, **flags):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=3, logging_steps=1, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-4, seed=0,
        token_budget=128, vllm_server_timeout=5, **flags)


def _build(trainer_class, tiny_model_dir, prompts_dataset, args, transfer="record"):
    from transformers import AutoTokenizer

    from conftest import cat_reward

    recorder = RecordingTransfer() if transfer == "record" else None
    trainer = trainer_class(model=tiny_model_dir, reward_funcs=cat_reward, args=args, train_dataset=prompts_dataset,
                            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                            rollout_worker=StubRolloutWorker(), weight_transfer=recorder)
    if recorder is not None:
        recorder.trainer = trainer
    return trainer, recorder


def test_async_grpo_trains_and_streams_fair_cast_of_master(cpu_async_grpo, tiny_model_dir, prompts_dataset, tmp_path):
    trainer, transfer = _build(cpu_async_grpo, tiny_model_dir, prompts_dataset,
                               _args(tmp_path, faircast=True, faircast_seed=SEED, faircast_audit=True))
    masters_at = {}

    def snapshot(*_args, **_kwargs):  # the masters each sync must serve, by version
        masters_at[trainer._faircast.caster.version] = {n: m.clone() for n, m in trainer._faircast.masters.items()}

    original_sync = trainer._sync_weight
    trainer._sync_weight = lambda: (snapshot(), original_sync())[1]
    for callback in trainer.callback_handler.callbacks:  # the StepIntervalCallback holds the bound method
        if getattr(callback, "fn", None) == original_sync:
            callback.fn = trainer._sync_weight
    log, handle = watch_forwards(trainer, check_against_masters=True, seed=SEED)
    try:
        trainer.train()
    finally:
        handle.remove()

    assert trainer.state.global_step == 3 and trainer._faircast.caster.version == 3
    assert log.grad >= 3 and log.off_grid == 0 and log.mismatches == [], log.mismatches[:5]  # loss on the served copy
    assert [v for v, _ in transfer.syncs] == [0, 1, 2, 3]  # cold sync at train begin, then one per step
    differs_from_nearest = 0
    for version, sent in transfer.syncs:
        assert set(sent) == set(masters_at[version])
        for name, tensor in sent.items():
            master = masters_at[version][name]
            assert tensor.dtype == torch.bfloat16, name
            want = expected_served(master, seed=SEED, version=version, name=name, mode="stochastic")
            assert torch.equal(tensor, want), (version, name)
            differs_from_nearest += int(not torch.equal(tensor, master.to(torch.bfloat16)))
    assert differs_from_nearest > 0
    masters = trainer._faircast.masters
    assert any(not on_bf16_grid(m) for m in masters.values())  # the masters keep sub-bf16 updates
    assert any("faircast/served_changed_frac" in h for h in trainer.state.log_history)


def test_async_grpo_without_faircast_streams_fp32(cpu_async_grpo, tiny_model_dir, prompts_dataset, tmp_path):
    trainer, transfer = _build(cpu_async_grpo, tiny_model_dir, prompts_dataset, _args(tmp_path))
    log, handle = watch_forwards(trainer, check_against_masters=False)
    try:
        trainer.train()
    finally:
        handle.remove()
    assert not hasattr(trainer, "_faircast")
    assert [v for v, _ in transfer.syncs] == [0, 1, 2, 3]
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    last = transfer.syncs[-1][1]
    assert {t.dtype for t in last.values()} == {torch.float32}
    assert all(torch.equal(last[n], params[n]) for n in last)  # TRL's stream: the fp32 weights themselves
    assert log.off_grid > 0  # the loss forwards ran on weights off the bf16 grid


@pytest.mark.parametrize("faircast", [True, False])
def test_async_grpo_manifest_announces_the_stream_dtype(cpu_async_grpo, tiny_model_dir, prompts_dataset, tmp_path,
                                                         faircast):
    """The real WeightTransferClient (built, not connected: no server here) holds the dtype manifest."""
    trainer, _ = _build(cpu_async_grpo, tiny_model_dir, prompts_dataset, _args(tmp_path, faircast=faircast),
                        transfer=None)
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    assert isinstance(trainer.weight_transfer, WeightTransferClient)
    dtypes = set(trainer.weight_transfer._weight_update_info["dtype_names"])
    assert dtypes == ({"bfloat16"} if faircast else {"float32"})
