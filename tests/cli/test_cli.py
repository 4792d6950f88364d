"""`python -m steer` end to end on the tiny model, as a user runs it: in a subprocess where the process itself is what
a test checks (its exit, its stderr from interpreter start), else in this process (the `cli` fixture)."""

import csv
import json

import pytest
import torch
from safetensors.torch import save_file

from helpers import cli_here, run_cli


def run_dirs(cwd):
    return sorted(p.parent for p in (cwd / "outputs").rglob(".hydra") if p.is_dir())


def ok(res):
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_default_run(tmp_path, cache_dir):
    """The default run's outputs, their modes under the umask, and the log saying what ran."""
    import os
    import stat

    env_umask = os.umask(0o022)
    try:
        res = run_cli([], tmp_path, cache_dir)
    finally:
        os.umask(env_umask)
    ok(res)
    assert "Loading weights" not in res.stderr + res.stdout  # progress=false: transformers' bar too
    [d] = run_dirs(tmp_path)
    for name in ("results.jsonl", "metrics.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o644, name
    log = (d / "steer.log").read_text()
    assert "edits: layer1 add scale=4" in log and "wrote results.jsonl and metrics.json" in log
    said = next(line for line in res.stderr.splitlines() if line.startswith("default direction at layer1: norm "))
    assert said in log and "held-out AUC" in said  # how good the direction it extracted is
    rows = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {"prompt", "baseline", "steered", "kl", "tokens_changed"} <= set(rows[0])
    m = json.loads((d / "metrics.json").read_text())
    assert set(m) >= {"kl_mean", "tokens_changed_frac", "proj_baseline", "proj_steered", "tokens_per_s"}
    assert m["kl_mean"] > 0 and m["proj_steered"] > m["proj_baseline"]  # add 4 * joy raises the projection
    assert (d / ".hydra" / "config.yaml").exists() and (d / "steer.log").exists()


def test_ablate_removes_the_direction(cli, tmp_path):
    ok(cli(["model=tiny", "tap=layer1", "edit=ablate"], tmp_path))
    [d] = run_dirs(tmp_path)
    m = json.loads((d / "metrics.json").read_text())
    assert m["proj_steered"] <= 1e-3 * m["proj_baseline"]


def test_multirun_scale_zero_is_baseline(cli, tmp_path):
    res = ok(cli(["-m", "edit=add", "edit.scale=0,4"], tmp_path))
    [summary] = list((tmp_path / "outputs").rglob("summary.csv"))
    rows = list(csv.DictReader(summary.open()))
    assert [r["edit.scale"] for r in rows] == ["0", "4"]
    assert float(rows[0]["kl_mean"]) == 0.0 and float(rows[0]["tokens_changed_frac"]) == 0.0
    assert float(rows[1]["kl_mean"]) > 1e-4  # adding 4 x joy moves the next-token distributions
    zero, four = ([json.loads(line) for line in (summary.parent / job / "results.jsonl").read_text().splitlines()]
                  for job in ("0", "1"))
    assert all(r["steered"] == r["baseline"] for r in zero)
    # the summary's changed-token fraction is the jobs' own count (whether 4 x joy moves a greedy token of the tiny
    # model, trained where the tests run, differs between CPUs)
    changed = sum(sum(a != b for a, b in zip(r["baseline_ids"], r["steered_ids"])) +
                  abs(len(r["baseline_ids"]) - len(r["steered_ids"])) for r in four)
    positions = sum(max(len(r["baseline_ids"]), len(r["steered_ids"])) for r in four)
    assert float(rows[1]["tokens_changed_frac"]) == pytest.approx(changed / positions)
    assert "summary:" in res.stdout


def test_extract_then_steer_with_the_file(cli, tmp_path):
    out = tmp_path / "joy.safetensors"
    ok(cli(["task=extract", "tap=layer2", f"extract.out={out}", "extract.key=joy"], tmp_path))
    ok(cli(["edit=ablate", "tap=layer2", f"edit.vector.path={out}", "edit.vector.key=joy",
            "edit.tokens=generated", "gen.max_new_tokens=4"], tmp_path))
    records = [json.loads(p.read_text()) for p in (tmp_path / "outputs").rglob("metrics.json")]
    [extracted] = [r for r in records if "vector" in r]  # the extraction's record: where it wrote what
    [m] = [r for r in records if "vector" not in r]
    diag = {k for k in extracted if k.startswith("diag.")}  # the direction's diagnostics (tests/runs/test_diagnostics)
    assert {k: v for k, v in extracted.items() if k not in diag} == {"vector": str(out), "key": "joy", "tap": "layer2"}
    assert {"diag.norm", "diag.resid_norm", "diag.heldout_auc"} <= diag
    assert m["proj_steered"] <= 1e-3 * m["proj_baseline"]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vectors")
    save_file({"direction": torch.randn(128)}, str(d / "small.safetensors"))
    v = torch.randn(256)
    v[7] = float("nan")
    save_file({"direction": v}, str(d / "nan.safetensors"))
    save_file({"a": torch.randn(256), "b": torch.randn(256)}, str(d / "ab.safetensors"))
    save_file({"direction": torch.zeros(256)}, str(d / "zero.safetensors"))
    return d


BAD = [
    (["edit.vector.path={d}/missing.safetensors"], "edit.vector.path: vector file"),
    (["edit.vector.path={d}/ab.safetensors", "edit.vector.key=c"], "keys present: ['a', 'b']"),
    (["edit.vector.path={d}/small.safetensors"], "the model's hidden size is 256, the vector's last dimension 128"),
    (["edit.vector.path={d}/nan.safetensors"], "entries are 1 NaN"),
    (["edit.vector.path={d}/zero.safetensors"], "the vector is all zeros"),
    (["edit=rescale", "edit.vector.path={d}/zero.safetensors"], "the vector is all zeros"),
    (["tap.layer=12"], "tap.layer: layer 12 is out of range: tiny has 4 decoder layers"),
    (["tap.path=model.layers.1.mpl"], "tap.path: 'model.layers.1.mpl' names no module"),
    (["edit.kind=steer"], "edit.kind: 'steer' is not one of add, ablate, clamp, set, rescale"),
    (["edit.scale=big"], "Value 'big' of type 'str' could not be converted to Float"),
    (["edit.scale=nan"], "edit.scale: must be a finite number, got nan"),
    (["edit=clamp", "edit.lo=-inf", "edit.hi=2"], "edit.lo: must be a finite number, got -inf"),
    (["engine=nope"], "engine: 'nope' is not one of auto, hf, vllm"),
    (["extract.method=pcx"], "extract.method: 'pcx' is not one of diffmean, pca"),
    (["prompts.chat=maybe"], "prompts.chat: 'maybe' is not one of true, false, null"),
    (["edit.kind=scale"], "edit.kind: 'scale' was renamed; did you mean 'rescale'?"),
    (["edit=scale"], "edit: 'scale' was renamed; did you mean edit=rescale?"),
    (["model.tiny.layers=2"], "model.tiny.layers: was renamed; did you mean model.tiny.num_layers?"),
    (["eval.sentiment=true"], "eval.sentiment: was renamed; did you mean metrics.sentiment?"),
    (["prompts.chat=auto"], "prompts.chat: 'auto' was renamed; did you mean null?"),
    (["task=extract", "extract.layers=[1,7]"], "extract.layers: [7] out of range: the model has 4 decoder layers"),
    (["edit.scale_by=raw"], "edit.scale_by: 'raw' is not one of vector, unit, resid"),
    (["edit.scale_by=resid", "edit.vector.path={d}/ab.safetensors", "edit.vector.key=a"],
     "edit.scale_by: resid multiplies the unit direction by the mean residual norm"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[a[0].split("=")[0] + str(i) for i, (a, _) in enumerate(BAD)])
def test_bad_input_fails_fast_and_leaves_no_results(tmp_path, cache_dir, bad_files, args, message, monkeypatch,
                                                    capsys):
    # in this process: the command's own path to its config error, without a subprocess's imports (bad input goes
    # through a subprocess in test_hydra_config_errors_exit_2_in_one_line)
    res = cli_here([a.format(d=bad_files) for a in args], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert message in res.stderr + res.stdout
    assert "Loading weights" not in res.stderr  # failed before any model loaded
    assert not list(tmp_path.rglob("results.jsonl")) and not list(tmp_path.rglob("metrics.json"))
    if "-m" not in args:  # nothing at all: the run's directory went with the parents made for it
        assert not (tmp_path / "outputs").exists()


def test_a_malformed_yaml_config_is_one_line_naming_file_line_and_column(tmp_path, cache_dir):
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "broken.yaml").write_text("# @package _global_\nedit:\n  scale: [1, 2\n  kind: add\n")
    res = run_cli([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=broken"], tmp_path, cache_dir)
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert f"{conf / 'broken.yaml'}:4:7: invalid YAML" in line


SCAL = "edit.scal: is not a setting of this config; did you mean edit.scale? the settings there are: hi, kind,"


@pytest.mark.parametrize("args,says", [(["edit.scal=3"], SCAL),  # not Hydra's advice to add it with `+`
                                       (["edit=nope"], "Could not find 'edit/nope'"),
                                       (["edit.scale=[1"], "no viable alternative at input '[1'"),
                                       (["-m", "edit.scale=range(0,4,0)"], "range() arg 3 must not be zero"),
                                       (["+edit.scal=3"], SCAL),  # added to the typed node, then refused
                                       (["gen.max_new_tokns=3"], "gen.max_new_tokns: is not a setting of this "
                                                                 "config; did you mean gen.max_new_tokens?"),
                                       (["edit.kind=scale"], "edit.kind: 'scale' was renamed; did you mean 'rescale'"),
                                       (["extract.span=some"], "extract.span: 'some' is not one of auto, user, all")])
def test_hydra_config_errors_exit_2_in_one_line(cli, tmp_path, args, says):
    res = cli(args, tmp_path)
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert says in line and "$VALUE" not in line


@pytest.mark.parametrize("group,name,text,says", [
    ("prompts", "calm", "postive: [calm]\nnegative: [rush]\n",
     "error prompts/calm: prompts.postive: is not a setting of this config; did you mean prompts.positive?"),
    ("edit", "half", "kind: scale\nscale: 0.5\n",
     "error edit/half: edit.kind: 'scale' was renamed; did you mean 'rescale'?"),
], ids=["misspelt key", "old spelling"])
def test_a_bad_key_in_a_config_file_of_ones_own_names_the_file_and_the_right_one(cli, tmp_path, group, name, text,
                                                                                  says):
    (tmp_path / "my_conf" / group).mkdir(parents=True)
    (tmp_path / "my_conf" / group / f"{name}.yaml").write_text(text)
    res = cli(["--config-dir", str(tmp_path / "my_conf"), f"{group}={name}"], tmp_path)
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert line.startswith(says)


def test_a_second_run_into_a_held_run_dir_refuses(cli, tmp_path):
    import subprocess
    import sys

    from helpers import started

    run_dir = tmp_path / "held"
    run_dir.mkdir()
    # Stand in for a first run holding the directory: the same lock, from another process.
    with started([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                  "from steer.runs.rundir import hold; hold(Path(sys.argv[1])); print('held', flush=True); "
                  "time.sleep(600)", str(run_dir)], stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline().strip() == "held"
        res = cli([f"hydra.run.dir={run_dir}"], tmp_path)
    assert res.returncode == 2 and f"'{run_dir}' is in use by another steer run" in res.stderr
    assert not (run_dir / ".hydra").exists() and not (run_dir / "metrics.json").exists()


def test_bad_input_leaves_no_directory_it_made_and_says_why_in_one_that_was_there(cli, tmp_path):
    res = cli(["gen.max_new_tokens=0", "hydra.run.dir=outputs/day/run"], tmp_path)
    assert res.returncode == 2 and "gen.max_new_tokens: must be at least 1" in res.stderr
    assert not (tmp_path / "outputs").exists()  # the run's directory and the parents made for it
    (tmp_path / "run").mkdir()
    res = cli(["gen.max_new_tokens=0", "hydra.run.dir=run"], tmp_path)
    assert res.returncode == 2
    assert "gen.max_new_tokens: must be at least 1" in (tmp_path / "run" / "error.txt").read_text()
    assert "gen.max_new_tokens: must be at least 1" in (tmp_path / "run" / "steer.log").read_text()


def test_flags_after_the_overrides_are_taken_as_before_them(tmp_path, cache_dir, monkeypatch, capsys):
    # Hydra's parser alone reads an override after a flag as "unrecognized arguments"
    (tmp_path / "mine" / "prompts").mkdir(parents=True)
    (tmp_path / "mine" / "prompts" / "calm.yaml").write_text(
        "steer: ['Tell me about your weekend.']\npositive: ['calm and steady']\nnegative: ['rushed and tense']\n")
    res = cli_here(["prompts=calm", "--config-dir", str(tmp_path / "mine"), "--cfg", "job", "gen.max_new_tokens=5"],
                   tmp_path, monkeypatch, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Tell me about your weekend." in res.stdout and "max_new_tokens: 5" in res.stdout, res.stdout[-2000:]
