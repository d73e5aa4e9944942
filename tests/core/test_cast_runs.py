"""fair_cast_runs: many runs of one flat tensor pair in one launch, bit for bit the per-run fair_cast of the torch
reference (ROUNDING.md), on every backend (Triton under its CPU interpreter here)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from faircast_plugins import golden  # noqa: E402
from faircast_plugins.cast import RunTable, available_backends, fair_cast, fair_cast_runs  # noqa: E402
from faircast_plugins.key import derive_key  # noqa: E402

BACKENDS = [b for b in ("torch", "cpu", "triton") if b in available_backends()]
KEYS = [derive_key(1234, 7, f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"]


def _device(backend):
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _x(n, seed=0):
    """Weights with every special the contract names sprinkled in (NaN payloads, infinities, bf16 max, zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02
    specials = golden.fp32_from_bits([0x7FC00001, 0xFF800000, 0x7F7FFFFF, 0x80000000, 0x00000001, 0x7F800000])
    x[:: max(1, n // 7)][: specials.numel()] = specials[: x[:: max(1, n // 7)].numel()]
    return x


def _expected(x, runs, keys, mode, out):
    out = out.clone()
    for pos, first, n, slot in runs.rows:
        out[pos: pos + n] = fair_cast(x[pos: pos + n], key=keys[slot], offset=first, mode=mode, backend="torch")
    return out


def _bits(t):
    return t.view(torch.int16).cpu()


TABLES = {
    # a TP row split: one run per row, global row stride 3x the local row
    "rows": ([[r * 37, 3 * 37 * r + 37, 37, 0] for r in range(9)], 1),
    # a fused QKV keyed by HF names: head blocks of q, k, v, aligned and not, gaps left unwritten
    "qkv": ([[0, 0, 64, 0], [64, 0, 16, 1], [80, 0, 16, 2], [96, 64, 64, 0], [160, 16, 16, 1], [176, 16, 16, 2],
             [200, 2**32 - 5, 13, 0], [220, 2**40 + 3, 8200, 1]], 3),
    # runs longer than a CPU block and a Triton tile, near the end of the index space
    "long": ([[3, 2**63 - 20000, 20000, 0], [20010, 8, 16384, 0]], 1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["stochastic", "nearest"])  # sticky: the stochastic kernel, another key
@pytest.mark.parametrize("table", sorted(TABLES))
def test_runs_equal_per_run_fair_cast(backend, mode, table):
    rows, slots = TABLES[table]
    runs = RunTable(rows, slots)
    n = runs.extent + 5
    x = _x(n, seed=len(table))
    keys = KEYS[:slots]
    dev = _device(backend)
    sentinel = torch.full((n,), 7.0, dtype=torch.bfloat16)
    out = sentinel.clone().to(dev)
    fair_cast_runs(x.to(dev), runs=runs, keys=keys, out=out, mode=mode, backend=backend)
    assert torch.equal(_bits(out), _bits(_expected(x, runs, keys, mode, sentinel)))
    # the same table again (its device copy is cached), other keys
    keys2 = [k ^ 0x5555 for k in keys]
    fair_cast_runs(x.to(dev), runs=runs, keys=keys2, out=out, mode=mode, backend=backend)
    assert torch.equal(_bits(out), _bits(_expected(x, runs, keys2, mode, sentinel)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_vector_through_runs(backend):
    """ROUNDING.md §1's fused-QKV golden vector: each element cast through a one-element run at its HF index."""
    dev = _device(backend)
    for element, name, index, key, bits_in, bits_out in golden.HF_QKV:
        x = golden.fp32_from_bits([bits_in] * 4)
        out = torch.zeros(4, dtype=torch.bfloat16, device=dev)
        fair_cast_runs(x.to(dev), runs=RunTable([[2, index, 1, 0]]), keys=[key], out=out, backend=backend)
        assert golden.bf16_bits(out.cpu())[2] == bits_out


def test_bad_tables_and_inputs_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        RunTable([[0, 0, 8, 0], [4, 100, 8, 0]])
    with pytest.raises(ValueError, match="slot"):
        RunTable([[0, 0, 8, 1]], 1)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        RunTable([[0, 2**63 - 4, 8, 0]])
    runs = RunTable([[0, 0, 8, 0], [10, 3, 6, 1]], 2)
    x, out = torch.zeros(16), torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 key slots"):
        fair_cast_runs(x, runs=runs, keys=[1], out=out)
    with pytest.raises(ValueError, match="reach element 15"):
        fair_cast_runs(x[:12], runs=runs, keys=[1, 2], out=out[:12])
    with pytest.raises(ValueError, match="index-free"):
        fair_cast_runs(x, runs=runs, keys=[1, 2], out=out, mode="error_feedback")
    with pytest.raises(ValueError, match="share memory"):
        fair_cast_runs(x, runs=runs, keys=[1, 2], out=x.view(torch.bfloat16)[:16])
