"""The 2 B master (faircast_plugins.master16): low 16 bits + exceptions + the served copy give the master back, bit
for bit, under every backend, on random and special inputs; the probe's carry is the contract's.

The fused kernels (numba serial and parallel, Triton under the interpreter) apply the contract's carry
``(low + noise) >> 16`` at any offset and size; their compaction's low halves and miss count are the reference's;
master16 uses them only after its self-check and refuses a kernel that disagrees."""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import derive_key, fair_cast, master16, sticky_key
from faircast_plugins.cast import available_backends
from faircast_plugins.master16 import compact, low16_of, recover, recover_, stochastic_carry, stochastic_misses, unsigned16
from faircast_plugins.torch_ref import noise16

SPECIALS = [
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x0000FFFF, 0x00010000,
    0x7F800000, 0xFF800000, 0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0xFFC12345, 0x7FA00000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F0000, 0x7F7F0001, 0x7F7F8000, 0x7F7EFFFF, 0xFF7F0001, 0x7F7FFFFE,
    0x3F808000, 0x3F80FFFF, 0x3F800000, 0xBF80C000, 0x40490FDB, 0x3F7FFFFF,
]
BACKENDS = [b for b in ("torch", "cpu", "triton") if b in available_backends()]


def _inputs(n=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)  # every bit pattern
    normal = (torch.randn(n, generator=g) * 0.02).view(torch.int32)
    special = torch.tensor([s - 2**32 if s >= 2**31 else s for s in SPECIALS], dtype=torch.int32)
    return torch.cat([special, rand, normal, special]).view(torch.float32)


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["stochastic", "sticky"])
def test_stochastic_round_trip_is_bit_exact(mode, backend):
    x = _inputs().reshape(2, -1)
    for version in (0, 7):
        key = sticky_key(1234, "w") if mode == "sticky" else derive_key(1234, version, "w")
        q = fair_cast(x, key=key, mode=mode, backend=backend)
        c = compact(x, q, key=key, mode=mode, backend=backend)
        assert c.low16.dtype == torch.int16 and c.low16.numel() == x.numel()
        assert _same_bits(recover(q, c, backend), x)
        p = q.float()  # the parameter holds the served copy in fp32: recovered in place
        recover_(p, c, backend)
        assert _same_bits(p, x)
        # exceptions: exactly the NaNs and the finite magnitudes above 0x7F7F0000 (may saturate)
        mag = x.reshape(-1).view(torch.int32) & 0x7FFFFFFF
        assert torch.equal(c.index, torch.nonzero((mag > 0x7F7F0000) & (mag != 0x7F800000)).reshape(-1))
        assert c.index.numel() < x.numel() // 100 + 2 * len(SPECIALS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_carry_is_the_contracts_carry(backend):
    low = torch.randint(0, 65536, (3001,), dtype=torch.int32)
    low[:4] = torch.tensor([0, 1, 0xFFFF, 0x8000])
    key = derive_key(1234, 7, "model.layers.0.self_attn.q_proj.weight")
    for offset in (0, 5, 2**32 + 5):
        want = (low + noise16(key, offset, low.numel())) >> 16
        assert torch.equal(stochastic_carry(low, key=key, offset=offset, mode="stochastic", backend=backend), want)


@pytest.mark.parametrize("made_by", ["torch_to", "fair_cast"])
def test_nearest_round_trip_is_bit_exact(made_by):
    x = _inputs(seed=1)
    q = x.to(torch.bfloat16) if made_by == "torch_to" else fair_cast(x, key=0, mode="nearest", backend="torch")
    c = compact(x, q, key=None, mode="nearest")
    assert _same_bits(recover(q, c), x)
    assert c.index.numel() < x.numel() // 20


