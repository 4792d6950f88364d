import pytest
import torch

from helpers import compose
from steer.edits import vector
from steer.errors import ConfigError
from steer.edits.plan import build
from steer.config.schema import EditKind


def test_edits_group_by_tap_in_config_order(tiny_spec, tmp_path):
    p = vector.save(tmp_path / "v.safetensors", {"d": torch.randn(tiny_spec.hidden)}, model="t", tap="x", method="m")
    cfg = compose("tap=layer1", "edit=add", f"edit.vector.path={p}", "edit.vector.key=d",
                  f"+extra_edits=[{{tap: {{layer: 2}}, edit: {{kind: ablate, vector: {{path: '{p}', key: d}}}}}},"
                  f"{{tap: {{layer: 1}}, edit: {{kind: rescale, scale: 0.5}}}}]")
    plan = build(cfg, tiny_spec)
    assert list(plan.edits) == ["model.layers.1", "model.layers.2"]
    assert [e.kind for e in plan.edits["model.layers.1"]] == [EditKind.add, EditKind.rescale]
    assert plan.primary[0].name == "layer1" and plan.primary[1].kind == EditKind.add


def test_active_drops_noops(tiny_spec):
    cfg = compose("edit=add", "edit.scale=0")
    plan = build(cfg, tiny_spec)
    assert plan.edits and not plan.active().edits
    assert plan.active().primary is plan.primary


def test_default_vector_is_asked_per_tap(tiny_spec):
    cfg = compose("edit=ablate", "tap=layer2")
    asked = []
    build(cfg, tiny_spec, default_vector=lambda tap: asked.append(tap.name) or torch.randn(tiny_spec.hidden))
    assert asked == ["layer2"]


def test_errors_name_the_extra_edit(tiny_spec):
    cfg = compose("+extra_edits=[{tap: {layer: 9}, edit: {kind: add}}]")
    with pytest.raises(ConfigError, match=r"extra_edits\[0\]\.tap\.layer: layer 9 is out of range"):
        build(cfg, tiny_spec)


def test_describe_names_every_edit_in_order(tiny_spec):
    from steer.runs.run import describe

    plan = build(compose("+experiment=joy_two_taps"), tiny_spec)
    assert describe(plan) == "layer1 add scale=6, layer2 clamp scale=1 lo=-40 hi=40 (generated)"


def test_a_vector_used_at_another_tap_or_model_than_it_was_made_at_is_warned_of_once(tiny_spec, tmp_path, caplog):
    p = vector.save(tmp_path / "v.safetensors", {"direction": torch.randn(tiny_spec.hidden)}, model=tiny_spec.name,
                    tap="layer1", method="m")
    with caplog.at_level("WARNING", logger="steer.edits.plan"):
        build(compose("tap.layer=1", f"edit.vector.path={p}"), tiny_spec)
        assert not caplog.records  # where it was made
        for _ in range(2):
            build(compose("tap.layer=2", f"edit.vector.path={p}"), tiny_spec)
    assert [r.getMessage() for r in caplog.records] == [
        f"edit.vector.path: {p} was extracted at tap layer1 and is used at layer2"]
    other = vector.save(tmp_path / "w.safetensors", {"direction": torch.randn(tiny_spec.hidden)}, model="llama",
                        tap="layer2", method="m")
    caplog.clear()
    with caplog.at_level("WARNING", logger="steer.edits.plan"):
        build(compose("tap.layer=2", f"edit.vector.path={other}"), tiny_spec)
    assert [r.getMessage() for r in caplog.records] == [
        f"edit.vector.path: {other} was extracted at model llama and is used at {tiny_spec.name}"]


def test_a_multi_layer_file_used_at_one_of_its_layers_is_not_warned_of(tiny_spec, tmp_path, caplog):
    dirs = {k: torch.randn(tiny_spec.hidden) for k in (1, 2, 3)}
    p = vector.save_layers(tmp_path / "m.safetensors", dirs, model=tiny_spec.name, tap="layer1,layer2,layer3",
                           method="m")
    with caplog.at_level("WARNING", logger="steer.edits.plan"):
        build(compose("tap.layer=2", f"edit.vector.path={p}"), tiny_spec)  # direction.2 runs: where it was made
    assert [r.getMessage() for r in caplog.records] == []
