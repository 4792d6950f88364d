"""Whose slow spells (steer/bench/spells.py): each pass against the next, by the same engine process or another."""

import math
import os
import random
import time

import pytest

from bench_common import bench_conf, first_cell, stand_in_runner
from steer.bench import report, spells


def _cells(order, slow):
    """Records of one cell per engine: the engines run passes in `order` (their pids, one second apart), and
    pass i takes 2 s where slow(i, pid), else 1 s."""
    cells = {}
    for i, pid in enumerate(order):
        rec = cells.setdefault(pid, {"pid": pid, "walls_s": [], "started_s": []})
        rec["walls_s"].append(2.0 if slow(i, pid) else 1.0)
        rec["started_s"].append(float(i))
    return list(cells.values())


def test_a_hosts_spells_show_in_the_next_pass_whichever_engine_runs_it():
    # Two engines take turns pass by pass; the host runs slow for 4 passes in every 8
    found = spells.adjacent(_cells([1, 2] * 24, lambda i, pid: i % 8 < 4))
    assert found["same"] is None  # no engine ran two passes in a row
    r, pairs = found["other"]
    assert r > 0.4 and pairs == 47


def test_an_engines_own_spells_show_only_in_its_own_next_pass():
    # Each engine runs 4 passes a turn; 1 is slow in its even turns, 2 in every fourth pair of turns: the passes
    # that meet at a change of engine do not follow each other
    turns = [pid for turn in range(24) for pid in [1 + turn % 2] * 4]

    def slow(i, pid):
        return (i // 8) % 2 == 0 if pid == 1 else (i // 8) % 4 < 2

    found = spells.adjacent(_cells(turns, slow))
    assert found["same"][0] > 0.9 and found["same"][1] == 72
    assert abs(found["other"][0]) < 0.3 and found["other"][1] == 23


def test_passes_with_a_wave_of_engine_starts_between_them_are_no_pair():
    cells = _cells([1, 2] * 24, lambda i, pid: i % 8 < 4)
    for c in cells:  # the second half of the passes start a minute later
        c["started_s"] = [s + (60.0 if s >= 24 else 0.0) for s in c["started_s"]]
    assert spells.adjacent(cells)["other"][1] == 46


def test_runs_without_starts_or_pids_and_too_few_pairs_say_nothing():
    cells = _cells([1, 2] * 6, lambda i, pid: i % 4 < 2)
    assert spells.adjacent([{k: v for k, v in c.items() if k != "started_s"} for c in cells]) == \
        {"same": None, "other": None}
    assert spells.adjacent([{k: v for k, v in c.items() if k != "pid"} for c in cells]) == \
        {"same": None, "other": None}
    assert spells.adjacent(_cells([1, 2, 1], lambda i, pid: i == 1))["other"] is None  # 2 pairs
    assert spells.adjacent(_cells([1, 2] * 4, lambda i, pid: False))["other"] is None  # no pass slower


def test_a_cell_records_when_each_pass_began_and_its_engine_process(engine_c, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=3", "min_timed_s=0")
    engine_c(lambda cfg, m, where, group: stand_in_runner())
    before = time.time()
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    starts = rec["started_s"]
    assert len(starts) == len(rec["walls_s"]) == 3 and rec["pid"] == os.getpid()
    assert before <= starts[0] <= starts[1] <= starts[2] <= time.time()
    assert starts[1] - starts[0] >= rec["walls_s"][0] - 1e-3  # a pass starts once the one before it has ended


def test_the_report_says_whose_spells_they_were():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,c]", "scenarios=[add]")
    recs = [{**c, "model": "tiny", "config": "bc"[c["pid"] - 1], "scenario": ("unsteered", "add")[c["pid"] - 1],
             "requests": 64, "tokens": 128, "status": "ok", "tok_s": 1000.0, "wall_s": 1.0}
            for c in _cells([1, 2] * 24, lambda i, pid: i % 8 < 4)]
    md = report.markdown(report.cells(recs, cfg), [], cfg, {}, "now", "cmd", recs)
    r = spells.adjacent(recs)["other"][0]
    assert f"- tiny: each pass's time against the next pass's, when that is another engine's r = {r:+.2f} " \
           "(47 pairs)" in md
    assert "its own engine's r =" not in md
    assert pytest.approx(r) == spells.adjacent(recs[::-1])["other"][0]  # the records' order does not matter


def test_pass_times_are_split_by_the_cpu_the_busiest_process_ran_on():
    # Two cells of different speed; on CPU 3 each pass takes twice what it takes on CPU 5: all of the spread
    recs = [{"walls_s": [1.0, 2.0, 1.0, 2.0], "cpu_busiest_passes": [5.0, 3.0, 5.0, 3.0]},
            {"walls_s": [4.0, 8.0, 4.0, 8.0], "cpu_busiest_passes": [5.0, 3.0, 5.0, 3.0]}]
    share, cpus = spells.by_cpu(recs)
    assert share == pytest.approx(1.0) and cpus[3][1] == cpus[5][1] == 4
    assert cpus[3][0] - cpus[5][0] == pytest.approx(math.log(2))
    assert spells.said(recs) == [
        "the CPU its busiest process ended a pass on accounts for 100% of the variance of pass times beyond chance "
        "(8 passes on 2 CPUs; slowest CPU 3 +41% over 4 passes, fastest CPU 5 -29% over 4)"]
    # the CPUs alike: none of it
    even = [{"walls_s": [1.0, 2.0, 1.0, 2.0] * 2, "cpu_busiest_passes": [5.0, 5.0, 3.0, 3.0] * 2}]
    assert spells.by_cpu(even)[0] == 0.0
    # a cell with a slow tail, all of it on one CPU, makes that CPU no slower: only within a cell does it count
    tail = [{"walls_s": [1.0, 1.0, 1.0, 1.0, 1.8, 2.0], "cpu_busiest_passes": [3.0] * 6},
            {"walls_s": [1.0, 1.2, 1.0, 1.2], "cpu_busiest_passes": [5.0] * 4}]
    assert spells.by_cpu(tail)[0] == 0.0


def test_many_cpus_account_for_nothing_where_pass_times_are_noise_alone():
    rng = random.Random(0)
    recs = [{"walls_s": [rng.uniform(1.0, 1.5) for _ in range(30)],
             "cpu_busiest_passes": [float(rng.randrange(8)) for _ in range(30)]} for _ in range(2)]
    # the raw between-CPU share of these passes is 9%: what chance gives 8 CPUs over 60 passes
    assert spells.by_cpu(recs)[0] < 0.02


def test_too_few_passes_one_cpu_or_no_spread_say_nothing():
    assert spells.by_cpu([{"walls_s": [1.0, 2.0, 1.0], "cpu_busiest_passes": [5.0] * 3}]) is None  # one CPU
    # CPU 3's two passes are too few to count: one CPU left
    assert spells.by_cpu([{"walls_s": [1.0, 2.0, 1.0, 2.0, 1.0], "cpu_busiest_passes": [5.0, 5.0, 5.0, 3.0, 3.0]}]) \
        is None
    assert spells.by_cpu([{"walls_s": [1.0, 2.0], "cpu_busiest_passes": [5.0]}]) is None  # a pass without it
    assert spells.by_cpu([{"walls_s": [1.0] * 6, "cpu_busiest_passes": [5.0, 3.0] * 3}]) is None  # no spread
