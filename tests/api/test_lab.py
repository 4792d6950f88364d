"""steer.Lab, the Python API, on the tiny model: its results are the CLI's for the same config (same tokens, same
metrics, the same extracted vector), one engine serves every call of a Lab, its run directories are the CLI's
files, and bad input is a ValueError naming the field before any engine starts."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import steer
from helpers import ROOT, compose_conf, run_cli
from steer.errors import ConfigError

SETTINGS = ["engine=hf", "progress=false", "gen.max_new_tokens=8"]
PROMPTS = ["The weather today is", "My friend looked at me and said"]


@pytest.fixture
def loads(monkeypatch):
    """Counts the engines started (steer.engine.make: where weights load)."""
    from steer import engine

    made = []
    real = engine.make

    def make(*a, **kw):
        made.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(engine, "make", make)
    return made


@pytest.fixture
def lab(tiny_spec, loads):  # the tiny model built once in this process, before a command's subprocess needs it
    with steer.Lab(model="tiny", overrides=SETTINGS, quiet=True) as lab:
        yield lab


def test_import_steer_loads_no_torch():
    code = "import sys, steer; steer.add; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_the_lab_writes_what_the_cli_writes(lab, loads, cache_dir, tmp_path):
    """The same extraction and the same steer run through the CLI (subprocesses) and through a Lab: the vector is
    the same tensor, and every per-prompt field (token ids, texts, metrics) and every metric but the speed equal."""
    prompts = "prompts.steer=[" + ",".join(f"'{p}'" for p in PROMPTS) + "]"
    made = tmp_path / "cli.safetensors"
    r = run_cli([*SETTINGS, "task=extract", "tap=layer2", f"extract.out={made}"], tmp_path, cache_dir)
    assert r.returncode == 0, r.stderr
    r = run_cli([*SETTINGS, "tap=layer2", "edit.scale=6", f"edit.vector.path={made}", prompts,
                 "hydra.run.dir=cli_run"], tmp_path, cache_dir)
    assert r.returncode == 0, r.stderr

    v = lab.extract(layer=2)
    with safe_open(str(made), framework="pt") as f:
        assert torch.equal(v.tensor, f.get_tensor("direction"))
    out = lab.generate(PROMPTS, edits=[steer.add(v, layer=2, scale=6)])

    cli_rows = [json.loads(line) for line in (tmp_path / "cli_run" / "results.jsonl").read_text().splitlines()]
    assert out.rows == cli_rows
    cli_metrics = json.loads((tmp_path / "cli_run" / "metrics.json").read_text())
    assert {k: v for k, v in out.metrics.items() if k != "tokens_per_s"} == \
        {k: v for k, v in cli_metrics.items() if k != "tokens_per_s"}
    table = out.table()
    assert list(table["steered"]) == [r["steered"] for r in cli_rows] and len(table) == len(PROMPTS)
    assert out.metrics["concept_steered"] == pytest.approx(table["concept_steered"].mean())
    assert loads == ["hf"]

    saved = out.save(tmp_path / "saved")
    for name in ("results.jsonl", "metrics.json", "inputs.json", "steer.log", ".hydra/config.yaml"):
        assert (saved / name).is_file(), name
    assert (saved / "results.jsonl").read_text() == (tmp_path / "cli_run" / "results.jsonl").read_text()


def test_one_engine_serves_every_call_and_select_agrees_with_a_single_run(lab, loads):
    v = lab.extract(layer=1)
    single = lab.generate(PROMPTS[:1], edits=[steer.add(v, layer=2, scale=4)])
    grid = lab.select(v, layers=[1, 2], scales=[2, 4], prompts=PROMPTS[:1])
    two = lab.generate(PROMPTS[:1], edits=[steer.ablate(v, layer=1), steer.clamp(v, layer=2, lo=-1, hi=1)])
    assert loads == ["hf"] and lab.engine_loads == 1

    table = grid.table()
    assert list(zip(table["layer"], table["scale"])) == [(1, 2.0), (1, 4.0), (2, 2.0), (2, 4.0)]
    # The grid's pair (layer 2, scale 4) ran packed with the others; alone, the same edit gives the same gain (to
    # float32's noise where the edit leaves the text as it was: padded and unpadded rows sum in another order)
    cell = table[(table["layer"] == 2) & (table["scale"] == 4.0)].iloc[0]
    m = single.metrics
    assert cell["gain"] == pytest.approx(m["concept_steered"] - m["concept_baseline"], rel=1e-5, abs=1e-5)
    assert cell["ppl_ratio"] == pytest.approx(m["ppl_steered"] / m["ppl_baseline"], rel=1e-5)
    ok = table[table["ok"]]
    assert grid.best is None if ok.empty else grid.best["gain"] == ok["gain"].max()
    assert grid.pivot().shape == (2, 2) and grid.heatmap.is_file()
    if grid.best:  # the rerun command composes to the best pair's steer run, with the Lab's settings
        args = shlex.split(grid.command)
        cfg = compose_conf("config", args[3:])
        assert args[:3] == ["python", "-m", "steer"] and cfg.model.name == "tiny" and cfg.gen.max_new_tokens == 8
        assert (cfg.tap.layer, cfg.edit.scale) == (grid.best["layer"], grid.best["scale"])
        assert cfg.prompts.steer == PROMPTS[:1] and Path(cfg.edit.vector.path).is_file()
    # Two edits: the first is the run's edit, the second its extra edit, each as given
    assert two.config["edit"]["kind"] == "ablate" and two.config["tap"]["layer"] == 1
    [extra] = two.config["extra_edits"]
    assert extra["edit"]["kind"] == "clamp" and (extra["edit"]["lo"], extra["edit"]["hi"]) == (-1, 1)

    lab.close()
    lab.generate(PROMPTS[:1], edits=[steer.rescale(0.5, layer=1)])  # a closed Lab starts another engine
    assert loads == ["hf", "hf"]


def test_the_hf_engines_settings_are_the_labs_own(lab, loads):
    """hf.* chooses how the HF engine batches, as model, engine, device and vllm.* choose the engine: a Lab takes
    them as it is made, and a call that changes them is refused naming them. Batching changes no token: the rows
    of a Lab batching 4 requests are those of one batching 32."""
    edits = [steer.add(None, layer=1, scale=4)]
    with steer.Lab(model="tiny", overrides=[*SETTINGS, "hf.batch_size=4"], quiet=True) as four:
        got = four.generate(PROMPTS, edits)
        assert four._engine.bound.rows == 4
        with pytest.raises(ConfigError) as e:
            four.generate(PROMPTS, edits, overrides=["hf.batch_size=2"])
    assert e.value.field == "overrides" and "hf.batch_size" in str(e.value), e.value
    assert [r["steered"] for r in got.rows] == [r["steered"] for r in lab.generate(PROMPTS, edits).rows]
    assert loads == ["hf", "hf"]


def test_a_vector_saves_and_loads_with_its_metadata(lab, tmp_path):
    v = lab.extract(layer=1, positive=["I love this, what a joy"], negative=["I hate this, what a misery"])
    path = v.save(tmp_path / "joy.safetensors")
    back = steer.Vector.load(path)
    assert torch.equal(back.tensor, v.tensor)
    assert back.metadata["tap"] == "layer1" and back.metadata["positive"] == "1" and back.layer == 1
    assert back.diagnostics["norm"] == pytest.approx(float(torch.linalg.vector_norm(v.tensor.double())))
    # A vector stored with diagnostics (diag.* keys) exposes them as numbers
    meta = {**v.metadata, "diag.heldout_accuracy": "0.75"}
    assert steer.Vector(v.tensor, meta).diagnostics["heldout_accuracy"] == 0.75


def test_a_vectors_diagnostics_come_in_extractions_order_whatever_order_its_file_gives():
    meta = {"diag.folds": "3", "diag.12.norm_ratio": "0.1", "diag.heldout_auc": "1", "diag.9.norm": "2",
            "diag.norm": "2", "diag.best_layer": "12", "diag.resid_norm": "40", "diag.9.heldout_acc": "0.5"}
    assert list(steer.Vector(torch.ones(4), meta).diagnostics) == [
        "norm", "resid_norm", "heldout_auc", "folds", "best_layer", "9.norm", "9.heldout_acc", "12.norm_ratio"]


def test_a_tensor_steers_as_its_vector_does_and_a_bad_one_is_refused_before_it_is_a_file(lab, tiny_spec, loads):
    t = torch.randn(tiny_spec.hidden, generator=torch.Generator().manual_seed(0))
    as_tensor = lab.generate(PROMPTS, [steer.add(t, layer=1, scale=8)])
    as_vector = lab.generate(PROMPTS, [steer.add(steer.Vector(t), layer=1, scale=8)])
    assert [r["steered"] for r in as_tensor.rows] == [r["steered"] for r in as_vector.rows]
    assert [r["steered"] for r in as_tensor.rows] != [r["baseline"] for r in as_tensor.rows]
    kept = Path(lab.config.cache_dir) / "vectors" / "lab"
    files = sorted(kept.iterdir())
    for bad, says in ((torch.full((tiny_spec.hidden,), float("nan")), "NaN"), (torch.zeros(tiny_spec.hidden), "zeros"),
                      (torch.ones(3, 2, tiny_spec.hidden), "3 dimensions"), (torch.ones(7), "does not fit")):
        with pytest.raises(ConfigError) as e:
            lab.generate(PROMPTS, [steer.add(bad.numpy(), layer=1)])
        assert e.value.field == "edit.vector" and says in str(e.value) and "safetensors" not in str(e.value)
    assert sorted(kept.iterdir()) == files  # none of them written
    assert len(loads) == 1


def _wrong_size():
    return steer.Vector(torch.ones(7))


BAD = [
    (lambda lab: lab.generate(PROMPTS, [steer.add(None, layer=99)]), "tap.layer"),
    (lambda lab: lab.generate(PROMPTS, [steer.add(None, layer=1, tokens="sideways")]), "edit.tokens"),
    (lambda lab: lab.generate([1, 2], [steer.add(None, layer=1)]), "prompts.steer"),
    (lambda lab: lab.generate([], [steer.add(None, layer=1)]), "prompts.steer"),
    (lambda lab: lab.generate(PROMPTS, []), "edits"),
    (lambda lab: lab.generate(PROMPTS, [steer.add(_wrong_size(), layer=1)]), "edit.vector"),
    (lambda lab: lab.generate(PROMPTS, [steer.add(None, layer=1), steer.clamp(None, layer=7)]),
     "extra_edits[0].tap.layer"),
    (lambda lab: lab.generate(PROMPTS, [steer.add("missing.safetensors", layer=1)]), "edit.vector.path"),
    (lambda lab: lab.extract(positive=[], layer=1), "prompts.positive"),
    (lambda lab: lab.select(None, layers=[1, 9], scales=[2]), "select.layers"),
    (lambda lab: lab.generate(PROMPTS, [steer.add(None, layer=1)], overrides=["gen.max_new_tokens=0"]),
     "gen.max_new_tokens"),
    (lambda lab: lab.generate(PROMPTS, [steer.add(None, layer=1)], overrides=["model=smollm2"]), "overrides"),
]


@pytest.mark.parametrize("call,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_a_value_error_naming_the_field_before_any_engine(lab, loads, call, field):
    with pytest.raises(ValueError) as e:
        call(lab)
    assert isinstance(e.value, ConfigError) and e.value.field.startswith(field), e.value
    assert loads == []


@pytest.mark.parametrize("kw,field", [({"overrides": ["gen.max_new_tokens=-1"]}, "gen.max_new_tokens"),
                                      ({"model": "nope"}, "overrides"),
                                      ({"overrides": ["edit.scael=2"]}, "overrides"),
                                      ({"overrides": ["hf.batch_size=0"]}, "hf.batch_size"),
                                      ({"overrides": "engine=hf"}, "overrides")])
def test_a_bad_lab_config_fails_as_the_lab_is_made(cache_dir, loads, kw, field):
    with pytest.raises(ValueError) as e:
        steer.Lab(**{"model": "tiny", **kw})
    assert isinstance(e.value, ConfigError) and e.value.field == field, e.value
    assert loads == []


def test_a_config_dir_of_ones_own_adds_groups_as_config_dir_does(cache_dir, tmp_path, loads):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "calm.yaml").write_text("steer: ['Tell me about your weekend.']\n"
                                                    "positive: ['calm and quiet']\nnegative: ['loud and rushed']\n")
    lab = steer.Lab(model="tiny", overrides=["prompts=calm"], config_dir=tmp_path)
    assert lab.config.prompts.steer == ["Tell me about your weekend."]
    assert lab.config.prompts.positive == ["calm and quiet"] and loads == []
    with pytest.raises(ValueError) as e:
        steer.Lab(model="tiny", config_dir=tmp_path / "none")
    assert e.value.field == "config_dir"


def test_a_group_that_names_only_files_is_read_as_the_cli_reads_it(cache_dir, tmp_path, loads):
    """A prompts group of files alone (steer_file, pairs_file): the Lab's own checks once refused its empty lists."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "steer.txt").write_text("Dear Sir or Madam,\nKind regards,\n")
    (tmp_path / "pairs.jsonl").write_text('{"positive": "I would be grateful", "negative": "gimme"}\n'
                                          '{"positive": "Yours faithfully", "negative": "cya"}\n')
    (tmp_path / "prompts" / "formal.yaml").write_text(f"steer_file: {tmp_path / 'steer.txt'}\n"
                                                      f"pairs_file: {tmp_path / 'pairs.jsonl'}\n")
    with steer.Lab(model="tiny", overrides=["prompts=formal", *SETTINGS], config_dir=tmp_path, quiet=True) as lab:
        v = lab.extract(layer=1)
    assert v.metadata["positive"] == "2" and v.metadata["negative"] == "2"


