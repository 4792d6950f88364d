"""steer.runs.job.prepare: the config it is handed stays as composed (the job resolves a copy: prompts read from
files, "auto" extraction settings resolved), for every task and for the Lab, and the job holds what it resolved."""

import copy
from dataclasses import asdict

import pytest
import torch
from omegaconf import OmegaConf

import steer
from helpers import compose_conf, on_tiny
from steer.edits import vector
from steer.runs.job import prepare

PAIRS = '{"positive": "I am glad", "negative": "I am sad"}\n{"positive": "What joy", "negative": "What grief"}\n'


def _files(tmp_path, tiny_spec):
    (tmp_path / "steer.txt").write_text("The weather today is\nMy friend said\n")
    (tmp_path / "pairs.jsonl").write_text(PAIRS)
    v = tmp_path / "v.safetensors"
    vector.save(v, {"direction": torch.ones(tiny_spec.hidden)}, model="tiny", tap="layer1", method="diffmean")
    return [f"prompts.steer_file={tmp_path / 'steer.txt'}", f"prompts.pairs_file={tmp_path / 'pairs.jsonl'}"], v


TASKS = {"steer": ["tap=layer1"], "extract": ["task=extract", "tap=layer1"],
         "export": ["task=export", "tap=layer1", "edit.vector.path={v}"],
         "select": ["task=select", "select.layers=[1,2]", "select.scales=[2,4]"],
         "eval": ["task=eval", "tap.layer=2", "eval.scales=[4]"]}


@pytest.mark.parametrize("task", TASKS)
def test_prepare_leaves_the_composed_config_as_it_was(task, cache_dir, tiny_spec, tmp_path):
    files, v = _files(tmp_path, tiny_spec)
    args = [a.format(v=v) for a in TASKS[task]] + (files if task != "eval" else []) + [f"cache_dir={cache_dir}"]
    composed = compose_conf("config", on_tiny(args))
    conf = OmegaConf.to_object(composed)
    before_dict, before = copy.deepcopy(composed), copy.deepcopy(conf)
    job = prepare(conf, tmp_path)
    assert asdict(conf) == asdict(before) and composed == before_dict
    if task != "eval":  # the job's own copy holds what the files say and what "auto" resolves to
        assert job.cfg.prompts.steer == ["The weather today is", "My friend said"]
        assert job.cfg.prompts.positive == ["I am glad", "What joy"] != conf.prompts.positive
    assert conf.extract.position == "auto" and job.cfg.extract.position == job.recipe.position != "auto"
    assert all(c.recipe == job.recipe for c in job.cells)


def test_a_lab_call_leaves_the_labs_config_and_the_calls_as_they_were(cache_dir, tiny_spec, tmp_path, monkeypatch):
    from steer.runs import run

    files, _ = _files(tmp_path, tiny_spec)
    seen = []
    real = run.prepare

    def prepare_(conf, out_dir):
        before = copy.deepcopy(conf)
        job = real(conf, out_dir)
        seen.append((asdict(before), asdict(conf), job.cfg.prompts.steer))
        raise KeyboardInterrupt  # stop before the engine: prepare is what is checked

    monkeypatch.setattr(run, "prepare", prepare_)
    lab = steer.Lab(model="tiny", overrides=["engine=hf", *files], quiet=True)
    base, config = copy.deepcopy(lab._base), copy.deepcopy(lab.config)
    with pytest.raises(KeyboardInterrupt):
        lab.extract(layer=1)
    assert lab._base == base and asdict(lab.config) == asdict(config)
    [(before, after, steered)] = seen
    assert before == after and steered == ["The weather today is", "My friend said"]
