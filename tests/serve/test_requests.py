"""steer/serve/requests.py on its own: what a request body may hold, without a server."""

import pytest

from steer.serve.protocol import RequestError
from steer.serve.requests import chat, completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_logprobs_zero_asks_for_a_log_prob_in_a_completion_but_is_false_in_a_chat():
    with pytest.raises(RequestError) as e:
        completion({"model": "m", "prompt": "x", "logprobs": 0}, (), 10.0)
    assert e.value.param == "logprobs"
    for off in (0, False, None):  # chat's logprobs is a flag
        assert chat({**CHAT, "logprobs": off}, (), 10.0, 16).messages[0]["content"] == "hi"
    with pytest.raises(RequestError):
        chat({**CHAT, "logprobs": True}, (), 10.0, 16)


@pytest.mark.parametrize("body,param", [({"model": "m", "prompt": "\ud800abc"}, "prompt"),
                                        ({"model": "m", "prompt": ["ok", "x\udfff"]}, "prompt[1]"),
                                        ({"model": "m", "prompt": "ok", "stop": ["\ud800"]}, "stop")])
def test_a_lone_surrogate_is_no_text(body, param):
    with pytest.raises(RequestError, match="lone UTF-16 surrogate") as e:
        completion(body, (), 10.0)
    assert e.value.param == param


OK = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "x"}, "model", "is required (a string"),
    ({**OK, "model": 3}, "model", "must be a string (GET /v1/models lists this server's), got the number 3"),
    ({**OK, "model": "m\ud800"}, "model", "holds '\\ud800' at 1, a lone UTF-16 surrogate"),  # echoed in errors: text
    ({**OK, "temperature": 10 ** 400}, "temperature", "must be a number in [0, 2], got the number 1000"),
    ({**OK, "max_tokens": "ten"}, "max_tokens", "must be an integer >= 1, got the string 'ten'"),
    ({**OK, "max_tokens": True}, "max_tokens", "must be an integer >= 1, got a boolean"),
    ({**OK, "temperature": float("nan")}, "temperature", "must be a number in [0, 2], got the number nan"),
    ({**OK, "top_p": 0}, "top_p", "must be a number in (0, 1], got the number 0"),
    ({**OK, "seed": 2 ** 63}, "seed", "must be an integer in [0, 9223372036854775807]"),
    ({**OK, "n": 2}, "n", "must be 1 (the hf engine serves n=1 only), got the number 2"),
    ({**OK, "stop": ["a"] * 5}, "stop", "must be a string or a list of at most 4 strings"),
    ({**OK, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "must be a boolean, got the number 1"),
    ({**OK, "echo": True}, "echo", "is not served by the hf engine"),
    ({**OK, "prompt": ["a"] * 65}, "prompt", "65 prompts in one request; at most 64"),
    ([OK], None, "the request body must be a JSON object"),
])
def test_a_bad_completion_names_its_field_and_what_it_must_be(body, param, message):
    with pytest.raises(RequestError) as e:
        completion(body, (), 10.0)
    assert (e.value.param, e.value.message[:len(message)]) == (param, message)


@pytest.mark.parametrize("messages,param,message", [
    ([], "messages", "must be a non-empty list of {role, content} objects, got an array"),
    (["x"], "messages[0]", "must be an object with role and content, got the string 'x'"),
    ([CHAT["messages"][0], {"role": "", "content": "x"}], "messages[1].role", "must be a non-empty string"),
    ([{"role": "user"}], "messages[0].content", "is required (a string or a list of text parts)"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}], "messages[0].content[1]",
     "only text parts"),
])
def test_a_bad_chat_message_names_its_place_in_the_list(messages, param, message):
    with pytest.raises(RequestError) as e:
        chat({**CHAT, "messages": messages}, (), 10.0, 16)
    assert (e.value.param, e.value.message[:len(message)]) == (param, message)


def test_a_served_request_has_openais_defaults_and_its_own_settings():
    req = completion(OK, (), 10.0)
    assert (req.prompts, req.max_tokens, req.temperature, req.top_p, req.seed, req.stop, req.stream,
            req.include_usage, req.steer) == (["hi"], 16, 1.0, 1.0, None, [], False, False, None)
    req = completion({**OK, "prompt": [[1, 2], [3]], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 7,
                      "stop": ["a", ""], "stream": True, "stream_options": {"include_usage": True}, "n": 1,
                      "vllm_xargs": {"steer": "joy", "steer_scale": 2}, "unknown_field": 1}, ("joy",), 10.0)
    assert (req.prompts, req.max_tokens, req.temperature, req.top_p, req.seed, req.stop, req.stream,
            req.include_usage, req.steer.names, req.steer.scale) == ([[1, 2], [3]], 5, 0.0, 0.5, 7, ["a"], True, True,
                                                                     ("joy",), 2.0)
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat({**CHAT, "messages": [{"role": "user", "content": content}], "max_completion_tokens": 9}, (), 10.0, 16)
    assert (req.messages, req.max_tokens) == ([{"role": "user", "content": "a\nb"}], 9)
    assert chat(CHAT, (), 10.0, 256).max_tokens == 256  # the server's chat default
