"""The bench's scheduler: engines start a wave at a time and are timed in rounds, one at a time (fake engines; two
tests with real child processes)."""

import os
import time

import pytest

from steer.bench import waves


class Fake:
    """An engine that is ready after `polls` looks (never, if None), or dies while starting when `dies`; it wants
    `rounds` rounds, and on its way out ends unless it `lingers`."""

    def __init__(self, name, log, polls=1, dies=False, lingers=False, rounds=1, fails_after=None):
        self.name, self.log, self.polls, self.dies, self.lingers = name, log, polls, dies, lingers
        self.rounds, self.timed, self.passes, self.fails_after = rounds, 0, {}, fails_after
        self.exitcode, self.killed, self.looks, self.ended = None, False, 0, False
        log.append(("start", name))

    def ready(self):
        if self.polls is None or self.dies:
            return False
        self.looks += 1
        return self.looks > self.polls

    def alive(self):
        return not self.dies and not self.killed and not self.ended

    def round(self, timeout, ask=waves.ROUND):
        """A plain round; in a paired run a pass at `ask.batch` (the reference's with `keep`), or the close."""
        if ask == waves.ROUND:
            self.timed += 1
            self.log.append(("round", self.name))
            return [(1, 1)] if self.timed < self.rounds else []
        self.log.append(("close", self.name) if ask.close else ("pass", self.name, ask.batch, ask.scenario))
        if ask.close or (self.fails_after is not None and len(self.log) > self.fails_after):
            return [] if ask.close else None
        if not ask.keep:
            self.passes[ask.scenario, ask.batch] = self.passes.get((ask.scenario, ask.batch), 0) + 1
        return [c for c in CELLS.get(self.name, []) if ask.keep or self.passes.get(c, 0) < self.rounds]

    def join(self, timeout):
        self.ended = not self.lingers

    def kill(self):
        if self.alive():
            self.log.append(("killed", self.name))
        self.killed = True


BATCHES = [(64, 128), (256, 256)]
SMALL, LARGE = BATCHES
# each engine's cells (scenario, batch), in order: b is the pairing reference, c has two scenarios, f one
CELLS = {"b": [("unsteered", SMALL), ("unsteered", LARGE)],
         "c": [("add", SMALL), ("k1", SMALL), ("add", LARGE), ("k1", LARGE)],
         "f": [("add", SMALL), ("add", LARGE)]}


def schedule(groups, width, make, timeout_s=5.0, reference=None):
    log = []
    tries = {}

    def start(g):
        tries[g] = tries.get(g, 0) + 1
        return Fake(g, log, **make(g, tries[g]))

    done = []
    waves.run(groups, width, start, lambda g, e: done.append((g, e.ready())), timeout_s, poll_s=0.001,
              reference=reference, cells=lambda g: CELLS.get(g, []))
    return log, done


def test_a_wave_starts_together_and_is_timed_one_at_a_time():
    log, done = schedule(list("abcde"), 2, lambda g, n: {"polls": 3})
    assert log == [("start", "a"), ("start", "b"), ("round", "a"), ("round", "b"),
                   ("start", "c"), ("start", "d"), ("round", "c"), ("round", "d"),
                   ("start", "e"), ("round", "e")]
    assert [g for g, _ in done] == list("abcde")


def test_a_waves_engines_take_turns_round_by_round_until_each_has_its_passes():
    log, done = schedule(list("abc"), 3, lambda g, n: {"rounds": {"a": 3, "b": 1, "c": 2}[g]})
    rounds = [name for what, name in log if what == "round"]
    assert rounds == ["a", "b", "c", "a", "c", "a"]
    assert [g for g, _ in done] == ["b", "c", "a"]  # each finished as soon as it has all its rounds


def test_a_start_that_fails_beside_others_is_tried_again_alone():
    log, done = schedule(list("abc"), 3, lambda g, n: {"dies": g == "b" and n == 1})
    assert log == [("start", "a"), ("start", "b"), ("start", "c"), ("round", "a"), ("round", "c"),
                   ("start", "b"), ("round", "b")]
    assert [g for g, _ in done] == ["a", "c", "b"]


@pytest.mark.parametrize("make, log_", [(lambda g, n: {"dies": True}, [("start", "a")]),
                                       (lambda g, n: {"polls": None}, [("start", "a"), ("killed", "a")])])
def test_a_start_that_fails_alone_is_finished_as_failed(make, log_):
    log, done = schedule(["a"], 4, make, timeout_s=0.05)
    assert log == log_ and done == [("a", False)]


def test_a_start_that_never_gets_ready_is_killed_and_retried_once():
    log, done = schedule(["a", "b"], 2, lambda g, n: {"polls": None if g == "a" else 0}, timeout_s=0.05)
    assert log == [("start", "a"), ("start", "b"), ("killed", "a"), ("round", "b"), ("start", "a"),
                   ("killed", "a")]
    assert done == [("b", True), ("a", False)]


def test_an_engine_that_is_finished_but_never_ends_is_killed_and_the_next_goes():
    log, done = schedule(list("ab"), 2, lambda g, n: {"lingers": g == "a"})
    assert log == [("start", "a"), ("start", "b"), ("round", "a"), ("killed", "a"), ("round", "b")]
    assert [g for g, _ in done] == ["a", "b"]


