"""Test stand-ins for running TRL's AsyncGRPOTrainer on CPU (tests only; see test_async_grpo.py).

* :class:`StubRolloutWorker` and :class:`RecordingTransfer` fill the trainer's own injection points
  (``rollout_worker=``, ``weight_transfer=``) in place of the vLLM server and its NCCL weight transfer;
* :func:`install_cpu_shims` points TRL's tree attention at :class:`CpuVarlenAttention` (the FA3 kernel it would
  download from the Hub is CUDA only) and turns off the MFU peak-FLOPs lookup (``torch.cuda.get_device_name``).
"""
from __future__ import annotations

import queue
import time

import numpy as np
import torch


class CpuVarlenAttention:
    """Stand-in for the FA3 kernel's ``flash_attn_varlen_func`` (causal, bottom-right aligned, GQA), with SDPA."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True,
                               window_size=(-1, -1), **_):
        assert causal and tuple(window_size) == (-1, -1)
        out = torch.empty_like(q)
        for i in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            qi, ki, vi = (x.transpose(0, 1) for x in (q[qs:qe], k[ks:ke], v[ks:ke]))
            groups = qi.shape[0] // ki.shape[0]
            ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
            mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
            out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
        return out


class StubRolloutWorker:
    """Queues fixed-token rollouts (what the vLLM rollout worker would produce) for every model version."""

    def __init__(self):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        self.version, self.group = 0, 0

    def _fill(self, n=48):
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        rng = np.random.default_rng(self.group)
        for _ in range(n):
            self.rollout_buffer.put_nowait(RolloutSample(
                prompt=[{"role": "user", "content": "x"}], completion=[{"role": "assistant", "content": "y"}],
                input_ids=rng.integers(3, 300, size=12), completion_mask=np.array([0] * 4 + [1] * 8),
                old_log_probs=np.full(12, -5.0, dtype=np.float32), advantage=float(rng.normal()),
                model_version=self.version, group_id=self.group, metrics={}, enqueued_at=time.time()))
            self.group += 1

    def start(self):
        self._fill()

    def stop(self):
        pass

    def update_model_version(self, version):
        self.version = version
        self._fill()

    def check_health(self, stale_after_s):
        pass


class RecordingTransfer:
    """Receives what the trainer streams to the vLLM server, with the trainer's weight version at each sync."""

    def __init__(self):
        self.trainer, self.syncs = None, []

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        self.syncs.append((self.trainer.state.global_step, {n: t.detach().clone() for n, t in iterator}))

    def resume(self):
        pass

    def destroy(self):
        pass



def install_cpu_shims(setattr_=setattr):
    """Patch the two CUDA-only points (``setattr_`` may be pytest's ``monkeypatch.setattr``)."""
    import trl.experimental.async_grpo.async_grpo_trainer as async_trainer
    import trl.experimental.async_grpo.packing as packing

    setattr_(packing, "_flash_attn", lambda: CpuVarlenAttention)
    setattr_(async_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    return async_trainer.AsyncGRPOTrainer


def chat_cat_reward(completions, **kwargs):
    """``cat_reward`` for conversational completions (message lists), as AsyncGRPO's rollout worker scores them.
    Module-level, so the rollout worker's spawned child can unpickle it."""
    texts = [" ".join(m.get("content") or "" for m in c) for c in completions]
    return [min(t.count("cat"), 4) - 0.01 * len(t) for t in texts]
