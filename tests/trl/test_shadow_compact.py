"""One process / DDP with 2 B masters: every step's masters, served copies and version equal, bit for bit, those of
the previous implementation (full fp32 masters, tests/trl/shadow_reference.py), through specials, saturation, a
checkpoint and a resume; the persistent state is 2 B per parameter plus the exceptions."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from faircast_plugins.caster import FairCaster
from faircast_plugins.config import FairCastConfig
from faircast_plugins.trl.backends.plain import ShadowMasters
from shadow_reference import ReferenceShadowMasters

SPECIAL_BITS = [
    0x7FC00000, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F0001,
    0x7F7EFFFF, 0x00000001, 0x807FFFFF, 0x00012345, 0x80000000, 0x00000000, 0x3F808000, 0x3F80FFFF, 0xBF80C000,
]


class Tiny(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(37, 29, generator=g) * 0.05)
        self.b = torch.nn.Parameter(torch.randn(29, generator=g))
        bits = torch.tensor([s - 2**32 if s >= 2**31 else s for s in SPECIAL_BITS] * 3, dtype=torch.int32)
        self.special = torch.nn.Parameter(bits.view(torch.float32).clone())  # trained at lr 0: the specials stay
        self.frozen = torch.nn.Parameter(torch.cat([torch.randn(50, generator=g), bits.view(torch.float32)]),
                                         requires_grad=False)


def _trainer(model, master_bytes=2):
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, process_index=0, num_processes=1,
                                  device=torch.device("cpu"))
    return SimpleNamespace(accelerator=accelerator, model=model,
                           args=SimpleNamespace(should_save=True, faircast_master_bytes=master_bytes))


def _run(cls, config, seed=0, master_bytes=2):
    model = Tiny(seed)
    backend = cls(_trainer(model, master_bytes), FairCaster(config))
    backend.prepare()
    opt = torch.optim.Adam([{"params": [model.w, model.b], "lr": 1e-2}, {"params": [model.special], "lr": 0.0}])
    return model, backend, opt


def _grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in (model.w, model.b, model.special):  # depends on the served copy the parameter holds
        p.grad = torch.nan_to_num(torch.sin(p.detach() * 7.0), 0.0, 0.0, 0.0) * torch.randn(p.shape, generator=g)


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _same(a: dict, b: dict):
    assert list(a) == list(b)
    for n in a:
        assert torch.equal(_bits(a[n]), _bits(b[n])), n


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _step(pairs, step):
    """One optimizer step of every (model, backend, optimizer), comparing the first with the others at each point."""
    for model, backend, opt in pairs:
        _grads(model, step)
        backend.before_step()
    for model, _, _ in pairs[1:]:
        _same(_params(pairs[0][0]), _params(model))  # trainable params hold the masters, frozen the served copy
    for model, backend, opt in pairs:
        opt.step()
        backend.after_step()
    _check(pairs)


def _check(pairs):
    ref_model, ref, _ = pairs[0]
    for model, backend, _ in pairs[1:]:
        assert backend.caster.version == ref.caster.version
        _same(_params(ref_model), _params(model))  # the served copies
        _same(dict(ref.masters), dict(backend.masters))  # the masters


CONFIGS = {
    "stochastic": FairCastConfig(enabled=True, mode="stochastic", seed=1234, backend="torch"),
    # the numba kernel ("cpu") is covered by tests/core/test_master16.py: importing it here would load llvmlite into
    # this process, and every later vLLM CPU engine of the session would fail to build (see conftest.py)
    "sticky": FairCastConfig(enabled=True, mode="sticky", seed=1234, backend="torch"),
    "nearest": FairCastConfig(enabled=True, mode="nearest", seed=1234, backend="torch"),
    "error_feedback": FairCastConfig(enabled=True, mode="error_feedback", seed=1234, backend="torch"),
    "ema": FairCastConfig(enabled=True, mode="stochastic", ema_decay=0.5, seed=1234, backend="torch"),
}


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_masters_match_the_fp32_shadow_at_every_step_and_resume(mode, tmp_path):
    config = CONFIGS[mode]
    pairs = [_run(ReferenceShadowMasters, config), _run(ShadowMasters, config)]
    state0 = SimpleNamespace(global_step=0)
    for _, backend, _ in pairs:
        backend.begin(state0, None)
    _check(pairs)
    for step in range(3):
        _step(pairs, step)
    if mode in ("stochastic", "sticky", "nearest"):
        assert pairs[1][1].compacts["special"].index.numel() > 0  # NaN, saturating values: in the exception list

    # checkpoint: the parameters hold the masters while saving (the Trainer's model files), then the served copy again
    model, backend, opt = pairs[1]
    served = _params(model)
    with pairs[0][1].masters_in_params():
        old_format = _params(pairs[0][0])  # what the previous version wrote
    with backend.masters_in_params():
        saved = _params(model)
    _same(old_format, saved)
    _same(served, _params(model))
    _check(pairs)
    backend.save_state(str(tmp_path))
    opt_state = copy.deepcopy(opt.state_dict())  # (a state_dict shares the live state tensors)

    # resume on a fresh trainer (other initial weights), from the new and from the old-format checkpoint
    for checkpoint in (saved, old_format):
        resumed = _run(ShadowMasters, config, seed=99)
        with torch.no_grad():
            resumed[0].load_state_dict(checkpoint)  # what Trainer._load_from_checkpoint does
        resumed[2].load_state_dict(copy.deepcopy(opt_state))
        resumed[1].begin(SimpleNamespace(global_step=3), str(tmp_path))
        pairs.append(resumed)
    _check(pairs)
    for step in range(3, 6):
        _step(pairs, step)


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_persistent_state_is_2_bytes_per_parameter(mode):
    config = CONFIGS[mode]
    (model, ref, _), (_, backend, _) = _run(ReferenceShadowMasters, config), _run(ShadowMasters, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    ref_bytes = sum(t.numel() * t.element_size() for t in ref.masters.values())
    assert ref_bytes == 4 * (trainable + frozen)
    exceptions = sum(c.index.numel() * 12 for c in backend.compacts.values())  # int64 index + fp32 value
    assert exceptions <= 12 * 2 * 3 * len(SPECIAL_BITS)  # only the specials' NaN / saturating elements
    held = backend.state_bytes()
    if mode in ("stochastic", "sticky", "nearest"):
        assert held == 2 * (trainable + frozen) + exceptions
        assert not backend.full
    else:  # error feedback, EMA: their trainable masters stay fp32 (their state is in the caster, fp32, unchanged)
        assert held == 4 * trainable + 2 * frozen + exceptions
    for c in backend.compacts.values():
        assert c.low16.dtype == torch.int16


def test_flag_off_keeps_nothing():
    """Negative control: Fair Cast off keeps no masters and leaves the parameters as they are."""
    config = FairCastConfig(enabled=False)
    model, backend, _ = _run(ShadowMasters, config)
    before = _params(model)
    backend.begin(SimpleNamespace(global_step=0), None)
    assert backend.state_bytes() == 0 and dict(backend.masters) == {}
    _same(before, _params(model))


def test_exception_list_and_key_are_needed():
    """Negative controls: without its exception list, or under another version's key, a master does not come back."""
    config = CONFIGS["stochastic"]
    (_, ref, _), (_, backend, _) = _run(ReferenceShadowMasters, config), _run(ShadowMasters, config)
    special = backend.compacts["special"]
    special.index, special.value = special.index[:0], special.value[:0]
    assert not torch.equal(_bits(ref.masters["special"]), _bits(backend.masters["special"]))
    backend.compacts["w"].key ^= 1
    assert not torch.equal(_bits(ref.masters["w"]), _bits(backend.masters["w"]))


