"""task=condition on the tiny model: the chosen layer, comparison and threshold are the best F1 over the grid, as
recomputed here from the prompts' scores it records, and those scores are the model's own (read here directly)."""

import json

import pytest
import torch

from helpers import refused

FOOD = ["Give me a recipe for a tomato soup", "How do I bake a chocolate cake", "Which cheese goes with pasta",
        "What is a good breakfast with eggs", "How long should I roast a chicken", "A bowl of noodles with broth"]
OTHER = ["How do I change a flat tyre", "Explain how a rainbow forms", "What is the capital of Australia",
         "Write a note to my landlord", "How many planets are there", "Give me tips for a job interview"]


def prompts():
    return [f"prompts.condition_positive=[{','.join(json.dumps(p) for p in FOOD)}]",
            f"prompts.condition_negative=[{','.join(json.dumps(p) for p in OTHER)}]"]


def f1(truth, predicted):
    tp = sum(t and p for t, p in zip(truth, predicted))
    fp = sum(p and not t for t, p in zip(truth, predicted))
    fn = sum(t and not p for t, p in zip(truth, predicted))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def test_the_choice_is_the_best_f1_of_the_grid(cli, tmp_path):
    res = cli(["task=condition", "condition.layers=[1,2,3]", "condition.step=0.01", "edit.when.score=cosine",
               *prompts(), "hydra.run.dir=run"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads((tmp_path / "run" / "condition.json").read_text())
    assert (tmp_path / "run" / "condition.png").stat().st_size > 1000
    choice, grid = got["choice"], got["thresholds"]
    n_pos = got["positive"]
    truth = [i < n_pos for i in range(len(got["prompts"]))]
    assert len(got["prompts"]) == 6  # half of each side held out
    best = 0.0
    for d in got["layers"].values():
        for how in ("above", "below"):
            for t in grid:
                pred = [s > t if how == "above" else s < t for s in d["scores"]]
                best = max(best, f1(truth, pred))
    assert choice["f1"] == pytest.approx(best)
    d = got["layers"][str(choice["layer"])]
    pred = [s > choice["threshold"] if choice["compare"] == "above" else s < choice["threshold"]
            for s in d["scores"]]
    assert f1(truth, pred) == pytest.approx(choice["f1"])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["condition.layer"] == choice["layer"]


def test_scores_with_a_vector_file_are_the_models_own(cli, tmp_path, hf_engine, tiny_spec):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    v = torch.randn(tiny_spec.hidden)
    save_file({"direction": v}, str(tmp_path / "c.safetensors"))
    res = cli(["task=condition", "condition.layers=[2]", "edit.when.score=cast", "edit.when.reduce=last",
               "edit.when.vector=c.safetensors", *prompts(), "hydra.run.dir=run"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads((tmp_path / "run" / "condition.json").read_text())
    assert got["prompts"] == FOOD + OTHER  # a file's direction: every prompt is scored
    for p, s in zip(got["prompts"], got["layers"]["2"]["scores"]):
        h = hf_engine.score(hf_engine.encode(p), [], None, ("model.layers.2",)).captured["model.layers.2"][-1]
        t = torch.tanh((h @ v) * v / (v @ v))
        assert s == pytest.approx(float(h @ t / (h.norm() * t.norm())), abs=1e-5)


@pytest.mark.parametrize("args, field", [
    (["condition.layers=[]"], "condition.layers"),
    (["condition.layers=[7]"], "condition.layers"),
    (["condition.split=1"], "condition.split"),
    (["prompts.condition_negative=[]"], "prompts.condition_negative"),
])
def test_a_grid_that_cannot_run_is_one_line_and_exit_2(cli, tmp_path, args, field):
    keys = {a.split("=")[0] for a in args}
    res = cli(["task=condition", *[p for p in prompts() if p.split("=")[0] not in keys], *args, "hydra.run.dir=run"],
              tmp_path)
    refused(res, field)
