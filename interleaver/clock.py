"""Host time per section, for profiling the taps' own overhead (the tap worker's and the engine's).

A section's total says what it costs; its histogram says how: every call slow (the code, or caches cold once per
step) or a few calls very slow (a wait behind something else). Durations are binned by eighths of an octave of a
microsecond (9% apart), so histograms from many takes, engines or passes add up by bin."""

import math
from typing import Dict, List, Mapping

import numpy as np

BINS_PER_OCTAVE = 8
_FLOOR_US = 0.25  # shorter calls share the lowest bin
_FOLD = 1 << 16  # calls kept one by one before they are binned (a process profiled for hours stays small)


def bins(seconds) -> Dict[str, int]:
    """{bin: calls} of these durations (bin b holds [2 ** (b / 8), 2 ** ((b + 1) / 8)) us; keys are strings, so
    the histogram is plain data for vLLM's RPC and JSON)."""
    us = np.maximum(np.asarray(seconds, dtype=np.float64) * 1e6, _FLOOR_US)
    keys, counts = np.unique(np.floor(BINS_PER_OCTAVE * np.log2(us)).astype(np.int64), return_counts=True)
    return {str(k): int(c) for k, c in zip(keys, counts)}


def merge(into: Dict[str, int], more: Mapping[str, int]) -> Dict[str, int]:
    """Add histogram `more` into `into` (and return it)."""
    for k, c in more.items():
        into[k] = into.get(k, 0) + c
    return into


def quantile(hist: Mapping[str, int], q: float) -> float:
    """The `q` quantile in us of a histogram from `bins`: the middle of the bin it falls in (nan if empty)."""
    total = sum(hist.values())
    if not total:
        return math.nan
    seen = 0
    for k in sorted(hist, key=int):
        seen += hist[k]
        if seen >= q * total * (1 - 1e-12):  # q * total may round over the whole count it means
            break
    return 2 ** ((int(k) + 0.5) / BINS_PER_OCTAVE)


class Clock:
    """Host time per section and call counts, for profiling the taps' own overhead (and the engine's host work
    around them)."""

    def __init__(self) -> None:
        self._times: Dict[str, List[float]] = {}
        self._binned: Dict[str, dict] = {}  # section -> {"seconds", "calls", "hist"} of calls already binned

    def add(self, section: str, dt: float) -> None:
        times = self._times.get(section)
        if times is None:
            times = self._times[section] = []
        times.append(dt)
        if len(times) >= _FOLD:
            self._fold(section)

    def _fold(self, section: str) -> None:
        times = self._times.pop(section, [])
        acc = self._binned.setdefault(section, {"seconds": 0.0, "calls": 0, "hist": {}})
        acc["seconds"] += math.fsum(times)
        acc["calls"] += len(times)
        merge(acc["hist"], bins(times))

    def take(self) -> Dict[str, dict]:
        """{section: {"seconds": total, "calls": n, "hist": `bins` of them}} since the last take."""
        for section in list(self._times):
            self._fold(section)
        out, self._binned = self._binned, {}
        return out
