"""FairCaster: versions, canonical names, error feedback and EMA state, checkpoint round trip."""
import io

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster, derive_key, fair_cast, sticky_key


def bits(t):
    return t.reshape(-1).view(torch.int16)


def masters(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 16, generator=g), "model.norm.weight": 1 + 0.01 * torch.randn(16, generator=g)}


def train_step(ms, v):
    g = torch.Generator().manual_seed(100 + v)
    for t in ms.values():
        t.add_(1e-4 * torch.randn(t.shape, generator=g))


def test_cast_is_fair_cast_with_the_canonical_key_of_the_current_version():
    caster = FairCaster(FairCastConfig(enabled=True, seed=42))
    ms = masters()
    for v in range(3):
        for name, x in ms.items():
            want = fair_cast(x, key=derive_key(42, v, name))
            for wrapped in (name, f"_fsdp_wrapped_module.{name}", f"module._orig_mod.{name}"):
                assert torch.equal(bits(caster.cast(wrapped, x)), bits(want))
        train_step(ms, v)
        caster.advance()


def test_cast_of_a_shard_at_an_offset_matches_the_full_cast():
    caster = FairCaster(FairCastConfig(enabled=True, seed=1))
    x = torch.randn(1000)
    full = caster.cast("w", x)
    assert torch.equal(bits(caster.cast("w", x[371:], offset=371)), bits(full[371:]))


def test_disabled_config_casts_round_to_nearest():
    caster = FairCaster(FairCastConfig(enabled=False, audit=True))
    x = torch.randn(4096)
    assert torch.equal(bits(caster.cast("w", x)), bits(x.to(torch.bfloat16)))


def test_cast_many_equals_cast():
    caster = FairCaster(FairCastConfig(enabled=True, seed=3))
    ms = masters()
    many = caster.cast_many(ms)
    for name, x in ms.items():
        assert torch.equal(bits(many[name]), bits(caster.cast(name, x)))


def test_sticky_key_ignores_the_version_and_casting_is_stateless():
    ms = masters()
    caster = FairCaster(FairCastConfig(enabled=True, mode="sticky", seed=42))
    first = {}
    for v in range(3):
        for name, x in ms.items():
            assert caster.key(f"_fsdp_wrapped_module.{name}") == sticky_key(42, name)
            want = fair_cast(x, key=sticky_key(42, name), mode="sticky")
            assert torch.equal(bits(caster.cast(name, x)), bits(want))
            first.setdefault(name, (x.clone(), bits(want).clone()))
        many = caster.cast_many(ms)
        assert all(torch.equal(bits(many[n]), bits(caster.cast(n, x))) for n, x in ms.items())
        train_step(ms, v)
        caster.advance()
    # an unchanged master is served with the same bits at any later version, by a fresh caster (no state)
    later = FairCaster(FairCastConfig(enabled=True, mode="sticky", seed=42), version=1000)
    for name, (x0, q0) in first.items():
        assert torch.equal(bits(later.cast(name, x0)), q0)
    # negative control: stochastic draws new thresholds at the later version
    stochastic = FairCaster(FairCastConfig(enabled=True, mode="stochastic", seed=42), version=1000)
    assert not torch.equal(bits(stochastic.cast("model.embed_tokens.weight", first["model.embed_tokens.weight"][0])),
                           first["model.embed_tokens.weight"][1])


def test_error_feedback_is_idempotent_within_a_version_and_strict_about_order():
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"))
    x = torch.full((100,), 1.0 + 2**-9)
    q0 = caster.cast("w", x)
    assert torch.equal(bits(caster.cast("w", x)), bits(q0))  # a second cast site at version 0: same copy
    caster.advance()
    q1 = caster.cast("w", x)
    caster.advance()
    q2 = caster.cast("w", x)
    assert [float(q[0]) for q in (q0, q1, q2)] == [1.0, 1.0, 1.0 + 2**-7]
    caster.advance()
    caster.advance()
    with pytest.raises(RuntimeError, match="cast exactly once in order"):
        caster.cast("w", x)


def test_error_feedback_refuses_a_different_shard():
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"))
    caster.cast("w", torch.zeros(10), offset=0)
    with pytest.raises(ValueError, match="per-rank state"):
        caster.cast("w", torch.zeros(10), offset=10)


def test_ema_casts_the_average_and_needs_masters():
    b = 0.9
    caster = FairCaster(FairCastConfig(enabled=True, ema_decay=b, seed=5))
    x = torch.zeros(512)
    caster.cast("w", x)
    x += 1.0
    caster.advance({"w": x})
    m = torch.full((512,), 1 - b)  # m = 0 + (1 - b) * (1 - 0)
    assert torch.equal(bits(caster.cast("w", x)), bits(fair_cast(m, key=derive_key(5, 1, "w"))))
    with pytest.raises(ValueError, match="needs the updated masters"):
        caster.advance()


