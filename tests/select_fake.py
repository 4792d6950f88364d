"""task=select with no model: the grid's steer runs are replaced by the results.jsonl rows a test gives each pair,
and the probe by a fixed one, so select's rules can be checked against a direct computation."""

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from helpers import compose
from steer import results
from steer.edits.tap import Tap
from steer.runs import grid, metrics
from steer.runs import job as jobs_mod
from steer.runs import probe as probes
from steer.runs import run as runner
from steer.runs.extract import Recipe
from steer.runs.job import Job
from steer.tasks import select

PROBE = probes.Probe(1, Tap("layer1", "model.layers.1", True), torch.ones(4), "select.probe_layer")


def row(probe_baseline=0.0, probe_steered=0.0, ppl_baseline=2.0, ppl_steered=2.0, distinct2_baseline=0.9,
        distinct2_steered=0.9, repeat_baseline=1, repeat_steered=1, prompt="p", **more):
    """One prompt's line of results.jsonl, with what select reads."""
    return {"prompt": prompt, "baseline": "base text", "steered": "steered text", "baseline_tokens": 4,
            "steered_tokens": 4, "tokens_changed": 2, "kl": 0.1, "probe_baseline": probe_baseline,
            "probe_steered": probe_steered, "concept_baseline": probe_baseline, "concept_steered": probe_steered,
            "ppl_baseline": ppl_baseline, "ppl_steered": ppl_steered, "distinct2_baseline": distinct2_baseline,
            "distinct2_steered": distinct2_steered, "rep_steered": 0.0, "repeat_baseline": repeat_baseline,
            "repeat_steered": repeat_steered, **more}


def run_grid(tmp_path, console, rows, *overrides, monkeypatch=None, layers=(1, 2), scales=(2, 4)):
    """select.run over a layers x scales grid whose pairs 'ran' into `rows`: (layer, scale) -> that pair's rows
    (every pair the same number, one per prompt of prompts.steer, which is set to match)."""
    n = len(next(iter(rows.values())))
    prompts = [f"prompt {i}" for i in range(n)]
    cfg = compose("task=select", f"select.layers=[{','.join(map(str, layers))}]",
                  f"select.scales=[{','.join(map(str, scales))}]", "progress=false",
                  f"prompts.steer=[{','.join(repr(p) for p in prompts)}]", *overrides)
    cells = [Job(c, None, tmp_path / grid.cell_name(c), "hf", Recipe()) for c in grid.cells(cfg)]

    @contextmanager
    def no_engine(jobs):
        yield None

    def execute(jobs, console, summary=None, engine=None):
        out = []
        for j in jobs:
            got = [{**r, "prompt": p} for r, p in zip(rows[(j.cfg.tap.layer, j.cfg.edit.scale)], prompts)]
            j.out_dir.mkdir(parents=True, exist_ok=True)
            results.write_jsonl(j.out_dir / "results.jsonl", got)
            out.append(metrics.aggregate(got, 1.0))
            results.write_json(j.out_dir / "metrics.json", out[-1])
        return out

    saved = jobs_mod.engine_for, probes.choose, runner.execute
    jobs_mod.engine_for, probes.choose = no_engine, lambda cfg, spec, engine: PROBE
    runner.execute = execute
    try:
        return select.run(SimpleNamespace(cfg=cfg, out_dir=tmp_path, cells=cells, spec=None), console)
    finally:
        jobs_mod.engine_for, probes.choose, runner.execute = saved
