"""`python -m steer preset=NAME`: the preset's edits for the model run as tap, edit and extra_edits, as the same
edits written out in the config run; a preset beside a tap or edit of the command line, or for another task, is
refused before any engine."""

import io
import json

import pytest
from rich.console import Console

from helpers import TWO_PROMPTS, cli_here, compose
from steer.config.schema import EditKind, TapConf, TapEditConf, EditConf, Tokens


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_preset_runs_as_its_edits_written_out(cli, tmp_path):
    from steer.tasks import registry

    res = cli(["preset=joy_two_taps", "gen.max_new_tokens=4", TWO_PROMPTS, "hydra.run.dir=preset"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # conf/preset/joy_two_taps.yaml's edits on the tiny model, written out by hand
    cfg = compose("gen.max_new_tokens=4", TWO_PROMPTS, "progress=false")
    cfg.tap, cfg.edit = TapConf(layer=1), EditConf(kind=EditKind.add, scale=6.0)
    cfg.extra_edits = [TapEditConf(TapConf(layer=2), EditConf(kind=EditKind.clamp, scale=1.0, lo=-40.0, hi=40.0,
                                                              tokens=Tokens.generated))]
    (tmp_path / "written").mkdir()
    registry.main(cfg, tmp_path / "written", Console(file=io.StringIO()))
    got, want = _rows(tmp_path / "preset" / "results.jsonl"), _rows(tmp_path / "written" / "results.jsonl")
    keys = ("prompt", "baseline_ids", "steered_ids", "kl", "concept_steered")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    assert got[0]["steered_ids"] != got[0]["baseline_ids"] or got[1]["steered_ids"] != got[1]["baseline_ids"]


def test_a_preset_takes_the_edits_it_gives_the_model():
    from steer.config import preset

    smol = preset.apply(compose("preset=joy", tiny=False), ["preset"])
    tiny = preset.apply(compose("preset=joy"), ["preset", "model"])
    assert (smol.tap.layer, smol.edit.scale, smol.extra_edits) == (12, 4.0, [])  # its `models.smollm2` entry
    assert (tiny.tap.layer, tiny.edit.scale, tiny.extra_edits) == (1, 4.0, [])  # its `edits`


@pytest.mark.parametrize("args, says", [
    (["preset=joy", "edit.scale=2"], "error edit.scale: is set beside preset"),
    (["preset=joy", "tap=layer2"], "error tap: is set beside preset"),
    (["preset=joy", "task=select"], "error preset: runs the preset's edits as task=steer, not task=select"),
    (["preset=cheerful"], "error "),
])
def test_a_preset_the_run_cannot_take_is_one_line_and_exit_2(args, says, tmp_path, cache_dir, monkeypatch, capsys):
    res = cli_here([*args, "model=tiny", "hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith(says), res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "run" / "results.jsonl").exists()