def test_update_ema_per_shard_equals_the_full_ema():
    """Cast sites that see the master in shards (DeepSpeed's ZeRO partitions) keep the EMA per shard: the shards
    of the full EMA, bit for bit, and so the same served bits."""
    cfg = FairCastConfig(enabled=True, ema_decay=0.8, seed=3)
    full, ranks = FairCaster(cfg), [FairCaster(cfg), FairCaster(cfg)]
    cuts = [(0, 437), (437, 1024)]  # an uneven split
    x0 = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    x = x0.clone()
    full.cast("w", x)  # version 0: the EMA starts at the master
    for v in range(1, 5):
        x += 1e-3 * torch.randn(1024, generator=torch.Generator().manual_seed(10 + v))
        full.advance({"w": x})
        for caster, (a, b) in zip(ranks, cuts):
            caster.update_ema("w", x[a:b], start=x0[a:b] if v == 1 else None)
            caster.advance(masters=())
            assert caster.version == full.version == v
        want = full.cast("w", x)
        for caster, (a, b) in zip(ranks, cuts):
            assert torch.equal(bits(caster.cast("w", x[a:b], offset=a)), bits(want[a:b]))
    assert not torch.equal(bits(want), bits(fair_cast(x, key=derive_key(3, 4, "w"))))  # the EMA is not the master
    with pytest.raises(ValueError, match="per-rank state"):
        ranks[0].update_ema("w", x[:100])
    with pytest.raises(ValueError, match="needs Fair Cast enabled with ema_decay"):
        FairCaster(FairCastConfig(enabled=True)).update_ema("w", x)


def test_ema_step_rounds_each_operation():
    """m + (1 - b) * (x - m) with each operation rounded to fp32 (no fused multiply-add), whatever the kernel."""
    b = 0.9
    caster = FairCaster(FairCastConfig(enabled=True, ema_decay=b, mode="nearest"))
    g = torch.Generator().manual_seed(0)
    m0, x = torch.randn(4099, generator=g), torch.randn(4099, generator=g)
    caster.update_ema("w", x, start=m0)
    d = (x - m0) * torch.tensor(1 - b, dtype=torch.float32)
    assert torch.equal(caster.state_dict()["ema"]["w"].view(torch.int32), (m0 + d).view(torch.int32))


def _run(caster, ms, steps, served):
    for _ in range(steps):
        served.append({n: bits(caster.cast(n, x)).clone() for n, x in ms.items()})
        train_step(ms, caster.version)
        caster.advance(ms)


@pytest.mark.parametrize("cfg", [
    dict(mode="stochastic", seed=9),
    dict(mode="sticky", seed=9, audit=True),
    dict(mode="sticky", seed=9, ema_decay=0.5),
    dict(mode="error_feedback", seed=9),
    dict(mode="stochastic", seed=9, ema_decay=0.5, audit=True),
])
def test_resume_serves_bit_identical_copies(cfg):
    straight, resumed = [], []
    ms = masters()
    _run(FairCaster(FairCastConfig(enabled=True, **cfg)), ms, 6, straight)

    ms = masters()
    first = FairCaster(FairCastConfig(enabled=True, **cfg))
    _run(first, ms, 3, resumed)
    buf = io.BytesIO()
    torch.save({"faircast": first.state_dict(), "masters": ms}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    second = FairCaster(FairCastConfig(enabled=True, **cfg))
    second.load_state_dict(ckpt["faircast"])
    assert second.version == 3
    _run(second, ckpt["masters"], 3, resumed)

    assert len(straight) == len(resumed) == 6
    for a, b in zip(straight, resumed):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_without_state_differs_for_error_feedback():
    """Negative control: dropping the residual on resume changes the served copies."""
    ms, straight = masters(), []
    _run(FairCaster(FairCastConfig(enabled=True, mode="error_feedback")), ms, 4, straight)
    ms, resumed = masters(), []
    first = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"))
    _run(first, ms, 2, resumed)
    second = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"), version=2)
    _run(second, ms, 2, resumed)
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(straight, resumed) for n in a)


