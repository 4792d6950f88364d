import pytest

from steer.errors import ConfigError
from steer.config.schema import TapConf
from steer.edits.tap import resolve


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
    assert e.value.field == "tap.path" and "modules under model.layers.1: [" in str(e.value)
    assert "'model.layers.1.mlp'" in str(e.value) and "'model.layers.1.mlp.up_proj'" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # a layer out of range says the range, not a list of modules
        resolve(TapConf(path=f"model.layers.{tiny_spec.layers}.mlp"), tiny_spec)
    assert str(e.value).endswith(f"has {tiny_spec.layers} (0..{tiny_spec.layers - 1}) under model.layers")
    with pytest.raises(ConfigError, match="top-level modules: \\['lm_head', 'model'\\]"):
        resolve(TapConf(path="nothing"), tiny_spec)


def test_empty_tap(tiny_spec):
    with pytest.raises(ConfigError, match="names no location"):
        resolve(TapConf(), tiny_spec)


@pytest.mark.parametrize("path,says", [
    ("model.layers", "is a ModuleList, never called in a forward pass, with no rows of its own to edit"),
    ("model", "is a BaseModelOutputWithPast, with no rows of its own to edit"),
    ("lm_head", "outputs rows of 512 values, and an edit changes rows of the model's hidden size (256)"),
    ("model.layers.1.mlp.gate_proj", "outputs rows of 512 values"),
    ("model.rotary_emb", "outputs rows of 64 values")])
def test_a_path_whose_output_is_no_hidden_wide_tensor_is_refused_before_any_weights(tiny_spec, path, says):
    with pytest.raises(ConfigError) as e:
        resolve(TapConf(path=path), tiny_spec)
    assert e.value.field == "tap.path" and says in str(e.value)


@pytest.mark.parametrize("path", ["model.layers.1.mlp", "model.layers.1.self_attn", "model.layers.1.self_attn.o_proj",
                                  "model.layers.1.mlp.down_proj", "model.layers.1.input_layernorm", "model.norm",
                                  "model.embed_tokens"])
def test_a_path_whose_output_is_hidden_wide_is_a_tap(tiny_spec, path):
    assert resolve(TapConf(path=path), tiny_spec).path == path and tiny_spec.outputs[path] == tiny_spec.hidden


def test_where_a_forward_cannot_run_on_meta_tensors_the_module_types_still_say_what_they_output():
    import torch

    from steer.models.spec import _outputs

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
            self.head = torch.nn.Linear(8, 3)
            self.act = torch.nn.SiLU()

        def forward(self, input_ids):
            raise RuntimeError("needs real data")

    model = Broken()
    out = _outputs(model, {n: m for n, m in model.named_modules() if n})
    assert out == {"layers": "a ModuleList, never called in a forward pass", "layers.0": 8, "head": 3}
