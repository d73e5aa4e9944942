"""``rollout.quantization: fp8`` with Fair Cast: verl's fp8 engine receives verl's quantization of the Fair Cast copy.

verl's real worker (CPU/gloo, world sizes 1-3, ``rollout.quantization=fp8``) exports; verl's own ``quant_weights``
-> ``scaled_fp8_blockwise`` (PyTorch path) turns that export into what the fp8 vLLM engine loads
(tests/verl/fp8_receive.py). The fp8 bytes and descales must equal verl's quantization of the Fair Cast copy
(computed here from the recorded fp32 masters), bit for bit; control: with the flag off they are verl's
quantization of round-to-nearest, and the two differ. Also: this package's emulation (``faircast_plugins.fp8``)
equals verl's quantizer on several shapes, and the delta shards stay the served bf16 copy under fp8.
"""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import FairCastConfig, derive_key, fair_cast, sticky_key
from faircast_plugins.fp8 import dequantize_blockwise, quantize_blockwise, served_fp8

from . import fp8_receive
from .conftest import EF, EMA, ON, SEED, STICKY, run_ranks
from .test_worker_stateful import reference

FP8 = "actor_rollout_ref.rollout.quantization=fp8"
CASES = {
    1: [dict(name="fsdp2_fp8", strategy="fsdp2", overrides=[ON, FP8]),
        dict(name="fsdp2_fp8_off", strategy="fsdp2", overrides=[FP8]),
        dict(name="fsdp_fp8_ef", strategy="fsdp", overrides=[EF, FP8])],
    2: [dict(name="fsdp_fp8", strategy="fsdp", overrides=[ON, FP8]),
        dict(name="fsdp2_fp8_sticky", strategy="fsdp2", overrides=[STICKY, FP8], delta=True)],
    3: [dict(name="fsdp2_fp8_ema", strategy="fsdp2", overrides=[EMA, FP8]),
        dict(name="fsdp_fp8_off", strategy="fsdp", overrides=[FP8])],
}
_RUNS: dict = {}


@pytest.fixture(scope="session")
def fp8_runs(tmp_path_factory, model_dir):
    def get(world):
        if world not in _RUNS:
            out = tmp_path_factory.mktemp(f"fp8_world{world}")
            _RUNS[world] = run_ranks(out, model_dir=model_dir, world=world, cases=CASES[world])
        return _RUNS[world]

    return get


def u8(t):
    assert t.dtype == torch.float8_e4m3fn, t.dtype
    return t.view(torch.uint8)


def _served_bf16(r0, case):
    """The bf16 copy the flag defines at version 2 (round-to-nearest with the flag off)."""
    if case.endswith("_off"):
        return {n: m.to(torch.bfloat16) for n, m in r0["masters"].items()}
    if case.endswith(("_ef", "_ema")):
        mode = dict(mode="error_feedback") if case.endswith("_ef") else dict(ema_decay=0.5)
        return reference(r0, FairCastConfig(enabled=True, seed=SEED, **mode))[2]
    if case.endswith("_sticky"):
        return {n: fair_cast(m, key=sticky_key(SEED, n), mode="sticky") for n, m in r0["masters"].items()}
    return {n: fair_cast(m, key=derive_key(SEED, 2, n)) for n, m in r0["masters"].items()}


SHAPES = [(64, 64), (128, 128), (200, 300), (256, 129), (1, 5), (384, 256), (130, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_emulation_is_verls_quantizer_bit_for_bit(shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(*shape, generator=g) * 0.02
    x[0, 0] = 0.0
    if shape == (130, 7):
        x[:128] = 0.0  # an all-zero block: descale 1
    for src in (x, x.to(torch.bfloat16)):
        q, s = fp8_receive.verl_quantize(src)
        mq, ms = quantize_blockwise(src)
        assert torch.equal(u8(q), u8(mq)) and torch.equal(s.view(torch.int32), ms.view(torch.int32))
    deq = served_fp8(x)
    assert torch.equal(deq, dequantize_blockwise(q, s)) and deq.dtype == torch.float32


def test_pow2_emulation_uses_power_of_two_descales_without_clipping():
    x = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)) * 0.02
    q, s = quantize_blockwise(x, scales="pow2")
    assert torch.equal(torch.exp2(torch.log2(s)), s) and bool((torch.log2(s).frac() == 0).all())
    assert float(q.to(torch.float32).abs().max()) <= 448.0
    verl_s = quantize_blockwise(x)[1]
    assert bool((s >= verl_s).all()) and bool((s < 2 * verl_s).all())


@pytest.mark.parametrize("world, case", [(w, c["name"]) for w, cs in CASES.items() for c in cs],
                         ids=[f"{c['name']}-world{w}" for w, cs in CASES.items() for c in cs])
def test_fp8_engine_receives_verls_quantization_of_the_served_copy(fp8_runs, world, case):
    results = fp8_runs(world)[case]
    r0 = results[0]
    assert r0["version"] == (None if case.endswith("_off") else 2)
    served = _served_bf16(r0, case)
    quantized = 0
    for r in results:  # every rank's colocated engine receives the full export
        received = fp8_receive.engine_receives(r["exported"])
        for name, q in served.items():
            got = received[name]
            if got.dtype != torch.float8_e4m3fn:  # embeddings, LM head, norms, biases: loaded as sent
                assert name + "_scale_inv" not in received
                assert torch.equal(got.to(torch.bfloat16).view(torch.int16), q.view(torch.int16)), name
                continue
            quantized += 1
            want_q, want_s = fp8_receive.verl_quantize(q)
            assert torch.equal(u8(got), u8(want_q)), f"rank {r['rank']}: fp8 bytes of {name}"
            assert torch.equal(received[name + "_scale_inv"].view(torch.int32), want_s.view(torch.int32)), name
            emu_q, emu_s = quantize_blockwise(q)  # the package's emulation: the same bytes
            assert torch.equal(u8(got), u8(emu_q)) and torch.equal(received[name + "_scale_inv"], emu_s), name
    assert quantized == 14 * len(results), quantized  # 2 layers x 7 linear weights, on every rank
    if not case.endswith("_off"):  # control: verl's quantization of round-to-nearest is another fp8 copy
        rtn = fp8_receive.engine_receives({n: m for n, m in r0["masters"].items()})
        diff = sum(int((u8(rtn[n]) != u8(v)).sum()) for n, v in fp8_receive.engine_receives(r0["exported"]).items()
                   if v.dtype == torch.float8_e4m3fn)
        assert diff > 0, "Fair Cast's fp8 copy equals round-to-nearest's: the check is vacuous"
    if r0.get("delta_shards"):  # delta syncs: the shards are the served bf16 copy, as without fp8
        for name, q in served.items():
            full = torch.zeros(q.numel(), dtype=torch.int16)
            for r in results:
                idx, local = r["delta_shards"][name]
                full[idx] = local.view(torch.int16)
            assert torch.equal(full.view(q.shape), q.view(torch.int16)), name
