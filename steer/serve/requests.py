"""engine=hf: OpenAI completion and chat completion request bodies, checked field by field into a `GenRequest`.

Only what the HF engine serves is accepted: model, prompt / messages, max_tokens (max_completion_tokens), temperature,
top_p, seed, n=1, stop, stream (stream_options.include_usage), user, and the steer arguments (steer.serve.protocol).
A field it cannot honour (logprobs, penalties, tools, ...) is refused by name rather than ignored; other unknown
fields are ignored, as vLLM does.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from steer.serve.protocol import InlinePolicy, RequestError, SteerArgs, is_int, is_number, parse_steer

# Fields the HF engine cannot honour, with the values that mean "not asked for".
_UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "use_beam_search": (None, False), "prompt_logprobs": (None,),
}
MAX_PROMPTS = 64
MAX_STOPS = 4
MAX_SEED = 2 ** 63 - 1


@dataclass
class GenRequest:
    model: str
    prompts: List[Union[str, List[int]]]  # completions: texts or token ids; chat: one entry, the messages' text
    messages: Optional[List[Dict[str, str]]]  # chat: role/content pairs, contents as text
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: List[str]
    stream: bool
    include_usage: bool
    steer: Optional[SteerArgs]


def completion(body: Any, presets, max_scale: float, inline: Optional[InlinePolicy] = None) -> GenRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(is_int(t) for t in p)
                                                     for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise RequestError("prompt", "must be a string, a list of strings, a list of token ids or a list of such "
                                     "lists (none empty)")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError("prompt", f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            _text(p, f"prompt[{i}]" if isinstance(prompt, list) else "prompt")
    return _common(body, prompts, None, 16, presets, max_scale, inline=inline)


def chat(body: Any, presets, max_scale: float, default_max_tokens: int,
         inline: Optional[InlinePolicy] = None) -> GenRequest:
    body = _object(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role", "must be a non-empty string")
        _text(role, f"messages[{i}].role")
        out.append({"role": role, "content": _text(_content(m.get("content"), f"messages[{i}].content"),
                                                   f"messages[{i}].content")})
    field = "max_tokens"
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        field, body = "max_completion_tokens", dict(body, max_tokens=body["max_completion_tokens"])
    return _common(body, [""], out, default_max_tokens, presets, max_scale, max_tokens_field=field,
                   inline=inline)


def _content(c: Any, param: str) -> str:
    """A message's content as text: a string, or the text parts of a list, joined by newlines (as vLLM does)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{param}[{j}]", "only text parts ({type: text, text: ...}) are served")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(param, "must be a string or a list of text parts")


def _common(body: Dict[str, Any], prompts, messages, default_max_tokens: int, presets, max_scale: float,
            max_tokens_field: str = "max_tokens", inline: Optional[InlinePolicy] = None) -> GenRequest:
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("model", "must be a string (GET /v1/models lists this server's)")
    _refuse_unsupported(body, completions=messages is None)
    max_tokens = _max_tokens(body, default_max_tokens, max_tokens_field)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p", "must be a number in (0, 1]")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise RequestError("seed", f"must be an integer in [0, {MAX_SEED}]")
    stops = _stops(body.get("stop"))
    stream, include_usage = _streaming(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("user", "must be a string")
    steer = parse_steer(body, presets, max_scale, inline=inline)
    return GenRequest(model, prompts, messages, max_tokens, temperature, top_p, seed, stops, stream,
                      include_usage, steer)


def _refuse_unsupported(body: Dict[str, Any], completions: bool) -> None:
    """Refuse by name what the HF engine cannot honour, rather than silently ignore it."""
    for key, ok in _UNSUPPORTED.items():
        if key not in body:
            continue
        x = body[key]
        # completions' logprobs=0 asks for the sampled token's log-prob (vLLM gives it), and 0 == False; chat's
        # logprobs is a flag, 0 its false
        if x not in ok or (completions and key == "logprobs" and x == 0 and x is not False):
            raise RequestError(key, "is not served by the hf engine (engine=vllm serves vLLM's full API)")
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise RequestError("n", "the hf engine serves n=1 only")


def _max_tokens(body: Dict[str, Any], default: int, field: str) -> int:
    # `field` is the name the client used (chat's max_completion_tokens arrives as max_tokens), so errors cite it.
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        return int(default)
    if not is_int(max_tokens) or max_tokens < 1:
        raise RequestError(field, "must be an integer >= 1")
    return int(max_tokens)


def _stops(stop: Any) -> List[str]:
    """OpenAI's `stop` as a list of non-empty strings."""
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = list(stop)
    else:
        raise RequestError("stop", f"must be a string or a list of at most {MAX_STOPS} strings")
    return [_text(s, "stop") for s in stops if s]


def _text(s: str, param: str) -> str:
    """`s`, where it is text the tokenizer can take: JSON's escapes can spell a lone UTF-16 surrogate (\\ud800),
    which no UTF-8 holds."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(param, f"holds {s[e.start]!r} at {e.start}, a lone UTF-16 surrogate: not text") from None
    return s


def _streaming(body: Dict[str, Any]) -> Tuple[bool, bool]:
    """(stream, stream_options.include_usage), both False when not given."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream", "must be a boolean")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("stream_options", "must be an object")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise RequestError("stream_options.include_usage", "must be a boolean")
    return stream, include_usage


def _object(body: Any) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    return body


def _number(body: Dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    x = body.get(key)
    if x is None:
        return default
    if not is_number(x) or not math.isfinite(float(x)) or not lo <= float(x) <= hi:
        raise RequestError(key, f"must be a number in [{lo:g}, {hi:g}]")
    return float(x)
