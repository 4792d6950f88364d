"""task=select judges damage per prompt: a loop that perplexity passes is rejected, a collapse on one prompt of many
is not averaged away, negative scales gain toward the negative set, and only a positive gain is picked; no model
(the grid's steer runs are replaced by the rows given here: tests/select_fake.py)."""

from types import SimpleNamespace

import pytest

from select_fake import row, run_grid
from steer.tasks import select
from steer.runs.damage import Rules, judge, longest_repeat

CLEAN = {"ppl_baseline": 3.0, "ppl_steered": 3.3, "distinct2_baseline": 0.9, "distinct2_steered": 0.85}
LOOP = {"ppl_baseline": 3.0, "ppl_steered": 1.7, "distinct2_baseline": 0.9, "distinct2_steered": 0.2}
CELLS = [(1, 2.0), (1, 4.0), (2, 2.0), (2, 4.0)]


def concept(gain):
    return {"probe_baseline": 1.0, "probe_steered": 1.0 + gain}


def test_a_loop_with_low_perplexity_is_rejected_and_the_clean_pair_chosen(tmp_path, console):
    metrics = {(1, 2.0): {**CLEAN, **concept(2.0)}, (1, 4.0): {**LOOP, **concept(9.0)},
               (2, 2.0): {**CLEAN, **concept(-1.0)}, (2, 4.0): {**CLEAN, "ppl_steered": 9.0, **concept(8.0)}}
    got = run_grid(tmp_path, console, {k: [row(**m), row(**m)] for k, m in metrics.items()})
    cells = {(c["layer"], c["scale"]): c for c in got["cells"]}
    loop = cells[(1, 4.0)]
    assert loop["ppl_ratio"] < 2.0 and not loop["ok"]  # perplexity alone would keep it, and pick it
    assert loop["why"] == "2 of 2 prompts damaged (2 loop; max 0)"
    assert loop["damaged"][0]["damage"] == ["distinct-2 0.20 < 0.7 x 0.90"]
    assert (got["best"]["layer"], got["best"]["scale"]) == (1, 2.0)
    md = (tmp_path / "selection.md").read_text()
    assert "distinct-2 0.20 < 0.7 x 0.90" in md and "edit.scale_by=vector" in md


def test_one_collapsed_prompt_rejects_a_pair_its_mean_would_pass(tmp_path, console):
    """Five clean prompts and one that collapses into a loop of low perplexity: the means pass every check (and the
    loop lifts the mean gain), the prompt does not."""
    clean, collapse = row(**CLEAN, **concept(1.0)), row(**LOOP, **concept(12.0), repeat_steered=8)
    rows = {k: [clean] * 6 for k in CELLS} | {(2, 4.0): [clean] * 5 + [collapse]}
    got = run_grid(tmp_path, console, rows, "select.split=0")
    cells = {(c["layer"], c["scale"]): c for c in got["cells"]}
    c = cells[(2, 4.0)]
    assert c["choose"]["distinct2_steered"] >= 0.7 * c["choose"]["distinct2_baseline"] and c["ppl_ratio"] < 2
    assert c["gain"] == pytest.approx((5 * 1.0 + 12.0) / 6) and c["gain"] > cells[(1, 2.0)]["gain"]
    assert not c["ok"] and c["choose"]["prompts_looping"] == 1 and c["damaged"][0]["index"] == 5
    assert "a unit repeated 8 times in a row" in "; ".join(c["damaged"][0]["damage"])
    assert got["best"]["scale"] != 4.0 or got["best"]["layer"] != 2
    # select.max_bad_prompts=1 lets one damaged prompt pass
    again = run_grid(tmp_path / "again", console, rows, "select.split=0", "select.max_bad_prompts=1")
    assert (again["best"]["layer"], again["best"]["scale"]) == (2, 4.0)


def test_a_run_of_one_token_or_a_short_unit_counts_as_a_loop():
    assert longest_repeat([]) == 0 and longest_repeat([1, 2, 3]) == 1
    assert longest_repeat([5, 7, 7, 7, 7, 7, 7, 2]) == 6
    assert longest_repeat([9, 1, 2, 1, 2, 1, 2, 1, 2]) == 4  # an emoji of two byte tokens, four times
    assert longest_repeat([1, 2, 3, 4, 5] * 3) == 1  # a unit of five is longer than UNIT: not a run
    rules = Rules(max_run=6)
    assert judge(row(repeat_steered=6), rules)["looping"]
    assert not judge(row(repeat_steered=5), rules)["looping"]
    assert not judge(row(repeat_steered=7, repeat_baseline=7), rules)["looping"]  # the baseline's own run


