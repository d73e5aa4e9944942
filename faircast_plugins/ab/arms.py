"""A/B arms: runs of one recipe that differ only in how the served copy is made (and, for tuned baselines, the LR).

An arm is named ``BASE`` or ``BASE@MOD[@MOD...]``, a modifier being ``lr=X`` (any arm at another learning rate) or
an integer: the delay ``k`` of ``fp32-delayed@k``, the grid scale ``S`` of the ``coarse-*@S`` arms (required, once).
Bases:

==================  ==========================================================================================
``standard``        TRL's defaults: the engine loads the fp32 master and rounds it to nearest; loss on the master
``faircast``        Fair Cast (stochastic): unbiased export, loss on the served copy
``faircast-aa``     the same as ``faircast`` with another Fair Cast seed: the A/A control
``faircast-ef``     Fair Cast with error feedback
``sticky``          Fair Cast with sticky rounding (where the installed package has that mode)
``fp32-served``     the engine serves the fp32 master itself (no rounding anywhere): what the LR can do at all
``fp32-served-aa``  ``fp32-served`` with other rollout draws (request seeds keyed by run seed + an offset): the
                    A/A of a freshness comparison under common random numbers (what no effect looks like)
``fp32-delayed@k``  the engine serves the fp32 master from k steps ago: the standard export as a pure delay?
``fp32-frozen``     the engine serves the fp32 master of step 0 for the whole run (one snapshot kept): the
                    positive control, a sampler that never learns against ``fp32-served`` (a fresh one)
``export-only``     ablation: unbiased (stochastic) export, loss on the fp32 master
``loss-only``       ablation: round-to-nearest export, loss on the served (round-to-nearest) copy
``standard-fp8``    ``standard``, then verl's fp8 stage: the engine serves the dequantized blockwise-e4m3 copy
                    of round-to-nearest (an EMULATION of an fp8 engine: fp32 weights ``fp8 * descale``)
``faircast-fp8``    ``faircast``, then the same fp8 stage on the Fair Cast copy (loss on the bf16 served copy)
``coarse-rtn@S``    an EMULATED served grid S times coarser than bf16 for the update: the (fp32) engine holds
                    ``w0 + RTN_u(w - w0)``, ``w0`` the step-0 master (the bf16 warm start), ``u = S * ulp_bf16(w0)``;
                    loss on the fp32 master (the standard export's analogue on that grid)
``coarse-sr@S``     the same grid with stochastic rounding keyed like Fair Cast (``derive_key(seed, step, name)``,
                    the contract's per-element noise); loss on the fp32 master: against ``coarse-rtn@S`` only the
                    export differs (Fair Cast's export question, not its loss)
``coarse-sr-aa@S``  ``coarse-sr@S`` with another rounding seed (+1000003): its A/A twin
==================  ==========================================================================================

The fp8 arms quantize each linear weight as verl's ``quant_weights`` does (``faircast_plugins.fp8``, bit-identical
to verl's PyTorch quantizer) and load the dequantized values into an fp32 engine: the weights an fp8 engine
computes with, not its fp8 kernels (records say ``engine: emulated fp8 ...``).

The coarse arms (``faircast_plugins.ab.coarse_grid``: its docstring states the rules and their bias) are an
emulation for the harness, ab-audit-2 §5.3 (3): they stretch the toy's lag to the preprint's 50-150 steps, and they
multiply stochastic rounding's noise and round to nearest's jumps by ~S, so they are biased against Fair Cast.
Records say ``engine: emulated coarse grid S=..``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..cast import MODES

#: Fair Cast seed offset of the A/A twin (any fixed value other than 0 gives an independent rounding draw).
AA_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Arm:
    name: str
    faircast: bool = False           # the adapter's flag (loss on the served copy, Fair Cast export)
    mode: str = "stochastic"         # the adapter's faircast_mode
    seed_offset: int = 0             # added to the run seed to make the Fair Cast seed
    lr: Optional[float] = None       # None: the protocol's learning rate
    engine_dtype: str = "bfloat16"   # what the vLLM engine holds
    delay: int = 0                   # serve the master from this many steps ago (fp32 engine)
    frozen: bool = False             # serve the master of step 0 for the whole run (fp32 engine)
    export: str = "trainer"          # "trainer": what TRL (+ the adapter) exports; "stochastic": SR of the master
    fp8: bool = False                # then verl's fp8 stage; the (fp32) engine holds the dequantized fp8 copy
    rollout_seed_offset: int = 0     # added to the run seed in the rollouts' request seeds (an A/A of the draws)
    coarse: int = 0                  # the emulated grid's scale S (0: none); ``export`` then names its rounding

    @property
    def kind(self) -> str:
        return self.name.split("@", 1)[0]


BASES = {
    "standard": Arm("standard"),
    "faircast": Arm("faircast", faircast=True),
    "faircast-aa": Arm("faircast-aa", faircast=True, seed_offset=AA_SEED_OFFSET),
    "faircast-ef": Arm("faircast-ef", faircast=True, mode="error_feedback"),
    "sticky": Arm("sticky", faircast=True, mode="sticky"),
    "fp32-served": Arm("fp32-served", engine_dtype="float32"),
    "fp32-served-aa": Arm("fp32-served-aa", engine_dtype="float32", rollout_seed_offset=AA_SEED_OFFSET),
    "fp32-delayed": Arm("fp32-delayed", engine_dtype="float32"),
    "fp32-frozen": Arm("fp32-frozen", engine_dtype="float32", frozen=True),
    "export-only": Arm("export-only", export="stochastic"),
    "loss-only": Arm("loss-only", faircast=True, mode="nearest"),
    "standard-fp8": Arm("standard-fp8", engine_dtype="float32", fp8=True),
    "faircast-fp8": Arm("faircast-fp8", faircast=True, engine_dtype="float32", fp8=True),
    "coarse-rtn": Arm("coarse-rtn", engine_dtype="float32", export="coarse-nearest"),
    "coarse-sr": Arm("coarse-sr", engine_dtype="float32", export="coarse-stochastic"),
    "coarse-sr-aa": Arm("coarse-sr-aa", engine_dtype="float32", export="coarse-stochastic", seed_offset=AA_SEED_OFFSET),
}

#: The coarse arms' exports and the emulated grid's rounding (``coarse_grid.MODES``) each stands for.
COARSE_EXPORTS = {"coarse-nearest": "nearest", "coarse-stochastic": "stochastic"}

#: How records describe the engine of an fp8 arm.
FP8_ENGINE = ("emulated fp8 engine: verl-style blockwise e4m3 (128x128, scale 448/amax) of each linear weight, "
              "dequantized into an fp32 vLLM engine")


def engine_record(arm: Arm) -> str:
    """What a run's record says its engine held."""
    if arm.fp8:
        return FP8_ENGINE
    if arm.coarse:
        return (f"emulated coarse grid S={arm.coarse}: an fp32 vLLM engine holding w0 + "
                f"{COARSE_EXPORTS[arm.export]}_u(w - w0), u = {arm.coarse} x ulp_bf16(w0), w0 the step-0 master")
    return arm.engine_dtype


