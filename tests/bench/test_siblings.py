"""CPUs that slow one another (steer/bench/siblings.py): the pairing on a stand-in reading, one real pair timed
end to end, and bad input said before anything runs."""

import json
import os

import pytest

from steer.bench import placement, siblings


def test_a_pair_is_shared_where_one_cpu_s_loop_slows_every_reading_of_the_other(monkeypatch):
    monkeypatch.setattr(siblings, "SPIN_UP_S", 0.0)
    busy, calls = {}, []

    # CPUs 0 and 2 are one core: a loop on either doubles the other's time. The host's slow spells: CPU 1 slow in its
    # first round (its first reading alone among them, as on the H200), CPU 3 in every reading beside 1 but the first
    def read(cpu, seconds):
        calls.append(cpu)
        spinning = [c for c, on in busy.items() if on]
        if cpu == 1 and len(calls) <= 16 or cpu == 3 and spinning == [1] and len(calls) > 16:
            return 1700.0
        return 1000.0 * (2.0 if {cpu, *spinning} == {0, 2} and spinning else 1.0)

    class Loop:  # stands in for the busy loop's process; remembers which CPU it keeps busy
        def __init__(self, cmd, **kw):
            self.cpu = int(cmd[-1])
            busy[self.cpu] = True

        def kill(self):
            busy[self.cpu] = False

        def wait(self):
            return 0

    monkeypatch.setattr(siblings.subprocess, "Popen", Loop)
    monkeypatch.setattr(siblings, "measure", lambda *a: pytest.fail("the stand-in reads"))
    floor, pairs = siblings.slowdowns([0, 1, 2, 3], 0.1, read, rounds=3)
    assert len(calls) == 3 * (4 + 4 * 3)
    assert floor == {0: 1000.0, 1: 1000.0, 2: 1000.0, 3: 1000.0}
    assert pairs[(0, 2)] == 2.0 and all(r == 1.0 for p, r in pairs.items() if p != (0, 2)) and len(pairs) == 6
    assert siblings.shared(pairs) == [(0, 2)]
    assert siblings.one_each([0, 1, 2, 3], [(0, 2)]) == [0, 1, 3]
    _, one_round = siblings.slowdowns([0, 1, 2, 3], 0.1, read, rounds=1)  # CPU 3 was slow in every reading beside 1
    assert one_round[(1, 3)] == 1.0  # ... but 1 was never slow beside 3: one way only is not a shared core


def test_measure_times_the_cpu_and_gives_this_thread_its_cpus_back():
    have = placement.available() or []
    if not have:
        pytest.skip("this platform cannot say which CPUs it may use")
    before = os.sched_getaffinity(0)
    assert siblings.measure(have[-1], 0.02) > 0
    assert os.sched_getaffinity(0) == before


def test_one_each_keeps_the_lowest_of_each_group():
    assert siblings.one_each([5, 4, 6, 7], [(4, 5), (6, 7)]) == [4, 6]
    assert siblings.one_each([1, 2, 3], []) == [1, 2, 3]


def test_two_real_cpus_are_timed_alone_and_together(tmp_path):
    have = placement.available() or []
    if len(have) < 2:
        pytest.skip("one CPU: nothing to pair")
    out = tmp_path / "siblings.json"
    siblings.main(["--cpus", f"{have[0]},{have[1]}", "--seconds", "0.02", "--rounds", "2", "--out", str(out)])
    got = json.loads(out.read_text())
    assert set(got["floor_us"]) == {str(have[0]), str(have[1])} and all(v > 0 for v in got["floor_us"].values())
    [pair] = got["pairs"]
    assert pair["cpus"] == [have[0], have[1]] and pair["slower"] > 0
    assert set(got["one_each"]) <= set(have[:2]) and got["one_each"][0] == have[0]


@pytest.mark.parametrize("args,match", [(["--seconds", "0"], "--seconds: expected seconds > 0"),
                                        (["--seconds", "nan"], "--seconds: expected seconds > 0"),
                                        (["--rounds", "0"], "--rounds: expected 1 or more"),
                                        (["--cpus", "3-1"], "--cpus: "), (["--cpus", "100000,100001"], "--cpus: "),
                                        (["--out", "/nonexistent/dir/s.json"], "--out: ")])
def test_bad_input_is_refused_naming_the_flag(args, match, monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: [0, 1])
    monkeypatch.setattr(siblings, "slowdowns", lambda *a: pytest.fail("nothing may run on bad input"))
    with pytest.raises(SystemExit, match=match):
        siblings.main(args + ([] if "--cpus" in args else ["--cpus", "0,1"]))


def test_one_cpu_cannot_be_paired(monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: [0, 1])
    with pytest.raises(SystemExit, match="--cpus: expected at least 2 CPUs to pair"):
        siblings.main(["--cpus", "1"])
