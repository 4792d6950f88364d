"""The bench's scheduler: engines start a wave at a time and are timed alone (fake engines, no processes)."""

import pytest

from steer.bench import waves


class Fake:
    """An engine that is ready after `polls` looks (never, if None), or dies while starting when `dies`."""

    def __init__(self, name, log, polls=1, dies=False):
        self.name, self.log, self.polls, self.dies = name, log, polls, dies
        self.exitcode, self.killed, self.looks = None, False, 0
        log.append(("start", name))

    def ready(self):
        if self.polls is None or self.dies:
            return False
        self.looks += 1
        return self.looks > self.polls

    def alive(self):
        return not self.dies and not self.killed

    def go(self):
        self.log.append(("go", self.name))

    def join(self, timeout):
        self.log.append(("timed", self.name))

    def kill(self):
        self.killed = True


def schedule(groups, width, make, timeout_s=5.0):
    log = []
    tries = {}

    def start(g):
        tries[g] = tries.get(g, 0) + 1
        return Fake(g, log, **make(g, tries[g]))

    done = []
    waves.run(groups, width, start, lambda g, e: done.append((g, e.ready())), timeout_s, poll_s=0.001)
    return log, done


def test_a_wave_starts_together_and_is_timed_one_at_a_time():
    log, done = schedule(list("abcde"), 2, lambda g, n: {"polls": 3})
    assert log == [("start", "a"), ("start", "b"), ("go", "a"), ("timed", "a"), ("go", "b"), ("timed", "b"),
                   ("start", "c"), ("start", "d"), ("go", "c"), ("timed", "c"), ("go", "d"), ("timed", "d"),
                   ("start", "e"), ("go", "e"), ("timed", "e")]
    assert [g for g, _ in done] == list("abcde")


def test_a_start_that_fails_beside_others_is_tried_again_alone():
    log, done = schedule(list("abc"), 3, lambda g, n: {"dies": g == "b" and n == 1})
    assert log == [("start", "a"), ("start", "b"), ("start", "c"), ("go", "a"), ("timed", "a"), ("go", "c"),
                   ("timed", "c"), ("start", "b"), ("go", "b"), ("timed", "b")]
    assert [g for g, _ in done] == ["a", "c", "b"]


@pytest.mark.parametrize("make", [lambda g, n: {"dies": True}, lambda g, n: {"polls": None}])
def test_a_start_that_fails_alone_is_finished_as_failed(make):
    log, done = schedule(["a"], 4, make, timeout_s=0.05)
    assert log == [("start", "a")] and done == [("a", False)]


def test_a_start_that_never_gets_ready_is_killed_and_retried_once():
    log, done = schedule(["a", "b"], 2, lambda g, n: {"polls": None if g == "a" else 0}, timeout_s=0.05)
    assert log == [("start", "a"), ("start", "b"), ("go", "b"), ("timed", "b"), ("start", "a")]
    assert done == [("b", True), ("a", False)]


def _child(path, ready, go):
    ready.set()
    go.wait(30)
    with open(path, "w") as f:
        f.write("timed")


def test_a_child_process_waits_for_go(tmp_path):
    import multiprocessing
    import time

    p = waves.Process(multiprocessing.get_context("spawn"), _child, (str(tmp_path / "out"),))
    deadline = time.monotonic() + 60
    while not p.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.ready() and p.alive() and not (tmp_path / "out").exists()
    p.go()
    p.join(30)
    assert (tmp_path / "out").read_text() == "timed" and p.exitcode == 0 and not p.alive()
