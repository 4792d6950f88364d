"""Starting the server: check everything a user can get wrong before any engine loads, compile the presets as the
CLI compiles the same edits, then serve on the chosen engine."""

import errno
import socket
from pathlib import Path
from typing import Dict, Optional, Tuple

from rich.console import Console
from rich.markup import escape

from steer import engine as engines
from steer.models import tiny
from steer.config import checks
from steer.errors import ConfigError
from steer.runs.extract import Recipe, cached_default
from steer.models.spec import ModelSpec, spec as model_spec
from steer.serve import presets
from steer.config.schema import TapConf
from steer.serve.schema import PresetConf, ServeConf, ServeOptions
from steer.edits.tap import Tap, resolve


def prepare(conf: ServeConf) -> Tuple[str, ModelSpec, Dict[str, PresetConf], Dict[int, Tap]]:
    """(engine name, model spec, presets read and checked, serve.inline_layers' taps): everything checked that
    needs no weights."""
    s = conf.serve
    checks.serve_modes(conf)
    name = engines.resolve(conf.engine)
    pick_mode(conf, name)
    checks.serve(conf, name)
    spec = model_spec(conf.model, conf.cache_dir)
    checks.room_for_a_prompt("serve.chat_max_tokens", s.chat_max_tokens, spec.positions, conf.model.name)
    inline = inline_taps(s, spec)
    confs = presets.read(s, conf.model.name)
    checks.preset_edits(confs, name)
    presets.check(confs, spec)
    if presets.needs_default(confs):
        checks.prompt_sets(conf.prompts, ("positive", "negative"), "presets with a null vector path use the default "
                           "direction, extracted from prompts.positive and prompts.negative")
        checks.extraction(conf.extract.method, conf.prompts.positive, conf.prompts.negative)
    refused = bind_error(s.host, s.port)  # last: a config error says more than a busy port
    if refused is not None:
        raise ConfigError(*refused)
    return name, spec, confs, inline


def bind_error(host: str, port: int) -> Optional[Tuple[str, str]]:
    """(field, why) where a server could not listen on host:port now, None where it could: tried as uvicorn binds
    (SO_REUSEADDR; "" is every IPv4 interface; any of the host's addresses will do), so a port in use is found
    before a model loads rather than after."""
    try:
        addrs = [(socket.AF_INET, ("", port))] if host == "" else \
            [(i[0], i[4]) for i in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except OSError as e:
        return "serve.host", f"cannot resolve {host!r}: {e}"
    err: OSError = OSError(f"no address for {host!r}")
    for family, addr in addrs:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
            return None
        except OSError as e:
            err = e
    if err.errno == errno.EADDRINUSE:
        return "serve.port", (f"cannot listen on {host}:{port}: {err.strerror}; is another server there? Pick a free "
                              "port with serve.port=N")
    return "serve.host", f"cannot listen on {host}:{port}: {err.strerror or err}"


def pick_mode(conf: ServeConf, name: str) -> None:
    """Set vllm.compiled_edits where it is null: true on engine=vllm unless another mode or requests' own vectors
    are asked for (the fastest mode: docs/benchmark.md, "Serving"), else false."""
    v = conf.vllm
    if v.compiled_edits is None:
        v.compiled_edits = name == "vllm" and not (v.edits_in_graph or v.tap_graphs or list(conf.serve.inline_layers))


def mode_name(conf: ServeConf) -> str:
    """How the vLLM server runs the presets' edits, in the words of docs/vllm-engine.md."""
    v = conf.vllm
    return ("compiled edits" if v.compiled_edits else "edits in the graph" if v.edits_in_graph
            else "tap graphs" if v.tap_graphs else "replay")


def inline_taps(s: ServeOptions, spec: ModelSpec) -> Dict[int, Tap]:
    """serve.inline_layers, checked, as layer -> the residual-stream tap after that decoder layer."""
    out = {}
    for i, layer in enumerate(s.inline_layers):
        if layer in out:
            raise ConfigError(f"serve.inline_layers[{i}]", f"layer {layer} is listed twice")
        if not 0 <= layer < spec.layers:
            raise ConfigError(f"serve.inline_layers[{i}]", f"layer {layer} is out of range: {spec.name} has "
                                                           f"{spec.layers} decoder layers (0..{spec.layers - 1})")
        out[layer] = resolve(TapConf(layer=layer), spec, f"serve.inline_layers[{i}]")
    return out


def compile_presets(conf: ServeConf, spec: ModelSpec, confs: Dict[str, PresetConf], engine) -> Dict:
    """The presets compiled; a null vector path is the default direction at its tap, from `engine` (cached), as
    `python -m steer` asks for it."""
    pos, neg = list(conf.prompts.positive), list(conf.prompts.negative)
    recipe = Recipe.from_conf(conf.extract, conf.prompts.chat)
    def default(tap):
        return cached_default(conf.cache_dir, engine, tap, pos, neg, recipe)

    return presets.compile_all(confs, spec, default if engine is not None else None, conf.cache_dir)


def main(conf: ServeConf, out_dir: Path, console: Console) -> None:
    name, spec, confs, inline = prepare(conf)
    say = lambda msg: console.print(msg, highlight=False)  # noqa: E731
    if conf.model.source == "tiny":
        if not tiny.tiny_dir(conf.cache_dir, conf.model.tiny).is_dir():
            say("steer serve: training the tiny model into the cache (once; a few minutes on a CPU)")
        tiny.ensure_tiny(conf.cache_dir, conf.model.tiny)
    model_name = conf.serve.model_name or conf.model.name
    if name == "hf":
        from steer.serve.hf_app import HFServer
        from steer.serve.hf_serve import serve

        engine = engines.make("hf", spec, conf.device, hf_conf=conf.hf)
        compiled = compile_presets(conf, spec, confs, engine)
        server = HFServer(engine, compiled, presets.listing(compiled), model_name, conf.serve.max_steer_scale,
                          conf.serve.chat_max_tokens, inline, conf.serve.playground,
                          Recipe.from_conf(conf.extract, conf.prompts.chat))
        say(f"steer serve: {model_name} on engine=hf ({conf.device}), presets {escape(str(sorted(compiled)))}, "
            f"{base_url(conf.serve)}{playground_line(conf.serve)}")
        serve(server, conf.serve.host, conf.serve.port, conf.serve.log_level, conf.serve.keep_alive_s)
        return
    # engine=vllm: default directions are extracted (once, then cached) on the HF engine before vLLM starts, since
    # every preset's stages go to the workers at start.
    helper = None
    if presets.needs_default(confs):
        helper = engines.make("hf", spec, conf.device)
    compiled = compile_presets(conf, spec, confs, helper)
    if helper is not None:
        del helper
        _free_cuda()
    from steer.serve import vllm_server

    say(f"steer serve: {model_name} on engine=vllm ({mode_name(conf)}), presets {escape(str(sorted(compiled)))}, "
        f"{base_url(conf.serve)}{playground_line(conf.serve)}")
    vllm_server.serve(conf, spec, compiled, inline, out_dir, model_name)


def base_url(s: ServeOptions) -> str:
    """The API's address as a client writes it (an empty host listens on every interface)."""
    host = s.host or "0.0.0.0"
    return f"http://{f'[{host}]' if ':' in host else host}:{s.port}/v1"


def playground_line(s: ServeOptions) -> str:
    """Where the start line says the playground is (serve.playground)."""
    return f"; playground at {base_url(s).removesuffix('/v1')}/" if s.playground else ""


def _free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
