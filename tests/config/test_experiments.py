"""Every committed experiment runs end to end on the tiny model (shortened generation), as a sweep: one job per
value its config sweeps, each job running the edits its config names, and those edits changing what the model
does where they should.

The tiny model is trained where the tests run, so whether an experiment's edits move a greedy token at its
strengths differs between CPUs: the checks here are on the next-token distributions (KL, projections), and on the
texts as the model with the job's edits reads them here, never on whether a text moved."""

import json
import math

import pytest
from omegaconf import OmegaConf

from helpers import CONF, compose, summary_rows

EXPERIMENTS = sorted(f.stem for f in (CONF / "experiment").glob("*.yaml"))
QUICK = ["model=tiny", "gen.max_new_tokens=4", "prompts.steer=['The weather today is','Tell me how to bake bread']"]
# The edits each job's steer.log must name, from the value the job sweeps (None: the experiment is one run).
EDITS = {
    "add_scale_sweep": lambda v: f"layer1 add scale={v}",
    "clamp_sweep": lambda v: f"layer2 clamp scale=1 hi={v} (generated)",
    "refusal_ablation_layers": lambda v: f"layer{v} ablate scale=1",
    "joy_two_taps": lambda v: "layer1 add scale=6, layer2 clamp scale=1 lo=-40 hi=40 (generated)",
}
METRICS = ["kl_mean", "tokens_changed_frac", "proj_baseline", "proj_steered", "ppl_baseline", "ppl_steered",
           "concept_baseline", "concept_steered", "tokens_per_s"]
# Experiments on the real model run, with their own checks, in tests/models/test_real_model.py and (the
# conditional one) tests/runs/test_conditional_example.py.
REAL = {"smollm2_joy", "smollm2_joy_food"}


def swept(name):
    """The experiment's swept key and its values, as its config lists them; (None, [None]) for a single run."""
    params = OmegaConf.select(OmegaConf.load(CONF / "experiment" / f"{name}.yaml"), "hydra.sweeper.params")
    if not params:
        return None, [None]
    [(key, values)] = params.items()
    return key, str(values).split(",")


def check_greedy(job_dir, cfg, engine):
    """Each continuation the job wrote is the greedy one of its model, read back here teacher-forced: the baseline's
    tokens the argmax of the unsteered model's log-probs, the steered ones' of the model with the job's edits (to
    1e-4 in log-prob: a near tie may go either way). A generation that left out an edit its scoring applied fails
    wherever that edit moves a greedy token."""
    from steer.tasks import registry
    from steer.runs.extract import Recipe, cached_default

    job = registry.prepare(cfg, job_dir)
    pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
    recipe = Recipe.from_conf(cfg.extract, cfg.prompts.chat)
    plan = job.plan.with_defaults(lambda tap: cached_default(cfg.cache_dir, engine, tap, pos, neg, recipe),
                                  job.spec.hidden).active()
    plan = plan if plan.edits else None  # as the run holds it: a plan that edits nothing runs as none
    for row in map(json.loads, (job_dir / "results.jsonl").read_text().splitlines()):
        ids, n = row["prompt_ids"], len(row["prompt_ids"])
        for cont, edits in ((row["baseline_ids"], None), (row["steered_ids"], plan)):
            lp = engine.score(ids, cont, edits).logprobs[n - 1: n - 1 + len(cont)]
            chosen = lp[range(len(cont)), cont]
            assert (chosen >= lp.max(-1).values - 1e-4).all(), (job_dir.name, row["prompt"], edits is not None)


def test_every_experiment_is_listed_here():
    assert set(EXPERIMENTS) == set(EDITS) | REAL


@pytest.mark.parametrize("name", sorted(EDITS))
def test_experiment_runs_on_tiny(cli, name, tmp_path, tiny_spec, hf_engine):
    sweep = tmp_path / "sweep"
    res = cli(["-m", f"+experiment={name}", *QUICK, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = summary_rows(sweep)
    key, values = swept(name)
    assert [r[key] if key else None for r in rows] == values
    m = [{k: float(r[k]) for k in METRICS} for r in rows]
    for r, v, mr in zip(rows, values, m):
        assert r["status"] == "ok" and all(math.isfinite(x) for x in mr.values()) and mr["tokens_per_s"] > 0, r
        assert f"edits: {EDITS[name](v)}\n" in (sweep / r["job"] / "steer.log").read_text()
        if name == "add_scale_sweep" and float(v) == 0:  # adding nothing: the steered run is the baseline
            assert mr["kl_mean"] == 0 and mr["tokens_changed_frac"] == 0 and mr["ppl_steered"] == mr["ppl_baseline"]
        else:  # every other job's edits move the next-token distributions, well past float32's rounding
            assert mr["kl_mean"] > 1e-4, r
        # and its texts are what greedy decoding with and without those edits gives
        check_greedy(sweep / r["job"], compose(f"+experiment={name}", *QUICK, *([f"{key}={v}"] if key else [])),
                     hf_engine)
    if name == "add_scale_sweep":  # the strongest add moves the tap along the direction
        assert m[-1]["proj_steered"] > 1.5 * m[-1]["proj_baseline"]
    if name == "refusal_ablation_layers":  # the direction is gone at the tap, whichever layer it is
        assert all(mr["proj_steered"] < 1e-3 * mr["proj_baseline"] for mr in m)
    if name == "clamp_sweep":  # every generated row sits at or below the ceiling: |h . d| >= |hi| on average
        proj = [mr["proj_steered"] for mr in m]
        assert all(p >= -float(hi) - 1e-3 for p, hi in zip(proj, values)), (proj, values)
        assert proj[-1] > proj[0], proj  # the lowest ceiling moves the rows furthest
