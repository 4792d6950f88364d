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
    mine, theirs = _per_pass(of, over, STEP)
    if not mine:
        return {"steps": None, "steps_interval": None}
    if over.get("paired"):
        ratios = [sum(b) / len(b) / v for v, b in neighbours(of["started_s"], of["walls_s"], over["started_s"],
                                                             over["walls_s"], of_values=mine, over_values=theirs)]
        if not ratios:
            return {"steps": None, "steps_interval": None}
        return {"steps": median(ratios), "steps_interval": bootstrap.median_interval(ratios)}
    return {"steps": median(theirs) / median(mine), "steps_interval": bootstrap.interval(mine, theirs)}


def _per_pass(of: Dict, over: Dict, key: str) -> Tuple[List, List]:
    """Each cell's reading `key` of every timed pass (`<key>_passes`); ([], []) where either cell lacks one."""
    mine, theirs = of.get(f"{key}_passes") or [], over.get(f"{key}_passes") or []
    if not mine or not theirs or len(mine) != len(of.get("walls_s") or ()) or \
            len(theirs) != len(over.get("walls_s") or ()):
        return [], []
    return mine, theirs


def fast_steps(of: Dict, over: Dict, resamples: int = bootstrap.RESAMPLES,
               seed: int = 0) -> Dict[str, Optional[object]]:
    """The same work's throughput ratio between the cells' fastest decode steps: `fast_steps`, over's `FAST_Q`
    quantile of its timed passes' steps (`STEP_GAPS`) over of's. In a paired run, over's steps are those of the
    reference pass just before each of of's passes (or just after, where none is before), and of's passes without
    one are left out. `fast_steps_interval`: its 90% interval, resampling the pairs in a paired run and each cell's
    passes otherwise. None where a cell lacks its passes' steps (or, for the interval, has fewer than 2 passes)."""
    mine, theirs = _per_pass(of, over, STEP_GAPS)
    if not mine:
        return {"fast_steps": None, "fast_steps_interval": None}
    paired = bool(over.get("paired"))
    if paired:
        pairs = neighbours(of["started_s"], of["walls_s"], over["started_s"], over["walls_s"], of_values=mine,
                           over_values=theirs)
        mine, theirs = [v for v, _ in pairs], [b[0] for _, b in pairs]
    if not mine:
        return {"fast_steps": None, "fast_steps_interval": None}
    interval = None
    if len(mine) > 1 and len(theirs) > 1:
        rng = np.random.default_rng(seed)  # the same run gives the same report
        picks = rng.integers(len(mine), size=(resamples, len(mine)))
        theirs_picks = picks if paired else rng.integers(len(theirs), size=(resamples, len(theirs)))
        interval = bootstrap.central(list(_fast_drawn(theirs, theirs_picks) / _fast_drawn(mine, picks)))
    whole = _fast_drawn(theirs, np.arange(len(theirs))[None])[0] / _fast_drawn(mine, np.arange(len(mine))[None])[0]
    return {"fast_steps": float(whole), "fast_steps_interval": interval and (float(interval[0]), float(interval[1]))}


def _fast_drawn(passes: Sequence[Sequence[float]], picks: np.ndarray, block: int = 100) -> np.ndarray:
    """The `FAST_Q` quantile of the pooled steps of each row of `picks` (indices into `passes`), in blocks of rows
    (a row of 100 passes of 255 steps is 200 KB). A cell's passes hold about as many steps each (a stamp falls on
    either side of a pass's edge: 128 or 129 at 64 x 128), and are then cut to the shortest and drawn at once."""
    shortest, longest = min(len(p) for p in passes), max(len(p) for p in passes)
    if shortest >= 0.9 * longest:
        stacked = np.asarray([p[:shortest] for p in passes], dtype=float)
        return np.concatenate([np.quantile(stacked[picks[i:i + block]].reshape(len(picks[i:i + block]), -1), FAST_Q,
                                           axis=1) for i in range(0, len(picks), block)])
    arrays = [np.asarray(p, dtype=float) for p in passes]
    return np.array([np.quantile(np.concatenate([arrays[k] for k in row]), FAST_Q) for row in picks])
