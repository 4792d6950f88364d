"""Whose slow spells: the host's, or each engine process's own.

A host-bound model's passes spread by 20-85% (SmolLM2 on the H200), and a pass follows the previous pass of its
own engine (docs/perf-log.md, 2026-12-03). That alone cannot tell a host that runs slow for a second or two (a
neighbour on the machine, the hypervisor) from a process that does (its threads, its garbage, its GIL): an
engine's consecutive passes are also adjacent in time. Each pass's start (`started_s`, wall clock) and engine
process (`pid`) can: over every pair of passes adjacent in time, a host's spells make the next pass follow this
one whichever engine runs it; a process's make only its own next pass follow. A third kind would look like a
process's: a virtual machine's CPUs can each run slow for a while (their physical cores shared with other guests),
and an engine's busy loop stays on one CPU while the next engine's wakes on another. So each pass also keeps the
CPU its busiest process ended it on (`cpu_busiest`, steer/bench/placement.py), and `by_cpu` says how much of the
passes' spread that CPU accounts for.
"""

from collections import defaultdict
from math import exp, fsum, log
from statistics import StatisticsError, correlation
from typing import Dict, List, Optional, Sequence, Tuple

from steer.bench.cpu import centred

Found = Tuple[float, int]  # correlation, pairs
MIN_PASSES = 3  # a CPU with fewer passes says nothing of its speed


def adjacent(records: Sequence[Dict]) -> Dict[str, Optional[Found]]:
    """Over `records` (one model's timed cells), every pass against the pass that started next: the correlation
    between their log times, each less its cell's mean, for pairs run by the same engine process ("same") and by
    different ones ("other"), and how many pairs; None where fewer than 3 pairs or no spread. A pair with a gap
    longer than the first pass between them (a wave of engines starting) is no pair. Cells without `started_s`
    and `pid` (runs before they were recorded) count for nothing."""
    passes = []  # (start, wall, pid, log time less its cell's mean)
    for r in records:
        walls, starts = r.get("walls_s") or [], r.get("started_s") or []
        if len(starts) != len(walls) or len(walls) < 2 or "pid" not in r:
            continue
        logs = centred([log(w) for w in walls])
        passes += [(s, w, r["pid"], x) for s, w, x in zip(starts, walls, logs)]
    passes.sort()
    pairs: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
    for (start, wall, pid, x), (next_start, _, next_pid, y) in zip(passes, passes[1:]):
        if next_start - (start + wall) <= wall:
            pairs["same" if pid == next_pid else "other"].append((x, y))
    return {kind: _correlation(pairs[kind]) for kind in ("same", "other")}


def by_cpu(records: Sequence[Dict]) -> Optional[Tuple[float, Dict[int, Tuple[float, int]]]]:
    """Over `records` (one model's timed cells), each pass's log time less its cell's mean, by the CPU its busiest
    process ended it on (`cpu_busiest_passes`; CPUs with fewer than `MIN_PASSES` left out): the share of those
    times' variance the CPU accounts for beyond what chance gives that many CPUs (omega squared, at least 0), and
    per CPU the mean and how many passes. A host whose CPUs run at different speeds for a while (a virtual
    machine's CPUs share physical cores with other guests) shows here; None where fewer than 2 CPUs or no spread."""
    on: Dict[int, List[float]] = defaultdict(list)
    for r in records:
        walls, cpus = r.get("walls_s") or [], r.get("cpu_busiest_passes") or []
        if len(cpus) != len(walls) or len(walls) < 2:
            continue
        for c, x in zip(cpus, centred([log(w) for w in walls])):
            on[int(c)].append(x)
    on = {c: xs for c, xs in on.items() if len(xs) >= MIN_PASSES}
    every = [x for xs in on.values() for x in xs]
    k, n = len(on), len(every)
    if k < 2 or n <= k:
        return None
    mean = fsum(every) / n
    total = fsum((x - mean) ** 2 for x in every)
    if total <= 0:
        return None
    between = fsum(len(xs) * (fsum(xs) / len(xs) - mean) ** 2 for xs in on.values())
    within = (total - between) / (n - k)
    share = max(0.0, (between - (k - 1) * within) / (total + within))
    return share, {c: (fsum(xs) / len(xs), len(xs)) for c, xs in sorted(on.items())}


def said(records: Sequence[Dict]) -> List[str]:
    """What `adjacent` and `by_cpu` find in `records` (one model's timed cells), a sentence each; none where they
    find nothing."""
    out = []
    after = adjacent(records)
    if any(after.values()):
        found = [f"{what} r = {after[kind][0]:+.2f} ({after[kind][1]} pairs)"
                 for kind, what in (("same", "its own engine's"), ("other", "another engine's")) if after[kind]]
        out.append("each pass's time against the next pass's, when that is " + "; ".join(found)
                   + " (a host's slow spells: both follow; an engine process's own: only its own)")
    where = by_cpu(records)
    if where:
        share, cpus = where
        slow, fast = max(cpus, key=lambda c: cpus[c][0]), min(cpus, key=lambda c: cpus[c][0])
        out.append(f"the CPU its busiest process ended a pass on accounts for {share:.0%} of the variance of pass "
                   f"times beyond chance ({sum(n for _, n in cpus.values())} passes on {len(cpus)} CPUs; slowest "
                   f"CPU {slow} {_pct(cpus[slow][0])} over {cpus[slow][1]} passes, fastest CPU {fast} "
                   f"{_pct(cpus[fast][0])} over {cpus[fast][1]})")
    return out


def _pct(log_ratio: float) -> str:
    """A mean log time ratio as a percentage over or under the cells' means."""
    return f"{exp(log_ratio) - 1:+.0%}"


def _correlation(pairs: List[Tuple[float, float]]) -> Optional[Found]:
    if len(pairs) < 3:
        return None
    try:
        return correlation([x for x, _ in pairs], [y for _, y in pairs]), len(pairs)
    except StatisticsError:  # one side never varies
        return None
