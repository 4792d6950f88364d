"""The profiling clock: totals and counts per section, and each call's duration binned so that quantiles say
whether every call is slow or a few are."""

import math

import pytest

from interleaver import clock
from interleaver.clock import Clock


def test_a_section_keeps_its_total_its_count_and_where_its_calls_fell():
    c = Clock()
    for _ in range(90):
        c.add("fill_step", 5e-6)
    for _ in range(10):
        c.add("fill_step", 800e-6)
    c.add("replay", 20e-6)
    taken = c.take()
    assert sorted(taken) == ["fill_step", "replay"]
    f = taken["fill_step"]
    assert f["calls"] == 100 and f["seconds"] == pytest.approx(90 * 5e-6 + 10 * 800e-6)
    assert sum(f["hist"].values()) == 100
    # the median is the common call, to the bin's width (an eighth of an octave); the 95th the slow one
    assert clock.quantile(f["hist"], 0.5) == pytest.approx(5, rel=2 ** (1 / 8) - 1)
    assert clock.quantile(f["hist"], 0.95) == pytest.approx(800, rel=2 ** (1 / 8) - 1)
    assert clock.quantile(taken["replay"]["hist"], 0.5) == pytest.approx(20, rel=2 ** (1 / 8) - 1)
    assert c.take() == {}  # each take starts the sections anew


def test_a_call_lands_in_its_eighth_of_an_octave_and_a_quantile_reads_that_bins_middle():
    assert clock.bins([5e-6]) == {"18": 1}  # 8 * log2(5) = 18.6
    assert clock.quantile({"18": 1}, 0.5) == 2 ** (18.5 / 8)
    assert clock.bins([0.0, 1e-9, -1e-6, 0.25e-6]) == {"-16": 4}  # at or under a quarter of a us: the lowest bin
    assert clock.quantile({"3": 7, "9": 93}, 0.07) == 2 ** (3.5 / 8)  # 0.07 * 100 is 7.000000000000001


def test_quantiles_read_the_bins_in_order_of_duration_not_of_their_names():
    hist = clock.bins([2e-6] * 3 + [100e-6] * 7)  # bins 8 and 53: "53" sorts before "8" as text
    assert clock.quantile(hist, 0.3) == pytest.approx(2, rel=0.1)
    assert clock.quantile(hist, 0.31) == pytest.approx(100, rel=0.1)
    assert math.isnan(clock.quantile({}, 0.5))


def test_calls_binned_early_add_up_to_the_same_take(monkeypatch):
    durations = [(i % 17 + 1) * 1e-6 for i in range(50)] + [0.0, 1e-9]  # and some under the lowest bin
    whole = Clock()
    for d in durations:
        whole.add("s", d)
    monkeypatch.setattr(clock, "_FOLD", 7)  # a long profile bins its calls every _FOLD of them
    folded = Clock()
    for d in durations:
        folded.add("s", d)
    a, b = whole.take()["s"], folded.take()["s"]
    assert a["calls"] == b["calls"] == 52 and a["hist"] == b["hist"]
    assert a["seconds"] == pytest.approx(b["seconds"])


def test_histograms_from_several_takes_merge_by_bin():
    a, b = clock.bins([1e-6, 1e-6, 3e-5]), clock.bins([1e-6, 4e-3])
    merged = clock.merge(dict(a), b)
    assert merged == clock.bins([1e-6, 1e-6, 3e-5, 1e-6, 4e-3])