def test_paired_the_reference_times_a_pass_before_and_after_every_other_engines_cell_batch_by_batch():
    log, done = schedule(list("bcf"), 3, lambda g, n: {"rounds": {"b": 0, "c": 2, "f": 1}[g]},
                         reference=lambda g: g == "b")

    def around(batch, *passes):  # b, then each engine's pass followed by b's
        return [("pass", "b", batch, None)] + [x for p in passes for x in (("pass", *p), ("pass", "b", batch, None))]

    one = around(SMALL, ("c", SMALL, "add"), ("c", SMALL, "k1"), ("f", SMALL, "add")) + \
        around(LARGE, ("c", LARGE, "add"), ("c", LARGE, "k1"), ("f", LARGE, "add"))  # f has its one pass at each
    two = around(SMALL, ("c", SMALL, "add"), ("c", SMALL, "k1")) + around(LARGE, ("c", LARGE, "add"),
                                                                          ("c", LARGE, "k1"))
    assert [e for e in log if e[0] != "start"] == one + two + [("close", "b")]
    assert [g for g, _ in done] == ["f", "c", "b"]  # the reference closes once every other is finished


def test_paired_without_its_reference_in_the_wave_the_rounds_are_plain():
    log, done = schedule(list("bcf"), 2, lambda g, n: {"rounds": 1}, reference=lambda g: g == "b")
    assert [e for e in log if e[0] != "start"][-1] == ("round", "f")  # f's wave has no b: a plain round
    assert ("pass", "c", SMALL, "add") in log  # b's wave (b, c) is paired


def test_paired_a_reference_that_fails_leaves_the_others_timed_unpaired():
    log, done = schedule(list("bf"), 2, lambda g, n: {"rounds": 2, "fails_after": 4 if g == "b" else None},
                         reference=lambda g: g == "b")
    timed = [e for e in log if e[0] != "start"]
    # b answers nothing from its second pass on (the fifth entry of the log): finished as failed, f goes on alone
    assert timed == [("pass", "b", SMALL, None), ("pass", "f", SMALL, "add"), ("pass", "b", SMALL, None),
                     ("pass", "f", LARGE, "add"), ("pass", "f", SMALL, "add"), ("pass", "f", LARGE, "add")]
    assert [g for g, _ in done] == ["b", "f"]


def test_paired_an_engine_wanting_no_cell_it_was_given_gets_plain_rounds():
    class Odd(Fake):
        def round(self, timeout, ask=waves.ROUND):  # wants a cell nobody named, until a plain round
            self.log.append(("asked", self.name, ask))
            return [("add", (9, 9))] if ask != waves.ROUND else []

    log, finished = [], []
    waves._paired(("b", Fake("b", log)), [("c", Odd("c", log), [("add", SMALL)])], 1.0, 0.0,
                  lambda g, e: finished.append(g))
    assert [e[2] for e in log if e[0] == "asked"] == [waves.Ask(SMALL, "add"), waves.ROUND]
    assert finished == ["c", "b"] and log[-1] == ("close", "b")


def _child(path, ready, turns):
    """Two rounds, each appending to `path` only when asked for."""
    ready.set()
    for i in range(2):
        assert turns.wait() == waves.ROUND
        with open(path, "a") as f:
            f.write(f"round {i};")
        turns.answer([("add", (64, 128))] if i == 0 else [])


def test_a_child_process_times_a_round_only_when_asked(tmp_path):
    import multiprocessing

    p = waves.Process(multiprocessing.get_context("spawn"), _child, (str(tmp_path / "out"),))
    deadline = time.monotonic() + 60
    while not p.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.ready() and p.alive() and not (tmp_path / "out").exists()
    assert p.round(30) == [("add", (64, 128))] and (tmp_path / "out").read_text() == "round 0;"
    assert p.round(30) == [] and (tmp_path / "out").read_text() == "round 0;round 1;"
    p.join(30)
    assert p.exitcode == 0 and not p.alive() and not p.killed
    assert p.round(1) is None  # nobody there to answer


def _hangs_on_its_way_out(path, ready, turns):
    """Starts a grandchild (as vLLM starts its engine core), says it is finished, and never ends."""
    import subprocess
    import sys

    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(path, "w") as f:
        f.write(str(grandchild.pid))
    ready.set()
    turns.wait()
    turns.answer([])
    time.sleep(600)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


def test_a_finished_process_that_hangs_is_killed_with_what_it_started(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    engines = []

    def start(g):
        engines.append(waves.Process(ctx, _hangs_on_its_way_out, (str(tmp_path / "pid"),)))
        return engines[-1]

    finished = []
    t0 = time.monotonic()
    waves.run(["a"], 1, start, lambda g, e: finished.append(g), timeout_s=60, poll_s=0.05, exit_s=0.5)
    grandchild = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert finished == ["a"] and engines[0].killed and not engines[0].alive()
    assert not _running(grandchild)
    assert time.monotonic() - t0 < 60  # the child's own sleep is 600 s


def _dies_leaving_its_grandchild(path, ready, turns):
    """Starts a grandchild (its engine core) and dies without ending it."""
    import subprocess
    import sys

    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(path, "w") as f:
        f.write(str(grandchild.pid))
    ready.set()
    os._exit(3)


def test_a_process_that_died_is_killed_with_what_it_started(tmp_path):
    import multiprocessing

    p = waves.Process(multiprocessing.get_context("spawn"), _dies_leaving_its_grandchild, (str(tmp_path / "pid"),))
    deadline = time.monotonic() + 60
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int((tmp_path / "pid").read_text())
    assert not p.alive() and _running(grandchild)
    p.kill()
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(grandchild) and p.exitcode == 3 and not p.killed  # it had ended: not killed running
