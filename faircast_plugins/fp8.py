"""The fp8 stage after the served bf16 copy: an emulation of verl's blockwise e4m3 quantizer, and its inverse.

verl 0.9.1 quantizes each weight its fp8 vLLM engine receives with ``scaled_fp8_blockwise`` (from
``quant_weights``, ``verl/utils/vllm/vllm_quant_utils.py``): ``x.to(bf16)``, 128x128 blocks (the last ones
zero-padded), per block ``scale = 448 / amax`` (1 for an all-zero or infinite block), ``descale = 1 / scale``,
``clamp(x * scale, -448, 448)`` cast to ``float8_e4m3fn`` (round to nearest even). :func:`quantize_blockwise`
repeats those operations, in that order, so its bytes and descales are verl's PyTorch path's bit for bit
(``tests/verl/test_fp8_rollout.py`` checks it against verl's own function on several shapes).

verl's rollout takes its Triton kernel instead wherever triton imports (every GPU machine) unless
``VERL_DISABLE_TRITON_FP8=1``. That kernel computes ``descale = max(amax, 1e-10) / 448`` and ``scale = 1 /
descale`` (:func:`descale_triton`, ``scales="verl-triton"``), whose descale differs from the PyTorch path's
(:func:`descale_pytorch`) by one ulp in 6446 of the 20644 positive normal bf16 amax values at or above the
kernel's 1e-10 floor (31.2%, both computed by torch on the CPU; below the floor they differ by more). ``scales="verl-triton"`` emulates it with
correctly rounded division; Triton's fp32 ``/`` on NVIDIA GPUs is ``div.full.f32`` (not correctly rounded), so the
emulation is exact only where that division is: the verl adapter does not rely on it and calls verl's own
quantizer (``faircast_plugins/verl/fp8.py``); benchmarks/gpu/real_sizes.py compares the two on a GPU.

``scales="pow2"`` is NOT verl's quantizer: it is this package's emulation of a power-of-two (E8M0 / UE8M0-style)
block descale, ``descale = 2 ** ceil(log2(amax / 448))`` (so nothing clips), labelled as such wherever it is
reported (``benchmarks/fp8_lag.py``). With a power-of-two descale the fp8 grid of a block is a subset of the
bf16 grid, which the measurement in docs/verl.md examines.

What an fp8 engine computes with is :func:`dequantize_blockwise` of those bytes (``fp8 * descale``, in fp32),
:func:`served_fp8` in one call.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = 128  # verl's weight_block_size [128, 128] (vllm_async_server.FP8_BLOCK_QUANT_KWARGS)
SCALES = ("verl", "verl-triton", "pow2")
TRITON_EPS = 1e-10  # the floor verl's Triton kernel puts under a block's amax


def _blocks(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, int, int]:
    rows, cols = x.shape
    pad_r, pad_c = (-rows) % block, (-cols) % block
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r), mode="constant", value=0)
    br, bc = x.shape[0] // block, x.shape[1] // block
    return x.reshape(br, block, bc, block).permute(0, 2, 1, 3).contiguous().to(torch.float32).flatten(2), br, bc


def _check_scales(scales: str) -> None:
    if scales not in SCALES:
        raise ValueError(f"fp8 scales must be one of {', '.join(SCALES)}, got {scales!r}")


def _pytorch_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = torch.div(FP8_MAX, amax)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(amax == torch.inf, torch.ones_like(scale), scale)


def descale_pytorch(amax: torch.Tensor) -> torch.Tensor:
    """verl's PyTorch quantizer's block descale of fp32 ``amax``: ``1 / (448 / amax)``, 1 for 0 or inf (its
    quantization scale is ``448 / amax``)."""
    return torch.reciprocal(_pytorch_scale(amax))


def descale_triton(amax: torch.Tensor) -> torch.Tensor:
    """verl's Triton quantizer's block descale of fp32 ``amax``: ``max(amax, 1e-10) / 448``, correctly rounded
    (its quantization scale is ``1 / descale``). On a GPU Triton divides with ``div.full.f32``: compare there."""
    return torch.div(torch.clamp_min(amax, TRITON_EPS), FP8_MAX)


def quantize_blockwise(x: torch.Tensor, *, block: int = BLOCK,
                       scales: str = "verl") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 bytes of x's shape, descale of shape (ceil(rows/block), ceil(cols/block)))`` of a 2-D tensor, as verl
    quantizes ``x.to(bfloat16)`` (``scales="verl"``: its PyTorch path; ``"verl-triton"``: its Triton kernel's
    formula, correctly rounded) or with power-of-two descales (``"pow2"``, an emulation)."""
    _check_scales(scales)
    if x.dim() != 2:
        raise ValueError(f"blockwise fp8 quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    data, br, bc = _blocks(x.to(torch.bfloat16), block)
    amax = data.abs().amax(dim=-1, keepdim=True)
    if scales == "verl":
        scale = _pytorch_scale(amax)
        descale = torch.reciprocal(scale)
    elif scales == "verl-triton":
        descale = descale_triton(amax)
        scale = torch.reciprocal(descale)
    else:
        ok = (amax > 0) & torch.isfinite(amax)
        exponent = torch.ceil(torch.log2(torch.where(ok, amax, torch.ones_like(amax)) / FP8_MAX))
        # log2 in fp32 can land a hair off an exact power of two: step up if amax / 2**e still exceeds 448
        descale = torch.where(ok, torch.exp2(exponent), torch.ones_like(amax))
        descale = torch.where(amax / descale > FP8_MAX, descale * 2, descale)
        scale = torch.reciprocal(descale)  # exact: a power of two
    data = data.mul(scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    out = data.reshape(br, bc, block, block).permute(0, 2, 1, 3).reshape(br * block, bc * block)
    return out[:rows, :cols].contiguous(), descale.reshape(br, bc)


def dequantize_blockwise(q: torch.Tensor, descale: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """The fp32 weight an fp8 engine computes with: each element's fp8 value times its block's descale."""
    rows, cols = q.shape
    full = descale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.to(torch.float32) * full.to(torch.float32)


#: 2-D ``*.weight`` tensors an fp8 vLLM engine under verl does NOT quantize: vLLM's embeddings and LM head are not
#: ``LinearBase``, verl's fp8 config ignores the MoE routers (``model.layers.N.mlp.gate``), and LoRA adapters are
#: loaded apart from the base layers.
NOT_QUANTIZED = ("embed_tokens.", "lm_head.", "mlp.gate.weight", ".lora_")


def quantized_by_engine(name: str, tensor: torch.Tensor) -> bool:
    """Whether verl's fp8 vLLM engine quantizes this exported tensor: the 2-D ``*.weight`` of a linear layer (a
    Qwen2/Llama-style naming rule; biases, norms, embeddings, the LM head and packed 3-D experts stay bf16)."""
    return tensor.dim() == 2 and name.endswith(".weight") and not any(s in name for s in NOT_QUANTIZED)


def served_fp8(x: torch.Tensor, *, block: int = BLOCK, scales: str = "verl") -> torch.Tensor:
    """``dequantize(quantize(x))``: the fp8 engine's weight for a 2-D ``x``; 3-D (packed experts) per leading
    index, as verl quantizes each expert's 2-D weight."""
    if x.dim() == 3:
        return torch.stack([served_fp8(e, block=block, scales=scales) for e in x])
    return dequantize_blockwise(*quantize_blockwise(x, block=block, scales=scales), block=block)
