"""ROUNDING.md section 5 golden vectors and the Philox known answers, on the torch reference path."""
import pytest
import torch

from faircast_plugins import derive_key, fair_cast, golden, sticky_key, torch_ref


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


# -- sticky (ROUNDING.md §2 reserved version, §4 sticky, §5) -------------------------------------------------------
@pytest.mark.parametrize("seed,name,want", [golden.STICKY_KEY_ZERO, golden.STICKY_KEY_S])
def test_sticky_key(seed, name, want):
    assert sticky_key(seed, name) == want
    assert want not in {derive_key(seed, v, name) for v in (0, 1, 7, 2**64 - 2)}


def test_the_sticky_version_is_reserved():
    with pytest.raises(ValueError, match="reserved for mode='sticky'"):
        derive_key(1, 2**64 - 1, "w")
    assert 0 <= derive_key(1, 2**64 - 2, "w") < 2**63  # the largest ordinary version
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        derive_key(1, 2**64, "w")


@pytest.mark.parametrize("start,want", golden.NOISE_S)
def test_sticky_noise_golden(start, want):
    assert torch_ref.noise16(golden.STICKY_KEY_S[2], start, len(want)).tolist() == want


def test_sticky_golden_table_whole_and_as_shards():
    x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN)
    key = golden.STICKY_KEY_S[2]
    assert golden.bf16_bits(fair_cast(x, key=key, mode="sticky", backend="torch")) == golden.STICKY_S_OUT
    for cut in (1, 5, 8, 13):
        parts = (fair_cast(x[:cut], key=key, mode="sticky", backend="torch"),
                 fair_cast(x[cut:], key=key, offset=cut, mode="sticky", backend="torch"))
        assert golden.bf16_bits(torch.cat(parts)) == golden.STICKY_S_OUT
    # negative control: the version's key (stochastic) gives another table
    assert golden.STICKY_S_OUT != golden.STOCHASTIC_K_OUT


# -- error feedback (ROUNDING.md §4, §5) ---------------------------------------------------------------------------
def test_error_feedback_golden_table():
    x = golden.fp32_from_bits([row[0] for row in golden.ERROR_FEEDBACK])
    r = golden.fp32_from_bits([row[1] for row in golden.ERROR_FEEDBACK])
    q = fair_cast(x, key=0, mode="error_feedback", residual=r, backend="torch")
    assert golden.bf16_bits(q) == [row[2] for row in golden.ERROR_FEEDBACK]
    assert [v & 0xFFFFFFFF for v in r.view(torch.int32).tolist()] == [row[3] for row in golden.ERROR_FEEDBACK]
