"""task=select rejects looping text that perplexity passes, and picks only a positive gain; no model (the grid's
steer runs are replaced by the metrics given here, as in tests/runs/test_select_cell.py)."""

from contextlib import contextmanager
from types import SimpleNamespace

from helpers import compose
from steer.runs import select

CLEAN = {"ppl_baseline": 3.0, "ppl_steered": 3.3, "distinct2_baseline": 0.9, "distinct2_steered": 0.85}
LOOP = {"ppl_baseline": 3.0, "ppl_steered": 1.7, "distinct2_baseline": 0.9, "distinct2_steered": 0.2}


def run_grid(tmp_path, console, metrics, *extra):
    from steer.runs import grid
    from steer.runs import job as jobs_mod

    cfg = compose("task=select", "select.layers=[1,2]", "select.scales=[2,4]", "progress=false", *extra)
    cells = [SimpleNamespace(cfg=c, out_dir=tmp_path / grid.cell_name(c), result=None) for c in grid.cells(cfg)]

    @contextmanager
    def no_engine(jobs):
        yield None

    def execute(jobs, console, summary=None, engine=None):
        for j in jobs:
            j.result = {**metrics[(j.cfg.tap.layer, j.cfg.edit.scale)], "kl_mean": 0.1, "prompts": 2}
        return [j.result for j in jobs]

    old = jobs_mod.engine_for
    jobs_mod.engine_for = no_engine
    try:
        return select.run(SimpleNamespace(cfg=cfg, out_dir=tmp_path, cells=cells), console, execute)
    finally:
        jobs_mod.engine_for = old


def concept(gain):
    return {"concept_baseline": 1.0, "concept_steered": 1.0 + gain}


def test_a_loop_with_low_perplexity_is_rejected_and_the_clean_pair_chosen(tmp_path, console):
    metrics = {(1, 2.0): {**CLEAN, **concept(2.0)}, (1, 4.0): {**LOOP, **concept(9.0)},
               (2, 2.0): {**CLEAN, **concept(-1.0)}, (2, 4.0): {**CLEAN, "ppl_steered": 9.0, **concept(8.0)}}
    got = run_grid(tmp_path, console, metrics)
    cells = {(c["layer"], c["scale"]): c for c in got["cells"]}
    loop = cells[(1, 4.0)]
    assert loop["ppl_ratio"] < 2.0 and not loop["ok"]  # perplexity alone would keep it, and pick it
    assert loop["why"] == "repetitive: distinct-2 0.20 < 0.7 x 0.90"
    assert (got["best"]["layer"], got["best"]["scale"]) == (1, 2.0)
    md = (tmp_path / "selection.md").read_text()
    assert "repetitive: distinct-2 0.20" in md and "edit.scale_by=vector" in md


def test_the_repetition_check_follows_min_distinct_ratio(tmp_path, console):
    metrics = {k: {**LOOP, **concept(9.0 if k == (1, 4.0) else 1.0)} for k in [(1, 2.0), (1, 4.0), (2, 2.0), (2, 4.0)]}
    got = run_grid(tmp_path, console, metrics, "select.min_distinct_ratio=0.2")  # 0.2 >= 0.2 x 0.9: kept
    assert all(c["ok"] for c in got["cells"]) and (got["best"]["layer"], got["best"]["scale"]) == (1, 4.0)


def test_no_positive_gain_no_pick(tmp_path, console):
    metrics = {k: {**CLEAN, **concept(-0.5)} for k in [(1, 2.0), (1, 4.0), (2, 2.0), (2, 4.0)]}
    got = run_grid(tmp_path, console, metrics)
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
