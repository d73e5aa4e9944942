"""Audit metrics: how far the served bf16 copy is from the fp32 master, measured on a fixed sample.

Each observed parameter contributes up to ``sample`` elements at fixed, evenly spaced positions, so the
cost per step is bounded on any model size (a 7B model at the default 4096 per parameter reads ~1.2M
elements). Between two consecutive observed weight versions the tracker reports:

``faircast/served_changed_frac``
    fraction of sampled served (bf16) elements whose bits changed since the previous export.
``faircast/master_moved_frac``
    fraction of sampled fp32 master elements that changed.
``faircast/lag_steps``
    how many steps the served copy trails the master. With ``D`` the master's mean per-step update over the
    last ``window`` versions, ``lag = sum((x - q) * D) / sum(D * D)``: the number of recent updates that the
    master holds and the served copy ``q`` does not. About 0 when the served copy follows the master in
    expectation (stochastic rounding, error feedback); it climbs when updates below half a bf16 step pile
    up unexported (round-to-nearest).
``faircast/bias``
    ``|mean(sign(d) * (w - d))|`` over moved elements, where ``d`` is the fp32 update and ``w`` the update
    the served copy received (``q_now - q_prev``): the mean signed deviation of the written update along the
    update's direction. ``faircast/bias_rel`` divides it by ``mean(|d|)``: 1 means every update was lost,
    0 means the written updates are unbiased. Under stochastic rounding one step's written update is noisy
    (each element moves by 0 or a whole bf16 step), but the deviations telescope: summed over the steps
    between two reports they stay bounded while the fp32 updates add up, so read it over tens of steps:
    ``faircast/bias_rel_cumulative`` is the same ratio over everything observed since the tracker started.

The cast site never waits for the device: :meth:`Audit.observe` gathers the samples where the tensors are and
queues their copy to the host (non-blocking, into pinned memory, on CUDA); the sums are taken on the CPU, where the
audit keeps all its state (so one parameter may be observed on the GPU and on the host), when they are read.

Totals are plain sums (see :meth:`Audit.totals`): :func:`reduce_metrics` adds them over every rank before
the ratios, the one metrics reduction every adapter uses (so each reports the same ``faircast/*`` set).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Dict, Optional

import torch

#: served dtype -> the integer dtype its bits are compared in
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
TOTAL_KEYS = ("n", "served_changed", "master_moved", "moved", "dev_along", "abs_update", "lag_num", "lag_den")


def sample_positions(numel: int, sample: int, device) -> Optional[torch.Tensor]:
    """Fixed, evenly spaced flat positions (None = all elements): ``round(i * (numel - 1) / (sample - 1))`` for
    ``i < sample``, in exact int64 arithmetic, so the last one is ``numel - 1`` at any size. (A float32 ``linspace``
    rounds ``numel - 1`` up to ``numel`` above 2**24 elements: one position past the end.)"""
    if sample < 1:
        raise ValueError(f"audit sample must be at least 1, got {sample}")
    if numel <= sample:
        return None
    if sample == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    span = sample - 1
    if 2 * span * (numel - 1) + span >= 2**63:  # the largest intermediate below must fit int64
        raise ValueError(f"audit positions of {numel} elements at sample {sample} overflow int64: lower audit_sample")
    i = torch.arange(sample, dtype=torch.int64, device=device)
    return (2 * i * (numel - 1) + span) // (2 * span)  # round half up, all in int64


def _async_copy_ok(device: torch.device) -> bool:
    """True where a device-to-host copy can be queued without waiting (CUDA, into pinned memory)."""
    return device.type == "cuda" and torch.cuda.is_available()


def _pinned_empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _to_host(t: torch.Tensor):
    """A CPU copy of ``t``, and whether it is still in flight: on CUDA a non-blocking copy into pinned memory,
    ordered on ``t``'s current stream (after the cast that wrote it), so the cast site never waits for the device."""
    if t.device.type == "cpu":
        return t.clone(), False
    if _async_copy_ok(t.device):
        buf = _pinned_empty(t.shape, t.dtype)
        buf.copy_(t, non_blocking=True)
        return buf, True
    return t.to("cpu"), False  # another accelerator: a blocking copy


