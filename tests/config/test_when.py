"""`edit.when` that cannot run is one line naming the field, exit 2, before any engine."""

import pytest

from helpers import cli_here, refused


@pytest.mark.parametrize("args, field, says", [
    (["edit.when.layer=1"], "edit.when.vector", "has no direction"),
    (["edit.when.layer=1", "prompts.condition_positive=[a]"], "edit.when.vector", "has no direction"),
    (["edit.when.layer=1", "edit.when.vector=c.safetensors", "edit.when.threshold=1.5"], "edit.when.threshold",
     "[-1, 1]"),
    (["edit.when.layer=1", "edit.when.vector=c.safetensors", "edit.when.compare=abov"], "edit.when.compare",
     "not one of above, below"),
    (["edit.when.layer=1", "edit.when.vector=c.safetensors", "edit.when.reduce=max"], "edit.when.reduce",
     "not one of mean, last"),
    (["edit.when.layer=1", "edit.when.vector=c.safetensors", "edit.when.score=dot"], "edit.when.score",
     "not one of cast, cosine"),
    (["edit.when.vector=c.safetensors"], "edit.when.layer", "is unset"),
    (["edit.when.layer=1", "edit.when.vector=missing.safetensors"], "edit.when.vector", "does not exist"),
    (["edit.when.layer=9", "edit.when.vector=c.safetensors"], "edit.when.layer", "out of range"),
    (["extra_edits=[{tap: {layer: 2}, edit: {kind: add, when: {layer: 1, threshold: -2}}}]"],
     "extra_edits[0].edit.when.threshold", "[-1, 1]"),
])
def test_a_condition_that_cannot_run_is_one_line_and_exit_2(args, field, says, tmp_path, cache_dir, monkeypatch,
                                                           capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"direction": torch.ones(256)}, str(tmp_path / "c.safetensors"))
    res = cli_here([*args, "hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    refused(res, field, says)
    assert not (tmp_path / "run" / "results.jsonl").exists()


def preset_with(**when):
    from steer.config.schema import EditConf, PresetConf, TapConf, TapEditConf, WhenConf

    return {"food": PresetConf(edits=[TapEditConf(TapConf(layer=1), EditConf(when=WhenConf(**when)))])}


def test_a_presets_condition_names_its_file_on_both_engines():
    from steer.config import checks
    from steer.errors import ConfigError

    checks.preset_edits(preset_with(layer=1, vector="c.safetensors"), "hf")
    with pytest.raises(ConfigError) as e:
        checks.preset_edits(preset_with(layer=1), "hf")
    assert e.value.field == "preset food: edits[0].edit.when.vector"
    assert "a preset's condition names its file" in str(e.value)
    checks.preset_edits(preset_with(layer=1, vector="c.safetensors"), "vllm")