@pytest.mark.parametrize("mode", ["stochastic", "sticky"])
def test_master_bytes_4_keeps_fp32_masters_with_the_same_bits(mode):
    """``faircast_master_bytes: 4`` (faster steps): trainable masters kept in fp32, every step's bits equal to the
    reference and to the 2 B backend's."""
    config = CONFIGS[mode]
    pairs = [_run(ReferenceShadowMasters, config), _run(ShadowMasters, config),
             _run(ShadowMasters, config, master_bytes=4)]
    for _, backend, _ in pairs:
        backend.begin(SimpleNamespace(global_step=0), None)
    for step in range(3):
        _step(pairs, step)
    model, backend = pairs[2][0], pairs[2][1]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert set(backend.full) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert backend.state_bytes() >= 4 * trainable and pairs[1][1].state_bytes() < 4 * trainable


def test_master_bytes_is_checked():
    """2, 4, or unset (None: 2 B masters for stochastic and sticky, fp32 for nearest)."""
    from faircast_plugins.trl.config import master_bytes

    assert master_bytes(2) == 2 and master_bytes("4") == 4 and master_bytes(None) is None
    for bad in (3, 0, "two", True, 2.5):
        with pytest.raises(ValueError, match="faircast_master_bytes must be 2"):
            master_bytes(bad)


# -- issue 29, finding 4: no chunked reference per step for nearest; one host read per step for the others -------

def test_nearest_keeps_fp32_masters_unless_2_bytes_are_asked_for():
    """``nearest`` has no fused compaction (on CUDA the chunked torch reference made ~20 launches and a host sync per
    1M elements every step): with ``faircast_master_bytes`` unset its trainable masters are kept in fp32 (no
    compaction, no recovery), with the same bits; an explicit 2 keeps the 2 B masters."""
    config = CONFIGS["nearest"]
    pairs = [_run(ReferenceShadowMasters, config), _run(ShadowMasters, config, master_bytes=None),
             _run(ShadowMasters, config, master_bytes=2)]
    for _, backend, _ in pairs:
        backend.begin(SimpleNamespace(global_step=0), None)
    for step in range(3):
        _step(pairs, step)
    trainable = {n for n, p in pairs[1][0].named_parameters() if p.requires_grad}
    assert set(pairs[1][1].full) == trainable
    assert not set(pairs[2][1].full) and trainable <= set(pairs[2][1].compacts)  # control: the user's explicit 2


@pytest.mark.parametrize("mode", ["stochastic", "sticky"])
def test_each_step_compacts_every_master_in_one_call(mode, monkeypatch):
    """The step's compaction goes through ``master16.compact_all`` once, for every trainable parameter (the fused
    kernels' miss counts are then read from the device once per step, tests/core/test_master16.py), not through
    ``compact`` one parameter at a time; the bits stay the reference's."""
    import faircast_plugins.trl.backends.plain as plain

    calls = []
    real_all, real_one = plain.compact_all, plain.compact
    monkeypatch.setattr(plain, "compact_all", lambda masters, **k: calls.append(sorted(masters)) or real_all(masters, **k))
    monkeypatch.setattr(plain, "compact", lambda *a, **k: calls.append("compact") or real_one(*a, **k))
    pairs = [_run(ReferenceShadowMasters, CONFIGS[mode]), _run(ShadowMasters, CONFIGS[mode])]
    for _, backend, _ in pairs:
        backend.begin(SimpleNamespace(global_step=0), None)
    calls.clear()
    for step in range(2):
        _step(pairs, step)
    trainable = sorted(n for n, p in pairs[1][0].named_parameters() if p.requires_grad)
    assert calls == [trainable, trainable]
