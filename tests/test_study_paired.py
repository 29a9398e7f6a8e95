"""The paired statistics of a study's comparisons (xlm_pkm/experiments/paired.py): the t quantile against printed
tables, the interval and Holm's correction against hand computations. With 3 seeds (2 degrees of freedom) Student's
t has closed forms, used here as the hand computation: P(|T| ≤ t) = t / √(2 + t²), so the two-sided p-value is
1 − |t| / √(2 + t²) and the two-sided quantile at level c is c · √(2 / (1 − c²))."""

import math
import random

import pytest

from xlm_pkm.experiments.paired import HOLDS, INCONCLUSIVE, REVERSED, Paired, holm, paired, t_quantile, t_within


def p_df2(t: float) -> float:
    return 1 - abs(t) / math.sqrt(2 + t * t)


def quantile_df2(level: float) -> float:
    return level * math.sqrt(2 / (1 - level * level))


@pytest.mark.parametrize("df, level, table", [
    (1, 0.95, 12.706), (2, 0.95, 4.303), (3, 0.95, 3.182), (4, 0.95, 2.776), (5, 0.95, 2.571), (9, 0.95, 2.262),
    (10, 0.95, 2.228), (29, 0.95, 2.045), (30, 0.95, 2.042), (2, 0.99, 9.925), (4, 0.99, 4.604), (10, 0.99, 3.169),
    (1, 0.90, 6.314), (7, 0.90, 1.895)])
def test_the_t_quantile_is_the_printed_tables(df, level, table):
    assert t_quantile(level, df) == pytest.approx(table, abs=5e-4)


def test_the_t_distribution_is_its_closed_forms():
    for level in (0.5, 0.95, 0.975, 0.99, 1 - 0.05 / 15):
        assert t_quantile(level, 1) == pytest.approx(math.tan(math.pi * level / 2), rel=1e-10)
        assert t_quantile(level, 2) == pytest.approx(quantile_df2(level), rel=1e-10)
    for t in (0.3, 1.0, 4.303, 40.0):
        assert 1 - t_within(t, 2) == pytest.approx(p_df2(t), abs=1e-14)
        theta = math.atan(t / math.sqrt(3))  # ν = 3: (2/π)(θ + sin θ cos θ)
        assert t_within(t, 3) == pytest.approx(2 / math.pi * (theta + math.sin(theta) * math.cos(theta)))


def test_the_t_distribution_matches_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 6, 11, 50):
        for level in (0.8, 0.95, 0.999):
            assert t_quantile(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df), rel=1e-9)


def test_the_paired_interval_is_the_hand_computation():
    # issue 47's PEER − PKM on three seeds: -1.3, -3.2, -4.5
    pair = paired({0: 200.0, 1: 210.0, 2: 220.0}, {0: 201.3, 1: 213.2, 2: 224.5})
    assert pair.seeds == (0, 1, 2) and pair.diffs == pytest.approx((-1.3, -3.2, -4.5)) and pair.signs() == "−−−"
    mean = -3.0
    sd = math.sqrt(((-1.3 + 3) ** 2 + (-3.2 + 3) ** 2 + (-4.5 + 3) ** 2) / 2)  # √2.59 = 1.6093
    se = sd / math.sqrt(3)  # 0.92916
    t = mean / se  # -3.2287
    assert pair.mean == pytest.approx(mean) and pair.se == pytest.approx(se)
    assert pair.p == pytest.approx(p_df2(t), rel=1e-12) and pair.p == pytest.approx(0.0840, abs=1e-4)
    lo, hi = pair.interval()
    assert (lo, hi) == pytest.approx((mean - 4.302653 * se, mean + 4.302653 * se), abs=1e-5)
    assert (lo, hi) == pytest.approx((-6.9978, 0.9978), abs=1e-4)  # contains 0: better on every seed, yet not shown
    assert holm([pair])[0].verdict == INCONCLUSIVE
    assert paired({0: 1.0, 5: 2.0}, {5: 1.0, 7: 0.0}).seeds == (5,)  # only the seeds both cells have


def _three(mean: float) -> Paired:
    """Three seeds at mean − 1, mean, mean + 1: sd 1, se 1/√3."""
    return Paired((0, 1, 2), (mean - 1, mean, mean + 1))


