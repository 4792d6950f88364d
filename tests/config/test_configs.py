"""Every committed config composes against the schema, and the schema rejects what it should."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from helpers import CONF, compose, compose_conf, on_tiny
from steer.config.schema import EditKind, SteerConf

# conf/preset/ is also the server's (tests/serve/test_serve_presets.py checks its presets there)
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "experiment")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
EXPERIMENTS = sorted(f.stem for f in (CONF / "experiment").glob("*.yaml"))


def test_default_composes():
    cfg = compose(tiny=False)
    assert isinstance(cfg, SteerConf)
    assert cfg.model.name == "smollm2" and cfg.tap.layer == 12 and cfg.edit.kind == EditKind.add
    assert cfg.edit.scale == 4.0 and cfg.prompts.chat is None and cfg.metrics.sentiment


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_group_option_composes(group, option):
    assert isinstance(compose(f"{group}={option}"), SteerConf)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = compose(f"+experiment={name}")
    assert isinstance(cfg, SteerConf)


def test_experiment_extra_edits():
    cfg = compose("+experiment=joy_two_taps")
    assert cfg.extra_edits[0].tap.layer == 2 and cfg.extra_edits[0].edit.kind == EditKind.clamp


def test_a_group_option_and_a_field_override_compose_together():
    assert compose("model=tiny", "tap=layer1", "edit=ablate").edit.kind == EditKind.ablate
    assert compose("edit=add", "edit.scale=4").edit.scale == 4.0
    assert compose("tap.layer=2").tap.layer == 2
    assert compose("model=llama").model.source == "hub"


@pytest.mark.parametrize("override", ["edit.scale=abc", "edit.kind=foo", "edit.bogus=1", "tap.layer=x",
                                      "gen.max_new_tokens=1.5"])
def test_bad_overrides_fail_at_composition(override):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose(override)


@pytest.mark.parametrize("override,line", [
    ("extract.method=svd", "extract.method: 'svd' is not one of diffmean, pca"),
    ("extract.position=first", "extract.position: 'first' is not one of auto, mean, last"),
    ("edit.when.reduce=max", "edit.when.reduce: 'max' is not one of mean, last"),
    ("edit.when.compare=over", "edit.when.compare: 'over' is not one of above, below"),
    ("select.rank_by=votes", "select.rank_by: 'votes' is not one of probe, judge"),
    ("model.dtype=fp8", "model.dtype: 'fp8' is not one of float32, bfloat16, float16"),
])
def test_a_value_outside_its_choices_fails_at_composition_naming_the_key_and_the_choices(override, line):
    from steer.errors import config_error_line

    with pytest.raises(ConfigCompositionException) as e:
        compose_conf("config", on_tiny([override]))
    assert config_error_line(e.value) == line


def test_prompts_chat_takes_true_false_and_null():
    assert [compose(f"prompts.chat={v}").prompts.chat for v in ("true", "false", "null")] == [True, False, None]


@pytest.mark.parametrize("name,overrides,near", [
    ("config", ["+edit.scael=2"], "edit.scale"),
    ("config", ["+gen.tempreature=1"], "gen.temperature"),
    ("config", ["+experiment=joy_two_taps", "+extra_edits.0.edit.scael=3"], "extra_edits.0.edit.scale"),
    ("serve", ["+serve.porrt=8001"], "serve.port"),
    ("bench", ["+models.tiny.repeets=3"], "models.tiny.repeats"),
    ("config", ["+nonsense=1"], None)])
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused_naming_the_nearest(name, overrides, near):
    from steer.errors import ConfigError
    from steer.config.schema import to_object

    key = overrides[-1][1:].split("=")[0]
    with pytest.raises(ConfigError) as e:
        to_object(compose_conf(name, on_tiny(overrides) if name == "config" else overrides))
    assert e.value.field == key  # as the override spelled it, which Hydra parses back
    assert (near or key) in str(e.value) and ("did you mean" in str(e.value)) == (near is not None)
    to_object(compose_conf(name, on_tiny(overrides[:-1]) if name == "config" else overrides[:-1]))  # the rest is fine


@pytest.mark.parametrize("launcher,key,value", [("slurm_gpu", "gpus_per_node", 1), ("local_procs", "timeout_min", 60),
                                                ("packed", "pack_size", 16)])
def test_launcher_configs_compose(launcher, key, value):
    cfg = compose_conf("config", [f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher[key] == value


def test_an_interpolation_that_does_not_resolve_is_refused_naming_its_field():
    from steer.errors import ConfigError
    from steer.config.schema import to_object

    with pytest.raises(ConfigError) as e:
        to_object(compose_conf("config", on_tiny(["edit.vector.path=vecs/l${tap.layerr}.safetensors"])))
    assert e.value.field == "edit.vector.path" and str(e.value).endswith("Interpolation key 'tap.layerr' not found")


@pytest.mark.parametrize("overrides,field", [(["hf.batch_size=0"], "hf.batch_size"),
                                             (["hf.batch_tokens=24", "gen.max_new_tokens=24"], "hf.batch_tokens")])
def test_hf_batch_bounds_are_checked_before_an_engine_loads(overrides, field):
    from steer.config import checks
    from steer.errors import ConfigError

    cfg = compose(*overrides)
    with pytest.raises(ConfigError, match=field):
        checks.run(cfg, "hf")
    assert compose().hf.batch_size == 32
    checks.run(compose("hf.batch_size=1", "hf.batch_tokens=25", "gen.max_new_tokens=24"), "hf")
