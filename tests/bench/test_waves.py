"""The bench's scheduler: a model's engines start a wave at a time and are timed in rounds, the references in
every round of every wave (fake engines; three tests with real child processes)."""

import os
import time

from steer.bench import waves


class Fake:
    """An engine that is ready after its first look unless it `dies` while starting; it wants `rounds` rounds, and
    answers nothing (fails) at round `fails_at`."""

    def __init__(self, name, log, dies=False, rounds=2, fails_at=None):
        self.name, self.log, self.dies, self.rounds, self.fails_at = name, log, dies, rounds, fails_at
        self.timed, self.killed, self.ended = 0, False, False
        log.append(("start", name))

    def ready(self):
        return not self.dies

    def alive(self):
        return not self.dies and not self.killed and not self.ended

    def round(self, timeout, ask):
        if ask.close:
            self.log.append(("close", self.name))
            return False
        if ask.round == self.fails_at:
            return None
        self.timed += 1
        self.log.append((ask.round, self.name, ask.keep))
        return self.timed < self.rounds

    def join(self, timeout):
        self.ended = True

    def kill(self):
        self.killed = True


def schedule(groups, width, **how):
    """`groups` (names; a and b are references) under the scheduler; the log of starts, passes and closes, and
    the order engines were finished in."""
    log, done, engines = [], [], {}

    def start(g):
        engines[g] = Fake(g, log, **how.get(g, {}))
        return engines[g]

    waves.run(groups, width, start, lambda g, e: done.append(g), timeout_s=5.0, poll_s=0.001,
              reference=lambda g: g in ("a", "b"))
    return log, done, engines


def test_the_references_start_first_and_time_every_round_of_every_wave():
    log, done, _ = schedule(["a", "b", "c", "f", "h"], 4)
    # a, b and two others in the first wave; h alone beside a and b in the second
    assert [x[1] for x in log if x[0] == "start"] == ["a", "b", "c", "f", "h"]
    assert log.index(("start", "h")) > log.index((2, "f", False))  # h starts once c and f are done
    rounds = [x for x in log if isinstance(x[0], int)]
    assert rounds == [(1, "a", True), (1, "b", True), (1, "c", False), (1, "f", False),
                      (2, "a", True), (2, "b", True), (2, "c", False), (2, "f", False),
                      (3, "a", True), (3, "b", True), (3, "h", False),
                      (4, "a", True), (4, "b", True), (4, "h", False)]
    assert log[-2:] == [("close", "a"), ("close", "b")]
    assert done == ["c", "f", "h", "a", "b"]


def test_without_others_the_references_take_rounds_until_they_have_their_passes():
    log, done, _ = schedule(["a", "b"], 2, a={"rounds": 3})
    assert [x for x in log if isinstance(x[0], int)][-2:] == [(3, "a", True), (3, "b", True)]
    assert done == ["a", "b"]


def test_a_reference_that_fails_is_finished_and_the_others_go_on():
    log, done, engines = schedule(["a", "b", "c", "f"], 3, b={"fails_at": 2})
    assert done[0] == "b" and engines["b"].killed
    assert [x[1] for x in log if isinstance(x[0], int) and x[0] >= 2] == ["a", "c", "a", "f", "a", "f"]


def test_an_engine_that_never_gets_ready_is_killed_and_finished_and_the_rest_are_timed():
    log, done, engines = schedule(["a", "c", "f"], 3, c={"dies": True})
    assert done[0] == "c" and engines["c"].killed and not any(x[1] == "c" for x in log if isinstance(x[0], int))
    assert [x[1] for x in log if x[0] == 1] == ["a", "f"] and done[1:] == ["f", "a"]


def _child(path, ready, turns):
    """Two rounds, each appending to `path` only when asked for."""
    ready.set()
    for i in range(2):
        assert turns.wait() == waves.Ask(i + 1)
        with open(path, "a") as f:
            f.write(f"round {i};")
        turns.answer(i == 0)


def _wait(cond, seconds=60):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_child_process_times_a_round_only_when_asked(tmp_path):
    import multiprocessing

    p = waves.Process(multiprocessing.get_context("spawn"), _child, (str(tmp_path / "out"),))
    _wait(p.ready)
    assert p.ready() and p.alive() and not (tmp_path / "out").exists()
    assert p.round(30, waves.Ask(1)) is True and (tmp_path / "out").read_text() == "round 0;"
    assert p.round(30, waves.Ask(2)) is False and (tmp_path / "out").read_text() == "round 0;round 1;"
    p.join(30)
    assert p.exitcode == 0 and not p.alive() and not p.killed
    assert p.round(1, waves.Ask(3)) is None  # nobody there to answer


def _hangs_on_its_way_out(path, ready, turns):
    """Starts a grandchild (as vLLM starts its engine core), says it is finished, and never ends."""
    import subprocess
    import sys

    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(path, "w") as f:
        f.write(str(grandchild.pid))
    ready.set()
    turns.wait()
    turns.answer(False)
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
    engines, finished = [], []

    def start(g):
        engines.append(waves.Process(ctx, _hangs_on_its_way_out, (str(tmp_path / "pid"),)))
        return engines[-1]

    waves.run(["c"], 1, start, lambda g, e: finished.append(g), timeout_s=60, poll_s=0.05, exit_s=0.5)
    grandchild = int((tmp_path / "pid").read_text())
    _wait(lambda: not _running(grandchild), 10)
    assert finished == ["c"] and engines[0].killed and not engines[0].alive()
    assert not _running(grandchild)


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
    _wait(lambda: not p.alive())
    grandchild = int((tmp_path / "pid").read_text())
    assert not p.alive() and _running(grandchild)
    p.kill()
    _wait(lambda: not _running(grandchild), 10)
    assert not _running(grandchild) and p.exitcode == 3 and not p.killed  # it had ended: not killed running
