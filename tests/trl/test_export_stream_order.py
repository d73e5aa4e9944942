"""The export waits for the stream the served copy was written on (docs/gpu-paths.md, finding 4): vLLM's server-mode
producer pulls the export inside its own side stream, AsyncGRPO's weight sender in another thread. ``torch.cuda`` is
replaced by a recorder (no GPU here); the callback runs on a stand-in trainer and backend that record when the served
copy is written and when a tensor is pulled from the export."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster
from faircast_plugins.trl.callback import FairCastCallback

DEVICE = torch.device("cuda", 0)


class FakeCuda:
    """Records stream calls; ``current_stream`` is per thread, and ``side()`` stands for ``torch.cuda.stream(side)``."""

    def __init__(self, monkeypatch, calls, available=True):
        self.calls, self.local = calls, threading.local()
        self.default = self._stream("default")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: available)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: self.default)
        monkeypatch.setattr(torch.cuda, "Event", self._event)

    def _stream(self, name):
        calls = self.calls
        return types.SimpleNamespace(
            name=name,
            wait_event=lambda event: calls.append(f"{name}.wait_event({event.recorded_on})"),
            wait_stream=lambda other: calls.append(f"{name}.wait_stream({other.name})"),
        )

    def _event(self):
        calls = self.calls
        event = types.SimpleNamespace(recorded_on=None)

        def record(stream):
            event.recorded_on = stream.name
            calls.append(f"record({stream.name})")

        event.record = record
        return event

    def current_stream(self, device=None):
        assert device is None or torch.device(device) == DEVICE
        return getattr(self.local, "stream", None) or self.default

    def side(self):
        self.local.stream = self._stream("side")


class Backend:
    """Stand-in backend: writes the served copy at prepare/begin/after_step; the export is a passthrough."""

    ready = serves_export = True

    def __init__(self, calls):
        self.calls = calls

    def prepare(self):
        self.calls.append("serve")

    def begin(self, state, resume_dir):
        self.calls.append("serve")

    def after_step(self):
        self.calls.append("serve")

    def export(self, stream):
        yield from stream


def _callback(calls, device=DEVICE):
    cb = FairCastCallback.__new__(FairCastCallback)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    cb.trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(device=device), args=None, optimizer=optimizer)
    cb.config = FairCastConfig(enabled=True, seed=1)
    cb.caster, cb.backend, cb.resume_dir, cb._served = FairCaster(cb.config), Backend(calls), None, None
    return cb


def _source(calls):
    for i in range(2):
        calls.append(f"pull {i}")
        yield f"w{i}", torch.zeros(2)


def _trained(cb):
    """Built (serves version 0), train begin (serves again), one optimizer step (serves version 1)."""
    cb.prepare()
    cb.on_train_begin(None, types.SimpleNamespace(global_step=0), None)
    cb.on_optimizer_step(None, None, None)


def test_server_mode_side_stream_waits_for_the_served_copy_before_the_first_tensor(monkeypatch):
    calls = []
    cuda = FakeCuda(monkeypatch, calls)
    cb = _callback(calls)
    _trained(cb)
    cuda.side()  # vLLM's packed_nccl_broadcast_producer: `with torch.cuda.stream(side_stream):` around the loop
    names = [n for n, _ in cb.export(_source(calls))]
    assert names == ["w0", "w1"]
    assert calls[-4:] == ["record(default)", "side.wait_event(default)", "pull 0", "pull 1"]
    assert calls[-5] == "serve"  # the event is recorded after the newest serve


def test_async_grpo_sender_thread_waits_for_the_served_copy(monkeypatch):
    calls = []
    FakeCuda(monkeypatch, calls)
    cb = _callback(calls)
    _trained(cb)
    out = []
    sender = threading.Thread(target=lambda: out.extend(n for n, _ in cb.export(_source(calls))))
    sender.start()
    sender.join()
    assert out == ["w0", "w1"]
    assert calls[-3:] == ["default.wait_event(default)", "pull 0", "pull 1"]


def test_before_any_serve_the_export_waits_for_the_default_stream(monkeypatch):
    calls = []
    cuda = FakeCuda(monkeypatch, calls)
    cb = _callback(calls)
    cuda.side()
    list(cb.export(_source(calls)))
    assert calls[:2] == ["side.wait_stream(default)", "pull 0"]


@pytest.mark.parametrize("available,device", [(False, DEVICE), (True, torch.device("cpu"))], ids=["no_cuda", "cpu_trainer"])
def test_on_cpu_no_stream_call_is_made(monkeypatch, available, device):
    """Negative control: a CPU run (no CUDA, or a CPU trainer in a CUDA process) records and waits on nothing."""
    calls = []
    FakeCuda(monkeypatch, calls, available=available)
    cb = _callback(calls, device)
    _trained(cb)
    assert [n for n, _ in cb.export(_source(calls))] == ["w0", "w1"]
    assert calls == ["serve", "serve", "serve", "pull 0", "pull 1"]
