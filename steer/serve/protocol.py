"""What both servers read from a request beyond OpenAI's own fields: the steer arguments, checked, and the errors
they answer with.

A request steers by name: `vllm_xargs={"steer": "joy", "steer_scale": 1.5}` (the openai client's
`extra_body={"vllm_xargs": ...}` lands at the top level of the JSON body). `steer` is one preset name or several,
comma-separated, composed in that order; `steer_scale` (default 1) multiplies every edit's strength. A request may
also carry vectors of its own, added after its presets' edits: `steer_vector` (base64 of little-endian float32,
hidden size values; one, or a list of at most MAX_INLINE), `steer_layer` (one layer for all, or one per vector, each
among the server's `serve.inline_layers`), `steer_strength` (default 1; one, or one per vector) and `steer_tokens`
(the rows it is added to: "both", the default, "prompt" or "generated"; one, or one per vector), and `steer_when`, a
condition on the prompt that gates them (conditional steering, docs/conditional.md): an object with `vector` (base64
as steer_vector's), `layer` (among `serve.inline_layers`: where the prompt is read), `threshold` (in [-1, 1]), and
optionally `reduce` (mean, last), `score` (cast, cosine) and `compare` (above, below). Requests carry
names, numbers and vectors only: nothing in one can name a file, a module or code. Anything else whose key starts
with `steer` is refused, so a typo never silently serves an unsteered answer.
"""

import binascii
import json
import math
from dataclasses import dataclass
from typing import Any, Collection, Dict, List, Optional, Tuple

import numpy as np

# steer_vector's format is the worker's (RequestEdits.inline): one codec for both ends
from interleaver.bank import decode_vector, encode_vector  # noqa: F401  (encode_vector: for clients)

STEER_KEYS = ("steer", "steer_scale", "steer_vector", "steer_layer", "steer_strength", "steer_tokens", "steer_when")
WHEN_KEYS = {"vector": None, "layer": None, "threshold": None, "reduce": ("mean", "last"),
             "score": ("cast", "cosine"), "compare": ("above", "below")}
TOKENS = ("both", "prompt", "generated")  # the rows an inline vector is added to
MAX_INLINE = 64  # vectors in one request
MAX_PUSH = 1e4  # the largest value strength x vector may add to a residual-stream element


