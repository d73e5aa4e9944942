"""faircast_plugins.fsdp.assemble_served on one process: the bit packing that puts a served tensor together from
shards (the multi-rank all-gather runs in test_fsdp_batched_cast.py and the worker tests at world sizes 2 and 3)."""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import FairCaster, FairCastConfig
from faircast_plugins.fsdp import assemble_served


def test_whole_shard_gives_the_caster_bits_including_signs_and_negative_zero():
    x = torch.tensor([-0.0, 0.0, -1.5, 3.0e-3, -7.0e5, float("inf"), float("-inf"), 1e-40], dtype=torch.float32)
    caster = FairCaster(FairCastConfig(enabled=True, seed=3))
    q = assemble_served(caster, "w", (0, x), x.shape, "cpu")
    expected = caster.cast("w", x)
    assert torch.equal(q.view(torch.int16), expected.view(torch.int16))
    assert q.view(torch.int16)[0] == -32768  # -0.0 keeps its sign bit


def test_missing_elements_are_an_error():
    caster = FairCaster(FairCastConfig(enabled=True))
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="no rank holds some elements of w"):
        assemble_served(caster, "w", (0, x), (2, 4), "cpu")  # this (only) rank holds 4 of 8 elements
