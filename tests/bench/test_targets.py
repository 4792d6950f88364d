"""The targets' verdicts beside the A/A control (b2: b's pipeline and work in a second engine process), on CPU."""

from statistics import median

import pytest

from bench_common import bench_conf
from steer.bench import bootstrap, pairs, report, targets

N = 64 * 128


def cell(config, walls, scenario="unsteered", **more):
    return {"model": "tiny", "config": config, "scenario": scenario, "requests": 64, "tokens": 128, "status": "ok",
            "tok_s": N / median(walls), "wall_s": median(walls), "walls_s": walls, **more}


def conf(*goals):
    return bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,b2,f]", "scenarios=[add]",
                      "targets=[" + ",".join(goals) + "]")


def test_the_control_is_b2_over_b_in_every_column():
    cfg = conf()
    b, b2 = [0.40, 0.50, 0.52], [0.44, 0.47, 0.60]
    found = targets.controls(report.cells([cell("b", b), cell("b2", b2), cell("f", b, "add")], cfg), cfg)
    got = found[("tiny", 64, 128)]
    assert got["ratio"] == pytest.approx(median(b) / median(b2))  # throughput over b's: b's time over b2's
    assert got["best"] == pytest.approx(min(b) / min(b2))
    assert got["interval"] == bootstrap.interval(b2, b)
    assert got["paired"] is None  # b was not the run's pairing reference
    without = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]")
    assert targets.controls(report.cells([cell("b", b), cell("f", b, "add")], without), without) == {}


def test_a_margin_the_control_reaches_is_within_noise_either_way():
    cfg = conf("{scenario:add,of:f,at_least:0.95,between:fastest}", "{scenario:add,of:f,at_least:0.80,between:fastest}")
    # b2 is b's work, and its fastest pass is 6% slower than b's: that far, this run cannot tell a ratio from noise
    b, b2, f = [0.40, 0.5, 0.5], [0.424, 0.5, 0.5], [0.41, 0.5, 0.5]
    rows = report.cells([cell("b", b), cell("b2", b2), cell("f", f, "add")], cfg)
    close, far = report.targets(rows, cfg)
    assert close["control"] == far["control"] == pytest.approx(0.40 / 0.424)
    assert close["best"] == pytest.approx(0.40 / 0.41) and close["holds"] and targets.within_noise(close)
    assert far["holds"] and not targets.within_noise(far)  # 0.18 over its threshold, beyond the control's 0.06
    md = report.markdown(rows, [close, far], cfg, {}, "now", "cmd")
    assert "| control (b2/b) | holds |" in md
    assert "| f/b >= 0.95 (fastest) | add | tiny | 64x128 | 1.00 | 0.98 | - | " in md
    assert md.count("| 0.94 | yes, within noise |") == 1 and md.count("| 0.94 | yes |") == 1
    assert "| tiny | 64x128 | 1.00 | 0.94 | - | " in md  # the control's own table: medians, fastest passes
    miss = report.targets(report.cells([cell("b", b), cell("b2", b2), cell("f", [0.428, 0.5, 0.5], "add")], cfg),
                          cfg)[0]
    assert not miss["holds"] and targets.within_noise(miss)  # 0.935 misses 0.95 by less than the control's 0.06


def test_a_paired_control_is_paired_with_b_like_any_engine():
    cfg = conf("{scenario:add,of:f,at_least:0.95,between:paired}")
    b = cell("b", [0.5, 0.4, 0.6, 0.5], started_s=[0.0, 1.0, 2.0, 3.0], paired=True)
    b2 = cell("b2", [0.45, 0.55], started_s=[0.6, 2.7])
    f = cell("f", [0.5], "add", started_s=[1.5])
    rows = report.cells([b, b2, f], cfg)
    got = targets.controls(rows, cfg)[("tiny", 64, 128)]
    expect = pairs.figures({"walls_s": b2["walls_s"], "started_s": b2["started_s"]},
                           {"walls_s": b["walls_s"], "started_s": b["started_s"]})
    assert got["paired"] == pytest.approx(expect["paired"]) and got["paired_interval"] == expect["paired_interval"]
    assert got["paired"] == pytest.approx(median([0.45 / 0.45, 0.55 / 0.55]))  # each pass over its neighbours' mean
    goal = report.targets(rows, cfg)[0]
    assert goal["control"] == pytest.approx(got["paired"])  # the column that decides the target: paired


def test_a_target_without_a_control_has_no_control_column():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]",
                     "targets=[{scenario:add,of:f,at_least:0.95}]")
    rows = report.cells([cell("b", [0.5, 0.5]), cell("f", [0.5, 0.5], "add")], cfg)
    goal = report.targets(rows, cfg)[0]
    assert goal["control"] is None and not targets.within_noise(goal)
    md = report.markdown(rows, [goal], cfg, {}, "now", "cmd")
    assert "control" not in md and "| interval | holds |" in md