class RequestError(Exception):
    """A request the server refuses: an OpenAI-style error body naming the field (`param`) at fault."""

    def __init__(self, param: Optional[str], message: str, status: int = 400, kind: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.param, self.message, self.status, self.kind, self.code = param, message, status, kind, code

    def body(self) -> Dict[str, Any]:
        # The field is in the message too: clients (the openai one among them) show the message alone
        message = f"{self.param}: {self.message}" if self.param else self.message
        return {"error": {"message": message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class InlineVector:
    """A request's own vector: added (times `strength`) to the residual stream after decoder layer `layer`."""

    layer: int
    strength: float
    data: str  # base64 of little-endian float32, as the request sent it (checked: hidden size, finite)
    tokens: str = "both"  # rows fed a prompt token, a generated one, or both

    def values(self) -> np.ndarray:
        return decode_vector(self.data)


@dataclass(frozen=True)
class InlineWhen:
    """A request's own condition on its prompt, gating its own vectors: the prompt read after decoder `layer`."""

    layer: int
    data: str  # the condition direction: base64 of little-endian float32, as the request sent it (checked)
    threshold: float
    reduce: str = "mean"
    score: str = "cast"
    compare: str = "above"

    def values(self) -> np.ndarray:
        return decode_vector(self.data)


@dataclass(frozen=True)
class InlinePolicy:
    """What a server takes in steer_vector: the model's hidden size, and the layers tapped for inline vectors."""

    hidden: int
    layers: Tuple[int, ...]


@dataclass(frozen=True)
class SteerArgs:
    names: Tuple[str, ...]  # presets, composed in this order
    scale: float = 1.0
    inline: Tuple[InlineVector, ...] = ()  # added after the presets' edits, in this order
    when: Optional[InlineWhen] = None  # gates the inline vectors


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_steer(body: Dict[str, Any], known: Collection[str], max_scale: float, where: str = "",
                inline: Optional[InlinePolicy] = None) -> Optional[SteerArgs]:
    """The steer arguments of a request body (a JSON object), or None when it asks for no steering. Raises
    RequestError naming the field (prefixed by `where`, e.g. "requests[0].") for anything it cannot serve;
    `inline` None: this server takes no steer_vector."""
    for key in body:
        if isinstance(key, str) and key.lower().startswith("steer"):
            raise RequestError(f"{where}{key}", "steering goes in vllm_xargs (extra_body={'vllm_xargs': "
                                                "{'steer': ...}}), not at the top level of the request")
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return None
    if not isinstance(xargs, dict):
        raise RequestError(f"{where}vllm_xargs", f"must be an object, got {json_type(xargs)}")
    for key in xargs:
        if key.lower().startswith("steer") and key not in STEER_KEYS:  # "Steer_scale" too: a typo, not ignored
            raise RequestError(f"{where}vllm_xargs.{key}", f"unknown steer argument {key!r}; this server takes "
                                                           f"{', '.join(STEER_KEYS)}")
    vectors = _inline(xargs, inline, max_scale, f"{where}vllm_xargs.")
    when = _when(xargs.get("steer_when"), inline, bool(vectors), f"{where}vllm_xargs.steer_when")
    steer = xargs.get("steer")
    if steer is None:
        if "steer_scale" in xargs:
            raise RequestError(f"{where}vllm_xargs.steer_scale", "steer_scale without steer: name the preset(s) "
                                                                 "to scale")
        return SteerArgs((), 1.0, vectors, when) if vectors else None
    param = f"{where}vllm_xargs.steer"
    if not isinstance(steer, str):
        raise RequestError(param, f"must be a string of preset names (comma-separated), got {json_type(steer)}")
    names = tuple(n.strip() for n in steer.split(","))
    for n in names:
        if not n:
            raise RequestError(param, f"{steer!r} has an empty preset name")
        if n not in known:
            raise RequestError(param, f"unknown preset {n!r}; presets on this server: {sorted(known)} "
                                      "(GET /v1/steer/presets)")
    if len(set(names)) != len(names):
        raise RequestError(param, f"{steer!r} names a preset twice; use steer_scale to strengthen one")
    scale = xargs.get("steer_scale", 1.0)
    param = f"{where}vllm_xargs.steer_scale"
    if not is_number(scale):
        raise RequestError(param, f"must be a number, got {json_type(scale)}")
    scale = _float(scale)
    if not math.isfinite(scale):
        raise RequestError(param, f"must be finite, got {scale}")
    if abs(scale) > max_scale:
        raise RequestError(param, f"{scale:g} is beyond this server's limit of {max_scale:g} "
                                  "(serve.max_steer_scale)")
    return SteerArgs(names, scale, vectors, when)


def _when(w: Any, policy: Optional[InlinePolicy], vectors: bool, param: str) -> Optional[InlineWhen]:
    """The request's steer_when, checked (None when it sends none)."""
    if w is None:
        return None
    if not vectors:
        raise RequestError(param, "steer_when without steer_vector: it gates the request's own vectors")
    if not isinstance(w, dict):
        raise RequestError(param, f"must be an object with vector, layer and threshold, got {json_type(w)}")
    for key in w:
        if key not in WHEN_KEYS:
            raise RequestError(f"{param}.{key}", f"unknown key; steer_when takes {', '.join(WHEN_KEYS)}")
    for key in ("vector", "layer", "threshold"):
        if key not in w:
            raise RequestError(f"{param}.{key}", "is required")
    if not isinstance(w["vector"], str):
        raise RequestError(f"{param}.vector", f"must be a base64 string (little-endian float32), got "
                                              f"{json_type(w['vector'])}")
    _check_vector(w["vector"], policy.hidden, f"{param}.vector")
    if not is_int(w["layer"]) or w["layer"] not in policy.layers:
        raise RequestError(f"{param}.layer", f"must be a layer this server taps for inline vectors, one of "
                                             f"{list(policy.layers)} (serve.inline_layers); got "
                                             f"{json_type(w['layer'])}")
    t = w["threshold"]
    if not is_number(t) or not -1.0 <= _float(t) <= 1.0:
        raise RequestError(f"{param}.threshold", f"must be a number in [-1, 1] (both scores are cosines), got "
                                                 f"{json_type(t)}")
    choice = {}
    for key, allowed in WHEN_KEYS.items():
        if allowed is not None and key in w:
            if w[key] not in allowed:
                raise RequestError(f"{param}.{key}", f"must be one of {', '.join(allowed)}, got {json_type(w[key])}")
            choice[key] = w[key]
    return InlineWhen(int(w["layer"]), w["vector"], _float(t), **choice)


def _inline(xargs: Dict[str, Any], policy: Optional[InlinePolicy], max_scale: float,
            where: str) -> Tuple[InlineVector, ...]:
    """The request's steer_vector / steer_layer / steer_strength, checked (empty when it sends none)."""
    data = xargs.get("steer_vector")
    if data is None:
        for key in ("steer_layer", "steer_strength", "steer_tokens"):
            if xargs.get(key) is not None:
                raise RequestError(f"{where}{key}", f"{key} without steer_vector: send the vector(s) it is for")
        return ()
    param = f"{where}steer_vector"
    if policy is None or not policy.layers:
        raise RequestError(param, "this server takes no inline vectors: start it with serve.inline_layers=[...] "
                                  "(the layers a request's vector may be added at)")
    if isinstance(data, str):
        data = [data]
    if not isinstance(data, list) or not data or not all(isinstance(d, str) for d in data):
        raise RequestError(param, "must be a base64 string (little-endian float32) or a non-empty list of them")
    if len(data) > MAX_INLINE:
        raise RequestError(param, f"{len(data)} vectors in one request; at most {MAX_INLINE}")
    values = [_check_vector(d, policy.hidden, f"{param}[{i}]" if len(data) > 1 else param)
              for i, d in enumerate(data)]
    layers = _per_vector(xargs.get("steer_layer"), len(data), f"{where}steer_layer", None, is_int, "an integer",
                         int)
    for i, layer in enumerate(layers):
        if layer not in policy.layers:
            raise RequestError(_item(xargs, where, "steer_layer", i), f"layer {layer} is not tapped for inline "
                               f"vectors on this server; it takes {list(policy.layers)} (serve.inline_layers)")
    strengths = _per_vector(xargs.get("steer_strength"), len(data), f"{where}steer_strength", 1.0, is_number,
                            "a number", _float)
    tokens = _per_vector(xargs.get("steer_tokens"), len(data), f"{where}steer_tokens", "both",
                         lambda t: t in TOKENS, f"one of {', '.join(TOKENS)}", str)
    for i, (w, v) in enumerate(zip(strengths, values)):
        at = _item(xargs, where, "steer_strength", i)
        if not math.isfinite(w):
            raise RequestError(at, f"must be finite, got {w}")
        if abs(w) > max_scale:
            raise RequestError(at, f"{w:g} is beyond this server's limit of {max_scale:g} (serve.max_steer_scale)")
        push = abs(w) * float(np.abs(v).max())
        if push > MAX_PUSH:  # past this, a half-precision stream overflows to inf
            raise RequestError(at, f"adds values up to {push:.3g} to the residual stream (strength times the "
                                   f"vector's largest value); at most {MAX_PUSH:g}")
    _check_sums(layers, strengths, values, tokens, f"{where}steer_vector")
    return tuple(InlineVector(layer, w, d, t) for layer, w, d, t in zip(layers, strengths, data, tokens))


def _check_sums(layers: List[int], strengths: List[float], values: List[np.ndarray], tokens: List[str],
                param: str) -> None:
    """Refuse vectors that pass MAX_PUSH one by one but not added together on one row at their layer (64 of 1e4
    each): a prompt row takes the `both` and `prompt` vectors, a generated row the `both` and `generated` ones."""
    sums: Dict[Tuple[int, str], np.ndarray] = {}
    for layer, w, v, t in zip(layers, strengths, values, tokens):
        for rows in (("prompt", "generated") if t == "both" else (t,)):
            sums[layer, rows] = sums.get((layer, rows), 0.0) + w * v.astype(np.float64)
    for (layer, _), total in sorted(sums.items()):
        push = float(np.abs(total).max())
        if push > MAX_PUSH:
            raise RequestError(param, f"the vectors at layer {layer} add values up to {push:.3g} to the residual "
                                      f"stream together (strength times vector, summed); at most {MAX_PUSH:g}")


def _check_vector(data: str, hidden: int, param: str) -> np.ndarray:
    """The vector a steer_vector string holds, or RequestError naming `param`."""
    if len(data) > 4 * (4 * hidden // 3 + 4):  # longer than hidden float32 values in base64: not decoded
        raise RequestError(param, f"is {len(data)} characters long; {hidden} float32 values in base64 take "
                                  f"{4 * ((4 * hidden + 2) // 3)}")
    try:
        v = decode_vector(data)
    except (binascii.Error, ValueError) as e:
        raise RequestError(param, f"is not base64 of float32 values ({e})") from None
    if v.shape[0] != hidden:
        raise RequestError(param, f"holds {v.shape[0]} float32 values; this model's hidden size is {hidden}")
    if not np.isfinite(v).all():
        raise RequestError(param, "holds a NaN or infinite value")
    return v


def _per_vector(x: Any, n: int, param: str, default: Any, ok, what: str, cast) -> List[Any]:
    """One value for every vector, or a list of one per vector (each `ok`, then `cast`)."""
    if x is None:
        if default is None:
            raise RequestError(param, f"is required with steer_vector: {what}, or a list of one per vector")
        return [default] * n
    listed = isinstance(x, list)
    if not listed:
        x = [x] * n
    elif len(x) != n:
        raise RequestError(param, f"has {len(x)} values for {n} vectors")
    for i, v in enumerate(x):
        if not ok(v):
            at = f"{param}[{i}]" if listed else param
            raise RequestError(at, f"must be {what} or a list of one per vector; got {json_type(v)}")
    return [cast(v) for v in x]


def _float(x) -> float:
    """A JSON number as a float; an integer too large for one is infinite (and refused as not finite)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _item(xargs: Dict[str, Any], where: str, key: str, i: int) -> str:
    """The field of vector i's value of `key`: `key[i]` where the request sent a list."""
    return f"{where}{key}" + (f"[{i}]" if isinstance(xargs.get(key), list) else "")


MAX_DEPTH = 100  # an OpenAI request nests a few levels (a tool's JSON schema, a dozen or so)


def read_body(raw: bytes) -> Any:
    """A request body parsed as JSON: ValueError where it is not JSON (each server answers that its own way),
    RequestError where it nests deeper than json.loads or MAX_DEPTH allows."""
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise RequestError(None, "the request body is nested too deeply to read") from e
    check_depth(data)
    return data


def check_depth(data: Any) -> None:
    """RequestError where the parsed body nests deeper than MAX_DEPTH (what reads it next recurses)."""
    level, depth = [data] if isinstance(data, (dict, list)) else [], 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise RequestError(None, f"the request body nests deeper than {MAX_DEPTH} levels")
        level = [v for node in level for v in (node.values() if isinstance(node, dict) else node)
                 if isinstance(v, (dict, list))]


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return f"the number {x!r}"[:80]
    if isinstance(x, str):
        return f"the string {x!r}"[:80]
    if isinstance(x, list):
        return "an array"
    if isinstance(x, dict):
        return "an object"
    return type(x).__name__


def plain_chat_template(tokenizer) -> str:
    """The chat template of a tokenizer that has none: the messages' contents joined by newlines, after the special
    tokens the tokenizer itself puts in front of a text (a BOS). So a single user message is fed exactly as
    `python -m steer` feeds that prompt raw. Both engines use it (engine=vllm as vLLM's --chat-template)."""
    with_special = list(tokenizer("a")["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    lead = with_special[: len(with_special) - len(plain)] if with_special[len(with_special) - len(plain):] == plain \
        else []
    prefix = "".join(tokenizer.convert_ids_to_tokens(lead))
    quoted = prefix.replace("\\", "\\\\").replace("'", "\\'")
    return ("{{ '" + quoted + "' }}{% for m in messages %}{{ m['content'] }}{% if not loop.last %}{{ '\\n' }}"
            "{% endif %}{% endfor %}")
