"""conf/serve.yaml and the presets: the committed ones check out, a bad one stops the start (exit 2, the preset and
field named) before any engine loads, and composing presets is the CLI's edit list."""

import sys

import pytest
import torch
from safetensors.torch import save_file

from helpers import cli_env, cli_here, compose, compose_conf, run
from steer.edits.edit import compile_edit, scale_of
from steer.errors import ConfigError
from steer.config.schema import EditKind
from steer.serve import presets
from steer.serve.schema import ServeOptions


def serve_here(args, cwd, monkeypatch, capsys):
    """`python -m steer.serve args` run in this process (helpers.cli_here), for a start refused before any engine:
    what the command does, without a new interpreter's imports. A start that is not refused fails the test where it
    would begin serving, rather than serving on in the test's process."""
    from steer.serve import hf_serve

    monkeypatch.setattr(hf_serve, "serve", lambda *a, **k: pytest.fail("the server started: its start was not refused"))
    return cli_here(args, cwd, monkeypatch, capsys, module="steer.serve")


def compose_serve(*overrides, tiny=True):
    """conf/serve.yaml composed as `python -m steer.serve` composes it, on the tiny model unless `tiny` is False or
    the overrides name a model (the server's default is SmolLM2)."""
    from omegaconf import OmegaConf

    named = any(o.startswith("model=") for o in overrides)
    return OmegaConf.to_object(compose_conf("serve", [*overrides, *([] if named or not tiny else ["model=tiny"])]))


def test_serve_config_composes():
    conf = compose_serve("serve.port=9000", "serve.presets=[joy]", tiny=False)
    assert (conf.serve.host, conf.serve.port, conf.serve.presets, conf.engine) == ("127.0.0.1", 9000, ["joy"], "auto")
    # the CLI's default model, as conf/config.yaml names it
    assert conf.model == compose("task=steer", tiny=False).model and conf.model.name == "smollm2"
    assert conf.prompts.positive
    with pytest.raises(Exception, match="serve.prot"):
        compose_serve("serve.prot=1")


def test_committed_presets_check(tiny_spec):
    confs = presets.read(ServeOptions())
    assert {"joy", "gloom", "joy_two_taps"} <= set(confs)
    presets.check(confs, tiny_spec)
    assert len({te.tap.layer for te in confs["joy_two_taps"].edits}) == 2
    assert confs["gloom"].edits[0].edit.scale == -confs["joy"].edits[0].edit.scale


def test_committed_presets_have_smollm2s_own_layer_and_strength():
    # On SmolLM2 (30 layers) the presets use the pair task=select chose, as conf/experiment/smollm2_joy.yaml does;
    # a model they name nothing for (the tiny model) gets their default edits
    chosen = compose("+experiment=smollm2_joy", tiny=False)
    smol, tiny = presets.read(ServeOptions(), "smollm2"), presets.read(ServeOptions(), "tiny")
    joy = smol["joy"].edits[0]
    assert (joy.tap.layer, joy.edit.kind, joy.edit.scale) == (chosen.tap.layer, chosen.edit.kind, chosen.edit.scale)
    assert smol["gloom"].edits[0].edit.scale == -joy.edit.scale and smol["gloom"].edits[0].tap.layer == joy.tap.layer
    assert smol["joy_two_taps"].edits[0].tap.layer == joy.tap.layer and len(smol["joy_two_taps"].edits) == 2
    assert {n: c.edits for n, c in tiny.items()} == {n: c.edits for n, c in presets.read(ServeOptions()).items()}


def _write(d, name, text):
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.yaml").write_text(text)


