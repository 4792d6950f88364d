"""A model's engines start side by side and are timed one at a time, in rounds.

An engine start (torch.compile, graph capture) is most of a bench's time and uses the GPU little, while a timed
pass must have the GPU and the host to itself. So a model's engines start a wave at a time; each says when it is
ready and waits, holding its memory. Then they take turns: in a round, each engine in turn times one pass of every
cell it still needs while the rest wait idle, round after round until the wave has its passes.

The references (a and b, `reference`) start with the first wave and stay up through every wave of their model,
timing a pass of each of their cells in every round. Each other engine's pass then has the references' passes of
the same round beside it, seconds apart, and the report sets the one against the others round by round: a host's
slow spells move the passes of one round together, and the spread of the per-round ratios shows what is left.

An engine is finished when it says so, not when its process ends: a process that hangs on its way out (waiting on
an engine core nothing stopped) would otherwise hold its GPU memory. Each engine process leads a process group of
its own, and once finished it gets `EXIT_S` to end before the group (its engine core included) is killed.
"""

import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

from steer import procgroup

G = TypeVar("G")
EXIT_S = 20.0  # for an engine process to end after its last round (vLLM's own shutdown takes about a second)


@dataclass(frozen=True)
class Ask:
    """The scheduler's message: time round `round` (`keep`: a pass of every cell, short of its passes or not),
    or `close`: no more rounds, finish."""

    round: int = 0
    keep: bool = False
    close: bool = False


def run(groups: Sequence[G], width: int, start: Callable[[G], "Process"], finish: Callable[[G, "Process"], None],
        timeout_s: float, reference: Callable[[G], bool] = lambda g: False, poll_s: float = 0.5,
        exit_s: float = EXIT_S) -> None:
    """Start one model's `groups` `width` engines alive at a time (`start`: a `Process`, or anything with its
    methods), the `reference` ones through every wave; time each wave in rounds until no engine wants more; `finish`
    each once it is finished and gone (ended within `exit_s`, or killed) or failed (dead before ready, past
    `timeout_s` to start or to answer a round)."""
    refs = [g for g in groups if reference(g)]
    rest = [g for g in groups if not reference(g)]
    slots = max(1, width - len(refs))
    held: List[Tuple[G, "Process"]] = []  # the references up
    rounds = itertools.count(1)
    for i in range(0, max(len(rest), 1), slots):
        new = [(g, start(g)) for g in (refs if i == 0 else []) + rest[i:i + slots]]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(e.alive() and not e.ready() for _, e in new):
            time.sleep(poll_s)
        for g, e in new:
            if not e.ready():
                e.kill()
                finish(g, e)
        held += [(g, e) for g, e in new if e.ready() and reference(g)]
        active = [(g, e) for g, e in new if e.ready() and not reference(g)]
        wanted = bool(active) or i + slots >= len(rest)  # the last wave also gives the references their passes
        while wanted:
            n, wanted = next(rounds), False
            for g, e in held + active:
                mine = (g, e) in held
                more = e.round(timeout_s, Ask(n, keep=mine))
                if more is None or not (more or mine):  # a reference stays up with its passes; others go
                    (held if mine else active).remove((g, e))
                    _end(g, e, exit_s, finish)
                wanted = wanted or bool(more)
    for g, e in held:
        e.round(timeout_s, Ask(close=True))
        _end(g, e, exit_s, finish)


def _end(g: G, e: "Process", exit_s: float, finish: Callable[[G, "Process"], None]) -> None:
    """A finished (or failed) engine gets `exit_s` to end, is made sure of, and is finished."""
    e.join(exit_s)
    e.kill()
    finish(g, e)


_LIVE: "weakref.WeakSet[Process]" = weakref.WeakSet()


class Process:
    """An engine in a child process of its own process group: `target(*args, ready, turns)`, with `ready` an
    event of the context `ctx` and `turns` the child's end of a pipe (see `Turns`)."""

    def __init__(self, ctx, target, args: tuple):
        self._ready = ctx.Event()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=procgroup.lead, args=(target, *args, self._ready, Turns(child)))
        self.killed = False  # still running when the scheduler was done with it
        self.process.start()
        child.close()  # the child holds its own copy: the pipe reads as closed once the child is gone
        _LIVE.add(self)

    def ready(self) -> bool:
        return self._ready.is_set()

    def alive(self) -> bool:
        return self.process.is_alive()

    def round(self, timeout: float, ask: Ask) -> Optional[bool]:
        """Whether the engine wants more rounds once it has timed `ask`; None: it failed (died, or no answer in
        `timeout`)."""
        try:
            self._conn.send(ask)
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
        """Kill the process and everything it started (its engine core), also once the process itself has ended:
        an engine core that outlives it holds its GPU memory."""
        self.killed = procgroup.kill(self.process) or self.killed
        self._conn.close()
        _LIVE.discard(self)

    @property
    def exitcode(self):
        return self.process.exitcode


class Turns:
    """The engine's side of the rounds: wait for the scheduler's next ask, then say whether it wants more."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self) -> Optional[Ask]:
        """Block until the next ask; None if the scheduler is gone."""
        try:
            ask = self.conn.recv()
        except (EOFError, OSError):
            return None
        return ask if isinstance(ask, Ask) else None

    def answer(self, wanted: bool) -> None:
        try:
            self.conn.send(wanted)
        except (BrokenPipeError, OSError):  # the scheduler is gone: nothing to tell
            pass


def kill_all() -> None:
    """Kill every engine process still running (the bench was stopped): they lead groups of their own, so a
    terminal's Ctrl-C does not reach them, and each holds GPU memory."""
    for p in list(_LIVE):
        p.kill()
