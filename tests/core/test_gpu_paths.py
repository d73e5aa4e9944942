"""The rounding engine's GPU paths, guarded on CPU (issue #20, findings 2-audit, 3, 7, 8, 10, 11).

No GPU here: the device paths are reached with test shims defined in this file only:

* :class:`OffHostTensor`: a CPU tensor that reports a non-CPU device (``meta``), so the code under test takes its
  device branches; every op runs on the wrapped CPU values, and host syncs (value reads, blocking copies to the host)
  are counted;
* :func:`fake_devices`: ``Tensor.device`` patched so chosen CPU tensors report ``cpu:0``, a second device that
  torch can still allocate on (a model split over devices in one process);
* a DTensor on a one-rank gloo group;
* ``torch.cuda`` pieces (events, streams, pinned memory) and the cast module's backend probes, monkeypatched.
"""
from __future__ import annotations

import contextlib
import logging
import socket

import pytest
import torch
from torch.utils._pytree import tree_map

from faircast_plugins import audit as audit_mod
from faircast_plugins import cast as cast_mod
from faircast_plugins import caster as caster_mod
from faircast_plugins import fair_cast, fair_cast_many
from faircast_plugins.audit import Audit
from faircast_plugins.caster import FairCaster
from faircast_plugins.config import FairCastConfig


# --------------------------------------------------------------------------------------------------------------
# Shims
# --------------------------------------------------------------------------------------------------------------


class OffHostTensor(torch.Tensor):
    """CPU values that say they live on ``meta`` (a stand-in for a GPU). Counts, on the class, the host syncs a real
    device would make: ``reads`` (``item``/``float``/``bool`` of a value), ``blocking_copies`` (to the host, waiting)
    and the ``async_copies`` (``non_blocking=True``) that would not wait."""

    DEVICE = torch.device("meta")
    reads = blocking_copies = async_copies = 0

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=cls.DEVICE, requires_grad=False,
        )
        t.inner = inner
        return t

    @classmethod
    def reset_counts(cls) -> None:
        cls.reads = cls.blocking_copies = cls.async_copies = 0

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        aten = torch.ops.aten
        device = kwargs.get("device")
        to_host = device is not None and torch.device(device).type == "cpu"
        if device is not None and torch.device(device) == cls.DEVICE:
            kwargs["device"] = torch.device("cpu")
        if func is aten._local_scalar_dense.default:
            cls.reads += 1
        elif func is aten._to_copy.default and to_host:
            cls.blocking_copies += 1
        elif func is aten.copy_.default and not isinstance(args[0], cls) and isinstance(args[1], cls):
            if kwargs.get("non_blocking") or (len(args) > 2 and args[2]):
                cls.async_copies += 1
            else:
                cls.blocking_copies += 1
        out = func(*tree_map(lambda t: t.inner if isinstance(t, cls) else t, args),
                   **tree_map(lambda t: t.inner if isinstance(t, cls) else t, kwargs))
        if func is aten.copy_.default:
            return args[0]
        if to_host:
            return out
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)


class FakeEvent:
    """``torch.cuda.Event`` stand-in: counts records and waits; ``done`` is what ``query()`` answers."""

    recorded = waited = 0
    done = True

    def record(self, stream=None):
        FakeEvent.recorded += 1

    def query(self):
        return FakeEvent.done

    def synchronize(self):
        FakeEvent.waited += 1


@contextlib.contextmanager
def mocked_cuda_copies(monkeypatch):
    """The audit's CUDA branch (pinned memory, non-blocking copy, an event) taken for :class:`OffHostTensor`."""
    FakeEvent.recorded = FakeEvent.waited = 0
    FakeEvent.done = True
    with monkeypatch.context() as m:
        m.setattr(audit_mod, "_async_copy_ok", lambda device: device == OffHostTensor.DEVICE)
        m.setattr(audit_mod, "_pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
        m.setattr(torch.cuda, "Event", FakeEvent)
        m.setattr(torch.cuda, "current_stream", lambda device=None: None)
        yield


@contextlib.contextmanager
def fake_devices(monkeypatch, tensors, device):
    """``t.device`` reads ``device`` for each of ``tensors`` (torch's kernels do not see it: they run on the CPU)."""
    ids = {id(t) for t in tensors}
    real = torch._C.TensorBase.device.__get__
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "device", property(lambda self: device if id(self) in ids else real(self)))
        yield


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def bits(t):
    return t.reshape(-1).view(torch.int16)


