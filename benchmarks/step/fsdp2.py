"""FSDP2 at 2 gloo ranks on CPU: what ``faircast: true`` costs one step through TRL's FSDP2 backend.

Each arm is the same random Qwen3 under ``fully_shard`` (every decoder layer and the root; bf16
``MixedPrecisionPolicy``, fp32 gradient reduction; torch's AdamW) with TRL's ``FSDPBackend`` attached the way the
callback attaches it at train begin (``begin``: the shared FSDP cast patches, every trainable shard registered).
The trainer itself is not built: the backend gets a holder of the sharded model and this process's rank (what it
reads of a trainer), so the step is exactly the backend's: forward + loss, backward, ``optimizer.step()``,
``after_step`` (version += 1; error feedback casts its shards here), then the weight sync TRL's FSDP2 path sends
vLLM (each parameter gathered in fp32 with ``full_tensor()``, through the backend's ``export``, bf16 out).

    python benchmarks/step/fsdp2.py [--smoke] [--reps N] [--world 2]
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MEM_TARGET = 0.0  # B/param for stochastic/sticky (issue #21)
PATH = "TRL FSDP2 backend, 2 gloo ranks (fully_shard + the shared FSDP cast patches)"


def make_arm_factory(size: harness.Size, kernel: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.trl.backends.fsdp import FSDPBackend

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ids = harness.batch(size, seed=1 + rank)

    def make(label: str, mode, audit: bool) -> harness.Arm:
        model = harness.build_model(size)
        params = harness.count_params(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        backend = None
        if mode is not None or audit:
            config = FairCastConfig(enabled=mode is not None, mode=mode or "stochastic", audit=audit, seed=1234,
                                    backend=kernel)
            holder = SimpleNamespace(
                model=model, args=SimpleNamespace(should_save=False),
                accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=rank, num_processes=world,
                                            device=torch.device("cpu")))
            backend = FSDPBackend(holder, FairCaster(config))
            backend.prepare()
            with harness.quiet_logs():
                backend.begin(SimpleNamespace(global_step=0), None)
        sent = {}

        def step() -> None:
            loss = harness.lm_loss(model, ids)
            loss.backward()
            if backend is not None:
                backend.before_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if backend is not None:
                backend.after_step()
            with torch.no_grad():
                stream = ((n, p.full_tensor()) for n, p in model.named_parameters())
                for name, tensor in (backend.export(stream) if backend is not None and backend.serves_export
                                     else stream):
                    sent[name] = tensor.to(torch.bfloat16)  # what vLLM's bf16 parameter receives
            sent.clear()

        def state_bytes():
            if backend is None:
                return {}
            # model_storages counts each DTensor parameter's local shard (its storage)
            return harness.fair_cast_bytes({"backend": backend}, harness.model_storages(model, optimizer))

        arm = harness.Arm(label, mode, audit, step=step, state_bytes=state_bytes, params=params)
        arm.backend = backend
        return arm

    return make


def hooks(timers: harness.Timers, arm: harness.Arm) -> None:
    from faircast_plugins import fsdp

    if arm.backend is None:
        return
    timers.wrap(fsdp, "_cast_into", "hook: FSDP all-gather cast site")
    timers.wrap(arm.backend, "after_step", "hook: after step")
    timers.wrap_generator(arm.backend, "export", "hook: export")


def main() -> int:
    harness.reexec_for_rss()
    parser = harness.arguments(__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="local gloo ranks (default 2)")
    args = parser.parse_args()
    harness.as_ranks(args.world)
    size = harness.settle(args)
    torch.distributed.init_process_group("gloo")
    params = harness.count_params(harness.build_model(size))
    harness.header(PATH, size, params, args)
    harness.measure(PATH, make_arm_factory(size, args.backend), hooks, params, args, mem_target=MEM_TARGET)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
