"""Which of the machine's CPUs slow one another: cores a virtual machine's CPUs may share without saying so.

The H200 machine's guest reports one thread a core, yet SCHED_IDLE spinners on the 8 CPUs of a bench's lane slowed
its engines and a probe on a CPU outside the lane (docs/perf-log.md, 2026-12-04 09:59), while 8 busy loops on those
CPUs with no engine running had not slowed probes on 7 others (09:53). Two virtual CPUs on the two hardware threads of
one physical core would do that, and the guest's /sys cannot say. This reads it: each CPU's speed (the host-speed
probe's work back to back, so the CPU never halts: steer/bench/hostspeed.py) alone and while a busy loop runs on each
other CPU, in rounds. A pair whose loop slows the other's fastest reading by `SLOWER` or more, both ways, shares
something; a bench's lane can then take one CPU of each such pair.

    python -m steer.bench.siblings --cpus 0-15 --seconds 0.1 --out siblings.json
"""

import argparse
import itertools
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

from steer.bench import hostspeed, placement

SLOWER = 1.2  # a pair's loop making the other CPU's work this much slower (an SMT sibling: 1.3-2)
SPIN_UP_S = 0.2  # for the loop's interpreter to start and pin itself before the other CPU is timed
# Readings of each CPU beside each loop, spread over the run: on the H200 each 0.1 s reading of a busy CPU ran slow
# (1.3-1.9 times its floor) with odds of about 0.55 whatever ran beside it, so 3 rounds left 120 x 0.55^6 = 3.3
# pairs to chance (5 showed, CPU 15 in three: 2026-12-04 13:49); 6 leave 0.1
ROUNDS = 6


def measure(cpu: int, seconds: float) -> float:
    """The median time (us) of the probe's work run back to back on `cpu` for `seconds` (this thread pinned there
    meanwhile)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(hostspeed.work() * 1e6)
        return statistics.median(times)
    finally:
        os.sched_setaffinity(0, before)


def _spin_here(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def slowdowns(cpus: List[int], seconds: float, read: Callable[[int, float], float] = measure,
              rounds: int = ROUNDS) -> Tuple[Dict[int, float], Dict[Tuple[int, int], float]]:
    """Each CPU's floor (its fastest reading, alone or beside any loop), and for each pair (a, b) of `cpus` (a < b)
    how much a busy loop on either slows the other: a's fastest of `rounds` readings beside a loop on b over a's
    floor, the same of b's, the lesser of the two. On the H200 machine a CPU working back to back read 1.3-2.0 times
    its floor in about half of its 0.1-0.3 s readings, whatever ran beside it (2026-12-04 11:25-13:52), so one
    reading against one reading alone paired CPUs at random; a shared core slows every reading, both ways.
    `read(cpu, seconds)` times a CPU (`measure`; a stand-in in tests)."""
    every: Dict[int, List[float]] = {c: [] for c in cpus}  # each CPU's readings, alone and beside any loop
    beside: Dict[Tuple[int, int], List[float]] = {(a, b): [] for a in cpus for b in cpus if a != b}
    for _ in range(rounds):
        for c in cpus:
            every[c].append(read(c, seconds))
        for busy in cpus:
            with _loop(busy):
                for c in cpus:
                    if c != busy:
                        beside[(c, busy)].append(read(c, seconds))
                        every[c].append(beside[(c, busy)][-1])
    floor = {c: min(every[c]) for c in cpus}
    pairs = {(a, b): min(min(beside[(a, b)]) / floor[a], min(beside[(b, a)]) / floor[b])
             for a, b in itertools.combinations(cpus, 2)}
    return floor, pairs


@contextmanager
def _loop(cpu: int) -> Iterator[None]:
    """A busy loop on `cpu` within the block."""
    loop = subprocess.Popen([sys.executable, "-m", "steer.bench.siblings", "--spin", str(cpu)],
                            stdin=subprocess.DEVNULL)
    try:
        time.sleep(SPIN_UP_S)
        yield
    finally:
        loop.kill()
        loop.wait()


def shared(pairs: Dict[Tuple[int, int], float], slower: float = SLOWER) -> List[Tuple[int, int]]:
    """The pairs whose loop slowed the other CPU by `slower` or more, slowest first."""
    return sorted((p for p, r in pairs.items() if r >= slower), key=lambda p: -pairs[p])


def one_each(cpus: List[int], together: List[Tuple[int, int]]) -> List[int]:
    """`cpus` less the higher CPU of each pair in `together` whose lower one is kept."""
    out: List[int] = []
    for c in sorted(cpus):
        if not any((min(c, k), max(c, k)) in together for k in out):
            out.append(c)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpus", default=None, help="a Linux CPU list (default: every CPU this process may run on)")
    p.add_argument("--seconds", type=float, default=0.1, help="each reading's length (default 0.1)")
    p.add_argument("--out", type=Path, default=Path("siblings.json"))
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"readings of each CPU beside each loop (default {ROUNDS})")
    p.add_argument("--spin", type=int, help=argparse.SUPPRESS)  # the child that keeps a CPU busy
    a = p.parse_args(argv)
    if not (math.isfinite(a.seconds) and a.seconds > 0):
        raise SystemExit(f"--seconds: expected seconds > 0, got {a.seconds}")
    if a.spin is not None:
        _spin_here(a.spin)
    if a.rounds < 1:
        raise SystemExit(f"--rounds: expected 1 or more, got {a.rounds}")
    cpus = _cpus(a.cpus)
    if not a.out.parent.is_dir():
        raise SystemExit(f"--out: {a.out.parent} is not a directory")
    floor, pairs = slowdowns(cpus, a.seconds, rounds=a.rounds)
    together = shared(pairs)
    from steer.results import write_json

    write_json(a.out, {"cpus": cpus, "seconds": a.seconds, "rounds": a.rounds, "slower": SLOWER, "floor_us": floor,
                       "pairs": [{"cpus": list(k), "slower": round(v, 3)} for k, v in sorted(pairs.items())],
                       "shared": [list(k) for k in together], "one_each": one_each(cpus, together)})
    print(f"floor: {', '.join(f'{c} {us:.0f} us' for c, us in floor.items())}")
    said = ", ".join(f"{x}-{y} {pairs[(x, y)]:.2f}" for x, y in together) or "none"
    print(f"pairs slowed {SLOWER:g}x or more: {said}")
    print(f"one CPU of each: {','.join(map(str, one_each(cpus, together)))}")


def _cpus(text) -> List[int]:
    """The CPUs of `--cpus` (None: every CPU this process may run on); SystemExit naming the flag otherwise."""
    from steer.bench import workload
    from steer.errors import ConfigError

    try:
        workload.check_cpus("--cpus", text)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    cpus = (placement.available() or []) if text is None else placement.cpu_list(text)
    if len(cpus) < 2:
        raise SystemExit(f"--cpus: expected at least 2 CPUs to pair, got {text!r}")
    return cpus


if __name__ == "__main__":
    main()
