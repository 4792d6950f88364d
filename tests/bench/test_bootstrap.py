"""The medians' ratio's interval on the passes' noise (steer/bench/bootstrap.py)."""

import random
from statistics import median

from steer.bench import bootstrap


def test_cells_without_noise_give_their_ratio_exactly():
    assert bootstrap.interval([0.5] * 5, [0.5] * 4) == (1.0, 1.0)
    assert bootstrap.interval([1.0] * 3, [0.5] * 3) == (0.5, 0.5)  # twice the time: half the tok/s
    assert bootstrap.interval([1.0], [0.5, 0.6]) is None and bootstrap.interval([1.0, 1.1], []) is None


def test_the_interval_holds_the_ratio_and_narrows_with_more_passes():
    rng = random.Random(1)

    def passes(n):
        return [0.4 * (1 + rng.random() * 0.6) for _ in range(n)]  # SmolLM2-like: up to 60% over the fastest

    few, many = (passes(8), passes(8)), (passes(200), passes(200))
    lo, hi = bootstrap.interval(*few)
    assert lo <= median(few[1]) / median(few[0]) <= hi
    lo2, hi2 = bootstrap.interval(*many)
    assert hi2 - lo2 < (hi - lo) / 2 and lo2 < 1.0 < hi2


def test_the_interval_covers_the_true_ratio_about_as_often_as_it_says():
    # 200 runs of two cells with the same true speed: a 90% interval should hold 1.0 in most of them
    rng = random.Random(7)
    covered = 0
    for i in range(200):
        a, b = ([0.4 * (1 + rng.expovariate(5)) for _ in range(24)] for _ in range(2))
        lo, hi = bootstrap.interval(a, b, resamples=300, seed=i)
        covered += lo <= 1.0 <= hi
    assert 0.80 * 200 <= covered <= 0.98 * 200


def test_a_median_s_interval_holds_the_median_and_narrows_with_more_values():
    few = [0.9, 1.0, 1.1, 0.95, 1.05]
    lo, hi = bootstrap.median_interval(few)
    assert lo <= 1.0 <= hi and (lo, hi) == bootstrap.median_interval(few)  # the same values, the same interval
    lo_many, hi_many = bootstrap.median_interval(few * 8)
    assert hi_many - lo_many < hi - lo
    assert bootstrap.median_interval([1.0]) is None


def test_cells_timed_alike_without_noise_never_miss_between_fastest_passes():
    assert bootstrap.chance_below([0.5] * 20, 10, 0.95) == 0.0
    assert bootstrap.chance_below([0.5] * 19, 10, 0.95) == 0.0  # too few for two disjoint draws: with replacement
    assert bootstrap.chance_below([0.5] * 20, 0, 0.95) is None and bootstrap.chance_below([], 3, 0.95) is None


def test_the_chance_of_a_miss_between_fastest_passes_is_that_of_all_slow_against_one_fast():
    # passes in two modes, twice as slow as each other, half each: a cell misses 0.95 exactly when all its n passes
    # are slow and the other's fastest is fast, (1/2)^n (1 - (1/2)^n) for a pool this large
    pool = [0.4, 0.8] * 500
    odds = {n: bootstrap.chance_below(pool, n, 0.95, draws=4000) for n in (1, 2, 5)}
    for n, got in odds.items():
        assert abs(got - 0.5 ** n * (1 - 0.5 ** n)) < 0.025
    assert odds[1] > odds[2] > odds[5]
    assert bootstrap.chance_below(pool, 2, 0.95, draws=4000) == odds[2]  # the same pool gives the same report
    # an unpaired run's reference has about as many passes as the cell: drawn with replacement, the same odds
    few = bootstrap.chance_below([0.4, 0.8] * 3, 2, 0.95, draws=4000)
    assert abs(few - 0.5 ** 2 * (1 - 0.5 ** 2)) < 0.025
