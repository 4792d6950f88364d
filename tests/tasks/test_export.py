"""task=export and extract.out=*.gguf: files written for llama.cpp (read back here with the gguf package) and
steer's multi-layer safetensors, and a multi-layer control vector that runs the same after export and re-import."""

import numpy as np
import pytest
import torch

from helpers import cli_here, compose
from steer.config.schema import GenConf, TapConf
from steer.edits import vector
from steer.edits.plan import build
from steer.edits.tap import resolve
from steer.runs.extract import Recipe, direction, extract


def gguf_tensors(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    meta = {k: r.fields[k].contents() for k in ("general.architecture", "controlvector.model_hint")}
    return meta, {t.name: np.array(t.data, dtype=np.float32) for t in r.tensors}


def test_export_sums_scaled_edits_per_layer(tmp_path, cache_dir, tiny_spec, monkeypatch, capsys):
    dirs = {k: torch.randn(256) for k in (1, 2, 3)}
    src = vector.save_layers(tmp_path / "m.safetensors", dirs, model="tiny", tap="", method="manual")
    extra = f"extra_edits=[{{tap: {{layer: 2}}, edit: {{kind: add, scale: 0.5, vector: {{path: '{src}'}}}}}}]"
    for fmt in ("gguf", "safetensors"):
        out = tmp_path / f"out.{fmt}"
        res = cli_here(["task=export", f"export.format={fmt}", f"export.out={out}", f"edit.vector.path={src}",
                        "edit.vector.layers=all", "edit.scale=3", extra], tmp_path, monkeypatch, capsys)
        assert res.returncode == 0, res.stderr[-2000:]
        want = {k: 3 * v + (0.5 * v if k == 2 else 0) for k, v in dirs.items()}
        if fmt == "gguf":
            meta, tensors = gguf_tensors(out)
            assert meta["general.architecture"] == "controlvector" and meta["controlvector.model_hint"] == "llama"
            assert sorted(tensors) == [f"direction.{k}" for k in (1, 2, 3)]
            for k, v in want.items():
                np.testing.assert_allclose(tensors[f"direction.{k}"], v.numpy(), rtol=1e-6)
        else:
            got = vector.load_layers(out, 256)
            assert vector.metadata(out)["layers"] == "1,2,3"
            for k, v in want.items():
                torch.testing.assert_close(got[k][0], v)


@pytest.mark.parametrize("args,message", [
    (["edit=ablate"], "edit.kind: is ablate; a control vector only adds a direction"),
    (["edit.tokens=generated"], "edit.tokens: is generated; llama.cpp adds the direction at every token"),
    (["export.format=onnx"], "export.format: 'onnx' is not one of gguf, safetensors"),
    (["tap.layer=0"], "export.format: gguf: llama.cpp refuses a direction at decoder layer 0"),
])
def test_export_refuses_what_a_control_vector_cannot_hold(tmp_path, cache_dir, monkeypatch, capsys, args, message):
    src = tmp_path / "v.safetensors"
    vector.save(src, {"direction": torch.randn(256)}, model="tiny", tap="layer1", method="manual")
    res = cli_here(["task=export", f"edit.vector.path={src}", *args], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_extract_out_gguf_writes_a_control_vector(tmp_path, cache_dir, hf_engine, monkeypatch, capsys):
    out = tmp_path / "v.gguf"
    res = cli_here(["task=extract", f"extract.out={out}", "tap.layer=2"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    _, tensors = gguf_tensors(out)
    cfg = compose("tap.layer=2")
    want = direction(hf_engine, resolve(TapConf(layer=2), hf_engine.spec), list(cfg.prompts.positive),
                     list(cfg.prompts.negative), Recipe.from_conf(cfg.extract, cfg.prompts.chat))
    assert list(tensors) == ["direction.2"]
    np.testing.assert_allclose(tensors["direction.2"], want.numpy(), rtol=1e-5, atol=1e-6)
    res = cli_here(["task=extract", f"extract.out={tmp_path / 'w.gguf'}", "tap.layer=0"], tmp_path, monkeypatch,
                   capsys)
    assert res.returncode == 2 and "extract.out: ends in .gguf" in res.stderr


def test_smollm2_layers_8_to_16_run_the_same_after_gguf_export_and_reimport(smollm2_engine, tmp_path, cache_dir):
    """Extracted per layer (8..16) and saved in the multi-layer layout; run from that file, then exported to GGUF
    (task=export) and run from the GGUF: the same greedy tokens."""
    from steer.config.schema import Task
    from steer.tasks import export
    from steer.tasks.registry import prepare

    cfg = compose("model=smollm2", tiny=False)
    pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
    recipe = Recipe.from_conf(cfg.extract, cfg.prompts.chat)
    layers = range(8, 17)  # read in one pass of the pairs, each layer's direction as `direction` gives it
    exs = extract(smollm2_engine, [resolve(TapConf(layer=k), smollm2_engine.spec) for k in layers], pos, neg, recipe)
    dirs = {k: ex.direction for k, ex in zip(layers, exs)}
    multi = vector.save_layers(tmp_path / "joy_8_16.safetensors", dirs, model="smollm2",
                                     tap=",".join(f"layer{k}" for k in dirs), method="diffmean")
    common = ["model=smollm2", "edit.vector.layers={from: 8, to: 16}", "edit.scale=1.5"]
    steer_cfg = compose(*common, f"edit.vector.path={multi}", tiny=False)
    plan = build(steer_cfg, smollm2_engine.spec)
    assert list(plan.taps) == [smollm2_engine.spec.layer_path(k) for k in range(8, 17)]
    out = tmp_path / "joy.gguf"
    job = prepare(compose(*common, f"edit.vector.path={multi}", "task=export", f"export.out={out}", tiny=False),
                  tmp_path / "run")
    assert job.cfg.task == Task.export
    export.write(job.cfg, job.plan, job.spec, out)
    again = build(compose("model=smollm2", "edit.vector.layers=all", "edit.scale=1", f"edit.vector.path={out}",
                          tiny=False), smollm2_engine.spec)
    gen = GenConf(max_new_tokens=16)
    ids = smollm2_engine.encode(cfg.prompts.steer[0], "auto")
    single, reimported = smollm2_engine.generate(ids, plan, gen, 0), smollm2_engine.generate(ids, again, gen, 0)
    assert single == reimported
    assert single != smollm2_engine.generate(ids, None, gen, 0)  # the vector steers at all