def aa_twin(name: str) -> Optional[str]:
    """The arm whose A/A twin ``name`` is (``faircast-aa`` -> ``faircast``, ``coarse-sr-aa@16`` -> ``coarse-sr@16``),
    or None: the same name without the base's ``-aa``."""
    base, sep, mods = name.partition("@")
    return base[:-3] + sep + mods if base.endswith("-aa") else None


def parse_arm(name: str) -> Arm:
    """The :class:`Arm` for ``name``; a clear ``ValueError`` for anything unknown or malformed."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("an A/B arm name must be a non-empty string")
    base, *mods = name.strip().split("@")
    if base not in BASES:
        raise ValueError(f"unknown A/B arm {name!r}; arms: {', '.join(BASES)} (with @lr=X for another learning "
                         f"rate, fp32-delayed@K for a delay of K steps, coarse-*@S for an emulated grid S times "
                         f"coarser than bf16)")
    arm = replace(BASES[base], name=name.strip())
    if arm.faircast and arm.mode not in MODES:
        raise ValueError(f"arm {name!r} needs Fair Cast mode {arm.mode!r}, which this faircast-plugins does not have "
                         f"(modes: {', '.join(MODES)})")
    for mod in mods:
        if mod.startswith("lr="):
            try:
                lr = float(mod[3:])
            except ValueError:
                raise ValueError(f"arm {name!r}: {mod!r} is not lr=<number>") from None
            if not lr > 0:
                raise ValueError(f"arm {name!r}: the learning rate must be > 0")
            arm = replace(arm, lr=lr)
        elif base == "fp32-delayed" and mod.isdigit():
            arm = replace(arm, delay=int(mod))
        elif arm.export in COARSE_EXPORTS:
            if arm.coarse:
                raise ValueError(f"arm {name!r}: the grid scale S is given twice")
            if not mod.isdigit() or int(mod) < 1:
                raise ValueError(f"arm {name!r}: the grid scale S must be an integer >= 1 (u = S x ulp_bf16(w0)), "
                                 f"got {mod!r}; e.g. {base}@16")
            arm = replace(arm, coarse=int(mod))
        else:
            raise ValueError(f"arm {name!r}: unknown modifier {mod!r} (lr=X, or an integer delay for fp32-delayed, "
                             f"or the grid scale S for coarse-*)")
    if base == "fp32-delayed" and arm.delay < 1:
        raise ValueError(f"arm {name!r}: give the delay in steps, e.g. fp32-delayed@20")
    if arm.export in COARSE_EXPORTS and not arm.coarse:
        raise ValueError(f"arm {name!r}: give the emulated grid's scale S, e.g. {base}@16 (u = S x ulp_bf16(w0))")
    return arm
