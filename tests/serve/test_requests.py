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
