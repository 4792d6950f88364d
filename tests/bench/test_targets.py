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
    cfg = conf("{scenario:add,of:f,at_least:0.9}")
    b, b2 = [0.40, 0.50, 0.52], [0.44, 0.47, 0.60]
    # passes a second apart, but b not the run's pairing reference: nothing is paired
    rows = report.cells([cell("b", b, started_s=[0.0, 2.0, 4.0]), cell("b2", b2, started_s=[1.0, 3.0, 5.0]),
                         cell("f", b, "add")], cfg)
    got = targets.controls(rows, cfg)[("tiny", 64, 128)]
    assert got["ratio"] == pytest.approx(median(b) / median(b2))  # throughput over b's: b's time over b2's
    assert got["best"] == pytest.approx(min(b) / min(b2))
    assert got["interval"] == bootstrap.interval(b2, b)
    assert got["paired"] is None and got["paired_interval"] is None
    assert report.targets(rows, cfg)[0]["control"] == pytest.approx(median(b) / median(b2))  # a medians target's
    md = report.markdown(rows, [], cfg, {}, "now", "cmd")
    assert "| scenario | b tok/s | b2 tok/s | f tok/s | f/b | b2/b |" in md and "| 1.00 | 1.06 |" in md
    without = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]")
    assert targets.controls(report.cells([cell("b", b), cell("f", b, "add")], without), without) == {}


def test_a_control_that_failed_or_was_skipped_controls_nothing():
    cfg = conf("{scenario:add,of:f,at_least:0.95,between:fastest}")
    for status in ("error", "skipped"):
        b2 = {**cell("b2", [0.4, 0.4]), "status": status, "tok_s": None}
        rows = report.cells([cell("b", [0.4, 0.5]), b2, cell("f", [0.41, 0.5], "add")], cfg)
        assert targets.controls(rows, cfg) == {} and report.targets(rows, cfg)[0]["control"] is None
        assert "The A/A control" not in report.markdown(rows, [], cfg, {}, "now", "cmd")


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
    assert "| control (b2/b) | miss by chance | holds |" in md
    assert "| f/b >= 0.95 (fastest) | add | tiny | 64x128 | 1.00 | 0.98 | - | " in md
    odds = [f"{bootstrap.chance_below(b, 3, t):.0%}" for t in (0.95, 0.80)]  # b's 3 passes, drawn with replacement
    # f's one 0.41 s pass holds the first (its next, 0.5 s, gives 0.80); the second holds either way
    assert md.count(f"| 0.94 | {odds[0]} | yes, within noise, turns on one pass |") == 1
    assert md.count(f"| 0.94 | {odds[1]} | yes |") == 1
    assert "| tiny | 64x128 | 1.00 | 0.94 | - | " in md  # the control's own table: medians, fastest passes
    miss = report.targets(report.cells([cell("b", b), cell("b2", b2), cell("f", [0.428, 0.5, 0.5], "add")], cfg),
                          cfg)[0]
    assert not miss["holds"] and targets.within_noise(miss)  # 0.935 misses 0.95 by less than the control's 0.06
    assert f"| 0.94 | {odds[0]} | **no** (-0.015), within noise, turns on one pass |" in report.markdown(
        rows, [miss], cfg, {}, "now", "cmd")  # b's next fastest, 0.5 s, would put it at 1.17


def test_noise_is_a_share_of_the_threshold():
    # 4% of noise moves a ratio near 3 by about 0.12, a ratio near 1 by 0.04
    near_three = {"decided": 3.1, "required": 3.0, "control": 0.96}
    assert targets.within_noise(near_three) and not targets.within_noise({**near_three, "decided": 3.2})
    assert not targets.within_noise({"decided": 1.1, "required": 1.0, "control": 0.96})


