"""Paired comparisons of two cells over seeds, with Holm's correction over a report's comparisons.

Seeds pair the runs of two cells (same seed: same data order and dropout draws), so a comparison is
the one-sample Student t on the per-seed differences d_s = ppl_a,s − ppl_b,s (n seeds):

    mean = Σ d_s / n,   sd = √(Σ (d_s − mean)² / (n − 1)),   se = sd / √n,   t = mean / se
    interval at level c:  mean ± t_{(1+c)/2, n−1} · se      two-sided p = P(|T_{n−1}| ≥ |t|)

Holm over m comparisons (α = 0.05), as adjusted p-values and as adjusted intervals, which agree:
sort the p-values p_(1) ≤ … ≤ p_(m); the adjusted p-value of rank i is max_{j ≤ i} min(1, (m − j + 1) p_(j));
let s be the first rank with p_(s) ≥ α / (m − s + 1) (m + 1 if none): the ranks before s are rejected.
The adjusted interval of rank i is the interval at level 1 − α / (m − min(i, s) + 1): it excludes 0
exactly when Holm rejects (ranks before s: p_(i) < α / (m − i + 1); from s on, p_(i) ≥ p_(s) ≥ the
level's α / (m − s + 1)). The verdict words of a claim "a has the lower perplexity" follow from it:
holds (interval below 0), reversed (above 0), inconclusive (contains 0).

The t distribution needs no SciPy: for an integer ν its two-sided probability has a closed form
(Abramowitz & Stegun 26.7.3-4), with θ = atan(|t| / √ν):

    ν even:  P(|T| ≤ |t|) = sin θ · Σ_{k=0}^{(ν−2)/2} c_k cos^{2k} θ,               c_{k+1} = c_k (2k + 1) / (2k + 2)
    ν odd:   P(|T| ≤ |t|) = (2/π) (θ + sin θ · Σ_{k=0}^{(ν−3)/2} c_k cos^{2k+1} θ),  c_{k+1} = c_k (2k + 2) / (2k + 3)
    (c_0 = 1; for ν = 1 the sum is empty)
and its quantile is found by bisection on it (to 1e-12 relative).

Seeds needed (a rough power figure): the smallest n ≥ 2 at which an interval at level c, at the observed mean
and sd of the differences, would exclude 0: t_{(1+c)/2, n−1} · sd / √n < |mean|. The mean and sd are estimates
(from a few seeds), so n is what the observed effect would need if it held, not a probability of deciding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.05
HOLDS, REVERSED, INCONCLUSIVE = "holds", "reversed", "inconclusive"


def t_within(t: float, df: int) -> float:
    """P(|T| ≤ |t|) for Student's T with `df` (a positive integer) degrees of freedom."""
    if df < 1 or df != int(df):
        raise ValueError(f"degrees of freedom must be a positive integer, not {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    total, term = 0.0, 1.0 if df % 2 == 0 else math.cos(theta)
    for k in range((df - 2) // 2 + 1 if df % 2 == 0 else (df - 3) // 2 + 1):
        total += term
        term *= cos2 * ((2 * k + 1) / (2 * k + 2) if df % 2 == 0 else (2 * k + 2) / (2 * k + 3))
    return sin * total if df % 2 == 0 else 2 / math.pi * (theta + sin * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| ≤ t) = level (two-sided), e.g. t_quantile(0.95, 2) = 4.3027 = t_{0.975, 2}."""
    if not 0 < level < 1:
        raise ValueError(f"a two-sided level is between 0 and 1, not {level}")
    lo, hi = 0.0, 1.0
    while t_within(hi, df) < level:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_within(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Paired:
    """The per-seed differences a − b of two cells (seeds both have), and their t statistics."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return sum(self.diffs) / self.n

    @property
    def se(self) -> float:
        """sd / √n (infinite below two seeds: nothing is known of the spread)."""
        if self.n < 2:
            return math.inf
        return math.sqrt(sum((d - self.mean) ** 2 for d in self.diffs) / (self.n - 1) / self.n)

    @property
    def p(self) -> float:
        """Two-sided p-value of mean = 0."""
        if self.se == 0:
            return 0.0 if self.mean else 1.0
        return 1.0 if self.n < 2 else 1 - t_within(self.mean / self.se, self.n - 1)

    def interval(self, level: float = 1 - ALPHA) -> tuple[float, float]:
        if self.n < 2:
            return -math.inf, math.inf
        half = 0.0 if self.se == 0 else t_quantile(level, self.n - 1) * self.se
        return self.mean - half, self.mean + half

    def seeds_needed(self, level: float = 1 - ALPHA, limit: int = 100_000) -> int | None:
        """The module docstring's seeds needed at `level` (None: fewer than 2 seeds, a mean of 0 or beyond
        `limit`); t · sd / √n falls as n grows, so n is found by doubling, then bisection."""
        if self.n < 2 or self.mean == 0:
            return None
        sd = self.se * math.sqrt(self.n)

        def enough(n: int) -> bool:
            return t_quantile(level, n - 1) * sd / math.sqrt(n) < abs(self.mean)

        lo, hi = 1, 2  # enough(lo) is False (one seed has no interval)
        while not enough(hi):
            if hi >= limit:
                return None
            lo, hi = hi, min(2 * hi, limit)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if enough(mid) else (mid, hi)
        return hi

    def signs(self) -> str:
        """One sign per seed: '−' where a is below b (the claim's direction), '+' above, '0' equal."""
        return "".join("−" if d < 0 else "+" if d > 0 else "0" for d in self.diffs)


def paired(a: dict[int, float], b: dict[int, float]) -> Paired:
    """The pairs of {seed: value} a and b over the seeds both have, in seed order."""
    seeds = tuple(sorted(a.keys() & b.keys()))
    return Paired(seeds, tuple(a[s] - b[s] for s in seeds))


@dataclass(frozen=True)
class Holm:
    """One comparison after Holm's correction: its adjusted p-value, its adjusted interval and level."""

    p: float
    level: float
    interval: tuple[float, float]

    @property
    def verdict(self) -> str:
        """Of the claim a < b: holds / reversed / inconclusive as the adjusted interval is below / above / across 0."""
        lo, hi = self.interval
        return HOLDS if hi < 0 else REVERSED if lo > 0 else INCONCLUSIVE


def holm(comparisons: list[Paired], alpha: float = ALPHA) -> list[Holm]:
    """Holm's correction over `comparisons` (see the module docstring), in their order; ties of p keep it."""
    m = len(comparisons)
    order = sorted(range(m), key=lambda i: comparisons[i].p)  # stable: ties in the comparisons' order
    stop = next((r for r, i in enumerate(order, 1) if comparisons[i].p >= alpha / (m - r + 1)), m + 1)
    out: list[Holm | None] = [None] * m
    running = 0.0
    for rank, i in enumerate(order, 1):
        running = max(running, min(1.0, (m - rank + 1) * comparisons[i].p))
        level = 1 - alpha / (m - min(rank, stop) + 1)
        out[i] = Holm(running, level, comparisons[i].interval(level))
    return out
