"""Stand-ins that let megatron-core 0.16.1, 0.18.2 and 0.19.2 train on CPU over gloo (test-only; see
/work/shared/notes/megatron.md §9 and verl-megatron-cpu.md).

Each replaces one CUDA-only call megatron-core makes on the way; nothing here touches Fair Cast. Install them with
:func:`install` before building a model.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor", torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor",
}
_ORIGINAL_TYPE = torch.Tensor.type


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """Factory calls and ``.to()`` / ``.cuda()`` aimed at a CUDA device land on the CPU (``optimizer.py`` _scale_one,
    ``clip_grads.py``); pinned host memory is plain host memory (verl's ``offload_megatron_model_to_cpu``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _cpu(args[1])) + tuple(args[2:]) if not isinstance(args[1], torch.dtype) else args
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):  # pinned host buffers (verl's offload) need an accelerator: plain CPU memory
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _type(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` answers ``torch.cuda.*Tensor`` names (``distrib_optimizer.py``, ``optimizer.py`` compare them)."""
    if dtype is None and not kwargs:
        return _CUDA_TYPES.get(self.dtype, _ORIGINAL_TYPE(self))
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


class OneStream:
    """Every CUDA stream is the CPU's one stream: megatron-core 0.19's gradient sync orders its reduce on
    ``torch.cuda.current_stream()`` (``param_and_grad_buffer.py`` start_grad_sync), megatron.training's ``_ddp_wrap``
    (through megatron-bridge) builds DDP on a side stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return OneEvent()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class OneEvent:
    """A CUDA event on the CPU's one stream: always complete (megatron-core 0.18+'s MoE token dispatcher synchronizes
    on the event of its device-to-host copies, ``token_dispatcher.py`` _maybe_dtoh_and_synchronize)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_mode = None
_saved: list = []  # (owner, attr, value before install) for uninstall


def _set(owner, attr, value) -> None:
    _saved.append((owner, attr, getattr(owner, attr, _MISSING)))
    setattr(owner, attr, value)


_MISSING = object()


def install() -> None:
    global _mode
    if _mode is not None:
        return
    _set(torch.cuda, "current_device", lambda: torch.device("cpu"))  # param_and_grad_buffer.py allocates on it
    _set(torch.cuda, "synchronize", lambda *a, **k: None)  # p2p_communication.py (pipeline parallel)
    _set(torch.cuda, "empty_cache", lambda *a, **k: None)
    _set(torch.cuda, "manual_seed", lambda *a, **k: None)
    _set(torch.cuda, "manual_seed_all", lambda *a, **k: None)  # aliasing torch.manual_seed would recurse
    _set(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(torch.Tensor, "type", _type)
    _set(torch.cuda, "Stream", OneStream)
    _set(torch.cuda, "Event", OneEvent)
    _set(torch.cuda, "current_stream", lambda *a, **k: OneStream())
    _set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    from megatron.core.tensor_parallel import random as mrandom

    _set(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))  # the RNG tracker on the CPU
    _set(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state().clone())
    try:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            _set(moe_utils, "te_general_gemm", None)  # NameError at moe_utils.py:1192 without TransformerEngine
    except ImportError:
        pass
    _mode = CudaToCpu()
    _mode.__enter__()


def uninstall() -> None:
    """Undo :func:`install` (for a test that ran Megatron in the pytest process itself)."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    while _saved:
        owner, attr, value = _saved.pop()
        if value is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, value)