def test_a_vllm_lab_refuses_a_tap_its_engine_did_not_start_with(lab, loads, monkeypatch):
    """vLLM fixes its taps as it starts (its graphs are recorded with them): a later call elsewhere is refused by
    name before it reaches the engine, not left to fail inside it. A stand-in for a started vLLM engine holds layer
    1's tap; the HF engine, which serves any tap, is not asked."""
    from types import SimpleNamespace

    from steer.runs import job

    monkeypatch.setattr(job, "engine_key", lambda j: "the lab's")
    lab._engine, lab._engine_key = SimpleNamespace(name="vllm", taps={"model.layers.1": None}), "the lab's"
    with pytest.raises(ConfigError) as e:
        lab.generate(PROMPTS, [steer.add(None, layer=2)])
    assert e.value.field == "tap" and "layer2" in str(e.value), e.value
    assert loads == []


def test_a_calls_edit_overrides_refine_the_edit_it_builds(lab):
    """`overrides=["edit.scale_by=resid"]` reaches the run: the edit's other fields come from its kind's defaults,
    which must not replace what the call asked for (select's grid on the residual's scale needs it)."""
    got = lab.generate(PROMPTS, [steer.add(None, layer=1, scale=0.5)], overrides=["edit.scale_by=resid"])
    assert got.config["edit"]["scale_by"] == "resid" and got.config["edit"]["scale"] == 0.5
    plain = lab.generate(PROMPTS, [steer.add(None, layer=1, scale=0.5)])
    assert plain.config["edit"]["scale_by"] != "resid"
    assert [r["steered"] for r in got.rows] != [r["steered"] for r in plain.rows]


