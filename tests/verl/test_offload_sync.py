"""verl ``param_offload``: the export waits for verl's non_blocking offload copies before its first host read
(docs/gpu-paths.md, finding 2). ``torch.cuda`` is replaced by a recorder (no GPU here): the offloaded shards are
ordinary CPU tensors, and the casts Fair Cast runs on them are recorded in the same list."""
from __future__ import annotations

import types

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster
from faircast_plugins.verl import engine

N = 8


class Recorder:
    def __init__(self, monkeypatch, cuda: bool):
        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
        stream = types.SimpleNamespace(synchronize=lambda: self.calls.append("stream.synchronize"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("synchronize"))


def _state(monkeypatch, recorder, **cfg):
    """One registered parameter ``w`` whose (offloaded, full) master shard lives on the CPU; every cast of it is
    recorded."""
    caster = FairCaster(FairCastConfig(enabled=True, seed=1, **cfg))
    master = torch.linspace(-1, 1, N, dtype=torch.float32) / 3
    monkeypatch.setattr(engine, "registered_shards", lambda module: {"w": (0, master)})
    real_cast, real_fair_cast = caster.cast, engine.fair_cast

    def cast(name, m, **kw):
        recorder.calls.append(("cast", m.device.type))
        return real_cast(name, m, **kw)

    def fair_cast(m, **kw):
        recorder.calls.append(("cast", m.device.type))
        return real_fair_cast(m, **kw)

    monkeypatch.setattr(caster, "cast", cast)
    monkeypatch.setattr(engine, "fair_cast", fair_cast)
    return engine.EngineFairCast(caster, {"w": "w"}, module=None, canonical={"w"}), master


@pytest.mark.parametrize("cfg", [{}, {"mode": "error_feedback"}, {"ema_decay": 0.5}],
                         ids=["stateless", "error_feedback", "ema"])
def test_export_of_offloaded_masters_waits_for_the_offload_copy_first(monkeypatch, cfg):
    rec = Recorder(monkeypatch, cuda=True)
    state, master = _state(monkeypatch, rec, **cfg)
    out = list(engine.cast_export(state, [("w", master.clone()), ("buffer", torch.ones(2))]))
    assert [n for n, _ in out] == ["w", "buffer"] and out[0][1].dtype == torch.bfloat16
    assert rec.calls[0] == "stream.synchronize" and ("cast", "cpu") in rec.calls
    assert rec.calls.count("stream.synchronize") == 1  # once per export, not per tensor


def test_delta_sharded_export_of_offloaded_shards_waits_for_the_offload_copy_first(monkeypatch):
    pytest.importorskip("verl")
    rec = Recorder(monkeypatch, cuda=True)
    state, master = _state(monkeypatch, rec)
    spec = types.SimpleNamespace(place=0, full_shape=(N,))
    out = list(engine.cast_local_shards(state, [("w", master.to(torch.bfloat16), spec)], fsdp_version=2))
    assert len(out) == 1 and out[0][1].dtype == torch.bfloat16
    assert rec.calls[0] == "stream.synchronize" and rec.calls[1] == ("cast", "cpu")


@pytest.mark.parametrize("cfg", [{}, {"mode": "error_feedback"}], ids=["stateless", "error_feedback"])
def test_without_cuda_the_export_makes_no_stream_call(monkeypatch, cfg):
    """Negative control: a CPU-only process has no copies in flight, so nothing is synchronized."""
    rec = Recorder(monkeypatch, cuda=False)
    state, master = _state(monkeypatch, rec, **cfg)
    list(engine.cast_export(state, [("w", master.clone())]))
    assert rec.calls and all(c[0] == "cast" for c in rec.calls)


def test_shards_on_the_gpu_need_no_host_wait(monkeypatch):
    """Negative control: without offload (shards on the GPU) the casts are stream-ordered: no host synchronize."""
    rec = Recorder(monkeypatch, cuda=True)
    engine.wait_for_offload_copies([torch.empty(1, device="meta")])
    assert rec.calls == []
    engine.wait_for_offload_copies([torch.empty(1, device="meta"), torch.empty(1)])
    assert rec.calls == ["stream.synchronize"]
