"""Paired statistics for A/B runs: one number per (arm, seed), compared across arms seed by seed.

For a pair of arms (A, B) over the seeds both ran: wins/ties/losses of A over B, the mean paired difference, a
bootstrap 95% confidence interval of that mean (percentile, resampling seeds), an exact two-sided sign-test p-value
(ties dropped), and beside them the unpaired spread (each arm's standard deviation across seeds), so a reader sees
what pairing buys.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

BOOTSTRAP_SAMPLES = 10_000


def final_value(points: Sequence[Tuple[float, float]], tail: float = 0.2) -> float:
    """Mean of the last ``tail`` fraction (at least one) of ``(step, value)`` points, in step order."""
    if not points:
        raise ValueError("no points to summarize")
    pts = sorted(points)
    k = max(1, math.ceil(len(pts) * tail - 1e-9))
    return sum(v for _, v in pts[-k:]) / k


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: P(a split at least this uneven | no difference), ties excluded."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap_ci(diffs: Sequence[float], level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES,
                 seed: int = 0) -> Tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``diffs`` (resampling the paired seeds)."""
    if not diffs:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(samples))
    lo = means[int(math.floor((1 - level) / 2 * (samples - 1)))]
    hi = means[int(math.ceil((1 + level) / 2 * (samples - 1)))]
    return (lo, hi)


def _sd(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@dataclass
class PairResult:
    a: str
    b: str
    n: int
    wins: int
    ties: int
    losses: int
    mean_diff: float
    ci_low: float
    ci_high: float
    sign_p: float
    sd_diff: float
    sd_a: float
    sd_b: float
    mean_a: float
    mean_b: float

    @property
    def ci_contains_zero(self) -> bool:
        return self.ci_low <= 0 <= self.ci_high

    def as_dict(self) -> dict:
        return {**asdict(self), "ci_contains_zero": self.ci_contains_zero}


def compare(a: str, b: str, values: Mapping[str, Mapping[int, float]]) -> PairResult:
    """Arm ``a`` against arm ``b`` over the seeds both have (``values[arm][seed]``)."""
    for arm in (a, b):
        if arm not in values:
            raise ValueError(f"no results for arm {arm!r} (have: {', '.join(values) or 'none'})")
    seeds = sorted(set(values[a]) & set(values[b]))
    diffs = [values[a][s] - values[b][s] for s in seeds]
    wins = sum(d > 0 for d in diffs)
    losses = sum(d < 0 for d in diffs)
    lo, hi = bootstrap_ci(diffs)
    va, vb = [values[a][s] for s in seeds], [values[b][s] for s in seeds]
    mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
    return PairResult(a, b, len(seeds), wins, len(seeds) - wins - losses, losses, mean(diffs), lo, hi,
                      sign_test_p(wins, losses), _sd(diffs), _sd(va), _sd(vb), mean(va), mean(vb))


def default_pairs(arms: Sequence[str], baseline: str = "standard", aa: Tuple[str, str] = ("faircast-aa", "faircast"),
                  extra: Optional[Sequence[Tuple[str, str]]] = None) -> List[Tuple[str, str]]:
    """The A/A control, every other arm against ``baseline``, and any ``extra`` pairs (those whose arms ran)."""
    pairs: List[Tuple[str, str]] = []
    if aa[0] in arms and aa[1] in arms:
        pairs.append(aa)
    pairs += [(arm, baseline) for arm in arms if arm not in (baseline, aa[0]) and baseline in arms]
    for p in extra or ():
        if p[0] in arms and p[1] in arms and tuple(p) not in pairs:
            pairs.append(tuple(p))
    return pairs


def table(results: Sequence[PairResult], scale: float = 100.0, unit: str = "points") -> str:
    """A markdown table of paired comparisons (differences times ``scale``)."""
    head = (f"| A vs B | seeds | wins/ties/losses | mean A - B ({unit}) | 95% CI (bootstrap) | sign test p | "
            f"sd of A - B | sd of A, of B (unpaired) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = [
        f"| {r.a} vs {r.b} | {r.n} | {r.wins}/{r.ties}/{r.losses} | {scale * r.mean_diff:+.3f} | "
        f"[{scale * r.ci_low:+.3f}, {scale * r.ci_high:+.3f}] | {r.sign_p:.3g} | {scale * r.sd_diff:.3f} | "
        f"{scale * r.sd_a:.3f}, {scale * r.sd_b:.3f} |"
        for r in results
    ]
    return "\n".join([head, *rows])


def by_arm_seed(rows: Sequence[Tuple[str, int, float]]) -> Dict[str, Dict[int, float]]:
    out: Dict[str, Dict[int, float]] = {}
    for arm, seed, value in rows:
        if seed in out.setdefault(arm, {}):
            raise ValueError(f"two results for arm {arm!r} seed {seed}")
        out[arm][seed] = value
    return out
