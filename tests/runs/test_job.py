"""A Job: prepare (steer.tasks.registry.prepare) leaves the config it is handed as composed (the job resolves a copy:
prompts read from files, "auto" extraction settings resolved), for every task and for the Lab; the job holds what it
resolved, and nothing rewrites it once prepared."""

import copy
from dataclasses import asdict

import pytest
import torch
from omegaconf import OmegaConf

import steer
from helpers import compose_conf, on_tiny
from steer.edits import vector
from steer.config.schema import Task
from steer.tasks.registry import prepare

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
         "eval": ["task=eval", "tap.layer=2", "eval.scales=[4]"],
         "condition": ["task=condition", "condition.layers=[1,2]", "prompts.condition_positive=[a,b,c]",
                       "prompts.condition_negative=[d,e,f]"]}


def test_every_task_is_checked_here():
    assert set(TASKS) == {t.value for t in Task}


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
    from steer.tasks import registry

    files, _ = _files(tmp_path, tiny_spec)
    seen = []
    real = registry.prepare

    def prepare_(conf, out_dir):
        before = copy.deepcopy(conf)
        job = real(conf, out_dir)
        seen.append((asdict(before), asdict(conf), job.cfg.prompts.steer))
        raise KeyboardInterrupt  # stop before the engine: prepare is what is checked

    monkeypatch.setattr(registry, "prepare", prepare_)
    lab = steer.Lab(model="tiny", overrides=["engine=hf", *files], quiet=True)
    base, config = copy.deepcopy(lab._base), copy.deepcopy(lab.config)
    with pytest.raises(KeyboardInterrupt):
        lab.extract(layer=1)
    assert lab._base == base and asdict(lab.config) == asdict(config)
    [(before, after, steered)] = seen
    assert before == after and steered == ["The weather today is", "My friend said"]


def test_a_prepared_job_cannot_be_rewritten(cache_dir, tiny_spec, tmp_path):
    """Every later step reads the job as prepared: its fields, its sequences and its digests refuse changes, and a
    job made from it (a select's pair given its probe) is a new one."""
    import dataclasses
    import pickle

    files, v = _files(tmp_path, tiny_spec)
    job = prepare(OmegaConf.to_object(compose_conf("config", on_tiny([*TASKS["select"], *files,
                                                                       f"cache_dir={cache_dir}"]))), tmp_path)
    for name, value in (("plan", None), ("taps", ()), ("out_dir", tmp_path / "elsewhere"), ("cfg", job.cfg)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(job, name, value)
    with pytest.raises(AttributeError):
        job.cells.append(job)  # a tuple
    cell = job.cells[0]
    for change in (lambda d: d.update(x="y"), lambda d: d.__setitem__("x", "y"), lambda d: d.pop("x", None)):
        with pytest.raises(TypeError):
            change(cell.data)
        with pytest.raises(TypeError):
            change(cell.vectors)
    assert cell.data and dict(pickle.loads(pickle.dumps(cell)).data) == dict(cell.data)  # still crosses processes
    probed = dataclasses.replace(cell, probe="a probe")
    assert probed.probe == "a probe" and cell.probe is None and probed.settings == cell.settings
