"""A paired run's figures: each pass against the reference passes timed just before and after it."""

from statistics import median

import pytest

from steer.bench import pairs


def test_each_pass_is_set_against_the_reference_passes_beside_it():
    # b f b f b: each f pass has b on both sides, 0.1 s apart
    got = pairs.neighbours([1.1, 3.1], [0.9, 0.9], [0.0, 2.1, 4.1], [1.0, 0.9, 1.2])
    assert got == [(0.9, [1.0, 0.9]), (0.9, [0.9, 1.2])]


def test_a_reference_pass_further_than_the_slack_is_no_neighbour():
    # the last f pass comes 30 s after any b pass (another wave): it has none and is left out; the first has b
    # before it only
    got = pairs.neighbours([1.1, 40.0], [0.9, 0.9], [0.0], [1.0], slack_s=2.0)
    assert got == [(0.9, [1.0])]
    assert pairs.neighbours([40.0], [0.9], [0.0], [1.0]) == []


def test_the_paired_ratio_follows_the_spells_the_medians_do_not():
    # The host's spells: b's passes take 1.0 s in a fast one, 1.5 s in a slow one; f costs 2% whatever the spell,
    # and each f pass between two b passes takes 1.02 times their mean. The medians say 0.78 of b (f drew more of
    # the slow spells), the passes against their neighbours 0.98
    b_walls = [1.0, 1.0, 1.5, 1.5, 1.5, 1.0, 1.0]
    f_walls = [1.02 * (x + y) / 2 for x, y in zip(b_walls, b_walls[1:])]
    starts_b, starts_f, t = [], [], 0.0
    for i, w in enumerate(b_walls):
        starts_b.append(t)
        t += w + 0.05
        if i < len(f_walls):
            starts_f.append(t)
            t += f_walls[i] + 0.05
    got = pairs.figures({"walls_s": f_walls, "started_s": starts_f}, {"walls_s": b_walls, "started_s": starts_b})
    assert median(b_walls) / median(f_walls) == pytest.approx(1.0 / 1.275)
    assert got["paired"] == pytest.approx(1 / 1.02) and got["pairs"] == 6
    assert got["paired_interval"] == pytest.approx((1 / 1.02, 1 / 1.02))  # every pair says the same
    assert got["paired_fastest"] == pytest.approx(1.0 / 1.02)  # the fastest first neighbour over the fastest pass


def test_no_neighbours_no_figures():
    got = pairs.figures({"walls_s": [1.0], "started_s": [100.0]}, {"walls_s": [1.0], "started_s": [0.0]})
    assert got == {"paired": None, "paired_interval": None, "paired_fastest": None, "pairs": 0}


def test_between_fastest_passes_each_pass_brings_one_neighbour():
    # one f pass between b's 1.0 s and 0.8 s: its first neighbour stands for b, as many b passes as f's
    got = pairs.figures({"walls_s": [1.0], "started_s": [1.1]}, {"walls_s": [1.0, 0.8], "started_s": [0.0, 2.2]})
    assert got["paired_fastest"] == pytest.approx(1.0) and got["paired"] == pytest.approx(0.9)


def _stepped(walls, starts, steps, paired=False):
    return {"walls_s": walls, "started_s": starts, "step_ms_passes": steps, "paired": paired}


def test_steps_set_each_pass_against_its_neighbours_median_steps():
    # b f b f b: f's steps are 5% longer than the mean of the b passes beside it, whatever its wall
    b = _stepped([1.0, 1.0, 1.0], [0.0, 2.1, 4.1], [3.0, 4.0, 3.0], paired=True)
    f = _stepped([0.9, 1.5], [1.1, 3.2], [3.5 * 1.05, 3.5 * 1.05])
    got = pairs.steps(f, b)
    assert got["steps"] == pytest.approx(1 / 1.05) and got["steps_interval"] == pytest.approx((1 / 1.05, 1 / 1.05))


def test_unpaired_steps_are_the_ratio_of_the_cells_median_steps():
    got = pairs.steps(_stepped([1.0, 1.0], [0.0, 1.0], [4.0, 4.4]), _stepped([1.0, 1.0], [5.0, 6.0], [4.0, 4.0]))
    assert got["steps"] == pytest.approx(4.0 / 4.2) and got["steps_interval"] is not None


@pytest.mark.parametrize("mine", [[], [4.0]])  # none, or fewer than the passes (a pass without its step)
def test_steps_need_every_pass_step(mine):
    got = pairs.steps(_stepped([1.0, 1.0], [0.0, 1.0], mine), _stepped([1.0, 1.0], [0.0, 1.0], [4.0, 4.0]))
    assert got == {"steps": None, "steps_interval": None}


def _gapped(walls, starts, gaps, paired=False):
    return {"walls_s": walls, "started_s": starts, "step_gaps_ms_passes": gaps, "paired": paired}