def test_a_negative_scale_gains_toward_the_negative_set(tmp_path, console):
    """With scales -2 and -4 the pair that moves the probe's reading down the most wins; the heat map's gain is
    that move, a positive number."""
    rows = {(1, -2.0): [row(**CLEAN, **concept(-2.0))] * 2, (1, -4.0): [row(**CLEAN, **concept(-5.0))] * 2,
            (2, -2.0): [row(**CLEAN, **concept(1.0))] * 2, (2, -4.0): [row(**CLEAN, **concept(-0.5))] * 2}
    got = run_grid(tmp_path, console, rows, scales=(-2, -4))
    cells = {(c["layer"], c["scale"]): c for c in got["cells"]}
    assert cells[(1, -4.0)]["gain"] == pytest.approx(5.0) and cells[(2, -2.0)]["gain"] == pytest.approx(-1.0)
    assert cells[(1, -4.0)]["pole"] == "negative"
    assert (got["best"]["layer"], got["best"]["scale"]) == (1, -4.0)
    assert "toward the negative set" in (tmp_path / "selection.md").read_text()


def test_the_repetition_check_follows_min_distinct_ratio(tmp_path, console):
    rows = {k: [row(**LOOP, **concept(9.0 if k == (1, 4.0) else 1.0))] * 2 for k in CELLS}
    got = run_grid(tmp_path, console, rows, "select.min_distinct_ratio=0.2")  # 0.2 >= 0.2 x 0.9: kept
    assert all(c["ok"] for c in got["cells"]) and (got["best"]["layer"], got["best"]["scale"]) == (1, 4.0)


def test_no_positive_gain_no_pick(tmp_path, console):
    got = run_grid(tmp_path, console, {k: [row(**CLEAN, **concept(-0.5))] * 2 for k in CELLS})
    assert all(c["ok"] for c in got["cells"]) and got["best"] is None and got["command"] is None
    assert "no pair passed" in console.file.getvalue()


def test_the_rerun_command_keeps_scale_by(monkeypatch):
    from hydra.core.hydra_config import HydraConfig

    task = ["task=select", "edit.scale_by=resid", "edit.scale=3", "select.scales=[0.1,0.5]"]
    hydra = SimpleNamespace(overrides=SimpleNamespace(task=task), runtime=SimpleNamespace(config_sources=[]),
                            job=SimpleNamespace(config_name="config"))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
    assert select._command({"layer": 12, "scale": 0.5}) == \
        "python -m steer edit.scale_by=resid task=steer tap.layer=12 edit.scale=0.5"


def test_the_pair_is_chosen_on_one_half_and_reported_on_the_other(tmp_path, console):
    """Six prompts, select.split=0.5: the choice and its gain come from the choosing half alone (a pair that shines
    only on the held-out prompts is not chosen), and the report gives the other half's numbers beside them."""
    choose, report = select.split(6, 0.5, 0)
    assert sorted(choose + report) == list(range(6)) and len(choose) == 3
    assert select.split(6, 0.5, 1) != (choose, report) and select.split(3, 0.5, 0) == ([0, 1, 2], [])

    def rows(on_choose, on_report):
        return [row(**CLEAN, **concept(on_choose if i in choose else on_report)) for i in range(6)]

    got = run_grid(tmp_path, console, {(1, 2.0): rows(2.0, 1.0), (1, 4.0): rows(1.0, 9.0),
                                        (2, 2.0): rows(0.5, 0.5), (2, 4.0): rows(-1.0, 3.0)})
    best = got["best"]
    assert (best["layer"], best["scale"]) == (1, 2.0)
    assert best["gain"] == pytest.approx(2.0) and best["report"]["gain"] == pytest.approx(1.0)
    assert got["split"]["choose"] == choose and got["split"]["report"] == report
    md = (tmp_path / "selection.md").read_text()
    assert f"Chosen on 3 of 6 prompts (select.split=0.5, seed 0: prompts {', '.join(str(i + 1) for i in choose)})" \
        in md
    assert "Held-out prompts: gain 1, ppl x1.10, 0 of 3 looping, 0 over the ppl cap." in md
    m = __import__("json").loads((tmp_path / "metrics.json").read_text())
    assert m["best_gain"] == pytest.approx(2.0) and m["heldout_gain"] == pytest.approx(1.0)
