"""A configuration's passes set against the reference's passes timed just before and after each (a paired run).

A host-bound model's pass time moves 20-40% from one pass to the next with the host's slow spells, which last
1-5 s (SmolLM2 on the H200, docs/perf-log.md 2026-12-03), so two cells timed a round apart see different spells,
and their medians, or their fastest passes, differ by as much as the cost being measured. In a paired run
(steer/bench/waves.py, a model's `paired`) the reference (b) times a pass of the same batch right before and
right after each of another engine's, so each of its passes has two reference passes beside it that mostly share
its spell. The ratio of each pass to its neighbours cancels the spell; their median is the paired figure, and
resampling the pairs gives its interval. Between fastest passes, each pass's first neighbour (the one before it
where there is one) stands for the reference: as many reference passes as the engine's, drawn beside them, so
neither side's fastest comes from more draws (all the reference's passes outnumber any one engine's several
times, and the fastest of more draws reaches further into the fast spells).
"""

import bisect
import random
from statistics import median
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from steer.bench import bootstrap

STEP = "step_ms"  # a pass's median decode step, the engine core's (steer/bench/runs.py)
STEP_GAPS = "step_gaps_ms"  # each of a pass's decode steps, in ms, in order
# The fastest steps: this quantile of a cell's decode steps. A host-bound model's steps run in a fast mode and in
# slow spells 1.5-2x longer (SmolLM2 at 64 x 128 on the H200: pass medians 2.5-5 ms); the quantile sits in the fast
# mode while a tenth of the cell's steps run there, and rests on thousands of steps where a fastest pass rests on one
FAST_Q = 0.10
# A reference pass is a neighbour when no more than this many seconds lie between it and the pass (the scheduler's
# round trip and a cell's warm-up fit; a pass from another round or wave does not)
SLACK_S = 2.0


def neighbours(of_starts: Sequence[float], of_walls: Sequence[float], over_starts: Sequence[float],
               over_walls: Sequence[float], slack_s: float = SLACK_S, of_values: Optional[Sequence[float]] = None,
               over_values: Optional[Sequence[float]] = None) -> List[Tuple[float, List[float]]]:
    """For each pass of `of` (its start and wall time), its wall and the walls of the `over` passes just before
    and just after it, those within `slack_s` of it; a pass with neither is left out. With `of_values` and
    `over_values` (one a pass), those stand for the walls in what is handed back (the passes' median steps)."""
    order = sorted(zip(over_starts, over_walls, over_walls if over_values is None else over_values))
    starts = [s for s, _, _ in order]
    out = []
    for s, w, v in zip(of_starts, of_walls, of_walls if of_values is None else of_values):
        i = bisect.bisect_left(starts, s)
        beside = []
        if i > 0 and s - (order[i - 1][0] + order[i - 1][1]) <= slack_s:
            beside.append(order[i - 1][2])
        if i < len(order) and order[i][0] - (s + w) <= slack_s:
            beside.append(order[i][2])
        if beside:
            out.append((v, beside))
    return out


def figures(of: Dict, over: Dict) -> Dict[str, Optional[object]]:
    """`paired`: the median over `of`'s passes of its throughput over its neighbours' (their mean time over its
    time); `paired_interval`: its central 90% interval, resampling the pairs; `paired_fastest`: the fastest of
    the passes' first neighbours over `of`'s fastest pass. Each None where no pass has a neighbour (or, for the
    interval, fewer than 2 do). `of` and `over` are rows with `walls_s` and `started_s`."""
    pairs = neighbours(of.get("started_s") or [], of.get("walls_s") or [], over.get("started_s") or [],
                       over.get("walls_s") or [])
    if not pairs:
        return {"paired": None, "paired_interval": None, "paired_fastest": None, "pairs": 0}
    ratios = [sum(b) / len(b) / w for w, b in pairs]
    fastest = min(b[0] for _, b in pairs) / min(w for w, _ in pairs)
    return {"paired": median(ratios), "paired_interval": bootstrap.median_interval(ratios),
            "paired_fastest": fastest, "pairs": len(pairs)}


def steps(of: Dict, over: Dict) -> Dict[str, Optional[object]]:
    """The same work's throughput ratio from the passes' median decode steps (`STEP`, runs.step_reading) rather than
    their walls: `steps`, over's step over of's, each pass against the neighbours' in a paired run (the median of
    those ratios) and between the cells' medians otherwise; `steps_interval`, its 90% interval (resampling the pairs,
    or each cell's passes). None where a cell lacks a pass's step."""
    mine, theirs = of.get(f"{STEP}_passes") or [], over.get(f"{STEP}_passes") or []
    if not mine or not theirs or len(mine) != len(of.get("walls_s") or ()) or \
            len(theirs) != len(over.get("walls_s") or ()):
        return {"steps": None, "steps_interval": None}
    if over.get("paired"):
        ratios = [sum(b) / len(b) / v for v, b in neighbours(of["started_s"], of["walls_s"], over["started_s"],
                                                             over["walls_s"], of_values=mine, over_values=theirs)]
        if not ratios:
            return {"steps": None, "steps_interval": None}
        return {"steps": median(ratios), "steps_interval": bootstrap.median_interval(ratios)}
    return {"steps": median(theirs) / median(mine), "steps_interval": bootstrap.interval(mine, theirs)}


def fast_steps(of: Dict, over: Dict, resamples: int = bootstrap.RESAMPLES,
               seed: int = 0) -> Dict[str, Optional[object]]:
    """The same work's throughput ratio between the cells' fastest decode steps: `fast_steps`, over's `FAST_Q`
    quantile of its timed passes' steps (`STEP_GAPS`) over of's; in a paired run, over's steps are those of each of
    of's passes' first neighbour (as many passes as of's, beside them). `fast_steps_interval`: its 90% interval,
    resampling each side's passes. None where a cell lacks its passes' steps."""
    mine, theirs = of.get(f"{STEP_GAPS}_passes") or [], over.get(f"{STEP_GAPS}_passes") or []
    if not mine or not theirs or len(mine) != len(of.get("walls_s") or ()) or \
            len(theirs) != len(over.get("walls_s") or ()):
        return {"fast_steps": None, "fast_steps_interval": None}
    if over.get("paired"):
        pairs = neighbours(of["started_s"], of["walls_s"], over["started_s"], over["walls_s"], of_values=mine,
                           over_values=theirs)
        mine, theirs = [v for v, _ in pairs], [b[0] for _, b in pairs]
    if not mine:
        return {"fast_steps": None, "fast_steps_interval": None}
    mine, theirs = [np.asarray(p, dtype=float) for p in mine], [np.asarray(p, dtype=float) for p in theirs]
    rng = random.Random(seed)  # the same run gives the same report
    draws = [_fast(rng.choices(theirs, k=len(theirs))) / _fast(rng.choices(mine, k=len(mine)))
             for _ in range(resamples)] if len(mine) > 1 and len(theirs) > 1 else []
    return {"fast_steps": _fast(theirs) / _fast(mine),
            "fast_steps_interval": bootstrap.central(draws) if draws else None}


def _fast(passes: Sequence[np.ndarray]) -> float:
    return float(np.quantile(np.concatenate(passes), FAST_Q))