def test_a_paired_control_is_paired_with_b_like_any_engine():
    cfg = conf("{scenario:add,of:f,at_least:0.95,between:paired}", "{scenario:add,of:f,at_least:0.95,between:fastest}")
    # b b2 b b2 b b2 b, a second apart, and a fast b pass (0.3 s) a minute later, beside none of b2's
    b = cell("b", [0.5, 0.4, 0.6, 0.5, 0.3], started_s=[0.0, 1.0, 2.0, 3.0, 60.0], paired=True)
    b2 = cell("b2", [0.5, 0.48, 0.6], started_s=[0.6, 1.6, 2.6])
    f = cell("f", [0.5], "add", started_s=[1.5])
    rows = report.cells([b, b2, f], cfg)
    got = targets.controls(rows, cfg)[("tiny", 64, 128)]
    # each b2 pass over the mean of the b passes on its either side: 0.45/0.5, 0.5/0.48, 0.55/0.6
    assert got["paired"] == pytest.approx(median([0.45 / 0.5, 0.5 / 0.48, 0.55 / 0.6]))
    expect = pairs.figures({"walls_s": b2["walls_s"], "started_s": b2["started_s"]},
                           {"walls_s": b["walls_s"], "started_s": b["started_s"]})
    assert got["paired_interval"] == expect["paired_interval"] is not None
    assert got["best"] == pytest.approx(0.4 / 0.48)  # b's fastest first neighbour, not its 0.3 s a minute away
    assert got["ratio"] == pytest.approx(0.5 / 0.5)  # three columns, three different figures
    paired, fastest = report.targets(rows, cfg)
    assert paired["control"] == pytest.approx(got["paired"]) and fastest["control"] == pytest.approx(got["best"])
    md = report.markdown(rows, [], cfg, {}, "now", "cmd")
    lo, hi = got["paired_interval"]
    assert f"| tiny | 64x128 | 1.00 | 0.83 | 0.92 ({lo:.2f}-{hi:.2f}) | " in md


def test_a_target_without_a_control_has_no_control_column():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]",
                     "targets=[{scenario:add,of:f,at_least:0.95}]")
    rows = report.cells([cell("b", [0.5, 0.5]), cell("f", [0.5, 0.5], "add")], cfg)
    goal = report.targets(rows, cfg)[0]
    assert goal["control"] is None and not targets.within_noise(goal)
    md = report.markdown(rows, [goal], cfg, {}, "now", "cmd")
    assert "control" not in md and "| interval | steps | fastest steps | holds |" in md
    assert "turns on one pass" not in md  # no target between fastest passes, nothing to say of one


@pytest.mark.parametrize("key,reading,b_steps,f_steps,row,control", [
    ("steps", "step_ms_passes", [3.0] * 3, [3.06] * 3, "| 0.98 (0.98-0.98) | - |", "| 1.00 (1.00-1.00) | - |"),
    ("fast_steps", "step_gaps_ms_passes", [[3.0] * 20] * 3, [[3.06] * 20] * 3, "| - | 0.98 (0.98-0.98) |",
     "| - | 1.00 (1.00-1.00) |")])
def test_the_step_columns_sit_beside_the_verdict_and_never_decide_it(key, reading, b_steps, f_steps, row, control):
    # f's passes take 20% longer than b's, but its steps (median, or fastest) only 2% longer: the wall ratio
    # decides (no), the step column shows 0.98 in both tables, the control's 1.00
    cfg = conf("{scenario:add,of:f,at_least:0.9}")
    b = cell("b", [0.40, 0.40, 0.40], started_s=[0.0, 2.0, 4.0], **{reading: b_steps})
    b2 = cell("b2", [0.40, 0.40, 0.40], started_s=[1.0, 3.0, 5.0], **{reading: b_steps})
    f = cell("f", [0.48, 0.48, 0.48], "add", started_s=[6.0, 8.0, 10.0], **{reading: f_steps})
    rows = report.cells([b, b2, f], cfg)
    [goal] = report.targets(rows, cfg)
    assert goal[key] == pytest.approx(3.0 / 3.06) and goal["holds"] is False
    md = report.markdown(rows, [goal], cfg, {}, "now", "cmd")
    assert f"| 0.83 | 0.83 | - | 0.83-0.83 {row} 1.00 | **no** (-0.067) |" in md
    assert f"| tiny | 64x128 | 1.00 | 1.00 | - | 1.00-1.00 {control}" in md  # the control's