def test_load_state_dict_refuses_a_different_config():
    state = FairCaster(FairCastConfig(enabled=True, seed=1)).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        FairCaster(FairCastConfig(enabled=True, seed=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="state format"):
        FairCaster().load_state_dict({"format": 99})


def test_metrics_follow_the_master_under_stochastic_and_lag_under_nearest():
    """Audit on a bf16 checkpoint with steady updates far below half a bf16 step, summed over 12 steps."""
    n = 1 << 16
    results = {}
    for enabled in (True, False):
        caster = FairCaster(FairCastConfig(enabled=enabled, audit=True, audit_sample=n, seed=4))
        # weights in [0.02, 0.04): a bf16 step is 2**-13, so 1e-6 per step needs ~60 steps to cross half of it
        x = (0.02 * (1 + torch.rand(n, generator=torch.Generator().manual_seed(0)))).to(torch.bfloat16).float()
        update = 1e-6 * (1 + torch.rand(n, generator=torch.Generator().manual_seed(1)))
        for _ in range(12):
            caster.cast("w", x)
            x += update
            caster.advance()
        results[enabled] = caster.metrics()
    sr, rne = results[True], results[False]
    assert rne["faircast/master_moved_frac"] == sr["faircast/master_moved_frac"] == 1.0
    assert rne["faircast/served_changed_frac"] == 0.0 < sr["faircast/served_changed_frac"]
    assert rne["faircast/bias_rel"] == 1.0 and sr["faircast/bias_rel"] < 0.1
    assert rne["faircast/bias_rel_cumulative"] == 1.0 and sr["faircast/bias_rel_cumulative"] < 0.1
    assert rne["faircast/lag_steps"] > 5 and abs(sr["faircast/lag_steps"]) < 1
    assert sr["faircast/version"] == 12.0


def test_audit_keeps_a_full_cast_and_a_shard_cast_of_one_name_apart():
    caster = FairCaster(FairCastConfig(enabled=True, audit=True))
    x = torch.randn(1000)
    for _ in range(3):
        caster.cast("w", x)           # e.g. the export of the full parameter
        caster.cast("w", x[:400])     # e.g. rank 0's shard cast by FSDP, also at offset 0
        x += 1e-3
        caster.advance()
    assert caster.metrics()["faircast/master_moved_frac"] == 1.0


# -- the weight version and per-element state, as the adapters use them --------------------------------------


@pytest.mark.parametrize("cfg, keeps", [
    (FairCastConfig(enabled=True), False),
    (FairCastConfig(enabled=True, mode="nearest"), False),
    (FairCastConfig(enabled=True, mode="error_feedback"), True),
    (FairCastConfig(enabled=True, ema_decay=0.5), True),
    (FairCastConfig(enabled=False, mode="error_feedback", audit=True), False),  # off: casts round to nearest
])
def test_keeps_state_is_decided_by_the_caster(cfg, keeps):
    assert FairCaster(cfg).keeps_state is keeps
    assert cfg.keeps_state is keeps


def test_set_version_starts_a_fresh_caster_and_refuses_to_move_existing_state():
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"))
    caster.set_version(5)
    assert caster.version == 5
    caster.cast("w", torch.randn(8))
    caster.set_version(5)  # the same version: nothing moves
    with pytest.raises(RuntimeError, match="per-element state"):
        caster.set_version(0)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="version"):
            FairCaster().set_version(bad)


def test_rollback_undoes_advances_that_cast_nothing():
    caster = FairCaster(FairCastConfig(enabled=True))
    caster.advance()
    caster.advance()
    assert caster.rollback() == 1 and caster.version == 1
    with pytest.raises(ValueError, match="steps"):
        caster.rollback(0)
    with pytest.raises(ValueError, match="below 0"):
        caster.rollback(2)


def test_rollback_refuses_once_error_feedback_cast_the_new_version():
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"))
    x = torch.randn(8)
    caster.cast("w", x)
    caster.advance()
    caster.rollback()  # nothing cast at version 1 yet: fine
    assert caster.version == 0
    caster.advance()
    caster.cast("w", x)  # version 1 cast: its residual cannot be undone
    with pytest.raises(RuntimeError, match="error-feedback"):
        caster.rollback()


# -- issue 29, finding 6: state beside a pinned (offloaded) master is pinned too --------------------------------

class _PinnedHost:
    """Pinned host memory stood in for on a machine without an accelerator: ``pin_memory()`` gives a copy that
    ``is_pinned()`` then reports, so state made beside a pinned master can be checked."""

    def __init__(self, monkeypatch):
        self.pinned, self.pin_calls = set(), 0
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: t.untyped_storage().data_ptr() in self.pinned)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: self._pin(t))

    def _pin(self, t, *a):
        self.pin_calls += 1
        out = t.clone()
        self.pinned.add(out.untyped_storage().data_ptr())
        return out

    def master(self, x):
        return self._pin(x)


@pytest.mark.parametrize("cfg", [dict(ema_decay=0.5), dict(mode="error_feedback")], ids=["ema", "error_feedback"])
def test_state_beside_a_pinned_master_is_pinned(monkeypatch, cfg):
    """FSDP CPU offload keeps the masters in pinned host memory: the EMA (and an error-feedback residual and its kept
    served copy) made beside one must be pinned too, or each non_blocking copy of it to the GPU per all-gather is a
    pageable copy that waits for the host (defeating FSDP's prefetch). Control: beside a pageable master, no pinning."""
    host = _PinnedHost(monkeypatch)
    caster = FairCaster(FairCastConfig(enabled=True, seed=3, **cfg))
    master = host.master(torch.randn(64) * 0.02)
    assert master.is_pinned()
    if caster.ema_on:
        assert caster.source("w", master).is_pinned()
        caster.advance({"w": master})
        assert caster._ema["w"].is_pinned() and caster.update_ema("v", master).is_pinned()
    else:
        caster.cast("w", master)
        state = caster._ef["w"]
        assert state.residual.is_pinned() and state.served.is_pinned()
    calls = host.pin_calls
    plain = FairCaster(FairCastConfig(enabled=True, seed=3, **cfg))
    pageable = torch.randn(64) * 0.02
    plain.source("w", pageable) if plain.ema_on else plain.cast("w", pageable)
    assert host.pin_calls == calls  # control
