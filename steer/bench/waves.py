"""Engines start side by side and are timed one at a time.

An engine start (torch.compile, graph capture) is most of a bench's time and uses the GPU little, while a timed
pass must have the GPU and the host to itself. So the engines of a wave start together; each says when it is
ready and waits, holding its memory; then each in turn is told to go, times its cells and exits while the rest
wait idle. A start that fails beside others (memory, a port taken at the same moment) is tried once more alone
after its wave, so crowding never costs a figure.

An engine is done when it says so, not when its process ends: a process that hangs on its way out (waiting on an
engine core nothing stopped, 2026-11-29 after a profiled pass) would otherwise hold its GPU memory and its lane. Each
engine process leads a process group of its own, and once done it gets `EXIT_S` to end before the group (its
engine core included) is killed.
"""

import os
import signal
import time
import weakref
from typing import Callable, List, Protocol, Sequence, TypeVar

G = TypeVar("G")

EXIT_S = 20.0  # for an engine process to end after its last cell (vLLM's own shutdown takes about a second)


class Engine(Protocol):
    """One engine process, seen from the scheduler."""

    def ready(self) -> bool: ...  # started, waiting for go

    def alive(self) -> bool: ...

    def go(self) -> None: ...

    def done(self) -> bool: ...  # every cell timed (and traced): nothing left but to exit

    def join(self, timeout: float) -> None: ...

    def kill(self) -> None: ...


def run(groups: Sequence[G], width: int, start: Callable[[G], Engine], finish: Callable[[G, Engine], None],
        timeout_s: float, poll_s: float = 0.5, exit_s: float = EXIT_S) -> None:
    """Start `groups` `width` at a time; time the ready ones one by one, in order; `finish` each once it is done
    and gone (ended within `exit_s`, or killed) or failed (dead before ready, or past `timeout_s` to start or to
    time its cells)."""
    for i in range(0, len(groups), width):
        wave = list(groups[i:i + width])
        engines = [start(g) for g in wave]
        _await(engines, timeout_s, poll_s)
        retry: List[G] = []
        for g, e in zip(wave, engines):
            if not e.ready() and len(wave) > 1:
                e.kill()
                retry.append(g)
                continue
            _time(e, timeout_s, poll_s, exit_s)
            finish(g, e)
        for g in retry:
            e = start(g)
            _await([e], timeout_s, poll_s)
            _time(e, timeout_s, poll_s, exit_s)
            finish(g, e)


def _await(engines: Sequence[Engine], timeout_s: float, poll_s: float) -> None:
    """Until every engine is ready or dead, or `timeout_s` have passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(e.alive() and not e.ready() for e in engines):
        time.sleep(poll_s)


def _time(e: Engine, timeout_s: float, poll_s: float, exit_s: float) -> None:
    """Let a ready engine time its cells, give it `exit_s` to end once done, then make sure it is gone (ready or
    not)."""
    if e.ready():
        e.go()
        deadline = time.monotonic() + timeout_s
        while e.alive() and not e.done() and time.monotonic() < deadline:
            time.sleep(poll_s)
        e.join(exit_s)
    e.kill()


_LIVE: "weakref.WeakSet[Process]" = weakref.WeakSet()


class Process:
    """An `Engine` in a child process of its own process group: `target(*args, ready, go, done)` with three events
    of the context `ctx`."""

    def __init__(self, ctx, target, args: tuple):
        self._ready, self._go, self._done = ctx.Event(), ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=_lead_group, args=(target, *args, self._ready, self._go, self._done))
        self.killed = False  # still running when the scheduler was done with it
        self.process.start()
        _LIVE.add(self)

    def ready(self) -> bool:
        return self._ready.is_set()

    def alive(self) -> bool:
        return self.process.is_alive()

    def go(self) -> None:
        self._go.set()

    def done(self) -> bool:
        return self._done.is_set()

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
        _LIVE.discard(self)

    @property
    def exitcode(self):
        return self.process.exitcode


def kill_all() -> None:
    """Kill every engine process still running (the bench was stopped): they lead groups of their own, so a
    terminal's Ctrl-C does not reach them, and each holds GPU memory."""
    for p in list(_LIVE):
        p.kill()


def _lead_group(target, *args) -> None:
    os.setpgid(0, 0)
    target(*args)
