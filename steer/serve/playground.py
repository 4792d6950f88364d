"""The playground: a page at `/` where one types a prompt, picks presets or builds a direction from a few lines, and
reads the unsteered and the steered continuations stream side by side. Both servers serve it through this module
(engine=hf's FastAPI app, engine=vllm's middleware), with its two routes beside OpenAI's:

- `GET /v1/steer/info`: what the page offers: the served model name, its decoder layers and hidden size, the
  layers a request's own vector may be added at (serve.inline_layers), the largest strength, and whether a direction
  can be built here.
- `POST /v1/steer/direction` `{"positive": [...], "negative": [...], "layer": k}`: the difference-of-means direction
  of the two sets of lines at layer k (one of serve.inline_layers), as `python -m steer task=extract` makes it, with
  its diagnostics. The answer's `vector` is a `steer_vector` (base64 float32): the page sends it back in
  vllm_xargs with its strength, so it takes the inline-vector path of any request, with the same checks and limits.

The page itself (playground.html) is plain HTML, CSS and JavaScript in one file: no build step, nothing fetched
from anywhere but the server that serves it. `serve.playground=false` leaves all three routes out.
"""

import asyncio
import threading
from importlib import resources
from typing import Any, Callable, Dict, List, Optional, Tuple

from steer.serve.protocol import InlinePolicy, RequestError, encode_vector, json_type

MAX_LINES = 64  # lines in each set of a direction request
MAX_CHARS = 2000  # characters in one line
PAGE_PATH = "/"
INFO_PATH = "/v1/steer/info"
DIRECTION_PATH = "/v1/steer/direction"


def page() -> bytes:
    return resources.files("steer.serve").joinpath("playground.html").read_bytes()


def info(model_name: str, layers: int, hidden: int, policy: Optional[InlinePolicy], max_scale: float,
         direction: bool) -> Dict[str, Any]:
    return {"object": "steer.info", "model": model_name, "layers": layers, "hidden": hidden,
            "inline_layers": list(policy.layers) if policy else [], "max_steer_scale": max_scale,
            "direction": bool(direction and policy and policy.layers)}


def direction_request(body: Any, policy: Optional[InlinePolicy]) -> Tuple[int, List[str], List[str]]:
    """(layer, positive lines, negative lines) of a direction request; RequestError naming the field otherwise."""
    if policy is None or not policy.layers:
        raise RequestError("layer", "this server adds no request's own vectors, so it builds none: start it with "
                                    "serve.inline_layers=[...] (the layers a direction may be added at)")
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {json_type(body)}")
    unknown = sorted(set(body) - {"positive", "negative", "layer"})
    if unknown:
        raise RequestError(unknown[0], "unknown field; a direction request takes positive, negative and layer")
    sets = []
    for name in ("positive", "negative"):
        lines = body.get(name)
        if not isinstance(lines, list) or not lines:
            raise RequestError(name, "must be a non-empty list of lines (strings)")
        if len(lines) > MAX_LINES:
            raise RequestError(name, f"{len(lines)} lines; at most {MAX_LINES}")
        for i, line in enumerate(lines):
            if not isinstance(line, str) or not line.strip():
                raise RequestError(f"{name}[{i}]", "must be a line of text, not empty")
            if len(line) > MAX_CHARS:
                raise RequestError(f"{name}[{i}]", f"is {len(line)} characters; at most {MAX_CHARS}")
        sets.append([str(x) for x in lines])
    layer = body.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer not in policy.layers:
        raise RequestError("layer", f"{layer!r} is not a layer this server adds vectors at; it takes "
                                    f"{list(policy.layers)} (serve.inline_layers)")
    return layer, sets[0], sets[1]


