"""The Megatron-native global index (docs/ROUNDING.md §1, "Megatron-core without a converter"), without Megatron."""
from __future__ import annotations

import torch

from faircast_plugins.megatron.layout import ParamKey


def _split(full: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """Megatron's strided split (``_initialize_affine_weight_cpu``): chunks of local/stride rows, rank r takes r::tp."""
    chunks = torch.split(full, full.shape[dim] // (stride * tp), dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


def test_golden_example_of_the_contract():
    key = ParamKey("decoder.layers.1.mlp.linear_fc1.weight", (4, 3), tp_size=2, tp_rank=1, partition_dim=0, stride=2)
    assert key.indices(0, 12).view(4, 3)[:, 0].tolist() == [6, 9, 18, 21]  # full rows 2, 3, 6, 7
    assert int(key.indices(4, 5)) == 10


def test_indices_match_megatrons_split_for_every_layout():
    for shape, dim, stride, tp in [((8, 6), 0, 1, 2), ((8, 6), 1, 1, 2), ((8, 6), 0, 2, 2), ((12, 4), 0, 2, 3),
                                   ((4, 6, 2), 1, 3, 2), ((6,), 0, 1, 3)]:
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        for rank in range(tp):
            local = _split(full, dim, stride, tp, rank)
            key = ParamKey("w", tuple(local.shape), tp_size=tp, tp_rank=rank, partition_dim=dim, stride=stride)
            n = local.numel()
            assert torch.equal(key.indices(0, n), local.reshape(-1)), (shape, dim, stride, tp, rank)
            if n > 4:
                assert torch.equal(key.indices(3, n - 1), local.reshape(-1)[3: n - 1])
            if key.contiguous and n > 4:
                assert key.offset(3) == int(local.reshape(-1)[3])


def test_replicated_params_use_the_local_index():
    key = ParamKey("decoder.final_layernorm.weight", (64,), tp_size=4, tp_rank=3)
    assert key.contiguous and key.offset(5) == 5
