"""With ``rollout.quantization: fp8`` the audit measures the dequantized fp8 copy verl's engine computes with.

The engine's export hook (``engine.cast_export``) on a Fair Cast state with the fp8 audit attached
(``verl/fp8.py::attach``), over 12 weight versions of small Adam-like steps from a bf16 checkpoint: its metrics
equal, exactly, an audit run by hand on (master, dequantize(verl's ``scaled_fp8_blockwise`` of the served bf16
copy)); FSDP's shard casts no longer observe. Control: the bf16 audit (fp8 off) gives other numbers; with the flag
off (``enable: false, audit: true``) the fp8 audit reports verl's fp8-of-round-to-nearest lag.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from faircast_plugins import FairCaster, FairCastConfig, derive_key, fair_cast
from faircast_plugins.audit import Audit
from faircast_plugins.fp8 import dequantize_blockwise, quantized_by_engine
from faircast_plugins.verl import engine as fc_engine
from faircast_plugins.verl import fp8 as fc_fp8

from . import fp8_receive
from .conftest import SEED, run_ranks
from .test_fp8_rollout import FP8

NAMES = ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight")  # quantized, and not
FP8_CFG = SimpleNamespace(rollout={"quantization": "fp8"})


def _masters(versions=12):
    g = torch.Generator().manual_seed(0)
    start = {NAMES[0]: (torch.randn(200, 136, generator=g) * 0.02).to(torch.bfloat16).float(),
             NAMES[1]: (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16).float()}
    drift = {n: torch.sign(torch.randn(x.shape, generator=g)) * 1e-5 for n, x in start.items()}
    return [{n: x + v * drift[n] for n, x in start.items()} for v in range(versions)]


def _state(config, fp8: bool):
    caster = FairCaster(config)
    state = fc_engine.EngineFairCast(caster, {n: n for n in NAMES}, canonical=set(NAMES), audit=caster.audit)
    assert fc_fp8.attach(state, FP8_CFG if fp8 else SimpleNamespace(rollout={})) == fp8
    return state


def _run(config, fp8: bool):
    state = _state(config, fp8)
    out = []
    for version, masters in enumerate(_masters()):
        if version:
            state.caster.advance()
        if not fp8:  # without fp8 the audit observes FSDP's casts (here: one full-tensor cast per parameter)
            for n, x in masters.items():
                state.caster.cast(n, x)
        exported = dict(fc_engine.cast_export(state, list(masters.items())))
        out.append(fc_engine.metrics(state))
    return out, exported


def _by_hand(config):
    """The audit on (master, what the fp8 engine computes with), through verl's own quantizer."""
    audit, mode = Audit(config.audit_sample), config.effective_mode
    out = []
    for version, masters in enumerate(_masters()):
        for n, x in masters.items():
            q = fair_cast(x, key=derive_key(config.seed, version, n), mode=mode)
            engine = dequantize_blockwise(*fp8_receive.verl_quantize(q)) if n == NAMES[0] else q
            audit.observe(n, version, x, engine)
        out.append({"faircast/version": float(version), **audit.metrics()})
    return out


@pytest.mark.parametrize("enabled", [True, False], ids=["faircast", "flag_off"])
def test_fp8_audit_measures_the_engines_fp8_copy(enabled):
    config = FairCastConfig(enabled=enabled, seed=7, audit=True)
    got, exported = _run(config, fp8=True)
    assert got == _by_hand(config)
    assert {"faircast/lag_steps", "faircast/served_changed_frac", "faircast/bias"} <= set(got[-1])
    assert exported[NAMES[0]].dtype == torch.bfloat16  # the export itself is unchanged: verl quantizes it
    bf16, _ = _run(config, fp8=False)  # control: the bf16 audit is another measurement
    assert bf16[-1] != got[-1]
    assert set(bf16[-1]) == set(got[-1])


