"""``faircast`` fields on TRL's config classes.

TRL's configs are dataclasses parsed by ``HfArgumentParser``, so the flag must be a real dataclass field: each
supported config gets a subclass with the ``faircast*`` fields that keeps the original ``__name__``,
``__qualname__`` and ``__module__`` (``training_args.bin`` still unpickles), and the subclass is rebound in every
already-imported module that holds the original name. ``trl``'s scripts import their config at call time, so a
rebinding done before they run is seen by ``trl grpo --config cfg.yaml`` too.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import FairCastConfig, parse_bool

# (module that defines it, class name): every TRL 1.16 config that gains the flag.
CONFIG_CLASSES = (
    ("trl.trainer.grpo_config", "GRPOConfig"),
    ("trl.trainer.rloo_config", "RLOOConfig"),
    ("trl.experimental.online_dpo.online_dpo_config", "OnlineDPOConfig"),
    ("trl.experimental.async_grpo.async_grpo_config", "AsyncGRPOConfig"),
)

_HELP = {
    "faircast": "Fair Cast: unbiased fp32->bf16 export (stochastic rounding) and the loss on the served bf16 copy.",
    "faircast_mode": "Fair Cast rounding: 'stochastic' (default), 'sticky' (thresholds fixed per element: changes as "
                     "rarely as round-to-nearest), 'error_feedback', or 'nearest' (baseline with audit).",
    "faircast_seed": "Fair Cast seed (unsigned 64-bit), the same on every rank.",
    "faircast_ema_decay": "Fair Cast: serve an EMA of the fp32 master with this decay in [0, 1); 0 = off.",
    "faircast_audit": "Fair Cast audit: log faircast/* metrics (lag, bias, changed fractions); works with faircast off.",
    "faircast_audit_sample": "Fair Cast audit: elements sampled per parameter for the metrics.",
    "faircast_policy_metrics_every": (
        "Fair Cast policy metrics: every N optimizer steps, log faircast/policy_kl (per-token KL between the served "
        "copy and the fp32 master) and faircast/policy_ess_frac (sequence-level effective sample fraction) on a few "
        "sequences of the batch; 0 = off. Works with faircast off (then it measures round to nearest)."
    ),
    "faircast_policy_metrics_seqs": "Fair Cast policy metrics: sequences of the batch scored, per process.",
    "faircast_backend": "Fair Cast kernel: 'auto' (Triton on CUDA, numba on CPU), 'torch', 'triton' or 'cpu'.",
    "faircast_master_bytes": (
        "Fair Cast, one process/DDP with stochastic, sticky or nearest: bytes per parameter kept for the fp32 masters. "
        "2: their low 16 bits beside the served copy, recovered bit for bit around each optimizer step (one "
        "fused pass each way, ~4 ns/param per step on one CPU thread); 4: a full fp32 copy (no recovery, +2 B/param "
        "more). Same bits either way. Unset (default): 2 for stochastic and sticky, 4 for nearest (which has no "
        "fused compaction: 2 would run its chunked torch reference every step)."
    ),
    "faircast_resume_without_state": (
        "Fair Cast: resume from a checkpoint that has no Fair Cast state, starting the error-feedback residuals or "
        "the EMA fresh at the checkpoint's step (the run is then not reproducible). Off: such a resume is refused."
    ),
}


@dataclass
class FairCastArguments:
    """The ``faircast*`` fields shared by every patched TRL config."""

    faircast: bool = field(default=False, metadata={"help": _HELP["faircast"]})
    faircast_mode: str = field(default="stochastic", metadata={"help": _HELP["faircast_mode"]})
    faircast_seed: int = field(default=0, metadata={"help": _HELP["faircast_seed"]})
    faircast_ema_decay: float = field(default=0.0, metadata={"help": _HELP["faircast_ema_decay"]})
    faircast_audit: bool = field(default=False, metadata={"help": _HELP["faircast_audit"]})
    faircast_audit_sample: int = field(default=4096, metadata={"help": _HELP["faircast_audit_sample"]})
    faircast_backend: str = field(default="auto", metadata={"help": _HELP["faircast_backend"]})
    faircast_resume_without_state: bool = field(default=False, metadata={"help": _HELP["faircast_resume_without_state"]})
    faircast_master_bytes: Optional[int] = field(default=None, metadata={"help": _HELP["faircast_master_bytes"]})
    faircast_policy_metrics_every: int = field(default=0, metadata={"help": _HELP["faircast_policy_metrics_every"]})
    faircast_policy_metrics_seqs: int = field(default=FairCastConfig.policy_metrics_seqs, metadata={"help": _HELP["faircast_policy_metrics_seqs"]})


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(FairCastArguments))


def faircast_config(args: Any) -> Optional[FairCastConfig]:
    """The validated :class:`FairCastConfig` of a TRL config, or None when the config has no ``faircast`` fields."""
    if not hasattr(args, "faircast"):
        return None
    value = args.faircast
    if isinstance(value, FairCastConfig):
        return value
    overrides = dict(
        mode=args.faircast_mode, seed=args.faircast_seed, ema_decay=args.faircast_ema_decay, audit=args.faircast_audit,
        audit_sample=args.faircast_audit_sample, backend=args.faircast_backend,
        policy_metrics_every=getattr(args, "faircast_policy_metrics_every", 0),
        policy_metrics_seqs=getattr(args, "faircast_policy_metrics_seqs", FairCastConfig.policy_metrics_seqs),
    )
    if isinstance(value, dict):  # YAML ``faircast: {mode: ..., seed: ...}``: the mapping wins over the defaults
        return FairCastConfig.from_value(value, **{k: v for k, v in overrides.items() if k not in value})
    return FairCastConfig.from_value(value, **overrides)


def _post_init(self) -> None:
    cfg = faircast_config(self)  # raises ValueError with a clear message on bad values
    # Normalise what the user wrote (``"true"``, a mapping) to the flat fields, so to_dict()/YAML stay simple.
    self.faircast, self.faircast_mode, self.faircast_seed = cfg.enabled, cfg.mode, cfg.seed
    self.faircast_ema_decay, self.faircast_audit = cfg.ema_decay, cfg.audit
    self.faircast_audit_sample, self.faircast_backend = cfg.audit_sample, cfg.backend
    self.faircast_policy_metrics_every, self.faircast_policy_metrics_seqs = cfg.policy_metrics_every, cfg.policy_metrics_seqs
    self.faircast_resume_without_state = parse_bool(self.faircast_resume_without_state, "faircast_resume_without_state")
    self.faircast_master_bytes = master_bytes(self.faircast_master_bytes)


def master_bytes(value) -> Optional[int]:
    """``faircast_master_bytes`` checked: 2 or 4 (an int, or its string from a YAML/CLI), or None (unset: by mode)."""
    if value is None:
        return None
    try:
        parsed = int(str(value).strip())
    except ValueError:
        parsed = None
    if parsed not in (2, 4) or isinstance(value, bool):
        raise ValueError(f"faircast_master_bytes must be 2 (low 16 bits beside the served copy) or 4 (a full fp32 "
                         f"copy), got {value!r}")
    return parsed


def make_config_class(base: type) -> type:
    """A subclass of ``base`` with the ``faircast*`` fields that masquerades as ``base`` for pickling and parsing."""
    if getattr(base, "__faircast_config__", False):
        return base
    namespace: dict[str, Any] = {"__annotations__": {}, "__module__": base.__module__, "__doc__": base.__doc__}
    hints = typing.get_type_hints(FairCastArguments)  # types, not strings: the subclass lives in base's module,
    for f in dataclasses.fields(FairCastArguments):      # where a string like "Optional[int]" would not resolve
        namespace["__annotations__"][f.name] = hints[f.name]
        namespace[f.name] = field(default=f.default, metadata=dict(f.metadata))

    def __post_init__(self) -> None:
        _post_init(self)  # validate first: a bad value must not cost the user a trainer setup
        base.__post_init__(self)

    namespace["__post_init__"] = __post_init__
    namespace["__faircast_config__"] = True
    cls = dataclass(type(base.__name__, (base,), namespace))
    cls.__qualname__ = base.__qualname__
    cls.__faircast_base__ = base
    return cls


def _rebind(original: type, replacement: type) -> list[str]:
    """Point every loaded ``trl*`` module attribute that holds ``original`` at ``replacement``."""
    done = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "trl" or name.startswith("trl.")):
            continue
        namespace = getattr(module, "__dict__", {})
        for attr, value in list(namespace.items()):
            if value is original:
                setattr(module, attr, replacement)
                done.append(f"{name}.{attr}")
    return done


def patch_configs() -> dict[str, type]:
    """Subclass and rebind every config in :data:`CONFIG_CLASSES`. Idempotent; returns ``{name: class}``."""
    out = {}
    for module_name, class_name in CONFIG_CLASSES:
        module = importlib.import_module(module_name)
        current = getattr(module, class_name)
        patched = make_config_class(current)
        if patched is not current:
            _rebind(current, patched)
        out[class_name] = patched
    return out


def unpatch_configs() -> None:
    """Undo :func:`patch_configs` (tests)."""
    for module_name, class_name in CONFIG_CLASSES:
        module = sys.modules.get(module_name)
        current = getattr(module, class_name, None) if module else None
        if current is not None and getattr(current, "__faircast_config__", False):
            _rebind(current, current.__faircast_base__)