def test_fastest_steps_sit_in_the_fast_mode_that_a_slow_spell_leaves():
    # b's two passes run 3 ms steps; f's first runs 3.06 ms steps, its second a slow spell of 6 ms steps with a
    # few fast ones: the median step of f's passes says 0.66, its fastest steps 0.98
    b = _gapped([0.3, 0.3], [0.0, 1.0], [[3.0] * 100, [3.0] * 100])
    f = _gapped([0.3, 0.6], [2.0, 3.0], [[3.06] * 100, [6.0] * 70 + [3.06] * 30])
    got = pairs.fast_steps(f, b)
    assert got["fast_steps"] == pytest.approx(3.0 / 3.06)
    assert got["fast_steps_interval"][0] == pytest.approx(3.0 / 3.06)
    assert got["fast_steps_interval"][1] == pytest.approx(3.0 / 3.06)


def test_fastest_steps_of_a_paired_run_take_the_reference_pass_before_each():
    # b f b f b: the b passes before f's run 2.0 ms steps, the one after the last f pass 1.5 ms, the one far from
    # any f pass 1.0 ms (another stretch of the run): only the pass before each f pass counts, so f at 2.1 ms is
    # 2.0 / 2.1 (both neighbours would give less, the far pass less still)
    b = _gapped([1.0] * 4, [0.0, 2.1, 4.1, 50.0], [[2.0] * 50, [2.0] * 50, [1.5] * 50, [1.0] * 50], paired=True)
    f = _gapped([0.9, 0.9], [1.1, 3.2], [[2.1] * 50, [2.1] * 50])
    assert pairs.fast_steps(f, b)["fast_steps"] == pytest.approx(2.0 / 2.1)


def test_fastest_steps_of_a_paired_run_resample_the_pairs():
    # each f pass runs 2% slower than the b pass before it, in spells from 2 to 4 ms: resampling pairs keeps each
    # pass with its own neighbour, so the interval stays at 1 / 1.02 where drawing each side apart would spread it
    spells = [2.0, 4.0, 2.5, 3.5, 2.0, 4.0, 3.0, 2.2]
    b = _gapped([0.5] * 8, [3.0 * i for i in range(8)], [[x] * 40 for x in spells], paired=True)
    f = _gapped([0.5] * 8, [3.0 * i + 0.6 for i in range(8)], [[1.02 * x] * 40 for x in spells])
    got = pairs.fast_steps(f, b)
    assert got["fast_steps"] == pytest.approx(1 / 1.02)
    assert got["fast_steps_interval"] == pytest.approx((1 / 1.02, 1 / 1.02))


def test_fastest_steps_of_a_paired_run_leave_out_a_pass_with_no_neighbour():
    b = _gapped([1.0], [0.0], [[2.0] * 50], paired=True)
    alone = _gapped([0.9], [40.0], [[2.1] * 50])  # 39 s after b's pass: another wave
    assert pairs.fast_steps(alone, b) == {"fast_steps": None, "fast_steps_interval": None}


def test_passes_a_step_apart_in_length_are_drawn_together():
    # 128 and 129 steps a pass (a stamp on either side of a pass's edge): cut to 128, the same quantile
    mine = [[2.0] * 128, [2.0] * 128 + [9.0]]
    got = pairs.fast_steps(_gapped([0.3, 0.3], [0.0, 1.0], mine), _gapped([0.3, 0.3], [5.0, 6.0], [[2.0] * 128] * 2))
    assert got["fast_steps"] == pytest.approx(1.0) and got["fast_steps_interval"] == pytest.approx((1.0, 1.0))


def test_fastest_steps_are_the_quantile_of_every_step_pooled():
    mine = [[1.0 + i / 100 for i in range(100)], [2.0 + i / 100 for i in range(100)]]
    theirs = [[1.0] * 10, [1.5] * 10]
    got = pairs.fast_steps(_gapped([1.0, 1.0], [0.0, 1.0], mine), _gapped([1.0, 1.0], [5.0, 6.0], theirs))
    pooled = sorted(mine[0] + mine[1])
    assert got["fast_steps"] == pytest.approx(1.0 / (pooled[19] + 0.9 * (pooled[20] - pooled[19])))
    lo, hi = got["fast_steps_interval"]
    assert lo < got["fast_steps"] <= hi


@pytest.mark.parametrize("mine", [[], [[4.0]]])  # none, or fewer than the passes (a pass without its steps)
def test_fastest_steps_need_every_pass_steps(mine):
    got = pairs.fast_steps(_gapped([1.0, 1.0], [0.0, 1.0], mine), _gapped([1.0, 1.0], [0.0, 1.0], [[4.0], [4.0]]))
    assert got == {"fast_steps": None, "fast_steps_interval": None}