def test_fp8_audit_detaches_the_shard_casts():
    state = _state(FairCastConfig(enabled=True, seed=7, audit=True), fp8=True)
    assert state.caster.audit is None and state.audit is None and state.fp8_audit is not None
    assert quantized_by_engine(NAMES[0], torch.zeros(4, 4))
    assert not quantized_by_engine(NAMES[1], torch.zeros(4, 4))
    assert not quantized_by_engine("model.layers.0.mlp.gate.weight", torch.zeros(4, 4))
    assert not quantized_by_engine("model.norm.weight", torch.zeros(4))
    assert not quantized_by_engine("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 4))
    assert not fc_fp8.attach(_state(FairCastConfig(enabled=True, seed=7), fp8=False), FP8_CFG)  # no audit: nothing


# -- through verl's real worker ---------------------------------------------------------------------------------

AUDIT_CASES = {1: [dict(name="fsdp2_fp8_audit", strategy="fsdp2", export_versions=4,
                        overrides=[f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},audit:true}}", FP8]),
                   dict(name="fsdp2_fp8_audit_off", strategy="fsdp2", export_versions=4,
                        overrides=["+actor_rollout_ref.faircast={enable:false,audit:true}", FP8])],
               2: [dict(name="fsdp_fp8_audit", strategy="fsdp", export_versions=4,
                        overrides=[f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},audit:true}}", FP8])]}
AUDIT_IDS = [(w, c["name"]) for w, cs in AUDIT_CASES.items() for c in cs]
_AUDIT_RUNS: dict = {}


@pytest.fixture(scope="session")
def fp8_audit_runs(tmp_path_factory, model_dir):
    def get(world):
        if world not in _AUDIT_RUNS:
            out = tmp_path_factory.mktemp(f"fp8_audit_world{world}")
            _AUDIT_RUNS[world] = run_ranks(out, model_dir=model_dir, world=world, cases=AUDIT_CASES[world])
        return _AUDIT_RUNS[world]

    return get


@pytest.mark.parametrize("world, case", AUDIT_IDS, ids=[f"{c}-world{w}" for w, c in AUDIT_IDS])
def test_worker_metrics_measure_the_fp8_engines_copy(fp8_audit_runs, world, case):
    """verl's worker, rollout.quantization=fp8, audit on, one optimizer step per update_actor and a full export per
    version: the metrics update_actor returns equal an audit by hand on (full master, dequantize(verl's
    quant_weights of that version's export)); control: the same audit on the bf16 export gives other numbers."""
    results = fp8_audit_runs(world)[case]
    r0 = results[0]
    audit, bf16_audit = Audit(4096), Audit(4096)
    by_hand, bf16 = [], []
    for version, (exported, masters) in enumerate(zip(r0["exported_by_version"], r0["masters_by_version"])):
        received = fp8_receive.engine_receives(exported)
        for name, x in masters.items():
            got = received[name]
            engine = dequantize_blockwise(got, received[name + "_scale_inv"]) if got.dtype == torch.float8_e4m3fn \
                else got.to(torch.bfloat16)
            audit.observe(name, version, x, engine)
            bf16_audit.observe(name, version, x, exported[name].to(torch.bfloat16))
        if version < len(r0["metrics"]):  # update_actor of version+1 reports the exports up to this version
            by_hand.append(audit.metrics())
            bf16.append(bf16_audit.metrics())
    assert len(r0["metrics"]) == 4
    reported = [{k: v for k, v in m.items() if k != "faircast/version"} for m in r0["metrics"]]
    assert reported[0] == {} and by_hand[0] == {}  # one version observed: nothing to compare yet
    for got, want, control in zip(reported[1:], by_hand[1:], bf16[1:]):
        assert set(got) == set(want) and "faircast/lag_steps" in got
        assert all(got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-15) for k in want), (got, want)
        assert any(got[k] != pytest.approx(control[k], rel=1e-6) for k in want), (got, control)
    for r in results[1:]:
        assert r["metrics"] == r0["metrics"]  # reduced over every rank