def _copied_event(device: torch.device):
    """An event on ``device``'s current stream, after the copies queued there: the report waits for it."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _Track:
    """One parameter's (or shard's) samples. Its state is on the CPU whatever the device of the observations, so
    one parameter may be observed on the GPU and on the host (offloaded shards, FSDP all-gathers)."""

    def __init__(self, pos, window: int):
        self.pos = pos  # CPU int64 positions, or None (all elements)
        self.pos_on: Dict[torch.device, torch.Tensor] = {}  # their copy on each observation device (made once)
        self.pinned_pos: Optional[torch.Tensor] = None  # the pinned host copy those copies read (kept alive)
        self.observed = -1  # the last version observed (queued); ``version``: the last one measured
        self.version = -1
        self.served: Optional[torch.Tensor] = None
        self.history: Deque[torch.Tensor] = deque(maxlen=window + 1)

    def positions_on(self, like: torch.Tensor) -> torch.Tensor:
        pos = self.pos_on.get(like.device)
        if pos is None:
            pos = self.pos
            if like.device.type != "cpu":  # one host-to-device copy per track and device
                source, queued = pos, _async_copy_ok(like.device)
                if queued:  # from pinned memory, kept alive with the track, so the copy need not wait
                    if self.pinned_pos is None:
                        self.pinned_pos = _pinned_empty(pos.shape, pos.dtype).copy_(pos)
                    source = self.pinned_pos
                pos = like.new_empty(pos.shape, dtype=torch.int64).copy_(source, non_blocking=queued)
            self.pos_on[like.device] = pos
        return pos


class Audit:
    """Collects samples of (master, served) per parameter and weight version.

    :meth:`observe` only gathers the samples and queues their copy to the host (no host sync at the cast site);
    the sums are taken on the CPU, in observation order, when they are read (:meth:`totals`) or when many
    observations are queued."""

    #: settle the queue once it holds this many observations per track (bounds the host memory it holds)
    QUEUE_VERSIONS = 4

    def __init__(self, sample: int = 4096, window: int = 8):
        self.sample = sample
        self.window = window
        self._tracks: Dict[str, _Track] = {}
        self._queue: Deque[tuple] = deque()
        self._lock = threading.Lock()  # an export thread may observe while the trainer reads the totals
        self._totals = dict.fromkeys(TOTAL_KEYS, 0.0)
        self._cumulative = {"dev_along": 0.0, "abs_update": 0.0}

    def observe(self, name: str, version: int, master: torch.Tensor, served: torch.Tensor) -> None:
        """Record the master and the served copy of one parameter (or shard) at ``version``."""
        with self._lock:
            self._observe(name, version, master, served)

    def _observe(self, name: str, version: int, master: torch.Tensor, served: torch.Tensor) -> None:
        track = self._tracks.get(name)
        if track is None or (track.pos is None and master.numel() > self.sample):
            track = self._tracks[name] = _Track(sample_positions(master.numel(), self.sample, "cpu"), self.window)
        if version == track.observed:
            return  # the same version cast again (another cast site): nothing new to measure
        flat_x, flat_q = master.detach().reshape(-1), served.detach().reshape(-1)
        if track.pos is not None:
            flat_x, flat_q = flat_x[track.positions_on(flat_x)], flat_q[track.positions_on(flat_q)]
        x, x_in_flight = _to_host(flat_x)
        q_bits, q_in_flight = _to_host(flat_q.view(_BITS[flat_q.dtype]))  # bf16 served; fp32 where fp32 is served
        in_flight = {t.device: None for t, busy in ((flat_x, x_in_flight), (flat_q, q_in_flight)) if busy}
        ready = [_copied_event(device) for device in in_flight]  # one event per device covers its copies
        self._queue.append((track, version, x, q_bits, flat_q.dtype, ready))
        track.observed = version
        if len(self._queue) > self.QUEUE_VERSIONS * len(self._tracks):
            self._settle(wait=False)

    def _settle(self, wait: bool = True) -> None:
        """Measure the queued observations, in order, on the CPU: all of them, waiting for their copies (``wait``),
        or those whose copies are done (``wait=False``: at the cast site, which never waits for the device)."""
        while self._queue:
            track, version, x, q_bits, served_dtype, ready = self._queue[0]
            if not wait:
                if not all(event.query() for event in ready):
                    return
            else:
                for event in ready:
                    event.synchronize()  # the copies were queued after the cast: usually long done
            self._queue.popleft()
            self._measure(track, version, x.double(), q_bits, served_dtype)

    def _measure(self, track: _Track, version: int, x: torch.Tensor, q_bits: torch.Tensor, served_dtype) -> None:
        q = q_bits.view(served_dtype).double()
        if track.served is not None and version == track.version + 1:
            x_prev = track.history[-1]
            q_prev_bits = track.served
            d = x - x_prev
            w = q - q_prev_bits.view(served_dtype).double()
            moved = d != 0
            t = self._totals
            t["n"] += x.numel()
            t["served_changed"] += float((q_bits != q_prev_bits).sum())
            t["master_moved"] += float(moved.sum())
            t["moved"] += float(moved.sum())
            t["dev_along"] += float((torch.sign(d) * (w - d)).sum())
            t["abs_update"] += float(d.abs().sum())
            oldest = track.history[0]
            steps = len(track.history)
            drift = (x - oldest) / steps
            t["lag_num"] += float(((x - q) * drift).sum())
            t["lag_den"] += float((drift * drift).sum())
        elif track.served is not None and version != track.version + 1:
            track.history.clear()  # a gap (resume, skipped export): restart the window
        track.history.append(x)
        track.served = q_bits
        track.version = version

    def totals(self, reset: bool = True) -> Dict[str, float]:
        """Raw sums since the last reset (all-reduce these across ranks, then call :func:`finalize`)."""
        with self._lock:
            self._settle()
            out = dict(self._totals)
            if reset:
                self._totals = dict.fromkeys(TOTAL_KEYS, 0.0)
        return out

    def metrics(self, reset: bool = True) -> Dict[str, float]:
        """This process's metrics (``reset=False``: a peek that leaves the sums and the cumulative bias as they are)."""
        return self.report(self.totals(reset), commit=reset)

    def report(self, totals: Dict[str, float], *, commit: bool = True) -> Dict[str, float]:
        """The ``faircast/*`` metrics of ``totals`` (this rank's, or summed over every rank), taken from the sums:
        they also go into ``faircast/bias_rel_cumulative``, the same ratio over everything reported so far
        (``commit=False``: a peek, the cumulative sums stay as they are)."""
        c = self._cumulative if commit else dict(self._cumulative)
        c["dev_along"] += totals.get("dev_along", 0.0)
        c["abs_update"] += totals.get("abs_update", 0.0)
        out = finalize(totals)
        if c["abs_update"]:
            out["faircast/bias_rel_cumulative"] = abs(c["dev_along"]) / c["abs_update"]
        return out