def direction(engine, tap, positive: List[str], negative: List[str], recipe) -> Dict[str, Any]:
    """The direction of the two sets at `tap` on `engine` (steer.runs.extract, as task=extract), as the answer of
    POST /v1/steer/direction. A set the tap cannot tell apart is a RequestError, as task=extract refuses it."""
    from steer.errors import ConfigError
    from steer.runs.extract import extract

    try:
        ex = extract(engine, tap, positive, negative, recipe)
    except ConfigError as e:
        raise RequestError("positive", str(e)) from None
    d = ex.direction.float().cpu().numpy()
    return {"object": "steer.direction", "layer": None, "tap": tap.name, "hidden": int(d.shape[-1]),
            "vector": encode_vector(d), "diagnostics": ex.diagnostics, "positive": len(positive),
            "negative": len(negative)}


class LazyEngine:
    """An HF engine made on first use, one at a time (engine=vllm's middleware: the directions are read on the HF
    engine on `device`, as the server's default directions are before vLLM starts)."""

    def __init__(self, make: Callable[[], Any]):
        self.make, self.engine, self.lock = make, None, threading.Lock()

    def __call__(self, fn: Callable[[Any], Any]) -> Any:
        with self.lock:  # one reading at a time: the engine's hooks are per forward pass
            if self.engine is None:
                self.engine = self.make()
            return fn(self.engine)


async def answer_direction(body: Any, policy: Optional[InlinePolicy], taps: Dict[int, Any], recipe,
                           run: Callable) -> Dict[str, Any]:
    """POST /v1/steer/direction on either server: the request checked here, the reading done by `run(fn)` (which
    calls fn(engine) where the engine may be used: the HF server's engine thread, or a LazyEngine in a thread)."""
    layer, pos, neg = direction_request(body, policy)
    out = await run(lambda engine: direction(engine, taps[layer], pos, neg, recipe))
    out["layer"] = layer
    return out


def in_thread(lazy: LazyEngine) -> Callable:
    async def run(fn):
        return await asyncio.to_thread(lazy, fn)

    return run


class FromConf:
    """The playground of a server whose engine is not at hand (engine=vllm's middleware, in the API server's
    process): what the page is told comes from the table the server wrote at start, and a direction is read on an
    HF engine made from the server's config (`device`) on the first direction request."""

    def __init__(self, section: Dict[str, Any], policy: Optional[InlinePolicy], max_scale: float):
        self.section, self.policy, self.max_scale = section, policy, max_scale
        self._setup: Optional[Tuple[LazyEngine, Dict[int, Any], Any]] = None

    def info(self) -> Dict[str, Any]:
        s = self.section
        return info(s["model"], s["layers"], s["hidden"], self.policy, self.max_scale, bool(s.get("conf")))

    def _parts(self):
        if self._setup is None:
            from omegaconf import OmegaConf

            from steer import engine as engines
            from steer.models.spec import spec as model_spec
            from steer.runs.extract import Recipe
            from steer.config.schema import TapConf
            from steer.edits.tap import resolve
            from steer.serve.schema import ServeConf

            conf = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ServeConf),
                                                       OmegaConf.load(self.section["conf"])))
            spec = model_spec(conf.model, conf.cache_dir)
            lazy = LazyEngine(lambda: engines.make("hf", spec, conf.device, hf_conf=conf.hf))
            taps = {k: resolve(TapConf(layer=k), spec) for k in conf.serve.inline_layers}  # checked at the start
            self._setup = (lazy, taps, Recipe.from_conf(conf.extract, conf.prompts.chat))
        return self._setup

    async def direction(self, body: Any) -> Dict[str, Any]:
        direction_request(body, self.policy)  # refused before any model loads
        if not self.section.get("conf"):
            raise RequestError(None, "this server builds no directions", status=501)
        lazy, taps, recipe = await asyncio.to_thread(self._parts)
        return await answer_direction(body, self.policy, taps, recipe, in_thread(lazy))


def section(conf, spec, model_name: str, conf_path: Optional[str]) -> Dict[str, Any]:
    """The playground's part of the vLLM server's table (steer.serve.stages.Translator's JSON)."""
    return {"enabled": bool(conf.serve.playground), "model": model_name, "layers": spec.layers, "hidden": spec.hidden,
            "conf": conf_path}
