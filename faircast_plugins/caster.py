"""FairCaster: the stateful engine every adapter shares.

It owns the weight version, canonical names, the error-feedback residuals, the EMA of the master and the
audit tracker, and it round-trips through ``state_dict()`` / ``load_state_dict()`` so a resumed run serves
bit-identical copies.

Lifecycle in an adapter::

    caster = FairCaster(config)             # version 0: before the first optimizer step
    q = caster.cast(name, master_shard, offset=global_offset)   # any number of cast sites, same bits
    optimizer.step()
    caster.advance(named_masters)           # version += 1 (EMA update when ema_decay > 0)
    caster.rollback()                       # the step was skipped and nothing was cast: version -= 1
    caster.set_version(step)                # a fresh caster resuming at the trainer's step without saved state

Adapters read ``caster.version`` and never assign it: :meth:`advance`, :meth:`rollback`, :meth:`set_version` and
:meth:`load_state_dict` are the only ways it moves.

Casting the same parameter twice at one version gives the same bits in every mode: ``stochastic``, ``sticky``
and ``nearest`` are pure functions of (master, seed, version, name, index); ``error_feedback`` advances its
residual once per version and keeps that version's served copy (2 B/param) for repeated cast sites.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

import torch

from .audit import Audit
from .cast import check_local_tensor, fair_cast, fair_cast_many
from .config import FairCastConfig
from .key import canonical_name, mode_key

Named = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]

STATE_FORMAT = 1


def _items(named: Named):
    return named.items() if isinstance(named, Mapping) else named


def audit_track(name: str, offset: int, x: torch.Tensor) -> str:
    """One audit track per (parameter, shard): a full-tensor cast and a shard cast of one name stay apart."""
    return f"{name}@{offset}+{x.numel()}"


def group_by_device(tensors) -> list:
    """Positions of ``tensors`` grouped by device, groups in order of first appearance, positions in order."""
    groups: Dict[torch.device, list] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return list(groups.values())


def _ema_step(m: torch.Tensor, x: torch.Tensor, decay: float) -> None:
    """``m = m + (1 - decay) * (x - m)`` in fp32, each operation rounded on its own (no fused multiply-add), so the
    bits do not depend on the device, the kernel or where a shard starts."""
    d = x.detach().to(m.device) - m
    d.mul_(1.0 - decay)
    m.add_(d)


def _beside(t: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Per-element state kept next to ``master``: on its device, and pinned when the master is pinned host memory
    (FSDP CPU offload), so its copies to the GPU stay asynchronous like the master's."""
    if t.device != master.device:
        t = t.to(master.device)
    if t.device.type == "cpu" and master.is_pinned() and not t.is_pinned():
        t = t.pin_memory()
    return t


class _Residual:
    """Error-feedback state of one parameter (or shard): residual entering ``version``, and the last served copy."""

    __slots__ = ("residual", "version", "offset", "served")

    def __init__(self, residual: torch.Tensor, version: int, offset: int, served: Optional[torch.Tensor] = None):
        self.residual, self.version, self.offset, self.served = residual, version, offset, served


