"""Where a timed engine's processes ran through a pass, and pinning a lane's engines to chosen CPUs.

SmolLM2's passes spread by 20-85% with nothing else on the host, in spells of about a second, one engine at a time:
a pass follows its engine's previous pass in the same turn but not the other engines' passes of the round
(docs/perf-log.md, 2026-12-03 03:00). A vLLM engine is two busy processes (the frontend, which times the pass, and
its engine core), which talk every decode step; where the scheduler puts them when they wake for their turn
could make their passes fast or slow for a while. So each pass records,
of the processes that worked through it (this one and its children), whether they ended it on CPUs of more than
one last-level cache (`cpu_apart`, 1 or 0, where /sys says which CPUs share one; a virtual machine's /sys says what
its hypervisor tells it), whether two of them ended it on one physical core (`cpu_shared_core`: the same CPU, or
two SMT threads of a core, each running slower while the other is busy) and what share of them ended it on
another CPU than they started it on (`cpu_moved`),
each process by its main thread, where a vLLM process's steady work runs (its I/O threads are not read); the
report correlates pass times with each. `pin` is the
remedy to measure against it (`lanes[].cpus`; `one_per_core` chooses CPUs that keep busy processes off each
other's cores). Linux only: elsewhere a window reads nothing.
"""

import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PROC, SYS_CPU = Path("/proc"), Path("/sys/devices/system/cpu")
READINGS = ("cpu_apart", "cpu_shared_core", "cpu_moved")  # what `between` reads of a pass
# ... and the CPU the pass's busiest process (an engine core's busy loop) ended it on: a name, not a measure
BUSIEST = "cpu_busiest"
WORKED = 0.1  # a process that ran for this share of a pass's time or more worked through it
MAX_CPUS = 8192  # the kernel's largest NR_CPUS


def cpu_list(text: str) -> List[int]:
    """The CPUs of a Linux CPU list ("0-3,8" is [0, 1, 2, 3, 8]); ValueError where `text` is not one."""
    cpus = set()
    for part in str(text).split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise ValueError(f"expected a CPU list such as \"0-3\" or \"0,2,4-7\", got {text!r}")
        top = int(hi if dash else lo)
        if top >= MAX_CPUS:  # Linux's own limit; a range past it is built whole otherwise
            raise ValueError(f"names CPU {top} in {text!r}; Linux numbers CPUs below {MAX_CPUS}")
        cpus.update(range(int(lo), top + 1))
    return sorted(cpus)


