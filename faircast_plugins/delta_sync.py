"""What each mode costs a delta weight sync (one that sends only the served elements that changed since the last sync:
verl's ``delta_sharded`` checkpoint engine, slime's ``--update-weight-mode=delta``).

``stochastic`` redraws its noise at every weight version and ``error_feedback`` carries residuals, so both change
many more served elements per version than round-to-nearest; ``sticky`` (noise keyed without the version) changes
about as few, unbiased. The stack adapters say so when a delta sync meets a mode that makes it nearly a full sync."""
from __future__ import annotations

from typing import Optional

#: Served elements changed per weight version, per mode (benchmarks/verl_delta.py: verl 0.9.1's worker on CPU, a tiny
#: Qwen2 from a bf16 checkpoint, Adam lr 1e-6, mean over versions 121-150; docs/verl.md, Limits).
DELTA_CHANGED_PCT = {"nearest": 4.23, "sticky": 4.35, "stochastic": 30.4, "error_feedback": 44.2}


def rates() -> str:
    return ", ".join(f"{m} {pct}%" for m, pct in DELTA_CHANGED_PCT.items())


def costly_mode_warning(mode: str, where: str, fix: str) -> Optional[str]:
    """A warning for ``mode`` under the delta sync named by ``where`` when it sends several times what ``sticky``
    sends (None otherwise); ``fix`` names the option that selects ``sticky`` in that stack."""
    if mode not in ("stochastic", "error_feedback"):
        return None
    ratio = DELTA_CHANGED_PCT[mode] / DELTA_CHANGED_PCT["sticky"]
    return (f"Fair Cast: mode={mode} with a delta weight sync: {where} sends only the served elements that change per "
            f"weight version (measured per version, benchmarks/verl_delta.py: {rates()}), so each sync sends about "
            f"{ratio:.1f}x the elements mode=sticky sends. Use {fix} for delta syncs")