class FairCaster:
    """Casts fp32 masters to the served bf16 copy at the current weight version."""

    #: set by an adapter that measures the ``faircast/policy_*`` metrics itself (TRL's backends): the cast-site patches
    #: refuse ``policy_metrics_every`` only where nothing measures it
    policy_measured = False

    def __init__(self, config: Optional[FairCastConfig] = None, *, version: int = 0):
        self.config = config if config is not None else FairCastConfig(enabled=True)
        self.version = version
        self._ef: Dict[str, _Residual] = {}
        self._ema: Dict[str, torch.Tensor] = {}
        self.audit = Audit(self.config.audit_sample) if self.config.audit else None

    # -- keys and names -------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.config.effective_mode

    def key(self, name: str) -> int:
        """The Philox key of ``name`` at the current version (``sticky``: the same at every version)."""
        return mode_key(self.config.seed, self.version, canonical_name(name), self.mode)

    @property
    def keeps_state(self) -> bool:
        """True with per-element state (error feedback, EMA): checkpoints must carry it, and under sharding it is
        per-rank state of each rank's shard (see :attr:`FairCastConfig.keeps_state`)."""
        return self.config.keeps_state

    # -- casting --------------------------------------------------------------------------------------------
    @property
    def ema_on(self) -> bool:
        """True when casts read an EMA of the master (``ema_decay > 0`` and Fair Cast enabled)."""
        return bool(self.config.enabled and self.config.ema_decay)

    def source(self, name: str, master: torch.Tensor) -> torch.Tensor:
        """The tensor the cast reads: the master, or its EMA when ``ema_decay > 0`` (on the master's device)."""
        if not self.ema_on:
            return master
        name = canonical_name(name)
        m = self._ema.get(name)
        if m is None:
            m = self._ema[name] = _beside(master.detach().clone(), master)
        elif m.device != master.device or m.device.type == "cpu":  # e.g. restored on the CPU: moved (pinned) once
            m = self._ema[name] = _beside(m, master)
        return m

    def state_device(self, name: str) -> Optional[torch.device]:
        """Where ``name``'s per-element state (error-feedback residual, EMA) lives, or None without any yet."""
        name = canonical_name(name)
        state = self._ema.get(name) if self.ema_on else getattr(self._ef.get(name), "residual", None)
        return None if state is None else state.device

    def has_ema(self, name: str) -> bool:
        return canonical_name(name) in self._ema

    def update_ema(self, name: str, master: torch.Tensor, *, start: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One EMA step of one parameter, or of one shard of it, with its updated ``master``; returns the EMA.

        For cast sites that see the updated masters piece by piece (DeepSpeed's ZeRO partitions): the EMA is
        elementwise, so a shard's EMA is exactly that shard of the full EMA. Call it once per optimizer step,
        then :meth:`advance` with ``masters=()``. ``start``: the value the EMA had before this step when it
        has no state yet (default: the master itself). The EMA lives on the master's device.
        """
        if not self.ema_on:
            raise ValueError("update_ema needs Fair Cast enabled with ema_decay > 0")
        cname = canonical_name(name)
        m = self._ema.get(cname)
        if m is None:
            init = master if start is None else start
            m = self._ema[cname] = _beside(init.detach().to(device=master.device, dtype=torch.float32, copy=True), master)
        elif m.shape != master.shape:
            raise ValueError(
                f"the EMA of {cname} has shape {tuple(m.shape)}, its master {tuple(master.shape)}: the EMA is per-rank "
                f"state of this rank's shard; resume with the same sharding (ZeRO stage and world size)"
            )
        elif m.device != master.device or m.device.type == "cpu":
            m = self._ema[cname] = _beside(m, master)
        _ema_step(m, master, self.config.ema_decay)
        return m

    def cast(
        self,
        name: str,
        master: torch.Tensor,
        *,
        offset: int = 0,
        out: Optional[torch.Tensor] = None,
        indices: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The served bf16 copy of ``master`` (a full parameter, or a shard starting at global ``offset``)."""
        # a DTensor before any state (EMA, residual) is made from it; a launch checks storage pointers itself
        check_local_tensor(master, f"the master of {name}", storage=False)
        cname = canonical_name(name)
        src = self.source(cname, master)
        if self.mode == "error_feedback":
            q = self._cast_error_feedback(cname, src, offset, out)
        else:
            q = fair_cast(
                src, key=self.key(cname), offset=offset, mode=self.mode, backend=self.config.backend,
                out=out, indices=indices,
            )
        if self.audit is not None:
            self.audit.observe(audit_track(cname, offset, master), self.version, master, q)
        return q

    def cast_many(self, named: Named, *, offsets: Optional[Iterable[int]] = None) -> Dict[str, torch.Tensor]:
        """Cast many parameters at once: one batched launch per device when the mode allows (a model split over
        devices in one process, ``device_map``, gets one launch per device; the bits are those of per-tensor casts).
        Returns ``{name: bf16}`` in the order given."""
        pairs = list(_items(named))
        offsets = list(offsets) if offsets is not None else [0] * len(pairs)
        if self.mode == "error_feedback" or not pairs:
            return {n: self.cast(n, x, offset=o) for (n, x), o in zip(pairs, offsets)}
        for n, x in pairs:
            check_local_tensor(x, f"the master of {n}", storage=False)
        names = [canonical_name(n) for n, _ in pairs]
        srcs = [self.source(n, x) for n, (_, x) in zip(names, pairs)]
        keys = [self.key(n) for n in names]
        outs: list = [None] * len(pairs)
        for group in group_by_device(srcs):
            cast = fair_cast_many(
                [srcs[i] for i in group], keys=[keys[i] for i in group], offsets=[offsets[i] for i in group],
                mode=self.mode, backend=self.config.backend,
            )
            for i, q in zip(group, cast):
                outs[i] = q
        if self.audit is not None:
            for n, o, (_, x), q in zip(names, offsets, pairs, outs):
                self.audit.observe(audit_track(n, o, x), self.version, x, q)
        return {orig: q for (orig, _), q in zip(pairs, outs)}

    def _cast_error_feedback(self, name: str, src: torch.Tensor, offset: int, out: Optional[torch.Tensor]) -> torch.Tensor:
        state = self._ef.get(name)
        if state is None:
            state = self._ef[name] = _Residual(_beside(torch.zeros_like(src, dtype=torch.float32), src), self.version,
                                               offset)
        if state.offset != offset or state.residual.shape != src.shape:
            raise ValueError(
                f"error-feedback residual for {name} belongs to a shard at offset {state.offset} with shape "
                f"{tuple(state.residual.shape)}; got offset {offset}, shape {tuple(src.shape)}. The residual is "
                f"per-rank state: resume with the same sharding, or use mode='stochastic' or 'sticky'."
            )
        if state.residual.device != src.device or src.device.type == "cpu":
            state.residual = _beside(state.residual, src)
        if state.version == self.version + 1 and state.served is not None:
            if state.served.device != src.device:
                state.served = _beside(state.served, src)
            q = state.served  # this version was already cast: same bits again
            if out is not None:
                out.copy_(q)
                return out
            return q.clone()
        if state.version != self.version:
            raise RuntimeError(
                f"error-feedback residual for {name} is at version {state.version}, the caster at {self.version}: "
                f"every version must be cast exactly once in order (was a cast skipped, or state not restored?)"
            )
        q = fair_cast(src, key=0, mode="error_feedback", residual=state.residual, backend=self.config.backend, out=out)
        state.version = self.version + 1
        state.served = _beside(q.detach().clone(), src)
        return q

    # -- weight version -------------------------------------------------------------------------------------
    def advance(self, masters: Optional[Named] = None, steps: int = 1) -> int:
        """Move to the next weight version after an optimizer step; update the EMA from ``masters``.

        With ``ema_decay > 0`` the updated masters are required; pass ``masters=()`` when the cast site updates
        the EMA itself, shard by shard, with :meth:`update_ema`.
        """
        if steps < 1:
            raise ValueError("steps must be >= 1")
        if self.ema_on:
            if masters is None:
                raise ValueError("FairCaster.advance needs the updated masters when ema_decay > 0")
            for name, x in _items(masters):
                cname = canonical_name(name)
                m = self._ema.get(cname)
                if m is None:
                    m = self._ema[cname] = _beside(x.detach().clone(), x)
                elif m.device != x.device or m.device.type == "cpu":  # on the master's device (as update_ema does)
                    m = self._ema[cname] = _beside(m, x)
                for _ in range(steps):
                    _ema_step(m, x, self.config.ema_decay)
        if self.mode == "error_feedback" and steps > 1:
            raise ValueError("error_feedback casts every version: advance one step at a time")
        self.version += steps
        return self.version

    def rollback(self, steps: int = 1) -> int:
        """Undo ``steps`` :meth:`advance` calls whose optimizer step did not happen (skipped, or raised).

        Only the count moves back: refused once error feedback has cast a rolled-back version (its residual has
        absorbed that version and cannot be undone). EMA steps already taken are not undone either: call it
        before any :meth:`update_ema` of the rolled-back step."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"rollback steps must be an int >= 1, got {steps!r}")
        target = self.version - steps
        if target < 0:
            raise ValueError(f"cannot roll the weight version {self.version} back by {steps}: below 0")
        ahead = sorted(n for n, s in self._ef.items() if s.version > target + 1)
        if ahead:
            raise RuntimeError(
                f"cannot roll the weight version back to {target}: the error-feedback residual of {ahead[0]} "
                f"(and {len(ahead) - 1} more) already absorbed version {self._ef[ahead[0]].version - 1}"
            )
        self.version = target
        return target

    def set_version(self, version: int) -> None:
        """Start counting at ``version``: a caster resuming at the trainer's step from a checkpoint without Fair Cast
        state. Refused once per-element state (residuals, EMA) exists at another version: moving the count would
        make it state of a version it never saw (restore it with :meth:`load_state_dict` instead)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"a weight version is an int >= 0, got {version!r}")
        if version != self.version and (self._ef or self._ema):
            raise RuntimeError(
                f"cannot move the weight version from {self.version} to {version}: this caster holds per-element "
                f"state ({self._state_what()}) of version {self.version}; restore the matching Fair Cast state instead"
            )
        self.version = version

    def _state_what(self) -> str:
        return "error-feedback residuals" if self._ef else "an EMA of the master"

    def metrics(self, reset: bool = True) -> Dict[str, float]:
        """This process's ``faircast/*`` metrics since the last call (only the version without audit or before two
        versions were seen). Adapters report :func:`faircast_plugins.audit.reduce_metrics`, summed over ranks."""
        out = {"faircast/version": float(self.version)}
        if self.audit is not None:
            out.update(self.audit.metrics(reset))
        return out

    # -- checkpointing --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume bit-identically (tensors stay on their device; move them as you save)."""
        return {
            "format": STATE_FORMAT,
            "version": self.version,
            "config": asdict(self.config),
            "ema": {n: t for n, t in self._ema.items()},
            "error_feedback": {
                n: {"residual": s.residual, "version": s.version, "offset": s.offset, "served": s.served}
                for n, s in self._ef.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown Fair Cast state format {state.get('format')!r} (this version reads {STATE_FORMAT})")
        saved = FairCastConfig(**state["config"])
        for field in ("mode", "seed", "ema_decay", "enabled"):
            if getattr(saved, field) != getattr(self.config, field):
                raise ValueError(
                    f"Fair Cast checkpoint was written with {field}={getattr(saved, field)!r} but this run has "
                    f"{field}={getattr(self.config, field)!r}; resuming would not reproduce the served copies"
                )
        self.version = int(state["version"])
        self._ema = {n: t.clone() for n, t in state["ema"].items()}
        self._ef = {
            n: _Residual(s["residual"].clone(), int(s["version"]), int(s["offset"]),
                         None if s["served"] is None else s["served"].clone())
            for n, s in state["error_feedback"].items()
        }
