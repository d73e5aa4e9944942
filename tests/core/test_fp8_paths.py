"""The fp8 paths of the verl adapter, on the CPU: what ``fp8_loss`` keeps for the backward (issue 29, finding 2) and
which of verl's two fp8 quantizers Fair Cast follows (finding 3)."""
from __future__ import annotations

import torch

from faircast_plugins.fp8 import served_fp8
from faircast_plugins.verl import fp8 as fc_fp8


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


def test_fp8_loss_keeps_no_dequantized_weight_for_the_backward():
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


def test_fp8_loss_gradients_are_straight_through():
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