def test_holm_is_the_hand_computation():
    se = 1 / math.sqrt(3)
    a, b, c = _three(-11.0), _three(-3.0), Paired((0, 1, 2), (1.0, -2.0, 4.0))
    pa, pb, pc = p_df2(-11 / se), p_df2(-3 / se), p_df2(1 / math.sqrt(3))  # 0.00275, 0.0351, 0.622
    assert (a.p, b.p, c.p) == pytest.approx((pa, pb, pc), rel=1e-10)
    out = holm([c, a, b])  # the report's order; ranks by p: a, b, c
    # a: 3 pa = 0.0083 < 0.05 rejected; b: 2 pb = 0.070 not (pb > 0.05 / 2), so Holm stops at rank s = 2
    assert [h.p for h in out] == pytest.approx([max(3 * pa, 2 * pb, pc), 3 * pa, max(3 * pa, 2 * pb)], rel=1e-10)
    # levels: rank 1 -> 1 - 0.05/3; rank 2 (= s) -> 1 - 0.05/2; rank 3, past s -> 1 - 0.05/(3 - 2 + 1)
    assert [h.level for h in out] == pytest.approx([1 - 0.05 / 2, 1 - 0.05 / 3, 1 - 0.05 / 2])
    half_b = quantile_df2(0.975) * se  # 6.205 / √3 = 3.582
    assert out[2].interval == pytest.approx((-3 - half_b, -3 + half_b))
    assert [h.verdict for h in out] == [INCONCLUSIVE, HOLDS, INCONCLUSIVE]


def test_holm_stops_at_the_first_comparison_it_keeps():
    """x's p (0.0200) misses its threshold 0.05/3: Holm rejects nothing, although y's p (0.0211) alone is under
    its rank's 0.05/2; y's interval then takes x's level, and contains 0."""
    se = 1 / math.sqrt(3)

    def t_for(p):  # inverts p_df2
        return math.sqrt(2 * (1 - p) ** 2 / (1 - (1 - p) ** 2))

    x, y, z = _three(-t_for(0.0200) * se), _three(-t_for(0.0211) * se), Paired((0, 1, 2), (1.0, -2.0, 4.0))
    assert (x.p, y.p) == pytest.approx((0.0200, 0.0211), rel=1e-9) and y.p < 0.05 / 2
    out = holm([x, y, z])
    assert [h.p for h in out] == pytest.approx([0.06, 0.06, z.p], rel=1e-9)
    assert [h.level for h in out] == pytest.approx([1 - 0.05 / 3] * 3)
    assert [h.verdict for h in out] == [INCONCLUSIVE] * 3
    assert y.interval(1 - 0.05 / 2)[1] < 0  # what a rank-by-rank interval would have wrongly called "holds"


def test_the_verdict_follows_the_interval_and_agrees_with_the_adjusted_p():
    assert holm([_three(12.0)])[0].verdict == REVERSED
    assert holm([Paired((0, 1), (-2.0, -2.0))])[0].verdict == HOLDS  # no spread: the point interval [-2, -2]
    assert holm([Paired((0,), (-5.0,))])[0].verdict == INCONCLUSIVE  # one seed: no interval
    rng = random.Random(0)
    for _ in range(200):
        pairs = [Paired(tuple(range(n)), tuple(rng.gauss(mu, 1) for _ in range(n)))
                 for n, mu in [(rng.randint(2, 6), rng.uniform(-3, 3)) for _ in range(rng.randint(1, 8))]]
        for pair, h in zip(pairs, holm(pairs)):
            assert (h.verdict != INCONCLUSIVE) == (h.p < 0.05)
            assert h.verdict == INCONCLUSIVE or (h.verdict == HOLDS) == (pair.mean < 0)


def test_the_seeds_needed_are_the_hand_computation():
    """issue 61's multi-core scoring claim: per seed +2.32, +0.21, +5.79 (mean 2.7733, sd 2.8175). With the printed
    t(0.975, 5) = 2.571 and t(0.975, 6) = 2.447: 6 seeds give a half-width 2.571 · 2.8175 / √6 = 2.957 > 2.7733,
    7 seeds 2.447 · 2.8175 / √7 = 2.606 < 2.7733: 7 seeds would exclude 0 at 95% if the mean and sd held."""
    pair = Paired((0, 1, 2), (2.32, 0.21, 5.79))
    sd = pair.se * math.sqrt(3)
    assert pair.mean == pytest.approx(2.77333, abs=1e-5) and sd == pytest.approx(2.81749, abs=1e-5)
    assert 2.571 * sd / math.sqrt(6) > pair.mean > 2.447 * sd / math.sqrt(7)
    assert pair.seeds_needed() == 7
    # at 3 seeds (2 degrees of freedom, the closed form) an interval that already excludes 0 needs no more seeds
    assert _three(-3.0).seeds_needed() == 3 == _three(-3.0).seeds_needed(0.95) and _three(-3.0).interval()[1] < 0
    # at 99%: 3 seeds give 9.925 / √3 = 5.73 > 3, 4 seeds t(0.995, 3) / √4 = 5.841 / 2 = 2.92 < 3
    assert quantile_df2(0.99) / math.sqrt(3) > 3.0 > 5.841 / 2 and _three(-3.0).seeds_needed(0.99) == 4
    assert Paired((0, 1), (1.0, 1.0)).seeds_needed() == 2  # no spread: 2 seeds
    assert Paired((0,), (5.0,)).seeds_needed() is None and _three(0.0).seeds_needed() is None  # no sd; no effect
    assert _three(0.001).seeds_needed(limit=1000) is None  # beyond the limit
