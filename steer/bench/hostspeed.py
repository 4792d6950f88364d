"""The host's own speed through a bench run, read by a probe process on a CPU no engine uses.

A host-bound model's decode step (SmolLM2's, a few ms of mostly host work) runs in modes that last seconds and that
every engine process on the machine shares at once (docs/perf-log.md, 2026-12-04 09:35): the host's CPUs, a virtual
machine's on a shared host, run faster or slower with whatever else that host does, and nothing inside the machine
says so. The probe times the same piece of pure-Python work every `PERIOD_S` on a CPU of its own (`probe_cpu`, outside
every lane) and writes each time with its wall clock; each timed pass then gets the median of the probe's times within
it (`annotate`), so that a pass can be set beside the host's speed while it ran.

    python -m steer.bench.hostspeed --cpu 15 --out hostspeed.txt   # until stopped
"""

import argparse
import bisect
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

PERIOD_S = 0.02  # a 64 x 128 SmolLM2 pass (0.35 s) gets about 15 readings
WORK = 20_000  # iterations: about 1 ms of one CPU at full speed (5% of the probe's CPU)

Reading = Tuple[float, float]  # (wall clock at the work's end, its duration in us)


def work(n: int = WORK) -> float:
    """Seconds that `n` iterations of plain integer arithmetic take on this CPU now."""
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x = (x + i * i) & 0xFFFF
    return time.perf_counter() - t0


def probe(out: Path, period_s: float = PERIOD_S) -> None:
    """Time `work` every `period_s`, one line "wall_clock duration_us" at a time to `out`, until SIGTERM or until
    the process that started it is gone (a bench killed outright must not leave a probe spinning on its CPU)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the bench's whole group; the bench stops it
    parent = os.getppid()
    with open(out, "a", buffering=1) as f:
        while not stop and os.getppid() == parent:
            d = work()
            f.write(f"{time.time():.4f} {d * 1e6:.1f}\n")
            time.sleep(period_s)


class Probe:
    """Within its `with` block, a probe process pinned to `cpu` writes its readings to `out`."""

    def __init__(self, cpu: int, out: Path, period_s: float = PERIOD_S):
        self.cmd = [sys.executable, "-m", "steer.bench.hostspeed", "--cpu", str(cpu), "--out", str(out),
                    "--period", str(period_s)]
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Probe":
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def readings(path: Path) -> List[Reading]:
    """The probe's readings so far (a line cut short by a probe still writing is left out)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().split("\n")[:-1]:  # the last piece: "" or a line still being written
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((float(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return out


def _during(got: Sequence[Reading], times: List[float], start: float, wall: float) -> Optional[float]:
    """The median probe time (us) of the readings taken within [start, start + wall]; None if none was. `got` is in
    time order, as the probe writes it, and `times` its wall clocks."""
    inside = [d for _, d in got[bisect.bisect_left(times, start):bisect.bisect_right(times, start + wall)]]
    return statistics.median(inside) if inside else None


def annotate(records: List[Dict], got: Sequence[Reading]) -> None:
    """Give each timed record `host_us_passes` (each pass's median probe time, None where none fell in it) and
    `host_us` (their median), where the probe read anything during its passes."""
    times = [t for t, _ in got]
    for r in records:
        if "walls_s" not in r or "started_s" not in r or "host_us_passes" in r:
            continue
        each = [_during(got, times, s, w) for s, w in zip(r["started_s"], r["walls_s"])]
        if any(x is not None for x in each):
            r["host_us_passes"] = each
            r["host_us"] = statistics.median(x for x in each if x is not None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", type=int, required=True, help="the CPU the probe runs on")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--period", type=float, default=PERIOD_S, help=f"seconds between readings (default {PERIOD_S})")
    a = p.parse_args(argv)
    if not (math.isfinite(a.period) and a.period >= 0):
        raise SystemExit(f"--period: expected seconds >= 0, got {a.period}")
    os.sched_setaffinity(0, {a.cpu})
    probe(a.out, a.period)


if __name__ == "__main__":
    main()
