"""WeightLayout: flat copy destinations -> (parameter, global element index) runs."""
import pytest
import torch

from faircast_plugins.deepspeed.layout import Alias, Segment, Span, WeightLayout


def test_segments_split_at_parameters_and_skip_padding():
    flat = torch.zeros(20, dtype=torch.bfloat16)  # a: elements 0..5, padding 6..7, b: 8..19 (a ZeRO-3 shard at 30)
    base = flat.data_ptr()
    layout = WeightLayout([Span(base + 16, 12, "b", 30), Span(base, 6, "a", 0)])
    assert layout.segments(flat[4:12]) == [Segment(0, 2, "a", 4), Segment(4, 4, "b", 30)]
    assert layout.segments(flat[6:8]) == []  # padding only
    assert layout.touches(flat[::2]) and not layout.touches(torch.zeros(4, dtype=torch.bfloat16))


def test_staging_buffer_alias_maps_to_the_partition():
    weights = torch.zeros(10, dtype=torch.bfloat16)
    staging = torch.zeros(4, dtype=torch.bfloat16)  # holds weights[6:10] (CPU-offload staging buffer)
    layout = WeightLayout([Span(weights.data_ptr(), 10, "w", 0)],
                          [Alias(staging.data_ptr(), 4, weights[6:].data_ptr())])
    assert layout.segments(staging) == [Segment(0, 4, "w", 6)]


def test_overlapping_parameters_are_refused():
    flat = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap in memory"):
        WeightLayout([Span(flat.data_ptr(), 6, "a", 0), Span(flat.data_ptr() + 8, 4, "b", 0)])
