"""Stand-ins that let megatron-core 0.16.1 train on CPU over gloo (test-only; see /work/shared/notes/megatron.md §9).

Each replaces one CUDA-only call megatron-core makes on the way; nothing here touches Fair Cast. Install them with
:func:`install` before building a model.
"""
from __future__ import annotations

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
    ``clip_grads.py``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _cpu(args[1])) + tuple(args[2:]) if not isinstance(args[1], torch.dtype) else args
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _type(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` answers ``torch.cuda.*Tensor`` names (``distrib_optimizer.py``, ``optimizer.py`` compare them)."""
    if dtype is None and not kwargs:
        return _CUDA_TYPES.get(self.dtype, _ORIGINAL_TYPE(self))
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


_mode = None


def install() -> None:
    global _mode
    torch.cuda.current_device = lambda: torch.device("cpu")  # param_and_grad_buffer.py allocates on it
    torch.cuda.synchronize = lambda *a, **k: None  # p2p_communication.py (pipeline parallel)
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.manual_seed_all = lambda *a, **k: None  # aliasing torch.manual_seed would recurse
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.Tensor.type = _type
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # the RNG tracker on the CPU
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state().clone()
    try:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None  # NameError at moe_utils.py:1192 without TransformerEngine
    except ImportError:
        pass
    if _mode is None:
        _mode = CudaToCpu()
        _mode.__enter__()
