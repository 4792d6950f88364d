"""Extraction at several layers in one pass, and its diagnostics, against the tiny model's hidden states."""

import pytest
import torch

from steer.config.schema import TapConf
from steer.edits import vector
from steer.edits.tap import resolve
from steer.runs.extract import Recipe, direction, extract, write_layers

POS = ["I am happy and glad", "What a lovely bright day", "We laughed and smiled", "She was delighted"]
NEG = ["I am sad and tired", "What a grim dark day", "We cried and sighed", "She was miserable"]


def test_layers_in_one_pass_match_one_extraction_each(hf_engine, tiny_spec, monkeypatch):
    taps = [resolve(TapConf(layer=k), tiny_spec) for k in (0, 2, 3)]
    calls = []
    real = hf_engine.score_many
    monkeypatch.setattr(hf_engine, "score_many", lambda jobs: calls.append(list(jobs)) or real(jobs))
    found = extract(hf_engine, taps, POS, NEG, Recipe(), folds=2)
    # one forward per prompt, each capturing every tap
    assert [len(c) for c in calls] == [len(POS), len(NEG)]
    assert all(job[3] == tuple(t.path for t in taps) for c in calls for job in c)
    monkeypatch.setattr(hf_engine, "score_many", real)
    for tap, ex in zip(taps, found):
        torch.testing.assert_close(ex.direction, direction(hf_engine, tap, POS, NEG))
        assert ex.diagnostics["folds"] == 2 and 0 <= ex.diagnostics["heldout_auc"] <= 1


def test_resid_norm_is_the_mean_norm_of_the_kept_tokens(hf_engine, tiny_spec):
    tap = resolve(TapConf(layer=2), tiny_spec)
    norms = []
    for p in POS + NEG:
        ids = hf_engine.encode(p)
        with torch.no_grad():
            h = hf_engine.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[3][0]
        norms += h[1:].double().norm(dim=-1).tolist()  # the first token (the BOS) left out, as a mean leaves it
    ex = extract(hf_engine, tap, POS, NEG)
    assert ex.diagnostics["resid_norm"] == pytest.approx(sum(norms) / len(norms), rel=1e-5)
    assert ex.diagnostics["norm_ratio"] == pytest.approx(float(ex.direction.norm()) / ex.diagnostics["resid_norm"])


def test_a_multi_layer_file_holds_each_layer_and_its_diagnostics(hf_engine, tiny_spec, tmp_path):
    layers = [1, 3]
    found = extract(hf_engine, [resolve(TapConf(layer=k), tiny_spec) for k in layers], POS, NEG)
    path = write_layers(tmp_path / "v.safetensors", hf_engine, layers, found, POS, NEG, Recipe())
    meta = vector.metadata(path)
    assert meta["layers"] == "1,3"
    best = max(range(2), key=lambda i: (found[i].diagnostics["heldout_auc"], found[i].diagnostics["heldout_effect"]))
    assert meta["diag.best_layer"] == str(layers[best])
    for k, ex in zip(layers, found):
        torch.testing.assert_close(vector.load(path, f"direction.{k}", tiny_spec.hidden)[0], ex.direction)
        assert float(meta[f"diag.{k}.resid_norm"]) == pytest.approx(ex.diagnostics["resid_norm"], rel=1e-7)
        assert vector.resid_norm(meta, f"direction.{k}") == (pytest.approx(ex.diagnostics["resid_norm"]), f"layer{k}")
