"""Keep the lanes' CPUs from halting while the bench runs: one spinner at SCHED_IDLE on each.

On the H200 machine (a KVM guest whose idle is HLT, no cpuidle driver) a virtual CPU that halts, even for 2-20 ms,
comes back slow: the host-speed probe's same work takes 1.6-1.7 times as long in 39-58% of its readings on a CPU
that sleeps between them, 9% on one that never does, and 7-13% when a SCHED_IDLE spinner keeps the sleeping CPU busy
(docs/perf-log.md, 2026-12-04 10:20). A host-bound engine's threads wait on one another every decode step, so its
CPUs halt all the time, and its steps ran in a slow mode most passes. A spinner runs only when nothing else on its
CPU wants to (SCHED_IDLE: any other thread preempts it at once), so the engines keep their CPUs and the CPUs never
halt.

    python -m steer.bench.awake --cpu 3   # spins until stopped
"""

import argparse
import os
import subprocess
import sys
from typing import List


def spin(cpu: int) -> None:
    """Spin on `cpu` at SCHED_IDLE, forever."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


class Spinners:
    """Within its `with` block, one spinner process on each of `cpus`."""

    def __init__(self, cpus: List[int]):
        self.cpus = list(cpus)
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "Spinners":
        for cpu in self.cpus:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "steer.bench.awake", "--cpu", str(cpu)],
                                               stdin=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", type=int, required=True, help="the CPU to keep busy")
    spin(p.parse_args(argv).cpu)


if __name__ == "__main__":
    main()