@pytest.mark.parametrize("overrides,key,says", [
    (["extract.method=pcx"], "extract.method", "'pcx' is not one of diffmean, pca"),
    (["serve_x=1"], "serve_x", "is not a setting"),
    (["edit.kind=scale"], "edit.kind", "did you mean 'rescale'"),
    (["edit=scale"], "edit", "did you mean edit=rescale"),
    (["eval.sentiment=true"], "eval.sentiment", "did you mean metrics.sentiment"),
    (["model.tiny.layers=2"], "model.tiny.layers", "did you mean model.tiny.num_layers")])
def test_a_value_outside_its_choices_or_an_old_name_is_one_line_naming_the_key(cache_dir, loads, overrides, key,
                                                                               says):
    with pytest.raises(ConfigError) as e:
        steer.Lab(model="tiny", overrides=overrides)
    assert f"{key}: " in str(e.value) and says in str(e.value) and "\n" not in str(e.value), e.value
    assert loads == []


def test_a_calls_value_outside_its_choices_names_the_key_and_the_choices(lab, loads):
    with pytest.raises(ConfigError) as e:
        lab.generate(PROMPTS, [steer.add(None, layer=1)], overrides=["edit.scale_by=raw"])
    assert "edit.scale_by: 'raw' is not one of vector, unit, resid" in str(e.value)
    with pytest.raises(ConfigError) as e:
        lab.generate(PROMPTS, [steer.add(None, layer=1, tokens="sideways")])
    assert e.value.field == "edit.tokens" and "is not one of both, prompt, generated" in str(e.value)
    assert loads == []


@pytest.mark.parametrize("old,new", [("scale", "rescale"), ("set", "set_projection")])
def test_a_renamed_api_name_says_its_new_one(old, new):
    with pytest.raises(AttributeError, match=f"did you mean steer.{new}"):
        getattr(steer, old)
    assert getattr(steer, new).__name__ == new and new in steer.__all__ and old not in dir(steer)
