"""``faircast_plugins.deepspeed.master_windows`` without DeepSpeed: windows packing, a one-rank ZeRO-1/2 layout read
from stand-in optimizer attributes (the names DeepSpeed 0.19 uses), and the refusal of a partition it does not
recognise. The layouts themselves are checked on real DeepSpeed engines at 1 and 2 ranks by
``tests/trl/test_deepspeed.py`` and ``tests/openrlhf/test_openrlhf_actor.py`` (policy scenarios)."""
from types import SimpleNamespace

import pytest
import torch

from faircast_plugins.deepspeed import master_windows as mw
from faircast_plugins.patching import FairCastPatchError


def test_windows_pack_whole_parameters_up_to_the_limit():
    assert mw._pack([(0, 4), (4, 8), (8, 20), (20, 21)], 10) == [(0, 8), (8, 20), (20, 21)]
    assert mw._pack([(0, 30)], 10) == [(0, 30)]  # a parameter larger than a window is a window of its own


def _optimizer(partition_numel=None):
    params = [torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))]
    fp32 = torch.arange(12, dtype=torch.float32)  # the flat layout: p0 at 0 (6), 1 padding, p1 at 7 (5)
    return params, SimpleNamespace(
        bit16_groups_flat=[torch.zeros(12, dtype=torch.bfloat16)], real_dp_process_group=[None],
        single_partition_of_fp32_groups=[fp32 if partition_numel is None else torch.zeros(partition_numel)],
        round_robin_bit16_groups=[params], round_robin_bit16_offsets=[[0, 7]])


def test_one_rank_zero12_layout_reads_the_masters_from_the_flat_partition(monkeypatch):
    monkeypatch.setattr(mw, "WINDOW_BYTES", 4 * 8)  # 8 elements: one parameter per window
    params, opt = _optimizer()
    windows = mw.MasterWindows(mw.Zero12Layout(opt))
    assert torch.equal(windows(params[0]), torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(windows(params[1]), torch.arange(7, 12, dtype=torch.float32))
    assert windows(torch.nn.Parameter(torch.zeros(1))) is None  # not in the layout: the per-parameter view
    assert windows.loads == 2


def test_a_partition_not_laid_out_as_read_is_refused():
    with pytest.raises(FairCastPatchError, match="policy_metrics_every=0"):
        mw.Zero12Layout(_optimizer(partition_numel=11)[1])


def test_offsets_past_2_to_the_32_are_exact():
    """A flat layout of 2^32 + 16 elements (meta tensors: nothing allocated): the parameter at offset 2^32 + 8 gets
    its own window at exactly that offset, and its master is read from exactly there (no int32 or float rounding
    of positions on the way)."""
    big = (1 << 32) + 16
    params = [torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16, device="meta")),
              torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="meta"))]
    opt = SimpleNamespace(
        bit16_groups_flat=[torch.zeros(big, dtype=torch.bfloat16, device="meta")], real_dp_process_group=[None],
        single_partition_of_fp32_groups=[torch.zeros(big, dtype=torch.float32, device="meta")],
        round_robin_bit16_groups=[params], round_robin_bit16_offsets=[[0, (1 << 32) + 8]])
    windows = mw.MasterWindows(mw.Zero12Layout(opt))
    assert windows.where[id(params[1])] == (0, (1 << 32) + 8, (1 << 32) + 11)
    master = windows(params[1])
    assert master.shape == (3,) and master.storage_offset() == (1 << 32) + 8
    assert windows(params[0]).storage_offset() == 0 and windows.loads == 2
