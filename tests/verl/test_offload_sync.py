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
    monkeypatch.setattr(engine, "shard_groups", lambda module: {})  # the default group
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


# -- issue 29, finding 8: uneven FSDP2 shards and verl's non_blocking offload ----------------------------------

class _Shard:
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim


class _Replicate:
    def is_shard(self, dim=None):
        return False


def _dtensor_like(shape, placements, mesh_shape):
    mesh = types.SimpleNamespace(size=lambda dim=None: mesh_shape[dim] if dim is not None else int(torch.tensor(mesh_shape).prod()))
    return types.SimpleNamespace(shape=torch.Size(shape), placements=placements, device_mesh=mesh)


def test_uneven_fsdp2_shards_are_found_from_the_global_shape_on_every_rank():
    """A Shard(0) parameter whose first dimension the shard group does not divide is padded on the short ranks: the
    same answer on every rank (from the global shape), for FSDP2 and HSDP (Replicate, Shard) meshes."""
    from faircast_plugins.fsdp import uneven_shards

    params = {"even": _dtensor_like((12, 5), [_Shard(0)], (4,)), "uneven": _dtensor_like((10, 5), [_Shard(0)], (4,)),
              "hsdp_even": _dtensor_like((6, 5), [_Replicate(), _Shard(0)], (4, 2)),
              "hsdp_uneven": _dtensor_like((7, 5), [_Replicate(), _Shard(0)], (4, 2)),
              "plain": torch.zeros(3, 3)}
    module = types.SimpleNamespace(named_parameters=lambda: iter(params.items()))
    assert uneven_shards(module) == ["uneven", "hsdp_uneven"]


def test_offload_of_a_module_with_uneven_shards_is_blocking():
    """torch re-pads an uneven FSDP2 shard with a host copy inside ``module.to("cpu", non_blocking=True)``
    (``FSDPParam.reset_sharded_param``), reading the pinned destination before the device-to-host copy has landed:
    Fair Cast would export stale masters. For a module with uneven shards under Fair Cast the offload is a blocking
    copy; other modules keep verl's non_blocking offload (negative control)."""
    pytest.importorskip("verl")
    from faircast_plugins.verl import patches

    seen = []

    class Module:
        def to(self, device, non_blocking=False):
            seen.append((device, non_blocking))

    def verl_offload(model, empty_cache=True):
        model.to("cpu", non_blocking=True)

    offload = patches._wrap_offload(verl_offload)
    plain, marked = Module(), Module()
    engine.mark_blocking_offload(marked)
    offload(plain)
    offload(marked, empty_cache=False)
    assert seen == [("cpu", True), ("cpu", False)]


# -- issue 29, finding 5: the stateful export of offloaded masters casts on the device, state stays there -------

@pytest.mark.parametrize("cfg", [{"mode": "error_feedback"}, {"ema_decay": 0.5}], ids=["error_feedback", "ema"])
def test_stateful_export_of_an_offloaded_shard_casts_on_the_export_device(monkeypatch, cfg):
    """verl's param_offload leaves the master shards on the host while the export's tensors are on the GPU: the
    error-feedback/EMA assembly stages the shard to the export's device and casts there, so the residual (or EMA),
    which follows the cast's input (tests/core/test_caster.py), stays on the device it lives on at the all-gather:
    no host cast, no state moving device every step. The "meta" device stands in for the GPU (the cast is recorded,
    not run). Control: a shard already on the export's device is not copied, nor a host shard for a host export."""
    from faircast_plugins.fsdp import assemble_served, stage_for_cast

    caster = FairCaster(FairCastConfig(enabled=True, seed=1, **cfg))
    gpu, seen = torch.device("meta"), []
    monkeypatch.setattr(caster, "cast", lambda name, m, **kw: seen.append(m.device) or
                        torch.zeros(m.numel(), dtype=torch.bfloat16, device=m.device))
    host_master = torch.linspace(-1, 1, N, dtype=torch.float32) / 3
    q = assemble_served(caster, "w", (0, host_master), (N,), gpu)
    assert seen == [gpu] and q.device == gpu and q.dtype == torch.bfloat16
    on_device = torch.zeros(N, device=gpu)
    assert stage_for_cast(on_device, gpu) is on_device and stage_for_cast(host_master, torch.device("cpu")) is host_master
    # FSDP's own CPU offload casts on the host at every all-gather, where the state then lives: it stays there
    assert stage_for_cast(host_master, gpu, torch.device("cpu")) is host_master
