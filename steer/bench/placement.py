"""Where a timed engine's processes ran through a pass, and pinning a lane's engines to chosen CPUs.

SmolLM2's passes spread by 20-85% with nothing else on the host, in spells of about a second, one engine at a time:
a pass follows its engine's previous pass in the same turn but not the other engines' passes of the round
(docs/perf-log.md, 2026-12-03 03:00). A vLLM engine is two busy processes (the frontend, which times the pass, and
its engine core), which talk every decode step; where the scheduler puts them when they wake for their turn
could make their passes fast or slow for a while. So each pass records,
of the processes that worked through it (this one and its children), whether they ended it on CPUs of more than
one last-level cache (`cpu_apart`, 1 or 0, where /sys says which CPUs share one) and what share of them ended it
on another CPU than they started it on (`cpu_moved`); the report correlates pass times with both. `pin` is the
remedy to measure against it (`lanes[].cpus`). Linux only: elsewhere a window reads nothing.
"""

import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PROC, SYS_CPU = Path("/proc"), Path("/sys/devices/system/cpu")
WORKED = 0.1  # a process that ran for this share of a pass's time or more worked through it


def cpu_list(text: str) -> List[int]:
    """The CPUs of a Linux CPU list ("0-3,8" is [0, 1, 2, 3, 8]); ValueError where `text` is not one."""
    cpus = set()
    for part in str(text).split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise ValueError(f"expected a CPU list such as \"0-3\" or \"0,2,4-7\", got {text!r}")
        cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    return sorted(cpus)


def pin(cpus: List[int]) -> None:
    """Run this process, and every thread and process it starts from now on, on `cpus` only."""
    os.sched_setaffinity(0, cpus)


def available() -> Optional[List[int]]:
    """The CPUs this process may run on (None where the platform does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def llc_domains(root: Path = SYS_CPU) -> Dict[int, int]:
    """Each CPU's last-level (L3) cache, named by the lowest CPU sharing it; {} where /sys does not say."""
    domains = {}
    for d in root.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (d / "level").read_text().strip() == "3":
                domains[int(d.parent.parent.name[3:])] = min(cpu_list((d / "shared_cpu_list").read_text().strip()))
        except (OSError, ValueError):
            continue
    return domains


def snapshot(pid: int, proc: Path = PROC) -> Dict[int, Tuple[int, int]]:
    """{pid: (the CPU it last ran on, its CPU time in clock ticks)} of process `pid` and its children."""
    stats = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                # After the command's closing parenthesis: state, ppid, ... utime and stime (fields 14 and
                # 15 of proc(5)), ... processor (field 39); the command itself may hold spaces and parentheses
                fields = (d / "stat").read_text().rpartition(")")[2].split()
                if int(d.name) == pid or int(fields[1]) == pid:
                    stats[int(d.name)] = (int(fields[36]), int(fields[11]) + int(fields[12]))
            except (OSError, ValueError, IndexError):  # gone meanwhile, or not a stat line
                continue
    return stats


def between(start: Dict[int, Tuple[int, int]], end: Dict[int, Tuple[int, int]], ticks: float,
            domains: Dict[int, int]) -> Dict[str, float]:
    """`cpu_apart` and `cpu_moved` (the module docstring) over a pass of `ticks` clock ticks; {} where no process
    worked through it, and no `cpu_apart` where fewer than two did or /sys named no caches."""
    worked = [p for p in end if p in start and end[p][1] - start[p][1] >= WORKED * ticks]
    if not worked or ticks <= 0:
        return {}
    got = {"cpu_moved": sum(end[p][0] != start[p][0] for p in worked) / len(worked)}
    if len(worked) >= 2 and all(end[p][0] in domains for p in worked):
        got["cpu_apart"] = float(len({domains[end[p][0]] for p in worked}) > 1)
    return got


class Window:
    """Within its `with` block, where this process and its children ran: `summary()` (see `between`)."""

    def __init__(self, proc: Path = PROC, root: Path = SYS_CPU, pid: Optional[int] = None):
        self.proc, self.pid = proc, pid or os.getpid()
        self.domains = llc_domains(root)
        self._start: Dict[int, Tuple[int, int]] = {}
        self._end: Dict[int, Tuple[int, int]] = {}
        self._t0 = self._ticks = 0.0

    def __enter__(self) -> "Window":
        self._start, self._t0 = self._read(), time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self._end, self._ticks = self._read(), (time.monotonic() - self._t0) * _hz()

    def summary(self) -> Dict[str, float]:
        return between(self._start, self._end, self._ticks, self.domains)

    def _read(self) -> Dict[int, Tuple[int, int]]:
        try:
            return snapshot(self.pid, self.proc)
        except OSError:  # no /proc (not Linux)
            return {}


def _hz() -> float:
    return float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
