"""Paired statistics for A/B runs: one number per (arm, seed), compared across arms seed by seed.

Built for few seeds (4-8). For a pair of arms (A, B) over the seeds both ran:

- **primary**: the paired t-test on the differences A - B: mean, its 95% t interval (n - 1 degrees of freedom) and
  two-sided p-value; the p-value Holm-adjusted over the pre-declared family of comparisons (``holm``); where the
  protocol declares an equivalence margin, the two one-sided tests (TOST) against it; and the minimum detectable
  effect of the design (``mde``: the true difference the t-test would find with 80% power at alpha 0.05).
- **secondary**, each with what limits it at this n: the exact sign test (its smallest possible p-value is
  2 / 2**n: 0.125 at n = 4, so at n <= 5 it can never reach 0.05) and the percentile bootstrap interval (it
  resamples seeds and uses normal quantiles of an sd shrunk by sqrt((n-1)/n): its real coverage of a nominal 95%
  is only about 81% at n = 4, 87% at n = 6, ``bootstrap_coverage``);
- the unpaired spread (each arm's sd across seeds) beside the sd of the paired differences: what pairing buys.

The t distribution is computed here (regularized incomplete beta), with no scipy at run time; tests/core checks it
against scipy's values.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

BOOTSTRAP_SAMPLES = 10_000
ALPHA = 0.05
POWER = 0.80


def final_value(points: Sequence[Tuple[float, float]], tail: float = 0.2) -> float:
    """Mean of the last ``tail`` fraction (at least one) of ``(step, value)`` points, in step order."""
    if not points:
        raise ValueError("no points to summarize")
    pts = sorted(points)
    k = max(1, math.ceil(len(pts) * tail - 1e-9))
    return sum(v for _, v in pts[-k:]) / k


# -- the t distribution ----------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)), -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on ``t_cdf``; exact to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile needs 0 < p < 1, got {p}")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13 * max(1.0, abs(mid)):
            break
    return (lo + hi) / 2


# -- tests -----------------------------------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def paired_t(diffs: Sequence[float], level: float = 1 - ALPHA) -> Tuple[float, float, float, float]:
    """The paired t-test on ``diffs``: (t statistic, two-sided p, CI low, CI high) of the mean difference."""
    n = len(diffs)
    if n < 2:
        return (float("nan"),) * 4
    m, sd = _mean(diffs), _sd(diffs)
    se = sd / math.sqrt(n)
    half = t_ppf(1 - (1 - level) / 2, n - 1) * se
    if se == 0:
        return (math.copysign(math.inf, m) if m else float("nan"), 0.0 if m else 1.0, m - half, m + half)
    t = m / se
    return t, min(1.0, 2 * t_cdf(-abs(t), n - 1)), m - half, m + half


def tost_p(diffs: Sequence[float], margin: float) -> float:
    """Two one-sided t-tests against the equivalence margin (-margin, +margin): the larger of the two p-values.
    p < alpha means the mean difference lies inside the margin (equivalence shown); else it is not shown."""
    n = len(diffs)
    if n < 2 or not margin > 0:
        return float("nan")
    m, se = _mean(diffs), _sd(diffs) / math.sqrt(n)
    if se == 0:
        return 0.0 if abs(m) < margin else 1.0
    p_low = 1 - t_cdf((m + margin) / se, n - 1)   # H0: mean <= -margin
    p_high = t_cdf((m - margin) / se, n - 1)      # H0: mean >= +margin
    return max(p_low, p_high)


def mde(sd_diff: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable effect of a two-sided paired t-test: (t_{1-alpha/2} + t_{power}) * sd / sqrt(n), with n - 1
    degrees of freedom (the usual approximation to the noncentral t: at n = 4 it gives 2.08 sd, the exact 2.13 sd)."""
    if n < 2 or math.isnan(sd_diff):
        return float("nan")
    return (t_ppf(1 - alpha / 2, n - 1) + t_ppf(power, n - 1)) * sd_diff / math.sqrt(n)


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm's step-down adjustment of a family of p-values (NaN entries are left out of the family and stay NaN)."""
    idx = sorted((i for i, p in enumerate(pvalues) if not math.isnan(p)), key=lambda i: pvalues[i])
    out = [float("nan")] * len(pvalues)
    running, m = 0.0, len(idx)
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: P(a split at least this uneven | no difference), ties excluded."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def sign_test_floor(n: int) -> float:
    """The smallest p-value the exact two-sided sign test can give with ``n`` untied pairs: 2 / 2**n."""
    return min(1.0, 2 / 2 ** n) if n > 0 else 1.0


