"""What verl's fp8 vLLM engine makes of an export, through verl's own ``quant_weights`` (test shim: no vLLM engine).

verl's ``load_quanted_weights`` (``verl/utils/vllm/vllm_quant_utils.py``) hands the received ``(name, tensor)``
stream to ``quant_weights(weights, model, quant_config, dtype=bf16)``, which asks the vLLM model which names are
fp8 linear weights (``is_fp8_weight``: the module, after vLLM's ``packed_modules_mapping`` rename, is a
``LinearBase`` whose weight is ``float8_e4m3fn``) and quantizes those with ``scaled_fp8_blockwise``. A vLLM fp8
engine does not run on CPU here, so :func:`stub_vllm_model` builds the part of the model ``quant_weights`` reads:
the module tree of the exported names, with a real ``vllm`` ``LinearBase`` subclass holding an fp8 weight at each
linear layer of a Qwen2/Llama-style model (vLLM's fused ``qkv_proj`` / ``gate_up_proj``), and plain modules
elsewhere (vLLM's embedding, LM head and norms are not ``LinearBase``). Everything verl runs is verl's code.
"""
from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import torch

os.environ.setdefault("VERL_DISABLE_TRITON_FP8", "1")  # verl's PyTorch path (no Triton on CPU)

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = [128, 128]  # verl's FP8_BLOCK_QUANT_KWARGS["weight_block_size"]


def _fp8_linear_cls():
    from vllm.model_executor.layers.linear import LinearBase

    class Fp8Linear(LinearBase):
        """A vLLM linear layer after verl's fp8 load: only its class and weight dtype are read."""

        def __init__(self):  # noqa: D401 - LinearBase's own __init__ needs a vLLM parallel context
            torch.nn.Module.__init__(self)
            self.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.float8_e4m3fn), requires_grad=False)

    return Fp8Linear


def stub_vllm_model(names) -> torch.nn.Module:
    fp8_linear = _fp8_linear_cls()
    root = torch.nn.Module()
    root.packed_modules_mapping = PACKED
    fused = {orig: f for f, origs in PACKED.items() for orig in origs}
    for name in names:
        node = root
        parts = name.split(".")[:-1]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if last and part in LINEAR:
                part = fused.get(part, part)
            child = getattr(node, part, None) if part in node._modules else None
            if child is None:
                child = fp8_linear() if last and part in (*LINEAR, *PACKED) else torch.nn.Module()
                node.add_module(part, child)
            node = child
    return root


@contextlib.contextmanager
def _one_rank():
    """``quant_weights`` calls ``torch.distributed.get_rank()``: a one-rank gloo group in the test process."""
    dist = torch.distributed
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def engine_receives(exported: dict) -> dict:
    """``{name: tensor}`` the fp8 engine loads for the exported ``{name: tensor}``: fp8 weights with their
    ``<name>_scale_inv`` block descales for the linear weights, everything else as sent."""
    from verl.utils.kernel import fp8_kernel
    from verl.utils.vllm.vllm_quant_utils import quant_weights

    assert not (fp8_kernel.is_triton_available() and not fp8_kernel._DISABLE_TRITON_FP8), "expected verl's torch path"
    model = stub_vllm_model(exported)
    with _one_rank():
        return dict(quant_weights(list(exported.items()), model, SimpleNamespace(weight_block_size=BLOCK),
                                  dtype=torch.bfloat16))


def verl_quantize(x: torch.Tensor):
    """verl's ``scaled_fp8_blockwise`` of ``x.to(bf16)``, the descale squeezed as ``quant_weights`` sends it."""
    from verl.utils.kernel.fp8_kernel import scaled_fp8_blockwise

    q, s = scaled_fp8_blockwise(x.to(torch.bfloat16), weight_block_size=BLOCK)
    return q, s.squeeze(-1)
