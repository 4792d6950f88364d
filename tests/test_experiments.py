"""Every committed experiment runs end to end on the tiny model (shortened generation), as a sweep."""

import csv

import pytest

from helpers import CONF, run_cli

EXPERIMENTS = sorted(f.stem for f in (CONF / "experiment").glob("*.yaml"))
QUICK = ["model=tiny", "gen.max_new_tokens=4", "prompts.steer=['The weather today is','Tell me how to bake bread']"]
JOBS = {"refusal_ablation_layers": 4, "add_scale_sweep": 5, "clamp_sweep": 5, "joy_two_taps": 1}
# Experiments on the real model run, with their own checks, in tests/test_real_model.py.
REAL = {"smollm2_joy"}


def test_every_experiment_is_listed_here():
    assert set(EXPERIMENTS) == set(JOBS) | REAL


@pytest.mark.parametrize("name", sorted(JOBS))
def test_experiment_runs_on_tiny(name, tmp_path, cache_dir, tiny_spec):
    res = run_cli(["-m", f"+experiment={name}", *QUICK, f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "sweep" / "summary.csv").open()))
    assert len(rows) == JOBS[name]
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    if name == "clamp_sweep":  # a falling ceiling pushes the projection further from where it sat
        proj = [float(r["proj_steered"]) for r in rows]
        assert proj == sorted(proj) and proj[-1] > proj[0] * 1.2, proj