# --------------------------------------------------------------------------------------------------------------
# Finding 3: a DTensor (data_ptr() == 0) is refused before any kernel sees it
# --------------------------------------------------------------------------------------------------------------


def test_finding3_dtensor_is_refused_with_to_local_and_full_tensor_named(one_rank_gloo):
    from torch.distributed.tensor import Shard, distribute_tensor

    d = distribute_tensor(torch.randn(8, 4), one_rank_gloo, [Shard(0)])
    assert d.data_ptr() == 0 and d.is_contiguous()  # what made it slip through
    calls = {
        "fair_cast": lambda: fair_cast(d, key=1),
        "fair_cast torch": lambda: fair_cast(d, key=1, backend="torch"),
        "fair_cast_many": lambda: fair_cast_many([d], keys=[1]),
        "out": lambda: fair_cast(torch.randn(8, 4), key=1, out=distribute_tensor(
            torch.empty(8, 4, dtype=torch.bfloat16), one_rank_gloo, [Shard(0)])),
    }
    for what, call in calls.items():
        with pytest.raises(TypeError, match=r"DTensor.*to_local\(\).*full_tensor\(\)"):
            call()
    for config in (FairCastConfig(enabled=True, ema_decay=0.5), FairCastConfig(enabled=True, mode="error_feedback")):
        caster = FairCaster(config)
        with pytest.raises(TypeError, match=r"DTensor.*model.w.*to_local"):
            caster.cast("model.w", d)
        with pytest.raises(TypeError, match=r"DTensor.*to_local"):
            caster.cast_many({"model.w": d})
        assert not caster._ema and not caster._ef  # refused before any state was made from it
    # negative control: its local shard casts, with the same bits as the plain tensor
    local = d.to_local()
    assert torch.equal(bits(fair_cast(local, key=1)), bits(fair_cast(local.clone(), key=1)))


def test_finding3_a_tensor_with_elements_and_no_storage_pointer_is_refused():
    for t in (torch.empty(4, device="meta"), OffHostTensor(torch.randn(4))):
        with pytest.raises(TypeError, match=r"data_ptr\(\) == 0"):
            fair_cast(t, key=1, backend="torch")
    assert fair_cast(torch.empty(0, device="meta"), key=1).numel() == 0  # nothing to address: still fine


# --------------------------------------------------------------------------------------------------------------
# Findings 7 and 11: backend="auto" for CUDA tensors
# --------------------------------------------------------------------------------------------------------------


class _FakeTritonModule:
    def __init__(self, interpreting: bool):
        self._interpreting = interpreting

    def interpreting(self) -> bool:
        return self._interpreting


