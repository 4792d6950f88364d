"""Steering a real instruct model (SmolLM2-135M-Instruct, real weights, HF engine on CPU): the committed joy
experiment steers without damage, ablating the default direction at any middle layer keeps the text intact, and
task=select picks a pair that passes its own cap."""

import io
import json

import pytest
from rich.console import Console

from helpers import compose
from steer.runs import run
from steer.tasks import registry

# Three of the default prompts, short continuations: enough to measure, quick on two cores.
QUICK = ["model=smollm2", "engine=hf", "progress=false", "gen.max_new_tokens=16",
         "prompts.steer=['The weather today is','When I opened the letter, I felt','The music in the hall was']"]


def _run(cfgs, tmp_path):
    jobs = []
    for i, cfg in enumerate(cfgs):
        (tmp_path / str(i)).mkdir()
        jobs.append(registry.prepare(cfg, tmp_path / str(i)))
    out = run.execute(jobs, Console(file=io.StringIO()))
    assert not [m for m in out if "error" in m], out
    return out


def test_the_committed_joy_experiment_steers_without_damage(smollm2_spec, tmp_path):
    [m] = _run([compose("+experiment=smollm2_joy", *QUICK)], tmp_path)
    assert m["concept_steered"] > m["concept_baseline"] + 1.0, m
    assert m["sentiment_steered"] > m["sentiment_baseline"], m
    assert m["ppl_steered"] <= 2 * m["ppl_baseline"], m
    rows = [json.loads(line) for line in (tmp_path / "0" / "results.jsonl").read_text().splitlines()]
    assert all(r["fed"].startswith("<|im_start|>") for r in rows)  # chat template applied (prompts.chat null)


def test_ablating_the_default_direction_at_any_middle_layer_keeps_the_text(smollm2_spec, tmp_path):
    """No sink blow-up, and no steering by ablation: with the first token left out of the direction's means, ablating
    it at layer 12 no longer turns text into blanks; with the direction made orthogonal to the rows' mean
    (extract.orthogonal_to_mean), ablating it no longer moves every token by that mean's share (at layers 6 and 14,
    |cosine| 0.17-0.18 with it, ablation had pushed the text to gloom, "a storm of the unrelenting fury", and to joy,
    "I'm so excited to share", at 2.20 and 2.40 x the baseline's perplexity). Measured with 3 prompts x 16
    tokens: ppl_steered / ppl_baseline 1.04-1.16 at every layer 6..18 (1.05-2.40 before)."""
    layers = range(6, 19)
    out = _run([compose(*QUICK, "edit=ablate", f"tap.layer={layer}") for layer in layers], tmp_path)
    ratios = {layer: m["ppl_steered"] / m["ppl_baseline"] for layer, m in zip(layers, out)}
    assert all(r <= 2.0 for r in ratios.values()), ratios  # <= 2x perplexity at any single layer 6..18
    # The direction is removed where it is applied (the attention sink left out of the mean keeps it small).
    assert all(m["proj_steered"] < 1e-3 * max(m["proj_baseline"], 1.0) for m in out), out


def test_select_on_a_3x3_grid_picks_a_pair_that_passes(smollm2_spec, tmp_path, caplog):
    import logging

    cfg = compose(*QUICK, "task=select", "select.layers=[3,6,12]", "select.scales=[2,4,16]", "metrics.sentiment=true")
    with caplog.at_level(logging.INFO, logger="steer.tasks.select"):
        summary = registry.main(cfg, tmp_path, Console(file=io.StringIO()))
    said = [r.getMessage() for r in caplog.records if r.name == "steer.tasks.select"]
    assert said[0].startswith("select: 9 pairs") and said[-1].endswith(summary["command"])
    best = summary["best"]
    assert best is not None and best["ppl_ratio"] <= 2.0 and best["gain"] > 0
    assert best["gain"] == max(c["gain"] for c in summary["cells"] if c["ok"])
    assert len(summary["cells"]) == 9 and any(not c["ok"] for c in summary["cells"]), summary["cells"]
    for name in ("selection.md", "selection.json", "selection.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert f"tap.layer={best['layer']}" in summary["command"]
    assert (tmp_path / "layer3_scale2" / "metrics.json").exists()


@pytest.mark.parametrize("override,field", [("select.scales=[]", "select.scales"),
                                            ("select.layers=[]", "select.layers"),
                                            ("select.layers=[40]", "select.layers"),
                                            ("select.layers=[3,3]", "select.layers"),
                                            ("select.scales=[2,2.0]", "select.scales"),
                                            ("edit=rescale", "edit.vector.path")])
def test_select_bad_grid_fails_before_any_engine(smollm2_spec, tmp_path, override, field):
    from steer.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        registry.prepare(compose(*QUICK, "task=select", override), tmp_path)
    assert e.value.field == field
