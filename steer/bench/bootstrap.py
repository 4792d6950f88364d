"""How far a ratio between two cells could move on their passes' noise alone: a bootstrap interval.

A host-bound model's passes spread by 20-85% and independently from pass to pass (SmolLM2 on the H200,
docs/perf-log.md 2026-12-03 03:00), so with a few dozen passes a cell, a ratio between two cells is uncertain by
several percent. Resampling each cell's passes (with replacement, as many as it has) and taking the ratio of
medians again, many times, says how much: a target whose interval reaches past its threshold was not decided by
the run, whichever side its ratio fell on.
"""

import random
from statistics import median
from typing import List, Optional, Sequence, Tuple

RESAMPLES = 1000
LEVEL = 0.90


def interval(of: Sequence[float], over: Sequence[float], resamples: int = RESAMPLES,
             seed: int = 0) -> Optional[Tuple[float, float]]:
    """The central `LEVEL` interval of `of`'s throughput over `over`'s between their medians, each cell given by
    its passes' wall times (the same batch, so the ratio of tok/s is over's median time over of's). None where
    either cell has fewer than 2 passes. Nominal with few passes (a percentile bootstrap of a median covers less
    than it says with 6 or 7), and not for fastest passes: a resample's fastest is never faster than the cell's,
    so such an interval only leans one way."""
    if len(of) < 2 or len(over) < 2:
        return None
    rng = random.Random(seed)  # the same run gives the same report
    return central([median(rng.choices(over, k=len(over))) / median(rng.choices(of, k=len(of)))
                    for _ in range(resamples)])


def median_interval(values: Sequence[float], resamples: int = RESAMPLES,
                    seed: int = 0) -> Optional[Tuple[float, float]]:
    """The central `LEVEL` interval of the median of `values` (paired ratios, steer/bench/pairs.py), resampling
    them with replacement; None with fewer than 2."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    return central([median(rng.choices(values, k=len(values))) for _ in range(resamples)])


def chance_below(pool: Sequence[float], n: int, at_least: float, draws: int = RESAMPLES,
                 seed: int = 0) -> Optional[float]:
    """How often two cells timed exactly alike, `n` passes each drawn from `pool` (one cell's pass wall times),
    give a ratio between their fastest passes below `at_least`: the chance that a target decided between fastest
    passes misses at `n` passes a cell with no cost at all, which no interval gives (a resample's fastest only ever
    rises). The draws are disjoint where `pool` holds 2n passes (a paired run's reference holds about one a pass of
    every other cell); otherwise each is drawn with replacement, a bootstrap that is right on average but moves by
    several points from run to run at a few dozen passes. None without passes."""
    if n < 1 or not pool:
        return None
    rng, pool = random.Random(seed), list(pool)
    below = 0
    for _ in range(draws):
        picks = rng.sample(pool, 2 * n) if len(pool) >= 2 * n else rng.choices(pool, k=2 * n)
        below += min(picks[n:]) / min(picks[:n]) < at_least  # the first n's throughput over the second n's
    return below / draws


def central(draws: List[float]) -> Tuple[float, float]:
    """The central `LEVEL` interval of `draws`."""
    draws = sorted(draws)
    tail = round((1 - LEVEL) / 2 * len(draws))
    return draws[tail], draws[-1 - tail]
