"""Engines start side by side and are timed one at a time, in rounds.

An engine start (torch.compile, graph capture) is most of a bench's time and uses the GPU little, while a timed
pass must have the GPU and the host to itself. So the engines of a wave start together; each says when it is
ready and waits, holding its memory. Then they take turns: in each round, each engine in turn times one pass of
every cell it still needs (its cells' warm-ups come with their first pass) while the rest wait idle, until every
engine has all its passes. A host-bound model's passes drift and jump with whatever else the machine does; in
rounds, every configuration of a wave samples the same stretch of the run, so their ratios do not depend on which
was timed first (the measurement that showed it: docs/perf-log.md, bench).

A start that fails beside others (memory, a port taken at the same moment) is tried once more alone after its
wave, so crowding never costs a figure.

An engine is finished when it says so, not when its process ends: a process that hangs on its way out (waiting on
an engine core nothing stopped, as one can after a profiled pass) would otherwise hold its GPU memory and its lane.
Each engine process leads a process group of its own, and once finished it gets `EXIT_S` to end before the group
(its engine core included) is killed.
"""

import os
import signal
import time
import weakref
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, TypeVar

G = TypeVar("G")

EXIT_S = 20.0  # for an engine process to end after its last cell (vLLM's own shutdown takes about a second)
ROUND = "round"  # the scheduler's one message: time your next round


class Engine(Protocol):
    """One engine process, seen from the scheduler."""

    def ready(self) -> bool: ...  # started, waiting for its first round

    def alive(self) -> bool: ...

    def round(self, timeout: float) -> Optional[bool]: ...  # time one round: True more to come, False finished
    # (every cell timed and traced), None failed (died, or no answer within `timeout`)

    def join(self, timeout: float) -> None: ...

    def kill(self) -> None: ...


def run(groups: Sequence[G], width: int, start: Callable[[G], Engine], finish: Callable[[G, Engine], None],
        timeout_s: float, poll_s: float = 0.5, exit_s: float = EXIT_S) -> None:
    """Start `groups` `width` at a time; time the ready ones in rounds, in order within a round; `finish` each once
    it is finished and gone (ended within `exit_s`, or killed) or failed (dead before ready, past `timeout_s` to
    start, or to time a round)."""
    for i in range(0, len(groups), width):
        wave = list(groups[i:i + width])
        engines = [start(g) for g in wave]
        _await(engines, timeout_s, poll_s)
        started: List[Tuple[G, Engine]] = []
        retry: List[G] = []
        for g, e in zip(wave, engines):
            if e.ready() or len(wave) == 1:
                started.append((g, e))
            else:  # crowded out: tried once more, alone, after the wave
                e.kill()
                retry.append(g)
        _time(started, timeout_s, exit_s, finish)
        for g in retry:
            e = start(g)
            _await([e], timeout_s, poll_s)
            _time([(g, e)], timeout_s, exit_s, finish)


def _await(engines: Sequence[Engine], timeout_s: float, poll_s: float) -> None:
    """Until every engine is ready or dead, or `timeout_s` have passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(e.alive() and not e.ready() for e in engines):
        time.sleep(poll_s)


def _time(engines: List[Tuple[G, Engine]], timeout_s: float, exit_s: float,
          finish: Callable[[G, Engine], None]) -> None:
    """Kill and finish the engines that never got ready; time the rest in rounds."""
    for g, e in engines:
        if not e.ready():
            e.kill()
            finish(g, e)
    _rounds([(g, e) for g, e in engines if e.ready()], timeout_s, exit_s, finish)


def _rounds(engines: List[Tuple[G, Engine]], timeout_s: float, exit_s: float,
            finish: Callable[[G, Engine], None]) -> None:
    """Round after round, each engine in turn times its next round; one that is finished (or failed) gets
    `exit_s` to end, is made sure of, and is finished."""
    active = list(engines)
    while active:
        for g, e in list(active):
            if e.round(timeout_s):
                continue
            active.remove((g, e))
            e.join(exit_s)
            e.kill()
            finish(g, e)


_LIVE: "weakref.WeakSet[Process]" = weakref.WeakSet()


class Process:
    """An `Engine` in a child process of its own process group: `target(*args, ready, turns)`, with `ready` an
    event of the context `ctx` and `turns` the child's end of a pipe (see `Turns`)."""

    def __init__(self, ctx, target, args: tuple):
        self._ready = ctx.Event()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_lead_group, args=(target, *args, self._ready, Turns(child)))
        self.killed = False  # still running when the scheduler was done with it
        self.process.start()
        child.close()  # the child holds its own copy: the pipe reads as closed once the child is gone
        _LIVE.add(self)

    def ready(self) -> bool:
        return self._ready.is_set()

    def alive(self) -> bool:
        return self.process.is_alive()

    def round(self, timeout: float) -> Optional[bool]:
        try:
            self._conn.send(ROUND)
            deadline = time.monotonic() + timeout
            while not self._conn.poll(0.5):
                if not self.process.is_alive() or time.monotonic() > deadline:
                    return None
            return bool(self._conn.recv())
        except (EOFError, OSError):  # the child died (its end of the pipe closed)
            return None

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        """Kill the process and everything it started (its engine core) if it is still running."""
        if self.process.is_alive():
            self.killed = True
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # killed before it led its own group
                self.process.kill()
        self.process.join()
        self._conn.close()
        _LIVE.discard(self)

    @property
    def exitcode(self):
        return self.process.exitcode


class Turns:
    """The engine's side of the rounds: wait for the scheduler's next round, then say whether more are wanted."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self) -> bool:
        """Block until the next round is asked for; False if the scheduler is gone."""
        try:
            return self.conn.recv() == ROUND
        except (EOFError, OSError):
            return False

    def answer(self, more: bool) -> None:
        try:
            self.conn.send(more)
        except (BrokenPipeError, OSError):  # the scheduler is gone: nothing to tell
            pass


def kill_all() -> None:
    """Kill every engine process still running (the bench was stopped): they lead groups of their own, so a
    terminal's Ctrl-C does not reach them, and each holds GPU memory."""
    for p in list(_LIVE):
        p.kill()


def _lead_group(target, *args) -> None:
    os.setpgid(0, 0)
    target(*args)
