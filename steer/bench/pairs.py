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

from steer.bench import bootstrap

# A reference pass is a neighbour when no more than this many seconds lie between it and the pass (the scheduler's
# round trip and a cell's warm-up fit; a pass from another round or wave does not)
SLACK_S = 2.0


def neighbours(of_starts: Sequence[float], of_walls: Sequence[float], over_starts: Sequence[float],
               over_walls: Sequence[float], slack_s: float = SLACK_S) -> List[Tuple[float, List[float]]]:
    """For each pass of `of` (its start and wall time), its wall and the walls of the `over` passes just before
    and just after it, those within `slack_s` of it; a pass with neither is left out."""
    order = sorted(zip(over_starts, over_walls))
    starts = [s for s, _ in order]
    out = []
    for s, w in zip(of_starts, of_walls):
        i = bisect.bisect_left(starts, s)
        beside = []
        if i > 0 and s - (order[i - 1][0] + order[i - 1][1]) <= slack_s:
            beside.append(order[i - 1][1])
        if i < len(order) and order[i][0] - (s + w) <= slack_s:
            beside.append(order[i][1])
        if beside:
            out.append((w, beside))
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
