"""Old spellings (steer/renamed.py): each is refused with the name that replaced it, wherever it is written
(an override, a config file, a list item, the bench's config), and a name that was never used passes through."""

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from helpers import compose_conf, on_tiny
from steer import renamed
from steer.config.schema import SteerConf, to_object
from steer.errors import ConfigError, config_error_line


@pytest.mark.parametrize("key,new", [("model.tiny.layers", "model.tiny.num_layers"),
                                     ("models.tiny.tiny.layers", "models.tiny.tiny.num_layers"),
                                     ("eval.sentiment", "metrics.sentiment"),
                                     ("eval.judge.base_url", "metrics.judge.base_url"),
                                     ("select.layers", None), ("eval.dataset", None), ("layers", None)])
def test_a_renamed_key_and_what_it_is_now(key, new):
    assert renamed.new_key(key) == new
    said = renamed.key_message(key)
    assert (said is None) == (new is None)
    if said is not None:
        assert said == f"was renamed; did you mean {new}?"


@pytest.mark.parametrize("key,value,says", [("edit.kind", "scale", "did you mean 'rescale'?"),
                                            ("extra_edits[1].edit.kind", "scale", "did you mean 'rescale'?"),
                                            ("k_kinds[4]", "scale", "did you mean 'rescale'?"),
                                            ("prompts.chat", "auto", "did you mean null?"),
                                            ("edit.kind", "bogus", None), ("edit.scale_by", "scale", None),
                                            ("prompts.chat", True, None)])
def test_a_renamed_value_and_what_it_is_now(key, value, says):
    said = renamed.value_message(key, value)
    assert (said is None) == (says is None)
    if said is not None:
        assert said.startswith(f"{value!r} was renamed") and says in said


def test_a_renamed_group_option_and_the_api_names():
    assert "did you mean edit=rescale?" in renamed.group_message("edit", "scale")
    assert renamed.group_message("edit", "add") is None and renamed.group_message("tap", "scale") is None
    assert renamed.api_message("scale") == "steer.scale was renamed; did you mean steer.rescale?"
    assert "steer.set_projection" in renamed.api_message("set") and renamed.api_message("add") is None


def test_every_new_name_exists():
    import dataclasses

    import steer
    from steer.config import schema

    def has(kind, key):  # a dotted key under the dataclass `kind`
        for name in key.split("."):
            fields = {f.name: f for f in dataclasses.fields(kind)}
            if name not in fields:
                return False
            kind = fields[name].type if dataclasses.is_dataclass(fields[name].type) else None
        return True

    assert has(schema.ModelConf, renamed.KEYS["tiny.layers"])
    assert has(SteerConf, renamed.KEYS["eval.sentiment"]) and has(SteerConf, renamed.KEYS["eval.judge"])
    assert renamed.VALUES["edit.kind"]["scale"] in schema.EditKind.__members__
    assert all(hasattr(steer, new) for new in renamed.API.values())


@pytest.mark.parametrize("overrides,line", [
    (["edit.kind=scale"], "edit.kind: 'scale' was renamed; did you mean 'rescale'?"),
    (["edit=scale"], "edit: 'scale' was renamed; did you mean edit=rescale?"),
    (["extra_edits=[{tap: {layer: 1}, edit: {kind: scale}}]"],
     "extra_edits: edit.kind: 'scale' was renamed; did you mean 'rescale'?"),
    (["prompts.chat=auto"], "prompts.chat: 'auto' was renamed; did you mean null?"),
    (["model.tiny.layers=2"], "model.tiny.layers: was renamed; did you mean model.tiny.num_layers?"),
    (["eval.judge.model=m"], "eval.judge: was renamed; did you mean metrics.judge?")])
def test_composing_an_old_spelling_is_one_line_with_the_new_one(overrides, line):
    with pytest.raises((ConfigCompositionException, MissingConfigException)) as e:
        compose_conf("config", on_tiny(overrides))
    assert config_error_line(e.value) == line


def test_an_old_key_added_with_plus_is_refused_with_the_new_one():
    with pytest.raises(ConfigError) as e:
        to_object(compose_conf("config", on_tiny(["+eval.sentiment=true"])))
    assert e.value.field == "eval.sentiment" and "did you mean metrics.sentiment?" in str(e.value)


def test_the_bench_refuses_an_old_kind_with_the_new_one():
    with pytest.raises(ConfigCompositionException) as e:
        compose_conf("bench", ["k_kinds=[add,scale]"])
    assert config_error_line(e.value) == "k_kinds[1]: 'scale' was renamed; did you mean 'rescale'?"
