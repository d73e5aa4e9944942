"""The fp8 paths of the verl adapter, on the CPU: what ``fp8_loss`` keeps for the backward (issue 29, finding 2) and
which of verl's two fp8 quantizers Fair Cast follows (finding 3)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from faircast_plugins.fp8 import quantize_blockwise, served_fp8
from faircast_plugins.verl import fp8 as fc_fp8


def _fake_verl_fp8_kernel(monkeypatch, *, triton: bool, disabled: bool) -> list:
    """Stand in for verl's ``fp8_kernel`` module (its path flags, and a quantizer by the path's formula that
    records its calls)."""
    calls = []
    mod = types.ModuleType("verl.utils.kernel.fp8_kernel")
    mod._TRITON_AVAILABLE, mod._DISABLE_TRITON_FP8 = triton, disabled

    def scaled_fp8_blockwise(data_hp, weight_block_size):
        calls.append((tuple(data_hp.shape), data_hp.dtype, tuple(weight_block_size)))
        scales = "verl-triton" if triton and not disabled else "verl"
        q, d = quantize_blockwise(data_hp, scales=scales)
        return q, (d if scales == "verl-triton" else d.unsqueeze(-1))  # verl's PyTorch path: (br, bc, 1)

    mod.scaled_fp8_blockwise = scaled_fp8_blockwise
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.utils.kernel.fp8_kernel", mod)
    return calls


@pytest.fixture
def verl_pytorch_quantizer(monkeypatch):
    """verl's fp8 kernel module as on a machine without triton (its PyTorch quantizer, which served_fp8 repeats)."""
    return _fake_verl_fp8_kernel(monkeypatch, triton=False, disabled=False)


def _layers(dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(136, 200, dtype=dtype))
    model.add_module("act", torch.nn.GELU())
    model.add_module("o_proj", torch.nn.Linear(200, 136, bias=False, dtype=dtype))
    return model


def _saved_weight_copies(model: torch.nn.Module, x: torch.Tensor) -> list:
    """The tensors autograd saves for the backward that are shaped like a linear weight but are not the parameter
    itself (a dequantized copy: FSDP cannot reshard it, so it lives, unsharded, until the backward)."""
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")}
    params = {p.data_ptr() for p in model.parameters()}
    copies = []

    def pack(t):
        if tuple(t.shape) in shapes and t.data_ptr() not in params:
            copies.append((tuple(t.shape), t.dtype))
        return t

    x = x.detach().requires_grad_(True)  # as hidden states are: every layer's input needs its gradient
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().sum().backward()
    return copies


def test_fp8_loss_keeps_no_dequantized_weight_for_the_backward(verl_pytorch_quantizer):
    """Without activation checkpointing, each fp8_loss layer used to keep its full fp32 dequantized weight until the
    backward (4 B/param, unsharded: ~26 GB per rank at 7B). The backward now dequantizes again from the weight."""
    model = _layers()
    assert fc_fp8.enable_fp8_loss(model) == 2
    assert _saved_weight_copies(model, torch.randn(3, 136, dtype=torch.bfloat16)) == []


def test_negative_control_a_plain_fp32_linear_on_a_copy_is_seen():
    """The counter sees a saved weight copy when there is one (an fp32 linear on a dequantized copy, the old way)."""
    model = _layers()
    for sub in (model.q_proj, model.o_proj):
        sub.forward = (lambda m: lambda x: torch.nn.functional.linear(
            x.float(), served_fp8(m.weight.detach()).requires_grad_(True)).to(x.dtype))(sub)
    assert len(_saved_weight_copies(model, torch.randn(3, 136, dtype=torch.bfloat16))) == 2


