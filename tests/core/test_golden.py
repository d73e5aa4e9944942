"""ROUNDING.md section 5 golden vectors and the Philox known answers, on the torch reference path."""
import pytest
import torch

from faircast_plugins import derive_key, fair_cast, golden, torch_ref


@pytest.mark.parametrize("seed,version,name,want", [golden.KEY_ZERO, golden.KEY_K])
def test_key(seed, version, name, want):
    assert derive_key(seed, version, name) == want


def test_key_changes_with_every_input():
    base = derive_key(1, 2, "a.weight")
    assert len({base, derive_key(2, 2, "a.weight"), derive_key(1, 3, "a.weight"), derive_key(1, 2, "b.weight")}) == 4
    assert 0 <= base < 2**63


@pytest.mark.parametrize("ctr,key,want", golden.PHILOX_KAT)
def test_philox_known_answers(ctr, key, want):
    out = torch_ref.philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in ctr), *key)
    assert tuple(int(w) & 0xFFFFFFFF for w in out) == want


@pytest.mark.parametrize("start,want", golden.NOISE_K)
def test_noise_golden(start, want):
    assert torch_ref.noise16(golden.KEY_K[3], start, len(want)).tolist() == want


def test_noise_at_arbitrary_indices_matches_contiguous():
    key = golden.KEY_K[3]
    idx = torch.tensor([[15, 0, 2**32 + 8], [3, 2**32 + 5, 9]])
    full = {i: v for start, vals in golden.NOISE_K for i, v in enumerate(vals, start)}
    assert torch_ref.noise16_at(key, idx).tolist() == [[full[i] for i in row] for row in idx.tolist()]


def test_stochastic_golden_table():
    x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN)
    out = fair_cast(x, key=golden.KEY_K[3], backend="torch")
    assert golden.bf16_bits(out) == golden.STOCHASTIC_K_OUT


def test_stochastic_golden_table_in_2d_and_as_shards():
    x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN)
    key = golden.KEY_K[3]
    assert golden.bf16_bits(fair_cast(x.view(4, 4), key=key, backend="torch")) == golden.STOCHASTIC_K_OUT
    for cut in (1, 5, 8, 13):
        parts = fair_cast(x[:cut], key=key, backend="torch"), fair_cast(x[cut:], key=key, offset=cut, backend="torch")
        assert golden.bf16_bits(torch.cat(parts)) == golden.STOCHASTIC_K_OUT
