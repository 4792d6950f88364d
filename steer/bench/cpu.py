"""The host's CPUs through a timed pass, from Linux's /proc/stat, and how a model's pass times follow them.

A step of a small model is mostly Python on the host (SmolLM2's GPU idles 61-65% of a decode step on the H200),
and its timed passes spread by 30-80% whatever steers them, every configuration alike (2026-12-02): the slow
passes are the host's. What the CPUs did through each pass says whose: cores kept busy (the timed engine's own
processes among them, so a cell's mean is taken out before comparing), or time the hypervisor took from this
machine's virtual CPUs (steal). The counters are the kernel's cumulative jiffies for all CPUs, read at the start
and end of a pass; where there is no /proc/stat (not Linux) a window reads nothing and the cells go without.
"""

from pathlib import Path
from statistics import StatisticsError, correlation, fmean, median
from typing import Dict, List, Optional, Sequence, Tuple

STAT = Path("/proc/stat")

# /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal (guest and guest_nice are already in
# user and nice)
_BUSY, _STEAL, _FIELDS = (0, 1, 2, 5, 6), 7, 8


def parse(text: str) -> Optional[Tuple[List[int], int]]:
    """(the all-CPU line's first eight counters, how many CPUs have a line of their own) of /proc/stat's text;
    None where it has no all-CPU line."""
    total, cpus = None, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name == "cpu":
            values = [int(v) for v in rest.split()[:_FIELDS]]
            total = values + [0] * (_FIELDS - len(values))  # an old kernel stops before steal
        elif name.startswith("cpu") and name[3:].isdigit():
            cpus += 1
    return None if total is None else (total, cpus)


def read(path: Path = STAT) -> Optional[Tuple[List[int], int]]:
    """The counters now (see `parse`), None where the file cannot be read."""
    try:
        return parse(path.read_text())
    except OSError:
        return None


def between(start: Optional[Tuple[List[int], int]], end: Optional[Tuple[List[int], int]]) -> Dict[str, float]:
    """{"cpu_busy": CPUs kept busy on average (user, nice, system, irq, softirq), "cpu_steal": percent of the
    CPUs' time the hypervisor took} between two readings; {} where either is missing or no time passed."""
    if start is None or end is None:
        return {}
    delta = [b - a for a, b in zip(start[0], end[0])]
    elapsed = sum(delta)
    if elapsed <= 0:
        return {}
    return {"cpu_busy": end[1] * sum(delta[i] for i in _BUSY) / elapsed, "cpu_steal": 100.0 * delta[_STEAL] / elapsed}


class Window:
    """Within its `with` block, what the host's CPUs did: `summary()` (see `between`) once it has closed."""

    def __init__(self, path: Path = STAT):
        self.path = path
        self._start = self._end = None

    def __enter__(self) -> "Window":
        self._start = read(self.path)
        return self

    def __exit__(self, *exc) -> None:
        self._end = read(self.path)

    def summary(self) -> Dict[str, float]:
        return between(self._start, self._end)


def follows(records: Sequence[Dict], key: str) -> Optional[Tuple[float, int, int]]:
    """How a model's pass times follow a host reading: the correlation, over every timed pass of `records` that
    has the reading, between the pass's time over its cell's median and the reading, each less its cell's mean
    (so that neither a cell's speed nor its own load counts); how many passes, and how many cells. None where
    fewer than 3 passes or either side never varies within a cell."""
    xs, ys, cells = [], [], 0
    for r in records:
        walls, values = r.get("walls_s") or [], r.get(f"{key}_passes") or []
        if len(values) != len(walls):
            continue
        read = [(w, v) for w, v in zip(walls, values) if v is not None]  # a pass the reading missed
        if len(read) < 2:
            continue
        walls, values = [w for w, _ in read], [v for _, v in read]
        cells += 1
        times = [w / median(walls) for w in walls]
        xs += centred(values)
        ys += centred(times)
    if len(xs) < 3 or not any(xs) or not any(ys):
        return None
    try:
        return correlation(xs, ys), len(xs), cells
    except StatisticsError:
        return None


def centred(values: List[float]) -> List[float]:
    """`values` less their mean; exactly 0 where they never vary (a mean can round off a constant)."""
    if max(values) == min(values):
        return [0.0] * len(values)
    mean = fmean(values)
    return [v - mean for v in values]
