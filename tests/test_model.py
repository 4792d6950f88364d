import pytest

from steer import tiny
from steer.errors import ConfigError
from steer.model import spec
from steer.schema import ModelConf, TinyConf


def test_tiny_spec_needs_no_weights(tmp_path):
    s = spec(ModelConf(name="tiny", tiny=TinyConf(layers=3, hidden=128, heads=2, kv_heads=2)), str(tmp_path))
    assert (s.layers, s.hidden, s.layers_path) == (3, 128, "model.layers")
    assert "model.layers.2.mlp" in s.modules
    assert not (tmp_path / "models").exists()


def test_unreachable_hub_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="could not read the config of 'nobody/no-such-model'") as e:
        spec(ModelConf(name="nobody/no-such-model", source="hub"), str(tmp_path))
    assert e.value.field == "model.name"


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
    assert tiny.corpus(3) == tiny.corpus(3) and tiny.corpus(3) != tiny.corpus(4)
    assert tiny.tiny_dir("/c", TinyConf()) == tiny.tiny_dir("/c", TinyConf())
    assert tiny.tiny_dir("/c", TinyConf()) != tiny.tiny_dir("/c", TinyConf(seed=1))