BAD = [
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add, vector: {path: /nonexistent.safetensors}}\n",
     "preset bad: edits[0].edit.vector.path: vector file"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add}\n  - tap: {layer: 9}\n    edit: {kind: add}\n",
     "preset bad: edits[1].tap.layer: layer 9 is out of range"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add, scal: 2}\n", "preset bad: edits[0].edit.scal"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: steer}\n", "preset bad: edits[0].edit.kind"),
    ("edits: []\n", "preset bad: edits: is empty"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add, vector: {path: VEC, key: nope}}\n",
     "preset bad: edits[0].edit.vector.key: key 'nope' is not in"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add, vector: {path: SMALL}}\n",
     "the model's hidden size is 256"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add}\nmodels:\n  tiny:\n    - tap: {layer: 1}\n"
     "      edit: {kind: steer}\n", "preset bad: models.tiny[0].edit.kind"),
    ("edits:\n  - tap: {layer: 1}\n    edit: {kind: add}\nmodels:\n  tiny: 3\n",
     "preset bad: models.tiny: must be a list"),
    ("edits: [joy]\n", "preset bad: edits[0]: must be a {tap, edit} mapping, got 'joy'"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_preset_is_named(tmp_path, tiny_spec, text, message):
    save_file({"direction": torch.randn(256)}, str(tmp_path / "v.safetensors"))
    save_file({"direction": torch.randn(128)}, str(tmp_path / "small.safetensors"))
    text = text.replace("VEC", str(tmp_path / "v.safetensors")).replace("SMALL", str(tmp_path / "small.safetensors"))
    _write(tmp_path / "p", "bad", text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        presets.check(presets.read(ServeOptions(preset_dir=str(tmp_path / "p"))), tiny_spec)


def test_unknown_or_badly_named_presets(tmp_path):
    _write(tmp_path, "a,b", "edits:\n  - tap: {layer: 1}\n    edit: {kind: add}\n")
    with pytest.raises(ConfigError, match="serve.presets: no preset 'joyful'"):
        presets.read(ServeOptions(presets=["joyful"]))
    with pytest.raises(ConfigError, match="preset a,b: a preset's name"):
        presets.read(ServeOptions(preset_dir=str(tmp_path)))


def test_a_preset_dir_adds_to_the_built_in_presets(tmp_path, tiny_spec):
    _write(tmp_path / "p", "mine", "edits:\n  - tap: {layer: 2}\n    edit: {kind: add, scale: 3.0}\n")
    built_in = {p.stem for p in (presets.CONF_DIR / "preset").glob("*.yaml")}
    confs = presets.read(ServeOptions(preset_dir=str(tmp_path / "p")))
    assert set(confs) == built_in | {"mine"} and "joy" in built_in
    assert (confs["mine"].edits[0].tap.layer, confs["mine"].edits[0].edit.scale) == (2, 3.0)
    assert confs["joy"] == presets.read(ServeOptions())["joy"]  # the built-in one, as without the directory
    assert set(presets.read(ServeOptions(preset_dir=str(presets.CONF_DIR / "preset")))) == built_in  # itself: once
    with pytest.raises(ConfigError, match="serve.preset_dir: .* is not a directory"):
        presets.read(ServeOptions(preset_dir=str(tmp_path / "none")))


def test_a_name_defined_twice_stops_the_start_naming_both_files(tmp_path, cache_dir, monkeypatch, capsys):
    _write(tmp_path / "p", "joy", "edits:\n  - tap: {layer: 1}\n    edit: {kind: add, scale: 2.0}\n")
    ours, theirs = presets.CONF_DIR / "preset" / "joy.yaml", tmp_path / "p" / "joy.yaml"
    with pytest.raises(ConfigError) as e:
        presets.read(ServeOptions(preset_dir=str(tmp_path / "p")))
    assert e.value.field == "serve.preset_dir" and f"'joy' is defined twice: {ours} and {theirs}" in str(e.value)
    res = serve_here(["engine=hf", "model=tiny", f"serve.preset_dir={tmp_path / 'p'}",
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].endswith(f"defined twice: {ours} and {theirs}; rename one"), res.stderr
    assert "Loading weights" not in res.stderr + res.stdout and "Traceback" not in res.stderr


def test_a_bad_preset_fails_the_start_with_exit_2(tmp_path, cache_dir, monkeypatch, capsys):
    _write(tmp_path / "p", "good", "edits:\n  - tap: {layer: 1}\n    edit: {kind: add}\n")
    _write(tmp_path / "p", "mine", "edits:\n  - tap: {layer: 1}\n    edit: {kind: add, vector: {path: /no/such.st}}\n")
    res = serve_here(["engine=hf", "model=tiny", f"serve.preset_dir={tmp_path / 'p'}",
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "preset mine: edits[0].edit.vector.path: vector file '/no/such.st' does not exist" in res.stderr
    assert "Loading weights" not in res.stderr + res.stdout  # no engine was started


def test_a_config_hydra_rejects_is_one_line_and_exit_2(tmp_path, cache_dir):
    res = run([sys.executable, "-m", "steer.serve", "model=tiny", "serve.port=abc",
               f"hydra.run.dir={tmp_path / 'run'}"],
              cwd=tmp_path, env=cli_env(cache_dir), timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("error serve.port: ") and "'abc'" in res.stderr
    assert "Traceback" not in res.stderr


def test_compose_is_the_cli_edit_list(tiny_spec):
    v = torch.randn(1, 256)
    compiled = presets.compile_all(presets.read(ServeOptions()), tiny_spec, lambda tap: v, "/nonexistent")
    plan = presets.compose(compiled, ["joy_two_taps", "joy"], 0.5)
    assert {p: [(e.kind, scale_of(e)) for e in es] for p, es in plan.edits.items()} == {
        "model.layers.1": [(EditKind.add, 3.0), (EditKind.add, 2.0)], "model.layers.2": [(EditKind.clamp, 0.5)]}
    assert presets.compose(compiled, ["joy", "gloom"], 0.0) is None  # scale 0: an unsteered request
    scale = presets.scaled(compile_edit(EditKind.rescale, 0.5, None), 2.0)
    assert scale_of(scale) == 0.0 and scale.strength == -1.0  # a rescale edit's strength (scale - 1) doubles


@pytest.mark.parametrize("mode", ["edits_in_graph", "compiled_edits", "tap_graphs"])
def test_graph_modes_need_the_vllm_engine(mode):
    from steer.serve.schema import ServeConf
    from steer.serve.start import prepare

    conf = ServeConf(engine="hf")
    setattr(conf.vllm, mode, True)
    with pytest.raises(ConfigError) as e:
        prepare(conf)
    assert e.value.field == f"vllm.{mode}" and "needs engine=vllm" in str(e.value)


@pytest.mark.parametrize("others", [{}, {"edits_in_graph": True, "compiled_edits": True}])
def test_folding_into_the_norm_needs_edits_in_breakable_graphs(others):
    from steer.serve.schema import ServeConf
    from steer.serve.start import prepare

    conf = ServeConf(engine="vllm")
    for name, value in {"fold_norm": True, **others}.items():
        setattr(conf.vllm, name, value)
    with pytest.raises(ConfigError) as e:
        prepare(conf)
    assert e.value.field == "vllm.fold_norm" and "vllm.edits_in_graph=true" in str(e.value)


@pytest.mark.parametrize("engine, overrides, compiled", [
    ("vllm", [], True),  # the fastest mode when nothing else is asked for
    ("vllm", ["serve.inline_layers=[1]"], False),  # requests' own vectors: replay
    ("vllm", ["vllm.edits_in_graph=true"], False),
    ("vllm", ["vllm.tap_graphs=true"], False),
    ("vllm", ["vllm.compiled_edits=false"], False),
    ("hf", [], False),
])
def test_the_server_picks_compiled_edits_unless_asked_otherwise(engine, overrides, compiled, cache_dir):
    from steer.serve.start import mode_name, pick_mode

    conf = compose_serve(f"cache_dir={cache_dir}", f"engine={engine}", *overrides)
    assert conf.vllm.compiled_edits is (False if "vllm.compiled_edits=false" in overrides else None)
    pick_mode(conf, engine)
    assert conf.vllm.compiled_edits is compiled
    assert (mode_name(conf) == "compiled edits") is compiled


@pytest.mark.parametrize("engine, compiled", [("vllm", True), ("hf", False)])
def test_the_start_leaves_the_mode_picked(engine, compiled, cache_dir, monkeypatch):
    import socket

    from steer import engine as engines
    from steer.serve.start import prepare

    monkeypatch.setattr(engines, "resolve", lambda name: engine)  # vLLM need not be installed to check the pick
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = compose_serve(f"cache_dir={cache_dir}", f"serve.port={port}")
    assert prepare(conf)[0] == engine and conf.vllm.compiled_edits is compiled


@pytest.mark.parametrize("layers, mode, field, says", [
    ([1, 9], None, "serve.inline_layers[1]", "layer 9 is out of range: tiny has 4 decoder layers (0..3)"),
    ([2, 2], None, "serve.inline_layers[1]", "layer 2 is listed twice"),
    ([1], "compiled_edits", "serve.inline_layers", "serve inline vectors in replay mode"),
    ([1], "edits_in_graph", "serve.inline_layers", "a request's own vector is not known then"),
])
def test_bad_inline_layers_stop_the_start(layers, mode, field, says, cache_dir):
    from steer.serve.start import prepare

    conf = compose_serve(f"serve.inline_layers={layers}", f"cache_dir={cache_dir}",
                         *([f"vllm.{mode}=true", "engine=vllm"] if mode else ["engine=hf"]))
    with pytest.raises(ConfigError) as e:
        prepare(conf)
    assert e.value.field == field and says in str(e.value), str(e.value)


@pytest.mark.parametrize("override, field, says", [
    ("serve.port=70000", "serve.port", "must be in 1..65535, got 70000"),
    ("serve.max_steer_scale=0", "serve.max_steer_scale", "must be positive, got 0"),
    ("serve.chat_max_tokens=0", "serve.chat_max_tokens", "must be at least 1, got 0"),
    ("serve.keep_alive_s=0", "serve.keep_alive_s", "must be at least 1 (seconds), got 0"),
    ("serve.chat_max_tokens=2048", "serve.chat_max_tokens", "2048 new tokens leave no room for a prompt: tiny has "
                                                            "2048 positions"),
    ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization", "must be a share in (0, 1], got 1.5"),
    ("vllm.kv_cache_memory_bytes=0", "vllm.kv_cache_memory_bytes", "must be a positive number of bytes or null"),
])
def test_bad_server_settings_stop_the_start(override, field, says, cache_dir):
    from steer.serve.start import prepare

    conf = compose_serve("engine=hf", f"cache_dir={cache_dir}", override)
    with pytest.raises(ConfigError) as e:
        prepare(conf)
    assert e.value.field == field and says in str(e.value), str(e.value)


@pytest.mark.parametrize("override, line", [
    ("serve.log_level=verbose", "serve.log_level: 'verbose' is not one of critical, error, warning, info, debug"),
    ("extract.method=bogus", "extract.method: 'bogus' is not one of diffmean, pca"),
    ("prompts.chat=auto", "prompts.chat: 'auto' was renamed; did you mean null?"),
])
def test_a_server_setting_outside_its_choices_is_refused_as_the_config_composes(override, line):
    from hydra.errors import ConfigCompositionException

    from steer.errors import config_error_line

    with pytest.raises(ConfigCompositionException) as e:
        compose_serve("engine=hf", override)
    assert config_error_line(e.value).startswith(line)


def test_a_port_in_use_stops_the_start_before_any_model_loads(cache_dir):
    import socket

    from steer.serve.start import prepare

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        conf = compose_serve("engine=hf", f"cache_dir={cache_dir}", f"serve.port={busy.getsockname()[1]}")
        with pytest.raises(ConfigError) as e:
            prepare(conf)
    assert e.value.field == "serve.port" and f"cannot listen on 127.0.0.1:{conf.serve.port}" in str(e.value)
    assert "Pick a free port" in str(e.value)
    for host, says in (("no-such-host.invalid", "cannot resolve 'no-such-host.invalid'"),
                       ("192.0.2.1", "cannot listen on 192.0.2.1")):  # TEST-NET-1: no interface of this machine
        conf.serve.host = host
        with pytest.raises(ConfigError) as e:
            prepare(conf)
        assert e.value.field == "serve.host" and says in str(e.value) and "free port" not in str(e.value)
    conf.serve.host = ""  # every interface, as uvicorn and vLLM read it
    assert prepare(conf)[0] == "hf"


def test_the_start_line_gives_an_address_a_client_can_use():
    from steer.serve.schema import ServeOptions
    from steer.serve.start import base_url

    assert [base_url(ServeOptions(host=h, port=8000)) for h in ("", "127.0.0.1", "::1")] == \
        ["http://0.0.0.0:8000/v1", "http://127.0.0.1:8000/v1", "http://[::1]:8000/v1"]


def test_a_preset_runs_a_gguf_control_vector_at_every_layer_it_holds(tmp_path, tiny_spec):
    import gguf
    import numpy as np

    dirs = {k: np.random.default_rng(k).standard_normal(256).astype(np.float32) for k in (1, 3)}
    w = gguf.GGUFWriter(str(tmp_path / "cv.gguf"), "controlvector")  # as repeng writes one
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", 2)
    for k, v in dirs.items():
        w.add_tensor(f"direction.{k}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    edit = f"{{kind: add, scale: 2.0, vector: {{path: '{tmp_path}/cv.gguf', layers: all}}}}"
    (tmp_path / "cv.yaml").write_text(f"edits:\n  - edit: {edit}\n")
    compiled = presets.compile_all(presets.read(ServeOptions(preset_dir=str(tmp_path))), tiny_spec, None, "/x")
    items = compiled["cv"].items
    assert [tap.path for tap, _ in items] == [tiny_spec.layer_path(1), tiny_spec.layer_path(3)]
    for (_, e), k in zip(items, (1, 3)):
        assert e.strength == 2.0 and np.array_equal(e.basis[0].numpy(), dirs[k])
    assert [v["vector"]["path"] for v in compiled["cv"].listed] == [f"{tmp_path}/cv.gguf"] * 2


def test_the_listing_shows_each_edits_scale_as_its_config_gives_it(tmp_path, tiny_spec):
    """A rescale edit holds its strength (scale - 1): the listing shows the config's scale, not one computed back."""
    (tmp_path / "calm.yaml").write_text("edits:\n  - tap: {layer: 1}\n    edit: {kind: rescale, scale: 0.1}\n")
    compiled = presets.compile_all(presets.read(ServeOptions(preset_dir=str(tmp_path))), tiny_spec, None, "/x")
    (_, e), = compiled["calm"].items
    assert e.strength == 0.1 - 1.0 and (e.strength + 1.0) != 0.1  # the float a computed-back scale would show
    listed = next(p for p in presets.listing(compiled) if p["name"] == "calm")
    assert [x["scale"] for x in listed["edits"]] == [0.1]
