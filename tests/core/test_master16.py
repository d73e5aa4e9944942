"""The 2 B master (faircast_plugins.master16): low 16 bits + exceptions + the served copy give the master back, bit
for bit, under every backend, on random and special inputs; the probe's carry is the contract's."""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import derive_key, fair_cast, sticky_key
from faircast_plugins.cast import available_backends
from faircast_plugins.master16 import compact, recover, recover_, stochastic_carry, unsigned16
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
