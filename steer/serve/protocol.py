"""What both servers read from a request beyond OpenAI's own fields: the steer arguments, checked, and the errors
they answer with.

A request steers by name: `vllm_xargs={"steer": "joy", "steer_scale": 1.5}` (the openai client's
`extra_body={"vllm_xargs": ...}` lands at the top level of the JSON body). `steer` is one preset name or several,
comma-separated, composed in that order; `steer_scale` (default 1) multiplies every edit's strength. Requests
carry names and numbers only: nothing in one can name a file, a module or code. Anything else whose key starts
with `steer` is refused, so a typo never silently serves an unsteered answer.
"""

import math
from dataclasses import dataclass
from typing import Any, Collection, Dict, Optional, Tuple

STEER_KEYS = ("steer", "steer_scale")


class RequestError(Exception):
    """A request the server refuses: an OpenAI-style error body naming the field (`param`) at fault."""

    def __init__(self, param: Optional[str], message: str, status: int = 400, kind: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.param, self.message, self.status, self.kind, self.code = param, message, status, kind, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SteerArgs:
    names: Tuple[str, ...]  # presets, composed in this order
    scale: float = 1.0


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_steer(body: Dict[str, Any], known: Collection[str], max_scale: float,
                where: str = "") -> Optional[SteerArgs]:
    """The steer arguments of a request body (a JSON object), or None when it asks for no steering. Raises
    RequestError naming the field (prefixed by `where`, e.g. "requests[0].") for anything it cannot serve."""
    for key in body:
        if isinstance(key, str) and key.lower().startswith("steer"):
            raise RequestError(f"{where}{key}", "steering goes in vllm_xargs (extra_body={'vllm_xargs': "
                                                "{'steer': ...}}), not at the top level of the request")
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return None
    if not isinstance(xargs, dict):
        raise RequestError(f"{where}vllm_xargs", f"must be an object, got {_json_type(xargs)}")
    for key in xargs:
        if key.lower().startswith("steer") and key not in STEER_KEYS:  # "Steer_scale" too: a typo, not ignored
            raise RequestError(f"{where}vllm_xargs.{key}", f"unknown steer argument {key!r}; this server takes "
                                                           f"{' and '.join(STEER_KEYS)}")
    steer = xargs.get("steer")
    if steer is None:
        if xargs.get("steer_scale") is not None:
            raise RequestError(f"{where}vllm_xargs.steer_scale", "steer_scale without steer: name the preset(s) "
                                                                 "to scale")
        return None
    param = f"{where}vllm_xargs.steer"
    if not isinstance(steer, str):
        raise RequestError(param, f"must be a string of preset names (comma-separated), got {_json_type(steer)}")
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
    if scale is None:
        scale = 1.0
    param = f"{where}vllm_xargs.steer_scale"
    if not is_number(scale):
        raise RequestError(param, f"must be a number, got {_json_type(scale)}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise RequestError(param, f"must be finite, got {scale}")
    if abs(scale) > max_scale:
        raise RequestError(param, f"{scale:g} is beyond this server's limit of {max_scale:g} "
                                  "(serve.max_steer_scale)")
    return SteerArgs(names, scale)


def _json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return f"the number {x!r}"
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
