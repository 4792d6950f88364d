"""Whose slow spells: the host's, or each engine process's own.

A host-bound model's passes spread by 20-85% (SmolLM2 on the H200), and a pass follows the previous pass of its
own engine (docs/perf-log.md, 2026-12-03). That alone cannot tell a host that runs slow for a second or two (a
neighbour on the machine, the hypervisor) from a process that does (its threads, its garbage, its GIL): an
engine's consecutive passes are also adjacent in time. Each pass's start (`started_s`, wall clock) and engine
process (`pid`) can: over every pair of passes adjacent in time, a host's spells make the next pass follow this
one whichever engine runs it; a process's make only its own next pass follow.
"""

from collections import defaultdict
from math import log
from statistics import StatisticsError, correlation, median
from typing import Dict, List, Optional, Sequence, Tuple

Found = Tuple[float, int]  # correlation, pairs


def adjacent(records: Sequence[Dict]) -> Dict[str, Optional[Found]]:
    """Over `records` (one model's timed cells), every pass against the pass that started next: the correlation
    between their log times over their cells' medians, for pairs run by the same engine process ("same") and by
    different ones ("other"), and how many pairs; None where fewer than 3 pairs or no spread. Cells without
    `started_s` and `pid` (runs before they were recorded) count for nothing."""
    passes = []  # (start, pid, log time over the cell's median)
    for r in records:
        walls, starts = r.get("walls_s") or [], r.get("started_s") or []
        if len(starts) != len(walls) or len(walls) < 2 or "pid" not in r:
            continue
        mid = median(walls)
        passes += [(s, r["pid"], log(w / mid)) for s, w in zip(starts, walls)]
    passes.sort()
    pairs: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
    for (_, pid, x), (_, next_pid, y) in zip(passes, passes[1:]):
        pairs["same" if pid == next_pid else "other"].append((x, y))
    return {kind: _correlation(pairs[kind]) for kind in ("same", "other")}


def _correlation(pairs: List[Tuple[float, float]]) -> Optional[Found]:
    if len(pairs) < 3:
        return None
    try:
        return correlation([x for x, _ in pairs], [y for _, y in pairs]), len(pairs)
    except StatisticsError:  # one side never varies
        return None
