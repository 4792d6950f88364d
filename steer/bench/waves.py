"""Engines start side by side and are timed one at a time.

An engine start (torch.compile, graph capture) is most of a bench's time and uses the GPU little, while a timed
pass must have the GPU and the host to itself. So the engines of a wave start together; each says when it is
ready and waits, holding its memory; then each in turn is told to go, times its cells and exits while the rest
wait idle. A start that fails beside others (memory, a port taken at the same moment) is tried once more alone
after its wave, so crowding never costs a figure.
"""

import time
from typing import Callable, List, Protocol, Sequence, TypeVar

G = TypeVar("G")


class Engine(Protocol):
    """One engine process, seen from the scheduler."""

    def ready(self) -> bool: ...  # started, waiting for go

    def alive(self) -> bool: ...

    def go(self) -> None: ...

    def join(self, timeout: float) -> None: ...

    def kill(self) -> None: ...


def run(groups: Sequence[G], width: int, start: Callable[[G], Engine], finish: Callable[[G, Engine], None],
        timeout_s: float, poll_s: float = 0.5) -> None:
    """Start `groups` `width` at a time; time the ready ones one by one, in order; `finish` each once it is done
    (or failed: dead before ready, or past `timeout_s` to start or to time its cells)."""
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
            _time(e, timeout_s)
            finish(g, e)
        for g in retry:
            e = start(g)
            _await([e], timeout_s, poll_s)
            _time(e, timeout_s)
            finish(g, e)


def _await(engines: Sequence[Engine], timeout_s: float, poll_s: float) -> None:
    """Until every engine is ready or dead, or `timeout_s` have passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(e.alive() and not e.ready() for e in engines):
        time.sleep(poll_s)


def _time(e: Engine, timeout_s: float) -> None:
    """Let a ready engine time its cells, then make sure its process is gone (ready or not)."""
    if e.ready():
        e.go()
        e.join(timeout_s)
    e.kill()


class Process:
    """An `Engine` in a child process: `target(*args, ready, go)` with two events of the context `ctx`."""

    def __init__(self, ctx, target, args: tuple):
        self._ready, self._go = ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=target, args=(*args, self._ready, self._go))
        self.process.start()

    def ready(self) -> bool:
        return self._ready.is_set()

    def alive(self) -> bool:
        return self.process.is_alive()

    def go(self) -> None:
        self._go.set()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()

    @property
    def exitcode(self):
        return self.process.exitcode
