import pytest

from steer.errors import ConfigError
from steer.schema import TapConf
from steer.tap import resolve


def test_layer_tap(tiny_spec):
    t = resolve(TapConf(layer=3), tiny_spec)
    assert (t.name, t.path, t.residual) == ("layer3", "model.layers.3", True)


def test_layer_out_of_range_names_layer_count(tiny_spec):
    with pytest.raises(ConfigError, match="layer 4 is out of range: tiny has 4 decoder layers") as e:
        resolve(TapConf(layer=4), tiny_spec)
    assert e.value.field == "tap.layer"
    with pytest.raises(ConfigError, match="out of range"):
        resolve(TapConf(layer=-1), tiny_spec)


def test_path_tap(tiny_spec):
    t = resolve(TapConf(path="model.layers.1.mlp"), tiny_spec)
    assert (t.path, t.residual) == ("model.layers.1.mlp", False)
    assert resolve(TapConf(path="model.layers.2"), tiny_spec).residual  # a layer named by path is a layer tap


def test_path_wins_over_layer(tiny_spec):
    assert resolve(TapConf(layer=1, path="model.layers.2.mlp"), tiny_spec).path == "model.layers.2.mlp"


def test_path_naming_no_module(tiny_spec):
    with pytest.raises(ConfigError, match="'model.layers.1.mpl' names no module of tiny") as e:
        resolve(TapConf(path="model.layers.1.mpl"), tiny_spec)
    assert e.value.field == "tap.path" and "model.layers.1.mlp" in str(e.value)


def test_empty_tap(tiny_spec):
    with pytest.raises(ConfigError, match="names no location"):
        resolve(TapConf(), tiny_spec)
