"""The A/B protocol: everything fixed before a run (task, model, learning rate, steps, arms, seeds, metric).

Presets are JSON files in ``faircast_plugins/ab/presets/`` (``smoke``, ``cpu``); ``--protocol FILE`` reads any
other. A report records the protocol's SHA-256 and, where the file is in a git checkout, the commit that last
changed it, so a result can be traced to the protocol that was written down before it ran.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

from .arms import parse_arm
from .task import TASKS
from .warmstart import FinetuneSpec, WarmStartSpec

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
#: Readouts of the fp32 master, scored through the engine at every eval point beside the served copy: what the
#: master of that arm would score if it were exported by round-to-nearest, stochastic rounding (keyed by the run
#: seed and the weight version in every arm, so it is the ``faircast`` arm's own export), or sticky rounding.
READOUTS = ("rtn", "sr", "sticky")
METRICS = ("served_expected", "served_greedy", "served_sampled", "master_expected", "master_greedy",
           *(f"{r}_{k}" for r in READOUTS for k in ("expected", "greedy")))
#: How the trainer computes: ``bf16-autocast`` (torch autocast to bf16 around the forward, fp32 masters; TRL's
#: default ``bf16=True``) or ``fp32`` (every op in fp32). A protocol must name one: never a framework's default.
COMPUTE = ("bf16-autocast", "fp32")
#: Paired over arms besides METRICS: the readout effect (served minus the master's best readout, within a run) and
#: the served copy minus SR(master).
DERIVED = ("readout_effect", "served_minus_sr")
LR_SCHEDULES = ("constant", "linear", "cosine")


def presets() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


@dataclass
class Protocol:
    name: str
    description: str = ""
    task: str = "add2"
    heldout: int = 1000
    warmstart: WarmStartSpec = field(default_factory=WarmStartSpec)
    model: Optional[str] = None       # a user's model directory (replaces the built-in warm start)
    sft: Optional[FinetuneSpec] = None  # a short SFT of ``model`` on the task's format first (cached), or none
    dataset: Optional[str] = None     # a user's jsonl (replaces the built-in task)
    compute: Optional[str] = None     # one of COMPUTE; required
    lr: float = 1e-6
    lr_schedule: str = "constant"     # TRL's lr_scheduler_type, no warm-up
    steps: int = 200
    eval_every: int = 20
    prompts_per_step: int = 16
    generations: int = 8
    # GRPO knobs the harness passes to TRL explicitly (what the committed CPU run had from TRL 1.16's defaults):
    num_iterations: int = 1           # optimizer passes over each generation batch (> 1: off-policy, ratio clip active)
    steps_per_generation: int = 1     # optimizer steps per generation batch (> 1: off-policy)
    epsilon: float = 0.2              # PPO ratio clip
    loss_type: str = "dapo"
    is_correction: bool = True        # TRL's vllm_importance_sampling_correction (mode sequence_mask, clip_max 3.0)
    # TRL's gradient_checkpointing (its default, on): recomputes activations in the backward; the same gradients,
    # ~1/4 more compute. Off saves CPU time where memory allows (a 135M model).
    gradient_checkpointing: bool = True
    readouts: bool = True             # score RTN/SR/sticky(master) through the engine at every eval point
    arms: List[str] = field(default_factory=lambda: ["standard", "faircast"])
    seeds: List[int] = field(default_factory=lambda: [0, 1])
    metric: str = "served_expected"
    baseline: str = "standard"
    pairs: List[List[str]] = field(default_factory=list)  # extra (A, B) comparisons beyond arm-vs-baseline and A/A
    # The pre-declared family of confirmatory comparisons, [metric, A, B] each: their paired-t p-values are
    # Holm-adjusted together. Empty: every pair of the primary metric (the report says it was not declared).
    family: List[List[str]] = field(default_factory=list)
    # Equivalence margin, in the metric's units (0.002 = 0.2 points of success): every comparison then carries the
    # two one-sided t-tests (TOST) against (-margin, +margin). None: not declared.
    equivalence_margin: Optional[float] = None
    workers: int = 2
    threads: int = 1
    audit_sample: int = 4096
    source: str = ""                  # where it was read from (set by load)

    def __post_init__(self):
        if isinstance(self.warmstart, dict):
            self.warmstart = WarmStartSpec(**self.warmstart)
        if isinstance(self.sft, dict):
            unknown = sorted(set(self.sft) - {f.name for f in dataclasses.fields(FinetuneSpec)})
            if unknown:
                raise ValueError(f"unknown protocol sft field(s) {unknown}; fields: steps, batch, lr, seed")
            self.sft = FinetuneSpec(**self.sft)
        if self.sft is not None and not self.model:
            raise ValueError("protocol sft fine-tunes a pretrained model: it needs model (e.g. \"smollm2\")")
        for arm in self.arms:
            parse_arm(arm)
        if len(set(self.arms)) != len(self.arms):
            raise ValueError("each arm may appear once in a protocol")
        if not self.dataset and self.task not in TASKS:
            raise ValueError(f"unknown A/B task {self.task!r}; built in: {', '.join(TASKS)} (or --dataset FILE.jsonl)")
        if self.compute not in COMPUTE:
            raise ValueError(f"protocol compute must be one of {', '.join(COMPUTE)} (how the trainer computes; the "
                             f"harness never relies on a framework's default), got {self.compute!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"protocol lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not self.readouts and self.metric.split("_", 1)[0] in READOUTS:
            raise ValueError(f"protocol metric {self.metric!r} needs readouts: true")
        if not 0 < self.epsilon < 1:
            raise ValueError(f"protocol epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; one of {', '.join(METRICS)}")
        for name in ("steps", "eval_every", "prompts_per_step", "generations", "workers", "threads", "heldout",
                     "num_iterations", "steps_per_generation"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"protocol {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.generations < 2:
            raise ValueError("GRPO needs at least 2 generations per prompt")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("protocol seeds must be a non-empty list of distinct integers")
        if not self.lr > 0:
            raise ValueError("protocol lr must be > 0")
        for p in self.pairs:
            if len(p) != 2 or any(a not in self.arms for a in p):
                raise ValueError(f"protocol pair {p!r} must name two of the protocol's arms")
        for f in self.family:
            if len(f) != 3 or f[0] not in METRICS + DERIVED or any(a not in self.arms for a in f[1:]):
                raise ValueError(f"protocol family entry {f!r} must be [metric, arm A, arm B]: a metric of "
                                 f"{', '.join(METRICS + DERIVED)} and two of the protocol's arms")
        if self.equivalence_margin is not None and not (isinstance(self.equivalence_margin, (int, float))
                                                        and self.equivalence_margin > 0):
            raise ValueError(f"protocol equivalence_margin must be a positive number (the metric's units), "
                             f"got {self.equivalence_margin!r}")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


def load(preset: Optional[str] = None, path: Optional[str] = None, **overrides) -> Protocol:
    """A preset by name, or a protocol file; ``overrides`` (not None) replace fields (recorded in the report)."""
    if (preset is None) == (path is None):
        raise ValueError("give a preset or a protocol file (not both)")
    if preset is not None:
        if preset not in presets():
            raise ValueError(f"unknown A/B preset {preset!r}; presets: {', '.join(presets())}")
        path = os.path.join(PRESET_DIR, preset + ".json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"protocol file {path!r} does not exist")
    with open(path) as f:
        data = json.load(f)
    known = {f.name for f in dataclasses.fields(Protocol)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown protocol field(s) {unknown}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("arms") is not None:  # a subset of arms keeps the protocol's extra pairs that it still has
        data["pairs"] = [p for p in data.get("pairs", []) if all(a in data["arms"] for a in p)]
        data["family"] = [f for f in data.get("family", []) if all(a in data["arms"] for a in f[1:])]
    proto = Protocol(**data)
    proto.source = os.path.abspath(path)
    return proto
