"""``faircast.fp8_loss`` (with ``rollout.quantization: fp8``): the actor's forward computes its quantized linear
layers with the dequantized fp8 copy, straight-through gradient to the fp32 master.

Through verl's real worker (FSDP2 at 1 rank, FSDP1 at 2): the weight every such layer computed with, at versions 0
and 2, equals ``dequantize(verl's scaled_fp8_blockwise(fair_cast(master)))`` bit for bit, and equals the dequantized
fp8 copy verl's ``quant_weights`` makes of the export (what the fp8 engine loads); the masters still train.
Control: without the option no layer computes with an fp8 copy (the forward reads the bf16 copy). The fp8 engine's
own kernels (fp8 GEMM, dynamic activation quantization) are not run on CPU: that side is unverified.
"""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import derive_key, fair_cast
from faircast_plugins.fp8 import dequantize_blockwise, served_fp8
from faircast_plugins.verl import fp8 as fc_fp8

from . import fp8_receive
from .conftest import ON, SEED, run_ranks
from .test_fp8_rollout import FP8

FP8_LOSS = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},fp8_loss:true}}"
CASES = {1: [dict(name="fsdp2_fp8_loss", strategy="fsdp2", overrides=[FP8_LOSS, FP8], record_fp8_weights=True),
             dict(name="fsdp2_fp8_no_loss", strategy="fsdp2", overrides=[ON, FP8], record_fp8_weights=True)],
         2: [dict(name="fsdp_fp8_loss", strategy="fsdp", overrides=[FP8_LOSS, FP8], record_fp8_weights=True)]}
_RUNS: dict = {}


@pytest.fixture(scope="session")
def fp8_loss_runs(tmp_path_factory, model_dir):
    def get(world):
        if world not in _RUNS:
            _RUNS[world] = run_ranks(tmp_path_factory.mktemp(f"fp8_loss_world{world}"), model_dir=model_dir,
                                     world=world, cases=CASES[world])
        return _RUNS[world]

    return get


def test_straight_through_linear():
    """One linear layer, no FSDP: the output is the fp32 linear on the dequantized fp8 weight, under bf16 autocast
    too, and the weight's gradient is the gradient with respect to that fp8 copy (straight through)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(136, 200).to(torch.bfloat16)
    model = torch.nn.Sequential()
    model.add_module("q_proj", lin)
    assert fc_fp8.enable_fp8_loss(model) == 1
    x = torch.randn(3, 136, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    w8 = served_fp8(lin.weight.detach()).requires_grad_(True)
    ref = torch.nn.functional.linear(x.float(), w8, lin.bias.detach().float()).to(torch.bfloat16)
    assert torch.equal(y, ref)
    y.float().sum().backward()
    ref.float().sum().backward()
    assert torch.equal(lin.weight.grad, w8.grad.to(torch.bfloat16))


@pytest.mark.parametrize("world, case", [(1, "fsdp2_fp8_loss"), (2, "fsdp_fp8_loss")])
def test_forward_computes_with_verls_fp8_copy(fp8_loss_runs, world, case):
    results = fp8_loss_runs(world)[case]
    r0 = results[0]
    assert r0["version"] == 2
    engine = fp8_receive.engine_receives(r0["exported"])
    linear = [n for n, t in engine.items() if t.dtype == torch.float8_e4m3fn]
    assert len(linear) == 14
    for r in results:
        for key, version, masters in (("forward_fp8_v0", 0, r0["masters_v0"]), ("forward_fp8", 2, r0["masters"])):
            seen = r[key]
            assert set(seen) == set(linear), sorted(set(seen) ^ set(linear))
            for name in linear:
                served = fair_cast(masters[name], key=derive_key(SEED, version, name))
                want = dequantize_blockwise(*fp8_receive.verl_quantize(served))
                assert seen[name].dtype == torch.float32
                assert torch.equal(seen[name].view(torch.int32), want.view(torch.int32)), (r["rank"], key, name)
        for name in linear:  # what the fp8 engine loads from the export: the same weights
            loaded = dequantize_blockwise(engine[name], engine[name + "_scale_inv"])
            assert torch.equal(r["forward_fp8"][name], loaded), name
    moved = sum(int((r0["masters"][n] != r0["masters_v0"][n]).sum()) for n in linear)
    assert moved > 0, "the masters did not train through the straight-through gradient"


def test_without_the_option_no_layer_computes_with_fp8(fp8_loss_runs):
    r0 = fp8_loss_runs(1)["fsdp2_fp8_no_loss"][0]
    assert r0["forward_fp8"] == {} and r0["forward_fp8_v0"] == {}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert r0["forward"][name].dtype == torch.bfloat16  # the bf16 Fair Cast copy, as without fp8
    assert torch.equal(r0["forward"][name], fair_cast(r0["masters"][name], key=derive_key(SEED, 2, name)))
