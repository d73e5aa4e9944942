"""The audit's sampled positions at the sizes users run (issue 29, finding 1).

A float32 ``linspace(0, numel - 1, sample)`` rounds ``numel - 1`` up to ``numel`` above 2**24 elements: the last
position ran one past the end (IndexError on the host, a device-side assert on CUDA) for every model from ~0.5B.
"""
from __future__ import annotations

import pytest
import torch

from faircast_plugins.audit import Audit, sample_positions

# 2**24 + 1, 17 * 2**20 (first size where the float32 linspace failed in the review), an embedding of a 151936-token
# vocabulary at width 4096, and a tensor past 2**31 elements (positions only: nothing that size is allocated).
SIZES = (2**24 + 1, 17 * 2**20, 151936 * 4096, 2**31 + 5)


def _exact(numel: int, sample: int) -> list:
    """The reference in Python integers: round half up of i * (numel - 1) / (sample - 1)."""
    return [(2 * i * (numel - 1) + sample - 1) // (2 * (sample - 1)) for i in range(sample)]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("sample", (2, 4096, 65537))
def test_positions_exact_and_in_range(numel, sample):
    pos = sample_positions(numel, sample, "cpu")
    assert pos.dtype == torch.int64 and pos.shape == (sample,)
    assert pos[0].item() == 0 and pos[-1].item() == numel - 1
    assert bool((pos[1:] > pos[:-1]).all()), "positions must be strictly increasing"
    assert pos.tolist() == _exact(numel, sample)


def test_float32_linspace_was_out_of_range():
    """The negative control: the old construction's last position is past the end at these sizes (and wrong,
    though in range, past 2**31, where float32 rounds down)."""
    for numel in SIZES[1:]:
        old = torch.linspace(0, numel - 1, 4096).round().to(torch.int64)
        assert old[-1].item() >= numel if numel < 2**31 else old[-1].item() != numel - 1


def test_small_sizes_keep_the_old_positions():
    """Below 2**24 the positions are those the float32 construction gave (audit histories stay comparable)."""
    for numel, sample in ((10007, 4096), (4097, 4096), (1 << 20, 4096), (12345, 100)):
        old = torch.linspace(0, numel - 1, sample, dtype=torch.float64).round().to(torch.int64)
        new = sample_positions(numel, sample, "cpu")
        assert (old - new).abs().max().item() == 0


def test_edge_cases():
    assert sample_positions(4096, 4096, "cpu") is None  # all elements
    assert sample_positions(10, 1, "cpu").tolist() == [0]
    with pytest.raises(ValueError, match="at least 1"):
        sample_positions(10, 0, "cpu")
    with pytest.raises(ValueError, match="overflow int64"):
        sample_positions(2**62, 4096, "cpu")


def test_observe_above_2_24_elements():
    """One real observation of a 17 * 2**20-element tensor (71 MB fp32): two versions measured, finite metrics."""
    numel = 17 * 2**20
    audit = Audit(sample=4096)
    master = torch.randn(numel) * 0.02
    for version in range(3):
        served = master.to(torch.bfloat16)
        audit.observe("embed", version, master, served)
        master.add_(1e-6)
    totals = audit.totals()
    assert totals["n"] > 0
    assert all(torch.isfinite(torch.tensor(float(v))) for v in totals.values())
