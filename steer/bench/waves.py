"""Engines start side by side and are timed one at a time, in rounds.

An engine start (torch.compile, graph capture) is most of a bench's time and uses the GPU little, while a timed
pass must have the GPU and the host to itself. So the engines of a wave start together; each says when it is
ready and waits, holding its memory. Then they take turns: in each round, each engine in turn times one pass of
every cell it still needs (its cells' warm-ups come with their first pass) while the rest wait idle, until every
engine has all its passes. A host-bound model's passes drift and jump with whatever else the machine does; in
rounds, every configuration of a wave samples the same stretch of the run, so their ratios do not depend on which
was timed first (the measurement that showed it: docs/perf-log.md, bench).

Paired (a model's `paired`, e.g. b): where the wave holds that reference configuration, a round goes batch by
batch and cell by cell, and the reference times a pass of the batch before and after every other engine's pass of
a cell, whatever it has: each steered pass then sits between two of b's, and the report sets it against them
(steer/bench/pairs.py). A host-bound model's passes move 20-40% from one to the next in the host's spells; a pair
shares the spell far more often than passes a round apart. The reference's cells are finished when the others'
are.

A start that fails beside others (memory, a port taken at the same moment) is tried once more alone after its
wave, so crowding never costs a figure.

An engine is finished when it says so, not when its process ends: a process that hangs on its way out (waiting on
an engine core nothing stopped, as one can after a profiled pass) would otherwise hold its GPU memory and its lane.
Each engine process leads a process group of its own, and once finished it gets `EXIT_S` to end before the group
(its engine core included) is killed.
"""

import functools
import time
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, TypeVar

from steer import procgroup

G = TypeVar("G")

EXIT_S = 20.0  # for an engine process to end after its last cell (vLLM's own shutdown takes about a second)
Batch = Tuple[int, int]  # requests, new tokens
Cell = Tuple[str, Batch]  # scenario, batch


@dataclass(frozen=True)
class Ask:
    """The scheduler's message: time a pass of each of your cells still short of its passes, those at `batch`
    of `scenario` (None: any). `keep`: the pairing reference times such a pass whether or not the cell has its
    passes; `close`: it is done, finish."""

    batch: Optional[Batch] = None
    scenario: Optional[str] = None
    keep: bool = False
    close: bool = False


ROUND = Ask()  # a whole round, the unpaired one


class Engine(Protocol):
    """One engine process, seen from the scheduler."""

    def ready(self) -> bool: ...  # started, waiting for its first round

    def alive(self) -> bool: ...

    def round(self, timeout: float, ask: Ask = ROUND) -> Optional[List[Cell]]: ...  # time one round: the
    # cells still short of their passes ([]: finished, every cell timed and traced), None failed (died, or no
    # answer within `timeout`)

    def join(self, timeout: float) -> None: ...

    def kill(self) -> None: ...


def run(groups: Sequence[G], width: int, start: Callable[[G], Engine], finish: Callable[[G, Engine], None],
        timeout_s: float, poll_s: float = 0.5, exit_s: float = EXIT_S, reference: Optional[Callable[[G], bool]] = None,
        cells: Callable[[G], Sequence[Cell]] = lambda g: ()) -> None:
    """Start `groups` `width` at a time; time the ready ones in rounds, in order within a round; `finish` each once
    it is finished and gone (ended within `exit_s`, or killed) or failed (dead before ready, past `timeout_s` to
    start, or to time a round). Where `reference` names a group of the wave, its rounds are paired, over the
    `cells` of each group in their order."""
    time_ = functools.partial(_time, reference=reference, cells=cells)
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
        time_(started, timeout_s, exit_s, finish)
        for g in retry:
            e = start(g)
            _await([e], timeout_s, poll_s)
            time_([(g, e)], timeout_s, exit_s, finish)