def test_a_fastest_target_gives_its_chance_of_missing_at_no_cost_and_the_run_its_power():
    # b's passes in two modes; f exactly b's speed but only 4 passes: it misses 0.95 whenever all 4 are slow
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]",
                     "targets=[{scenario:add,of:f,at_least:0.95,between:fastest},{scenario:add,of:f,at_least:0.7}]")
    b_walls = [0.4, 0.8] * 20
    rows = report.cells([cell("b", b_walls), cell("f", [0.8, 0.8, 0.8, 0.8], "add")], cfg)
    fastest, medians = report.targets(rows, cfg)
    chance = bootstrap.chance_below(b_walls, 4, 0.95)
    assert fastest["chance"] == chance and 0.03 < chance < 0.09 and medians["chance"] is None
    assert fastest["holds"] is False  # the chance is shown beside the verdict, never changes it
    md = report.markdown(rows, [fastest, medians], cfg, {}, "now", "cmd")
    assert "| miss by chance | holds |" in md and f"| {chance:.0%} | **no** (-0.450) |" in md
    assert "| 0.75 | 0.50 | - | 0.50-1.00 | - | - | - | yes, undecided |" in md  # the medians target: 0.6 s / 0.8 s
    assert (f"the 1 targets decided between fastest passes would miss {chance:.1f} of them by chance at these "
            f"passes a cell, and all 1 hold in {1 - chance:.0%} of runs (their chances taken as independent). 0 of "
            "their verdicts turn on one pass.") in md


@pytest.mark.parametrize("b_walls,f_walls,holds,single", [
    ([0.30, 0.40, 0.40, 0.41], [0.40, 0.41, 0.42], False, True),  # b's one fast pass decides: 0.75, else 1.00
    ([0.40, 0.45, 0.45], [0.38, 0.45, 0.46], True, True),  # f's one fast pass: 1.05, else 0.89
    ([0.40, 0.40, 0.41], [0.40, 0.41, 0.41], True, False),  # either cell's next fastest keeps it
    ([0.30, 0.31, 0.31], [0.40, 0.41, 0.41], False, False),  # a miss by a mile stays one
    ([0.40], [0.30, 0.40], True, False)])  # one pass of b: nothing to leave out
def test_a_fastest_verdict_says_when_it_turns_on_one_pass(b_walls, f_walls, holds, single):
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]",
                     "targets=[{scenario:add,of:f,at_least:0.95,between:fastest},{scenario:add,of:f,at_least:0.7}]")
    rows = report.cells([cell("b", b_walls), cell("f", f_walls, "add")], cfg)
    fastest, medians = report.targets(rows, cfg)
    assert fastest["holds"] is holds and fastest["one_pass"] is single and medians["one_pass"] is None
    assert targets.one_pass(cell("f", f_walls), cell("b", b_walls), 0.95) is single
    md = report.markdown(rows, [fastest, medians], cfg, {}, "now", "cmd")
    assert md.count(", turns on one pass |") == single and f"{int(single)} of their verdicts turn on one pass" in md


def test_a_paired_fastest_verdict_is_not_left_one_out():
    # Paired, a cell's fastest pass is measured among the reference passes beside it: no single reference pass
    # serves every cell, so the flag is the unpaired reference's
    cfg = conf("{scenario:add,of:f,at_least:0.95,between:fastest}")
    b = cell("b", [0.3, 0.4, 0.4], started_s=[0.0, 2.0, 4.0], paired=True)
    rows = report.cells([b, cell("f", [0.4, 0.4], "add", started_s=[1.0, 3.0])], cfg)
    [goal] = report.targets(rows, cfg)
    assert goal["paired"] is not None and goal["one_pass"] is None
    md = report.markdown(rows, [goal], cfg, {}, "now", "cmd")
    assert "miss by chance" in md and "turns on one pass" not in md and "of their verdicts" not in md