def _auto_cuda(monkeypatch, caplog, *, importable: bool, interpreting: bool = False, calls: int = 2):
    monkeypatch.setattr(cast_mod, "_LOGGED", set())
    monkeypatch.setattr(cast_mod, "_importable", lambda backend: importable if backend == "triton" else True)
    monkeypatch.setattr(cast_mod, "_kernel_module", lambda backend: _FakeTritonModule(interpreting))
    monkeypatch.setitem(cast_mod._IMPORT_ERRORS, "triton", "ImportError: no module named triton")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="faircast_plugins"):
        chosen = [cast_mod.resolve_backend("auto", torch.device("cuda", i)) for i in range(calls)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return chosen, warnings


def test_finding7_auto_on_cuda_warns_once_when_triton_does_not_import(monkeypatch, caplog):
    chosen, warnings = _auto_cuda(monkeypatch, caplog, importable=False)
    assert chosen == ["torch", "torch"]
    assert len(warnings) == 1 and "triton does not import" in warnings[0] and "ImportError" in warnings[0]
    assert "pip install 'triton>=3.2'" in warnings[0]  # a package that exists on PyPI, not this one's extra
    assert "backend='torch'" in warnings[0]  # how to silence it
    # negative control: triton imports (not interpreted): Triton, and nothing to warn about
    chosen, warnings = _auto_cuda(monkeypatch, caplog, importable=True)
    assert chosen == ["triton", "triton"] and warnings == []


def test_finding11_auto_on_cuda_under_triton_interpret_uses_the_torch_path(monkeypatch, caplog):
    chosen, warnings = _auto_cuda(monkeypatch, caplog, importable=True, interpreting=True)
    assert chosen == ["torch", "torch"]
    assert len(warnings) == 1 and "TRITON_INTERPRET=1" in warnings[0]
    # explicit backend="triton" is not rerouted: the Triton backend keeps its clear refusal
    monkeypatch.undo()
    if not cast_mod._importable("triton"):
        return
    from faircast_plugins.kernels import triton_cast

    if triton_cast.interpreting():
        assert cast_mod.resolve_backend("triton", torch.device("cuda")) == "triton"
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1 the Triton backend casts CPU tensors only"):
            triton_cast._check_device(torch.device("cuda"))
        # and CPU tensors under the interpreter still go to Triton when asked for
        x = torch.randn(64)
        assert torch.equal(bits(fair_cast(x, key=5, backend="triton")), bits(fair_cast(x, key=5, backend="torch")))


def test_finding11_the_real_interpreter_flag_reroutes_auto(monkeypatch, caplog):
    """In this venv (TRITON_INTERPRET=1) with the real triton module: CUDA tensors get the torch path."""
    if not cast_mod._importable("triton"):
        pytest.skip("triton does not import here")
    from faircast_plugins.kernels import triton_cast

    if not triton_cast.interpreting():
        pytest.skip("triton is not interpreted here")
    monkeypatch.setattr(cast_mod, "_LOGGED", set())
    assert cast_mod.resolve_backend("auto", torch.device("cuda")) == "torch"


# --------------------------------------------------------------------------------------------------------------
# Finding 10: FairCaster.cast_many over a model split across devices in one process
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stochastic", "sticky", "nearest"])
def test_finding10_cast_many_groups_by_device_with_per_tensor_bits(monkeypatch, mode):
    torch.manual_seed(0)
    masters = {f"model.layers.{i}.w": torch.randn(37 + 8 * i) for i in range(6)}
    on_second = [t for i, t in enumerate(masters.values()) if i % 2]  # layers 1, 3, 5 on the second device
    second = torch.device("cpu", 0)
    config = FairCastConfig(enabled=True, mode=mode, seed=7, audit=True)
    launches = []
    real_many = caster_mod.fair_cast_many

    def spy(xs, **kwargs):
        launches.append([x.device for x in xs])
        return real_many(xs, **kwargs)

    with fake_devices(monkeypatch, on_second, second):
        assert len({t.device for t in masters.values()}) == 2
        with pytest.raises(ValueError, match="needs one device"):  # the engine itself stays one launch, one device
            fair_cast_many(list(masters.values()), keys=[1] * 6)
        monkeypatch.setattr(caster_mod, "fair_cast_many", spy)
        batched = FairCaster(config).cast_many(masters)
        single = FairCaster(config)
        one_by_one = {n: single.cast(n, x) for n, x in masters.items()}
    assert list(batched) == list(masters)  # order preserved
    for name in masters:
        assert torch.equal(bits(batched[name]), bits(one_by_one[name])), name
    assert launches == [[torch.device("cpu")] * 3, [second] * 3]  # one launch per device, first-seen order


def test_finding10_one_device_is_still_one_launch(monkeypatch):
    masters = {f"w{i}": torch.randn(16) for i in range(4)}
    launches = []
    real_many = caster_mod.fair_cast_many
    monkeypatch.setattr(caster_mod, "fair_cast_many", lambda xs, **kw: launches.append(len(xs)) or real_many(xs, **kw))
    FairCaster(FairCastConfig(enabled=True, seed=1)).cast_many(masters)
    assert launches == [4]


# --------------------------------------------------------------------------------------------------------------
# Findings 8 and 2 (audit part): no host sync at the cast site; sample state on the CPU
# --------------------------------------------------------------------------------------------------------------


def _versions(numel: int, n_versions: int, seed: int = 0):
    """(master, served) per version: a master drifting by small steps, served with Fair Cast."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    out = []
    for v in range(n_versions):
        x = x + 1e-3 * torch.randn(numel, generator=g)
        out.append((x.clone(), fair_cast(x, key=v + 1, backend="torch")))
    return out


def _cpu_state(audit: Audit):
    for track in audit._tracks.values():
        tensors = [track.pos, track.served, *track.history]  # (pos_on: the positions' copy on each device, an index)
        for t in tensors:
            if t is not None and (type(t) is not torch.Tensor or t.device.type != "cpu"):
                yield t


@pytest.mark.parametrize("numel,sample", [(300, 64), (48, 64)])
def test_finding2_audit_observes_one_parameter_on_two_devices_with_cpu_state(numel, sample):
    steps = _versions(numel, 6)
    mixed, cpu_only = Audit(sample=sample, window=3), Audit(sample=sample, window=3)
    for v, (x, q) in enumerate(steps):
        on_device = v % 2 == 0  # version 0 on the "GPU", 1 on the host, 2 on the "GPU", ...
        mixed.observe("w", v, OffHostTensor(x) if on_device else x, OffHostTensor(q) if on_device else q)
        cpu_only.observe("w", v, x, q)
        if v == 3:
            assert mixed.metrics() == cpu_only.metrics()
    assert not list(_cpu_state(mixed))
    assert mixed.metrics() == cpu_only.metrics() != {}


def test_finding8_observe_makes_no_host_sync_on_a_device(monkeypatch):
    steps = _versions(4096, 4)
    audit = Audit(sample=1024)
    OffHostTensor.reset_counts()
    with mocked_cuda_copies(monkeypatch):
        for v, (x, q) in enumerate(steps):
            audit.observe("w", v, OffHostTensor(x), OffHostTensor(q))
        assert (OffHostTensor.reads, OffHostTensor.blocking_copies) == (0, 0), "a host sync at the cast site"
        assert OffHostTensor.async_copies == 2 * len(steps)  # the master's and the served copy's samples
        assert FakeEvent.recorded == len(steps) and FakeEvent.waited == 0  # one event per observation
        device_metrics = audit.metrics()
        assert FakeEvent.waited == FakeEvent.recorded  # waited for at the report, not at the cast
    cpu = Audit(sample=1024)
    for v, (x, q) in enumerate(steps):
        cpu.observe("w", v, x, q)
    assert device_metrics == cpu.metrics() != {}


def test_finding8_the_queue_is_bounded_and_settled_in_order():
    audit = Audit(sample=16, window=2)
    names = [f"p{i}" for i in range(3)]
    data = {n: _versions(40, 12, seed=i) for i, n in enumerate(names)}
    eager = Audit(sample=16, window=2)
    for v in range(12):
        for n in names:
            audit.observe(n, v, *data[n][v])
            assert len(audit._queue) <= Audit.QUEUE_VERSIONS * len(names) + 1
            eager.observe(n, v, *data[n][v])
            eager._settle()  # measure at once, as the code before the queue did
    assert audit.totals() == eager.totals()


def test_finding8_a_repeated_version_is_measured_once():
    (x0, q0), (x1, q1) = _versions(50, 2)
    a, b = Audit(), Audit()
    for audit, repeats in ((a, 1), (b, 3)):
        audit.observe("w", 0, x0, q0)
        for _ in range(repeats):
            audit.observe("w", 1, x1, q1)
    assert a.metrics() == b.metrics() != {}


def test_finding8_a_long_queue_is_settled_at_the_cast_site_only_when_its_copies_are_done(monkeypatch):
    steps = _versions(64, 3 * Audit.QUEUE_VERSIONS)
    with mocked_cuda_copies(monkeypatch):
        FakeEvent.done = False  # the device is behind: observe must not wait
        busy = Audit(sample=16)
        for v, (x, q) in enumerate(steps):
            busy.observe("w", v, OffHostTensor(x), OffHostTensor(q))
        assert FakeEvent.waited == 0 and len(busy._queue) == len(steps)
        FakeEvent.done = True  # copies done: the queue is measured as it grows, still without waiting for any
        idle = Audit(sample=16)
        for v, (x, q) in enumerate(steps):
            idle.observe("w", v, OffHostTensor(x), OffHostTensor(q))
        assert len(idle._queue) <= Audit.QUEUE_VERSIONS + 1 and FakeEvent.waited == 0
        assert busy.metrics() == idle.metrics() != {}