def as_text(cpus) -> str:
    """`cpus` as a Linux CPU list ([0, 1, 2, 3, 8] is "0-3,8")."""
    runs: List[List[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin(cpus: List[int], proc: Path = PROC) -> None:
    """Run this process (each of its threads: an affinity is a thread's own) and every thread and process it
    starts from now on on `cpus` only. Thread pools sized before (torch's) keep their size."""
    place({tid: cpus for tid in threads("self", proc) or [0]})  # no /proc: this thread, and what it starts


def threads(pid, proc: Path = PROC) -> List[int]:
    """The ids of process `pid`'s threads (`pid` "self": this process's); [] where /proc does not say or it is
    gone."""
    try:
        return sorted(int(t.name) for t in (proc / str(pid) / "task").iterdir())
    except OSError:
        return []


def place(mapping: Dict[int, List[int]]) -> None:
    """Set each thread's CPUs (thread id -> CPUs; 0: the calling thread), passing over a thread that ended
    meanwhile."""
    for tid, cpus in mapping.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue


def available() -> Optional[List[int]]:
    """The CPUs this process may run on (None where the platform does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


@lru_cache(maxsize=4)
def llc_domains(root: Path = SYS_CPU) -> Dict[int, int]:
    """Each CPU's last-level (L3) cache, named by the lowest CPU sharing it; {} where /sys does not say."""
    return _lowest_sharing((d.parent.parent, d / "shared_cpu_list") for d in root.glob("cpu[0-9]*/cache/index[0-9]*")
                           if _read(d / "level") == "3")


def family(pid: int, proc: Path = PROC) -> List[int]:
    """Process `pid` and its children (a vLLM engine's frontend and its engine core), from /proc."""
    return [pid] + sorted(int(d.name) for d in proc.iterdir() if d.name.isdigit() and int(d.name) != pid
                          and (_fields(proc / d.name) or [None, None])[1] == str(pid))


def snapshot(pids: List[int], proc: Path = PROC) -> Dict[int, Tuple[int, int]]:
    """{pid: (the CPU its main thread last ran on, its CPU time in clock ticks, every thread's)} of `pids` still
    running."""
    stats = {}
    for pid in pids:
        fields = _fields(proc / str(pid))
        try:
            # proc(5) numbers the fields from 1 with the pid, then the command: after it, utime and stime are
            # fields 14 and 15, processor field 39
            stats[pid] = (int(fields[36]), int(fields[11]) + int(fields[12]))
        except (TypeError, ValueError, IndexError):  # gone meanwhile, or not a stat line
            continue
    return stats


def _fields(d: Path) -> Optional[List[str]]:
    """A /proc/<pid>/stat line's fields after the command (which may hold spaces and parentheses), from the state
    on; None where it cannot be read."""
    try:
        return (d / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


@lru_cache(maxsize=4)
def cores(root: Path = SYS_CPU) -> Dict[int, int]:
    """Each CPU's physical core, named by the lowest CPU of its SMT siblings; {} where /sys does not say."""
    return _lowest_sharing((d.parent.parent, d) for d in root.glob("cpu[0-9]*/topology/thread_siblings_list"))


def _lowest_sharing(lists) -> Dict[int, int]:
    """{CPU: the lowest CPU of its list} for each (/sys's cpuN directory, a CPU-list file of it) of `lists`; a CPU
    whose file cannot be read or parsed is left out."""
    out = {}
    for cpu_dir, path in lists:
        try:
            out[int(cpu_dir.name[3:])] = min(cpu_list(_read(path)))
        except ValueError:  # unreadable (None is no CPU list) or not a list
            continue
    return out


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def one_per_core(cpus: List[int], root: Path = SYS_CPU) -> List[int]:
    """`cpus` less every CPU that shares a physical core with a lower one of them (all of them where /sys does not
    say): busy processes pinned there cannot land on two threads of one core."""
    core, seen, out = cores(root), set(), []
    for c in sorted(cpus):
        if core.get(c, c) not in seen:
            seen.add(core.get(c, c))
            out.append(c)
    return out


def between(start: Dict[int, Tuple[int, int]], end: Dict[int, Tuple[int, int]], ticks: float,
            domains: Dict[int, int], core: Optional[Dict[int, int]] = None) -> Dict[str, float]:
    """`cpu_apart`, `cpu_shared_core`, `cpu_moved` (the module docstring) and `cpu_busiest` over a pass of `ticks`
    clock ticks; {} where no process worked through it, and neither of the first two where fewer than two did or
    /sys named no caches (cores)."""
    worked = [p for p in end if p in start and end[p][1] - start[p][1] >= WORKED * ticks]
    if not worked or ticks <= 0:
        return {}
    busiest = max(worked, key=lambda p: end[p][1] - start[p][1])
    got = {"cpu_moved": sum(end[p][0] != start[p][0] for p in worked) / len(worked),
           BUSIEST: float(end[busiest][0])}
    cpus = [end[p][0] for p in worked]
    if len(cpus) >= 2 and all(c in domains for c in cpus):
        got["cpu_apart"] = float(len({domains[c] for c in cpus}) > 1)
    if len(cpus) >= 2 and core and all(c in core for c in cpus):
        got["cpu_shared_core"] = float(len({core[c] for c in cpus}) < len(cpus))
    return got


class Window:
    """Within its `with` block, where this process and its children ran: `summary()` (see `between`). Its reads
    (the process's family once, then one stat file each) come before and after the block: enter it outside the
    other readings of a pass, so that they do not count its work."""

    def __init__(self, proc: Path = PROC, root: Path = SYS_CPU, pid: Optional[int] = None):
        self.proc, self.pid = proc, pid or os.getpid()
        self.domains, self.cores = llc_domains(root), cores(root)
        self._pids: List[int] = []
        self._start: Dict[int, Tuple[int, int]] = {}
        self._end: Dict[int, Tuple[int, int]] = {}
        self._t0 = self._ticks = 0.0

    def __enter__(self) -> "Window":
        try:
            self._pids = family(self.pid, self.proc)
        except OSError:  # no /proc (not Linux)
            self._pids = []
        self._start, self._t0 = snapshot(self._pids, self.proc), time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self._ticks = (time.monotonic() - self._t0) * _hz()
        self._end = snapshot(self._pids, self.proc)

    def summary(self) -> Dict[str, float]:
        return between(self._start, self._end, self._ticks, self.domains, self.cores)


def _hz() -> float:
    return float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
