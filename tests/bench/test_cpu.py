"""The host's CPUs through a timed pass (steer/bench/cpu.py), and the report's account of them."""

import time

import pytest

from bench_common import bench_conf, first_cell, stand_in_runner
from steer.bench import cpu, report

STAT = """cpu  1000 20 300 5000 40 5 6 70 0 0
cpu0 500 10 150 2500 20 2 3 35 0 0
cpu1 500 10 150 2500 20 3 3 35 0 0
intr 123 4 5
ctxt 98765
"""


def test_the_all_cpu_line_and_the_cpu_count_are_read():
    assert cpu.parse(STAT) == ([1000, 20, 300, 5000, 40, 5, 6, 70], 2)
    assert cpu.parse("cpu  1 2 3 4 5 6 7\ncpu0 1 2 3 4 5 6 7\n") == ([1, 2, 3, 4, 5, 6, 7, 0], 1)  # no steal field
    assert cpu.parse("intr 1 2\n") is None


def test_busy_cpus_and_steal_between_two_readings():
    start = ([1000, 0, 100, 5000, 0, 0, 0, 0], 4)
    # 300 user, 100 system, 500 idle, 100 stolen: 1000 ticks of all four CPUs' time
    end = ([1300, 0, 200, 5500, 0, 0, 0, 100], 4)
    assert cpu.between(start, end) == {"cpu_busy": pytest.approx(1.6), "cpu_steal": pytest.approx(10.0)}
    assert cpu.between(None, end) == {} and cpu.between(start, start) == {}


def test_a_window_reads_this_machines_cpus(tmp_path):
    if cpu.read() is None:
        pytest.skip("no /proc/stat on this machine (not Linux)")
    with cpu.Window() as w:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:  # one CPU busy for a third of a second
            pass
    got = w.summary()
    assert set(got) == {"cpu_busy", "cpu_steal"} and got["cpu_busy"] > 0.2 and 0.0 <= got["cpu_steal"] <= 100.0
    with cpu.Window(tmp_path / "absent") as w:
        pass
    assert w.summary() == {}


def _rec(walls, busy, **kw):
    return {"walls_s": walls, "cpu_busy_passes": busy, **kw}


def test_pass_times_follow_a_reading_within_each_cell():
    # Two cells of different speed and load; within each the slow passes are the busy ones
    slow = [_rec([1.0, 2.0, 1.5], [1.0, 3.0, 2.0]), _rec([10.0, 20.0, 15.0], [5.0, 7.0, 6.0])]
    r, passes, cells = cpu.follows(slow, "cpu_busy")
    assert r == pytest.approx(1.0) and (passes, cells) == (6, 2)
    against = [_rec([1.0, 2.0, 1.5], [3.0, 1.0, 2.0])]
    assert cpu.follows(against, "cpu_busy")[0] == pytest.approx(-1.0)
    assert cpu.follows([_rec([1.0, 2.0, 1.5], [2.0, 2.0, 2.0])], "cpu_busy") is None  # the reading never varies
    # ... nor here, though the cells differ and a mean of 0.1s rounds off 0.1
    assert cpu.follows([_rec([1.0, 2.0, 1.5], [0.1] * 3), _rec([1.0, 1.4, 1.2], [0.2] * 3)], "cpu_busy") is None
    assert cpu.follows([_rec([1.0, 2.0], [1.0])], "cpu_busy") is None  # a pass without its reading
    assert cpu.follows([_rec([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])], "cpu_steal") is None
    # a pass the reading missed (None: no probe reading fell within it) is left out, the rest stand
    assert cpu.follows([_rec([1.0, 2.0, 1.5, 9.0], [1.0, 3.0, 2.0, None])], "cpu_busy") == (pytest.approx(1.0), 3, 1)
    assert cpu.follows([_rec([1.0, 2.0], [None, 3.0])], "cpu_busy") is None


def test_a_cell_records_its_passes_host_readings(engine_c, monkeypatch, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=3", "min_timed_s=0")
    engine_c(lambda cfg, m, where, group: stand_in_runner())
    readings = iter([{"cpu_busy": 2.0, "cpu_steal": 0.0}, {"cpu_busy": 4.0, "cpu_steal": 5.0},
                     {"cpu_busy": 3.0, "cpu_steal": 1.0}])
    monkeypatch.setattr(cpu.Window, "summary", lambda self: next(readings))
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    assert rec["cpu_busy_passes"] == [2.0, 4.0, 3.0] and rec["cpu_steal_passes"] == [0.0, 5.0, 1.0]
    assert (rec["cpu_busy"], rec["cpu_steal"]) == (3.0, 1.0)  # the medians of the passes'


def test_the_report_puts_the_host_beside_the_cells_and_says_how_passes_followed_it():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,c]", "scenarios=[add]")
    recs = [{"model": "tiny", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": 1000.0, "wall_s": 1.0, "walls_s": [1.0, 1.2, 0.9], "cpu_busy": busy,
             "cpu_busy_passes": [busy, busy + 1, busy - 0.5], "cpu_steal": 0.5, "cpu_steal_passes": [0.5, 0.5, 0.5]}
            for c, s, busy in (("b", "unsteered", 2.0), ("c", "add", 3.0))]
    md = report.markdown(report.cells(recs, cfg), [], cfg, {}, "now", "cmd", recs)
    assert "| CPUs / % stolen | b | c |" in md and "| add | 2.0 / 0.5 | 3.0 / 0.5 |" in md
    assert "- tiny: each pass's time over its cell's median, against the host through it: busy CPUs r = +1.00 " \
           "(6 passes of 2 cells)" in md
    assert "steal r =" not in md  # steal never varied
    assert "CPUs / % stolen" not in report.markdown(report.cells([], cfg), [], cfg, {}, "now", "cmd")
