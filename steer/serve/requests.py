"""engine=hf: OpenAI completion and chat completion request bodies, validated by pydantic models into a `GenRequest`.

Only what the HF engine serves is accepted: model, prompt / messages, max_tokens (max_completion_tokens), temperature,
top_p, seed, n=1, stop, stream (stream_options.include_usage), user, and the steer arguments (steer.serve.protocol).
A field it cannot honour (logprobs, penalties, tools, ...) is refused by name rather than ignored; other unknown
fields are ignored, as vLLM does. A refusal is a RequestError naming the field as the client wrote it
(`messages[0].role`, `prompt[1]`).
"""

from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from steer.serve.protocol import InlinePolicy, RequestError, SteerArgs, is_int, json_type, parse_steer

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

# What a field must be, as a refusal says it (by the field's path, list indices as `*`), for pydantic's own checks
_MUST = {
    "model": "a string (GET /v1/models lists this server's)",
    "max_tokens": "an integer >= 1", "max_completion_tokens": "an integer >= 1",
    "temperature": "a number in [0, 2]", "top_p": "a number in (0, 1]",
    "seed": f"an integer in [0, {MAX_SEED}]", "n": "1 (the hf engine serves n=1 only)",
    "stream": "a boolean", "stream_options": "an object", "stream_options.include_usage": "a boolean",
    "user": "a string",
    "messages": "a non-empty list of {role, content} objects",
    "messages.*": "an object with role and content", "messages.*.role": "a non-empty string",
    "messages.*.content": "a string or a list of text parts",
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
}


def _refuse(message: str, at: Optional[str] = None) -> PydanticCustomError:
    """A refusal with its own message; `at`: the field it names, where that is deeper than the validated one."""
    return PydanticCustomError("steer_request", message, {"at": at} if at else None)


def _text(s: str, at: Optional[str] = None) -> str:
    """`s`, where it is text the tokenizer can take: JSON's escapes can spell a lone UTF-16 surrogate (\\ud800),
    which no UTF-8 holds."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _refuse(f"holds {s[e.start]!r} at {e.start}, a lone UTF-16 surrogate: not text", at) from None
    return s


Text = Annotated[StrictStr, AfterValidator(_text)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an int or a float; no bool, string, NaN


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM does


class StreamOptions(_Open):
    include_usage: StrictBool = False


class _Body(_Open):
    """The fields completions and chat completions share."""

    model: Text
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    temperature: Optional[Annotated[Number, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[Number, Field(gt=0, le=1)]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_SEED)]] = None
    n: Optional[Annotated[StrictInt, Field(ge=1, le=1)]] = None
    stop: Any = Field(None, validate_default=True)  # None too becomes a list
    stream: Optional[StrictBool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[Text] = None

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: Any) -> Any:
        """Refuse by name what the HF engine cannot honour, rather than silently ignore it."""
        if not isinstance(body, dict):
            raise _refuse("the request body must be a JSON object")
        for key, ok in _UNSUPPORTED.items():
            if key not in body:
                continue
            x = body[key]
            # completions' logprobs=0 asks for the sampled token's log-prob (vLLM gives it), and 0 == False; chat's
            # logprobs is a flag, 0 its false
            if x not in ok or (issubclass(cls, Completion) and key == "logprobs" and x == 0 and x is not False):
                raise _refuse("is not served by the hf engine (engine=vllm serves vLLM's full API)", key)
        return body

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: Any) -> List[str]:
        """OpenAI's `stop` as a list of non-empty strings."""
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
            stops = list(stop)
        else:
            raise _refuse(f"must be a string or a list of at most {MAX_STOPS} strings")
        return [_text(s) for s in stops if s]


class Completion(_Body):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> List[Union[str, List[int]]]:
        """Texts or token ids: a string, a list of strings, a list of token ids or a list of such lists."""
        if isinstance(prompt, str) and prompt:
            return [_text(prompt)]
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
            prompts = [_text(p, f"[{i}]") for i, p in enumerate(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(is_int(t) for t in p)
                                                         for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise _refuse("must be a string, a list of strings, a list of token ids or a list of such lists (none "
                          "empty)")
        if len(prompts) > MAX_PROMPTS:
            raise _refuse(f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}")
        return prompts


class Message(_Open):
    role: Annotated[Text, Field(min_length=1)]
    content: Any

    @field_validator("content")
    @classmethod
    def _content(cls, c: Any) -> str:
        """A message's content as text: a string, or the text parts of a list, joined by newlines (as vLLM does)."""
        if isinstance(c, str):
            return _text(c)
        if isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _refuse("only text parts ({type: text, text: ...}) are served", f"[{j}]")
            return _text("\n".join(part["text"] for part in c))
        raise _refuse("must be a string or a list of text parts")


class Chat(_Body):
    messages: Annotated[List[Message], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None


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
    req = _validate(Completion, body)
    return _request(req, body, req.prompt, None, req.max_tokens or 16, presets, max_scale, inline)


def chat(body: Any, presets, max_scale: float, default_max_tokens: int,
         inline: Optional[InlinePolicy] = None) -> GenRequest:
    req = _validate(Chat, body)
    messages = [{"role": m.role, "content": m.content} for m in req.messages]
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    return _request(req, body, [""], messages, max_tokens or default_max_tokens, presets, max_scale, inline)


def _request(req: _Body, body: Dict[str, Any], prompts, messages, max_tokens: int, presets, max_scale: float,
             inline: Optional[InlinePolicy]) -> GenRequest:
    opts = req.stream_options
    return GenRequest(req.model, prompts, messages, max_tokens, 1.0 if req.temperature is None else req.temperature,
                      1.0 if req.top_p is None else req.top_p, req.seed, req.stop, bool(req.stream),
                      bool(opts and opts.include_usage), parse_steer(body, presets, max_scale, inline=inline))


def _validate(model, body: Any):
    """`body` as the pydantic `model`, or a RequestError naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _request_error(e.errors()[0]) from None


def _request_error(err: Dict[str, Any]) -> RequestError:
    """A pydantic error as a RequestError: the field as the client wrote it, and what it must be."""
    loc = list(err["loc"])  # () for the body itself
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if err["type"] == "steer_request":
        at = (err.get("ctx") or {}).get("at")
        if at:  # an index within the validated field ("[1]"), or another field the body names ("logprobs")
            param = f"{param or ''}{at}" if at.startswith("[") else at
        return RequestError(param, err["msg"])
    if err["type"] == "missing":
        return RequestError(param, f"is required ({_must(loc)})")
    return RequestError(param, f"must be {_must(loc)}, got {json_type(err['input'])}")


def _must(loc: List[Any]) -> str:
    return _MUST.get(".".join("*" if isinstance(p, int) else str(p) for p in loc), "of another type")