def test_recovery_needs_the_served_key():
    """Negative control: under another version's key the rule gives a different tensor (the key is part of state)."""
    x = torch.randn(4096) * 0.02
    k0, k1 = derive_key(0, 0, "w"), derive_key(0, 1, "w")
    q = fair_cast(x, key=k0, backend="torch")
    c = compact(x, q, key=k0, mode="stochastic", backend="torch")
    c.key = k1
    assert not _same_bits(recover(q, c, "torch"), x)
    assert unsigned16(c.low16).max() < 65536


# -- the fused kernels ---------------------------------------------------------------------------------------

FUSED = [b for b in ("cpu", "triton") if b in available_backends()]
KERNELS = []
if "cpu" in available_backends():
    KERNELS += [pytest.param(("cpu", {"parallel": False}), id="numba-serial"),
                pytest.param(("cpu", {"parallel": True}), id="numba-parallel")]
if "triton" in available_backends():
    KERNELS += [pytest.param(("triton", {}), id="triton")]


def _module(backend):
    if backend == "cpu":
        from faircast_plugins.kernels import cpu_master16 as module
    else:
        from faircast_plugins.kernels import triton_master16 as module
    return module


#: a derived key; halves equal to 1 (a plain int 1 is a compile-time constant to Triton); both halves >= 2**31
KEYS = [derive_key(99, 3, "w"), (1 << 32) | 1, 0xFFFFFFFF_FFFFFFFE]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("key", KEYS, ids=["derived", "halves-1", "halves-high"])
@pytest.mark.parametrize("n, offset", [(1, 0), (13, 3), (8 * 1024 * 2 + 29, 0), (8 * 1024 * 2 + 29, 8 * 1024 - 3),
                                       (5000, 2**32 + 5), (70000, 2**40 - 11)])
def test_recover_applies_the_contracts_carry(kernel, key, n, offset):
    backend, extra = kernel
    g = torch.Generator().manual_seed(n + offset % 997)
    served_bits = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int32) << 16  # any sign | hi << 16
    low16 = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    low16[:4] = torch.tensor([0, -1, -2**15, 2**15 - 1], dtype=torch.int16)[: min(4, n)]
    low = unsigned16(low16)
    want = (served_bits - (((low + noise16(key, offset, n)) >> 16) << 16)) | low
    bits = served_bits.clone()
    _module(backend).recover_(bits, low16, key=key, offset=offset, **extra)
    assert torch.equal(bits, want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_compact_takes_the_low_halves_and_counts_the_misses(kernel):
    backend, extra = kernel
    bits = _inputs(n=40000, seed=3).view(torch.int32)
    low16 = torch.full((bits.numel(),), 123, dtype=torch.int16)
    misses = _module(backend).compact(low16, bits, **extra)
    assert torch.equal(low16, low16_of(bits))
    assert misses == int(stochastic_misses(bits).sum()) > 0
    normal = (torch.randn(30000) * 0.02).view(torch.int32)
    assert _module(backend).compact(torch.empty(30000, dtype=torch.int16), normal, **extra) == 0


@pytest.mark.parametrize("backend", FUSED)
def test_master16_runs_the_fused_kernel_and_matches_the_reference(backend, monkeypatch):
    x = _inputs(n=20000, seed=5)
    key = derive_key(7, 2, "w")
    q = fair_cast(x, key=key, mode="stochastic", backend="torch")
    module, calls = _module(backend), []
    master16._kernels(backend, torch.device("cpu"), "stochastic")  # its one-time self-check, before the spies
    for name in ("compact", "recover_"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    fused = compact(x, q, key=key, mode="stochastic", backend=backend)
    reference = compact(x, q, key=key, mode="stochastic", backend="torch")
    assert torch.equal(fused.low16, reference.low16) and torch.equal(fused.index, reference.index)
    p, p_ref = q.float(), q.float()
    recover_(p, fused, backend)
    recover_(p_ref, reference, "torch")
    assert calls == ["compact", "recover_"]  # the torch calls above went to the reference
    assert _same_bits(p, x) and _same_bits(p_ref, x)


@pytest.mark.parametrize("backend", FUSED)
def test_a_kernel_that_disagrees_with_the_reference_is_refused(backend, monkeypatch):
    """Negative control of the one-time self-check: a kernel module whose recovery is off by one carry (what a stale
    numba cache of a changed Philox would give) is refused before any master is touched."""
    module = _module(backend)
    real = module.recover_

    def off_by_one_carry(bits, low16, **kwargs):
        real(bits, low16, **kwargs)
        bits[100] -= 1 << 16

    monkeypatch.setattr(module, "recover_", off_by_one_carry)
    monkeypatch.setattr(master16, "_CHECKED", set())
    x = torch.randn(100) * 0.02
    q = fair_cast(x, key=5, mode="stochastic", backend="torch")
    with pytest.raises(RuntimeError, match="does not give back the master.*__pycache__"):
        compact(x, q, key=5, mode="stochastic", backend=backend)


@pytest.mark.parametrize("backend", ["torch"] + FUSED)
def test_low_halves_of_another_tensor_are_refused(backend):
    """numba reads raw buffers: a compact master of another size (or dtype) is refused on every backend, not read out
    of bounds or applied to the wrong elements."""
    x = torch.randn(1000) * 0.02
    key = derive_key(7, 1, "w")
    q = fair_cast(x, key=key, mode="stochastic", backend="torch")
    c = compact(x, q, key=key, mode="stochastic", backend=backend)
    for wrong in (c.low16[:999], torch.cat([c.low16, c.low16[:1]]), c.low16.to(torch.int32)):
        bad = master16.Compact(wrong, c.index, c.value, c.key, c.mode)
        with pytest.raises(ValueError, match="belongs to another tensor"):
            recover_(q.float(), bad, backend)
    if backend != "torch":
        with pytest.raises(ValueError, match="int32 bits and int16 low halves|one size"):
            _module(backend).recover_(q.float().view(torch.int32), c.low16[:999], key=key)


# -- one host read per step (issue 29, finding 4) ---------------------------------------------------------------

HOST_READS = ("item", "tolist", "__int__", "__bool__")


def _count_host_reads(monkeypatch) -> list:
    """Every host read of a tensor value (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``torch.nonzero``):
    on CUDA each is a host sync."""
    calls = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: calls.append(_n) or _r(self, *a, **k))
    real_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: calls.append("nonzero") or real_nonzero(*a, **k))
    return calls


