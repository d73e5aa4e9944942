"""FairCastConfig: the one flag and its sub-options, validated once for every framework."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .cast import BACKENDS, MODES, check_mode

_TRUE = {"true", "1", "yes", "on", "y", "t"}
_FALSE = {"false", "0", "no", "off", "n", "f", "none", "null", ""}


def parse_bool(value: Any, what: str = "faircast") -> bool:
    """Strict boolean parsing for config values (YAML, CLI strings, ints 0/1)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{what} must be true or false, got {value!r}")


@dataclass
class FairCastConfig:
    """Fair Cast options.

    enabled:   turn the unbiased export and the loss-on-served-copy on.
    mode:      ``stochastic`` (default), ``sticky`` (stochastic rounding with thresholds fixed per element: the
               served copy changes about as rarely as round-to-nearest's), ``error_feedback`` (+4 B/param
               residual state) or ``nearest`` (today's round-to-nearest: a baseline that still reports the
               audit metrics).
    seed:      unsigned 64-bit run seed that keys the noise; the same on every rank.
    ema_decay: b in [0, 1): cast an EMA of the master (+4 B/param state) instead of the master; 0 = off.
    audit:     compute the ``faircast/*`` metrics each step (works with ``enabled=False`` too, to measure lag).
    audit_sample: elements sampled per parameter for the metrics (bounded cost on any model size).
    backend:   ``auto`` (Triton on CUDA, numba on CPU, else torch), ``torch``, ``triton`` or ``cpu``.
    policy_metrics_every: every N optimizer steps, the ``faircast/policy_*`` metrics (per-token KL and effective
               sample fraction between the served copy and the master on a few sequences of the batch,
               :mod:`faircast_plugins.policy_lag`); 0 = off. Works with ``enabled=False`` too.
    policy_metrics_seqs: sequences of the batch (per rank) those metrics score.
    """

    enabled: bool = False
    mode: str = "stochastic"
    seed: int = 0
    ema_decay: float = 0.0
    audit: bool = False
    audit_sample: int = 4096
    backend: str = "auto"
    policy_metrics_every: int = 0
    policy_metrics_seqs: int = 2

    def __post_init__(self) -> None:
        self.enabled = parse_bool(self.enabled, "faircast.enable")
        self.audit = parse_bool(self.audit, "faircast.audit")
        check_mode(self.mode)
        if isinstance(self.seed, str) and self.seed.strip().lstrip("+").isdigit():
            self.seed = int(self.seed)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"faircast.seed must be an integer in [0, 2**64), got {self.seed!r}")
        try:
            self.ema_decay = float(self.ema_decay)
        except (TypeError, ValueError):
            raise ValueError(f"faircast.ema_decay must be a number in [0, 1), got {self.ema_decay!r}") from None
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"faircast.ema_decay must be in [0, 1), got {self.ema_decay}")
        if isinstance(self.audit_sample, bool) or not isinstance(self.audit_sample, int) or self.audit_sample < 1:
            raise ValueError(f"faircast.audit_sample must be a positive int, got {self.audit_sample!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"faircast.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        self.policy_metrics_every = _count(self.policy_metrics_every, "faircast.policy_metrics_every", 0)
        self.policy_metrics_seqs = _count(self.policy_metrics_seqs, "faircast.policy_metrics_seqs", 1)
        if self.mode == "error_feedback" and self.ema_decay:
            raise ValueError("faircast: ema_decay with mode=error_feedback is not supported; use stochastic or sticky")

    @property
    def active(self) -> bool:
        """True when the adapter must attach to the trainer: Fair Cast on, audit only, or the policy metrics only."""
        return self.enabled or self.audit or self.measures_policy

    @property
    def measures_policy(self) -> bool:
        """True when the ``faircast/policy_*`` metrics are asked for (``policy_metrics_every > 0``)."""
        return self.policy_metrics_every > 0

    @property
    def keeps_state(self) -> bool:
        """True when the served copy depends on per-element state (error-feedback residuals or an EMA of the master),
        so it must be saved with every checkpoint and is per-rank state of each rank's shard. The one place this is
        decided; :attr:`FairCaster.keeps_state` reads it."""
        return self.enabled and (self.mode == "error_feedback" or bool(self.ema_decay))

    @property
    def effective_mode(self) -> str:
        """The mode casts actually use: ``nearest`` when Fair Cast is off (audit-only runs measure the baseline)."""
        return self.mode if self.enabled else "nearest"

    @classmethod
    def from_value(cls, value: Any, **overrides: Any) -> "FairCastConfig":
        """Build from what a user wrote: a bool (``faircast: true``), a mapping, a string or a config.

        Mapping keys: ``enable``/``enabled``, ``mode``, ``seed``, ``ema_decay``, ``audit``, ``audit_sample``,
        ``backend``, ``policy_metrics_every``, ``policy_metrics_seqs``. Unknown keys are an error, never ignored.
        """
        if isinstance(value, cls):
            base: dict[str, Any] = dataclasses.asdict(value)
        elif value is None:
            base = {}
        elif isinstance(value, Mapping):
            base = dict(value)
            if "enable" in base:
                if "enabled" in base:
                    raise ValueError("faircast: give 'enable' or 'enabled', not both")
                base["enabled"] = base.pop("enable")
            base.setdefault("enabled", True)
        else:
            base = {"enabled": parse_bool(value)}
        base.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise ValueError(f"unknown faircast option(s) {unknown}; known: enable, {', '.join(sorted(known - {'enabled'}))}")
        return cls(**base)

    def describe(self) -> str:
        policy = f", policy metrics every {self.policy_metrics_every} steps" if self.measures_policy else ""
        if not self.enabled:
            return "off" + (" (audit on: measuring the round-to-nearest baseline)" if self.audit else "") + policy
        extra = f", ema_decay={self.ema_decay}" if self.ema_decay else ""
        return f"mode={self.mode}, seed={self.seed}{extra}, audit={'on' if self.audit else 'off'}{policy}"


def _count(value: Any, what: str, least: int) -> int:
    """An int >= ``least`` (or its string from a YAML/CLI); a clear ValueError otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be an int >= {least}, got {value!r}")
    return value


__all__ = ["FairCastConfig", "MODES", "parse_bool"]