def _await(engines: Sequence[Engine], timeout_s: float, poll_s: float) -> None:
    """Until every engine is ready or dead, or `timeout_s` have passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(e.alive() and not e.ready() for e in engines):
        time.sleep(poll_s)


def _time(engines: List[Tuple[G, Engine]], timeout_s: float, exit_s: float,
          finish: Callable[[G, Engine], None], reference: Optional[Callable[[G], bool]] = None,
          cells: Callable[[G], Sequence[Cell]] = lambda g: ()) -> None:
    """Kill and finish the engines that never got ready; time the rest in rounds (paired where `reference` names
    one of them and there are others)."""
    for g, e in engines:
        if not e.ready():
            e.kill()
            finish(g, e)
    ready = [(g, e) for g, e in engines if e.ready()]
    ref = next((x for x in ready if reference is not None and reference(x[0])), None)
    others = [x for x in ready if x is not ref]
    if ref is None or not others:
        return _rounds(ready, timeout_s, exit_s, finish)
    _paired(ref, [(g, e, [(s, tuple(b)) for s, b in cells(g)]) for g, e in others], timeout_s, exit_s, finish)


def _paired(ref: Tuple[G, Engine], engines: List[Tuple[G, Engine, List[Cell]]], timeout_s: float,
            exit_s: float, finish: Callable[[G, Engine], None]) -> None:
    """Batch by batch (in the order the engines' cells first name them), each engine in turn times each of its
    cells still wanted at that batch, one pass each, and the reference a pass before the first and after each;
    once every other engine is finished, the reference closes (should it fail on the way, the others go on
    unpaired). An engine that wants no cell it was given is timed in plain rounds."""
    batches = list(dict.fromkeys(b for _, _, mine in engines for _, b in mine))
    wanted = {id(e): set(mine) for _, e, mine in engines}
    active, paired = list(engines), True
    while active:
        if not any(wanted[id(e)] & set(mine) for _, e, mine in active):
            _rounds([(g, e) for g, e, _ in active], timeout_s, exit_s, finish)
            break
        for batch in batches:
            first = True
            for g, e, mine in list(active):
                for scen, _ in [c for c in mine if c[1] == batch and c in wanted[id(e)]]:
                    if paired and first:
                        paired, first = _keep(ref, batch, timeout_s, exit_s, finish), False
                    left = e.round(timeout_s, Ask(batch, scen))
                    if not left:  # finished, or failed: its process ends before the reference's pass, not in it
                        active.remove((g, e, mine))
                        _end(g, e, exit_s, finish)
                    else:
                        wanted[id(e)] = {(s, tuple(b)) for s, b in left}
                    if paired:
                        paired = _keep(ref, batch, timeout_s, exit_s, finish)
                    if not left:
                        break
    if paired:
        ref[1].round(timeout_s, Ask(close=True))
        _end(*ref, exit_s, finish)


def _keep(ref: Tuple[G, Engine], batch: Batch, timeout_s: float, exit_s: float,
          finish: Callable[[G, Engine], None]) -> bool:
    """One reference pass at `batch`; False (the reference finished as failed) if it did not answer."""
    if ref[1].round(timeout_s, Ask(batch, keep=True)) is None:
        _end(*ref, exit_s, finish)
        return False
    return True


def _end(g: G, e: Engine, exit_s: float, finish: Callable[[G, Engine], None]) -> None:
    """A finished (or failed) engine gets `exit_s` to end, is made sure of, and is finished."""
    e.join(exit_s)
    e.kill()
    finish(g, e)


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
            _end(g, e, exit_s, finish)


_LIVE: "weakref.WeakSet[Process]" = weakref.WeakSet()


class Process:
    """An `Engine` in a child process of its own process group: `target(*args, ready, turns)`, with `ready` an
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

    def round(self, timeout: float, ask: Ask = ROUND) -> Optional[List[Cell]]:
        try:
            self._conn.send(ask)
            deadline = time.monotonic() + timeout
            while not self._conn.poll(0.5):
                if not self.process.is_alive() or time.monotonic() > deadline:
                    return None
            return [(s, tuple(b)) for s, b in self._conn.recv()]
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
    """The engine's side of the rounds: wait for the scheduler's next round, then say which cells are still short
    of their passes."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self) -> Optional[Ask]:
        """Block until the next round is asked for; None if the scheduler is gone."""
        try:
            ask = self.conn.recv()
        except (EOFError, OSError):
            return None
        return ask if isinstance(ask, Ask) else None

    def answer(self, wanted: Sequence[Cell]) -> None:
        """The cells still short of their passes (none: finished), as plain lists."""
        try:
            self.conn.send([[s, list(b)] for s, b in wanted])
        except (BrokenPipeError, OSError):  # the scheduler is gone: nothing to tell
            pass


def kill_all() -> None:
    """Kill every engine process still running (the bench was stopped): they lead groups of their own, so a
    terminal's Ctrl-C does not reach them, and each holds GPU memory."""
    for p in list(_LIVE):
        p.kill()