def test_fp8_loss_gradients_are_straight_through(verl_pytorch_quantizer):
    """Output and gradients of the layer equal the fp32 linear on the dequantized fp8 weight, bit for bit, with the
    weight's gradient passed straight through (in the weight's dtype), the input's and the bias' as autograd's."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(136, 200).to(torch.bfloat16)
    model = torch.nn.Sequential()
    model.add_module("q_proj", lin)
    assert fc_fp8.enable_fp8_loss(model) == 1
    x = torch.randn(2, 3, 136, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    g = torch.randn_like(y)
    y.backward(g)
    x2 = x.detach().clone().requires_grad_(True)
    w8 = served_fp8(lin.weight.detach()).requires_grad_(True)
    b = lin.bias.detach().float().requires_grad_(True)
    ref = torch.nn.functional.linear(x2.float(), w8, b).to(torch.bfloat16)
    ref.backward(g)
    assert torch.equal(y, ref)
    assert torch.equal(lin.weight.grad, w8.grad.to(torch.bfloat16))
    assert torch.equal(lin.bias.grad, b.grad.to(torch.bfloat16))
    assert torch.equal(x.grad, x2.grad)


# -- finding 3: verl has two fp8 quantizers; Fair Cast's fp8 copy must be the one verl's rollout takes -------------

def _positive_normal_bf16() -> torch.Tensor:
    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32).to(torch.int16)  # every positive normal finite bf16
    return bits.view(torch.bfloat16).to(torch.float32)


def test_the_two_descale_formulas_differ_in_a_third_of_amax_values():
    """verl's PyTorch quantizer: descale = 1 / (448 / amax); its Triton kernel: descale = max(amax, 1e-10) / 448.
    Over the 20644 positive normal bf16 amax values at or above that floor they differ in 6446 (31.2%; correctly
    rounded division), by one ulp; below it the Triton descale is the floor's."""
    from faircast_plugins.fp8 import TRITON_EPS, descale_pytorch, descale_triton

    amax = _positive_normal_bf16()
    a, b = descale_pytorch(amax), descale_triton(amax)
    above = amax >= TRITON_EPS
    assert int(above.sum()) == 20644 and int((a != b)[above].sum()) == 6446
    assert int((a.view(torch.int32) - b.view(torch.int32)).abs()[above].max()) == 1
    assert torch.equal(b[above], (amax[above].double() / 448).float())  # correctly rounded amax / 448
    assert torch.equal(b[~above], torch.full_like(b[~above], TRITON_EPS).div(448))
    zero = torch.zeros(1)
    assert descale_pytorch(zero).item() == 1.0 and descale_triton(zero).item() == b[0].item()


def _weight_where_the_formulas_differ() -> torch.Tensor:
    from faircast_plugins.fp8 import descale_pytorch, descale_triton

    amax = _positive_normal_bf16()
    amax = amax[(descale_pytorch(amax) != descale_triton(amax)) & (amax > 0.01) & (amax < 1)][:64]
    torch.manual_seed(2)
    w = (torch.rand(256, 256 * 64) * 2 - 1).to(torch.bfloat16)
    blocks = w.view(256, 64, 256).float()
    blocks = blocks / blocks.abs().amax(dim=(0, 2), keepdim=True) * amax.view(1, 64, 1)
    return blocks.reshape(256, -1).to(torch.bfloat16).t().contiguous()


def test_fp8_copy_follows_verls_triton_quantizer_when_verl_takes_it(monkeypatch):
    """verl's rollout takes its Triton quantizer wherever triton imports (every GPU machine) unless
    VERL_DISABLE_TRITON_FP8=1: the fp8 copy fp8_loss and the fp8 audit use must then be that quantizer's."""
    from faircast_plugins.fp8 import dequantize_blockwise

    calls = _fake_verl_fp8_kernel(monkeypatch, triton=True, disabled=False)
    w = _weight_where_the_formulas_differ()
    got = fc_fp8.compute_weight("model.layers.0.self_attn.q_proj.weight", w)
    want = dequantize_blockwise(*quantize_blockwise(w, scales="verl-triton"))
    assert calls and calls[0][1:] == (torch.bfloat16, (128, 128))
    assert torch.equal(got, want)
    assert not torch.equal(got, served_fp8(w))  # negative control: the PyTorch formula's copy differs here


def test_fp8_copy_follows_verls_pytorch_quantizer_when_triton_is_disabled(monkeypatch):
    from faircast_plugins.fp8 import quantize_blockwise, served_fp8

    _fake_verl_fp8_kernel(monkeypatch, triton=True, disabled=True)
    w = _weight_where_the_formulas_differ()
    assert torch.equal(fc_fp8.compute_weight("model.layers.0.mlp.up_proj.weight", w), served_fp8(w))
    assert fc_fp8.verl_fp8_path() == "pytorch"
    _fake_verl_fp8_kernel(monkeypatch, triton=True, disabled=False)
    assert fc_fp8.verl_fp8_path() == "triton"