def bootstrap_ci(diffs: Sequence[float], level: float = 1 - ALPHA, samples: int = BOOTSTRAP_SAMPLES,
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


def bootstrap_coverage(n: int, level: float = 1 - ALPHA) -> float:
    """The approximate real coverage of the nominal ``level`` percentile-bootstrap interval of a mean of ``n`` normal
    differences: it is about mean +- z * sd * sqrt((n-1)/n) / sqrt(n), so it covers with probability
    P(|T_{n-1}| < z sqrt((n-1)/n)) (0.81 at n = 4: under no difference it excludes 0 about one time in five)."""
    if n < 2:
        return float("nan")
    z = math.sqrt(2) * _erfinv(level)
    return 2 * t_cdf(z * math.sqrt((n - 1) / n), n - 1) - 1


def _erfinv(y: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


# -- one comparison --------------------------------------------------------------------------------------------------
@dataclass
class PairResult:
    a: str
    b: str
    n: int
    wins: int
    ties: int
    losses: int
    mean_diff: float
    ci_low: float            # percentile bootstrap (secondary)
    ci_high: float
    sign_p: float            # exact sign test (secondary)
    sd_diff: float
    sd_a: float
    sd_b: float
    mean_a: float
    mean_b: float
    t_stat: float = float("nan")       # paired t-test (primary)
    t_p: float = float("nan")
    t_ci_low: float = float("nan")
    t_ci_high: float = float("nan")
    p_holm: float = float("nan")       # t_p, Holm-adjusted over the declared family (NaN: not in the family)
    mde: float = float("nan")          # true difference the t-test finds with 80% power at alpha 0.05
    margin: float = float("nan")       # the declared equivalence margin (NaN: none declared)
    tost_p: float = float("nan")
    sign_p_floor: float = float("nan")
    bootstrap_coverage: float = float("nan")

    @property
    def ci_contains_zero(self) -> bool:
        """Whether the primary (t) interval contains 0."""
        return self.t_ci_low <= 0 <= self.t_ci_high

    @property
    def equivalent(self) -> Optional[bool]:
        """Shown equivalent within the margin (TOST p < alpha); None where no margin was declared."""
        return None if math.isnan(self.margin) else self.tost_p < ALPHA

    def as_dict(self) -> dict:
        return {**asdict(self), "ci_contains_zero": self.ci_contains_zero, "equivalent": self.equivalent}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PairResult":
        """From ``as_dict`` output, old results.json too (those lack the t fields: recomputed needs the values)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def compare(a: str, b: str, values: Mapping[str, Mapping[int, float]], margin: Optional[float] = None) -> PairResult:
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
    t, p, tlo, thi = paired_t(diffs)
    n = len(seeds)
    return PairResult(a, b, n, wins, n - wins - losses, losses, _mean(diffs), lo, hi, sign_test_p(wins, losses),
                      _sd(diffs), _sd(va), _sd(vb), _mean(va), _mean(vb), t, p, tlo, thi, float("nan"),
                      mde(_sd(diffs), n), float("nan") if margin is None else margin,
                      float("nan") if margin is None else tost_p(diffs, margin), sign_test_floor(wins + losses),
                      bootstrap_coverage(n))


def adjust_family(results: Sequence[PairResult], family: Optional[Sequence[Tuple[str, str]]] = None) -> None:
    """Set ``p_holm`` on the results whose (a, b) is in ``family`` (all of them when ``family`` is None)."""
    members = [r for r in results if family is None or (r.a, r.b) in {tuple(f) for f in family}]
    for r, p in zip(members, holm([r.t_p for r in members])):
        r.p_holm = p


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


def _num(x: float, scale: float, fmt: str = "+.3f") -> str:
    return "" if x is None or math.isnan(x) else format(scale * x, fmt)


def _p(x: float) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.2g}" if x < 0.001 else f"{x:.3f}"


def table(results: Sequence[PairResult], scale: float = 100.0, unit: str = "points") -> str:
    """A markdown table of paired comparisons (differences times ``scale``): the paired t-test first, then the
    secondary tests with their limits at this n."""
    margin = next((r.margin for r in results if not math.isnan(r.margin)), float("nan"))
    tost = not math.isnan(margin)
    head = (f"| A vs B | seeds | mean A - B ({unit}) | 95% CI (paired t) | t p | Holm p | MDE (80% power) | "
            + (f"equivalent within ±{_num(margin, scale, '.3g')} (TOST p) | " if tost else "")
            + "wins/ties/losses | sign p (floor) | bootstrap 95% CI (coverage) | sd of A - B | sd of A, of B |\n"
            + "| --- " * (12 + tost) + "|")
    rows = []
    for r in results:
        eq = ("" if math.isnan(r.tost_p) else f"{'yes' if r.equivalent else 'not shown'} ({_p(r.tost_p)}) | ")
        rows.append(
            f"| {r.a} vs {r.b} | {r.n} | {_num(r.mean_diff, scale)} | [{_num(r.t_ci_low, scale)}, "
            f"{_num(r.t_ci_high, scale)}] | {_p(r.t_p)} | {_p(r.p_holm) or '(not in family)'} | "
            f"{_num(r.mde, scale, '.3f')} | " + (eq if tost else "")
            + f"{r.wins}/{r.ties}/{r.losses} | {r.sign_p:.3g} ({_p(r.sign_p_floor)}) | [{_num(r.ci_low, scale)}, "
            f"{_num(r.ci_high, scale)}] ({_num(r.bootstrap_coverage, 100, '.0f')}%) | {_num(r.sd_diff, scale, '.3f')} | "
            f"{_num(r.sd_a, scale, '.3f')}, {_num(r.sd_b, scale, '.3f')} |")
    return "\n".join([head, *rows])


TABLE_NOTE = ("Primary: the paired t-test (mean, 95% t interval, two-sided p; Holm p = adjusted over the pre-declared "
              "family). MDE = the true difference this design detects with 80% power at alpha 0.05, "
              "(t_.975 + t_.80) x sd / sqrt(n). Secondary: the exact sign test, whose smallest possible p (floor) is "
              "2/2^n, and the percentile bootstrap, whose real coverage of a nominal 95% is given in brackets.")


def by_arm_seed(rows: Sequence[Tuple[str, int, float]]) -> Dict[str, Dict[int, float]]:
    out: Dict[str, Dict[int, float]] = {}
    for arm, seed, value in rows:
        if seed in out.setdefault(arm, {}):
            raise ValueError(f"two results for arm {arm!r} seed {seed}")
        out[arm][seed] = value
    return out
