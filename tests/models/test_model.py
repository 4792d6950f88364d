import time
from pathlib import Path

import pytest

from steer.models import tiny
from steer.errors import ConfigError
from steer.models.spec import spec
from steer.config.schema import ModelConf, TinyConf


def test_tiny_spec_needs_no_weights(tmp_path):
    s = spec(ModelConf(name="tiny", tiny=TinyConf(num_layers=3, hidden=128, heads=2, kv_heads=2)), str(tmp_path))
    assert (s.layers, s.hidden, s.layers_path) == (3, 128, "model.layers")
    assert "model.layers.2.mlp" in s.modules
    assert not (tmp_path / "models").exists()


def test_unreachable_hub_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="could not read the config of 'nobody/no-such-model'") as e:
        spec(ModelConf(name="nobody/no-such-model", source="hub"), str(tmp_path))
    assert e.value.field == "model.name"


def test_unreachable_hub_fails_fast_with_one_message(tmp_path, monkeypatch, caplog, capfd):
    # The hub blocked deterministically: nothing listens on port 9 (huggingface_hub would retry for 30 s).
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        spec(ModelConf(name="meta-llama/Llama-3.2-1B-Instruct", source="hub"), str(tmp_path))
    assert time.perf_counter() - t0 < 5
    assert e.value.field == "model.name"
    msg = str(e.value)
    assert "does not answer" in msg and "model.source=<local dir>" in msg and "HF_HUB_OFFLINE=1" in msg
    out, err = capfd.readouterr()
    assert "Retrying" not in out + err + caplog.text


def test_cached_hub_model_is_read_from_its_snapshot_when_the_hub_is_unreachable(tiny_spec, tmp_path, monkeypatch):
    import shutil

    snap = tmp_path / "hub" / "models--someone--cached-llama" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    shutil.copy(Path(tiny_spec.source) / "config.json", snap / "config.json")
    (tmp_path / "hub" / "models--someone--cached-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--cached-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for env in ({"HF_ENDPOINT": "http://127.0.0.1:9"}, {"HF_HUB_OFFLINE": "1"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            s = spec(ModelConf(name="someone/cached-llama", source="hub"), str(tmp_path))
        assert s.source == str(snap) and (s.layers, s.hidden) == (tiny_spec.layers, tiny_spec.hidden)


def test_missing_local_directory(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory") as e:
        spec(ModelConf(name="mine", source=str(tmp_path / "nowhere")), str(tmp_path))
    assert e.value.field == "model.source"


def test_bad_dtype(tmp_path):
    with pytest.raises(ConfigError, match="model.dtype"):
        spec(ModelConf(name="tiny", dtype="float8"), str(tmp_path))


def test_tiny_model_is_cached_and_loads_in_transformers(tiny_spec, cache_dir):
    from transformers import AutoConfig, AutoTokenizer

    path = tiny.ensure_tiny(str(cache_dir), TinyConf())
    assert str(path) == tiny_spec.source
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "llama" and cfg.head_dim == 64
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The weather today is")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "The weather today is"


def test_tiny_recipe_is_deterministic():
    from dataclasses import fields, replace

    assert tiny.corpus(3) == tiny.corpus(3) and tiny.corpus(3) != tiny.corpus(4)
    # one directory per recipe: a change to any field of it is a model of its own
    base = TinyConf()
    dirs = {tiny.tiny_dir("/c", replace(base, **{f.name: getattr(base, f.name) + 1})) for f in fields(base)}
    assert len(dirs | {tiny.tiny_dir("/c", base)}) == len(fields(base)) + 1
    assert tiny.tiny_dir("/c", base).parent == Path("/c/models")
