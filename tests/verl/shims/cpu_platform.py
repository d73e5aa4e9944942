"""Test shims that let verl 0.9.1's real worker code run on CPU with gloo. They change no verl code.

1. A ``cpu`` platform (``VERL_PLATFORM=cpu``): verl has none, and would fall back to ``nvidia``.
2. The FSDP engines registered for device ``cpu`` (verl registers them for ``cuda``/``npu`` only).
3. ``load_fsdp_model_to_gpu`` / ``offload_fsdp_model_to_cpu`` as no-ops: on CPU there is nowhere to move to.
4. FSDP1's ``sync_module_states`` CPU guard disabled: gloo broadcasts CPU tensors fine.
5. A recording rollout (``name=faircast_record``) that keeps whatever ``update_weights`` sends it.
6. ``fsdp2_sharded_save_to_cpu`` copies: on CPU its ``.cpu()`` would alias the live shards (decoupled PPO's
   saved masters would then follow the optimizer).

Call :func:`install` in each process before building a worker.
"""
from __future__ import annotations

import contextlib
import os

import torch


class _CPUDevice:
    """The subset of ``torch.cuda``'s module API verl calls, for the CPU (memory stats read as zero)."""

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def get_device_name(*_):
        return "cpu"

    def __getattr__(self, name):
        zero_stats = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
        noops = ("synchronize", "empty_cache", "ipc_collect", "reset_peak_memory_stats", "set_device",
                 "manual_seed", "manual_seed_all")
        if name in zero_stats:
            return lambda *a, **k: 0
        if name in noops:
            return lambda *a, **k: None
        if name == "mem_get_info":
            return lambda *a, **k: (8 << 30, 16 << 30)
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)
        raise AttributeError(f"CPU test platform: torch.cuda-like attribute {name!r} is not shimmed")


_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    os.environ["VERL_PLATFORM"] = "cpu"
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CPUDevice()

        def is_available(self):
            return True

        def current_device(self):
            return torch.device("cpu")

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CPU_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    from verl.workers.engine.base import EngineRegistry

    for model_type, backends in EngineRegistry._engines.items():
        for backend, devices in backends.items():
            if "cuda" in devices and "cpu" not in devices:
                devices["cpu"] = devices["cuda"]

    import verl.utils.fsdp_utils as fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl

    def noop(*args, **kwargs):
        return None

    for mod in (fsdp_utils, transformer_impl):
        for name in ("load_fsdp_model_to_gpu", "offload_fsdp_model_to_cpu"):
            if hasattr(mod, name):
                setattr(mod, name, noop)

    save_to_cpu = fsdp_utils.fsdp2_sharded_save_to_cpu

    def fsdp2_sharded_save_to_cpu(model):
        state, spec = save_to_cpu(model)
        return {name: (t.clone(), s) for name, (t, s) in state.items()}, spec

    fsdp_utils.fsdp2_sharded_save_to_cpu = fsdp2_sharded_save_to_cpu

    import torch.distributed.fsdp._init_utils as init_utils

    init_utils._check_module_states_for_sync_module_states = noop

    _register_recording_rollout()
    _register_recording_checkpoint_engine()
    _INSTALLED = True


RECEIVED: list = []  # one dict {name: tensor} per update_weights call
SENT_BY_CHECKPOINT_ENGINE: list = []  # one dict per checkpoint-engine send_weights call


def _register_recording_checkpoint_engine() -> None:
    """A checkpoint-engine backend (``faircast_record``) that records what the actor sends, the way the
    ``nccl``/``nixl``/``hccl`` backends receive it (``update_weights`` with a non-naive mode)."""
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    @CheckpointEngineRegistry.register("faircast_record")
    class RecordingCheckpointEngine(CheckpointEngine):
        def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs):
            self.bucket_size, self.is_master = bucket_size, is_master

        def prepare(self):
            return {}

        @classmethod
        def build_topology(cls, *args, **kwargs):
            return {}, {}

        def init_process_group(self, **kwargs):
            pass

        def finalize(self):
            pass

        async def send_weights(self, weights, **kwargs):
            SENT_BY_CHECKPOINT_ENGINE.append({name: t.detach().clone() for name, t in weights})
            return {}

        async def receive_weights(self, **kwargs):  # pragma: no cover - the rollout side is not run here
            raise NotImplementedError

        async def get_weights(self):  # pragma: no cover
            raise NotImplementedError


def _register_recording_rollout() -> None:
    from verl.workers.rollout import base as rollout_base

    rollout_base._ROLLOUT_REGISTRY[("faircast_record", "async")] = f"{__name__}.RecordingRollout"


def __getattr__(name):
    # RecordingRollout subclasses verl's BaseRollout; built on first use so importing this module stays light.
    if name != "RecordingRollout":
        raise AttributeError(name)
    from verl.workers.rollout.base import BaseRollout

    class RecordingRollout(BaseRollout):
        """A rollout that records the tensors verl's ``update_weights`` sends it, exactly as sent."""

        def __init__(self, config, model_config, device_mesh):
            self.config, self.model_config, self.device_mesh = config, model_config, device_mesh

        async def resume(self, tags):
            pass

        async def release(self):
            pass

        async def update_weights(self, weights, **kwargs):
            RECEIVED.append({name: t.detach().clone() for name, t in weights})

        def generate_sequences(self, prompts):  # pragma: no cover - not used by these tests
            raise NotImplementedError

    globals()["RecordingRollout"] = RecordingRollout
    return RecordingRollout