@pytest.mark.parametrize("backend", FUSED)
def test_compacting_a_whole_model_reads_the_miss_counts_once(backend, monkeypatch):
    """The fused compaction counts misses on the device; the masters of a step (here 6 parameters, one with misses)
    make one host read together, not one per parameter, and the same compact state as one by one."""
    masters = {f"p{i}": torch.randn(3000 + 17 * i) * 0.02 for i in range(6)}
    masters["p3"] = _inputs(n=3000, seed=9)  # specials: NaN and saturating values, the exceptions
    keys = {n: derive_key(3, 1, n) for n in masters}
    master16._kernels(backend, torch.device("cpu"), "stochastic")  # its one-time self-check, before the spies
    one_by_one = {n: compact(x, None, key=keys[n], mode="sticky", backend=backend) for n, x in masters.items()}
    calls = _count_host_reads(monkeypatch)
    together = master16.compact_all(masters, keys=keys, mode="sticky", backend=backend)
    monkeypatch.undo()
    reads = calls.count("tolist") + calls.count("item") + calls.count("__int__") + calls.count("__bool__")
    assert reads == (1 if backend == "triton" else 0), calls  # numba counts on the host: nothing to wait for
    assert calls.count("nonzero") == 1  # the one parameter with exceptions
    for n, c in one_by_one.items():
        t = together[n]
        assert torch.equal(t.low16, c.low16) and torch.equal(t.index, c.index) and _same_bits(t.value, c.value)
        assert t.key == keys[n] and t.mode == "sticky"
    assert one_by_one["p3"].index.numel() > 0