def finalize(t: Dict[str, float]) -> Dict[str, float]:
    """Turn summed totals into the ``faircast/*`` metrics (empty when nothing was measured yet)."""
    if not t.get("n"):
        return {}
    out = {
        "faircast/served_changed_frac": t["served_changed"] / t["n"],
        "faircast/master_moved_frac": t["master_moved"] / t["n"],
    }
    if t["moved"]:
        out["faircast/bias"] = abs(t["dev_along"] / t["moved"])
        out["faircast/bias_rel"] = abs(t["dev_along"]) / t["abs_update"] if t["abs_update"] else 0.0
    if t["lag_den"]:
        out["faircast/lag_steps"] = t["lag_num"] / t["lag_den"]
    return out


def reduce_metrics(caster, *, group=None, device=None) -> Dict[str, float]:
    """``faircast/*`` metrics of ``caster`` since the last call, with the audit sums added over every rank of
    ``group`` before the ratios: the one metrics reduction of every adapter. ``caster``: a
    :class:`~faircast_plugins.caster.FairCaster` (read: its ``version`` and its :class:`Audit`; not imported here,
    the caster sits above the audit).

    A collective when a process group is initialized and the audit is on: every rank must call it. Ranks that cast
    the same full tensors (DDP) give the same ratios as one; ranks that cast their own shards (FSDP, ZeRO) give
    the ratios over the whole model. ``device``: where the sums travel (default: the current CUDA device under
    NCCL, else the CPU)."""
    out = {"faircast/version": float(caster.version)}
    audit = caster.audit
    if audit is None:
        return out
    totals = audit.totals()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        if device is None:
            device = torch.cuda.current_device() if dist.get_backend(group) == "nccl" else "cpu"
        summed = torch.tensor([totals[k] for k in TOTAL_KEYS], dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=group)
        totals = dict(zip(TOTAL_KEYS, summed.cpu().tolist()))
    out.update(audit.report(totals))
    return out
