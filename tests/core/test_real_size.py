"""One real-size tensor on the CPU (issue 29, item 2): a 151936 x 4096 fp32 master (an embedding of a 7B-class
vocabulary, 622M elements, 2.5 GB) through the rounding engine and the 2 B master, checked at its head, middle
and tail against the torch reference at the same global indices. About 5 GB at the peak: run only with
FAIRCAST_REAL_SIZE=1 (the positions of such sizes are covered without memory in tests/core/test_audit_positions.py
and by the offset tests of test_cast_api.py, test_triton_cast.py and test_master16.py)."""
from __future__ import annotations

import os

import pytest
import torch

from faircast_plugins import derive_key, fair_cast, master16

pytestmark = pytest.mark.skipif(os.environ.get("FAIRCAST_REAL_SIZE") != "1",
                                reason="real-size CPU check (5 GB): set FAIRCAST_REAL_SIZE=1")

ROWS, COLS = 151936, 4096
WINDOW = 4096


def test_a_real_size_tensor_casts_and_recovers_bit_for_bit_at_its_far_end():
    numel = ROWS * COLS
    assert 2**24 < numel < 2**31
    g = torch.Generator().manual_seed(0)
    x = torch.empty(numel, dtype=torch.float32)
    x.normal_(0, 0.02, generator=g)
    key = derive_key(11, 3, "model.embed_tokens.weight")
    q = fair_cast(x, key=key, mode="stochastic", backend="cpu")
    windows = [0, numel // 2 - 3, numel - WINDOW]
    for start in windows:
        ref = fair_cast(x[start: start + WINDOW].clone(), key=key, offset=start, mode="stochastic", backend="torch")
        assert torch.equal(q[start: start + WINDOW].view(torch.int16), ref.view(torch.int16)), start
    masters = {s: x[s: s + WINDOW].clone() for s in windows}
    c = master16.compact(x, q, key=key, mode="stochastic", backend="cpu")
    x.copy_(q)  # the parameter now holds the served copy ...
    del q
    master16.recover_(x, c, backend="cpu")  # ... and gets its master back
    for s, want in masters.items():
        assert torch.equal(x[s: s + WINDOW].view(torch.int32), want.view(torch.int32)), s
