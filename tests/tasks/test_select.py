"""task=select on the tiny model: a rerun keeps each pair that finished with the same settings and inputs, and runs
the rest (a grid stopped part way loses only the pairs it had not finished)."""

import io
import json
import logging

from rich.console import Console
from safetensors.torch import save_file

from helpers import TWO_PROMPTS, compose
from steer.tasks import registry

GRID = ["task=select", "select.layers=[1,2]", "select.scales=[2,4]", "gen.max_new_tokens=3", TWO_PROMPTS,
        "progress=false"]


def _select(tmp_path, caplog, *overrides):
    with caplog.at_level(logging.INFO, logger="steer.tasks.select"):
        caplog.clear()
        summary = registry.main(compose(*GRID, *overrides), tmp_path / "sel", Console(file=io.StringIO()))
    said = [r.getMessage() for r in caplog.records
            if r.name == "steer.tasks.select" and r.getMessage().startswith("select")]
    return summary, said[0]


def _stamps(tmp_path):
    return {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "sel").glob("*/metrics.json")}


def test_a_rerun_keeps_the_pairs_done_with_the_same_settings_and_inputs(tmp_path, cache_dir, caplog):
    first, said = _select(tmp_path, caplog)
    assert said.endswith("each in its own directory here") and len(_stamps(tmp_path)) == 4
    before = _stamps(tmp_path)

    again, said = _select(tmp_path, caplog)
    assert said.endswith("4 done before with these settings and inputs, kept")
    assert _stamps(tmp_path) == before and again == first

    (tmp_path / "sel" / "layer2_scale4" / "metrics.json").unlink()  # stopped before it finished
    again, said = _select(tmp_path, caplog)
    assert said.endswith("3 done before with these settings and inputs, kept")
    after = _stamps(tmp_path)
    assert after["layer2_scale4"] != before["layer2_scale4"] and again["cells"] == first["cells"]
    assert {k: v for k, v in after.items() if k != "layer2_scale4"} == \
        {k: v for k, v in before.items() if k != "layer2_scale4"}

    _, said = _select(tmp_path, caplog, "select.max_ppl_ratio=3", "select.layers=[1,2,3]")  # cap, grid: not a pair's
    assert said.startswith("select: 6 pairs") and said.endswith("4 done before with these settings and inputs, kept")

    _, said = _select(tmp_path, caplog, "gen.max_new_tokens=4")  # other settings: every pair again
    assert said.endswith("each in its own directory here")


def test_a_pair_whose_vector_file_changed_runs_again(tmp_path, cache_dir, caplog):
    import torch

    vec = tmp_path / "v.safetensors"
    save_file({"direction": torch.ones(256)}, str(vec))
    _select(tmp_path, caplog, f"edit.vector.path={vec}")
    save_file({"direction": -torch.ones(256)}, str(vec))
    _, said = _select(tmp_path, caplog, f"edit.vector.path={vec}")
    assert said.endswith("each in its own directory here")


def test_a_sweep_of_selects_reports_each_ones_best_pair(cli, tmp_path):
    import csv

    res = cli(["-m", "task=select", "edit=add,ablate", "select.layers=[1,2]", "select.scales=[2,4]",
               "gen.max_new_tokens=3", TWO_PROMPTS, "hydra.sweep.dir=sweep"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "sweep" / "summary.csv").open()))
    assert [r["edit"] for r in rows] == ["add", "ablate"] and all(r["pairs"] == "4" for r in rows)
    for r in rows:  # each row is its select's own choice
        best = json.loads((tmp_path / "sweep" / r["job"] / "selection.json").read_text())["best"]
        assert (r["best_layer"], r["best_scale"]) == ((str(best["layer"]), str(best["scale"])) if best else ("", ""))
    assert "0 jobs to run" not in res.stderr + res.stdout
    again = cli(["-m", "task=select", "edit=add,ablate", "select.layers=[1,2]", "select.scales=[2,4]",
                 "gen.max_new_tokens=3", TWO_PROMPTS, "hydra.sweep.dir=sweep"], tmp_path)
    said = again.stderr + again.stdout
    assert again.returncode == 0 and "inputs changed" not in said and said.count("keeping its pairs") == 2, said
    assert said.count("4 done before with these settings and inputs, kept") == 2


def test_the_printed_rerun_command_runs_the_chosen_pair(tmp_path, cli):
    """A select run with its prompts from a config directory of the user's own (--config-dir, here after the
    overrides): the command it prints keeps that directory and the overrides, exits 0 and gives the chosen pair's
    own results. Both commands run in this process: what is checked is the command line, not a new interpreter."""
    import shlex

    mine = tmp_path / "myconf" / "prompts"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text(
        "steer: ['The weather today is', 'My friend looked at me and said']\n"
        "positive: ['I am so happy and full of joy', 'What a wonderful, delightful day']\n"
        "negative: ['I am so sad and full of gloom', 'What a miserable, dreadful day']\n")
    # On the tiny model this direction reads backwards: a negative strength is the one that gains (layer 2, -2)
    res = cli(["prompts=mine", "task=select", "select.layers=[1,2]", "select.scales=[-2,-4]",
               "select.max_ppl_ratio=100", "gen.max_new_tokens=6", "hydra.run.dir=sel",
               "--config-dir", str(tmp_path / "myconf")], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "sel" / "selection.json").read_text())
    best, command = summary["best"], summary["command"]
    assert best and command in (tmp_path / "sel" / "selection.md").read_text(), summary
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "steer"] and args[3:5] == ["--config-dir", str(tmp_path / "myconf")]
    assert "prompts=mine" in args and not any(a.startswith(("select.", "hydra.run")) for a in args), args

    again = cli(args[3:], tmp_path)  # `python -m steer` and then what the command gives it
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = [d for d in (tmp_path / "outputs").glob("*/*") if (d / "results.jsonl").is_file()]
    assert len(rerun) == 1, rerun
    rows = [json.loads(line) for line in (rerun[0] / "results.jsonl").read_text().splitlines()]
    pair = [json.loads(line) for line in (tmp_path / "sel" / best["dir"] / "results.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["baseline_ids"], r["steered_ids"]) for r in rows] == \
        [(r["prompt"], r["baseline_ids"], r["steered_ids"]) for r in pair]
